"""The host tier: host memory for what does not stay on the device, and the one pair of copies to and from it.

Activation offload (notebook 04), layer-to-layer training (05) and sharded optimizer state that
lives on the CPU (07) all keep tensors in host memory and copy them to and from the device. They
use this module:

    to_host(t, pool=None, stream=None)             # a new host-tier tensor with t's values
    to_device(h, device, pool=None, stream=None)   # a new device tensor with h's values
    host_tier()                                    # a context: new storages count as host memory
    HostPool(device, kind="auto")                  # accounted host buffers: pinned, memory or disk
    mark_host_state(meter, model, optimizer)       # count a host-resident model and its state as host

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
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator

import torch

from labkit.meter import MemoryMeter, active_meter

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
        self.device = torch.device(device)
        if kind not in HOST_KINDS:
            raise ValueError(f"kind must be one of {HOST_KINDS}, got {kind!r}")
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
