"""CUDA autocast's dtypes on a CPU: fake steps that plan a GPU run CPU autocast with CUDA's choices where they differ."""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_SOFTMAXES = (torch.Tensor.softmax, torch.softmax, torch.nn.functional.softmax,
              torch.Tensor.log_softmax, torch.log_softmax, torch.nn.functional.log_softmax)


class CudaAutocastOps(TorchFunctionMode):
    """Give a CPU's 16-bit autocast CUDA autocast's dtypes where the two differ for labkit's models (fake steps of a GPU).

    Recorded op by op on an H200 (torch 2.11.0+cu130) against this CPU's torch, one bf16 GPT step each
    (tests/data/cuda_autocast_ops_h200.json): CUDA autocast runs softmax and log_softmax in fp32 (casts a 16-bit input
    up, saves the fp32 result; the next matmul casts it back), CPU autocast in the input's dtype; and CUDA's
    cross-entropy takes log_softmax in the logits' 16-bit dtype and casts the result up for nll_loss, where CPU
    autocast casts the logits up first (so the log-probabilities saved for backward are 16-bit on CUDA, fp32 on a CPU).
    Everything else the models call (matmuls, layer norm on the fp32 residual, fused attention) takes the same dtypes.
    Acts only while CPU autocast is on; an explicit `dtype=` keeps its own. A checkpoint's recomputation runs where
    torch function modes are not inherited: checkpoints take `recompute_context_fn` to run it under one too.
    """

    active = 0  # how many are entered (in this process): checkpoints made meanwhile recompute under one

    def __enter__(self):
        type(self).active += 1
        return super().__enter__()

    def __exit__(self, *exc):
        type(self).active -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_autocast_enabled("cpu") or not args or not isinstance(args[0], torch.Tensor):
            return func(*args, **kwargs)
        x = args[0]
        half = x.dtype in (torch.bfloat16, torch.float16)
        if func in _SOFTMAXES and half and kwargs.get("dtype") is None:
            return func(x.float(), *args[1:], **kwargs)
        if func is torch.nn.functional.cross_entropy and half and not kwargs.get("label_smoothing"):
            target, weight = args[1], kwargs.get("weight", args[2] if len(args) > 2 else None)
            with torch.autocast("cpu", enabled=False):  # CUDA's cross-entropy passes the logits' dtype to log_softmax
                log_probs = torch.log_softmax(x, dim=1 if x.dim() > 1 else 0)  # (N, V): 16-bit, saved for backward
                return torch.nn.functional.nll_loss(log_probs.float(), target, weight,
                                                    ignore_index=kwargs.get("ignore_index", -100),
                                                    reduction=kwargs.get("reduction", "mean"))
        return func(*args, **kwargs)


def recompute_context_fn(context_fn=None):
    """Return a checkpoint `context_fn` (torch.utils.checkpoint) that adds CudaAutocastOps to the recomputation when one
    is active as the checkpoint runs forward; `context_fn`: the checkpoint's own (None: no contexts)."""
    def contexts():
        forward, recompute = context_fn() if context_fn is not None else (contextlib.nullcontext(),) * 2
        if not CudaAutocastOps.active:
            return forward, recompute
        return forward, _both(recompute, CudaAutocastOps())
    return contexts


@contextlib.contextmanager
def _both(first, second):
    """Enter two context managers (a checkpoint's recompute context is one)."""
    with first, second:
        yield
