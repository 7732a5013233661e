"""labkit.search.trial: a setting predicted on fake tensors, then trained under the budget, with every outcome."""

from __future__ import annotations

import pytest
import torch

from labkit import search
from labkit.estimate import example_batch
from labkit.gpus import step_time
from labkit.meter import live_tensor_bytes
from labkit.models import token_weights
from labkit.search.trial import SettingStep
from labkit.techniques.accumulation import split_batch
from labkit.work import Work, count_work

pytestmark = pytest.mark.usefixtures("one_thread")

PLAIN = {"technique": "none", "precision": "fp32", "lr": 1e-3}


@pytest.fixture(scope="module")
def tiny():
    """A tiny study: 2 blocks of width 32, 8 samples of 16 tokens, a budget of 90% of the plain step's peak.

    (Its parameters and Adam state weigh more than its activations: 90% is what each chapter's setting fits.)
    """
    shape = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, batch=8, seq_len=16, train_steps=4, eval_every=2,
                 eval_batch=8, timed_steps=2)
    plain_peak = search.predict_peak_bytes(dict(PLAIN, micro_batch=8), search.StudyConfig(budget_bytes=1, **shape))
    return search.StudyConfig(budget_bytes=int(plain_peak * 0.9), **shape)


SETTINGS = [
    dict(PLAIN, micro_batch=2),
    {"technique": "checkpoint", "segments": 2, "precision": "fp32", "micro_batch": 8, "lr": 1e-3},
    {"technique": "checkpoint", "segments": 2, "precision": "bf16", "micro_batch": 4, "lr": 1e-3},
    {"technique": "offload", "precision": "fp32", "micro_batch": 8, "lr": 1e-3},
    {"technique": "l2l", "lr": 1e-3},
]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_prediction_equals_the_trained_peak(params, tiny):
    result = search.train(params, tiny)
    print(result)
    assert result.status == "ok" and result.fits_predicted
    assert result.peak_bytes == result.predicted_peak_bytes  # the same step on fake tensors: to the byte
    assert result.steps_run == tiny.train_steps
    assert [s for s, _ in result.val_losses] == [2, 4]
    assert result.val_loss < search.untrained_loss(tiny)  # it learned something
    assert result.tokens_per_s > 0


def test_a_study_on_a_cpu_predicts_and_meters_16_bit_settings_with_a_gpus_autocast_dtypes(tiny):
    # the search answers for a GPU: a 16-bit step on a CPU takes CUDA autocast's dtypes (chapter 03), so a CPU study
    # predicts what a study on CUDA predicts (the H200's metered peaks: test_a_study_on_cuda_predicts_...), not its own
    import dataclasses

    cuda = dataclasses.replace(tiny, device="cuda")
    for params in (dict(PLAIN, precision="bf16", micro_batch=4), SETTINGS[2]):  # plain, and checkpointed (recomputed)
        assert search.predict_peak_bytes(params, tiny) == search.predict_peak_bytes(params, cuda), params
    step = SettingStep(dict(PLAIN, precision="bf16", micro_batch=4), tiny, "cpu")
    batch = example_batch(tiny.gpt, tiny.batch, tiny.seq_len)
    seen = []

    class Softmaxes(torch.overrides.TorchFunctionMode):  # outside the step's own modes: sees what they call
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.Tensor.softmax:
                seen.append(out.dtype)
            return out
    with Softmaxes():
        step.step(batch)
    assert seen and set(seen) == {torch.float32}  # CUDA's softmax: fp32 (this CPU's autocast: bf16)


def test_the_memory_techniques_learn_the_same_thing(tiny):
    """Checkpointing, offload, micro-batches and L2L compute the same gradients: the same loss to rounding."""
    losses = [search.train(p, tiny).val_loss for p in SETTINGS if p.get("precision", "fp32") == "fp32"]
    assert max(losses) - min(losses) < 1e-4, losses


def test_a_setting_predicted_not_to_fit_is_not_trained(tiny, monkeypatch):
    monkeypatch.setattr(SettingStep, "step", lambda *a: pytest.fail("a setting predicted not to fit was trained"))
    result = search.train(dict(PLAIN, micro_batch=8), tiny)
    assert (result.status, result.fits_predicted, result.steps_run) == ("predicted_oom", False, 0)
    assert result.predicted_peak_bytes > tiny.budget_bytes
    assert result.val_loss == search.untrained_loss(tiny) and not result.fits


