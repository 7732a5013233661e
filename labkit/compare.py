"""Compare two trainings' gradients and parameters: largest absolute and norm-wise relative differences."""

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
        worst = max(worst, diff(*_checked(x, y)))
    return worst


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Return ||a - b||_2 / max(||b||_2, FLOOR) in float64 (b is the reference)."""
    x, y = (t.double() for t in _checked(a, b))
    return float(torch.linalg.vector_norm(x - y)) / max(float(torch.linalg.vector_norm(y)), FLOOR)


def max_abs_diff(a: Tensors, b: Tensors) -> float:
    """Return the largest elementwise |a - b| over all matching tensors, in their own (promoted) dtype (inf: one None)."""
    return _worst(a, b, lambda x, y: float((x - y).abs().max()) if x.numel() else 0.0)


def max_rel_diff(a: Tensors, b: Tensors) -> float:
    """Return the largest per-tensor rel_diff(a_i, b_i) over matching tensors (inf where one side is None)."""
    return _worst(a, b, rel_diff)


def max_grad_diff(model_a: torch.nn.Module, model_b: torch.nn.Module, relative: bool = False) -> float:
    """Return max_abs_diff (or max_rel_diff) of the two models' gradients; model_b is the reference."""
    return _max_diff(model_a, model_b, relative, lambda p: p.grad)


def max_param_diff(model_a: torch.nn.Module, model_b: torch.nn.Module, relative: bool = False) -> float:
    """Return max_abs_diff (or max_rel_diff) of the two models' parameters; model_b is the reference."""
    return _max_diff(model_a, model_b, relative, lambda p: p)


def _max_diff(model_a: torch.nn.Module, model_b: torch.nn.Module, relative: bool, pick) -> float:
    """Return the largest difference of `pick(p)` over the two models' parameters, by name, without copying."""
    a, b = ({name: pick(p) for name, p in m.named_parameters()} for m in (model_a, model_b))
    return max_rel_diff(a, b) if relative else max_abs_diff(a, b)
