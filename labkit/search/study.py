"""Optuna studies over the workbook's trials: storage, samplers and pruners by name, the objectives, and accounting.

Reference for notebook 08. A study stores what its trials need (the StudyConfig, the objective,
the sampler and pruner names) as user attributes, so any process that can reach the storage can
work on it, the notebook's kernel or `python -m labkit.tools.search worker`:

    storage = make_storage("sqlite:///build/search.db")        # RDBStorage with heartbeats: a killed
    study = create_study("fit", storage, config, "speed")      # worker's trial is failed, then retried
    study.optimize(objective(study), n_trials=20)              # or: workers on many processes/machines
    lost_trials(study)                                         # trials whose work never completed: []

Objectives: "speed" maximises the speed over the memory knobs (technique, segments, precision,
micro-batch), in units of the plain step's speed (each trial times its step alternating with the
plain step's, and takes the median of the paired ratios), with the budget as an Optuna constraint
(`trial.set_constraint`: peak - budget <= 0 is feasible, and `study.best_trial` is the fastest
feasible one; a setting predicted not to fit is not run and scores 0). "loss" minimises the validation loss after `train_steps` steps,
reported every `eval_every` steps before the last for the pruner, with the same constraint; with
`fixed` (a setting's memory knobs) it tunes that setting's learning rate alone.
"""

from __future__ import annotations

import copy
import math
import os
import socket
import time
import warnings
from pathlib import Path

import optuna
import sqlalchemy
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback, fail_stale_trials
from optuna.trial import TrialState

from labkit.children import machine_id, process_alive, process_start
from labkit.meter import live_tensor_bytes
from labkit.results import build_dir
from labkit.search.space import suggest
from labkit.search.trial import MEMORY_KNOBS, StudyConfig, check_setting, measure_setting, plain_setting, train
from labkit.validate import ParameterError

OBJECTIVES = ("speed", "loss")
SAMPLERS = ("tpe", "random", "bruteforce", "replay")
PRUNERS = ("median", "hyperband", "none")
DIRECTIONS = {"speed": "maximize", "loss": "minimize"}