def test_a_wrong_prediction_ends_in_oom_not_a_crash(tiny, monkeypatch):
    """If the estimate says "fits" and the step does not, the budget refuses it: status "oom", a result."""
    monkeypatch.setattr(search.trial, "predict_step", lambda params, config: (1, Work()))
    result = search.train(dict(PLAIN, micro_batch=8), tiny)
    assert result.status == "oom" and not result.fits
    assert "budget exceeded" in result.error and result.peak_bytes > tiny.budget_bytes
    assert result.val_loss == search.untrained_loss(tiny)
    assert search.confirm_oom(dict(PLAIN, micro_batch=8), tiny)
    assert not search.confirm_oom(SETTINGS[0], tiny)


def test_the_prediction_check_runs_an_untried_setting_predicted_not_to_fit(tiny):
    """check_predictions(untried=...): a setting predicted not to fit that no trial drew is confirmed too (chapter 08
    adds the plain step's); one predicted to fit is not run."""
    from labkit.search.checks import check_predictions

    plain, small = dict(PLAIN, micro_batch=8), SETTINGS[0]
    assert check_predictions([], tiny).confirmed_oom == {}
    check = check_predictions([], tiny, untried=(plain, small))
    key = tuple(sorted((k, v) for k, v in plain.items() if k != "lr"))
    assert check.confirmed_oom == {key: True} and check.agreement == 1.0
    assert dict(check.rows())["hit OutOfMemory in one step, as predicted"] == "1 of 1 settings"


def test_fit_here_meters_a_setting_with_no_budget_and_sets_its_verdict_beside_the_prediction(tiny):
    """fit_here: a setting that fits metered as measure_setting meters it; one predicted not to fit metered in full
    (its whole peak over the budget, not refused); a hand-made disagreement and a setting not run here (chapter 08)."""
    from labkit.search.checks import FitHere, fit_here

    small = fit_here(SETTINGS[0], tiny)
    assert small.measured_bytes == search.measure_setting(SETTINGS[0], tiny).peak_bytes == small.predicted_bytes
    assert small.fits and small.agrees and small.verdict() == "yes, metered"
    plain = fit_here(dict(PLAIN, micro_batch=8), tiny)
    assert plain.measured_bytes == plain.predicted_bytes > tiny.budget_bytes  # run to its end, not refused
    assert not plain.fits and plain.agrees and plain.verdict().startswith("no, metered ")
    under = FitHere(predicted_bytes=90, measured_bytes=110, budget_bytes=100)  # predicted to fit, metered over
    assert not under.fits and not under.agrees and under.verdict() == "no, metered 10 B over"
    over = FitHere(predicted_bytes=110, measured_bytes=90, budget_bytes=100)  # predicted not to, metered within
    assert over.fits and not over.agrees
    untried = FitHere(predicted_bytes=90, measured_bytes=None, budget_bytes=100)
    assert untried.peak_bytes == 90 and untried.agrees and untried.verdict() == "yes, predicted"


def test_answer_rows_give_every_setting_a_row_and_a_setting_without_a_speed_dashes():
    """answer_rows: one row per setting in order, the verdict from FitHere, "-" speed cells where none is given, the
    knobs without the learning rate (chapter 08's table)."""
    from labkit.search.checks import FitHere, answer_rows

    settings = {"a": {"technique": "l2l", "lr": 1e-3}, "b": dict(PLAIN, micro_batch=8)}
    fit = {"a": FitHere(90, 90, 100), "b": FitHere(120, 130, 100)}
    rows = answer_rows(settings, fit, {"a": ("1,000", "1.00x")}, ("tokens/s", "time"))
    assert rows[0] == ("setting", "peak", "fits here", "tokens/s", "time", "knobs")
    assert rows[1] == ("a", "90 B", "yes, metered", "1,000", "1.00x", {"technique": "l2l"})
    assert rows[2] == ("b", "130 B", "no, metered 30 B over", "-", "-", {"technique": "none", "precision": "fp32",
                                                                        "micro_batch": 8})


