"""Worker processes on one study: a worker killed mid-trial loses nothing, workers die with their parent,
and the same workers run against a real PostgreSQL server (started here, on loopback, when it is installed)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import optuna
import pytest
from optuna.trial import TrialState

from labkit import search
from labkit.children import ChildProcesses
from labkit.search import storage as stores
from labkit.search import study as studies
from labkit.search import workers
from labkit.search.space import check_params

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, batch=8, seq_len=16, eval_every=2, eval_batch=8)
FITS = {"technique": "l2l", "lr": 1e-3}


def _complete(params: dict, space) -> bool:
    """Return whether `params` is a whole setting of `space` (a trial's setting is drawn one parameter at a time)."""
    try:
        check_params(params, space)
    except ValueError:
        return False
    return True


def _config(train_steps: int) -> search.StudyConfig:
    return search.StudyConfig(budget_bytes=10**7, train_steps=train_steps, **SHAPE)  # everything fits


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc (Linux)")
def test_a_worker_killed_mid_trial_loses_no_trial(tmp_path):
    """run_workers SIGKILLs one of two workers inside a trial: the trial is failed, retried and completed by the other
    (the replacement worker chapter 08 starts is in test_nb08 and its nbval run)."""
    url = stores.sqlite_url(tmp_path / "kill.db")
    storage = stores.make_storage(url, heartbeat_s=1, grace_s=2)
    config = _config(train_steps=48)  # about half a second per trial: long enough to be caught running
    study = studies.create_study("kill", storage, config, "loss", sampler="random", pruner="none")
    space = [p for p in config.space() if p.name not in (study.user_attrs["settings"].get("fixed") or {})]
    seen = []
    run = workers.run_workers(url, study, 2, 8, tmp_path, kill_one=True, timeout_s=300, on_progress=seen.append,
                              drawn=lambda t: _complete(t.params, space), replace=False)  # drawn: the retry repeats it
    assert run.killed is not None and not run.timed_out and run.seconds > 0
    number, codes = run.killed[0], run.exit_codes
    assert codes == [-signal.SIGKILL, 0], codes  # the killed one, the other
    assert len(seen) >= 2 and len(seen[-1]) == len(study.get_trials(deepcopy=False))  # drawn as it ran, and at the end
    # the surviving worker did not leave before the silent trial went stale: it failed it and ran the retry
    trials = study.get_trials(deepcopy=False)
    killed = trials[number]
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == number]
    print([(t.number, t.state.name, t.system_attrs.get("failed_trial")) for t in trials])
    assert killed.state == TrialState.FAIL
    assert retries and retries[0].state == TrialState.COMPLETE and retries[0].params == killed.params
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert studies.lost_trials(study) == []
    n_complete = sum(t.state == TrialState.COMPLETE for t in trials)
    assert n_complete in (8, 9)  # 9 where the silent trial went stale after the eighth finished
    resumed = studies.load_study("kill", storage)  # and the study resumes where it stopped
    assert studies.optimize(resumed, 2, total_trials=n_complete + 1) == 1


def test_child_processes_stop_when_the_block_fails():
    with pytest.raises(RuntimeError, match="boom"):
        with ChildProcesses() as kids:
            proc = kids.start([sys.executable, "-c", "import time; time.sleep(60)"])
            raise RuntimeError("boom")
    assert proc.poll() is not None


