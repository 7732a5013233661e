"""labkit.l2l trains layer to layer exactly like plain training, with a device peak constant in depth; notebook 05 runs."""

from __future__ import annotations

import copy

import pytest
import torch

import labkit
from labkit.compare import max_param_diff
from labkit.data import TeacherTask
from labkit.flops import count_flops
from labkit.l2l import L2LTrainer, measure_l2l_step

CPU = torch.device("cpu")


@pytest.fixture
def gpt(tiny_gpt):
    """Return make(seed=0, **overrides): the tiny GPT with 4 heads (head width 8: rope-able)."""
    return lambda seed=0, **overrides: tiny_gpt(seed, **{"n_head": 4, **overrides})


def _train_both(model, batches, seed_each_step=False):
    """Train a plain copy and an L2L copy of `model` on the same batches; return (plain, trainer, losses)."""
    plain = copy.deepcopy(model)
    opt = labkit.make_optimizer("adam", plain.parameters())
    trainer = L2LTrainer(copy.deepcopy(model), CPU)
    losses = []
    for i, b in enumerate(batches):
        if seed_each_step:
            torch.manual_seed(100 + i)
        lp = labkit.train_step(plain, opt, b)
        if seed_each_step:
            torch.manual_seed(100 + i)
        ll = trainer.step(b)
        losses.append((lp.item(), ll.item()))
    return plain, trainer, losses


def test_gpt_with_tied_weights_matches_plain_training(tiny_batch, gpt):
    model = gpt(1, n_layer=3)
    assert model.head.weight is model.tok_emb.weight
    plain, trainer, losses = _train_both(model, [tiny_batch(4, seed=1 + i) for i in range(4)])
    assert max_param_diff(trainer.model, plain) <= 1e-6
    assert max_param_diff(trainer.model, plain, relative=True) <= 1e-5
    assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in losses)
    assert max_param_diff(trainer.model, model) > 1e-4  # it did train


def test_dropout_untied_llama_options_and_padding_match_plain_training(tiny_batch, gpt):
    model = gpt(2, n_layer=3, dropout=0.2, tie_weights=False, mlp="swiglu", norm="rms", pos="rope", bias=False)
    batches = [tiny_batch(4, seed=2 + i, padded=True) for i in range(3)]
    plain, trainer, _ = _train_both(model, batches, seed_each_step=True)
    assert max_param_diff(trainer.model, plain) <= 1e-6


def test_mlp_matches_plain_training():
    torch.manual_seed(3)
    model = labkit.MLP(labkit.MLPConfig(depth=3, hidden=64))
    task = TeacherTask(seed=3)
    plain, trainer, _ = _train_both(model, [task.batch(16) for _ in range(3)])
    assert max_param_diff(trainer.model, plain) <= 1e-6


def test_without_dropout_replay_masks_differ(tiny_batch, gpt):
    """The recomputed forward must see the same dropout masks: without replay, gradients go wrong."""
    model = gpt(4, dropout=0.3)
    trainer = L2LTrainer(copy.deepcopy(model), CPU)
    trainer._dropout = [False] * len(trainer.stages)  # switch the RNG replay off
    plain = copy.deepcopy(model)
    opt = labkit.make_optimizer("adam", plain.parameters())
    b = tiny_batch(4, 16, seed=4)
    torch.manual_seed(7)
    labkit.train_step(plain, opt, b)
    torch.manual_seed(7)
    trainer.step(b)
    assert max_param_diff(trainer.model, plain) > 1e-5


def test_device_peak_is_flat_in_depth_and_plain_grows(tiny_batch, gpt):
    b = tiny_batch(4, seed=5)
    l2l, plain = {}, {}
    for depth in (1, 4, 8):
        model = gpt(5, n_layer=depth)
        trainer = L2LTrainer(copy.deepcopy(model), CPU)
        l2l[depth] = measure_l2l_step(trainer, b, timeline=False).peak_bytes
        opt = labkit.make_optimizer("adam", model.parameters())
        plain[depth] = labkit.measure_step(model, opt, b).peak_bytes
    assert max(l2l.values()) / min(l2l.values()) <= 1.01, l2l
    assert plain[1] < plain[4] < plain[8], plain
    assert l2l[8] < plain[8] / 3


def test_host_tier_holds_model_and_adam_state_and_the_device_ends_empty(tiny_batch, gpt):
    model = gpt(6)
    trainer = L2LTrainer(model, CPU)
    b = tiny_batch(4, 16, seed=6)
    trainer.step(b)  # Adam's state exists now
    n_params = labkit.count_params(model)
    with labkit.MemoryMeter(CPU) as meter:
        trainer.attach(meter)
        meter.track(*b)
        batch_bytes = meter.current_bytes
        trainer.step(b)
        after_bytes = meter.current_bytes
    split = meter.peak_split()
    assert split["optimizer_state"] == 0
    assert 0 < split["parameters"] < 4 * n_params  # never the whole model at once
    assert meter.host_peak_bytes >= 16 * n_params  # weights, gradients, m, v
    assert after_bytes == batch_bytes  # nothing of the model is left on the device
    assert all(p.grad is None for p in trainer.model.parameters())


