"""Check parameters (a notebook's, a function's arguments) before any work starts; errors name the parameter and the range."""

from __future__ import annotations

import math



class ParameterError(ValueError):
    """A parameter is out of its allowed range."""


def check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    """Return `value` if it is an integer in [lo, hi]; raise ParameterError naming `name` otherwise."""
    rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParameterError(f"{name} must be an integer {rng}, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ParameterError(f"{name} must be an integer {rng}, got {value}")
    return value


def check_int_list(name: str, value, lo: int, hi: int | None = None, min_len: int = 1, max_len: int | None = None,
                   increasing: bool = False) -> list[int]:
    """Return `value` as a list of integers in [lo, hi]; raise ParameterError naming `name` otherwise."""
    size = f"{min_len} to {max_len}" if max_len is not None else f"at least {min_len}"
    order = ", strictly increasing" if increasing else ""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ParameterError(f"{name} must be a list of {size} integers{order}, got {value!r}")
    if len(value) < min_len or (max_len is not None and len(value) > max_len):
        raise ParameterError(f"{name} must be a list of {size} integers{order}, got {len(value)}: {list(value)!r}")
    for i, v in enumerate(value):
        check_int(f"{name}[{i}]", v, lo, hi)
    if increasing and any(a >= b for a, b in zip(value, value[1:])):
        raise ParameterError(f"{name} must be strictly increasing, got {list(value)!r}")
    return list(value)


def check_float(name: str, value, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> float:
    """Return `value` as float if it lies in the range; raise ParameterError naming `name` otherwise."""
    rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ParameterError(f"{name} must be a number in {rng}, got {value!r}")
    bad_lo = value <= lo if lo_open else value < lo
    bad_hi = value >= hi if hi_open else value > hi
    if bad_lo or bad_hi:
        raise ParameterError(f"{name} must be a number in {rng}, got {value}")
    return float(value)


def check_choice(name: str, value, choices) -> object:
    """Return `value` if it is one of `choices`; raise ParameterError naming `name` otherwise."""
    if value not in tuple(choices):
        raise ParameterError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_divides(name: str, value: int, divisor_name: str, divisor: int) -> None:
    """Raise ParameterError unless `divisor` divides `value` (e.g. N_EMBD by N_HEAD)."""
    if value % divisor:
        raise ParameterError(f"{name} ({value}) must be divisible by {divisor_name} ({divisor})")


def check_budget(name: str, value, unit: str = "bytes") -> float | None:
    """Return a memory budget (None: no budget); raise ParameterError unless it is None or > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
        raise ParameterError(f"{name} must be None or a positive number of {unit}, got {value!r}")
    return value
