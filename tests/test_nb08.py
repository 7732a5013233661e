"""Notebook 08 with another seed, a smaller model, fewer trials, the A100 and its own study file: the same verdicts.

The storage already holds an earlier run's study under the same prefix: the run must start a fresh study
and tell the whole story again (a worker killed mid-trial, nothing lost), not resume the old one.
"""

import optuna

import labkit

from labkit import search
from labkit.search import storage as stores
from labkit.search import study as studies

STEM = "08_memory_aware_search"


def test_notebook_08_verdicts_with_another_seed_and_an_earlier_study_in_the_storage(execute_notebook, tmp_path):
    storage_url = f"sqlite:///{tmp_path}/studies.db"
    storage = stores.make_storage(storage_url)
    config = search.StudyConfig(budget_bytes=1 << 30, n_layer=2)
    earlier = studies.create_study("nb08-test-20260101-000000-1", storage, config, "speed", sampler="random")
    studies.optimize(earlier, 2)  # a finished earlier run

    # 8 TPE trials, the chapters' 5 settings first (every setting once, SEARCH="all", is
    # test_search_study's brute-force test; the defaults run under nbval)
    entry = execute_notebook(STEM, timeout_s=400, SEED=3, N_LAYER=2, N_TRIALS=8, TRAIN_STEPS=4, LR_TRIALS=4, GPU="a100-80gb",
                             APPENDIX=True, BLACK_BOX_TRIALS=0, STORAGE=storage_url, STUDY="nb08-test")
    assert entry["status"] == "ok", entry.get("error")
    m = entry["measurements"]
    assert m["trials_lost_after_kill"] == 0 and m["killed_trial"] is not None  # a fresh study: the kill happened
    budget = labkit.running_example(n_layer=2, batch_size=16, seq_len=64).budget_bytes
    assert m["fastest_fitting_peak_bytes"] <= budget
    # on a CPU the speeds are projections on the GPU asked for: exact, no noise; on an A100 16-bit is the fastest
    assert m["speed_on"] == "projected on the a100-80gb" and m["timing_noise_ratio"] is None
    assert all(r >= 1 for r in m["fastest_vs_chapters_speed_ratio"].values()), m["fastest_vs_chapters_speed_ratio"]
    assert m["fastest_fitting_params"].get("precision") == "bf16", m["fastest_fitting_params"]
    assert m["estimate_agreement"] == 1.0
    assert 0 <= m["estimate_max_rel_peak_error"] <= 0.02
    assert m["memory_growth_bytes_over_trials"] <= 0
    assert 0 <= m["pruning_saved_step_fraction"] < 1
    assert m["pareto_front_size"] >= 1
    assert m["black_box_best"] is None  # BLACK_BOX_TRIALS=0 skips it, and says so
    # the appendix (skipped by default, APPENDIX=True here: nbval runs the defaults, this run the appendix)
    assert len(m["tpe_minus_random_by_seed"]) == 1 and len(m["speedup_2_workers_by_repeat"]) == 1

    names = optuna.get_all_study_names(storage)
    fresh = [n for n in names if n.startswith("nb08-test-") and n.count("-") == 4 and n != earlier.study_name]
    assert len(fresh) == 1, names  # one new speed study; the earlier one untouched
    assert len(optuna.load_study(study_name=earlier.study_name, storage=storage).trials) == 2
    study = optuna.load_study(study_name=fresh[0], storage=storage)
    assert studies.lost_trials(study) == []
    assert m["fastest_fitting_params"] in [dict(sorted(t.params.items())) for t in study.trials]  # the study's own
