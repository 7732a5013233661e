"""Measure training throughput: synchronised, warm-up excluded, no meter attached, interleaved when compared."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from labkit.device import synchronize
from labkit.meter import active_meter
from labkit.validate import check_int


def timed_call(fn: Callable[[], object], *devices) -> float:
    """Return the seconds `fn()` takes, each device given (a name or torch.device) synchronised before and after it."""
    devices = [torch.device(d) for d in devices]
    for d in devices:
        synchronize(d)
    t0 = time.perf_counter()
    fn()
    for d in devices:
        synchronize(d)
    return time.perf_counter() - t0


def fastest_s(fn: Callable[[], object], repeats: int, *devices) -> float:
    """Return the fastest of `repeats` timed calls of `fn` (timed_call) after one untimed warm-up call."""
    check_int("repeats", repeats, 1)
    timed_call(fn, *devices)
    return min(timed_call(fn, *devices) for _ in range(repeats))


@dataclass(frozen=True)
class Throughput:
    """Timing of repeated steps (median step time)."""

    step_s: float  # median seconds per step
    samples_per_s: float  # samples per second at the median step time
    tokens_per_s: float | None  # tokens per second, when tokens_per_step was given
    steps: int  # timed steps (warm-up excluded)
    step_times_s: tuple  # every timed step, in order


def measure_throughput(step_fn, *, samples_per_step: int, tokens_per_step: int | None = None,
                       device: torch.device | str = "cpu", warmup_steps: int = 1, steps: int = 3) -> Throughput:
    """Time `step_fn()` over `steps` runs after `warmup_steps`, synchronising the device around each."""
    return measure_throughputs({"step": step_fn}, samples_per_step=samples_per_step, tokens_per_step=tokens_per_step,
                               device=device, warmup_steps=warmup_steps, steps=steps)["step"]


def measure_throughputs(step_fns: Mapping[str, Callable[[], object]], *, samples_per_step: int,
                        tokens_per_step: int | None = None, device: torch.device | str = "cpu",
                        warmup_steps: int = 1, steps: int = 3) -> dict[str, Throughput]:
    """Time several step functions in interleaved rounds, each starting one later; return each one's Throughput."""
    if active_meter() is not None:
        raise RuntimeError("measure_throughput must run outside a MemoryMeter (the meter slows every op)")
    check_int("steps", steps, 1)
    check_int("warmup_steps", warmup_steps, 0)
    check_int("samples_per_step", samples_per_step, 1)
    if not step_fns:
        raise ValueError("step_fns is empty: give at least one step function to time")
    device = torch.device(device)
    for _ in range(warmup_steps):
        for fn in step_fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in step_fns}
    names = list(step_fns)
    for r in range(steps):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each round starts one later: no fixed places
            times[name].append(timed_call(step_fns[name], device))
    out = {}
    for name, ts in times.items():
        step_s = statistics.median(ts)
        assert step_s > 0, (name, ts)
        out[name] = Throughput(step_s, samples_per_step / step_s,
                               None if tokens_per_step is None else tokens_per_step / step_s, steps, tuple(ts))
    return out


ROUNDS_AGREE = 1.5  # paired rounds whose judged ratios span more than this factor disagree: the load moved them


@dataclass(frozen=True)
class PairedRatio:
    """One step function's time over another's, round by round, from the same interleaved rounds (chapter 00).

    A ratio is a finding only when its judged rounds (from five rounds on, all but the highest and the lowest)
    agree within ROUNDS_AGREE: `verdict` says slower, faster, not told apart, or unreliable.
    """

    median: float  # median over the rounds of the per-round ratio
    round_ratios: tuple  # every round's ratio, in order

    @property
    def rounds(self) -> int:
        """Return how many paired rounds the ratio rests on."""
        return len(self.round_ratios)

    def judged(self) -> tuple[float, float]:
        """Return the lowest and highest of the judged rounds (from five rounds on, all but the extremes)."""
        middle = sorted(self.round_ratios)[1:-1] if self.rounds >= 5 else sorted(self.round_ratios)
        return middle[0], middle[-1]

    def agrees(self, factor: float = ROUNDS_AGREE) -> bool:
        """Return whether at least three rounds lie within `factor` of each other (from five on, less the extremes)."""
        if self.rounds < 3:
            return False
        lo, hi = self.judged()
        return hi <= factor * lo

    def verdict(self, noise: tuple = (1.0, 1.0)) -> str:
        """Return "slower", "faster", "not told apart" or "unreliable" (fewer than three rounds, or they disagree).

        `noise`: the judged range of the baseline timed against itself; slower (faster) means every judged round
        lies above (below) both 1 and that range.
        """
        if not self.agrees():
            return "unreliable"
        lo, hi = self.judged()
        return "slower" if lo > max(1.0, noise[1]) else "faster" if hi < min(1.0, noise[0]) else "not told apart"

    def words(self, noise: tuple = (1.0, 1.0)) -> str:
        """Return the ratio, its judged rounds and its verdict, e.g. "× 1.21 (the middle 3 of 5 rounds: 1.15–1.27):
        slower in each of them"."""
        n, (lo, hi) = self.rounds, self.judged()
        which = f"the middle {n - 2} of {n} rounds" if n >= 5 else f"{n} round{'s' if n > 1 else ''}"
        verdict = self.verdict(noise)
        why = {"slower": "slower in each of them", "faster": "faster in each of them",
               "not told apart": "not told apart (the rounds lie within the timing's own noise or on both sides of 1)",
               "unreliable": "too few rounds to tell" if n < 3 else "unreliable: the rounds disagree"}[verdict]
        return f"× {self.median:.2f} ({which}: {lo:.2f}–{hi:.2f}): {why}"


def paired_ratio(timed: Mapping[str, Throughput], num: str, den: str) -> PairedRatio:
    """Return `num`'s step time over `den`'s, round by round, from one `measure_throughputs` result."""
    for name in (num, den):
        if name not in timed:
            raise KeyError(f"{name!r} was not timed: the timed step functions are {sorted(timed)}")
    ratios = tuple(a / b for a, b in zip(timed[num].step_times_s, timed[den].step_times_s))
    return PairedRatio(statistics.median(ratios), ratios)


_MOVED = {name: "labkit.hostlink" for name in ("copy_bandwidth", "CopyOverlap", "host_to_device_bandwidth",
                                                "copy_compute_overlap")}


def __getattr__(name: str):
    """Return a name moved to labkit.hostlink (chapter 04), with a DeprecationWarning: old imports still work."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    import warnings
    warnings.warn(f"labkit.throughput.{name} moved to {_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)  # (by name: labkit.hostlink imports this module)
