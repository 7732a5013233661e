"""Optuna studies over the workbook's trials: storage, samplers and pruners by name, the objectives, and accounting.

Reference for notebook 08. A study stores what its trials need (the StudyConfig, the objective,
the sampler and pruner names) as user attributes, so any process that can reach the storage can
work on it, the notebook's kernel or `python -m labkit.tools.search worker`:

    storage = make_storage("sqlite:///build/search.db")        # RDBStorage with heartbeats: a killed
    study = create_study("fit", storage, config, "loss")       # worker's trial is failed, then retried
    study.optimize(objective(study), n_trials=20)              # or: workers on many processes/machines
    lost_trials(study)                                         # trials whose work never completed: []

Objectives: "loss" minimises the validation loss after `train_steps` steps, with the budget as an
Optuna constraint (`trial.set_constraint`: peak - budget <= 0 is feasible, and `study.best_trial`
is the best feasible one; a setting predicted not to fit is not trained)
and pruning on the intermediate losses; "speed_memory" maximises tokens/s and minimises the
predicted peak (two objectives, a Pareto front; no budget, the front shows where it cuts).
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from pathlib import Path

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback, fail_stale_trials
from optuna.storages._heartbeat import BaseHeartbeat, is_heartbeat_enabled
from optuna.trial import TrialState

from labkit.meter import live_tensor_bytes
from labkit.results import build_dir
from labkit.search.space import suggest
from labkit.search.trial import StudyConfig, time_setting, train

OBJECTIVES = ("loss", "speed_memory")
SAMPLERS = ("tpe", "random", "nsga2", "replay")
PRUNERS = ("median", "hyperband", "none")
DIRECTIONS = {"loss": ["minimize"], "speed_memory": ["maximize", "minimize"]}


def storage_url(path: str | Path) -> str:
    """Return the SQLite URL of a study file (its folder is created)."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def default_build_dir() -> Path:
    """Return build/search/ of $LABKIT_BUILD_DIR, the checkout, the working directory or the temp folder."""
    return build_dir("search")


def make_storage(url: str, heartbeat_s: int = 2, grace_s: int = 6, max_retry: int = 2) -> RDBStorage:
    """Return an RDBStorage with heartbeats: a trial silent for `grace_s` is failed and retried (up to max_retry)."""
    kwargs = {}
    if url.startswith("sqlite"):
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}  # several worker processes on one file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RDBStorage(url, heartbeat_interval=heartbeat_s, grace_period=grace_s,
                          heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=max_retry), **kwargs)


class ReplaySampler(optuna.samplers.BaseSampler):
    """Give trial number i the settings[i % len(settings)]: the same work for any number of workers (to time them).

    Trial numbers are handed out by the storage, one per trial, so this is race-free where a queue
    of enqueued trials is not (two SQLite workers can pop the same one: optuna #4621).
    """

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
    """Return a sampler by name (TPE and NSGA-II read the constraints each trial sets: infeasible ranks last)."""
    if name == "replay":
        return ReplaySampler(settings or [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "tpe":  # multivariate + group: the conditional space (segments only with checkpointing)
            return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials, multivariate=True,
                                              group=True)
        if name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if name == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed, population_size=8)
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {name!r}")


def make_pruner(name: str, n_startup_trials: int = 5, warmup_steps: int = 1):
    """Return a pruner by name: "median" (MedianPruner), "hyperband" (HyperbandPruner) or "none".

    Neither prunes before `warmup_steps` optimizer steps: early losses rank learning rates badly.
    """
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=n_startup_trials, n_warmup_steps=warmup_steps - 1)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=warmup_steps, reduction_factor=2)
    if name == "none":
        return optuna.pruners.NopPruner()
    raise ValueError(f"pruner must be one of {PRUNERS}, got {name!r}")


