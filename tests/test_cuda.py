"""CUDA invariants (marked `cuda`: skipped, with the reason, where torch sees no CUDA device).

The same functions `make gpu-check` runs at GPT-2 small, here at a size that runs in seconds, plus
gradients that must not change when a step moves tensors between host and device.
"""

from __future__ import annotations

import copy

import pytest
import torch

from labkit.compare import max_rel_diff
from labkit.device import as_device, resolve_device
from labkit.l2l import L2LTrainer
from labkit.meter import MemoryMeter
from labkit.models import GPT, GPTConfig
from labkit.offload import OffloadHooks
from labkit.tools import gpucheck

pytestmark = pytest.mark.cuda


@pytest.fixture
def setup():
    cfg = GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=256, vocab_size=1024, attn="sdpa")
    return gpucheck.Setup(as_device("cuda"), cfg, batch=4, seq_len=256, steps=3, train_steps=30)


def test_auto_and_cuda_resolve_to_an_indexed_device():
    assert resolve_device("auto") == torch.device("cuda", torch.cuda.current_device())
    assert resolve_device("cuda").index is not None


@pytest.mark.parametrize("check", ["meter", "budget", "offload", "precision"])
def test_gpu_check_rows_hold(setup, check):
    row = getattr(gpucheck, f"check_{check}")(setup)
    assert row.ok, (row.measured, row.note, row.figures)


def test_budgeted_meter_on_auto_device_and_the_next_one():
    with MemoryMeter("cuda", budget_bytes=2**30) as meter:
        torch.ones(1024, device="cuda")
    with MemoryMeter("cuda") as again:
        torch.ones(1024, device="cuda")
    assert meter.peak_bytes == again.peak_bytes == 4096
    assert meter.cuda_max_allocated_bytes is not None


def _grads(model):
    return {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("prefetch", [False, True])
def test_offload_on_cuda_offloads_and_keeps_gradients(setup, prefetch):
    model, batch = setup.model(), setup.data()
    ref = copy.deepcopy(model)
    _, loss = ref(*batch)
    loss.backward()
    hooks = OffloadHooks(device="cuda", prefetch=prefetch).track_layers(model.blocks)  # device without index
    with hooks:
        _, loss = model(*batch)
    loss.backward()
    assert hooks.stats()["offloaded"] > 0
    assert max_rel_diff(_grads(model), _grads(ref)) < 1e-5


def test_l2l_prefetch_keeps_gradients_and_survives_a_failing_step(setup):
    base = setup.model().cpu()
    batch = setup.data()
    a = L2LTrainer(copy.deepcopy(base), "cuda", prefetch=True)
    b = L2LTrainer(copy.deepcopy(base), "cuda", prefetch=False)
    la, lb = a.step(batch), b.step(batch)
    assert abs(float(la) - float(lb)) < 1e-5
    assert max_rel_diff(dict(a.model.named_parameters()), dict(b.model.named_parameters())) < 1e-5
    bad = (batch[0], batch[1][:, :-1])  # wrong target shape: the head's loss raises mid-step
    with pytest.raises(Exception):
        a.step(bad)
    torch.cuda.synchronize()
    a.step(batch)  # the trainer and the allocator are usable after the failure