def storage_url(path: str | Path) -> str:
    """Return the SQLite URL of a study file (its folder is created)."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def default_build_dir() -> Path:
    """Return build/search/ of $LABKIT_BUILD_DIR, the checkout, the working directory or the temp folder."""
    return build_dir("search")


def make_storage(url: str, heartbeat_s: int = 2, grace_s: int = 6, max_retry: int = 2, connect_timeout_s: float = 10,
                 name: str = "url") -> RDBStorage:
    """Return an RDBStorage with heartbeats: a trial silent for `grace_s` is failed and retried (up to max_retry).

    A URL no worker could share (in-memory SQLite, malformed) or a database that does not answer
    within `connect_timeout_s` raises ParameterError naming `name`. On SQLite, a transaction locks the
    file from its first read, so one process at a time reads and changes a trial's state (two workers
    cannot both fail one trial and queue two retries, nor both pop one queued trial).
    """
    parsed = _storage_url(name, url)
    kwargs = {"engine_kwargs": _engine_kwargs(parsed, connect_timeout_s)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        try:
            return _LockingRDBStorage(url, heartbeat_interval=heartbeat_s, grace_period=grace_s,
                                      heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=max_retry),
                                      **kwargs)
        except sqlalchemy.exc.DBAPIError as e:
            raise ParameterError(_unreachable(name, parsed, connect_timeout_s, e)) from None


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
    """Return a sampler by name; TPE reads the constraints each trial sets (an infeasible trial ranks last).

    TPE draws its first `n_startup_trials` settings at random (queued trials count among them:
    queue none before a TPE study whose start-up should stay random), then models the good and the
    bad settings seen so far. `constant_liar`: workers running at once do not draw the same setting.
    """
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
    """Optuna's BruteForceSampler, passing over trials that drew no parameter (a worker killed before its draw).

    Optuna's own sampler fails every later draw of the study on such a trial ("param_name mismatch"):
    its tree takes an empty path for a finished setting. Overrides the private `_populate_tree`,
    the one place that reads the trials (optuna 5.0; tests/test_search_study.py pins it).
    """

    @staticmethod
    def _populate_tree(tree, trials, params):
        optuna.samplers.BruteForceSampler._populate_tree(tree, [t for t in trials if t.params], params)


def make_pruner(name: str, warmup_steps: int, n_startup_trials: int = 3, max_steps: int | None = None):
    """Return a pruner by name: "median" (MedianPruner), "hyperband" (HyperbandPruner) or "none".

    Neither prunes before `warmup_steps` optimizer steps (early losses rank learning rates badly):
    MedianPruner first compares at step `warmup_steps`, after `n_startup_trials` trials finished;
    Hyperband's smallest budget is `warmup_steps`, its largest `max_steps`.
    """
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

    objective "loss" with `fixed` (a setting's memory knobs) tunes that setting's learning rate; sampler
    "replay" gives trial i the setting replay[i % len(replay)] (the same work for 1 or N workers).
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
    study = optuna.create_study(study_name=name, storage=storage, direction=DIRECTIONS[objective], sampler=chosen,
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


def _pruner_of(name: str, config: StudyConfig, startup_trials: int):
    return make_pruner(name, warmup_steps(config), n_startup_trials=min(3, startup_trials), max_steps=config.train_steps)


def load_study(name: str, storage, worker: int = 0) -> optuna.Study:
    """Load a study created by `create_study`, with its sampler (seeded per worker) and pruner."""
    summary = optuna.load_study(study_name=name, storage=storage)
    s = summary.user_attrs["settings"]
    config = StudyConfig.from_dict(s["config"])
    return optuna.load_study(study_name=name, storage=storage,
                             sampler=make_sampler(s["sampler"], s["seed"] + 1000 * worker, s["startup_trials"],
                                                  settings=s["replay"]),
                             pruner=_pruner_of(s["pruner"], config, s["startup_trials"]))


def settings_of(study: optuna.Study) -> tuple[StudyConfig, str]:
    """Return the study's StudyConfig and objective name."""
    s = study.user_attrs["settings"]
    return StudyConfig.from_dict(s["config"]), s["objective"]


# -- objectives ---------------------------------------------------------------------------------------
def objective(study: optuna.Study, on_result=None):
    """Return the objective function of the study's stored objective (the worker's and the notebook's)."""
    config, name = settings_of(study)
    fixed = study.user_attrs["settings"].get("fixed")

    def speed(trial):
        trial.set_user_attr("live_tensor_bytes_at_start", live_tensor_bytes(collect=False))  # a leak would grow
        params = suggest(trial, config.space(only=MEMORY_KNOBS))
        # timed against the plain step, alternating: the value is its speed in units of the plain step's
        result = measure_setting({**params, "lr": 1e-3}, config, reference=plain_setting(config))
        _record(trial, result, config, on_result)
        return result.relative_speed or 0.0  # a setting that did not fit ran no timed step: speed 0

    def loss(trial):
        trial.set_user_attr("live_tensor_bytes_at_start", live_tensor_bytes(collect=False))
        searched = [p for p in config.space() if p.name not in (fixed or {})]
        params = {**(fixed or {}), **suggest(trial, searched)}

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
        _record(trial, result, config, on_result)
        return result.val_loss

    return speed if name == "speed" else loss


def _record(trial, result, config: StudyConfig, on_result) -> None:
    """Store a trial's measurements as user attributes and its budget constraint (peak - budget <= 0: fits)."""
    peak = result.peak_bytes if result.peak_bytes is not None else result.predicted_peak_bytes
    trial.set_user_attr("status", result.status)
    trial.set_user_attr("predicted_peak_bytes", result.predicted_peak_bytes)
    trial.set_user_attr("peak_bytes", peak)
    trial.set_user_attr("steps_run", result.steps_run)
    trial.set_user_attr("tokens_per_s", result.tokens_per_s)
    trial.set_constraint("peak_over_budget_bytes", float(peak - config.budget_bytes))
    if on_result is not None:
        on_result(trial, result)


