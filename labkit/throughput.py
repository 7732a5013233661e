"""Measure training throughput: synchronised, warm-up excluded, no meter attached."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from labkit.device import synchronize
from labkit.meter import active_meter


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
    if active_meter() is not None:
        raise RuntimeError("measure_throughput must run outside a MemoryMeter (the meter slows every op)")
    if steps < 1 or warmup_steps < 0 or samples_per_step < 1:
        raise ValueError("need steps >= 1, warmup_steps >= 0 and samples_per_step >= 1")
    device = torch.device(device)
    for _ in range(warmup_steps):
        step_fn()
    times = []
    for _ in range(steps):
        synchronize(device)
        t0 = time.perf_counter()
        step_fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    assert step_s > 0
    return Throughput(step_s, samples_per_step / step_s,
                      None if tokens_per_step is None else tokens_per_step / step_s, steps, tuple(times))
