"""The host tier: host buffers (pinned, accounted RAM or disk) and the one pair of copies to and from them.

Chapters 04 and 05: a tested reference (labkit.techniques).

Each copy returns a new tensor with dense strides; a copy between pinned memory and CUDA is asynchronous
(synchronise before reading a host result); with `stream=` it runs on that side stream.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from labkit.device import as_device
from labkit.meter import MemoryMeter, active_meter
from labkit.validate import check_choice
from labkit.work import host_copy

HOST_KINDS = ("auto", "pinned", "memory", "disk")


def host_tier():
    """Return a context in which new storages count as host memory in the active meter (no-op without one)."""
    meter = active_meter()
    return meter.host_tier() if meter is not None else contextlib.nullcontext()


def dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    """Return the strides `empty_like(t)` would give (t's own when dense, else contiguous)."""
    if is_non_overlapping_and_dense_or_false(t):  # no tensor made: under fake mode a meta one is a counted fake one
        return t.stride()
    return torch.empty_like(t, device="meta").stride()


class HostPool:
    """Allocate host-tier buffers (pinned, accounted RAM or disk memmap), counted on the meter's host tier."""

    def __init__(self, device: str | torch.device = "cpu", kind: str = "auto"):
        self.device = as_device(device)
        check_choice("kind", kind, HOST_KINDS)
        if kind == "auto":
            kind = "pinned" if self.device.type == "cuda" else "memory"
        if kind == "pinned" and not torch.cuda.is_available():
            raise ValueError("kind='pinned' needs CUDA; use 'memory' or 'disk' on a CPU-only machine")
        self.kind = kind
        self.pinned = kind == "pinned"  # page-locked buffers: copies to and from CUDA are asynchronous
        self.spill_dir: str | None = None  # the folder of spill files ("disk" kind, once a buffer was allocated)
        self._counter = 0
        self.live_bytes = 0  # host bytes of this pool's buffers alive now
        self.peak_bytes = 0  # most host bytes alive at once
        self.live_buffers = 0  # buffers alive now
        self.allocated_bytes = 0  # host bytes ever allocated (a running total)
        self.bytes_to_host = 0  # bytes copied into this pool's buffers by to_host
        self.bytes_to_device = 0  # bytes copied out of this pool's buffers by to_device

    def files(self) -> list[str]:
        """Return the spill files on disk now (empty for the in-memory kinds)."""
        if self.spill_dir is None or not os.path.isdir(self.spill_dir):
            return []
        return sorted(os.listdir(self.spill_dir))

    def empty(self, shape, dtype: torch.dtype, stride=None) -> torch.Tensor:
        """Return an uninitialised host buffer, counted on the meter's host tier."""
        shape = tuple(shape)
        stride = tuple(stride) if stride is not None else torch.empty(shape, dtype=dtype, device="meta").stride()
        meter = active_meter()
        with meter.host_tier() if meter is not None else contextlib.nullcontext():
            if self.kind == "disk":
                numel = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride))  # spanned
                if self.spill_dir is None:
                    self.spill_dir = tempfile.mkdtemp(prefix="labkit-offload-")
                self._counter += 1
                path = os.path.join(self.spill_dir, f"t{self._counter:08d}.bin")
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
        if self.spill_dir is not None:
            shutil.rmtree(self.spill_dir, ignore_errors=True)
            self.spill_dir = None

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
    """Copy `t` into a new host-tier tensor (same shape, dense strides) and return it (pinned when `t` is on CUDA)."""
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
    with host_copy(t.numel() * t.element_size()):
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
    """Copy a host tensor into a new device tensor (same shape, dense strides) and return it."""
    device = torch.device(device)
    x = torch.empty_strided(h.shape, dense_stride(h), dtype=h.dtype, device=device)  # on the current stream
    src = h.detach()
    with host_copy(h.numel() * h.element_size()):
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


def mark_host_state(meter: MemoryMeter, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> MemoryMeter:
    """Count a host-resident model (parameters, gradients, buffers) and optimizer state as host; return `meter`."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), *model.buffers()]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        meter.mark_host(t)
    return meter
