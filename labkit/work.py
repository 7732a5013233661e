"""Count a step's work in what does not depend on the machine: FLOPs by precision, bytes, kernels, host and peer bytes.

Every chapter counts its technique's cost this way (chapter 00 introduces it) and `labkit.gpus` turns the count into
a time on a GPU; the planner counts its fake steps alike. One `WorkCounter` (a dispatch mode) sees every operator:
- FLOPs from torch's own formulas (torch.utils.flop_counter; the CPU's fused attention too), keyed by the precision
  the operator computes in (the dtype of its floating-point inputs: bf16 and fp16 matmuls run on tensor cores, fp32 ones do not);
- bytes operators read and write, each tensor once per operator (no fusion, no cache), views left out; an in-place
  operator's written tensors once (copy_'s destination is written, not read; a foreach update's list both);
- kernels: operators that move or compute data (a GPU launches one kernel or more for each) and host copies;
- bytes over the host link: every copy of `labkit.techniques.hosttier` (to_host, to_device) reports itself here;
- bytes handed to collectives and point-to-point sends, by kind, and the bytes a rank sends with ring algorithms.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import SUPPORTED_NODES
from torch.utils.flop_counter import flop_registry, shape_wrapper

from labkit.meter import fake_device

aten = torch.ops.aten
# torch's formulas, and the CPU's fused attention (what SDPA runs on a CPU, fake tensors included), which torch's
# registry leaves out: it takes the CUDA flash kernel's leading arguments, so the same formulas count it
FORMULAS = {**flop_registry,
            aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
                flop_registry[aten._scaled_dot_product_flash_attention_backward]}
_SHAPE_WRAPPED = shape_wrapper(lambda: 0).__code__  # the code of torch's wrapper that turns tensors into shapes
_SHAPED = {op: f.__wrapped__ for op, f in FORMULAS.items() if getattr(f, "__code__", None) is _SHAPE_WRAPPED}
#   (the formulas behind that wrapper, called with the shapes taken here: torch's wrapper maps every argument through
#   its pytree; without it chapter 02's segment sweep took 6% less CPU, 2026-12-05)
_OTHER = object()  # (_shapes: a container torch's pytree maps and _shapes does not)
PRECISION_OF = {torch.float32: "fp32", torch.float64: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "lift_fresh",
             "_local_scalar_dense", "_unsafe_view"}  # operators that allocate, alias or read a scalar without launching
#   a kernel (_unsafe_view: matmul's reshape of its bmm output, a view that autograd does not track as one)
WRITE_ONLY = {"copy_", "fill_", "zero_", "uniform_", "normal_", "bernoulli_", "random_", "exponential_"}  # in-place
#   operators that write their first argument without reading it: its bytes count once, as the output

# (kind, the argument holding this rank's input tensors) -> operator names; every c10d operator of torch 2.13
# is here or in NOT_COMMUNICATION: WorkCounter refuses one it does not know
_OPERATORS = {("all_reduce", 0): "allreduce_ all_reduce all_reduce_ allreduce_coalesced_ all_reduce_coalesced "
                                 "all_reduce_coalesced_",
              ("all_gather", 1): "allgather_ _allgather_base_ allgather_coalesced_ allgather_into_tensor_coalesced_",
              ("all_gather", 0): "all_gather_into_tensor all_gather_into_tensor_out all_gather_into_tensor_coalesced",
              ("reduce_scatter", 1): "reduce_scatter_ _reduce_scatter_base_ reduce_scatter_tensor_coalesced_",
              ("reduce_scatter", 0): "reduce_scatter_tensor reduce_scatter_tensor_out reduce_scatter_tensor_coalesced",
              ("broadcast", 0): "broadcast_ broadcast", ("reduce", 0): "reduce_", ("send", 0): "send isend",
              ("recv", 0): "recv_ irecv recv_any_source_", ("scatter", 1): "scatter_", ("gather", 1): "gather_",
              ("all_to_all", 1): "alltoall_ alltoall_base_", ("all_to_all", 0): "all_to_all_single"}
COLLECTIVES = {name: kind for kind, names in _OPERATORS.items() for name in names.split()}  # operator -> (kind, arg)
NOT_COMMUNICATION = {"barrier", "monitored_barrier_", "check_for_nan", "wait_tensor",  # no payload to count
                     "_wrap_tensor_autograd"}


def ring_factor(kind: str, world_size: int) -> float:
    """Return the bytes a rank sends per byte it hands to a `kind` collective, with ring algorithms on `world_size`."""
    n = world_size
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1, "reduce_scatter": (n - 1) / n,
            "broadcast": (n - 1) / n, "scatter": (n - 1) / n, "all_to_all": (n - 1) / n, "send": 1.0,
            "recv": 0.0, "reduce": (n - 1) / n, "gather": 1.0}[kind]  # gather: what a rank other than the root sends


def _nbytes(values) -> int:
    """Return the bytes of the tensors among `values`, nested lists and tuples included (an operator's arguments)."""
    total = 0
    for v in values:  # (a loop, not torch's tree_leaves: this runs for every operator of every fake step)
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, (list, tuple)):
            total += _nbytes(v)
    return total


