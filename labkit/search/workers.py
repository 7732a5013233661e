"""Workers on one study (notebook 08): their command line, the loop each runs, which process runs a trial, and the
failing and retrying of trials whose worker died."""

from __future__ import annotations

import copy
import os
import sys
import time
import warnings

import optuna
from optuna.storages import fail_stale_trials
from optuna.trial import TrialState

from labkit.children import process_gone, this_process
from labkit.validate import check_int

WORKER_ATTR = "worker"  # the user attribute `mark_worker` writes


def worker_argv(storage_url: str, study: str | list[str], trials: int, total: int | None = None, index: int = 0,
                threads: int = 1) -> list[str]:
    """Return the command line of one worker (this Python, this labkit); several studies run in turn."""
    check_int("trials", trials, 1)
    check_int("index", index, 0)
    check_int("threads", threads, 1)
    names = [study] if isinstance(study, str) else list(study)
    argv = [sys.executable, "-m", "labkit.tools.search", "worker", "--storage", storage_url, "--study", *names,
            "--trials", str(trials), "--index", str(index), "--threads", str(threads)]
    if total is not None:
        argv += ["--total", str(check_int("total", total, 1))]
    return argv


def worker_env(threads: int = 1) -> dict:
    """Return the environment of a worker: one OpenMP thread per worker (several workers share the cores)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def search_span_s(study: optuna.Study) -> float:
    """Return the seconds from the first finished trial's start to the last one's end (worker start-up excluded)."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    if not done:
        return 0.0
    return (max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)).total_seconds()


def run_trials(study: optuna.Study, objective, n_trials: int, total_trials: int | None = None, poll_s: float = 0.5,
               max_wait_s: float = 60.0) -> int:
    """Run up to `n_trials` trials of `objective` here, until the study holds `total_trials` finished; return how many.

    Each trial records its worker first (`mark_worker`). With `total_trials` the worker stays while a trial runs
    elsewhere, failing and retrying it once its worker is found dead, and leaves after `max_wait_s` with nothing to run.
    """
    this: dict = {}  # the trial this worker runs now, and what its objective raised

    def run(trial):
        this.clear()
        this["number"] = trial.number
        try:
            mark_worker(trial)
            return objective(trial)
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
                if (TrialState.RUNNING not in states or _heartbeat_interval(study) is None
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
            if e is this.get("raised") or not any(t.number == this.get("number") and t.state.is_finished()
                                                  for t in study.get_trials(deepcopy=False)):
                raise
            continue
        ran += 1
    return ran


def mark_worker(trial) -> None:
    """Record in `trial` the process that runs it and the trial's number (a retry's copied record names another)."""
    trial.set_user_attr(WORKER_ATTR, {"trial": trial.number, **this_process()})


def worker_of(trial) -> dict | None:
    """Return the worker record `mark_worker` wrote for this very trial (keys trial, host, pid, machine, start), else None."""
    record = trial.user_attrs.get(WORKER_ATTR)
    return record if isinstance(record, dict) and record.get("trial") == trial.number else None


def fail_dead_trials(study: optuna.Study) -> list[int]:
    """Fail the running trials whose heartbeat is stale or whose worker process here is gone, each retried once.

    Returns the numbers failed; the storage's lock lets one process only fail a trial and queue its retry.
    """
    before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        fail_stale_trials(study)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = worker_of(t)
        if worker is not None and process_gone(worker):
            _fail_and_retry(study, t)
    return sorted({t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))} - before)


def _fail_and_retry(study: optuna.Study, trial) -> None:
    """Fail a running trial and run the retry callback, unless another process ended it first."""
    storage = study._storage  # private attribute: Optuna's own fail_stale_trials fails trials through it the same way
    try:
        # trial._trial_id: private, the storage's key (Optuna's fail_stale_trials uses the same ids)
        if not storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
            return
    except optuna.exceptions.UpdateFinishedTrialError:
        return  # another process failed (or finished) it first: it queued the retry, if any
    # the callback: a private attribute of the storage, as in fail_stale_trials
    callback = storage.get_heartbeat_stale_trial_callback() if _heartbeat_interval(study) is not None else None
    if callback is not None:
        callback(study, copy.deepcopy(storage.get_trial(trial._trial_id)))


def _heartbeat_interval(study: optuna.Study) -> int | None:
    """Return the heartbeat interval of the study's storage, None without heartbeats (e.g. InMemoryStorage)."""
    get = getattr(study._storage, "get_heartbeat_interval", None)  # private attribute, as in Optuna's fail_stale_trials
    return get() if get is not None else None
