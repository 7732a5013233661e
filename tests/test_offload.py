"""labkit.techniques.offload: the activation-offload hooks on the host tier (notebook 04: tests/test_nb04.py)."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import labkit
from labkit.compare import max_abs_diff
from labkit.techniques.hosttier import HostPool
from labkit.techniques.offload import OffloadHooks


@pytest.fixture
def model_opt(tiny_gpt):
    """Return make(seed=0): the tiny GPT and its Adam optimizer."""
    def make(seed=0):
        model = tiny_gpt(seed)
        return model, labkit.make_optimizer("adam", model.parameters())
    return make


@pytest.fixture
def batch(tiny_batch):
    """A batch of 4 sequences of 16 tokens for the tiny GPT."""
    return tiny_batch(4, seed=1)


def _grads(model, batch, ctx=None, checkpointing=False):
    model.zero_grad(set_to_none=True)
    with ctx if ctx is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        if checkpointing:
            x = model.embed(batch[0])
            for block in model.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            loss = torch.nn.functional.cross_entropy(model.logits(x).flatten(0, 1), batch[1].flatten())
        else:
            _, loss = model(*batch)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _offload_step(hooks):
    """Return the plain training step with its forward under `hooks`."""
    return functools.partial(labkit.train_step, forward_context=hooks)


# -- OffloadHooks ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["memory", "disk"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_gradients_equal_the_plain_step_exactly(kind, prefetch, model_opt, batch):
    model, _ = model_opt()
    plain = _grads(model, batch)
    pool = HostPool("cpu", kind=kind)
    hooks = OffloadHooks(model, pool=pool, min_bytes=1024, prefetch=prefetch).track_layers(model.blocks)
    offloaded = _grads(model, batch, hooks)
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
    s = hooks.stats()
    assert s["offloaded"] > 0 and s["bytes_to_host"] == s["bytes_to_device"] > 0
    assert s["kept_params"] > 0  # addmm saves the weights: they are skipped
    if prefetch:
        assert s["prefetched"] > 0
    assert pool.live_bytes == 0 and pool.files() == []
    hooks.remove()
    pool.close()


def test_checkpointing_with_offload_gives_the_same_gradients(model_opt, batch):
    model, _ = model_opt()
    plain = _grads(model, batch)
    hooks = OffloadHooks(model, min_bytes=1024)
    both = _grads(model, batch, hooks, checkpointing=True)
    assert max_abs_diff(both, plain) <= 1e-6
    assert hooks.stats()["offloaded"] > 0  # the block inputs that checkpoint saves


def test_parameters_and_small_tensors_stay_on_the_device():
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    hooks = OffloadHooks(lin, min_bytes=32 * 64 * 4)
    with hooks:
        y = torch.relu(lin(x)).sum()
    s = hooks.stats()
    assert s["kept_params"] >= 1  # the weight, saved by addmm
    assert s["offloaded"] >= 1  # x (32×64 fp32) reaches the threshold
    y.backward()
    assert lin.weight.grad is not None and x.grad is not None


def test_a_huge_threshold_offloads_nothing_and_changes_nothing(model_opt, batch):
    model, opt = model_opt()
    plain = labkit.measure_step(model, opt, batch).peak_bytes
    hooks = OffloadHooks(model, min_bytes=2**40)
    same = labkit.measure_step(model, opt, batch, step_fn=_offload_step(hooks), warmup=False)
    assert same.peak_bytes == plain and hooks.stats()["offloaded"] == 0 and same.meter.host_peak_bytes == 0


def test_offload_lowers_the_device_peak_and_fits_a_budget_the_plain_step_does_not(model_opt, batch):
    model, opt = model_opt()
    plain = labkit.measure_step(model, opt, batch)
    pool = HostPool("cpu")
    hooks = OffloadHooks(model, pool=pool, min_bytes=1024)
    off = labkit.measure_step(model, opt, batch, step_fn=_offload_step(hooks), warmup=False)
    assert off.peak_bytes < plain.peak_bytes
    assert off.meter.host_peak_bytes == hooks.stats()["bytes_to_host"] > 0
    assert off.meter.host_current_bytes == 0 and pool.live_bytes == 0
    budget = (off.peak_bytes + plain.peak_bytes) // 2
    assert not labkit.try_fit(labkit.measure_step, model, opt, batch, budget_bytes=budget, warmup=False).fits
    fit = labkit.try_fit(labkit.measure_step, model, opt, batch, step_fn=_offload_step(hooks), budget_bytes=budget,
                         warmup=False)
    assert fit.fits and fit.value.peak_bytes == off.peak_bytes


def test_nothing_accumulates_across_steps(model_opt, batch):
    model, opt = model_opt()
    pool = HostPool("cpu", kind="disk")
    hooks = OffloadHooks(model, pool=pool, min_bytes=1024)
    step = _offload_step(hooks)
    with labkit.MemoryMeter("cpu") as meter:
        meter.track(model, opt, *batch)
        after = []
        for _ in range(3):
            step(model, opt, batch)
            after.append((meter.current_bytes, meter.host_current_bytes, pool.live_bytes, len(pool.files())))
    assert after[1] == after[2] and after[0][1:] == (0, 0, 0)
    assert pool.peak_bytes == hooks.stats()["bytes_to_host"]  # one step's worth, never more
    folder = pool.spill_dir
    pool.close()
    assert not os.path.exists(folder)


def test_a_step_that_runs_out_of_memory_leaks_nothing(model_opt, batch):
    """A budget refusal in the middle of a step leaves no graph behind: kept tensors are saved detached.

    Returning the saved tensor itself from `pack` makes a cycle (an op's saved output holds its own
    grad_fn) that only backward breaks; the failed step's whole graph would stay alive.
    """
    from labkit.meter import live_tensor_bytes

    model, opt = model_opt()
    hooks = OffloadHooks(model, min_bytes=1 << 30)  # offload nothing: every saved tensor is a kept one
    labkit.train_step(model, opt, batch)
    peak = labkit.measure_step(model, opt, batch, step_fn=_offload_step(hooks)).peak_bytes
    before = live_tensor_bytes()
    for _ in range(3):
        fit = labkit.try_fit(labkit.measure_step, model, opt, batch, step_fn=_offload_step(hooks),
                             budget_bytes=int(peak * 0.9), warmup=False)
        assert not fit.fits
        model.zero_grad(set_to_none=True)  # what the failed backward accumulated is legitimately there
    assert live_tensor_bytes() == before
    assert hooks.pool.live_bytes == 0


def test_copy_timing_reports_a_bandwidth(model_opt, batch):
    model, opt = model_opt()
    hooks = OffloadHooks(model, min_bytes=1024, time_copies=True)
    _offload_step(hooks)(model, opt, batch)
    s = hooks.stats()
    assert s["copy_to_host_s"] > 0 and s["copy_to_host_bytes_per_s"] > 0


def test_hooks_validate_their_arguments(model_opt):
    model, _ = model_opt()
    with pytest.raises(ValueError, match="min_bytes"):
        OffloadHooks(model, min_bytes=-1)
    with pytest.raises(ValueError, match="prefetch"):
        OffloadHooks(model, prefetch="sometimes")
