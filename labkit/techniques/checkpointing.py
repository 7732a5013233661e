"""Activation checkpointing (Chen et al. 2016): keep each segment's input, recompute its inside in backward.

Chapter 02: a tested reference (labkit.techniques).
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from labkit.autocast_ops import recompute_context_fn
from labkit.models import blocks_name
from labkit.validate import ParameterError, check_int

MATMUL_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
"""Operators whose outputs selective checkpointing keeps by default (the expensive ones)."""


def segment_sizes(n_blocks: int, segments: int) -> list[int]:
    """Split n blocks into `segments` contiguous runs, sizes differing by at most one, larger first."""
    check_int("n_blocks", n_blocks, 1)
    check_int("segments", segments, 1, n_blocks)
    q, r = divmod(n_blocks, segments)
    return [q + 1] * r + [q] * (segments - r)


def torch_segment_sizes(n_blocks: int, segments: int) -> list[int]:
    """Return the segment sizes `torch.utils.checkpoint.checkpoint_sequential` uses (remainder last)."""
    segment_sizes(n_blocks, segments)  # same argument checks
    size = n_blocks // segments
    return [size] * (segments - 1) + [n_blocks - size * (segments - 1)]


def selective_policy(save_ops=MATMUL_OPS):
    """Return a policy for torch's selective checkpoint: save outputs of `save_ops`, recompute the rest."""
    save_ops = tuple(save_ops)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def torchtitan_2024_save_list() -> frozenset:
    """Return the ops whose outputs torchtitan's op-level policy kept in December 2024, when it published its Llama 3.1
    8B benchmark (`_save_list`, torchtitan/parallelisms/parallelize_llama.py): mm, CUDA's flash and memory-efficient
    SDPA kernels, reduce-scatter and max. op_level_policy keeps torch's compute-intensive ops instead (bmm among
    them); with the flash kernel and bias-free linears a llama block keeps the same tensors under either (tests)."""
    aten = torch.ops.aten
    return frozenset({aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
                      aten._scaled_dot_product_flash_attention.default,
                      torch.ops._c10d_functional.reduce_scatter_tensor.default, aten.max.default})


