"""The search on other engines (notebook 08): Hyperopt and Ray Tune run the same space and trials; Katib gets an
Experiment (Hyperopt and Ray: `pip install -e '.[engines]'`)."""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass

from labkit.children import descendants, kill_pids
from labkit.search.space import active, from_hyperopt, katib_parameters, suggest, to_hyperopt
from labkit.search.config import StudyConfig
from labkit.search.trial import train
from labkit.validate import check_int


@dataclass
class EngineRun:
    """What one engine's search found."""

    engine: str  # "hyperopt" or "ray"
    values: list  # validation loss of each trial in order (the untrained loss for a setting that did not fit)
    fits: list  # whether each trial's setting fit the budget
    params: list  # each trial's setting (active parameters only, the fixed ones included)
    wall_s: float  # the whole search, engine start-up included
    steps_run: list | None = None  # optimizer steps each trial trained (Ray's ASHA stops some early)

    @property
    def best_value(self) -> float:
        """Return the best value of a trial that fit (nan if none did)."""
        return min((v for v, ok in zip(self.values, self.fits) if ok), default=math.nan)


def _searched(config: StudyConfig, fixed: dict | None, n_trials: int, startup_trials: int):
    """Return the parameters an engine draws: the whole space, or the learning rate of a fixed setting."""
    check_int("n_trials", n_trials, 2)
    check_int("startup_trials", startup_trials, 1, n_trials - 1)  # else TPE never runs: random search
    fixed = {k: v for k, v in (fixed or {}).items() if k != "lr"}
    return fixed, [p for p in config.space() if p.name not in fixed]


def run_hyperopt(config: StudyConfig, n_trials: int, seed: int = 0, fixed: dict | None = None,
                 startup_trials: int = 3) -> EngineRun:
    """Search with Hyperopt's TPE for `n_trials` trials, the first `startup_trials` drawn at random.

    A setting that does not fit is a failed evaluation (Hyperopt has no constraints).
    """
    import numpy as np
    from hyperopt import STATUS_FAIL, STATUS_OK, Trials, fmin, tpe

    fixed, space = _searched(config, fixed, n_trials, startup_trials)
    run = EngineRun("hyperopt", [], [], [], 0.0, [])

    def objective(sample):
        params = {**fixed, **active(from_hyperopt(sample, space), space)}
        result = train(params, config)
        run.values.append(result.val_loss)
        run.fits.append(result.fits)
        run.params.append(params)
        run.steps_run.append(result.steps_run)
        # Hyperopt has no constraints: a setting that does not fit is a failure its TPE learns to avoid
        return {"loss": result.val_loss, "status": STATUS_OK if result.fits else STATUS_FAIL}

    start = time.perf_counter()
    fmin(objective, to_hyperopt(space), algo=functools.partial(tpe.suggest, n_startup_jobs=startup_trials),
         max_evals=n_trials, trials=Trials(), rstate=np.random.default_rng(seed), show_progressbar=False)
    run.wall_s = time.perf_counter() - start
    return run


def _ray_trial(ray_config: dict) -> None:
    """Ray Tune's function trainable: one trial, reporting each validation (module level: Ray pickles it)."""
    from ray import tune

    config = StudyConfig(**json.loads(ray_config["study_config"]))
    params = active({**json.loads(ray_config["fixed"]),
                     **{k: v for k, v in ray_config.items() if k not in ("study_config", "fixed")}}, config.space())

    def report(progress, fits=True):  # ASHA compares trials at these reports and stops the laggards
        tune.report({"val_loss": progress.val_loss, "fits": fits, "steps_run": progress.steps_run,
                     "params_json": json.dumps(params)})

    result = train(params, config, report=report)
    if not result.fits:  # nothing was reported: report the outcome once
        report(result, fits=False)


class _DefineByRun:
    """The workbook's own conditional space, drawn by Optuna inside Ray (a class: Ray pickles its searcher)."""

    def __init__(self, space, constants: dict):
        self.space, self.constants = space, constants

    def __call__(self, trial) -> dict:
        suggest(trial, self.space)
        return self.constants


class EngineUnavailable(RuntimeError):
    """An outside engine could not start on this machine (not a fault of the search): the message says which, why."""


# Ray's node waits a fixed 30 s for its raylet to register (ray/_private/node.py, `raylet_start_wait_time_s = 30`,
# not configurable in Ray 2.60). The raylet registers once its dashboard agent, a Python process, is up; every other
# Python process Ray starts at the same time competes with it. Seen here under full load on 2 cores: 17-18 s with
# Ray's defaults, 11 s without prestarted workers and without a runtime environment.
RAY_SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