def optimize(study: optuna.Study, n_trials: int, total_trials: int | None = None, on_result=None,
             poll_s: float = 0.5, max_wait_s: float = 60.0) -> int:
    """Run up to `n_trials` trials here, stopping once the study holds `total_trials` finished ones; return trials run.

    Each trial records its worker first thing (`mark_worker`). With `total_trials`, a worker does not
    leave at once while a trial is still running elsewhere: that worker may have died. Its trial is
    failed and queued again, for a worker still here to run, once its heartbeat is stale, or at once
    when its worker was a process of this machine that no longer exists (a worker killed before its
    first heartbeat leaves no heartbeat to go stale). After `max_wait_s` with nothing left to run, the
    worker leaves. A trial another process finished first (its worker was thought dead and it was
    retried, or a storage that cannot lock a row let two workers pop it) is skipped, not fatal.
    """
    fn = objective(study, on_result)
    this: dict = {}  # the trial this worker runs now, and what its objective raised

    def run(trial):
        this.clear()
        this["number"] = trial.number
        try:
            mark_worker(trial)
            return fn(trial)
        except BaseException as e:
            this["raised"] = e
            raise

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
        this.clear()
        try:
            study.optimize(run, n_trials=1, gc_after_trial=True)
        except Exception as e:
            # Optuna could not record this trial's end (study.tell raises ValueError on a finished
            # trial): skip it only when the storage says someone else ended it, never the objective's own error
            if e is this.get("raised") or not _finished_elsewhere(study, this.get("number")):
                raise
            continue
        ran += 1
    return ran


def fail_dead_trials(study: optuna.Study) -> list[int]:
    """Fail the running trials whose worker is gone, run the storage's retry callback once each; return their numbers.

    Gone: its heartbeat is stale (Optuna's fail_stale_trials), or its worker (`worker_of`) was a
    process of this machine that no longer exists. A trial is failed by one process only (the
    storage locks it: PostgreSQL's row lock, SQLite's file lock in `make_storage`), and only that
    process queues its retry.
    """
    before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        fail_stale_trials(study)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = worker_of(t)
        if worker is not None and _worker_gone(worker):
            _fail_and_retry(study, t)
    return sorted({t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))} - before)


def _has_heartbeat(study: optuna.Study) -> bool:
    """Return whether the study's storage fails trials whose worker stopped beating."""
    return _heartbeat_interval(study) is not None


# -- liveness: which worker runs a trial, and whether it still does ------------------------------------
WORKER_ATTR = "worker"  # the user attribute `mark_worker` writes


def mark_worker(trial) -> None:
    """Record in `trial` the process that runs it (machine, pid, start, this trial's number): call it first in a trial.

    The record names the trial it was written for: a retry, which copies the failed trial's user
    attributes, carries its dead worker's record under another number, and `worker_of` ignores it.
    """
    pid = os.getpid()
    trial.set_user_attr(WORKER_ATTR, {"trial": trial.number, "host": socket.gethostname(), "pid": pid,
                                      "machine": machine_id(), "start": process_start(pid)})


def worker_of(trial) -> dict | None:
    """Return the worker record `mark_worker` wrote for this very trial (keys trial, host, pid, machine, start), else None."""
    record = trial.user_attrs.get(WORKER_ATTR)
    return record if isinstance(record, dict) and record.get("trial") == trial.number else None


def _worker_gone(worker: dict) -> bool:
    """Return whether a worker record names a process of this machine that no longer runs (another machine's: False)."""
    here = machine_id()
    if here is None or worker.get("machine") != here:
        return False  # its pid means nothing here: its heartbeat tells
    return not process_alive(worker["pid"], worker.get("start"))


