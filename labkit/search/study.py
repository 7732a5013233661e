"""Optuna studies of the search (notebook 08): the chapters' settings, samplers, pruners, the "speed" and "loss"
objectives, and accounting (where the studies are stored: labkit.search.storage)."""

from __future__ import annotations

import os
import time
import warnings

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState

from labkit.meter import live_tensor_bytes
from labkit.search.config import StudyConfig
from labkit.search.space import MEMORY_KNOBS, suggest
from labkit.search.trial import check_setting, measure_setting, predict_peak_bytes, train
from labkit.search.workers import run_trials, worker_of  # noqa: F401  (worker_of: notebook 08 reads it here)

OBJECTIVES = ("speed", "loss")
SAMPLERS = ("tpe", "random", "bruteforce", "replay")
PRUNERS = ("median", "hyperband", "none")


def plain_setting(config: StudyConfig, lr: float = 1e-3) -> dict:
    """Return the plain step's setting (fp32, the whole batch at once): chapter 00's step, the unit of speed."""
    return {"technique": "none", "precision": "fp32", "micro_batch": config.batch, "lr": lr}


def chapter_settings(config: StudyConfig, lr: float = 1e-3) -> dict[str, dict]:
    """Return each single-device chapter's fitting setting (01–05), as that chapter trains it (Adam, lr 1e-3).

    01: the fewest accumulation steps predicted to fit; 03: bf16, else fp16 where searched, else left out.
    """
    choices = next(p.choices for p in config.space() if p.name == "micro_batch")  # largest first
    micro = next((m for m in choices  # the largest that fits: smaller ones are not predicted (a fake step each)
                  if predict_peak_bytes(dict(plain_setting(config, lr), micro_batch=m), config) <= config.budget_bytes),
                 None)
    out = {}
    if micro is not None:
        out["01 gradient accumulation"] = dict(plain_setting(config, lr), micro_batch=micro)
    out["02 activation checkpointing"] = {"technique": "checkpoint", "segments": config.n_layer, "precision": "fp32",
                                          "micro_batch": config.batch, "lr": lr}
    half = next((p for p in ("bf16", "fp16") if p in config.precisions), None)
    if half is not None:
        out[f"03 mixed precision ({half})"] = dict(plain_setting(config, lr), precision=half)
    out["04 activation offload"] = dict(plain_setting(config, lr), technique="offload")
    out["05 layer to layer"] = {"technique": "l2l", "lr": lr}
    return out


class ReplaySampler(optuna.samplers.BaseSampler):
    """Give trial number i the settings[i % len(settings)]: the same work for any number of workers (race-free)."""

    def __init__(self, settings: list[dict]):
        if not settings:
            raise ValueError("ReplaySampler needs at least one setting")
        self.settings = [dict(s) for s in settings]

    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.settings[trial.number % len(self.settings)][param_name]


def make_sampler(name: str, seed: int | None, n_startup_trials: int = 5, settings: list | None = None):
    """Return a sampler by name; TPE (multivariate, grouped, constant liar) reads the trials' constraints."""
    if name == "replay":
        return ReplaySampler(settings or [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # multivariate, group, constant_liar
        if name == "tpe":  # multivariate + group: the conditional space (segments only with checkpointing)
            return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials, multivariate=True,
                                              group=True, constant_liar=True)
        if name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if name == "bruteforce":  # every setting of a discrete space once, in an order shuffled by the seed
            return _BruteForce(seed=seed)
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {name!r}")


class _BruteForce(optuna.samplers.BruteForceSampler):
    """Optuna's BruteForceSampler, passing over failed trials (a worker killed during its draw left part of a setting).

    Overrides the private `_populate_tree` (optuna 5.0; tests/test_search_study.py pins it); a retry carries the setting.
    """

    @staticmethod
    def _populate_tree(tree, trials, params):
        kept = [t for t in trials if t.params and t.state != TrialState.FAIL]
        optuna.samplers.BruteForceSampler._populate_tree(tree, kept, params)


def make_pruner(name: str, warmup_steps: int, n_startup_trials: int = 3, max_steps: int | None = None):
    """Return a pruner by name ("median", "hyperband" or "none") that prunes nothing before `warmup_steps` steps."""
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=n_startup_trials, n_warmup_steps=warmup_steps)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=warmup_steps, max_resource=max_steps or "auto",
                                              reduction_factor=2)
    if name == "none":
        return optuna.pruners.NopPruner()
    raise ValueError(f"pruner must be one of {PRUNERS}, got {name!r}")


