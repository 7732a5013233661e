"""The same search on other engines: Hyperopt and Ray Tune run it for real; Katib's Experiment is read back by
Katib's own API models; the command-line worker and trial entry points."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from labkit import search
from labkit.search import engines
from labkit.search.space import TECHNIQUES, check_params

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, batch=8, seq_len=16, train_steps=4, eval_every=2,
             eval_batch=8)


@pytest.fixture(scope="module")
def config():
    plain = {"technique": "none", "precision": "fp32", "micro_batch": 8, "lr": 1e-3}
    peak = search.predict_peak_bytes(plain, search.StudyConfig(budget_bytes=1, **SHAPE))
    return search.StudyConfig(budget_bytes=int(peak * 0.9), **SHAPE)  # the plain step does not fit


def _check_run(run, config, n):
    assert len(run.values) == len(run.fits) == len(run.params) == len(run.steps_run) == n
    for params, value, fits in zip(run.params, run.values, run.fits):
        check_params(params, config.space())
        assert fits == (search.predict_peak_bytes(params, config) <= config.budget_bytes)
        if not fits:
            assert value == search.untrained_loss(config)
    assert run.best_value == min(v for v, ok in zip(run.values, run.fits) if ok)


def test_hyperopt_runs_the_same_trials(config):
    pytest.importorskip("hyperopt", reason="Hyperopt is not installed (the engines extra)")
    run = engines.run_hyperopt(config, n_trials=6, seed=0, startup_trials=3)
    _check_run(run, config, 6)
    again = engines.run_hyperopt(config, n_trials=6, seed=0, startup_trials=3)
    assert again.params == run.params  # seeded


def test_hyperopts_tpe_runs_after_fewer_start_up_draws_than_trials(config, monkeypatch):
    """tpe.suggest's default n_startup_jobs is 20: a 6-trial search would be random search under TPE's name."""
    hyperopt = pytest.importorskip("hyperopt", reason="Hyperopt is not installed (the engines extra)")
    seen = []
    real = hyperopt.tpe.suggest
    monkeypatch.setattr(hyperopt.tpe, "suggest", lambda *a, **k: seen.append(k.get("n_startup_jobs")) or real(*a, **k))
    engines.run_hyperopt(config, n_trials=4, seed=0, fixed={"technique": "l2l"}, startup_trials=2)
    assert seen and set(seen) == {2}
    with pytest.raises(ValueError, match="startup_trials"):
        engines.run_hyperopt(config, n_trials=4, startup_trials=4)


def test_hyperopt_tunes_the_learning_rate_of_a_fixed_setting(config):
    pytest.importorskip("hyperopt", reason="Hyperopt is not installed (the engines extra)")
    run = engines.run_hyperopt(config, n_trials=3, seed=1, fixed={"technique": "l2l", "lr": 5.0}, startup_trials=2)
    assert all(set(p) == {"technique", "lr"} and p["lr"] < 1 for p in run.params)  # the fixed lr is not used
    assert all(run.fits)


def test_ray_tune_runs_the_same_trials_with_optunas_tpe_and_asha(config, tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (the engines extra)")
    try:
        run = engines.run_ray(config, n_trials=2, seed=0, num_cpus=2, startup_trials=1, storage_path=str(tmp_path))
    except engines.EngineUnavailable as e:  # Ray's own fixed start-up wait ran out: not a fault of the search
        pytest.skip(str(e))
    _check_run(run, config, 2)  # the second trial is TPE's draw
    assert run.engine == "ray" and run.wall_s > 0
    half = config.train_steps // 2  # ASHA's grace period: no trial stops before it
    assert all(s == 0 or half <= s <= config.train_steps for s in run.steps_run), run.steps_run


def test_a_ray_node_that_cannot_start_is_said_in_one_line_and_leaves_nothing_running(config, monkeypatch):
    """Ray's node start-up raises a bare Exception after starting processes that ray.shutdown() never learns of."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (the engines extra)")
    from labkit import children

    started = []

    def failing_init(**kwargs):
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))  # a GCS, say
        assert os.environ["OMP_NUM_THREADS"] == "1" and kwargs["_system_config"] == engines.RAY_SYSTEM_CONFIG
        raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")
    monkeypatch.setattr(ray, "init", failing_init)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with pytest.raises(engines.EngineUnavailable) as info:
        engines.run_ray(config, n_trials=3, startup_trials=2)
    assert str(info.value) == ("Ray's local node did not start on this machine: The current node timed out during "
                               "startup. This could happen because some of the raylet failed to startup or the GCS "
                               "has become overloaded.")
    assert started[0].wait(timeout=10) == -9 and started[0].pid not in children.descendants()
    assert os.environ["OMP_NUM_THREADS"] == "3"  # this process's own setting is back