def _fail_and_retry(study: optuna.Study, trial) -> bool:
    """Fail a running trial and run the retry callback, unless another process failed or finished it first; return whether this one did."""
    storage = study._storage  # private attribute: Optuna's own fail_stale_trials fails trials through it the same way
    try:
        # trial._trial_id: private, the storage's key (Optuna's fail_stale_trials uses the same ids)
        if not storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
            return False
    except optuna.exceptions.UpdateFinishedTrialError:
        return False  # another process failed (or finished) it first: it queued the retry, if any
    callback = _stale_callback(study)
    if callback is not None:
        callback(study, copy.deepcopy(storage.get_trial(trial._trial_id)))
    return True


def _finished_elsewhere(study: optuna.Study, number: int | None) -> bool:
    """Return whether trial `number` is finished in the storage (after this worker's tell failed: someone else ended it)."""
    if number is None:
        return False
    return any(t.number == number and t.state.is_finished() for t in study.get_trials(deepcopy=False))


def _heartbeat_interval(study: optuna.Study) -> int | None:
    """Return the heartbeat interval of the study's storage, None without heartbeats (e.g. InMemoryStorage)."""
    get = getattr(study._storage, "get_heartbeat_interval", None)  # private attribute, as in Optuna's fail_stale_trials
    return get() if get is not None else None


def _stale_callback(study: optuna.Study):
    """Return the storage's heartbeat-stale trial callback (the retry), None without one."""
    if _heartbeat_interval(study) is None:
        return None
    return study._storage.get_heartbeat_stale_trial_callback()  # private attribute, as in fail_stale_trials


# -- storage URLs: refused before any work when no worker could share them -------------------------------
STORAGE_EXAMPLES = "sqlite:///path/to/file.db, or a database server: postgresql+psycopg://user@host:5432/db"


def check_storage_url(name: str, url, timeout_s: float = 10) -> str:
    """Return `url` if it names a database every worker can share that answers within `timeout_s`; raise ParameterError naming `name` otherwise.

    Refused: a malformed URL, an in-memory SQLite database (each process would hold its own), a
    SQLite file whose folder does not exist, a driver that is not installed, a server that does not
    accept a connection in time. A SQLite file is not created here.
    """
    parsed = _storage_url(name, url)
    if parsed.get_backend_name() == "sqlite":
        return url
    engine = _engine(name, parsed, timeout_s)
    try:
        with engine.connect():
            pass
    except sqlalchemy.exc.DBAPIError as e:
        raise ParameterError(_unreachable(name, parsed, timeout_s, e)) from None
    finally:
        engine.dispose()
    return url


def _storage_url(name: str, url) -> sqlalchemy.engine.URL:
    """Return the parsed storage URL, or raise ParameterError naming `name` with what is allowed."""
    if not isinstance(url, str) or not url:
        raise ParameterError(f"{name} must be a database URL ({STORAGE_EXAMPLES}), got {url!r}")
    try:
        parsed = sqlalchemy.engine.make_url(url)
        parsed.get_dialect()  # an unknown dialect raises here, before any connection
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError, ValueError) as e:
        raise ParameterError(f"{name} must be a database URL ({STORAGE_EXAMPLES}), got {url!r}: {e}") from None
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database or ""
        if not db or ":memory:" in db or "mode=memory" in db or parsed.query.get("mode") == "memory":
            raise ParameterError(f"{name} must name a file that every worker process opens ({STORAGE_EXAMPLES}), "
                                 f"got {url!r}: an in-memory SQLite database exists only in the process that opened it")
        folder = Path(db.removeprefix("file:").split("?")[0]).parent
        if not folder.is_dir():
            raise ParameterError(f"{name}: the folder of the SQLite file {db!r} does not exist ({folder})")
    return parsed


