"""Notebook 08 under papermill with another seed, fewer trials and its own study file: the invariants hold."""

import optuna

from labkit.search import study as studies

STEM = "08_memory_aware_search"
CHAPTERS = 5  # 01-05's settings open the main study (bf16's only where this CPU runs it fast)


def test_notebook_08_invariants_with_another_seed_and_fewer_trials(execute_notebook, tmp_path):
    storage_url = f"sqlite:///{tmp_path}/studies.db"
    entry = execute_notebook(STEM, timeout_s=400, SEED=3, TRAIN_STEPS=4, N_TRIALS=8, PRUNER="hyperband", PARETO_TRIALS=4,
                             SAMPLER_TRIALS=4, SAMPLER_SEEDS=1, SPEEDUP_TRIALS=2, BLACK_BOX_TRIALS=0,
                             ENGINE_TRIALS=4, STORAGE=storage_url, STUDY="nb08-test")
    assert entry["status"] == "ok", entry.get("error")
    m = entry["measurements"]
    assert m["n_trials"] >= 8
    assert m["trials_lost_after_kill"] == 0 and m["killed_trial"] is not None
    assert m["best_fits_in_budget"] is True
    assert all(m["best_value"] <= v for v in m["chapter_setting_values"].values())
    assert len(m["chapter_setting_values"]) in (CHAPTERS - 1, CHAPTERS)
    assert m["estimate_agreement"] == 1.0
    assert 0 <= m["estimate_max_rel_peak_error"] <= 0.02
    assert m["memory_growth_bytes_over_trials"] <= 0
    assert 0 <= m["pruning_saved_step_fraction"] < 1
    assert m["pareto_front_size"] >= 1
    assert m["speedup_2_workers"] > 0
    assert m["black_box_best"] is None  # BLACK_BOX_TRIALS=0 skips it, and says so
    assert set(m["tpe_vs_random_best_by_seed"]) == {"tpe", "random"}
    assert all(len(v) == 1 for v in m["tpe_vs_random_best_by_seed"].values())

    # the study is in the file named by STORAGE, under the name STUDY plus the settings' digest; it resumes
    storage = studies.make_storage(storage_url)
    names = [n for n in optuna.get_all_study_names(storage) if n.startswith("nb08-test-")]
    main = [n for n in names if n.count("-") == 2]
    assert len(main) == 1, names
    study = optuna.load_study(study_name=main[0], storage=storage)
    assert study.best_trial.params == m["best_params"]
    assert studies.lost_trials(study) == []
