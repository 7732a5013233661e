"""Activation offload: saved-tensor hooks that move what autograd saves to a host pool (`hosttier.HostPool`) and back.

Chapter 04: a tested reference (labkit.techniques).
"""

from __future__ import annotations

import time
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor

from labkit.techniques.hosttier import HostPool, to_device, to_host
from labkit.validate import check_choice, check_int

PREFETCH_CHOICES = ("auto", True, False)


class Saved:
    """One offloaded saved tensor: its host buffer, its layer, and (CUDA) the events of its copies."""

    __slots__ = ("host", "device", "layer", "stored", "loaded", "on_device", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, layer: int):
        self.host = host  # the host-tier buffer
        self.device = device  # where backward needs it
        self.layer = layer  # the layer that saved it (forward order; 0: before the first layer)
        self.stored = None  # CUDA event: the copy to the host has finished
        self.loaded = None  # CUDA event: the copy back has finished
        self.on_device = None  # the prefetched device tensor, until unpack takes it


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Move tensors saved for backward to a HostPool during forward; bring them back for backward."""

    def __init__(self, model: torch.nn.Module, pool: HostPool | None = None, min_bytes: int = 65536,
                 prefetch="auto", time_copies: bool = False):
        self.device = next(model.parameters()).device  # where the model computes: compared with t.device
        self.pool = pool if pool is not None else HostPool(self.device)
        check_int("min_bytes", min_bytes, 0)
        check_choice("prefetch", prefetch, PREFETCH_CHOICES)
        self.model = model
        self.min_bytes = min_bytes
        self.cuda = self.device.type == "cuda"
        self.prefetch = self.cuda if prefetch == "auto" else bool(prefetch)
        self.time_copies = time_copies
        self.side_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._active = False
        self._handles: list = []
        self.reset_stats()
        super().__init__(self.pack, self.unpack)

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
            copy_s = sum(a.elapsed_time(b) / 1e3 if self.cuda else b - a for a, b in self._timings)
            out["copy_to_host_s"] = copy_s
            out["copy_to_host_bytes_per_s"] = out["bytes_to_host"] / copy_s if copy_s > 0 else float("nan")
        return out

    def track_layers(self, layers) -> "OffloadHooks":
        """Label saved tensors by layer (0 before the first, i + 1 from layer i on) for prefetch; return self."""
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._layer_setter(i + 1)))
        return self

    def remove(self) -> None:
        """Remove the layer hooks added by track_layers."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _layer_setter(self, layer: int):
        """Return a forward pre-hook that marks `layer` as running (in the forward inside `with hooks:` only)."""
        def set_layer(module, args):
            if self._active:  # only in the forward pass inside `with hooks:`
                self._layer = layer
        return set_layer

    def __enter__(self):
        self.reset_stats()
        self._layer = 0  # the layer whose forward runs now
        self._layers: dict[int, list] = {}  # layer -> weakrefs to its Saved
        self._fetched: set[int] = set()  # layers whose copy back has started
        self._triggered: set[int] = set()  # layers whose first unpack has started a prefetch
        self._param_storages = {p.untyped_storage()._cdata for p in self.model.parameters()}  # storages, fake ones too
        self._active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self._active = False
        return super().__exit__(*exc)

    def keep(self, t: torch.Tensor) -> str | None:
        """Return why `t` stays on the device ("params", "small", "other"), or None to offload it."""
        if t.layout != torch.strided or type(t) not in (torch.Tensor, FakeTensor) and not isinstance(t, torch.nn.Parameter):
            return "other"
        if t.device != self.device or t.device.type == "meta":
            return "other"
        if isinstance(t, torch.nn.Parameter) or t.untyped_storage()._cdata in self._param_storages:
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
            return t.detach()  # not t: an op's saved output would hold its own grad_fn, a cycle only backward
            #                    breaks; a step that fails before its backward would leak its whole graph
        if self.cuda:
            self.side_stream.wait_stream(torch.cuda.current_stream(self.device))  # t has been computed
        start = self._clock() if self.time_copies else None
        host = to_host(t, self.pool, stream=self.side_stream)  # CUDA: also t.record_stream(side)
        if start is not None:
            self._timings.append((start, self._clock()))
        saved = Saved(host, t.device, self._layer)
        if self.cuda:
            saved.stored = torch.cuda.Event()
            saved.stored.record(self.side_stream)
        self._layers.setdefault(saved.layer, []).append(weakref.ref(saved))
        self._stats["offloaded"] += 1
        self._stats["bytes_to_host"] += t.numel() * t.element_size()
        return saved  # holds the host buffer only: the device copy is released with t

    def unpack(self, saved):
        """Backward: return the saved tensor on the device (waiting for a prefetch if one is running)."""
        if isinstance(saved, torch.Tensor):
            return saved
        if self.prefetch and saved.layer not in self._triggered:
            self._triggered.add(saved.layer)  # the first unpack of a layer starts loading the layer before it
            earlier = [g for g in self._layers if g < saved.layer and g not in self._fetched]
            if earlier:
                self._fetched.add(max(earlier))
                self._load_layer(max(earlier))
        x, saved.on_device = saved.on_device, None
        if x is None:  # not prefetched: copy it now, on the compute stream
            x = self._load(saved, prefetch=False)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(saved.loaded)
        return x

    def _load(self, saved: Saved, prefetch: bool) -> torch.Tensor:
        """Copy a saved tensor back into a new device tensor (on the side stream when prefetching)."""
        self._stats["bytes_to_device"] += saved.host.numel() * saved.host.element_size()
        if not self.cuda:
            return to_device(saved.host, saved.device, self.pool)
        stream = self.side_stream if prefetch else torch.cuda.current_stream(self.device)
        stream.wait_event(saved.stored)  # the copy to the host has finished
        x = to_device(saved.host, saved.device, self.pool, stream=self.side_stream if prefetch else None)
        saved.loaded = torch.cuda.Event()
        saved.loaded.record(stream)
        return x

    def _load_layer(self, layer: int) -> None:
        """Start copying back every saved tensor of `layer` still on the host (prefetch)."""
        for ref in self._layers.get(layer, []):
            saved = ref()
            if saved is not None and saved.on_device is None:
                saved.on_device = self._load(saved, prefetch=True)
                self._stats["prefetched"] += 1

    def _clock(self):
        """Return now: an event recorded on the side stream (CUDA), else perf_counter's seconds."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.side_stream)
        return ev