def test_report_can_stop_a_trial(tiny):
    seen = []

    class Stop(Exception):
        pass

    def report(progress):
        seen.append((progress.steps_run, progress.val_loss, progress.peak_bytes))
        raise Stop

    with pytest.raises(Stop):
        search.train(SETTINGS[1], tiny, report=report)
    assert len(seen) == 1 and seen[0][0] == 2 and seen[0][2] == search.predict_peak_bytes(SETTINGS[1], tiny)


def test_measure_setting_on_a_cpu_meters_then_projects_its_counted_work_timing_nothing(tiny, monkeypatch):
    monkeypatch.setattr(search.trial, "_timed_step", lambda *a: pytest.fail("a CPU step was timed to rank a setting"))
    result = search.measure_setting(SETTINGS[1], tiny)
    assert result.status == "ok" and result.peak_bytes == result.predicted_peak_bytes <= tiny.budget_bytes
    assert result.peak_here_bytes == result.peak_bytes
    assert result.steps_run == tiny.metered_steps and result.val_loss is None and result.relative_speed is None
    assert result.projected_step_s == step_time(result.work, tiny.gpu).time_s > 0
    assert result.tokens_per_s == tiny.tokens_per_step / result.projected_step_s
    plain = search.plain_setting(tiny)
    against = search.measure_setting(SETTINGS[1], tiny, reference=plain)
    assert against.relative_speed == search.projected_step_s(plain, tiny) / result.projected_step_s < 1  # recomputes
    half = search.measure_setting(dict(SETTINGS[0], precision="bf16"), tiny, reference=plain)  # the T4's fp16 units
    full = search.measure_setting(SETTINGS[0], tiny, reference=plain)
    assert half.relative_speed > full.relative_speed and half.work.flops.get("bf16", 0) > 0
    skipped = search.measure_setting(dict(PLAIN, micro_batch=8), tiny)
    assert (skipped.status, skipped.steps_run, skipped.tokens_per_s) == ("predicted_oom", 0, None)


def test_a_16_bit_setting_is_predicted_not_run_on_a_cpu_without_16_bit_units(tiny, monkeypatch):
    monkeypatch.setattr(search.trial, "bf16_native", lambda: False)
    monkeypatch.setattr(SettingStep, "metered_step", lambda *a: pytest.fail("a 16-bit step ran without 16-bit units"))
    result = search.measure_setting(SETTINGS[2], tiny, reference=search.plain_setting(tiny))
    assert (result.status, result.steps_run, result.peak_bytes) == ("predicted", 0, None) and result.fits
    assert result.peak_here_bytes == result.predicted_peak_bytes > 0  # not run here: its prediction stands in
    assert result.relative_speed == search.projected_step_s(search.plain_setting(tiny), tiny) / result.projected_step_s
    assert search.runs_here(SETTINGS[1], tiny) and not search.runs_here(SETTINGS[2], tiny)
    monkeypatch.setattr(search.trial, "bf16_native", lambda: True)
    assert search.runs_here(SETTINGS[2], tiny)


def test_the_work_counted_on_fake_tensors_is_the_real_steps(tiny):
    """predict_step counts the step it predicts: a real step after a warm-up does the same work, to the FLOP and byte,
    but for the target tokens a real step counts to weigh its micro-batches (fake tensors hold none to count)."""
    for params in SETTINGS[:2] + SETTINGS[3:]:
        step = SettingStep(params, tiny, "cpu")
        batch = example_batch(tiny.gpt, tiny.batch, tiny.seq_len)
        step.step(batch)  # warm-up: Adam's state exists, as on the fake step
        real = count_work(step.step, batch)
        micro = split_batch(batch, params.get("micro_batch", tiny.batch))
        weigh = count_work(token_weights, [b[-1] for b in micro]) if len(micro) > 1 else Work()
        fake = search.predict_step(params, tiny)[1] + weigh
        assert (real.flops, real.bytes_accessed, real.kernels, real.host_bytes) == \
            (fake.flops, fake.bytes_accessed, fake.kernels, fake.host_bytes), params


