"""Activation offload: a host tier for offloaded tensors, and saved-tensor hooks that use it.

Notebook 04 writes the hooks out; this module is the tested reference that later notebooks
(05 layer-to-layer, the HPO study) reuse.

The host tier (stable API)
--------------------------
`HostPool(device, kind="auto", spill_dir=None)` allocates the host buffers that offloaded
tensors live in, and counts them on the host tier of the active `MemoryMeter`
(`meter.host_current_bytes` / `host_peak_bytes`; never against the device budget):

    kind      buffer                                   used for
    "pinned"  page-locked CPU memory (CUDA only)       "auto" on CUDA: real host memory, async copies
    "memory"  an ordinary CPU tensor, counted as host   "auto" on CPU: an accounted host pool
    "disk"    a file-backed memmap (torch.from_file)    like ZeRO-Infinity's NVMe offload

On a CPU-only machine the "device" is itself CPU memory, so `x.to("cpu")` is a no-op that
moves nothing; the pool always allocates a separate buffer and copies into it, and the meter
counts that buffer as host. The copy is real; only the *placement* is simulated.

    pool = HostPool(device)                 # or HostPool(device, kind="disk")
    h = pool.to_host(t)                     # new host buffer holding t's values (same shape/strides)
    x = pool.to_device(h)                   # new device tensor holding h's values
    pool.empty(shape, dtype, stride=None)   # an uninitialised host buffer
    pool.live_bytes, pool.peak_bytes        # host bytes alive now / at most (this pool's buffers)
    pool.live_buffers, pool.files()         # buffers alive now, spill files on disk now
    pool.close()                            # remove the spill folder ("disk"); also `with HostPool(...)`
    to_host(t, pool=None, meter=None)       # one-off helper: copy t to a host buffer

A buffer is freed (and its spill file deleted) when the last reference to it goes, so nothing
accumulates across steps. Pass `meter=` to count on a specific meter; by default the meter
active in the calling thread (if any) is used.

The hooks
---------
`OffloadHooks(model, pool=None, min_bytes=65536, prefetch="auto", time_copies=False)` is a
`torch.autograd.graph.saved_tensors_hooks` context: tensors that autograd saves for backward
inside it are copied to the host tier during forward (the device copy is released) and copied
back when backward needs them. Parameters (and views of them) and tensors smaller than
`min_bytes` stay where they are. On CUDA the copies run on a side stream (non-blocking, pinned
buffers) and, with prefetch, backward of layer i starts the copy-back of layer i-1. Call
`hooks.track_layers(model.blocks)` to group saved tensors by layer for prefetch.

    hooks = OffloadHooks(model).track_layers(model.blocks)
    with hooks:
        _, loss = model(x, y)
    loss.backward()
    hooks.stats()   # bytes_to_host, bytes_to_device, offloaded, kept_params, kept_small, ...

Also: `dense_stride(t)` (the strides a copy of t keeps) and `saved_tensor_census(model, batch)`
(every tensor one forward saves: bytes, shape, parameter or not, storage pointer).
On CUDA the hooks were written against the documented stream/event API but are exercised by the
test suite only on CPU (where the copies are synchronous and prefetch only moves copies earlier).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from contextlib import nullcontext

import torch

from labkit.meter import MemoryMeter, active_meter

HOST_KINDS = ("auto", "pinned", "memory", "disk")
PREFETCH_CHOICES = ("auto", True, False)


def dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    """Return the strides `empty_like(t)` would give (t's own when dense, else contiguous)."""
    return torch.empty_like(t, device="meta").stride()


_dense_stride = dense_stride


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
        self.bytes_to_host = 0  # bytes copied by to_host
        self.bytes_to_device = 0  # bytes copied by to_device

    # -- allocation --------------------------------------------------------------------------
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
        with meter.host_tier() if meter is not None else nullcontext():
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
                buf = torch.empty_strided(shape, stride, dtype=dtype, device="cpu", pin_memory=self.kind == "pinned")
        if meter is not None:
            meter.mark_host(buf)  # no-op when host_tier() already counted it
        nbytes = buf.untyped_storage().nbytes()
        self.live_bytes += nbytes
        self.live_buffers += 1
        self.allocated_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(buf.untyped_storage(), _release, weakref.ref(self), nbytes)
        return buf

    # -- copies ------------------------------------------------------------------------------
    def to_host(self, t: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """Return a new host buffer with t's values, shape and (dense) strides."""
        buf = self.empty(t.shape, t.dtype, _dense_stride(t))
        buf.copy_(t, non_blocking=non_blocking and self.kind == "pinned")
        self.bytes_to_host += t.numel() * t.element_size()
        return buf

    def to_device(self, h: torch.Tensor, device: str | torch.device | None = None,
                  non_blocking: bool = False) -> torch.Tensor:
        """Return a new device tensor with h's values, shape and (dense) strides."""
        device = self.device if device is None else torch.device(device)
        x = torch.empty_strided(h.shape, _dense_stride(h), dtype=h.dtype, device=device)
        x.copy_(h, non_blocking=non_blocking and self.kind == "pinned")
        self.bytes_to_device += h.numel() * h.element_size()
        return x

    # -- lifetime ----------------------------------------------------------------------------
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


def to_host(t: torch.Tensor, pool: HostPool | None = None, meter: MemoryMeter | None = None) -> torch.Tensor:
    """Copy `t` into a new host-tier buffer (pinned on CUDA, accounted RAM on CPU) and return it."""
    if pool is None:
        pool = HostPool(t.device if t.device.type != "cpu" else "cpu", meter=meter)
    return pool.to_host(t)


# -- saved-tensor hooks ----------------------------------------------------------------------
class Packed:
    """An offloaded saved tensor: its host buffer, where it came from, and its layer group."""

    __slots__ = ("host", "device", "group", "stored", "loaded", "device_copy", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, group: int):
        self.host = host  # the host-tier buffer
        self.device = device  # where backward needs it
        self.group = group  # layer group (forward order)
        self.stored = None  # CUDA event: the copy to the host has finished
        self.loaded = None  # CUDA event: the prefetched copy back has finished
        self.device_copy = None  # the prefetched device tensor, until unpack takes it


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Move tensors saved for backward to a HostPool during forward; bring them back for backward."""

    def __init__(self, model: torch.nn.Module | None = None, pool: HostPool | None = None,
                 min_bytes: int = 65536, prefetch="auto", time_copies: bool = False,
                 device: str | torch.device | None = None):
        if model is not None and device is None:
            device = next(model.parameters()).device
        self.device = torch.device("cpu" if device is None else device)
        self.pool = pool if pool is not None else HostPool(self.device)
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be an integer >= 0, got {min_bytes!r}")
        if prefetch not in PREFETCH_CHOICES:
            raise ValueError(f"prefetch must be one of {PREFETCH_CHOICES}, got {prefetch!r}")
        self.model = model
        self.min_bytes = min_bytes
        self.cuda = self.device.type == "cuda"
        self.prefetch = self.cuda if prefetch == "auto" else bool(prefetch)
        self.time_copies = time_copies
        self.side_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._param_ptrs: set[int] = set()
        self._active = False
        self._group = 0
        self._groups: dict[int, list] = {}
        self._prefetched: set[int] = set()  # groups whose copy back has started
        self._triggered: set[int] = set()  # groups whose first unpack has started a prefetch
        self._handles: list = []
        self._timings: list = []
        self.reset_stats()
        super().__init__(self.pack, self.unpack)

    # -- bookkeeping -------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero the counters (done on every `with hooks:` entry)."""
        self._stats = dict(bytes_to_host=0, bytes_to_device=0, offloaded=0, kept_params=0, kept_small=0,
                           kept_other=0, bytes_kept=0, prefetched=0)
        self._timings = []

    def stats(self) -> dict:
        """Return this step's counters; with time_copies, copy seconds and bytes/s to the host."""
        out = dict(self._stats)
        if self.time_copies:
            if self.cuda:
                torch.cuda.synchronize(self.device)
                copy_s = sum(a.elapsed_time(b) for a, b in self._timings) / 1e3
            else:
                copy_s = sum(self._timings)
            out["copy_to_host_s"] = copy_s
            out["copy_to_host_bytes_per_s"] = out["bytes_to_host"] / copy_s if copy_s > 0 else float("nan")
        return out

    def track_layers(self, layers) -> "OffloadHooks":
        """Group saved tensors by layer (a forward pre-hook on each module) so backward can prefetch.

        Tensors saved before the first layer are group 0, inside layer i (and after it, until the
        next layer starts) group i + 1. Recomputation in backward (checkpointing) does not count.
        """
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._group_setter(i + 1)))
        return self

    def remove(self) -> None:
        """Remove the layer hooks added by track_layers."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _group_setter(self, group: int):
        def set_group(module, args):
            if self._active:  # only in the forward pass inside `with hooks:`
                self._group = group
        return set_group

    def __enter__(self):
        self.reset_stats()
        self._group = 0
        self._groups = {}
        self._prefetched = set()
        self._triggered = set()
        if self.model is not None:
            self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self._active = False
        return super().__exit__(*exc)

    # -- the hooks ---------------------------------------------------------------------------
    def keep(self, t: torch.Tensor) -> str | None:
        """Return why `t` stays on the device ("params", "small", "other"), or None to offload it."""
        if t.layout != torch.strided or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return "other"
        if t.device != self.device or t.device.type == "meta":
            return "other"
        if isinstance(t, torch.nn.Parameter) or t.untyped_storage().data_ptr() in self._param_ptrs:
            return "params"
        if t.numel() * t.element_size() < self.min_bytes:
            return "small"
        return None

    def pack(self, t: torch.Tensor):
        """Forward: copy a saved tensor to a host buffer and return a handle (or keep the tensor)."""
        why = self.keep(t)
        if why is not None:
            self._stats[f"kept_{why}"] += 1
            self._stats["bytes_kept"] += t.numel() * t.element_size()
            return t
        nbytes = t.numel() * t.element_size()
        host = self.pool.empty(t.shape, t.dtype, _dense_stride(t))
        packed = Packed(host, t.device, self._group)
        if self.cuda:
            main = torch.cuda.current_stream(self.device)
            self.side_stream.wait_stream(main)  # t has been computed
            with torch.cuda.stream(self.side_stream):
                start = self._event()
                host.copy_(t, non_blocking=True)
                self._stop(start)
                packed.stored = torch.cuda.Event()
                packed.stored.record()
            t.record_stream(self.side_stream)  # the allocator keeps t's block until the copy is done
        else:
            t0 = time.perf_counter()
            host.copy_(t)
            if self.time_copies:
                self._timings.append(time.perf_counter() - t0)
        self._groups.setdefault(packed.group, []).append(weakref.ref(packed))
        self._stats["offloaded"] += 1
        self._stats["bytes_to_host"] += nbytes
        self.pool.bytes_to_host += nbytes
        return packed  # holds the host buffer only: the device copy is released with t

    def unpack(self, packed):
        """Backward: return the saved tensor on the device (waiting for a prefetch if one is running)."""
        if isinstance(packed, torch.Tensor):
            return packed
        if self.prefetch and packed.group not in self._triggered:
            self._triggered.add(packed.group)  # the first unpack of a layer starts loading the layer before it
            earlier = [g for g in self._groups if g < packed.group and g not in self._prefetched]
            if earlier:
                self._prefetched.add(max(earlier))
                self._load_group(max(earlier))
        if packed.device_copy is not None:  # prefetched
            x, packed.device_copy = packed.device_copy, None
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(packed.loaded)
                x.record_stream(torch.cuda.current_stream(self.device))
            return x
        return self._load(packed, prefetch=False)

    # -- copies back -------------------------------------------------------------------------
    def _load(self, packed: Packed, prefetch: bool) -> torch.Tensor:
        h = packed.host
        nbytes = h.numel() * h.element_size()
        self._stats["bytes_to_device"] += nbytes
        self.pool.bytes_to_device += nbytes
        if not self.cuda:
            x = torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=packed.device)
            x.copy_(h)
            return x
        if prefetch:  # allocate and copy on the side stream; unpack waits for the event
            with torch.cuda.stream(self.side_stream):
                x = torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=packed.device)
                x.copy_(h, non_blocking=True)
                packed.loaded = torch.cuda.Event()
                packed.loaded.record()
            return x
        main = torch.cuda.current_stream(self.device)
        main.wait_event(packed.stored)  # the copy to the host has finished
        x = torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=packed.device)
        x.copy_(h, non_blocking=True)
        return x

    def _load_group(self, group: int) -> None:
        for ref in self._groups.get(group, []):
            packed = ref()
            if packed is not None and packed.device_copy is None:
                packed.device_copy = self._load(packed, prefetch=True)
                self._stats["prefetched"] += 1

    def _event(self):
        if not (self.cuda and self.time_copies):
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _stop(self, start) -> None:
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._timings.append((start, end))


# -- a census of what autograd saves ---------------------------------------------------------
def saved_tensor_census(model: torch.nn.Module, batch) -> list[dict]:
    """Run one forward and list every tensor autograd saves: bytes, shape, and whether it is a parameter."""
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = []

    def pack(t):
        seen.append({"bytes": t.numel() * t.element_size(), "shape": tuple(t.shape),
                     "param": isinstance(t, torch.nn.Parameter) or t.untyped_storage().data_ptr() in ptrs,
                     "storage": t.untyped_storage().data_ptr()})
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(*batch)
    del loss
    return seen
