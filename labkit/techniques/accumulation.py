"""Gradient accumulation: k micro-batches, one optimizer step, the full batch's gradient (chapter 01's reference).

`normalise`: "mean" weighs each mean loss by its rows, "tokens" divides summed losses by the batch's real
tokens, "naive" divides each mean loss by k (the transformers #24725 bug, kept to measure its error).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from labkit.models import IGNORE_INDEX, count_tokens
from labkit.validate import ParameterError, check_choice, check_int, check_int_list

NORMALISATIONS = ("mean", "tokens", "naive")


def split_sizes(batch_size: int, micro_batch_size: int) -> list[int]:
    """Return the rows of each micro-batch: full ones of `micro_batch_size`, then a ragged remainder."""
    check_int("micro_batch_size", micro_batch_size, 1)
    check_int("batch_size", batch_size, 1)
    full, rest = divmod(batch_size, micro_batch_size)
    return [micro_batch_size] * full + ([rest] if rest else [])


def check_accum_steps(name: str, ks, batch: int | None = None, top: int = 64) -> list[int]:
    """Check a sweep of accumulation steps k (chapters 01 and 05): increasing, from 1 (the plain step, to compare
    with) up to `top`; with `batch`, each k realisable as micro-batches of ceil(batch / k) rows."""
    ks = check_int_list(name, ks, 1, batch or top, min_len=2, increasing=True)
    if ks[0] != 1:
        raise ParameterError(f"{name} must be a sweep starting at 1 (the plain step, to compare with), got {ks!r}")
    if batch is not None:  # batch 16, k = 5: micro-batches of 4 rows, so 4 of them
        realisable = sorted({math.ceil(batch / math.ceil(batch / k)) for k in range(1, batch + 1)})
        for k in ks:
            if k not in realisable:
                raise ParameterError(
                    f"{name} contains k={k}, which BATCH={batch} cannot realise: micro-batches of ceil({batch}/{k}) = "
                    f"{math.ceil(batch / k)} rows give {math.ceil(batch / math.ceil(batch / k))} micro-batches. "
                    f"Realisable k for BATCH={batch}: {realisable}")
    return ks


def split_batch(batch: Sequence[torch.Tensor], micro_batch_size: int) -> list[tuple]:
    """Split every tensor of a batch along dim 0 into micro-batches (the last may be shorter)."""
    check_int("micro_batch_size", micro_batch_size, 1)
    if not isinstance(batch, (tuple, list)) or not batch:
        raise ValueError("batch must be a non-empty tuple of tensors (inputs, targets)")
    rows = {t.shape[0] for t in batch if isinstance(t, torch.Tensor)}
    if len(rows) != 1:
        raise ValueError(f"the batch's tensors must share their first dimension, got sizes {sorted(rows)}")
    if rows == {0}:
        raise ValueError("batch has no rows")
    parts = [t.split(micro_batch_size) if isinstance(t, torch.Tensor) else None for t in batch]
    n = len(next(p for p in parts if p is not None))
    return [tuple(t if p is None else p[i] for t, p in zip(batch, parts)) for i in range(n)]


def accumulate_gradients(model: torch.nn.Module, batch: Sequence[torch.Tensor], micro_batch_size: int,
                         normalise: str = "mean") -> torch.Tensor:
    """Add the gradient of batch (inputs..., targets) to .grad, one micro-batch at a time; return the batch loss."""
    check_choice("normalise", normalise, NORMALISATIONS)
    micro_batches = split_batch(batch, micro_batch_size)
    tokens = None
    if normalise == "tokens":
        tokens = count_tokens(batch[-1])  # the whole batch's real tokens, counted once
        if tokens == 0:
            raise ValueError("normalise='tokens': the batch holds no real tokens (every target is ignore_index)")
    total = torch.zeros((), device=batch[-1].device)
    for mb in micro_batches:  # each part is normalised so that the parts add up to the batch's loss
        if normalise == "tokens":
            *inputs, targets = mb
            out = model(*inputs)
            logits = out[0] if isinstance(out, (tuple, list)) else out  # (..., V)
            part = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum") / tokens
        else:
            _, mean_loss = model(*mb)
            n = len(micro_batches)
            part = mean_loss * (mb[0].shape[0] / batch[0].shape[0]) if normalise == "mean" else mean_loss / n
        part.backward()
        total += part.detach()
    return total


def accumulation_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence[torch.Tensor],
                      micro_batch_size: int, normalise: str = "mean") -> torch.Tensor:
    """Run one optimizer step on a batch through micro-batches; return the detached batch loss."""
    optimizer.zero_grad(set_to_none=True)
    total = accumulate_gradients(model, batch, micro_batch_size, normalise=normalise)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def make_accumulation_step(micro_batch_size: int, normalise: str = "mean") -> Callable:
    """Return step_fn(model, optimizer, batch) that accumulates over micro-batches (for measure_step)."""
    check_int("micro_batch_size", micro_batch_size, 1)
    check_choice("normalise", normalise, NORMALISATIONS)
    return functools.partial(accumulation_step, micro_batch_size=micro_batch_size, normalise=normalise)