def _shapes(value):
    """Return `value` with every tensor replaced by its shape, inside lists and tuples too (what torch's shape_wrapper
    gives a formula); _OTHER where it holds another pytree container (a formula then takes torch's own wrapper)."""
    if isinstance(value, torch.Tensor):
        return value.shape
    kind = type(value)
    if kind is list or kind is tuple:
        out = kind(_shapes(v) for v in value)
        return _OTHER if any(o is _OTHER for o in out) else out
    return _OTHER if isinstance(value, (dict, list, tuple)) or kind in SUPPORTED_NODES else value


def _flops(func, args, kwargs, out) -> int:
    """Return torch's formula's FLOPs for `func` (a shape-wrapped formula called with the shapes taken here)."""
    raw = _SHAPED.get(func.overloadpacket)
    if raw is not None:
        shaped, out_shape, kw = _shapes(args), _shapes(out), _shapes(tuple(kwargs.values()))
        if shaped is not _OTHER and out_shape is not _OTHER and kw is not _OTHER:
            return int(raw(*shaped, out_shape=out_shape, **dict(zip(kwargs, kw))))
    return int(FORMULAS[func.overloadpacket](*args, **kwargs, out_val=out))


def _precision(args) -> str:
    """Return the precision an operator computes in: that of its first floating-point tensor input (fp32 if none)."""
    for v in args:
        if isinstance(v, (list, tuple)):
            v = next((u for u in v if isinstance(u, torch.Tensor) and u.is_floating_point()), None)
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return PRECISION_OF.get(v.dtype, "fp32")
    return "fp32"


@dataclass(frozen=True)
class Work:
    """What one piece of training code did, counted: the same on every machine."""

    flops: dict = field(default_factory=dict)  # FLOPs by precision ("fp32", "bf16", "fp16"), torch's formulas
    bytes_accessed: int = 0  # bytes operators read and write (each tensor once per operator: no fusion, no cache)
    kernels: int = 0  # operators that move or compute data (a GPU launches at least one kernel for each), host copies
    host_bytes: int = 0  # bytes over the host link, both directions (labkit.techniques.hosttier's copies)
    sent_bytes: float = 0.0  # bytes this rank sends to others (ring algorithms; sends)

    @property
    def total_flops(self) -> int:
        """Return the FLOPs of every precision together."""
        return sum(self.flops.values())

    def __add__(self, other: "Work") -> "Work":
        flops = dict(self.flops)
        for p, n in other.flops.items():
            flops[p] = flops.get(p, 0) + n
        return Work(flops, self.bytes_accessed + other.bytes_accessed, self.kernels + other.kernels,
                    self.host_bytes + other.host_bytes, self.sent_bytes + other.sent_bytes)

    def __mul__(self, k: float) -> "Work":
        """Return this work done `k` times (k micro-batches, say)."""
        return Work({p: n * k for p, n in self.flops.items()}, self.bytes_accessed * k, self.kernels * k,
                    self.host_bytes * k, self.sent_bytes * k)

    __rmul__ = __mul__


_ACTIVE: list = []  # the WorkCounters entered now, innermost last: hosttier's copies report to each


@contextlib.contextmanager
def host_copy(nbytes: int):
    """Count `nbytes` over the host link and one kernel in every active WorkCounter; the copy is not device traffic.

    labkit.techniques.hosttier's to_host and to_device run their copy inside it. The copy is one launch (a cudaMemcpyAsync),
    counted among the kernels while the counter counts them; its bytes count as host bytes, not bytes moved.
    """
    was = [(counter, counter.counting_bytes) for counter in _ACTIVE]
    for counter, counting in was:
        counter.host_bytes += nbytes
        counter.kernels += int(counting)  # the copy's launch: the host pays for it like an operator's
        counter.counting_bytes = False
    try:
        yield
    finally:
        for counter, counting in was:
            counter.counting_bytes = counting


_DTENSOR = None  # DTensor's class, once torch.distributed.tensor is imported (0.6 s of a process's start: not here)
_WRITTEN: dict = {}  # operator -> the positions of the arguments it writes in place and does not return


def _dtensor_class():
    """Return DTensor's class, or None while torch.distributed.tensor is not imported (then no tensor is one)."""
    global _DTENSOR
    if _DTENSOR is None:
        _DTENSOR = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return _DTENSOR


