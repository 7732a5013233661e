"""Count the bytes of live tensors exactly, by category, with an optional memory budget.

`MemoryMeter` counts each untyped storage an operator returns or first sees once, until Python frees it;
under a CUDA meter, CPU tensors count as host memory. Buffers count as parameters. Categories are resolved
when asked for. Two active meters in one thread are refused.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import (TorchDispatchMode, _get_current_dispatch_mode_stack,
                                          is_traceable_wrapper_subclass)

from labkit.validate import check_budget, check_choice

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")
"""Categories of `peak_split`; "activations" holds activations and everything else (inputs, temporaries)."""

PHASES = ("forward", "backward", "optimizer", "other")

_ACTIVE = threading.local()
_RESIZE = torch.UntypedStorage.resize_  # the storage method FSDP2 frees and re-allocates its gathered parameters with
_open_meters = [0]  # meters open in this process: while any is, storage resizes are reported to them


def _resize_and_count(storage, size):
    """Resize `storage` (UntypedStorage.resize_, which no dispatch mode sees) and let the thread's meter count it."""
    out = _RESIZE(storage, size)
    meter = active_meter()
    if meter is not None:
        meter._storage_resized(storage)
    return out


class OutOfMemory(torch.OutOfMemoryError):
    """Raised when an allocation would take the device beyond a `MemoryMeter` budget (CUDA: with allocator figures)."""

    def __init__(self, requested_bytes: int, in_use_bytes: int, budget_bytes: int,
                 cuda_allocated_bytes: int | None = None, cuda_reserved_bytes: int | None = None):
        self.requested_bytes = int(requested_bytes)
        self.in_use_bytes = int(in_use_bytes)
        self.budget_bytes = int(budget_bytes)
        self.cuda_allocated_bytes = cuda_allocated_bytes
        self.cuda_reserved_bytes = cuda_reserved_bytes
        allocator = ""
        if cuda_allocated_bytes is not None:
            allocator = (f"; CUDA allocator: {format_bytes(cuda_allocated_bytes)} allocated, "
                         f"{format_bytes(cuda_reserved_bytes or 0)} reserved")
        super().__init__(
            f"labkit budget exceeded: tried to allocate {format_bytes(requested_bytes)} "
            f"with {format_bytes(in_use_bytes)} in use and {format_bytes(budget_bytes)} allowed "
            f"({requested_bytes} B requested, {in_use_bytes} B in use, {budget_bytes} B budget){allocator}"
        )

    def __reduce__(self):
        return (OutOfMemory, (self.requested_bytes, self.in_use_bytes, self.budget_bytes,
                              self.cuda_allocated_bytes, self.cuda_reserved_bytes))


def live_tensor_bytes(collect: bool = True) -> int:
    """Return the bytes of every tensor alive in this process (each storage once)."""
    import gc

    if collect:
        gc.collect()
    seen: dict[int, int] = {}
    objs = gc.get_objects()
    # by exact type, each type asked once: isinstance on half a million objects took 0.3 s a call (it reads
    # __class__, which warns on deprecated torch aliases and raises on a dead weakref.proxy); a live proxy's tensor
    # is itself among the objects
    kinds = {t for t in set(map(type, objs)) if issubclass(t, torch.Tensor)}
    objs = [o for o in objs if type(o) in kinds]
    for obj in objs:
        if isinstance(obj, FakeTensor) or obj.is_meta:
            continue
        for t in _inner(obj):
            st = _storage(t)
            if st is not None:
                seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def format_bytes(n: float) -> str:
    """Format a byte count with a binary unit (B, KiB, MiB, GiB, TiB)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclass(eq=False, slots=True)
class _Record:
    """One storage's life in a meter: size, tier, category and when it was alive."""

    nbytes: int
    host: bool
    alloc_seq: int
    category: str | None = None  # None: activations and other, unless classified later
    free_seq: int | None = None
    stream: object = 0  # the stream it was allocated on (the meter's `stream` then)


