"""Child processes that never outlive the cell that started them, and whether a recorded process still lives.

Functions run in children forked from a fork server that imported torch once (start_forked); that server is the one
process that outlives a cell: it runs no child's code, and ends with the process that started it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

PARENT_ENV = "LABKIT_PARENT_PID"  # the starting process's pid: a child that calls die_with_parent dies with it
# `python -c` of a `python -m module ...` that start() runs: the death signal armed (Linux) before the module's imports
# (its package's __init__ imports torch: seconds, and more than 10 s on a loaded 2-core machine), then the module
ARMED_MODULE = """\
import ctypes, os, runpy, signal, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(os.environ["LABKIT_PARENT_PID"]):
    os._exit(1)  # the parent died before the signal was armed
sys.argv = sys.argv[1:]  # [module, args...]: run_module puts the module's path first, as -m does
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


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

    def start_forked(self, target, args: tuple = (), env: dict | None = None, stdout_path=None,
                     stderr_path=None, preload: tuple = ()) -> "Forked":
        """Start target(*args) in a child forked from this process's fork server (fork_context(preload)), in this
        process's environment as it is now with `env` added (as subprocess would), stdout and stderr to their files
        (the same file for both if stderr_path is None)."""
        process = fork_context(preload).Process(target=_forked_main, args=(
            target, args, {**os.environ, **(env or {})}, stdout_path, stderr_path))
        with _main_left_alone():
            process.start()
        proc = Forked(process)
        self.procs.append(proc)
        return proc

    def start(self, argv: list[str], env: dict | None = None, log_path=None, preload: tuple | None = None):
        """Start one child (stdout and stderr to `log_path`, else discarded); return its Popen (with `preload`: its
        Forked, which behaves as one). A child `python -m module ...` dies with this process from its first line, before
        the module's imports (ARMED_MODULE; elsewhere than Linux, once it calls die_with_parent).

        preload: argv must be this Python's `-m module ...`; the child is forked from the fork server that imported
        torch and the modules `preload` names (start_forked), and runs the module as `python -m` would, without the
        seconds a new Python takes to import them again.
        """
        full_env = dict(os.environ if env is None else env)
        if preload is not None:
            if argv[:2] != [sys.executable, "-m"] or len(argv) < 3:
                raise ValueError(f"start(preload=...) runs `{sys.executable} -m module ...` only, not {argv[:3]}")
            if log_path is not None:
                open(log_path, "w").close()  # as a new process's log: this run's lines only
            return self.start_forked(run_module, (argv[2], argv[3:]), env=full_env,
                                     stdout_path=os.devnull if log_path is None else log_path, preload=preload)
        full_env[PARENT_ENV] = str(os.getpid())
        if argv[:2] == [sys.executable, "-m"] and len(argv) >= 3:
            argv = [sys.executable, "-c", ARMED_MODULE, *argv[2:]]
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


class Forked:
    """A process ChildProcesses.start_forked started, seen as the subprocess.Popen that ChildProcesses stops."""

    def __init__(self, process: multiprocessing.Process):
        self.process = process
        self.pid = process.pid
        self.sentinel = process.sentinel  # readable once it has ended (multiprocessing.connection.wait)

    @property
    def returncode(self) -> int | None:
        """Return its exit code (negative: the signal that ended it), None while it runs."""
        return self.process.exitcode

    def poll(self) -> int | None:
        """Return its exit code, None while it runs."""
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to end; return its exit code (subprocess.TimeoutExpired after `timeout` s)."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)
        return self.process.exitcode

    def terminate(self) -> None:
        """Send it SIGTERM."""
        self.process.terminate()

    def kill(self) -> None:
        """Send it SIGKILL."""
        self.process.kill()


def fork_context(preload: tuple = ()):
    """Return the multiprocessing context children start in: a fork server that has imported torch and the modules
    `preload` names, or spawn where the platform has no fork server.

    A child forked from the server starts in milliseconds instead of the ~3 s of importing torch (4 ranks on 2
    cores: ~7 s). The server is started by this process's first forked child, with that caller's `preload` (a later
    caller's children import what else they need), and runs no child's code itself; it ends when this process ends
    (a kernel: on shutdown, restart or death), or at stop_fork_server(). Preload installed libraries only (torch's
    modules, optuna): labkit's take ~0.1 s and each child imports them afresh (an edited labkit reaches the next child,
    as with a new process).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", *preload])  # read when the server starts only
    return context


def stop_fork_server() -> None:
    """Stop this process's fork server if it started one (the next forked child starts another)."""
    from multiprocessing import forkserver
    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:  # private: the server's own record
        forkserver._forkserver._stop()


@contextlib.contextmanager
def _main_left_alone():
    """Start a process without multiprocessing re-running this process's __main__ in it (a script, or a module run
    with -m): the child runs its target only, and a starting script needs no `if __name__ == "__main__"` guard."""
    from multiprocessing import spawn
    prepare = spawn.get_preparation_data

    def without_main(name):
        data = prepare(name)
        data.pop("init_main_from_name", None)
        data.pop("init_main_from_path", None)
        return data
    spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        spawn.get_preparation_data = prepare


def _forked_main(target, args: tuple, env: dict, stdout_path, stderr_path) -> None:
    """In a forked child: output to the files (unbuffered), `env` its whole environment (the server's is the one the
    starting process had when the server started), dying with the fork server, then target(*args).

    OMP_NUM_THREADS in `env` sets torch's threads: OpenMP read the variable when the server imported torch.
    """
    for fd, path in ((1, stdout_path), (2, stderr_path or stdout_path)):
        if path is not None:
            target_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(target_fd, fd)
            os.close(target_fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)  # as python -u
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    os.environ.clear()
    os.environ.update(env)
    from multiprocessing import forkserver
    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)  # (private; none under spawn)
    if alive is not None:  # the server ends when no process holds this: the starting process only, not its children
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    os.environ[PARENT_ENV] = str(os.getppid())  # the fork server, which ends when the starting process does
    if "OMP_NUM_THREADS" in env:
        import torch
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    target(*args)


def run_module(module: str, args: list) -> None:
    """In a child: run `module` as `python -m module *args` would (its SystemExit is the child's exit code)."""
    import runpy
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


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
