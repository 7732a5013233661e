"""The host link (chapter 04): a copy's bandwidth, from pinned or pageable memory, and a copy overlapping compute."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from labkit.device import as_device
from labkit.throughput import fastest_s
from labkit.validate import check_int


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
