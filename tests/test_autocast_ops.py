"""CudaAutocastOps: a CPU's bf16 autocast step takes the dtypes an H200 recorded for the same step, op by op."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.autocast_ops import CudaAutocastOps, recompute_context_fn
from labkit.models import GPT, GPTConfig
from labkit.techniques.checkpointing import checkpoint_blocks

RECORDED = json.loads((Path(__file__).parent / "data" / "cuda_autocast_ops_h200.json").read_text())
KEPT = ("_softmax.", "_log_softmax.", "_to_copy.", "nll_loss", "_softmax_backward", "_log_softmax_backward")


class _OpLog(TorchDispatchMode):
    """Log each kept aten op as the recording does: name, its tensors' dtypes and shapes in and out."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))

        def described(xs):
            return [f"{str(t.dtype)[6:]}{list(t.shape)}" for t in xs if isinstance(t, torch.Tensor)]
        if func.__name__.startswith(KEPT):
            ins = [a for a in args if isinstance(a, torch.Tensor)]
            ins += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            outs = out if isinstance(out, (list, tuple)) else [out]
            self.ops.append(f"{func.__name__} in={described(ins)} out={described(outs)}")
        return out


def _logged_step(attn: str, checkpointing: str, cuda_ops: bool) -> list[str]:
    """Run the recording's bf16 step on this CPU (CudaAutocastOps on or off); return its kept ops."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=32, vocab_size=512, attn=attn))
    if checkpointing == "every":
        checkpoint_blocks(model, segments=2, checkpoint_last=True)
    idx, targets = torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32))
    log = _OpLog()
    with log, CudaAutocastOps() if cuda_ops else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, targets)[1]
        loss.backward()
    return log.ops


@pytest.mark.parametrize("case", sorted(RECORDED["ops"]))
def test_a_cpu_step_under_cuda_autocast_ops_casts_as_the_h200_did(case, one_thread):
    attn, checkpointing = case.split("/")
    assert _logged_step(attn, checkpointing, cuda_ops=True) == RECORDED["ops"][case]
    assert _logged_step(attn, checkpointing, cuda_ops=False) != RECORDED["ops"][case]  # this CPU's own: the loss


def test_outside_autocast_and_with_a_dtype_it_changes_nothing():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with CudaAutocastOps():
        assert x.softmax(-1).dtype == torch.bfloat16  # no autocast: the op's own dtype
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert x.softmax(-1).dtype == torch.float32 and x.softmax(-1, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert CudaAutocastOps.active == 0


def test_a_checkpoint_recomputes_under_the_ops_only_while_they_are_active():
    _, rec = recompute_context_fn()()
    with rec:
        assert not torch.overrides._is_torch_function_mode_enabled()
    with CudaAutocastOps():
        _, rec = recompute_context_fn()()
    with rec:
        assert CudaAutocastOps.active == 1


def test_chapter_03s_bf16_step_on_fake_tensors_holds_what_the_h200_measured():
    """Chapter 03's running example in bf16: the fake step with CUDA's dtypes peaks where the H200's real one did."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import labkit
    from labkit.gpus import GPU_RUN_PATH
    from labkit.techniques.precision import amp_step_fn

    measured = json.loads(GPU_RUN_PATH.read_text())["notebooks"]["03_mixed_precision"]["measurements"]
    ex = labkit.running_example()
    peaks = {}
    for cuda_ops in (False, True):
        with CudaAutocastOps() if cuda_ops else contextlib.nullcontext(), FakeTensorMode():
            model = GPT(ex.config)
            opt = labkit.make_optimizer("adam", model.parameters())
            batch = labkit.example_batch(ex.config, ex.batch_size, ex.seq_len)
            peaks[cuda_ops] = labkit.measure_step(model, opt, batch, step_fn=amp_step_fn("bf16", None),
                                                  device="cpu").peak_bytes
    steps_on_host = 4 * len(list(GPT(ex.config).parameters()))  # Adam's fp32 step counts: on CUDA torch keeps them
    assert measured["half_precision"] == "bf16"                 # on the host, on a CPU they are device tensors
    assert peaks[True] - steps_on_host == measured["peak_bytes_half"] != peaks[False] - steps_on_host
