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
    """Time several step functions in interleaved rounds (one step of each per round); return each one's Throughput.

    Interleaving makes a load that drifts during the measurement slow every function alike, so
    the ratios of the medians stay meaningful on a shared machine; each round starts one function
    later than the last, so that no function always runs first (or right after another).
    """
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


@dataclass(frozen=True)
class PairedRatio:
    """One step function's time over another's, round by round, from the same interleaved rounds."""

    median: float  # median over the rounds of the per-round ratio
    lo: float  # smallest round's ratio
    hi: float  # largest round's ratio
    round_ratios: tuple  # every round's ratio, in order

    @property
    def rounds(self) -> int:
        """Return how many paired rounds the ratio rests on."""
        return len(self.round_ratios)

    def agrees(self, factor: float) -> bool:
        """Return whether the rounds lie within `factor` of each other (at least three; from five, less the extremes).

        From five rounds on, the highest and the lowest round are left out: one disturbed round, either way,
        cannot decide. Fewer than three rounds cannot show that they agree.
        """
        if self.rounds < 3:
            return False
        middle = sorted(self.round_ratios)[1:-1] if self.rounds >= 5 else sorted(self.round_ratios)
        return max(middle) <= factor * min(middle)


def paired_ratio(timed: Mapping[str, Throughput], num: str, den: str) -> PairedRatio:
    """Return `num`'s step time over `den`'s, round by round, from one `measure_throughputs` result."""
    for name in (num, den):
        if name not in timed:
            raise KeyError(f"{name!r} was not timed: the timed step functions are {sorted(timed)}")
    ratios = tuple(a / b for a, b in zip(timed[num].step_times_s, timed[den].step_times_s))
    return PairedRatio(statistics.median(ratios), min(ratios), max(ratios), ratios)
