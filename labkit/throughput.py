"""Measure training throughput: synchronised, warm-up excluded, no meter attached, interleaved when compared."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from labkit.device import as_device, synchronize
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


def copy_bandwidth(dst: torch.Tensor, src: torch.Tensor, repeats: int = 3) -> float:
    """Return the best bytes/s of `dst.copy_(src, non_blocking=True)` after a warm-up, both devices synchronised."""
    check_int("repeats", repeats, 1, 1000)
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"dst and src must have the same shape and dtype, got {tuple(dst.shape)} {dst.dtype} "
                         f"and {tuple(src.shape)} {src.dtype}")
    nbytes = src.numel() * src.element_size()
    if nbytes == 0:
        raise ValueError("src is empty: there is no copy to time")
    devices = {as_device(dst.device), as_device(src.device)}
    return nbytes / fastest_s(lambda: dst.copy_(src, non_blocking=True), repeats, *devices)


@dataclass(frozen=True)
class CopyOverlap:
    """Seconds of one host -> device copy from pinned memory and of a compute, alone and together (CUDA)."""

    nbytes: int  # bytes of the copy
    matmuls: int  # square matmuls in the compute (chosen so that it takes about as long as the copy)
    copy_s: float  # the copy alone
    compute_s: float  # the compute alone
    serial_s: float  # copy, then compute, on the current stream (stream order: the compute waits for the copy)
    overlapped_s: float  # copy on a side stream while the compute runs on the current stream
    issue_s: float  # host seconds until `copy_(pinned, non_blocking=True)` returned (the copy goes on)
    pageable_issue_s: float  # the same call from pageable memory: it returns once the driver has staged it all

    @property
    def hidden_fraction(self) -> float:
        """Return the share of the shorter of copy and compute the side stream hid (0: serial, 1: all), clipped."""
        hidden = self.copy_s + self.compute_s - self.overlapped_s
        return min(1.0, max(0.0, hidden / min(self.copy_s, self.compute_s)))


def _host_and_device_buffers(caller: str, device, nbytes: int, pinned: bool = True):
    """Check a CUDA copy benchmark's arguments; return its device, a filled host buffer of `nbytes` and a device one."""
    check_int("nbytes", nbytes, 4, 2**40)
    if not isinstance(pinned, bool):
        raise ValueError(f"pinned must be True or False, got {pinned!r}")
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        seen = "" if torch.cuda.is_available() else "; torch sees no CUDA device here"
        raise ValueError(f"{caller} needs a CUDA device (got {str(device)!r}{seen}): on a CPU-only machine there "
                         "is no host-to-device copy to overlap, and no pinned memory")
    dev = as_device(device)
    src = torch.empty(nbytes // 4, pin_memory=pinned).fill_(1.0)  # pinned: the copy engine reads it directly
    return dev, src, torch.empty(src.shape, device=dev)


def host_to_device_bandwidth(device, nbytes: int = 64 * 2**20, pinned: bool = True) -> float:
    """Return the best bytes/s of one host -> device copy of `nbytes` from pinned or pageable memory (CUDA only)."""
    _, src, dst = _host_and_device_buffers("host_to_device_bandwidth", device, nbytes, pinned)
    return copy_bandwidth(dst, src)


def copy_compute_overlap(device, nbytes: int = 64 * 2**20) -> CopyOverlap:
    """Time a pinned host -> device copy and 2048² matmuls as long: alone, serial and overlapped (CUDA only)."""
    repeats = 3  # each time the best of 3
    dev, src, dst = _host_and_device_buffers("copy_compute_overlap", device, nbytes)
    current = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    pageable = torch.ones(nbytes // 4)
    a = torch.randn(2048, 2048, device=dev)
    c = torch.empty_like(a)

    def issue_s(host) -> float:
        """Return the fastest host time for `dst.copy_(host, non_blocking=True)` to return (not to finish)."""
        out = math.inf
        for _ in range(repeats):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            dst.copy_(host, non_blocking=True)
            out = min(out, time.perf_counter() - t0)
            torch.cuda.synchronize(dev)
        return out

    def copy():
        dst.copy_(src, non_blocking=True)  # on the current stream

    one_matmul_s = fastest_s(lambda: torch.mm(a, a, out=c), repeats, dev)
    copy_s = fastest_s(copy, repeats, dev)
    matmuls = max(1, round(copy_s / one_matmul_s))

    def compute():
        for _ in range(matmuls):
            torch.mm(a, a, out=c)  # on the current stream

    def serial():
        copy()
        compute()  # same stream: runs after the copy, though it does not read dst

    def overlapped():
        side.wait_stream(current)  # dst is free: earlier work on the current stream is done with it
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)  # on the side stream: the copy engine runs it
        compute()  # on the current stream, meanwhile
        current.wait_stream(side)  # later work on the current stream sees the copied dst

    compute_s, serial_s, overlapped_s = (fastest_s(fn, repeats, dev) for fn in (compute, serial, overlapped))
    out = CopyOverlap(nbytes=src.numel() * 4, matmuls=matmuls, copy_s=copy_s, compute_s=compute_s, serial_s=serial_s,
                      overlapped_s=overlapped_s, issue_s=issue_s(src), pageable_issue_s=issue_s(pageable))
    torch.cuda.synchronize(dev)  # nothing queued still reads src or writes dst when they are freed
    return out