def _start_ray(num_cpus: int, num_gpus: int) -> None:
    """Start a local Ray node with the fewest processes at once; raise EngineUnavailable when Ray itself cannot start.

    Workers take OMP_NUM_THREADS=1 from the environment Ray starts with (no runtime environment to set up).
    """
    import ray

    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the raylet, hence by every worker it starts
    before = descendants()
    try:
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
                 configure_logging=False, _system_config=RAY_SYSTEM_CONFIG)
    except Exception as e:  # Ray raises a bare Exception when its node does not come up in its fixed wait
        ray.shutdown()
        kill_pids(descendants() - before)  # what the failed start left running (ray.shutdown never knew of it)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EngineUnavailable(f"Ray's local node did not start on this machine: {first}") from e
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads


def run_ray(config: StudyConfig, n_trials: int, seed: int = 0, num_cpus: int = 2, fixed: dict | None = None,
            startup_trials: int = 3, storage_path: str | None = None) -> EngineRun:
    """Search with Ray Tune: Optuna's TPE as its searcher, ASHA stopping trials that lag, on local workers.

    Each trial asks Ray for one CPU, and one GPU when `config.device` is "cuda". Raises EngineUnavailable when Ray's
    own node cannot start.
    """
    import optuna
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    fixed, space = _searched(config, fixed, n_trials, startup_trials)
    constants = {"study_config": json.dumps(config.to_dict()), "fixed": json.dumps(fixed)}

    validations = config.train_steps // config.eval_every
    searcher = OptunaSearch(_DefineByRun(space, constants), metric="val_loss", mode="min",
                            sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials))
    scheduler = ASHAScheduler(time_attr="training_iteration", max_t=validations,
                              grace_period=max(1, validations // 2), reduction_factor=2)
    resources = {"cpu": 1, "gpu": 1 if config.device == "cuda" else 0}
    start = time.perf_counter()
    storage_path = storage_path or tempfile.mkdtemp(prefix="labkit-ray-")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # no CSV, JSON and TensorBoard files per trial (read back from each result, not from them): Tuner.fit 23 s, not
    # 29 s, for 2 trials on 2 cores (two pairs, 2026-12-01)
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    _start_ray(num_cpus, 1 if config.device == "cuda" else 0)
    try:
        tuner = tune.Tuner(
            tune.with_resources(_ray_trial, resources),
            tune_config=tune.TuneConfig(num_samples=n_trials, metric="val_loss", mode="min", search_alg=searcher,
                                        scheduler=scheduler),
            run_config=tune.RunConfig(storage_path=os.path.abspath(storage_path), name="fit-the-model", verbose=0))
        grid = tuner.fit()
    finally:
        ray.shutdown()
    # each trial's last report: where it finished or where ASHA stopped it
    m = [r.metrics for r in sorted((r for r in grid if r.metrics), key=lambda r: r.metrics.get("trial_id", ""))]
    return EngineRun("ray", [float(x["val_loss"]) for x in m], [bool(x["fits"]) for x in m],
                     [json.loads(x["params_json"]) for x in m], time.perf_counter() - start,
                     [int(x["steps_run"]) for x in m])


def katib_experiment(config: StudyConfig, image: str = "fit-the-model:latest", name: str = "fit-the-model",
                     namespace: str = "kubeflow", max_trials: int = 24, parallel: int = 2) -> dict:
    """Return Katib's Experiment for the workbook's search: same space, each trial runs `labkit.tools.search trial`.

    Katib has no conditional parameters (it draws every one; the trial command drops the inactive
    ones) and no constraints (a setting that does not fit reports the untrained loss and fits=0).
    """
    check_int("max_trials", max_trials, 1)
    check_int("parallel", parallel, 1)
    space = config.space()  # fp16 is in config.precisions only on CUDA, where each pod asks for a GPU
    params = katib_parameters(space)
    command = ["python", "-m", "labkit.tools.search", "trial", "--config", json.dumps(config.to_dict())]
    limits = {"cpu": "1", "memory": "2Gi"}
    if config.device == "cuda":
        limits["nvidia.com/gpu"] = "1"  # the device plugin's resource: one GPU per trial pod
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
            "algorithm": {"algorithmName": "tpe"},
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
                                        "resources": {"limits": limits}}],
                        "restartPolicy": "Never"}}},
                },
            },
        },
    }


def to_yaml(doc: dict) -> str:
    """Return a document as YAML (for `kubectl apply -f`)."""
    import yaml

    return yaml.safe_dump(doc, sort_keys=False, width=120)
