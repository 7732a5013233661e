"""Child processes that never outlive the cell that started them, and whether a recorded process still lives."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

PARENT_ENV = "LABKIT_PARENT_PID"  # the starting process's pid: a child that calls die_with_parent dies with it


def die_with_parent() -> None:
    """End this process when the process named by LABKIT_PARENT_PID ends (call it first thing in a child)."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    parent = int(parent)
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    else:
        def watch():
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)
        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


class ChildProcesses:
    """Start commands as child processes; on leaving the `with` block every one still running is stopped."""

    stop_timeout_s = 5.0  # seconds between SIGTERM and SIGKILL

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], env: dict | None = None, log_path=None) -> subprocess.Popen:
        """Start one child (stdout and stderr to `log_path`, else discarded); return its Popen."""
        full_env = dict(os.environ if env is None else env)
        full_env[PARENT_ENV] = str(os.getpid())
        with open(log_path, "w") if log_path is not None else contextlib.nullcontext(subprocess.DEVNULL) as out:
            proc = subprocess.Popen(argv, env=full_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def wait(self, timeout_s: float) -> list[int]:
        """Wait for every child to end; return their exit codes (TimeoutError, children stopped, after timeout_s)."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                raise TimeoutError(f"child processes still running after {timeout_s} s: stopped") from None
        return [p.returncode for p in self.procs]

    def stop(self) -> None:
        """Stop every child still running: SIGTERM, then SIGKILL after `stop_timeout_s`."""
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            p.terminate()
        deadline = time.monotonic() + self.stop_timeout_s
        for p in alive:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> "ChildProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def descendants(pid: int | None = None) -> set[int]:
    """Return the pids of the live processes below `pid` (default: this one), read from /proc (elsewhere: empty)."""
    if not os.path.isdir("/proc"):
        return set()
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [os.getpid() if pid is None else pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_pids(pids) -> None:
    """Send SIGKILL to each of `pids` still running (an engine's processes left by a start that failed)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


# -- liveness -----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def machine_id() -> str | None:
    """Return an id shared by exactly the processes whose pids this one can check (None on Windows)."""
    if os.name == "nt":
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"linux:{boot}:{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return f"{sys.platform}:{socket.gethostname()}:{uuid.getnode():012x}"


def process_start(pid: int) -> int | None:
    """Return when process `pid` started, in clock ticks since boot (Linux), to tell a reused pid apart; else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[-1].split()[19])  # field 22, starttime (proc(5))
    except (OSError, IndexError, ValueError):
        return None


def process_alive(pid: int, start: int | None = None) -> bool:
    """Return whether process `pid` of this machine runs (a zombie does not), and, given `start`, is the one started then."""
    if os.name == "nt":
        return True  # cannot tell without ending it (os.kill there terminates)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                return False
    except OSError:
        return True  # no /proc: trust kill(pid, 0)
    now = process_start(pid)
    return start is None or now is None or now == start


def this_process() -> dict:
    """Return this process's record for `process_gone`: host, pid, machine (`machine_id`) and start (`process_start`)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "machine": machine_id(), "start": process_start(pid)}


def process_gone(record: dict) -> bool:
    """Return whether a `this_process` record names a process of this machine that no longer runs (another's: False)."""
    here = machine_id()
    if here is None or record.get("machine") != here:
        return False  # its pid means nothing here
    return not process_alive(record["pid"], record.get("start"))
