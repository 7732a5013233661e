"""Where a command's CPU time went: every process started while it runs, its CPU-seconds summed by kind (`make bench`).

Linux only (/proc). A thread reads each process's CPU time (utime + stime) every `every_s` seconds and keeps the last
figure of each process started after sampling began, whoever its parent: daemons that leave the command's tree
(Ray's, a PostgreSQL server) are counted too, and those already running when it starts are not. A process is
classified by its command line at its last sample (a forked child shows its parent's until it runs a program of its
own; a process forked from a fork server never does). A process that ends between two samples loses what it ran since the
last one, and one shorter than a sample may be missed: the map's total falls somewhat below the machine's busy time.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

KINDS = (  # (kind, a pattern over its command line, one over its working directory or None): the first that matches
    ("nbval's kernels (the chapters' defaults)", re.compile(r"ipykernel"), re.compile(r"/build/nbval$")),
    ("other kernels (chapters with other parameters, runner, classroom)", re.compile(r"ipykernel"), None),
    ("forked from a fork server (torch.distributed ranks, chapter 08's search workers)",
     re.compile(r"multiprocessing\.forkserver|torch\.distributed\.run"), None),
    ("labkit's search commands run as programs (trials, workers)", re.compile(r"labkit\.tools\.search|labkit\.search"),
     None),
    ("Chromium and JupyterLab (the browser tests)", re.compile(r"chromium|jupyter[-_]?lab|jupyter_server"), None),
    ("Ray Tune's daemons and actors", re.compile(r"/ray/|ray::|raylet|gcs_server|--node-ip-address"), None),
    ("pip (the packaging tests)", re.compile(r"\bpip\b|__pip-runner__"), None),
    ("compilers (torch.compile's C++)", re.compile(r"cc1plus|\bg\+\+|\bgcc\b"), None),
    ("pytest and its workers (the tests' own code)", re.compile(r"pytest|exec\(eval\(sys\.stdin"), None),
)
OTHER = "other processes"


def kind_of(cmdline: str, cwd: str) -> str:
    """Return the KINDS name of a process from its command line and working directory, else OTHER."""
    return next((name for name, command, folder in KINDS
                 if command.search(cmdline) and (folder is None or folder.search(cwd))), OTHER)


def _read(pid: str, proc: Path) -> tuple[int, float, str, str] | None:
    """Return (start time in clock ticks since boot, CPU-seconds, command line, cwd) of a process, else None (gone)."""
    try:
        stat = (proc / pid / "stat").read_text()
        fields = stat[stat.rfind(")") + 2:].split()  # (after the command's name, which may hold spaces)
        cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        cmdline = (proc / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        try:
            cwd = os.readlink(proc / pid / "cwd")
        except OSError:
            cwd = ""
        return int(fields[19]), cpu_s, cmdline, cwd
    except (OSError, ValueError, IndexError):
        return None


class CpuMap:
    """Sample /proc every `every_s` seconds inside `with`; `by_kind()`: CPU-seconds and processes of each kind."""

    def __init__(self, every_s: float = 1.0, proc: Path = Path("/proc")):
        self.every_s, self.proc = every_s, proc
        self.processes: dict[tuple[str, int], list] = {}  # (pid, start ticks) -> [kind, CPU-seconds last read]
        self._stop, self._thread, self._before = threading.Event(), None, set()

    def sample(self) -> None:
        """Read every process started since sampling began; keep its CPU time."""
        for pid in os.listdir(self.proc):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            read = _read(pid, self.proc)
            if read is None or (pid, read[0]) in self._before:
                continue
            start, cpu_s, cmdline, cwd = read
            key = (pid, start)
            if cmdline:
                self.processes[key] = [kind_of(cmdline, cwd), max(cpu_s, self.processes.get(key, ("", 0.0))[1])]
            elif key in self.processes:  # (a zombie: no command line, its final CPU time; its kind from before)
                self.processes[key][1] = max(cpu_s, self.processes[key][1])

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __enter__(self) -> CpuMap:
        self._before = {(pid, read[0]) for pid in os.listdir(self.proc) if pid.isdigit()
                        and (read := _read(pid, self.proc)) is not None}  # (by their start, not a clock: no boot time)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def by_kind(self) -> dict[str, dict]:
        """Return {kind: {"cpu_s": CPU-seconds, "processes": count}}, the largest first."""
        out: dict[str, dict] = {}
        for kind, cpu_s in self.processes.values():
            entry = out.setdefault(kind, {"cpu_s": 0.0, "processes": 0})
            entry["cpu_s"] += cpu_s
            entry["processes"] += 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["cpu_s"]))


def cpu_map_lines(by_kind: dict, busy_cpu_s: float | None) -> list[str]:
    """Return the map as lines: each kind's CPU-seconds, its share of the map and its processes; the total beside the
    machine's busy time when known."""
    total = sum(e["cpu_s"] for e in by_kind.values())
    if not total:
        return []
    lines = [f"  {e['cpu_s']:7,.0f} CPU-s {e['cpu_s'] / total:4.0%}  {kind} ({e['processes']} processes)"
             for kind, e in by_kind.items()]
    seen = f"{total:,.0f} CPU-s in processes sampled each second"
    if busy_cpu_s:
        seen += f", {total / busy_cpu_s:.0%} of the machine's {busy_cpu_s:,.0f} busy CPU-s"
    return [f"where `make test`'s CPU went ({seen}):"] + lines