def _storage(t: torch.Tensor):
    """Return the tensor's untyped storage, or None for tensors without one (sparse, nested)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """Return the tensors that hold a tensor's memory: itself, or a wrapper subclass's (a DTensor's) inner tensors."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    out = []
    for name in names:
        inner = getattr(t, name, None)
        if isinstance(inner, torch.Tensor):
            out.extend(_inner(inner))
    return out


def _storage_ids(t: torch.Tensor) -> list[int]:
    """Return the ids of the storages that hold a tensor's memory (see _inner)."""
    return [id(st) for st in map(_storage, _inner(t)) if st is not None]


@dataclass(frozen=True)
class TimelinePoint:
    """Device bytes in use after one allocation or free."""

    seq: int  # event number within this meter
    t_s: float  # seconds since the meter started
    bytes: int  # device bytes in use after the event
    phase: str  # one of PHASES
    tag: object = None  # the meter's `tag` at the event (set by the caller, e.g. the block running), None: untagged


class MemoryMeter(TorchDispatchMode):
    """Count live tensor bytes on the compute device exactly; optionally enforce a budget."""

    def __init__(self, device: str | torch.device | None = None, budget_bytes: int | None = None,
                 timeline: bool = True, every_record: bool = False):
        super().__init__()
        if check_budget("budget_bytes", budget_bytes) is not None:
            budget_bytes = int(budget_bytes)
        from labkit.device import as_device, resolve_device
        self.device = as_device(resolve_device("auto") if device is None else device)
        self.budget_bytes = budget_bytes
        self.keep_timeline = timeline
        self.every_record = every_record  # keep every storage's record, so that timeline_splits() can split each point
        self.tag = None  # a label the caller sets; each timeline point keeps the tag current at its event
        self.stream = 0  # the CUDA stream allocations are made on now, as the caller says (0: the default stream)
        self.current_bytes = 0  # device bytes live now
        self.peak_bytes = 0  # most device bytes live at once
        self.host_current_bytes = 0  # host-tier bytes live now
        self.host_peak_bytes = 0  # most host-tier bytes live at once
        self.cuda_max_allocated_bytes: int | None = None  # allocator's figure (CUDA only)
        self.cuda_reserved_bytes: int | None = None  # allocator's reserved bytes (CUDA only)
        self._records: dict[int, _Record] = {}  # id(storage) -> its live record; removed when the storage dies
        self._refs: dict[int, weakref.ref] = {}  # id(storage) -> weakref whose callback releases the record
        self._history: list[_Record] = []  # every record that may belong to the current peak
        self._self_ref = weakref.ref(self)
        self._seq = 0
        self._peak_seq = 0
        self._phase_override: str | None = None
        self._auto_phase = "other"
        self._host_depth = 0
        self._quiet = False  # True while track() registers tensors that already exist
        self._open = False
        self._used = False
        self._t0 = time.perf_counter()
        self._timeline: list[tuple] = []  # (seq, t_s, bytes, phase, tag); TimelinePoints are built when asked for
        self._hooks: list = []
        self._tracked_modules: list[weakref.ref] = []
        self._tracked_optimizers: list[weakref.ref] = []
        self._handed_over: list[_Record] = []  # the records of storages handed to collectives (see settle)

    # -- context -----------------------------------------------------------------------------
    def __enter__(self):
        if self._used:
            raise RuntimeError("a MemoryMeter measures one `with` block; create a new one")
        if getattr(_ACTIVE, "meter", None) is not None:
            raise RuntimeError("another MemoryMeter is already active in this thread")
        self._used = True
        if self.device.type == "cuda":  # before the meter is active: a failure here leaves nothing set
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._open = True
        _ACTIVE.meter = self
        if _open_meters[0] == 0:
            torch.UntypedStorage.resize_ = _resize_and_count
        _open_meters[0] += 1
        self._t0 = time.perf_counter()
        try:
            return super().__enter__()
        except BaseException:
            self._close()  # never leave the active-meter slot set: every later meter would be refused
            raise

    def __exit__(self, exc_type, exc, tb):
        try:
            return super().__exit__(exc_type, exc, tb)
        finally:
            self._close()
            self._classify()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                self.cuda_max_allocated_bytes = torch.cuda.max_memory_allocated(self.device)
                self.cuda_reserved_bytes = torch.cuda.memory_reserved(self.device)

    def _close(self) -> None:
        """Leave the active-meter slot and restore what entering changed (idempotent)."""
        if not self._open:
            return
        self._open = False
        if getattr(_ACTIVE, "meter", None) is self:
            _ACTIVE.meter = None
        _open_meters[0] -= 1
        if _open_meters[0] == 0:
            torch.UntypedStorage.resize_ = _RESIZE
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- tracking ----------------------------------------------------------------------------
    def track(self, *objs) -> "MemoryMeter":
        """Count and categorise the parameters, gradients and optimizer state of modules/optimizers."""
        self._quiet = True  # what already exists enters the timeline as one point, not one per tensor
        try:
            for obj in objs:
                if isinstance(obj, torch.Tensor):
                    self._see(obj, check_budget=False)
                    continue
                if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
                    raise TypeError(f"track() takes modules, optimizers or tensors, got {type(obj).__name__}")
                for t, _ in _categorised(obj):
                    self._see(t, check_budget=False)  # already allocated: counted, never refused
                if isinstance(obj, torch.nn.Module):
                    self._tracked_modules.append(weakref.ref(obj))
                    self._hooks.append(obj.register_forward_pre_hook(self._enter_forward))
                    for p in obj.parameters():
                        if p.requires_grad:
                            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
                else:
                    self._tracked_optimizers.append(weakref.ref(obj))
                    self._hooks.append(obj.register_step_pre_hook(self._enter_optimizer))
                    self._hooks.append(obj.register_step_post_hook(self._leave_optimizer))
            self._classify()
        finally:
            self._quiet = False
        self._note()
        return self

    @contextlib.contextmanager
    def phase(self, name: str):
        """Label the allocations in this block with a phase (overrides the automatic label)."""
        check_choice("phase", name, PHASES)
        old, self._phase_override = self._phase_override, name
        try:
            yield self
        finally:
            self._phase_override = old

    @contextlib.contextmanager
    def host_tier(self):
        """Count storages allocated in this block as host memory, not device memory."""
        self._host_depth += 1
        try:
            yield self
        finally:
            self._host_depth -= 1

    def mark_host(self, t: torch.Tensor) -> torch.Tensor:
        """Move a tensor's storage from the device count to the host count; return the tensor."""
        for inner in _inner(t):
            st = inner.untyped_storage()
            rec = self._records.get(id(st))
            if rec is None:
                with self.host_tier():
                    self._see(inner)
            elif not rec.host:
                self._renew(st, rec, rec.nbytes, host=True, check_budget=False)
        return t

    # -- results -----------------------------------------------------------------------------
    def peak_split(self) -> dict[str, int]:
        """Return device bytes at the peak by category (sums to `peak_bytes`)."""
        out = self._split(self._at_peak)
        assert sum(out.values()) == self.peak_bytes, (out, self.peak_bytes)
        return out

    def peak_bytes_of(self, *tensors: torch.Tensor) -> int:
        """Return the device bytes these live tensors' storages held at the peak (each storage once; 0 if unseen)."""
        recs = [self._records.get(key) for key in {k for t in tensors for k in _storage_ids(t)}]
        return sum(rec.nbytes for rec in recs if rec is not None and self._at_peak(rec))

    def current_split(self) -> dict[str, int]:
        """Return device bytes live now by category (sums to `current_bytes`)."""
        return self._split(lambda r: r.free_seq is None and not r.host)

    def _at_peak(self, r: _Record) -> bool:
        """Tell whether a record held device bytes at the peak."""
        return not r.host and r.alloc_seq <= self._peak_seq and (r.free_seq is None or r.free_seq > self._peak_seq)

    def _split(self, counted) -> dict[str, int]:
        """Return the bytes of the history's records for which `counted(record)` holds, by category."""
        self._classify()
        out = dict.fromkeys(CATEGORIES, 0)
        for r in filter(counted, self._history):
            out[r.category or "activations"] += r.nbytes
        return out

    @property
    def timeline(self) -> list[TimelinePoint]:
        """Device bytes after every allocation and free, with phase labels."""
        return [TimelinePoint(*point) for point in self._timeline]

    def timeline_splits(self) -> list[tuple]:
        """Return device bytes by category (in CATEGORIES order) at every timeline point; needs every_record=True."""
        if not self.every_record:
            raise RuntimeError("timeline_splits() needs MemoryMeter(every_record=True)")
        self._classify()
        index = {c: k for k, c in enumerate(CATEGORIES)}
        changes: dict[int, list] = {}  # seq -> [(category index, bytes)], applied once the point's seq is reached
        for r in self._history:
            if not r.host:
                k = index[r.category or "activations"]
                changes.setdefault(r.alloc_seq, []).append((k, r.nbytes))
                if r.free_seq is not None:
                    changes.setdefault(r.free_seq, []).append((k, -r.nbytes))
        pending = sorted(changes)
        now, done, out = [0] * len(CATEGORIES), 0, []
        for seq, *_ in self._timeline:
            while done < len(pending) and pending[done] <= seq:
                for k, nbytes in changes[pending[done]]:
                    now[k] += nbytes
                done += 1
            out.append(tuple(now))
        return out

    def summary(self) -> dict:
        """Return the meter's figures as a JSON-able dict."""
        out = {"device": str(self.device), "peak_bytes": self.peak_bytes, "current_bytes": self.current_bytes,
               "peak_split": self.peak_split(), "budget_bytes": self.budget_bytes,
               "host_peak_bytes": self.host_peak_bytes}
        if self.cuda_max_allocated_bytes is not None:
            out["cuda_max_allocated_bytes"] = self.cuda_max_allocated_bytes
            out["cuda_reserved_bytes"] = self.cuda_reserved_bytes
        return out

    def __repr__(self):
        budget = "" if self.budget_bytes is None else f", budget {format_bytes(self.budget_bytes)}"
        return (f"MemoryMeter({self.device}: peak {format_bytes(self.peak_bytes)}, "
                f"now {format_bytes(self.current_bytes)}{budget})")

    # -- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "prim":  # metadata queries (prim.device: fake tensors ask it): nothing allocated
            device = fake_device(func, args)
            return device if device is not None else func(*args, **(kwargs or {}))
        # Inputs first seen here (the batch, an untracked weight) are counted, never refused.
        records = self._records
        inputs = [u for a in ((args, kwargs.values()) if kwargs else (args,)) for t in a
                  for u in (t if isinstance(t, (list, tuple)) else (t,)) if isinstance(u, torch.Tensor)]
        for u in inputs:
            st = _storage(u)
            if st is not None and id(st) not in records:
                self._see(u, check_budget=False)
                if self._handed_over and (rec := records.get(id(st))):  # after a collective: maybe a buffer made
                    self._handed_over.append(rec)  # and freed on a library's thread (gloo's reduce-scatter result)
        out = func(*args, **(kwargs or {}))
        self._see_all((out,))
        if func.namespace in _COLLECTIVES:  # a communication library may hold these a moment longer: see settle
            self._handed_over.extend(rec for u in inputs for key in _storage_ids(u)
                                     if (rec := records.get(key)) is not None)
        return out

    def settle(self, keep=(), timeout_s: float = 10.0) -> int:
        """Wait up to timeout_s until the storages handed to collectives in this meter, those of `keep` and tracked
        states aside, are released (gloo's thread drops them a moment after the collective returns, on a loaded CPU
        later: "at rest" could count an input the step let go of); return the bytes still held then (0: none)."""
        self._classify()
        kept = {id(self._records.get(k)) for t in keep for k in _storage_ids(t)}
        deadline = time.perf_counter() + timeout_s
        held = [r for r in self._handed_over if r.category is None and not r.host and id(r) not in kept]
        while (left := sum(r.nbytes for r in held if r.free_seq is None)) and time.perf_counter() <= deadline:
            time.sleep(0.002)
        return left

    def _see_all(self, outs) -> None:
        for t in outs:
            if isinstance(t, torch.Tensor):
                self._see(t)
            elif isinstance(t, (list, tuple)):  # e.g. a tuple of lists from a foreach operator
                self._see_all(t)

    # -- internals ---------------------------------------------------------------------------
    def _phase(self) -> str:
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and self._auto_phase == "forward":
            self._auto_phase = "other"  # what runs after backward (before the next forward) is not forward
        if self._phase_override is not None:
            return self._phase_override
        return "backward" if in_backward else self._auto_phase

    def _enter_forward(self, module, args):
        if torch._C._current_graph_task_id() == -1 and self._auto_phase != "optimizer":
            self._auto_phase = "forward"

    def _enter_optimizer(self, opt, args, kwargs):
        self._auto_phase = "optimizer"

    def _leave_optimizer(self, opt, args, kwargs):
        for t in _optimizer_state_tensors(opt):
            self._see(t)
            self._set_category(t, "optimizer_state")
        self._auto_phase = "other"

    def _grad_ready(self, p):
        if p.grad is not None:
            self._see(p.grad)
            self._set_category(p.grad, "gradients")

    def label(self, t: torch.Tensor, category: str) -> torch.Tensor:
        """Count a live tensor's storage under `category` (one of CATEGORIES) from now on; return it."""
        check_choice("category", category, CATEGORIES)
        self._see(t, check_budget=False)
        self._set_category(t, category, force=True)
        return t

    def _set_category(self, t, category, force: bool = False):
        """Give the records of `t`'s storages `category` (a parameter's stays a parameter unless `force`)."""
        for key in _storage_ids(t):
            rec = self._records.get(key)
            if rec is not None and (force or rec.category != "parameters"):
                rec.category = category

    def _classify(self) -> None:
        """Give live storages of tracked parameters, gradients and optimizer state their category."""
        for obj in (ref() for ref in self._tracked_modules + self._tracked_optimizers):
            if obj is not None:
                for t, category in _categorised(obj):
                    self._set_category(t, category, force=category == "parameters")

    def _see(self, t: torch.Tensor, check_budget: bool = True) -> None:
        if not self._open:
            return
        if is_traceable_wrapper_subclass(t):  # count the memory it holds, not its global-size wrapper
            for inner in _inner(t):
                self._see(inner, check_budget)
            return
        # a fake tensor's device read directly: t.device dispatches prim.device through every mode (2,026 of the
        # 4,301 dispatches of a 4-block llama-style fake step, counted 2026-11-29)
        dev = (t.fake_device if isinstance(t, FakeTensor) else t.device).type
        if dev != self.device.type and dev != "cpu" and dev != "meta":
            return
        if dev == "meta" and not isinstance(t, FakeTensor):  # real meta tensors hold no memory
            return
        st = _storage(t)
        if st is None:
            return
        if id(st) in self._records:
            self._storage_resized(st, check_budget)  # seen before: counted anew only if resized in place
            return
        host = self._host_depth > 0 or (dev != self.device.type and self.device.type != "cpu")
        if dev == "meta" and self.device.type != "meta":
            host = self._host_depth > 0
        rec = _Record(st.nbytes(), host, self._seq, stream=self.stream)
        self._acquire(rec, check_budget=check_budget)
        self._register(st, rec)

    def _storage_resized(self, st, check_budget: bool = True) -> None:
        """Count a storage resized in place (by an operator, or outside any: see _resize_and_count) at its new size."""
        rec = self._records.get(id(st))
        if rec is not None and st.nbytes() != rec.nbytes:
            self._renew(st, rec, st.nbytes(), host=rec.host, check_budget=check_budget)

    def _register(self, st, rec: _Record) -> None:
        """Make `rec` the live record of storage `st`; its weakref releases the bytes when `st` dies."""
        key = id(st)
        self._records[key] = rec
        self._history.append(rec)
        self._refs[key] = weakref.ref(st, functools.partial(_freed, self._self_ref, key, rec))

    def _renew(self, st, rec: _Record, nbytes: int, host: bool, check_budget: bool) -> None:
        """End `rec` and count its live storage anew (resized, or moved to the host tier), before any budget refusal."""
        self._release(rec)
        rec.free_seq = self._seq
        new = _Record(nbytes, host, self._seq, rec.category, stream=self.stream)
        self._register(st, new)
        in_use = self.current_bytes
        self._acquire(new, check_budget=False)
        if check_budget and not host and self.budget_bytes is not None and self.current_bytes > self.budget_bytes:
            raise self._refusal(nbytes, in_use)

    def _acquire(self, rec: _Record, check_budget: bool) -> None:
        if rec.host:
            self.host_current_bytes += rec.nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_current_bytes)
            return
        new = self.current_bytes + rec.nbytes
        if check_budget and self.budget_bytes is not None and new > self.budget_bytes and rec.nbytes > 0:
            raise self._refusal(rec.nbytes, self.current_bytes)
        self._seq += 1
        rec.alloc_seq = self._seq
        self.current_bytes = new
        if new > self.peak_bytes:
            self.peak_bytes = new
            self._peak_seq = self._seq
            # records freed before this peak can never matter again (but to timeline_splits, with every_record)
            if len(self._history) > 2048 and not self.every_record:
                self._history = [r for r in self._history if r.free_seq is None or r.free_seq > self._peak_seq]
        self._note()

    def _refusal(self, requested_bytes: int, in_use_bytes: int) -> OutOfMemory:
        """Return the budget error for an allocation, with the CUDA allocator's figures on a GPU."""
        cuda = self.device.type == "cuda"
        figures = (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)) if cuda else ()
        return OutOfMemory(requested_bytes, in_use_bytes, self.budget_bytes, *figures)

    def _release(self, rec: _Record) -> None:
        if rec.host:
            self.host_current_bytes -= rec.nbytes
            return
        self._seq += 1
        self.current_bytes -= rec.nbytes
        self._note()

    def _note(self) -> None:
        if self.keep_timeline and self._open and not self._quiet:
            self._timeline.append((self._seq, time.perf_counter() - self._t0, self.current_bytes, self._phase(),
                                   self.tag))


