"""labkit.l2l trains layer to layer exactly like plain training, with a device peak constant in depth; notebook 05 runs."""

from __future__ import annotations

import copy

import pytest
import torch

import labkit
from labkit.data import MarkovTokens, TeacherTask
from labkit.l2l import (L2LTrainer, count_flops, host_tier, mark_host_state, max_param_diff, measure_l2l_step,
                        split_stages, to_device, to_host)

CPU = torch.device("cpu")


def _gpt(seed=0, **kw):
    cfg = labkit.GPTConfig(**{"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16, **kw})
    torch.manual_seed(seed)
    return labkit.GPT(cfg)


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


def test_gpt_with_tied_weights_matches_plain_training():
    model = _gpt(seed=1, n_layer=3)
    assert model.head.weight is model.tok_emb.weight
    data = MarkovTokens(256, seed=1)
    plain, trainer, losses = _train_both(model, [data.batch(4, 16) for _ in range(4)])
    assert max_param_diff(trainer.model, plain) <= 1e-6
    assert max_param_diff(trainer.model, plain, relative=True) <= 1e-5
    assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in losses)
    assert max_param_diff(trainer.model, model) > 1e-4  # it did train


def test_dropout_untied_llama_options_and_padding_match_plain_training():
    model = _gpt(seed=2, n_layer=3, dropout=0.2, tie_weights=False, mlp="swiglu", norm="rms", pos="rope", bias=False)
    data = MarkovTokens(256, seed=2)
    batches = [data.padded_batch(4, 16)[:2] for _ in range(3)]
    plain, trainer, _ = _train_both(model, batches, seed_each_step=True)
    assert max_param_diff(trainer.model, plain) <= 1e-6


def test_mlp_matches_plain_training():
    torch.manual_seed(3)
    model = labkit.MLP(labkit.MLPConfig(depth=3, hidden=64))
    task = TeacherTask(seed=3)
    plain, trainer, _ = _train_both(model, [task.batch(16) for _ in range(3)])
    assert max_param_diff(trainer.model, plain) <= 1e-6


def test_without_dropout_replay_masks_differ():
    """The recomputed forward must see the same dropout masks: without replay, gradients go wrong."""
    model = _gpt(seed=4, dropout=0.3)
    trainer = L2LTrainer(copy.deepcopy(model), CPU)
    trainer._dropout = [False] * len(trainer.stages)  # switch the RNG replay off
    plain = copy.deepcopy(model)
    opt = labkit.make_optimizer("adam", plain.parameters())
    b = MarkovTokens(256, seed=4).batch(4, 16)
    torch.manual_seed(7)
    labkit.train_step(plain, opt, b)
    torch.manual_seed(7)
    trainer.step(b)
    assert max_param_diff(trainer.model, plain) > 1e-5


def test_device_peak_is_flat_in_depth_and_plain_grows():
    data = MarkovTokens(256, seed=5)
    b = data.batch(4, 16)
    l2l, plain = {}, {}
    for depth in (1, 4, 8):
        model = _gpt(seed=5, n_layer=depth)
        trainer = L2LTrainer(copy.deepcopy(model), CPU)
        l2l[depth] = measure_l2l_step(trainer, b, timeline=False).peak_bytes
        opt = labkit.make_optimizer("adam", model.parameters())
        plain[depth] = labkit.measure_step(model, opt, b).peak_bytes
    assert max(l2l.values()) / min(l2l.values()) <= 1.01, l2l
    assert plain[1] < plain[4] < plain[8], plain
    assert l2l[8] < plain[8] / 3


def test_host_tier_holds_model_and_adam_state_and_the_device_ends_empty():
    model = _gpt(seed=6)
    trainer = L2LTrainer(model, CPU)
    b = MarkovTokens(256, seed=6).batch(4, 16)
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


def test_budget_fits_where_plain_does_not_and_oom_leaves_the_trainer_usable():
    model = _gpt(seed=7, n_layer=4)
    b = MarkovTokens(256, seed=7).batch(8, 16)
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


def test_moved_bytes_follow_the_formula():
    model = _gpt(seed=8, n_layer=3)
    trainer = L2LTrainer(model, CPU)
    B, T, C = 4, 16, model.cfg.n_embd
    trainer.step(MarkovTokens(256, seed=8).batch(B, T))
    stage_bytes = [sum(p.nbytes for p in s.parameters()) for s in trainer.stages]
    n = len(stage_bytes)
    boundary = (n - 2) * B * T * C * 4
    assert trainer.moved_bytes["host_to_device"] == 2 * sum(stage_bytes[:-1]) + stage_bytes[-1] + boundary
    assert trainer.moved_bytes["device_to_host"] == sum(stage_bytes) + boundary


def test_flops_add_at_most_one_forward():
    model = _gpt(seed=9, n_layer=3)
    b = MarkovTokens(256, seed=9).batch(4, 16)
    plain = copy.deepcopy(model)
    opt = labkit.make_optimizer("adam", plain.parameters())
    f_plain = count_flops(labkit.train_step, plain, opt, b)
    f_l2l = count_flops(L2LTrainer(model, CPU).step, b)
    assert 1.0 < f_l2l / f_plain <= 4 / 3 + 1e-9


def test_copies_are_real_and_counted_on_their_tier():
    t = torch.randn(64, 64)
    with labkit.MemoryMeter(CPU) as meter:
        meter.mark_host(t)
        d = to_device(t, CPU)
        assert d.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        assert torch.equal(d, t)
        assert meter.current_bytes == t.nbytes and meter.host_current_bytes == t.nbytes
        h = to_host(d)
        assert meter.host_current_bytes == 2 * t.nbytes and meter.current_bytes == t.nbytes
        with host_tier():
            extra = torch.empty(10)
        assert meter.host_current_bytes == 2 * t.nbytes + extra.nbytes
    assert torch.equal(h, t)
    with host_tier():  # no meter: a no-op context
        torch.empty(1)


def test_mark_host_state_moves_model_and_state_to_the_host_count():
    model = _gpt(seed=10)
    opt = labkit.make_optimizer("adam", model.parameters())
    labkit.train_step(model, opt, MarkovTokens(256, seed=10).batch(2, 8))
    with labkit.MemoryMeter(CPU) as meter:
        mark_host_state(meter, model, opt)
        assert meter.current_bytes == 0
        assert meter.host_current_bytes >= 12 * labkit.count_params(model)


def test_split_stages_and_errors():
    model = _gpt(seed=11, n_layer=3)
    stages = split_stages(model)
    assert len(stages) == 5 and stages[-1].head.weight is stages[0].tok_emb.weight
    with pytest.raises(ValueError, match="BatchNorm"):
        split_stages(labkit.MLP(labkit.MLPConfig(batchnorm=True)))
    with pytest.raises(TypeError, match="GPT and MLP"):
        split_stages(torch.nn.Linear(2, 2))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            L2LTrainer(model, CPU, prefetch=True)


def test_max_param_diff():
    a = _gpt(seed=12)
    b = copy.deepcopy(a)
    assert max_param_diff(a, b) == 0.0
    with torch.no_grad():
        b.blocks[0].attn.qkv.weight[0, 0] += 0.5
    assert max_param_diff(a, b) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        max_param_diff(a, labkit.MLP(labkit.MLPConfig()))


def test_peak_stage_names_the_visit_that_set_the_meter_peak():
    trainer = L2LTrainer(_gpt(), CPU)
    assert trainer.stage_names == ["embedding", "block 1", "block 2", "head"]
    b = MarkovTokens(vocab_size=trainer.model.cfg.vocab_size, seed=0).batch(4, 16)
    trainer.step(b)
    assert trainer.peak_stage is None  # no meter: nothing to attribute
    meter = measure_l2l_step(trainer, b, timeline=False)
    phase, stage = trainer.peak_stage
    assert phase in ("forward", "backward") and stage in trainer.stage_names
    assert meter.peak_bytes > 0


# -- the notebook, with other parameters ------------------------------------------------------------
def test_notebook_runs_with_other_seed_and_depths(execute_notebook):
    entry = execute_notebook("05_layer_to_layer", SEED=3, N_LAYER=3, BATCH=6, EQUAL_STEPS=2, SWEEP_DEPTHS=[1, 3, 6],
                             SWEEP_WIDTH=32, SWEEP_SEQ=16, SWEEP_BATCH=3, TIMED_STEPS=1)
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


def test_notebook_rejects_bad_parameters_first(execute_notebook):
    entry = execute_notebook("05_layer_to_layer", SWEEP_DEPTHS=[8, 4])
    assert entry["status"] == "failed"
    assert "SWEEP_DEPTHS" in entry["error"] and "increasing" in entry["error"]
    assert "device_peak_bytes_by_layers_l2l" not in entry["measurements"]
