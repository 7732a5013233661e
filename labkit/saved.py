"""A census of what autograd saves for backward: every saved tensor, its bytes, its storage and its kind."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit.validate import check_choice

KINDS = ("parameter", "weight copy", "activation")  # a parameter or a view of one; a cast of one (autocast's); the rest
_PLURAL = {"parameter": "parameters", "weight copy": "weight copies", "activation": "activations"}
SHORT_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
                     torch.int64: "int64", torch.int32: "int32", torch.bool: "bool"}


def short_dtype_name(dtype: torch.dtype) -> str:
    """Return "fp32", "bf16", ... for a dtype (torch's own name for the others)."""
    return SHORT_DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd saved for backward."""

    nbytes: int  # the tensor's own bytes: numel × element size
    shape: tuple  # its shape
    dtype: torch.dtype  # its dtype
    kind: str  # one of KINDS
    storage: tuple  # (data pointer, bytes) of its storage: equal for views of one storage
    storage_nbytes: int  # bytes of its whole storage


class Census(tuple):
    """The tensors one run saved for backward, in the order autograd saved them."""

    def where(self, kind: str, min_bytes: int = 0, max_bytes: int | None = None) -> "Census":
        """Return the saved tensors of one kind with min_bytes <= nbytes <= max_bytes."""
        check_choice("kind", kind, KINDS)
        return Census(s for s in self if s.kind == kind and s.nbytes >= min_bytes
                      and (max_bytes is None or s.nbytes <= max_bytes))

    @property
    def nbytes(self) -> int:
        """Return the bytes of the saved tensors, tensor by tensor (a storage saved twice counts twice)."""
        return sum(s.nbytes for s in self)

    @property
    def storage_nbytes(self) -> int:
        """Return the bytes of the distinct storages behind the saved tensors (each storage once)."""
        return sum(dict((s.storage, s.storage_nbytes) for s in self).values())

    def by_dtype_kind(self) -> dict[str, int]:
        """Return distinct-storage bytes by "<dtype> <kind>s", e.g. "bf16 weight copies", sorted by name."""
        out: dict[str, int] = {}
        seen: set = set()
        for s in self:
            if s.storage not in seen:
                seen.add(s.storage)
                name = f"{short_dtype_name(s.dtype)} {_PLURAL[s.kind]}"
                out[name] = out.get(name, 0) + s.storage_nbytes
        return dict(sorted(out.items()))


def _is_weight_copy(t: torch.Tensor, param_ids: set) -> bool:
    """Tell whether `t` is a cast (possibly transposed/viewed) of a parameter, e.g. autocast's bf16 weight."""
    fn = t.grad_fn
    for _ in range(4):
        if fn is None:
            return False
        name = type(fn).__name__
        if name.startswith("ToCopyBackward"):
            nxt = fn.next_functions[0][0] if fn.next_functions else None
            return nxt is not None and id(getattr(nxt, "variable", None)) in param_ids
        if not name.startswith(("TBackward", "TransposeBackward", "PermuteBackward", "ViewBackward",
                                 "ExpandBackward", "UnsqueezeBackward")):
            return False
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return False


def saved_tensor_census(model: torch.nn.Module, fn: Callable[[], object]) -> Census:
    """Run fn() (a forward of `model`) and list every tensor autograd saves for backward; fn's result is dropped."""
    params = list(model.parameters())
    param_ids = {id(p) for p in params}
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    seen: list[SavedTensor] = []

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() in param_storages:
            kind = "parameter"
        elif _is_weight_copy(t, param_ids):
            kind = "weight copy"
        else:
            kind = "activation"
        seen.append(SavedTensor(t.numel() * t.element_size(), tuple(t.shape), t.dtype, kind,
                                (st.data_ptr(), st.nbytes()), st.nbytes()))
        return t.detach()  # not t: a saved output holding its own grad_fn is a cycle gc cannot see (a leak
        #                    when no backward runs); the detached alias shares the storage and breaks it

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()  # everything it saved stays alive (distinct storages) until the census is taken
    del result
    return Census(seen)