def test_katib_experiment_is_read_back_unchanged_by_katibs_models(config):
    katib = pytest.importorskip("kubeflow_katib_api.models", reason="kubeflow-katib-api is not installed")
    doc = engines.katib_experiment(config, image="registry.example/fit:1", max_trials=12, parallel=3)
    assert katib.V1beta1Experiment.from_dict(doc).to_dict() == doc  # every key and type is one Katib knows
    spec = doc["spec"]
    assert spec["objective"]["type"] in ("minimize", "maximize") and spec["objective"]["objectiveMetricName"] == "val_loss"
    assert spec["algorithm"]["algorithmName"] == "tpe"
    assert spec["metricsCollectorSpec"]["collector"]["kind"] == "StdOut"
    assert {p["parameterType"] for p in spec["parameters"]} <= {"double", "int", "categorical", "discrete"}
    assert [p["name"] for p in spec["parameters"]] == [p["name"] for p in spec["trialTemplate"]["trialParameters"]]
    template = spec["trialTemplate"]["trialSpec"]["spec"]["template"]
    assert katib.IoK8sApiCoreV1PodTemplateSpec.from_dict(template).to_dict() == template  # a valid pod template
    command = template["spec"]["containers"][0]["command"]
    for p in spec["parameters"]:
        assert "${trialParameters." + p["name"] + "}" in command  # every parameter reaches the trial
    assert "nvidia.com/gpu" not in template["spec"]["containers"][0]["resources"]["limits"]  # a CPU study


def test_katib_asks_for_a_gpu_per_trial_on_cuda(config):
    import dataclasses

    cuda = dataclasses.replace(config, device="cuda", precisions=("fp32", "bf16", "fp16"))
    doc = engines.katib_experiment(cuda)
    container = doc["spec"]["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    precision = next(p for p in doc["spec"]["parameters"] if p["name"] == "precision")
    assert "fp16" in precision["feasibleSpace"]["list"]


def test_katib_trial_command_prints_the_metrics_katib_collects(config):
    """What a Katib pod runs: inactive parameters are given too (Katib draws them all) and dropped."""
    argv = [sys.executable, "-m", "labkit.tools.search", "trial", "--config", json.dumps(config.to_dict()),
            "--technique", "l2l", "--segments", "2", "--precision", "bf16", "--micro_batch", "4", "--lr", "0.001"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    lines = dict(line.split("=", 1) for line in out.stdout.split() if "=" in line)
    assert lines["status"] == "ok" and lines["fits"] == "1"
    assert float(lines["val_loss"]) < search.untrained_loss(config)
    assert int(lines["peak_bytes"]) == search.predict_peak_bytes({"technique": "l2l", "lr": 1e-3}, config)


def test_katib_command_prints_yaml():
    yaml = pytest.importorskip("yaml")
    out = subprocess.run([sys.executable, "-m", "labkit.tools.search", "katib", "--budget-bytes", "38797312"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    assert doc["kind"] == "Experiment"
    assert doc["spec"]["parameters"][0]["feasibleSpace"]["list"] == list(TECHNIQUES)