def _freed(meter_ref, key: int, rec: _Record, _storage_ref) -> None:
    """Weakref callback: the storage of `rec` died; release its bytes and forget its key."""
    meter = meter_ref()
    if meter is None:
        return
    if rec.free_seq is None:
        meter._release(rec)
        rec.free_seq = meter._seq
    if meter._records.get(key) is rec:
        del meter._records[key]
        del meter._refs[key]


_COLLECTIVES = ("c10d", "_c10d_functional")  # the operator namespaces of torch.distributed's collectives
_PRIM_DEVICE = torch.ops.prim.device.default


def fake_device(func, args) -> torch.device | None:
    """Return a fake tensor's device when `func` is prim.device, answered as FakeTensorMode answers it, else None.

    C++ autograd asks a fake tensor's device at nearly every operator (two thirds of a fake step's dispatches): a mode
    above FakeTensorMode answers at once instead of passing the question down through every mode below it.
    """
    if func is _PRIM_DEVICE and type(args[0]) is FakeTensor:
        return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
    return None


class DispatchFloor(TorchDispatchMode):
    """A dispatch mode that only forwards each operator: the least any TorchDispatchMode adds to a step."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _optimizer_state_tensors(opt: torch.optim.Optimizer):
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


def _categorised(obj):
    """Yield (tensor, category) for a module's parameters, buffers and their gradients, or an optimizer's state."""
    if isinstance(obj, torch.optim.Optimizer):
        for t in _optimizer_state_tensors(obj):
            yield t, "optimizer_state"
        return
    for t in list(obj.parameters()) + list(obj.buffers()):
        yield t, "parameters"
        if t.grad is not None:
            yield t.grad, "gradients"


def active_meter() -> MemoryMeter | None:
    """Return the meter active in this thread, or the open meter whose dispatch mode this thread runs under."""
    meter = getattr(_ACTIVE, "meter", None)
    if meter is not None:
        return meter
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, MemoryMeter) and mode._open:
            return mode
    return None


@dataclass
class FitResult:
    """Whether a piece of work fitted the memory, and its value or the out-of-memory error it raised."""

    fits: bool  # True when no out-of-memory error was raised
    value: object = None  # what the work returned (None when it did not fit)
    error: torch.OutOfMemoryError | None = None  # labkit's OutOfMemory (budget) or the allocator's own error


def try_fit(fn, *args, **kwargs) -> FitResult:
    """Call `fn`; turn an out-of-memory error (budget or allocator) into FitResult(fits=False), releasing memory."""
    import gc
    try:
        return FitResult(True, fn(*args, **kwargs))
    except torch.OutOfMemoryError as e:
        err = e.with_traceback(None)  # the traceback's frames hold the step's tensors
        err.__context__ = err.__cause__ = None  # and so do those of the exceptions it was chained to
    gc.collect()  # outside the except block: the exception being handled no longer pins anything
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return FitResult(False, None, err)