def _engine_kwargs(parsed: sqlalchemy.engine.URL, connect_timeout_s: float) -> dict:
    """Return create_engine's arguments: a connect timeout for a server, a busy timeout for a SQLite file."""
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return {"connect_args": {"timeout": 60}}  # several worker processes on one file wait for its lock
    if backend in ("postgresql", "mysql", "mariadb"):
        return {"connect_args": {"connect_timeout": max(1, math.ceil(connect_timeout_s))}}  # libpq, MySQL drivers
    return {}


def _engine(name: str, parsed: sqlalchemy.engine.URL, timeout_s: float) -> sqlalchemy.engine.Engine:
    """Return an engine for the URL, or raise ParameterError naming the missing driver."""
    try:
        return sqlalchemy.create_engine(parsed, **_engine_kwargs(parsed, timeout_s))
    except ImportError as e:
        raise ParameterError(f"{name}: the driver of {parsed.drivername!r} is not installed ({e}); install it, or "
                             "name one that is (PostgreSQL: postgresql+psycopg://, pip install 'psycopg[binary]')") from None


def _unreachable(name: str, parsed: sqlalchemy.engine.URL, timeout_s: float, error: Exception) -> str:
    """Return the message for a database that refused or did not answer."""
    shown = parsed.render_as_string(hide_password=True)
    cause = str(getattr(error, "orig", error)).strip().splitlines()[0]
    return f"{name}: could not connect to the database {shown} within {timeout_s:g} s: {cause}"


class _LockingRDBStorage(RDBStorage):
    """RDBStorage whose SQLite transactions lock the file from their first read, as PostgreSQL's SELECT ... FOR UPDATE locks a row.

    Optuna reads a trial's state and then changes it (RUNNING to FAIL, WAITING to RUNNING) in one
    transaction; SQLite's default transaction locks only at the write, so two processes could both
    read RUNNING and both fail the trial (two retries), or both pop one queued trial (optuna #4621).
    BEGIN IMMEDIATE, SQLAlchemy's documented pysqlite recipe, serialises them.
    """

    def __init__(self, url: str, **kwargs):
        super().__init__(url, **kwargs)
        self._lock_on_first_read()

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._lock_on_first_read()

    def _lock_on_first_read(self) -> None:
        # self.engine: an RDBStorage attribute Optuna's docs do not offer users; SQLAlchemy's BEGIN
        # recipe needs the engine, and engine_kwargs cannot carry event listeners
        if self.engine.dialect.name != "sqlite":
            return
        sqlalchemy.event.listen(self.engine, "connect", _driver_autocommit)
        sqlalchemy.event.listen(self.engine, "begin", _begin_immediate)
        self.engine.dispose()  # the connections opened so far were set up without the listeners


def _driver_autocommit(dbapi_connection, connection_record) -> None:
    """Stop pysqlite from beginning transactions itself (it would BEGIN at the first write, not the first read)."""
    dbapi_connection.isolation_level = None


def _begin_immediate(connection) -> None:
    """Begin each SQLAlchemy transaction with SQLite's write lock."""
    connection.exec_driver_sql("BEGIN IMMEDIATE")


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


def speed_memory_front(trials) -> list:
    """Return the completed trials no other completed trial beats on both tokens/s (more) and peak bytes (fewer).

    The Pareto front of a speed study: each point on it is the fastest setting for its memory.
    A trial needs its value (tokens/s) and its user attribute `peak_bytes`.
    """
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.value and "peak_bytes" in t.user_attrs]

    def beaten(t):
        return any(o.value >= t.value and o.user_attrs["peak_bytes"] <= t.user_attrs["peak_bytes"]
                   and (o.value > t.value or o.user_attrs["peak_bytes"] < t.user_attrs["peak_bytes"]) for o in done)
    return sorted((t for t in done if not beaten(t)), key=lambda t: t.user_attrs["peak_bytes"])


def fresh_study_name(prefix: str) -> str:
    """Return a study name no earlier run used: `prefix`, the time to the second, and this process's id."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"