def test_budget_fits_where_plain_does_not_and_oom_leaves_the_trainer_usable(tiny_batch, gpt):
    model = gpt(7, n_layer=4)
    b = tiny_batch(8, 16, seed=7)
    plain = copy.deepcopy(model)
    opt = labkit.make_optimizer("adam", plain.parameters())
    plain_peak = labkit.measure_step(plain, opt, b).peak_bytes
    budget = plain_peak // 2
    assert not labkit.try_fit(labkit.measure_step, plain, opt, b, budget_bytes=budget).fits
    trainer = L2LTrainer(copy.deepcopy(model), CPU)
    fit = labkit.try_fit(measure_l2l_step, trainer, b, budget)
    assert fit.fits and fit.value.peak_bytes <= budget
    tiny = labkit.try_fit(measure_l2l_step, trainer, b, 4096)
    assert not tiny.fits and isinstance(tiny.error, labkit.OutOfMemory)
    assert all(p.grad is None for p in trainer.model.parameters())  # no half-step gradients left behind
    assert torch.isfinite(trainer.step(b))


def test_moved_bytes_follow_the_formula(tiny_batch, gpt):
    model = gpt(8, n_layer=3)
    trainer = L2LTrainer(model, CPU)
    B, T, C = 4, 16, model.cfg.n_embd
    trainer.step(tiny_batch(B, T, seed=8))
    stage_bytes = [sum(p.nbytes for p in s.parameters()) for s in trainer.stages]
    n = len(stage_bytes)
    boundary = (n - 2) * B * T * C * 4
    assert trainer.moved_bytes["host_to_device"] == 2 * sum(stage_bytes[:-1]) + stage_bytes[-1] + boundary
    assert trainer.moved_bytes["device_to_host"] == sum(stage_bytes) + boundary


def test_flops_add_at_most_one_forward(tiny_batch, gpt):
    model = gpt(9, n_layer=3)
    b = tiny_batch(4, 16, seed=9)
    plain = copy.deepcopy(model)
    opt = labkit.make_optimizer("adam", plain.parameters())
    f_plain = count_flops(labkit.train_step, plain, opt, b)
    f_l2l = count_flops(L2LTrainer(model, CPU).step, b)
    assert 1.0 < f_l2l / f_plain <= 4 / 3 + 1e-9


def test_trainer_refuses_batchnorm_and_prefetch_without_cuda(gpt):
    model = gpt(11, n_layer=3)
    with pytest.raises(ValueError, match="BatchNorm"):
        L2LTrainer(labkit.MLP(labkit.MLPConfig(batchnorm=True)), CPU)
    with pytest.raises(TypeError, match="GPT and MLP"):
        L2LTrainer(torch.nn.Linear(2, 2), CPU)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            L2LTrainer(model, CPU, prefetch=True)


def test_peak_stage_names_the_visit_that_set_the_meter_peak(tiny_batch, gpt):
    trainer = L2LTrainer(gpt(), CPU)
    assert trainer.stage_names == ["embedding", "block 1", "block 2", "head"]
    b = tiny_batch(4)
    trainer.step(b)
    assert trainer.peak_stage is None  # no meter: nothing to attribute
    meter = measure_l2l_step(trainer, b, timeline=False)
    phase, stage = trainer.peak_stage
    assert phase in ("forward", "backward") and stage in trainer.stage_names
    assert meter.peak_bytes > 0


# -- the notebook, with other parameters ------------------------------------------------------------
def test_notebook_runs_with_other_seed_and_depths(execute_notebook):
    entry = execute_notebook("05_layer_to_layer", SEED=3, N_LAYER=3, BATCH=6, EQUAL_STEPS=2, N_LAYER_SWEEP=[1, 3, 6],
                             SWEEP_N_EMBD=32, SWEEP_SEQ_LEN=16, SWEEP_BATCH=3, TIMED_STEPS=1)
    assert entry["status"] == "ok", entry.get("error")
    m = entry["measurements"]
    l2l, plain = m["device_peak_bytes_by_layers_l2l"], m["device_peak_bytes_by_layers_baseline"]
    assert list(l2l) == ["1", "3", "6"] and list(plain) == ["1", "3", "6"]
    assert m["l2l_depth_ratio"] <= 1.1
    assert m["l2l_depth_ratio"] == pytest.approx(l2l["6"] / l2l["1"])
    assert plain["1"] < plain["3"] < plain["6"]
    assert m["max_param_diff_after_steps"] <= 1e-5
    assert m["fits_in_budget"] is True
    assert m["step_time_ratio_l2l"] > 0
    assert 1.0 < m["flop_ratio_l2l"] <= 4 / 3 + 1e-9
