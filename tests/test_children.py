"""labkit.children's liveness: a pid is checked only on the machine that recorded it, and a reused pid is told apart."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from labkit import children

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


def test_machine_id_is_stable_and_shared_with_children():
    here = children.machine_id()
    assert here and here == children.machine_id()
    out = subprocess.run([sys.executable, "-c", "from labkit.children import machine_id; print(machine_id())"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here  # a worker this process starts sees the same pids


@linux_only
def test_machine_id_names_this_boot_not_the_hostname():
    """Machines cloned from one image share hostname and /etc/machine-id; the boot id is drawn at each boot."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert boot in children.machine_id() and os.readlink("/proc/self/ns/pid") in children.machine_id()


def test_a_reaped_process_is_not_alive():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert not children.process_alive(gone.pid)
    assert children.process_alive(os.getpid())


@linux_only
def test_a_zombie_is_not_alive():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until it exited, not yet reaped: kill(pid, 0) still succeeds
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                break
        time.sleep(0.01)
    try:
        assert not children.process_alive(proc.pid)
    finally:
        proc.wait()


@linux_only
def test_a_reused_pid_is_told_apart_by_its_start():
    start = children.process_start(os.getpid())
    assert isinstance(start, int) and start > 0
    assert children.process_alive(os.getpid(), start)
    assert not children.process_alive(os.getpid(), start - 1)  # another process that had this pid before


def test_a_process_record_is_gone_only_here_and_only_when_its_process_ended():
    here = children.this_process()
    assert here["pid"] == os.getpid() and here["machine"] == children.machine_id()
    assert not children.process_gone(here)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert children.process_gone(dict(here, pid=gone.pid, start=None))
    assert not children.process_gone(dict(here, pid=gone.pid, machine="linux:another-boot:pid:[1]"))  # not ours to say


def test_the_fork_servers_imports_query_no_cuda_device():
    """A child forked after its parent queried CUDA cannot use CUDA ("Cannot re-initialize CUDA in forked
    subprocess"): importing what the fork server preloads for ranks and plan workers must not ask torch.cuda anything."""
    code = ("import importlib, torch\n"
            "def asked(*a, **k):\n"
            "    raise SystemExit('torch.cuda queried while importing')\n"
            "torch.cuda.is_available = torch.cuda.device_count = torch.cuda._lazy_init = asked\n"
            "from labkit.dist.launch import RANK_PRELOAD\n"
            "from labkit.planner.plan import PLAN_PRELOAD\n"
            "for name in RANK_PRELOAD + PLAN_PRELOAD:\n"
            "    importlib.import_module(name)\n"
            "print(len(RANK_PRELOAD + PLAN_PRELOAD))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout) >= 5


def test_a_python_module_started_with_preload_is_forked_and_exits_as_python_m_would(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("an earlier run's line\n")
    argv = [sys.executable, "-m", "labkit.tools.search", "worker", "--storage", "sqlite:///:memory:", "--study", "x"]
    with children.ChildProcesses() as kids:
        proc = kids.start(argv, log_path=log, preload=("optuna",))
        assert isinstance(proc, children.Forked)  # a child of the fork server, not a new Python
        assert proc.wait(timeout=120) == 2  # the module's own exit code (an in-memory storage is refused)
        ok = kids.start([sys.executable, "-m", "labkit.tools.search", "katib", "--budget-bytes", "1000000"],
                        log_path=tmp_path / "katib.log", preload=())
        assert ok.wait(timeout=120) == 0
    text = log.read_text()
    assert "earlier" not in text and "python -m labkit.tools.search worker:" in text and "memory" in text, text
    assert "kind: Experiment" in (tmp_path / "katib.log").read_text()
    with pytest.raises(ValueError, match="-m module"):
        children.ChildProcesses().start(["echo", "hi"], preload=())



@linux_only
def test_a_python_module_dies_with_its_parent_while_its_imports_still_run(tmp_path):
    """The death signal is armed before `python -m`'s imports (labkit's pull torch in: seconds on a loaded machine)."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(600)  # an import that does not end\n")
    parent = ("import os, sys, time\nfrom labkit.children import ChildProcesses\n"
              f"env = dict(os.environ, PYTHONPATH={str(tmp_path)!r})\n"
              "print(ChildProcesses().start([sys.executable, '-m', 'slow_import'], env=env).pid, flush=True)\n"
              "time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    time.sleep(1.0)  # (Python's start-up: the child then sleeps inside the module's import)
    assert children.process_alive(child)
    p.kill()
    p.wait()
    deadline = time.monotonic() + 60  # a signal, not a poll: at once, unless the machine is very loaded
    while time.monotonic() < deadline and children.process_alive(child):
        time.sleep(0.1)
    outlived = children.process_alive(child)
    if outlived:
        os.kill(child, 9)
    assert not outlived, "the child outlived its parent: no death signal before its imports"