def test_wait_stops_children_after_the_timeout():
    with ChildProcesses() as kids:
        proc = kids.start([sys.executable, "-c", "import time; time.sleep(60)"])
        with pytest.raises(TimeoutError, match="still running after 0.5 s"):
            kids.wait(timeout_s=0.5)
    assert proc.poll() is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_dies_with_the_process_that_started_it(tmp_path):
    """The parent (a notebook kernel, say) is killed outright: its worker ends too."""
    url = stores.sqlite_url(tmp_path / "orphan.db")
    studies.create_study("orphan", stores.make_storage(url), _config(4), "loss", sampler="replay", replay=[FITS],
                         pruner="none")
    parent = textwrap.dedent(f"""
        import sys, time
        from labkit.children import ChildProcesses
        from labkit.search import workers
        kids = ChildProcesses()
        proc = kids.start(workers.worker_argv({url!r}, "orphan", trials=100000))
        print(proc.pid, flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    worker_pid = int(p.stdout.readline())
    time.sleep(1.0)
    assert _alive(worker_pid)
    p.kill()
    p.wait()
    # its death signal is armed before its imports (ChildProcesses.start): it ends at once, unless the machine is
    # very loaded (torch's import once took more than 10 s on a loaded 2-core machine: CI, 2026-12-02)
    deadline = time.monotonic() + 60
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker_pid), "the worker outlived the process that started it"


# -- PostgreSQL ---------------------------------------------------------------------------------------
def _postgres_bin() -> str | None:
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(os.path.realpath(found))
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(candidates[-1]) if candidates else None


def _as_postgres_user() -> list[str] | None:
    """Return the prefix that runs a server command: none for a normal user, runuser for root (initdb refuses root)."""
    if os.geteuid() != 0:
        return []
    import pwd
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return None
    runuser = shutil.which("runuser")
    return [runuser, "-u", "postgres", "--"] if runuser else None


@pytest.fixture
def postgres_url():
    """Start a throwaway PostgreSQL server listening on a Unix socket in a folder of its own; yield its URL; stop it.

    A socket file cannot be taken by another process between choosing it and the server's bind, as a TCP port
    found free can; the workers connect to it as they would to a server on the network (only the URL differs).
    """
    pytest.importorskip("psycopg", reason="psycopg is not installed (the engines extra)")
    bindir = _postgres_bin()
    prefix = _as_postgres_user()
    if bindir is None:
        pytest.skip("PostgreSQL's server binaries are not installed (Debian: apt-get install postgresql)")
    if prefix is None:
        pytest.skip("running as root without a 'postgres' user and runuser: initdb refuses to run as root")
    base = tempfile.mkdtemp(prefix="labkit-pg-")
    data = os.path.join(base, "data")
    if os.geteuid() == 0:
        shutil.chown(base, "postgres")
    run = lambda *argv: subprocess.run(prefix + list(argv), check=True, capture_output=True, text=True)  # noqa: E731
    try:
        run(f"{bindir}/initdb", "-D", data, "-U", "postgres", "--auth=trust", "--no-sync")
        run(f"{bindir}/pg_ctl", "-D", data, "-l", os.path.join(base, "log"), "-w", "-t", "60", "-o",
            f"-k {base} -c listen_addresses='' -c fsync=off", "start")
        yield f"postgresql+psycopg://postgres@/postgres?host={base}"
    finally:
        subprocess.run(prefix + [f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def test_two_workers_on_a_postgresql_server(postgres_url):
    """The many-machine set-up on one machine: workers share the study through a real database server."""
    config = _config(train_steps=4)
    settings = [dict(FITS, lr=1e-3 * (1 + i)) for i in range(6)]
    assert stores.check_storage_url("STORAGE", postgres_url) == postgres_url  # it answers
    storage = stores.make_storage(postgres_url)
    study = studies.create_study("pg", storage, config, "loss", sampler="replay", pruner="none", replay=settings)
    with ChildProcesses() as kids:
        for i in range(2):
            kids.start(workers.worker_argv(postgres_url, "pg", trials=3, index=i), env=workers.worker_env(),
                       preload=workers.WORKER_PRELOAD)
        assert kids.wait(timeout_s=180) == [0, 0]
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 6
    assert [t.params for t in trials] == settings
    assert len({workers.worker_of(t)["pid"] for t in trials}) == 2  # both workers ran trials, and recorded it
    assert optuna.load_study(study_name="pg", storage=postgres_url).best_trial.value == study.best_trial.value
