"""Compare two trainings: gradients and parameters, absolute and relative, one definition of each.

    g_ref = grads(model)                      # {name: copy of .grad, or None}
    ...                                       # run the technique on a copy of the model
    max_abs_diff(grads(other), g_ref)         # largest |a - b| over every element
    max_rel_diff(grads(other), g_ref)         # largest ||a - b|| / ||b|| over tensors (b: the reference)
    max_grad_diff(model_a, model_b, relative=True)   # the same, straight from two models
    max_param_diff(model_a, model_b)
    flat(model)                               # its parameters as one flat copy, in order (flat(grads(model)))

The absolute difference is taken in the tensors' own dtype (the difference of two fp32 values is
exact in fp32 when they are close). The relative difference is **norm-wise per tensor**, computed
in float64: ||a - b||_2 / ||b||_2 with a floor of 1e-12 on the denominator. Elementwise ratios would blow up on entries near zero in
both; an absolute difference depends on the gradients' scale. A tensor that exists on one side
and is None (no gradient) on the other makes the difference infinite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

FLOOR = 1e-12  # denominator floor of the relative difference (an all-zero reference tensor)

Tensors = torch.Tensor | Mapping[str, torch.Tensor | None] | Sequence[torch.Tensor | None]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Return a copy of every parameter's gradient by name (None where it has none)."""
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Return a copy of every parameter by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def flat(tensors: torch.nn.Module | Tensors | Iterable[torch.Tensor | None]) -> torch.Tensor:
    """Return a model's parameters, or tensors (a dict's values, a sequence; None skipped), as one flat copy in order."""
    if isinstance(tensors, torch.nn.Module):
        tensors = tensors.parameters()
    elif isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    elif isinstance(tensors, Mapping):
        tensors = tensors.values()
    parts = [t.detach().flatten() for t in tensors if t is not None]
    if not parts:
        raise ValueError("flat needs at least one tensor, got none")
    return torch.cat(parts)  # a new tensor, never a view of the inputs


def _pairs(a: Tensors, b: Tensors) -> list[tuple]:
    """Return matching (a_i, b_i) pairs of two tensors, two dicts with equal keys or two equal-length sequences."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [(a, b)]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if a.keys() != b.keys():
            raise ValueError(f"the two sets of tensors differ in names: {sorted(set(a) ^ set(b))}")
        return [(a[k], b[k]) for k in b]
    if isinstance(a, Sequence) and isinstance(b, Sequence) and not isinstance(a, (str, Mapping)):
        if len(a) != len(b):
            raise ValueError(f"the two sets of tensors differ in length: {len(a)} vs {len(b)}")
        return list(zip(a, b))
    raise TypeError(f"compare two tensors, two dicts or two sequences of tensors, got {type(a).__name__} "
                    f"and {type(b).__name__}")


def _checked(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape != y.shape:
        raise ValueError(f"cannot compare tensors of shapes {tuple(x.shape)} and {tuple(y.shape)}")
    return x.detach(), y.detach().to(x.device)


def _worst(a: Tensors, b: Tensors, diff) -> float:
    """Return the largest diff(a_i, b_i) over matching tensors: 0 where both are None, inf where one is."""
    worst = 0.0
    for x, y in _pairs(a, b):
        if x is None or y is None:
            if (x is None) != (y is None):
                return math.inf
            continue
        worst = max(worst, diff(x, y))
    return worst


def abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Return the largest elementwise |a - b|, in the tensors' own (promoted) dtype (0 for empty tensors)."""
    x, y = _checked(a, b)
    return float((x - y).abs().max()) if x.numel() else 0.0


def rel_diff(a: torch.Tensor, b: torch.Tensor, floor: float = FLOOR) -> float:
    """Return ||a - b||_2 / max(||b||_2, floor) in float64 (b is the reference)."""
    x, y = (t.double() for t in _checked(a, b))
    return float(torch.linalg.vector_norm(x - y)) / max(float(torch.linalg.vector_norm(y)), floor)


def max_abs_diff(a: Tensors, b: Tensors) -> float:
    """Return the largest elementwise |a - b| over all matching tensors (inf where one side is None)."""
    return _worst(a, b, abs_diff)


def max_rel_diff(a: Tensors, b: Tensors, floor: float = FLOOR) -> float:
    """Return the largest per-tensor rel_diff(a_i, b_i) over matching tensors (inf where one side is None)."""
    return _worst(a, b, lambda x, y: rel_diff(x, y, floor))


def max_grad_diff(model_a: torch.nn.Module, model_b: torch.nn.Module, relative: bool = False) -> float:
    """Return max_abs_diff (or max_rel_diff) of the two models' gradients; model_b is the reference."""
    fn = max_rel_diff if relative else max_abs_diff
    return fn(_live(model_a, "grad"), _live(model_b, "grad"))


def max_param_diff(model_a: torch.nn.Module, model_b: torch.nn.Module, relative: bool = False) -> float:
    """Return max_abs_diff (or max_rel_diff) of the two models' parameters; model_b is the reference."""
    fn = max_rel_diff if relative else max_abs_diff
    return fn(_live(model_a, "param"), _live(model_b, "param"))


def _live(model: torch.nn.Module, what: str) -> dict:
    """Return the model's parameters (or their .grad) by name, without copying."""
    return {name: (p if what == "param" else p.grad) for name, p in model.named_parameters()}
