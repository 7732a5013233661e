"""Worker processes on one study: started from a cell, stopped with it, timed from the study's own records.

Reference for notebook 08. A worker is `python -m labkit.tools.search worker ...`, the same command
a terminal or another machine runs; Optuna's storage is all the workers share.

    with ChildProcesses() as kids:                              # labkit.children: none outlives the cell
        for i in range(2):
            kids.start(worker_argv(url, "fit", trials=10, total=12, index=i))
        kids.wait(timeout_s=600)
    search_span_s(study)                                        # first trial start to last trial end
"""

from __future__ import annotations

import os
import sys

import optuna
from optuna.trial import TrialState

from labkit.validate import check_int


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
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def search_span_s(study: optuna.Study) -> float:
    """Return the seconds from the first finished trial's start to the last one's end (worker start-up excluded)."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))]
    if not done:
        return 0.0
    start = min(t.datetime_start for t in done)
    end = max(t.datetime_complete for t in done)
    return (end - start).total_seconds()
