"""labkit.search.space: one definition, conditional parameters, and its forms for Optuna, Hyperopt, Ray and Katib."""

from __future__ import annotations

import math

import optuna
import pytest

from labkit.search.space import (TECHNIQUES, Param, active, check_params, from_hyperopt, katib_parameters,
                                 suggest, to_hyperopt, workbook_space)

SPACE = workbook_space(n_layer=4, batch=16)


def test_workbook_space_names_the_chapters_knobs():
    assert [p.name for p in SPACE] == ["technique", "segments", "precision", "micro_batch", "lr"]
    by_name = {p.name: p for p in SPACE}
    assert by_name["technique"].choices == TECHNIQUES
    assert (by_name["segments"].low, by_name["segments"].high) == (1, 4)
    assert by_name["micro_batch"].choices == (16, 8, 4, 2)  # divisors of the batch, down to 2
    assert by_name["lr"].log and by_name["lr"].low < 1e-3 < by_name["lr"].high
    twelve = next(p for p in workbook_space(n_layer=1, batch=12, min_micro_batch=1) if p.name == "micro_batch")
    assert twelve.choices == (12, 6, 4, 3, 2, 1)


@pytest.mark.parametrize("kwargs, words", [
    (dict(name="x", kind="float", low=1.0, high=0.5), "low <= high"),
    (dict(name="x", kind="categorical"), "needs choices"),
    (dict(name="x", kind="float", low=0.0, high=1.0, log=True), "above 0"),
    (dict(name="x", kind="complex", low=0, high=1), "kind must be"),
])
def test_bad_params_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Param(**kwargs)


def test_conditions_keep_only_what_exists():
    drawn = {"technique": "l2l", "segments": 3, "precision": "bf16", "micro_batch": 4, "lr": 1e-3}
    assert active(drawn, SPACE) == {"technique": "l2l", "lr": 1e-3}
    drawn["technique"] = "checkpoint"
    assert active(drawn, SPACE) == drawn
    drawn["technique"] = "offload"
    assert "segments" not in active(drawn, SPACE)


@pytest.mark.parametrize("params, words", [
    ({"technique": "l2l", "lr": 1e-3, "precision": "fp32"}, "precision is not searched when technique = 'l2l'"),
    ({"technique": "none", "precision": "fp32", "lr": 1e-3}, "micro_batch is missing"),
    ({"technique": "none", "precision": "fp64", "micro_batch": 16, "lr": 1e-3}, "precision must be one of"),
    ({"technique": "checkpoint", "segments": 9, "precision": "fp32", "micro_batch": 16, "lr": 1e-3}, r"segments must lie"),
    ({"technique": "l2l", "lr": 1e-3, "dropout": 0.1}, "unknown parameters"),
])
def test_check_params_names_what_is_wrong(params, words):
    with pytest.raises(ValueError, match=words):
        check_params(params, SPACE)


def test_optuna_draws_only_active_parameters():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(40):
        trial = study.ask()
        params = suggest(trial, SPACE)
        check_params(params, SPACE)  # exactly the active ones, each in range
        assert set(trial.params) == set(params)
        seen.add(params["technique"])
        study.tell(trial, 0.0)
    assert seen == set(TECHNIQUES)


def test_hyperopt_samples_are_points_of_the_space():
    pytest.importorskip("hyperopt", reason="Hyperopt is not installed (the engines extra)")
    from hyperopt.pyll.stochastic import sample
    import numpy as np

    hp_space = to_hyperopt(SPACE)
    rng = np.random.default_rng(0)
    techniques = set()
    for _ in range(60):
        params = from_hyperopt(sample(hp_space, rng=rng), SPACE)
        check_params(params, SPACE)
        assert all(type(v) in (int, float, str) for v in params.values()), params
        techniques.add(params["technique"])
    assert techniques == set(TECHNIQUES)


def test_katib_parameters_are_strings_in_katibs_types():
    params = {p["name"]: p for p in katib_parameters(SPACE)}
    assert params["technique"] == {"name": "technique", "parameterType": "categorical",
                                   "feasibleSpace": {"list": list(TECHNIQUES)}}
    assert params["segments"]["feasibleSpace"] == {"min": "1", "max": "4"}
    assert params["micro_batch"]["feasibleSpace"]["list"] == ["16", "8", "4", "2"]
    lr = params["lr"]
    assert lr["parameterType"] == "double" and lr["feasibleSpace"]["distribution"] == "logUniform"
    assert math.isclose(float(lr["feasibleSpace"]["min"]), 1e-4)


def test_enumerate_settings_lists_each_active_combination_once():
    from labkit.search.space import enumerate_settings

    knobs = [p for p in SPACE if p.name != "lr"]
    settings = enumerate_settings(knobs)
    # none/offload: 2 precisions x 4 micro-batches; checkpoint: x 4 segments; l2l: one
    assert len(settings) == 8 + 8 + 32 + 1 == len({tuple(sorted(s.items())) for s in settings})
    for s in settings:
        check_params(dict(s, lr=1e-3), SPACE)
    assert {"technique": "l2l"} in settings
    with pytest.raises(ValueError, match="float"):
        enumerate_settings(SPACE)