def op_level_policy():
    """Return torchtitan's op-level selective checkpointing policy, fresh for one block's call (its SelectiveAC at
    pytorch/torchtitan b5bcd76, torchtitan/distributed/activation_checkpoint.py): keep the outputs of the ops torch's
    partitioner calls compute-intensive (matmuls, CUDA's SDPA kernels), of max and of reduce-scatter, but recompute
    every second mm or linear, counted apart in forward and in recomputation (addmm, a matmul with a bias, is kept
    every time: it is compute-intensive and not counted); recompute the rest. (Its MoE rules, a
    router's matmuls and device-to-host copies, are left out: no MoE here.)"""
    from torch._functorch.partitioners import get_default_op_list
    aten = torch.ops.aten
    save = {op.default for op in get_default_op_list().compute_intensive_ops}
    save |= {aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_attention_math.default,
             aten.max.default, aten.linear.default, aten.topk.default,
             torch.ops._c10d_functional.reduce_scatter_tensor.default}
    mm_ops = (aten.mm.default, aten.linear.default)
    counts = {False: 0, True: 0}  # mm/linear calls in forward (False) and in recomputation (True)

    def policy(ctx, op, *args, **kwargs):
        if op in mm_ops:
            counts[ctx.is_recompute] += 1
        if op in save and not (op in mm_ops and counts[ctx.is_recompute] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


class CheckpointedSequential(nn.Sequential):
    """An nn.Sequential that checkpoints its blocks in `segments` runs (all but the last, by default), or (every=k > 1)
    every k-th block alone, the others kept whole."""

    def __init__(self, *blocks: nn.Module, segments: int, checkpoint_last: bool = False, selective: bool = False,
                 op_level: bool = False, every: int = 1):
        super().__init__(*blocks)
        check_int("every", every, 1, len(blocks))
        if every > 1 and (segments != len(blocks) or not checkpoint_last or selective or op_level):
            raise ParameterError(f"every: {every} (layer-level checkpointing) takes segments = the {len(blocks)} blocks, "
                                 "checkpoint_last=True (its rule decides the last block too) and no selective policy")
        self.sizes = segment_sizes(len(blocks), segments)
        self.checkpoint_last = bool(checkpoint_last)
        self.every = every  # (> 1) torchtitan's layer-level selective: block i (from 0) checkpointed iff
        #                     (i + 1) % every == 0
        if op_level:  # torchtitan's policy counts its matmuls: a fresh one for every call
            self.context_fn = lambda: create_selective_checkpoint_contexts(op_level_policy())
        else:
            self.context_fn = (functools.partial(create_selective_checkpoint_contexts, selective_policy())
                               if selective else None)
        self.op_level = op_level

    def __getitem__(self, idx):
        if isinstance(idx, slice):  # a slice is a plain nn.Sequential over the same modules
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    def forward(self, x):
        start = 0
        for j, size in enumerate(self.sizes):
            segment = self[start:start + size]  # a plain nn.Sequential over blocks start .. start+size-1
            if self.every > 1 and (j + 1) % self.every:
                x = segment(x)  # layer-level: a block between the checkpointed ones, kept whole
            elif j == len(self.sizes) - 1 and not self.checkpoint_last:
                x = segment(x)  # kept: its backward comes first, recomputing saves nothing
            else:
                # (recompute_context_fn: a fake step planning a GPU recomputes with CUDA autocast's dtypes too)
                x = checkpoint(segment, x, use_reentrant=False, context_fn=recompute_context_fn(self.context_fn))
            start += size
        return x

    def extra_repr(self) -> str:
        mode = "op-level selective" if self.op_level else "selective" if self.context_fn is not None else "full"
        mode += f", every {self.every}th block" if self.every > 1 else ""
        return f"sizes={self.sizes}, checkpoint_last={self.checkpoint_last}, {mode}"


def checkpoint_blocks(model: nn.Module, segments: int, *, checkpoint_last: bool = False,
                      selective: bool = False, op_level: bool = False, every: int = 1) -> nn.Module:
    """Checkpoint a GPT's `blocks` (an MLP's `layers`) in `segments` runs, in place, and return it (selective: keep
    matmul outputs; op_level: torchtitan's op-level policy, op_level_policy; every=k > 1 with one block per segment:
    every k-th block alone, torchtitan's layer-level selective checkpointing, `selective_ac_option = "k"`)."""
    name = blocks_name(model)
    blocks = list(getattr(model, name))
    setattr(model, name, CheckpointedSequential(*blocks, segments=segments, checkpoint_last=checkpoint_last,
                                                selective=selective, op_level=op_level, every=every))
    return model


def predicted_activation_bytes(n_blocks: int, segments: int, block_bytes: float, boundary_bytes: float,
                               rest_bytes: float = 0.0) -> float:
    """Return Chen's peak activation bytes: the worst (boundaries stored before segment j + segment j) + the rest."""
    sizes = segment_sizes(n_blocks, segments)
    return rest_bytes + max((j * boundary_bytes + size * block_bytes for j, size in enumerate(sizes)), default=0.0)


def backward_moments_bytes(sizes: list[int], block_bytes: int, boundary_bytes: int,
                           rest_bytes: int = 0) -> tuple[int, int]:
    """Return the activation bytes as backward starts and while it rebuilds the largest segment (chapter 02).

    As it starts: the tensors outside the blocks (`rest_bytes`), the unchecked last segment and the stored boundaries;
    in a rebuild: that segment and the boundaries before it (the head's backward has freed `rest_bytes` by then).
    """
    at_start = rest_bytes + (len(sizes) - 1) * boundary_bytes + sizes[-1] * block_bytes
    in_rebuild = max((j * boundary_bytes + size * block_bytes for j, size in enumerate(sizes[:-1])), default=0)
    return at_start, in_rebuild