def create_study(name: str, storage, config: StudyConfig, objective: str = "loss", sampler: str = "tpe",
                 pruner: str = "median", seed: int = 0, load_if_exists: bool = True,
                 replay: list | None = None, startup_trials: int = 5) -> optuna.Study:
    """Create (or load, resuming it) a study whose user attributes say everything a worker needs.

    sampler "replay" gives trial i the setting replay[i % len(replay)] (the same work for 1 or N workers).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    chosen = make_sampler(sampler, seed, startup_trials, settings=replay)  # refuses unknown names first
    warmup = max(1, config.train_steps // 2)
    study = optuna.create_study(study_name=name, storage=storage, directions=DIRECTIONS[objective],
                                sampler=chosen, pruner=make_pruner(pruner, startup_trials, warmup),
                                load_if_exists=load_if_exists)
    settings = {"config": config.to_dict(), "objective": objective, "sampler": sampler, "pruner": pruner, "seed": seed,
                "replay": replay, "startup_trials": startup_trials}
    stored = study.user_attrs.get("settings")
    if stored is None:
        study.set_user_attr("settings", settings)
    elif stored != settings:
        raise ValueError(f"study {name!r} exists with other settings: {stored} (asked: {settings}); "
                         "use another name or delete it")
    return study


def load_study(name: str, storage, worker: int = 0) -> optuna.Study:
    """Load a study created by `create_study`, with its sampler (seeded per worker) and pruner."""
    summary = optuna.load_study(study_name=name, storage=storage)
    s = summary.user_attrs["settings"]
    return optuna.load_study(study_name=name, storage=storage,
                             sampler=make_sampler(s["sampler"], s["seed"] + 1000 * worker, s["startup_trials"],
                                                  settings=s["replay"]),
                             pruner=make_pruner(s["pruner"], s["startup_trials"],
                                                max(1, s["config"]["train_steps"] // 2)))


def settings_of(study: optuna.Study) -> tuple[StudyConfig, str]:
    """Return the study's StudyConfig and objective name."""
    s = study.user_attrs["settings"]
    return StudyConfig.from_dict(s["config"]), s["objective"]


# -- objectives ---------------------------------------------------------------------------------------
def objective(study: optuna.Study, on_result=None):
    """Return the objective function of the study's stored objective (the worker's and the notebook's)."""
    config, name = settings_of(study)
    space = config.space()

    def loss(trial):
        # what earlier trials left behind (Optuna collected the garbage after each: gc_after_trial)
        trial.set_user_attr("live_tensor_bytes_at_start", live_tensor_bytes(collect=False))
        params = suggest(trial, space)
        trial.set_user_attr("pid", os.getpid())  # which worker runs it, once its setting is drawn
        trial.set_user_attr("host", socket.gethostname())

        def report(progress):  # after each validation: the pruner's input
            trial.report(progress.val_loss, progress.steps_run)
            if trial.should_prune():
                trial.set_user_attr("status", "pruned")
                trial.set_user_attr("steps_run", progress.steps_run)
                trial.set_user_attr("peak_bytes", progress.peak_bytes)  # its metered steps ran
                trial.set_user_attr("predicted_peak_bytes", progress.predicted_peak_bytes)
                raise optuna.TrialPruned(f"pruned after {progress.steps_run} steps at loss {progress.val_loss:.4f}")

        result = train(params, config, report=report)
        peak = result.peak_bytes if result.peak_bytes is not None else result.predicted_peak_bytes
        trial.set_user_attr("status", result.status)
        trial.set_user_attr("predicted_peak_bytes", result.predicted_peak_bytes)
        trial.set_user_attr("peak_bytes", peak)
        trial.set_user_attr("steps_run", result.steps_run)
        trial.set_user_attr("tokens_per_s", result.tokens_per_s)
        trial.set_constraint("peak_over_budget_bytes", float(peak - config.budget_bytes))  # <= 0: fits
        if on_result is not None:
            on_result(trial, result)
        return result.val_loss

    def speed_memory(trial):
        params = suggest(trial, space)
        trial.set_user_attr("pid", os.getpid())
        trial.set_user_attr("host", socket.gethostname())
        result = time_setting(params, config)
        trial.set_user_attr("status", result.status)
        trial.set_user_attr("predicted_peak_bytes", result.predicted_peak_bytes)
        trial.set_user_attr("fits", result.fits_predicted)
        if result.status != "ok":
            raise optuna.TrialPruned("predicted beyond the device's memory: not run")
        trial.set_user_attr("tokens_per_s", result.tokens_per_s)
        if on_result is not None:
            on_result(trial, result)
        return result.tokens_per_s, float(result.predicted_peak_bytes)

    return loss if name == "loss" else speed_memory


