"""Count what a rank hands to collectives and point-to-point sends (via the dispatcher): calls and bytes, by kind."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# (kind, the argument holding this rank's input tensors) -> operator names; every c10d operator of torch 2.13
# is here or in NOT_COMMUNICATION: CommCounter refuses one it does not know
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


class CommCounter(TorchDispatchMode):
    """Count collective and point-to-point calls and the bytes of their input tensors, by kind."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}  # kind -> calls
        self.bytes: dict[str, int] = {}  # kind -> bytes of the tensors handed over

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional"):
            name = func.overloadpacket.__name__
            if name == "batch_p2p_ops":  # (ops, peers, tags, tensors): each "isend"/"irecv" with its tensor
                for op, t in zip(args[0], args[3]):
                    self._add("send" if op == "isend" else "recv", _nbytes(t))
            elif name in COLLECTIVES:
                kind, arg = COLLECTIVES[name]
                self._add(kind, _nbytes(args[arg]) if len(args) > arg else 0)
            elif name not in NOT_COMMUNICATION:
                raise NotImplementedError(f"CommCounter does not know the operator {namespace}::{name}; add it to "
                                          "labkit.dist.comm.COLLECTIVES (its kind and input argument) to count it")
        return func(*args, **(kwargs or {}))

    def _add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes

    def wire_bytes(self, world_size: int) -> float:
        """Return the bytes this rank sends with ring algorithms on `world_size` ranks (receiving counts nothing)."""
        n = world_size
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1, "reduce_scatter": (n - 1) / n,
                  "broadcast": (n - 1) / n, "scatter": (n - 1) / n, "all_to_all": (n - 1) / n, "send": 1.0,
                  "recv": 0.0, "reduce": (n - 1) / n, "gather": 1.0}  # gather: what a rank other than the root sends
        return sum(factor[kind] * nbytes for kind, nbytes in self.bytes.items())


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(u) for u in t)
    return 0