def test_paired_times_alternate_which_step_goes_first_and_a_slow_moment_cancels(tiny, monkeypatch):
    """The reference's steps alternate with the setting's (on CUDA); a slow moment slows both and the ratio stays."""
    seen = []

    def fake_timed_step(step, batch, device):  # the reference takes 2 units, the setting 1, every other pair 10x slower
        seen.append(step.params == search.plain_setting(tiny))
        slow = 10 if (len(seen) - 1) // 2 % 2 else 1
        return (2.0 if seen[-1] else 1.0) * slow

    monkeypatch.setattr(search.trial, "_timed_step", fake_timed_step)
    step, ref = SettingStep(SETTINGS[0], tiny, "cpu"), SettingStep(search.plain_setting(tiny), tiny, "cpu")
    batches = iter(lambda: None, 1)
    times, ref_times = search.trial._paired_times(step, batches, ref, batches, 4)
    assert [r / t for r, t in zip(ref_times, times)] == [2.0] * 4  # paired: the slow pairs cancel
    assert seen == [False, True, True, False, False, True, True, False]  # who goes first alternates


def test_time_settings_interleaves_rounds_without_a_budget(tiny):
    settings = {"fits": SETTINGS[0], "does not fit": dict(PLAIN, micro_batch=8)}
    timed = search.time_settings(settings, tiny, rounds=3)
    assert set(timed) == set(settings)
    assert all(t.steps == 3 and len(t.step_times_s) == 3 and t.tokens_per_s > 0 for t in timed.values())
    with pytest.raises(ValueError, match="rounds"):
        search.time_settings(settings, tiny, rounds=0)


def test_fp16_steps_use_a_grad_scaler_on_cuda_only(tiny):
    import dataclasses

    on_cpu = SettingStep(SETTINGS[0], tiny, "cpu")
    assert on_cpu.scaler is None  # fp32: no scaling
    cuda = dataclasses.replace(tiny, device="cuda", precisions=("fp32", "bf16", "fp16"))
    fp16 = dict(SETTINGS[0], precision="fp16")
    with pytest.raises(ValueError, match="fp16"):
        SettingStep(fp16, tiny, "cpu")  # never fp16 compute on a CPU
    if torch.cuda.is_available():
        assert isinstance(SettingStep(fp16, cuda, "cuda").scaler, torch.amp.GradScaler)


def test_chapter_settings_all_fit(tiny):
    chapters = search.chapter_settings(tiny)
    assert list(chapters) == ["01 gradient accumulation", "02 activation checkpointing", "03 mixed precision (bf16)",
                              "04 activation offload", "05 layer to layer"]
    for params in chapters.values():
        search.check_params(params, tiny.space())
        assert search.predict_peak_bytes(params, tiny) <= tiny.budget_bytes
    micro = chapters["01 gradient accumulation"]["micro_batch"]
    assert search.predict_peak_bytes(dict(PLAIN, micro_batch=micro * 2), tiny) > tiny.budget_bytes  # the fewest steps


def test_memory_is_freed_between_trials(tiny):
    """50 trials in one process: the bytes held by live tensors do not grow from trial to trial."""
    at_start = []
    for i in range(50):
        if i % 10 == 0:  # (a census of every live object takes a fifth of a second)
            at_start.append(live_tensor_bytes())
        params = dict(SETTINGS[i % len(SETTINGS)], lr=1e-3 * (1 + i / 50))
        search.train(params, tiny)
    at_start.append(live_tensor_bytes())
    print(at_start)
    assert at_start[-1] <= at_start[1], f"live tensor bytes grew from {at_start[1]} to {at_start[-1]} over 50 trials"


def test_live_tensor_bytes_counts_each_storage_once():
    before = live_tensor_bytes()
    a = torch.empty(1000)
    views = [a[:10], a.view(10, 100)]
    assert live_tensor_bytes() - before == 4000
    del a, views
    assert live_tensor_bytes() == before


def test_live_tensor_bytes_passes_over_dead_weak_proxies():
    """A kernel holds weakref.proxy objects whose referent died; touching one raises ReferenceError."""
    import weakref

    class Thing:
        pass

    thing = Thing()
    holder = [weakref.proxy(thing)]
    del thing
    before = live_tensor_bytes()
    a = torch.empty(250)
    assert live_tensor_bytes() - before == 1000
    del a, holder


