"""Workers on one study (notebook 08): their command line, the loop each runs, which process runs a trial, and the
failing and retrying of trials whose worker died."""

from __future__ import annotations

import copy
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.storages import fail_stale_trials
from optuna.trial import TrialState

from labkit.children import ChildProcesses, process_gone, this_process
from labkit.validate import check_int

WORKER_ATTR = "worker"  # the user attribute `mark_worker` writes
WORKER_PRELOAD = ("torch.distributed.tensor", "optuna", "sqlalchemy")  # what a worker imports beyond torch (~1 s)


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


@dataclass
class WorkersRun:
    """What run_workers saw: the worker killed mid-trial, each worker's exit code, the seconds it took."""

    killed: tuple[int, int] | None  # (trial number, process id) of the worker killed mid-trial, else None
    exit_codes: list  # one per worker started, the replacement last (None: still running at the timeout, stopped)
    seconds: float  # from the first worker's start to the last one's end
    timed_out: bool  # the workers were stopped at timeout_s


def run_workers(storage_url: str, study: optuna.Study, n_workers: int, n_trials: int, log_dir, kill_one: bool = False,
                timeout_s: float = 600.0, on_progress=None, every: int = 4, poll_s: float = 0.5,
                drawn=lambda trial: bool(trial.params), replace: bool = True) -> WorkersRun:
    """Run `n_workers` worker processes (`worker_argv`, forked with WORKER_PRELOAD imported) on `study` until it holds
    `n_trials` finished trials (chapter 08).

    kill_one: SIGKILL the first worker once, while it runs a trial whose setting is `drawn(trial)` (by default: a
    parameter drawn) for 0.2 s or more (no exception, no cleanup: the trial stays RUNNING until another worker finds
    its worker gone, fails it and queues its retry), then (`replace`) start a replacement worker. on_progress(trials): called at every `every`-th finished trial and once at the end (a live
    figure). Each worker logs to `log_dir`/<study>-worker-<i>.log; the workers die with this process, and are stopped
    on leaving, on an error or at `timeout_s`.
    """
    check_int("n_workers", n_workers, 1)
    check_int("n_trials", n_trials, 1)
    check_int("every", every, 1)
    name, env, killed, shown, timed_out = study.study_name, worker_env(threads=1), None, None, False
    start_s, deadline = time.perf_counter(), time.monotonic() + timeout_s
    with ChildProcesses() as kids:
        def start(i):
            kids.start(worker_argv(storage_url, name, trials=n_trials, total=n_trials, index=i), env=env,
                       log_path=Path(log_dir) / f"{name}-worker-{i}.log", preload=WORKER_PRELOAD)
        for i in range(n_workers):
            start(i)
        while any(p.poll() is None for p in kids.procs):
            if time.monotonic() > deadline:  # leaving the block stops them
                timed_out = True
                break
            trials = study.get_trials(deepcopy=False)
            n_done = sum(t.state == TrialState.COMPLETE for t in trials)
            if on_progress is not None and n_done // every != shown:  # drawing takes the cores the workers time on
                on_progress(trials)
                shown = n_done // every
            if kill_one and killed is None and n_done < n_trials - 2:
                first = kids.procs[0]
                running = [t for t in trials if t.state == TrialState.RUNNING and drawn(t)  # mid-trial
                           and (worker_of(t) or {}).get("pid") == first.pid
                           and time.time() - t.datetime_start.timestamp() > 0.2]
                if running:
                    killed = (running[0].number, first.pid)
                    os.kill(first.pid, signal.SIGKILL)
                    if replace:
                        start(n_workers)  # the replacement
            time.sleep(poll_s)
        codes = [p.returncode for p in kids.procs]
    if on_progress is not None:
        on_progress(study.get_trials(deepcopy=False))
    return WorkersRun(killed, codes, time.perf_counter() - start_s, timed_out)


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