@contextlib.contextmanager
def _pushed(mode):
    """Put `mode` back on the dispatch mode stack while it handles an operator (torch pops it for its handler)."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode
    _push_mode(mode)
    try:
        yield
    finally:
        _pop_mode()


def _written_in_place(func) -> tuple:
    """Return the positions of the arguments an operator that returns nothing writes (its schema's `a!` annotations):
    the foreach updates' first list, fused Adam's parameters and moments (not its gradients, written only when it
    unscales them)."""
    if func not in _WRITTEN:
        _WRITTEN[func] = tuple(i for i, a in enumerate(func._schema.arguments)
                               if a.alias_info is not None and a.alias_info.is_write and a.name != "grads")
    return _WRITTEN[func]


class WorkCounter(TorchDispatchMode):
    """Count FLOPs by precision, bytes read and written, kernels, host-link bytes and collectives' bytes by kind.

    Bytes and kernels are counted while `counting_bytes` is True (the planner leaves the optimizer step out).
    `world_size`: the ranks a collective spans, for `work().sent_bytes` (default: the process group's, else 1).
    """

    def __init__(self, world_size: int | None = None):
        super().__init__()
        self.flops: dict[str, int] = {}  # precision -> FLOPs
        self.bytes_accessed = 0
        self.kernels = 0
        self.host_bytes = 0
        self.calls: dict[str, int] = {}  # collective kind -> calls
        self.bytes: dict[str, int] = {}  # collective kind -> bytes of the tensors handed over
        self.counting_bytes = True
        self.world_size = world_size
        self._in_dtensor = False  # inside a DTensor's operator (WorkCounter._on_shards)
        self._under_fake = False  # entered under a FakeTensorMode (the planner's fake steps): fake tensors are the work

    def __enter__(self):
        from torch._guards import detect_fake_mode
        self._under_fake = detect_fake_mode() is not None
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtensor = None if self._under_fake else _dtensor_class()
        if dtensor is not None and any(issubclass(t, dtensor) for t in types):
            return self._on_shards(func, args, kwargs)  # (the planner's fake steps: as before, the global shape, where
            #                                              it counts no bytes: FSDP2's optimizer step)
        if self._in_dtensor and any(issubclass(t, FakeTensor) for t in types):  # (set on real tensors only)
            return func(*args, **(kwargs or {}))  # a DTensor's sharding propagation at its global shape: no work
        kwargs = kwargs or {}
        if func.namespace == "prim":  # metadata queries (prim.device: fake tensors ask it): no data, no kernel
            device = fake_device(func, args)
            return device if device is not None else func(*args, **kwargs)
        if func.namespace == "profiler":  # record_function's markers (every optimizer step has two): no kernel
            return func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional"):
            self._communication(func, args)
            if self.counting_bytes and func.overloadpacket.__name__ not in NOT_COMMUNICATION:
                self.kernels += 1  # a collective is a launch too (NCCL runs it as a kernel)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if func.overloadpacket in FORMULAS:
            p = _precision(args)
            self.flops[p] = self.flops.get(p, 0) + _flops(func, args, kwargs, out)
        if self.counting_bytes and not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL:
            read = args[1:] if func.overloadpacket.__name__ in WRITE_ONLY else args
            written = (out,) if out is not None else [args[i] for i in _written_in_place(func) if i < len(args)]
            self.bytes_accessed += _nbytes(read) + _nbytes(kwargs.values()) + _nbytes(written)
            self.kernels += 1
        return out

    def _on_shards(self, func, args, kwargs):
        """Run a DTensor's operator as the DTensor runs it, this counter seeing what it runs: the operator on this
        rank's shards and the collectives it issues are counted (its global shape is not what this rank computes);
        its sharding propagation on fake tensors of the global shape is not (where this counter counts real tensors)."""
        if self._in_dtensor:
            return NotImplemented  # (this counter again, below: the DTensor's own __torch_dispatch__ runs it)
        self._in_dtensor = True
        try:
            with _pushed(self):
                return func(*args, **(kwargs or {}))
        finally:
            self._in_dtensor = False

    def _communication(self, func, args) -> None:
        name = func.overloadpacket.__name__
        if name == "batch_p2p_ops":  # (ops, peers, tags, tensors): each "isend"/"irecv" with its tensor
            for op, t in zip(args[0], args[3]):
                self._add("send" if op == "isend" else "recv", _nbytes([t]))
        elif name in COLLECTIVES:
            kind, arg = COLLECTIVES[name]
            self._add(kind, _nbytes([args[arg]]) if len(args) > arg else 0)
        elif name not in NOT_COMMUNICATION:
            raise NotImplementedError(f"WorkCounter does not know the operator {func.namespace}::{name}; add it to "
                                      "labkit.work.COLLECTIVES (its kind and input argument) to count it")

    def _add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes

    def wire_bytes(self, world_size: int) -> float:
        """Return the bytes this rank sends with ring algorithms on `world_size` ranks (receiving counts nothing)."""
        return sum(ring_factor(kind, world_size) * nbytes for kind, nbytes in self.bytes.items())

    def work(self) -> Work:
        """Return what was counted so far as a Work."""
        world_size = self.world_size
        if world_size is None:
            import torch.distributed as dist
            world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return Work(dict(self.flops), self.bytes_accessed, self.kernels, self.host_bytes,
                    self.wire_bytes(world_size) if self.bytes else 0.0)


def count_work(fn, *args, **kwargs) -> Work:
    """Return the Work that `fn(*args, **kwargs)` does (forward, backward, recomputation and optimizer alike)."""
    with WorkCounter() as counter:
        fn(*args, **kwargs)
    return counter.work()