@pytest.mark.parametrize("kwargs, words", [
    (dict(budget_bytes=0), "budget_bytes"),
    (dict(budget_bytes=10, n_embd=30, n_head=4), "divisible"),
    (dict(budget_bytes=10, metered_steps=9), "metered_steps"),
    (dict(budget_bytes=10, device="auto"), "device"),
    (dict(budget_bytes=10, precisions=("fp32", "fp16")), "fp16 is searched only on CUDA"),
    (dict(budget_bytes=10, precisions=()), "precisions"),
])
def test_bad_study_configs_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        search.StudyConfig(**kwargs)


def test_config_round_trips_through_plain_data(tiny):
    assert search.StudyConfig(**tiny.to_dict()) == tiny
    assert tiny.to_dict()["precisions"] == ["fp32", "bf16"]  # JSON-ready


def test_fp16_compute_is_refused_on_a_cpu(tiny):
    with pytest.raises(ValueError, match="fp16 compute on CPU"):
        search.train(dict(PLAIN, precision="fp16", micro_batch=8), tiny)


def test_the_finalists_are_the_fastest_distinct_settings_timed_with_their_twins(tiny):
    import optuna
    from labkit.search.trial import CONTROL

    def trial(number, params, value):
        t = optuna.trial.create_trial(params=params, value=value, distributions={
            k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()})
        t.number = number
        return t
    a, b, c = (dict(PLAIN, micro_batch=m) for m in (8, 4, 2))
    a, b, c = ({k: v for k, v in s.items() if k != "lr"} for s in (a, b, c))
    trials = [trial(0, a, 1.0), trial(3, a, 0.99), trial(1, b, 0.8), trial(2, c, 0.3)]  # a twice; c below the band
    fair = search.time_finalists(trials, {"chapter": dict(b, lr=1e-3)}, tiny, most=3, band=0.5, rounds=2,
                                 noise_limit=10.0)
    assert list(fair.finalists.values()) == [dict(sorted(a.items())), dict(sorted(b.items()))]  # distinct, in the band
    assert set(fair.candidates) == {"search #1 (trial 0)", "search #2 (trial 1)", CONTROL, "chapter"}
    assert set(fair.twin_ratios) == {("search #1 (trial 0)", CONTROL), ("search #2 (trial 1)", "chapter")}
    assert fair.rounds == 2 and fair.reliable and fair.chosen in fair.finalists  # within 10x: the first timing stands
    assert all(t.steps == 2 for t in fair.timed.values())
    strict = search.time_finalists(trials[:1], {}, tiny, most=1, band=0.5, rounds=1, noise_limit=0.0, attempts=2)
    assert strict.rounds == 2 and not strict.reliable  # two copies never time exactly alike: twice the rounds, then
    #                                                    called unreliable


def test_a_study_on_cuda_predicts_the_peaks_an_h200_metered():
    """Chapter 08's trials on an H200 (tests/data): a study on CUDA predicts them on this CPU's fake tensors, with
    CUDA autocast's dtypes and 04's and 05's prefetch; the only bytes over are Adam's step counts (4 B per parameter
    tensor), which CUDA keeps on the host (05's Adam is on the host anyway)."""
    import json
    from pathlib import Path

    from labkit.example import running_example
    from labkit.models import GPT

    recorded = json.loads((Path(__file__).parent / "data" / "h200_chapter08_trials.json").read_text())["trials"]
    ex = running_example()
    config = search.StudyConfig(budget_bytes=ex.budget_bytes, n_layer=ex.config.n_layer, batch=ex.batch_size,
                                seq_len=ex.seq_len, seed=0, device="cuda", precisions=("fp32", "bf16"))
    step_counts = 4 * len(list(GPT(config.gpt).parameters()))
    for trial in recorded:
        over = search.predict_peak_bytes({**trial["params"], "lr": 1e-3}, config) - trial["metered_bytes"]
        assert over == (0 if trial["params"]["technique"] == "l2l" else step_counts), trial
    assert any(t["predicted_before_fix"] < t["metered_bytes"] for t in recorded)  # the record held a miss to fix