def optimize(study: optuna.Study, n_trials: int, total_trials: int | None = None, on_result=None,
             poll_s: float = 0.5, max_wait_s: float = 60.0) -> int:
    """Run up to `n_trials` trials here, stopping once the study holds `total_trials` finished ones; return trials run.

    With `total_trials`, a worker does not leave at once while a trial is still running elsewhere:
    that worker may have died. Its trial is failed and queued again, for a worker still here to run,
    once its heartbeat is stale, or at once when its worker was a process of this machine that no
    longer exists (a worker killed before its first heartbeat leaves no heartbeat to go stale). After
    `max_wait_s` with nothing left to run, the worker leaves. A trial another process already
    finished is skipped, not fatal: two SQLite workers can pop the same waiting trial (a retried
    one), since SQLite cannot lock the row (optuna #4621).
    """
    fn = objective(study, on_result)
    finished = (TrialState.COMPLETE, TrialState.PRUNED)
    ran, waited_since = 0, None
    while ran < n_trials:
        if total_trials is not None:
            fail_dead_trials(study)  # a dead worker's trial: FAIL, and its retry WAITING
            states = [t.state for t in study.get_trials(deepcopy=False)]
            if sum(s in finished for s in states) >= total_trials and TrialState.WAITING not in states:
                waited_since = waited_since or time.monotonic()
                if (TrialState.RUNNING not in states or not _has_heartbeat(study)
                        or time.monotonic() - waited_since > max_wait_s):
                    break
                time.sleep(poll_s)  # someone's trial is running: wait for it to finish, or to be found dead
                continue
        waited_since = None
        try:
            study.optimize(fn, n_trials=1, gc_after_trial=True)
        except ValueError as e:
            if "Cannot tell a" not in str(e):
                raise
            continue  # another worker finished this trial first
        ran += 1
    return ran


def fail_dead_trials(study: optuna.Study) -> list[int]:
    """Fail the running trials whose worker is gone, run the storage's retry callback; return their numbers.

    Gone: its heartbeat is stale (Optuna's fail_stale_trials), or it ran in a process of this
    machine (user attrs `host` and `pid`) that no longer exists.
    """
    storage = study._storage  # Optuna's own fail_stale_trials reads it the same way
    before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        fail_stale_trials(study)
    host = socket.gethostname()
    callback = storage.get_heartbeat_stale_trial_callback() if _has_heartbeat(study) else None
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = t.user_attrs.get("pid")
        if pid is None or t.user_attrs.get("host") != host or pid == os.getpid() or _process_exists(pid):
            continue
        try:
            if storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                if callback is not None:
                    callback(study, storage.get_trial(t._trial_id))
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another worker failed it first
    return sorted({t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))} - before)


def _process_exists(pid: int) -> bool:
    """Return whether a process `pid` runs on this machine (a zombie, killed and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: trust kill(pid, 0)


def _has_heartbeat(study: optuna.Study) -> bool:
    """Return whether the study's storage fails trials whose worker stopped beating."""
    storage = study._storage  # Optuna's own fail_stale_trials reads it the same way
    return isinstance(storage, BaseHeartbeat) and is_heartbeat_enabled(storage)


# -- accounting ---------------------------------------------------------------------------------------
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
