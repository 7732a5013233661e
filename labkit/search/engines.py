"""The same search space and trial on other engines: Hyperopt and Ray Tune run it; Katib gets an Experiment.

Reference for notebook 08. Each engine draws from `labkit.search.space` and trains with
`labkit.search.trial.train`, so the values are comparable with Optuna's at equal trial counts:

    run_hyperopt(config, n_trials=8, seed=0)      # Hyperopt's TPE; infeasible settings: status "fail"
    run_ray(config, n_trials=8, seed=0)           # Ray Tune's own (random) search on local worker processes
    katib_experiment(config, image=...)           # Kubeflow Katib's Experiment (a dict; to_yaml for kubectl)

Hyperopt and Ray are optional (`pip install -e '.[engines]'`); Katib needs a Kubernetes cluster,
so the Experiment is generated and checked against Katib's own API models, not submitted.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass

from labkit.search.space import active, from_hyperopt, katib_parameters, to_hyperopt, to_ray
from labkit.search.trial import StudyConfig, train
from labkit.validate import check_int


@dataclass
class EngineRun:
    """What one engine's search found."""

    engine: str  # "hyperopt" or "ray"
    values: list  # validation loss of each trial in order (the untrained loss for a setting that did not fit)
    fits: list  # whether each trial's setting fit the budget
    params: list  # each trial's setting (active parameters only)
    wall_s: float  # the whole search, engine start-up included

    def best_so_far(self) -> list[float]:
        """Return the best feasible value after each trial (nan until one fits)."""
        out, best = [], math.inf
        for v, ok in zip(self.values, self.fits):
            if ok:
                best = min(best, v)
            out.append(best if best < math.inf else math.nan)
        return out

    @property
    def best_value(self) -> float:
        """Return the best feasible value (nan if nothing fit)."""
        return self.best_so_far()[-1] if self.values else math.nan


def run_hyperopt(config: StudyConfig, n_trials: int, seed: int = 0) -> EngineRun:
    """Search with Hyperopt's TPE for `n_trials` trials; a setting that does not fit is a failed evaluation."""
    import numpy as np
    from hyperopt import STATUS_FAIL, STATUS_OK, Trials, fmin, tpe

    check_int("n_trials", n_trials, 1)
    space = config.space()
    run = EngineRun("hyperopt", [], [], [], 0.0)

    def objective(sample):
        params = active(from_hyperopt(sample, space), space)
        result = train(params, config)
        run.values.append(result.val_loss)
        run.fits.append(result.fits)
        run.params.append(params)
        # Hyperopt has no constraints: a setting that does not fit is a failure its TPE learns to avoid
        return {"loss": result.val_loss, "status": STATUS_OK if result.fits else STATUS_FAIL}

    start = time.perf_counter()
    fmin(objective, to_hyperopt(space), algo=tpe.suggest, max_evals=n_trials, trials=Trials(),
         rstate=np.random.default_rng(seed), show_progressbar=False)
    run.wall_s = time.perf_counter() - start
    return run


def _ray_trial(ray_config: dict) -> dict:
    """Ray Tune's function trainable: one trial of the workbook's search (module level: Ray pickles it)."""
    config = StudyConfig.from_dict(json.loads(ray_config["study_config"]))
    params = active({k: v for k, v in ray_config.items() if k != "study_config"}, config.space())
    result = train(params, config)
    return {"val_loss": result.val_loss, "fits": result.fits, "params_json": json.dumps(params)}


def run_ray(config: StudyConfig, n_trials: int, seed: int = 0, num_cpus: int = 2,
            storage_path: str | None = None) -> EngineRun:
    """Search with Ray Tune (its default random search) on `num_cpus` local worker processes."""
    import ray
    from ray import tune

    check_int("n_trials", n_trials, 1)
    space = to_ray(config.space())
    space["study_config"] = json.dumps(config.to_dict())
    start = time.perf_counter()
    storage_path = storage_path or tempfile.mkdtemp(prefix="labkit-ray-")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        tuner = tune.Tuner(
            tune.with_resources(_ray_trial, {"cpu": 1}), param_space=space,
            tune_config=tune.TuneConfig(num_samples=n_trials, metric="val_loss", mode="min",
                                        search_alg=tune.search.BasicVariantGenerator(random_state=seed)),
            run_config=tune.RunConfig(storage_path=os.path.abspath(storage_path), name="fit-the-model", verbose=0))
        grid = tuner.fit()
    finally:
        ray.shutdown()
    run = EngineRun("ray", [], [], [], time.perf_counter() - start)
    rows = sorted((r for r in grid if r.metrics), key=lambda r: r.metrics.get("trial_id", ""))
    for r in rows:
        run.values.append(float(r.metrics["val_loss"]))
        run.fits.append(bool(r.metrics["fits"]))
        run.params.append(json.loads(r.metrics["params_json"]))
    return run


# -- Kubeflow Katib ----------------------------------------------------------------------------------
KATIB_ALGORITHMS = ("random", "tpe", "grid", "hyperband", "bayesianoptimization", "cmaes", "sobol", "multivariate-tpe")


def katib_experiment(config: StudyConfig, image: str = "fit-the-model:latest", name: str = "fit-the-model",
                     namespace: str = "kubeflow", algorithm: str = "tpe", max_trials: int = 24,
                     parallel: int = 2) -> dict:
    """Return Katib's Experiment for the workbook's search: same space, each trial runs `labkit.tools.search trial`.

    Katib has no conditional parameters (it draws every one; the trial command drops the inactive
    ones) and no constraints (a setting that does not fit reports the untrained loss and fits=0).
    """
    if algorithm not in KATIB_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {KATIB_ALGORITHMS}, got {algorithm!r}")
    check_int("max_trials", max_trials, 1)
    check_int("parallel", parallel, 1)
    space = config.space(precisions=("fp32", "bf16"))  # fp16 needs a GPU in the pod: add it where there is one
    params = katib_parameters(space)
    command = ["python", "-m", "labkit.tools.search", "trial", "--config", json.dumps(config.to_dict())]
    for p in space:
        command += [f"--{p.name}", "${trialParameters." + p.name + "}"]
    return {
        "apiVersion": "kubeflow.org/v1beta1",
        "kind": "Experiment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "objective": {"type": "minimize", "objectiveMetricName": "val_loss",
                          "additionalMetricNames": ["peak_bytes", "fits"],
                          "metricStrategies": [{"name": "val_loss", "value": "latest"}]},
            "algorithm": {"algorithmName": algorithm},
            "parallelTrialCount": parallel,
            "maxTrialCount": max_trials,
            "maxFailedTrialCount": max(1, max_trials // 8),
            "metricsCollectorSpec": {"collector": {"kind": "StdOut"}},  # parses the trial's `name=value` lines
            "parameters": params,
            "trialTemplate": {
                "primaryContainerName": "training",
                "trialParameters": [{"name": p.name, "reference": p.name, "description": p.doc} for p in space],
                "trialSpec": {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "spec": {"template": {"spec": {
                        "containers": [{"name": "training", "image": image, "command": command,
                                        "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
                                        "resources": {"limits": {"cpu": "1", "memory": "2Gi"}}}],
                        "restartPolicy": "Never"}}},
                },
            },
        },
    }


def to_yaml(doc: dict) -> str:
    """Return a document as YAML (for `kubectl apply -f`)."""
    import yaml

    return yaml.safe_dump(doc, sort_keys=False, width=120)
