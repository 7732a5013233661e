"""Attention kernels on fake tensors: CUDA's flash and memory-efficient SDPA save what their autograd formulas say."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import torchgen
from torch._subclasses.fake_tensor import FakeTensorMode

from labkit.models import GPT, GPTConfig, _cuda_attention
from labkit.planner import plan as P
from labkit.validate import ParameterError

DERIVATIVES = Path(torchgen.__file__).parent / "packaged" / "autograd" / "derivatives.yaml"  # torch's own formulas
OPS = {"flash": "_scaled_dot_product_flash_attention", "efficient": "_scaled_dot_product_efficient_attention"}
B, H, T, D = 2, 4, 40, 16  # T not a multiple of 32: the memory-efficient kernel's padding shows


def saved_by_formula(op: str) -> list[str]:
    """Return the tensors the backward formula of `op` in derivatives.yaml takes from its forward (inputs, outputs)."""
    text = DERIVATIVES.read_text()
    entry = re.search(rf"^- name: {op}\((.*?)\) -> \((.*?)\)\n(.*?)(?=^- name:)", text, re.M | re.S)
    assert entry, f"{op} not in {DERIVATIVES}"
    declared = [a.strip() for a in (entry.group(1) + ", " + entry.group(2)).replace("*,", "").split(",")]
    tensors = {a.split()[-1].split("=")[0] for a in declared if a.startswith("Tensor") and not a.startswith("Tensor?")}
    tensors |= {a.split()[-1] for a in declared if a.startswith("Tensor?")}  # (attn_bias: None here, not saved)
    formula = re.search(r"^  query, key, value[^:]*: \w+\((.*)\)$", entry.group(3), re.M).group(1)
    return [a.strip() for a in formula.split(",") if a.strip() in tensors]


def expected(kernel: str, name: str, dtype):
    """Return the (shape, dtype) a kernel saves for one of its formula's tensors, None where the dense batch's tensor
    is undefined. logsumexp: one fp32 per query row and head; the memory-efficient kernel pads the rows to a multiple
    of 32 (kAlignLSE, aten/src/ATen/native/transformers/cuda/attention.cu); the random state: flash's rng_state and
    'unused' (uint64), the memory-efficient kernel's philox seed and offset (int64 scalars)."""
    rows = T if kernel == "flash" else math.ceil(T / 32) * 32
    return {"query": ((B, H, T, D), dtype), "key": ((B, H, T, D), dtype), "value": ((B, H, T, D), dtype),
            "output": ((B, H, T, D), dtype), "logsumexp": ((B, H, rows), torch.float32),
            "log_sumexp": ((B, H, rows), torch.float32), "rng_state": ((2,), torch.uint64), "unused": ((), torch.uint64),
            "philox_seed": ((), torch.int64), "philox_offset": ((), torch.int64), "cum_seq_q": None,
            "cum_seq_k": None, "attn_bias": None}[name]


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_cuda_kernels_save_what_their_autograd_formula_takes(kernel):
    """The model's attention with attn=kernel (labkit.models._cuda_attention), on fake tensors: the tensors autograd saves are, one for one, those the
    kernel's backward formula in torch's derivatives.yaml names, at the shapes the kernel gives them."""
    names = saved_by_formula(OPS[kernel])
    assert {"query", "key", "value", "output"} <= set(names) and len(names) >= 7, names
    saved = []
    with FakeTensorMode():
        q, k, v = (torch.randn(B, T, H, D, dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in range(3))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t,
                                                      lambda t: t):
            y = _cuda_attention(kernel, q, k, v, 0.0)  # (B, H, T, D), as CausalSelfAttention calls it
        y.sum().backward()  # the backward runs too: its meta function takes what was saved
    want = [e for e in (expected(kernel, n, torch.bfloat16) for n in names) if e is not None]
    assert sorted(saved, key=str) == sorted(want, key=str), (names, saved)


def test_flash_on_fp32_runs_the_memory_efficient_kernel_as_sdpa_picks_on_cuda():
    saved = []
    with FakeTensorMode():
        q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            _cuda_attention("flash", q, k, v, 0.0)
    assert (B, H, 64) in saved  # the memory-efficient kernel's padded logsumexp


def test_a_real_step_with_a_cuda_kernel_on_a_cpu_says_so():
    cfg = GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8, vocab_size=16, attn="flash")
    x = torch.randint(16, (1, 8))
    with pytest.raises(ParameterError, match="attn='flash' runs CUDA's flash attention kernel: a real step needs a CUDA"):
        GPT(cfg)(x, x)


def test_the_plan_takes_each_attention_and_names_it():
    """Planned peaks: the T×T scores of manual attention above every fused kernel; CUDA's flash exactly the CPU's
    SDPA (the same saved tensors) plus its random state, 24 B a block."""
    base = dataclasses.replace(P.PRESETS["llama-7b"], n_layer=2, n_embd=64, n_head=4, mlp_hidden=128, vocab_size=256)
    peaks = {}
    for attn in ("manual", "sdpa", "flash", "efficient"):
        spec = P.model_spec(dataclasses.replace(base, attn=attn))
        peaks[attn] = P._fake_run(spec, P.Step(2, 1, 40, "none", "bf16"), 2)[0]
    assert peaks["manual"] > max(peaks["sdpa"], peaks["flash"], peaks["efficient"])
    assert peaks["flash"] - peaks["sdpa"] == 2 * 24
    named = P.model_spec(dataclasses.replace(P.PRESETS["llama-7b"], attn="flash", logits_fp32=True)).name
    assert named == "llama-7b, fp32 logits, flash attention"
    assert P.model_spec(P.PRESETS["llama-7b"]).name == "llama-7b"
