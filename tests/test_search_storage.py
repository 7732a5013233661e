"""labkit.search.storage: URLs refused before any work, a silent server timed out, and one process at a
time changing a trial's state (one retry per dead trial, one worker per queued trial), on SQLite as on a server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter

import optuna
import pytest
from optuna.trial import TrialState

from labkit import search
from labkit.search import storage as stores
from labkit.search import study as studies
from labkit.validate import ParameterError

CONFIG = search.StudyConfig(budget_bytes=10**7, n_layer=2, n_embd=32, n_head=2, vocab_size=64, batch=8, seq_len=16,
                            train_steps=2, eval_every=2, eval_batch=8)
FITS = {"technique": "l2l", "lr": 1e-3}


@pytest.mark.parametrize("url, words", [
    ("sqlite://", "in-memory SQLite"),
    ("sqlite:///:memory:", "in-memory SQLite"),
    ("sqlite:///file::memory:?cache=shared", "in-memory SQLite"),
    ("nonsense", "must be a database URL"),
    ("", "must be a database URL"),
    (None, "must be a database URL"),
    ("nosuchdb://u@host/db", "must be a database URL"),
    ("sqlite:////no/such/folder/s.db", "folder of the SQLite file"),
])
def test_a_storage_no_worker_could_share_is_refused(url, words):
    with pytest.raises(ParameterError, match=words) as e:
        stores.check_storage_url("STORAGE", url)
    assert str(e.value).startswith("STORAGE")
    if "URL" in words:
        assert "sqlite:///path/to/file.db" in str(e.value)  # what is allowed
    with pytest.raises(ParameterError, match=f"^url.*{words}"):
        stores.make_storage(url)  # the function's own argument, before any connection


def test_a_sqlite_file_is_accepted_and_not_created(tmp_path):
    url = stores.sqlite_url(tmp_path / "s.db")
    assert stores.check_storage_url("STORAGE", url) == url
    assert not (tmp_path / "s.db").exists()


def _raised_within(seconds: float, call) -> tuple[BaseException | None, float]:
    """Run call() in a thread; return what it raised and its seconds, or fail the test if it is still running after `seconds`."""
    out = {}

    def run():
        start = time.monotonic()
        try:
            call()
        except BaseException as e:  # noqa: B036 (handed to the test)
            out["error"] = e
        out["s"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting for the database after {seconds} s: no connect timeout"
    return out.get("error"), out["s"]


def test_a_server_nobody_listens_on_fails_fast():
    pytest.importorskip("psycopg", reason="psycopg is not installed (the engines extra)")
    error, seconds = _raised_within(10, lambda: stores.check_storage_url(
        "STORAGE", "postgresql+psycopg://u@127.0.0.1:1/db", timeout_s=3))
    assert isinstance(error, ParameterError), error
    assert str(error).startswith("STORAGE: could not connect to the database postgresql+psycopg://u@127.0.0.1:1/db")
    assert seconds < 5


def test_a_server_that_never_answers_times_out():
    """A port that accepts the connection and then says nothing (a firewall, a hung server): no hang, an error."""
    pytest.importorskip("psycopg", reason="psycopg is not installed (the engines extra)")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nobody ever answers
        url = f"postgresql+psycopg://u:secret@127.0.0.1:{silent.getsockname()[1]}/db"
        for call in (lambda: stores.check_storage_url("STORAGE", url, timeout_s=2),
                     lambda: stores.make_storage(url, connect_timeout_s=2)):
            error, seconds = _raised_within(20, call)
            assert isinstance(error, ParameterError) and "could not connect to the database" in str(error), error
            assert "within 2 s" in str(error)
            assert 1.5 < seconds < 10  # psycopg may try each address the host name has: 2 s each
            assert "secret" not in str(error)


def test_the_worker_command_refuses_an_in_memory_storage():
    out = subprocess.run([sys.executable, "-m", "labkit.tools.search", "worker", "--storage", "sqlite://",
                          "--study", "x", "--trials", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--storage must name a file that every worker process opens" in out.stderr
    assert "Traceback" not in out.stderr


# -- one process at a time: two storage handles, their reads interleaved on purpose ----------------------
def _interleaved(storages, change):
    """Run change(storage) on each handle in its own thread, each pausing after reading the trial's state (up to 1 s)
    for the other to read it too: without a lock from the first read, both read the old state. Return the results."""
    read = threading.Barrier(len(storages), timeout=1.0)
    results = [None] * len(storages)

    def run(i, storage):
        original = storage.check_trial_is_updatable

        def check(trial_id, state):  # Optuna calls it between reading the trial and changing it
            original(trial_id, state)
            try:
                read.wait()
            except threading.BrokenBarrierError:
                pass  # the other is held at the lock: go on alone

        storage.check_trial_is_updatable = check
        try:
            results[i] = change(storage)
        except optuna.exceptions.UpdateFinishedTrialError:
            results[i] = "finished"

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate(storages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")
def test_two_processes_cannot_both_fail_one_trial(tmp_path):
    url = stores.sqlite_url(tmp_path / "f.db")
    a, b = stores.make_storage(url), stores.make_storage(url)  # two workers' handles on one file
    study = optuna.create_study(storage=a, study_name="f")
    trial_id = study.ask()._trial_id
    results = _interleaved([a, b], lambda s: s.set_trial_state_values(trial_id, state=TrialState.FAIL))
    assert sorted(map(str, results)) == ["True", "finished"]  # one failed it (and queues the retry); one was told


def test_two_processes_cannot_both_pop_one_queued_trial(tmp_path):
    url = stores.sqlite_url(tmp_path / "q.db")
    a, b = stores.make_storage(url), stores.make_storage(url)
    study = optuna.create_study(storage=a, study_name="q")
    study.enqueue_trial({"x": 1.0})
    trial_id = study.get_trials()[0]._trial_id
    results = _interleaved([a, b], lambda s: s.set_trial_state_values(trial_id, state=TrialState.RUNNING))
    assert sorted(results) == [False, True]  # what Study.ask reads: the one told False creates a trial of its own


def test_racing_workers_queue_one_retry_per_dead_trial(tmp_path):
    """Three worker processes find the same sixteen dead trials at the same moment: each is failed and retried once,
    whether its worker is seen dead by its pid, by its stale heartbeat, or by both."""
    url = stores.sqlite_url(tmp_path / "race.db")
    study = studies.create_study("race", stores.make_storage(url), CONFIG, "loss", sampler="random", pruner="none")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    dead = textwrap.dedent("""
        import sys
        from labkit.search import storage as db
        from labkit.search import study as s
        from labkit.search import workers
        st = s.load_study("race", db.make_storage(sys.argv[1], heartbeat_s=1, grace_s=1))
        for i in range(16):
            t = st.ask()
            workers.mark_worker(t)
            if i % 2:
                st._storage.record_heartbeat(t._trial_id)  # one beat, then silence: stale by the race
        # then exits: sixteen trials of a dead worker
    """)
    subprocess.run([sys.executable, "-W", "ignore", "-c", dead, url], check=True, env=env)
    racer = textwrap.dedent("""
        import os, sys, time
        from labkit.search import storage as db
        from labkit.search import study as s
        from labkit.search import workers
        url, me, n, folder = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
        st = s.load_study("race", db.make_storage(url, heartbeat_s=1, grace_s=1))
        open(os.path.join(folder, "ready-" + me), "w").close()
        while sum(os.path.exists(os.path.join(folder, f"ready-{i}")) for i in range(n)) < n:
            time.sleep(0.001)  # all three start together
        print(workers.fail_dead_trials(st))
    """)
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", racer, url, str(i), "3", str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e for _, e in outs]
    trials = study.get_trials()
    retries = Counter(t.system_attrs["failed_trial"] for t in trials if "failed_trial" in t.system_attrs)
    assert [t.state for t in trials[:16]] == [TrialState.FAIL] * 16
    assert retries == {n: 1 for n in range(16)}, retries


# -- a trial another process ended while this worker ran it ----------------------------------------------
def test_a_trial_finished_elsewhere_is_skipped_not_fatal(tmp_path, monkeypatch):
    """Two workers ran one trial (a worker thought dead, or a storage without row locks): the second one's tell fails."""
    url = stores.sqlite_url(tmp_path / "e.db")
    study = studies.create_study("e", stores.make_storage(url), CONFIG, "loss", sampler="replay", pruner="none",
                                 replay=[FITS])
    other = optuna.load_study(study_name="e", storage=stores.make_storage(url))  # the other worker's handle

    def objective(study, on_result=None):
        def fn(trial):
            if trial.number == 0:
                other.tell(trial.number, 1.0)  # the other worker finishes it first
            return 2.0
        return fn

    monkeypatch.setattr(studies, "objective", objective)
    assert studies.optimize(study, 2) == 2  # trial 0 skipped, not counted; trials 1 and 2 run here
    assert [(t.state, t.value) for t in study.trials] == [(TrialState.COMPLETE, 1.0), (TrialState.COMPLETE, 2.0),
                                                           (TrialState.COMPLETE, 2.0)]


def test_an_objectives_own_error_still_raises(tmp_path, monkeypatch):
    """The skip above must not swallow a real error: the trial is FAIL (by this worker) and the error is raised."""
    url = stores.sqlite_url(tmp_path / "o.db")
    study = studies.create_study("o", stores.make_storage(url), CONFIG, "loss", sampler="replay", pruner="none",
                                 replay=[FITS])

    def objective(study, on_result=None):
        def fn(trial):
            raise ValueError("Cannot tell a bug from a feature")
        return fn

    monkeypatch.setattr(studies, "objective", objective)
    with pytest.raises(ValueError, match="bug from a feature"):
        studies.optimize(study, 1)
    assert study.trials[0].state == TrialState.FAIL
