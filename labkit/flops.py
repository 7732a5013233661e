"""Count the floating-point operations, and the bytes operators read and write, of a piece of training code."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry


def _tensor_bytes(values) -> int:
    """Return the bytes of the tensors among `values`, nested lists and tuples included (an operator's arguments)."""
    return sum(v.numel() * v.element_size() for v in tree_leaves(list(values)) if isinstance(v, torch.Tensor))


class OpCounter(TorchDispatchMode):
    """Add up torch's FLOP formulas and each operator's bytes read and written; no module hooks (L2L, recomputation).

    Bytes are counted while `counting_bytes` is True: an operator reads its tensor inputs and writes its outputs
    once each (no fusion, no cache); views move nothing and are left out.
    """

    def __init__(self):
        super().__init__()
        self.flops = 0
        self.bytes_accessed = 0
        self.counting_bytes = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        if self.counting_bytes and not func.is_view:
            self.bytes_accessed += _tensor_bytes(args) + _tensor_bytes(kwargs.values()) + _tensor_bytes((out,))
        return out


def count_flops(fn, *args, **kwargs) -> int:
    """Return the FLOPs that `fn(*args, **kwargs)` runs (forward, backward and recomputation alike)."""
    with OpCounter() as counter:
        fn(*args, **kwargs)
    return counter.flops
