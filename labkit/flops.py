"""Count the floating-point operations a piece of training code runs."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


class _FlopCounter(TorchDispatchMode):
    """Add up the FLOPs of the operators torch's flop counter knows; no module hooks (so L2L and recomputation work)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out


def count_flops(fn, *args, **kwargs) -> int:
    """Return the FLOPs that `fn(*args, **kwargs)` runs (forward, backward and recomputation alike)."""
    with _FlopCounter() as counter:
        fn(*args, **kwargs)
    return counter.flops
