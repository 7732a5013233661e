"""The host tier: host memory for what does not stay on the device, and the one pair of copies to and from it.

Activation offload (notebook 04, `labkit.offload`) and layer-to-layer training (05, `labkit.l2l`)
keep tensors in host memory and copy them to and from the device; both make that host memory
and those copies here. (Chapter 07's CPU-resident shards and optimizer state are FSDP2's own,
`torch.distributed.fsdp.CPUOffloadPolicy`, and DeepSpeed's `offload_optimizer`: not this module.)

    to_host(t, pool=None, stream=None)             # a new host-tier tensor with t's values
    to_device(h, device, pool=None, stream=None)   # a new device tensor with h's values
    pin(t)                                         # a pinned (page-locked) copy of a CPU tensor (CUDA only)
    host_tier()                                    # a context: new storages count as host memory
    HostPool(device, kind="auto")                  # accounted host buffers: pinned, memory or disk
    mark_host_state(meter, model, optimizer)       # count a host-resident model and its state as host
    copy_bandwidth(dst, src)                       # best bytes/s of dst.copy_(src) (any devices)
    host_to_device_bandwidth(device, nbytes, pinned)  # CUDA: from pinned or pageable host memory
    copy_compute_overlap(device, nbytes)           # CUDA: a host->device copy alone, after compute, beside it

What the copies mean, on every device:
- Each returns a **new** tensor with the source's values, shape and dense strides (the strides
  `torch.empty_like` keeps: the source's own when it is dense, contiguous otherwise), so a
  tensor that goes out and comes back has the layout it had. On a CPU-only machine
  `t.to("cpu")` would return `t` itself and move nothing; these functions always copy.
- A copy between pinned host memory and a CUDA device is **asynchronous** (`non_blocking=True`):
  later work on the same stream sees it in order, but the CPU must synchronise
  (`labkit.synchronize(device)`, or wait on an event) before it reads a host tensor that
  `to_host` returned. Every other copy (all of them on a CPU-only machine) is synchronous.
- With `stream=` (CUDA) the copy runs on that side stream after it has waited for the current
  stream; the new tensor is allocated on the current stream, so the current stream must wait on
  an event recorded after the copy before it uses the result (`torch.cuda.current_stream()
  .wait_event(...)`). `to_host` also calls `t.record_stream(stream)`, so the allocator does not
  hand `t`'s memory to another tensor before the copy has read it.
- With `pool=` the host buffer comes from that `HostPool` (pinned, accounted RAM or a disk
  memmap) and the pool counts the bytes moved; without one, `to_host` allocates pinned memory
  when `t` is on CUDA and ordinary CPU memory otherwise.

Under an active `MemoryMeter`, host buffers are counted on its host tier
(`meter.host_current_bytes`, `host_peak_bytes`), never against its device budget.

The pool's kinds:

    kind      buffer                                   used for
    "pinned"  page-locked CPU memory (CUDA only)       "auto" on CUDA: real host memory, async copies
    "memory"  an ordinary CPU tensor, counted as host   "auto" on CPU: an accounted host pool
    "disk"    a file-backed memmap (torch.from_file)    like ZeRO-Infinity's NVMe offload

A pool buffer is freed (and its spill file deleted) when the last reference to it goes, so
nothing accumulates across steps; `pool.close()` (or `with HostPool(...)`) removes the spill folder.

Pinned memory and `non_blocking` (what `DataLoader(pin_memory=True)` and `batch.to(device,
non_blocking=True)` rely on), measured by `copy_bandwidth` and `copy_compute_overlap`:
- A GPU copies to or from host memory by DMA, which needs page-locked ("pinned") pages. From
  ordinary (pageable) memory the driver goes through a pinned staging buffer of its own, and the
  CPU waits, whatever `non_blocking` says: host to device until the whole buffer is staged,
  device to host until the copy is done.
- From pinned memory, `non_blocking=True` only enqueues the copy: the call returns at once. On
  its stream the copy still runs in order, so the next kernel on the same stream waits for it; a
  copy overlaps compute only when it runs on another stream (a side stream, as offload does).
- On a CPU-only machine there is no DMA transfer and no copy engine: pinning needs an accelerator
  (`torch.empty(..., pin_memory=True)` raises, `DataLoader(pin_memory=True)` warns and does not pin).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from labkit.device import as_device
from labkit.meter import MemoryMeter, active_meter
from labkit.throughput import fastest_s
from labkit.validate import check_choice, check_int

HOST_KINDS = ("auto", "pinned", "memory", "disk")


def host_tier():
    """Return a context in which new storages count as host memory in the active meter (no-op without one)."""
    meter = active_meter()
    return meter.host_tier() if meter is not None else contextlib.nullcontext()


def dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    """Return the strides `empty_like(t)` would give (t's own when dense, else contiguous)."""
    return torch.empty_like(t, device="meta").stride()


def _storage_numel(shape, stride) -> int:
    """Return the elements a strided buffer of this shape and stride spans."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


class HostPool:
    """Allocate host-tier buffers (pinned, accounted RAM or disk memmap), counted on the meter's host tier."""

    def __init__(self, device: str | torch.device = "cpu", kind: str = "auto", spill_dir: str | None = None,
                 meter: MemoryMeter | None = None):
        self.device = as_device(device)
        check_choice("kind", kind, HOST_KINDS)
        if kind == "auto":
            kind = "pinned" if self.device.type == "cuda" else "memory"
        if kind == "pinned" and not torch.cuda.is_available():
            raise ValueError("kind='pinned' needs CUDA; use 'memory' or 'disk' on a CPU-only machine")
        self.kind = kind
        self.meter = meter  # None: the meter active in the calling thread
        self._spill_parent = spill_dir
        self._spill_dir: str | None = None
        self._counter = 0
        self.live_bytes = 0  # host bytes of this pool's buffers alive now
        self.peak_bytes = 0  # most host bytes alive at once
        self.live_buffers = 0  # buffers alive now
        self.allocated_bytes = 0  # host bytes ever allocated (a running total)
        self.bytes_to_host = 0  # bytes copied into this pool's buffers by to_host
        self.bytes_to_device = 0  # bytes copied out of this pool's buffers by to_device

    @property
    def pinned(self) -> bool:
        """Tell whether the buffers are page-locked (copies to and from CUDA are asynchronous)."""
        return self.kind == "pinned"

    @property
    def spill_dir(self) -> str | None:
        """Return the folder of spill files ("disk" kind, once a buffer was allocated), else None."""
        return self._spill_dir

    def files(self) -> list[str]:
        """Return the spill files on disk now (empty for the in-memory kinds)."""
        if self._spill_dir is None or not os.path.isdir(self._spill_dir):
            return []
        return sorted(os.listdir(self._spill_dir))

    def empty(self, shape, dtype: torch.dtype, stride=None) -> torch.Tensor:
        """Return an uninitialised host buffer, counted on the meter's host tier."""
        shape = tuple(shape)
        stride = tuple(stride) if stride is not None else torch.empty(shape, dtype=dtype, device="meta").stride()
        meter = self.meter if self.meter is not None else active_meter()
        with meter.host_tier() if meter is not None else contextlib.nullcontext():
            if self.kind == "disk":
                numel = _storage_numel(shape, stride)
                if self._spill_dir is None:
                    self._spill_dir = tempfile.mkdtemp(prefix="labkit-offload-", dir=self._spill_parent)
                self._counter += 1
                path = os.path.join(self._spill_dir, f"t{self._counter:08d}.bin")
                flat = torch.from_file(path, shared=True, size=max(numel, 1), dtype=dtype)  # creates the file
                buf = flat.as_strided(shape, stride)
                weakref.finalize(buf.untyped_storage(), _remove_file, path)
            else:
                buf = torch.empty_strided(shape, stride, dtype=dtype, device="cpu", pin_memory=self.pinned)
        if meter is not None:
            meter.mark_host(buf)  # no-op when host_tier() already counted it
        nbytes = buf.untyped_storage().nbytes()
        self.live_bytes += nbytes
        self.live_buffers += 1
        self.allocated_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(buf.untyped_storage(), _release, weakref.ref(self), nbytes)
        return buf

    def close(self) -> None:
        """Remove the spill folder and any file left in it."""
        if self._spill_dir is not None:
            shutil.rmtree(self._spill_dir, ignore_errors=True)
            self._spill_dir = None

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self):
        return (f"HostPool({self.kind}, {self.live_buffers} buffers, {self.live_bytes} B live, "
                f"{self.peak_bytes} B peak)")