def warmup_steps(config: StudyConfig) -> int:
    """Return the steps a trial trains before a pruner may stop it: half of them, at a validation."""
    half = max(config.eval_every, config.train_steps // 2)
    return half - half % config.eval_every


def create_study(name: str, storage, config: StudyConfig, objective: str = "speed", sampler: str = "tpe",
                 pruner: str = "none", seed: int = 0, load_if_exists: bool = True, replay: list | None = None,
                 startup_trials: int = 5, fixed: dict | None = None) -> optuna.Study:
    """Create (or load, resuming it) a study whose user attributes say everything a worker needs.

    `fixed` (objective "loss"): a setting's memory knobs, to tune its learning rate; `replay`: the replay sampler's list.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if fixed is not None:
        if objective != "loss":
            raise ValueError("`fixed` is for objective 'loss' only (the speed study searches every memory knob)")
        fixed = {k: v for k, v in fixed.items() if k != "lr"}
        check_setting({**fixed, "lr": 1e-3}, config)
    if objective == "speed" and pruner != "none":
        raise ValueError("the speed objective reports no intermediate values: use pruner 'none'")
    chosen = make_sampler(sampler, seed, startup_trials, settings=replay)  # refuses unknown names first
    direction = "maximize" if objective == "speed" else "minimize"
    study = optuna.create_study(study_name=name, storage=storage, direction=direction, sampler=chosen,
                                pruner=_pruner_of(pruner, config, startup_trials), load_if_exists=load_if_exists)
    settings = {"config": config.to_dict(), "objective": objective, "sampler": sampler, "pruner": pruner, "seed": seed,
                "replay": replay, "startup_trials": startup_trials, "fixed": fixed}
    stored = study.user_attrs.get("settings")
    if stored is None:
        study.set_user_attr("settings", settings)
    elif stored != settings:
        raise ValueError(f"study {name!r} exists with other settings: {stored} (asked: {settings}); "
                         "use another name or delete it")
    return study


def pruner_startup_trials(startup_trials: int) -> int:
    """Return how many first trials the median pruner never stops (a median needs trials to compare with)."""
    return min(3, startup_trials)


def _pruner_of(name: str, config: StudyConfig, startup_trials: int):
    """Return the study's pruner for `config` (warm-up: `warmup_steps`)."""
    return make_pruner(name, warmup_steps(config), n_startup_trials=pruner_startup_trials(startup_trials),
                       max_steps=config.train_steps)


def load_study(name: str, storage, worker: int = 0) -> optuna.Study:
    """Load a study created by `create_study`, with its sampler (seeded per worker) and pruner."""
    s = optuna.load_study(study_name=name, storage=storage).user_attrs["settings"]
    return optuna.load_study(study_name=name, storage=storage,
                             sampler=make_sampler(s["sampler"], s["seed"] + 1000 * worker, s["startup_trials"],
                                                  settings=s["replay"]),
                             pruner=_pruner_of(s["pruner"], StudyConfig(**s["config"]), s["startup_trials"]))


def settings_of(study: optuna.Study) -> tuple[StudyConfig, str]:
    """Return the study's StudyConfig and objective name."""
    s = study.user_attrs["settings"]
    return StudyConfig(**s["config"]), s["objective"]


def objective(study: optuna.Study):
    """Return the objective function of the study's stored objective (the worker's and the notebook's).

    "speed": speed in units of the plain step's (on a CPU its projected time on config.gpu over the setting's, on CUDA
    paired timing), 0 when it does not fit; "loss": the validation loss.
    """
    config, name = settings_of(study)
    fixed = study.user_attrs["settings"].get("fixed") or {}

    def speed(trial):
        trial.set_user_attr("live_tensor_bytes_at_start", live_tensor_bytes(collect=False))  # a leak would grow
        params = suggest(trial, config.space(only=MEMORY_KNOBS))
        result = measure_setting({**params, "lr": 1e-3}, config, reference=plain_setting(config))
        _record(trial, result, config)
        return result.relative_speed or 0.0  # a setting that does not fit has no speed: 0

    def loss(trial):
        trial.set_user_attr("live_tensor_bytes_at_start", live_tensor_bytes(collect=False))
        params = {**fixed, **suggest(trial, [p for p in config.space() if p.name not in fixed])}

        def report(progress):  # after each validation before the last: the pruner's input
            if progress.steps_run >= config.train_steps:
                return  # the trial is finished: its value is its result, not a reason to prune
            trial.report(progress.val_loss, progress.steps_run)
            if trial.should_prune():
                trial.set_user_attr("status", "pruned")
                trial.set_user_attr("steps_run", progress.steps_run)
                trial.set_user_attr("peak_bytes", progress.peak_bytes)  # its metered steps ran
                trial.set_user_attr("predicted_peak_bytes", progress.predicted_peak_bytes)
                raise optuna.TrialPruned(f"pruned after {progress.steps_run} steps at loss {progress.val_loss:.4f}")

        result = train(params, config, report=report)
        _record(trial, result, config)
        return result.val_loss

    return speed if name == "speed" else loss


def _record(trial, result, config: StudyConfig) -> None:
    """Store a trial's measurements as user attributes and its budget constraint (peak - budget <= 0: fits)."""
    peak = result.peak_bytes if result.peak_bytes is not None else result.predicted_peak_bytes
    trial.set_user_attr("status", result.status)
    trial.set_user_attr("predicted_peak_bytes", result.predicted_peak_bytes)
    trial.set_user_attr("peak_bytes", peak)
    trial.set_user_attr("steps_run", result.steps_run)
    trial.set_user_attr("tokens_per_s", result.tokens_per_s)
    trial.set_user_attr("projected_step_s", result.projected_step_s)  # on config.gpu, from the counted work
    trial.set_constraint("peak_over_budget_bytes", float(peak - config.budget_bytes))


def optimize(study: optuna.Study, n_trials: int, total_trials: int | None = None, poll_s: float = 0.5,
             max_wait_s: float = 60.0) -> int:
    """Run up to `n_trials` trials of the study's objective here (`workers.run_trials`); return the trials run."""
    return run_trials(study, objective(study), n_trials, total_trials, poll_s, max_wait_s)


def lost_trials(study: optuna.Study) -> list[int]:
    """Return the numbers of failed trials whose work no retry completed (a trial lost to a dead worker)."""
    trials = study.get_trials(deepcopy=False)
    done = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        for t in trials:
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
                done.add(t.number)
                done.update(RetryHeartbeatStaleTrialCallback.retry_history(t))
    return [t.number for t in trials if t.state == TrialState.FAIL and t.number not in done]


def feasible(trial) -> bool:
    """Return True for a completed trial whose constraints all hold (it fit the budget)."""
    return trial.state == TrialState.COMPLETE and all(v <= 0 for v in trial.constraints.values())


def speed_memory_front(trials) -> list:
    """Return the completed trials no other beats on both value (more) and user attribute `peak_bytes` (fewer), one
    per point (of trials with the same value and peak, a repeated setting, the first)."""
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.value and "peak_bytes" in t.user_attrs]

    def beaten(t):
        return any(o.value >= t.value and o.user_attrs["peak_bytes"] <= t.user_attrs["peak_bytes"]
                   and (o.value > t.value or o.user_attrs["peak_bytes"] < t.user_attrs["peak_bytes"]) for o in done)
    points = {}
    for t in sorted(done, key=lambda t: t.number):
        if not beaten(t):
            points.setdefault((t.user_attrs["peak_bytes"], t.value), t)
    return [points[k] for k in sorted(points)]


def repeated_settings(trials) -> list[tuple[int, int, str]]:
    """Return (trial, the first trial with its setting, why) for each trial whose setting an earlier trial had
    (chapter 08): "retry" (of the failed trial named, its worker dead), "drawn again" (the sampler drew a setting
    tried and finished before), "drawn while it ran" (a setting another worker's trial still ran)."""
    earlier: dict = {}  # setting -> the trials that drew it so far, in order of their start
    out = []
    for t in sorted((t for t in trials if t.datetime_start is not None and t.params),
                    key=lambda t: (t.datetime_start, t.number)):
        before = earlier.setdefault(tuple(sorted(t.params.items())), [])
        failed = t.system_attrs.get("failed_trial")  # set by the retry callback (the failed trial may hold fewer knobs)
        if failed is not None:
            out.append((t.number, failed, "retry"))
        elif before:
            done = any(o.datetime_complete is not None and o.datetime_complete <= t.datetime_start for o in before)
            out.append((t.number, before[0].number, "drawn again" if done else "drawn while it ran"))
        before.append(t)
    return sorted(out)


def fresh_study_name(prefix: str) -> str:
    """Return a study name no earlier run used: `prefix`, the time to the second, and this process's id."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"