def _release(pool_ref, nbytes: int) -> None:
    pool = pool_ref()
    if pool is not None:
        pool.live_bytes -= nbytes
        pool.live_buffers -= 1


def _remove_file(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def to_host(t: torch.Tensor, pool: HostPool | None = None, stream=None) -> torch.Tensor:
    """Copy `t` into a new host-tier tensor (same shape, dense strides) and return it; see the module docstring."""
    stride = dense_stride(t)
    if pool is not None:
        buf = pool.empty(t.shape, t.dtype, stride)
        pinned = pool.pinned
        pool.bytes_to_host += t.numel() * t.element_size()
    else:
        pinned = t.device.type == "cuda"
        with host_tier():
            buf = torch.empty_strided(t.shape, stride, dtype=t.dtype, device="cpu", pin_memory=pinned)
    src = t.detach()
    if stream is None:
        buf.copy_(src, non_blocking=pinned and t.device.type == "cuda")
    else:
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t has been computed
        with torch.cuda.stream(stream):
            buf.copy_(src, non_blocking=True)
        t.record_stream(stream)  # t's memory is reused only after the copy has read it
    return buf


def to_device(h: torch.Tensor, device: str | torch.device, pool: HostPool | None = None,
              stream=None) -> torch.Tensor:
    """Copy a host tensor into a new device tensor (same shape, dense strides) and return it; see the module docstring."""
    device = torch.device(device)
    x = torch.empty_strided(h.shape, dense_stride(h), dtype=h.dtype, device=device)  # on the current stream
    src = h.detach()
    if stream is None:
        x.copy_(src, non_blocking=device.type == "cuda" and h.is_pinned())
    else:
        stream.wait_stream(torch.cuda.current_stream(device))  # x's memory is free for the copy
        with torch.cuda.stream(stream):
            x.copy_(src, non_blocking=True)
    if pool is not None:
        pool.bytes_to_device += h.numel() * h.element_size()
    return x


def pin(t: torch.Tensor) -> torch.Tensor:
    """Return CPU tensor `t` in page-locked memory (a copy unless pinned already; needs CUDA), counted as host memory."""
    if t.device.type != "cpu":
        raise ValueError(f"pin needs a CPU tensor, got one on {t.device}: to_host copies a device tensor to the host")
    if not torch.cuda.is_available():
        raise ValueError("pin needs CUDA: on a CPU-only machine there is no device to copy to by DMA, and torch "
                         "cannot pin memory")
    with host_tier():
        return t.detach().pin_memory()


def host_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[torch.Tensor]:
    """Yield a model's parameters, gradients and buffers and an optimizer's state tensors."""
    for p in model.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from model.buffers()
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield v


def mark_host_state(meter: MemoryMeter, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> MemoryMeter:
    """Count a host-resident model and optimizer state as host bytes in `meter`; return the meter."""
    for t in host_state_tensors(model, optimizer):
        meter.mark_host(t)
    return meter


# -- pinned memory and non_blocking ---------------------------------------------------------------
def copy_bandwidth(dst: torch.Tensor, src: torch.Tensor, repeats: int = 3) -> float:
    """Return the best bytes/s of `dst.copy_(src, non_blocking=True)`, timed to completion, after one warm-up copy.

    Works between any devices: the devices of both are synchronised around each copy, so the time
    is the copy's whole time even where `non_blocking` returned early (pinned memory and CUDA).
    """
    check_int("repeats", repeats, 1, 1000)
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"dst and src must have the same shape and dtype, got {tuple(dst.shape)} {dst.dtype} "
                         f"and {tuple(src.shape)} {src.dtype}")
    nbytes = src.numel() * src.element_size()
    if nbytes == 0:
        raise ValueError("src is empty: there is no copy to time")
    devices = {as_device(dst.device), as_device(src.device)}
    # non_blocking has no effect on pageable memory or between CPU tensors; the warm-up copy touches the pages first
    return nbytes / fastest_s(lambda: dst.copy_(src, non_blocking=True), repeats, *devices)


def overlap_fraction(a_s: float, b_s: float, together_s: float) -> float:
    """Return the share of the shorter of two tasks hidden when they ran together, clipped to [0, 1].

    0: together took a_s + b_s (one after the other); 1: together took max(a_s, b_s) (the shorter
    was fully hidden). Timing noise can put `together_s` just outside that range; it is clipped.
    """
    for name, v in (("a_s", a_s), ("b_s", b_s), ("together_s", together_s)):
        if not v > 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
    return min(1.0, max(0.0, (a_s + b_s - together_s) / min(a_s, b_s)))


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
        """Return the share of the shorter of copy and compute that the side stream hid."""
        return overlap_fraction(self.copy_s, self.compute_s, self.overlapped_s)


def _cuda_device(device, caller: str) -> torch.device:
    """Return `device` as an indexed CUDA device; raise ValueError naming `caller` if it is not one."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        seen = "" if torch.cuda.is_available() else "; torch sees no CUDA device here"
        raise ValueError(f"{caller} needs a CUDA device (got {str(device)!r}{seen}): on a CPU-only machine there "
                         "is no host-to-device copy to overlap, and no pinned memory")
    return as_device(device)


def host_to_device_bandwidth(device, nbytes: int = 64 * 2**20, pinned: bool = True, repeats: int = 3) -> float:
    """Return the best bytes/s of one host -> device copy of `nbytes` from pinned or pageable memory (CUDA only)."""
    check_int("nbytes", nbytes, 4, 2**40)
    check_int("repeats", repeats, 1, 1000)
    if not isinstance(pinned, bool):
        raise ValueError(f"pinned must be True or False, got {pinned!r}")
    dev = _cuda_device(device, "host_to_device_bandwidth")
    src = torch.empty(nbytes // 4, pin_memory=pinned).fill_(1.0)
    dst = torch.empty(src.shape, device=dev)
    return copy_bandwidth(dst, src, repeats)


def copy_compute_overlap(device, nbytes: int = 64 * 2**20, repeats: int = 3, matmul_n: int = 2048) -> CopyOverlap:
    """Time a pinned host -> device copy and a matmul compute alone, one after the other, and overlapped (CUDA only).

    Each time is the best of `repeats` after a warm-up, the device synchronised around it. The
    compute repeats a `matmul_n`² fp32 matmul as often as makes it about as long as the copy, where
    overlap can hide the most.
    """
    check_int("nbytes", nbytes, 4, 2**40)
    check_int("repeats", repeats, 1, 1000)
    check_int("matmul_n", matmul_n, 1, 2**15)
    dev = _cuda_device(device, "copy_compute_overlap")
    current = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    src = torch.empty(nbytes // 4, pin_memory=True).fill_(1.0)  # page-locked: the copy engine reads it directly
    pageable = torch.ones(nbytes // 4)
    dst = torch.empty(src.shape, device=dev)
    a = torch.randn(matmul_n, matmul_n, device=dev)
    c = torch.empty_like(a)

    def best_s(fn) -> float:
        """Return the fastest of `repeats` timed runs of `fn` (after a warm-up), synchronised around each."""
        return fastest_s(fn, repeats, dev)

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

    one_matmul_s = best_s(lambda: torch.mm(a, a, out=c))
    copy_s = best_s(copy)
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

    out = CopyOverlap(nbytes=src.numel() * 4, matmuls=matmuls, copy_s=copy_s, compute_s=best_s(compute),
                      serial_s=best_s(serial), overlapped_s=best_s(overlapped), issue_s=issue_s(src),
                      pageable_issue_s=issue_s(pageable))
    torch.cuda.synchronize(dev)  # nothing queued still reads src or writes dst when they are freed
    return out
