"""Launch a rank script on N local processes from a notebook cell and bring back what each rank produced.

A rank that fails, dies or outlives `timeout_s` stops the others; no rank outlives the call.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import runpy
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from labkit.children import ChildProcesses
from labkit.device import DEVICE_CHOICES
from labkit.dist.rank import BACKEND_ENV, DEVICE_ENV, RESULT_DIR_ENV, TIMEOUT_ENV
from labkit.validate import ParameterError, check_choice, check_float, check_int

_ANNOUNCED: set[str] = set()  # placements "auto" has already explained, once per process
RANK_BACKENDS = ("auto", "gloo", "nccl")  # auto: NCCL with one GPU per rank, gloo on the CPU
OUTPUT_CHARS = 20_000  # the tail of each rank's stdout/stderr kept in its result
RANK_PRELOAD = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint.state_dict",
                "torch.distributed.pipelining", "torch.distributed.optim", "torch.nn.parallel")  # torch's modules the
#                 ranks of 06 and 07 import: the fork server imports them once for all (labkit: each rank, afresh)


@dataclass(frozen=True)
class RankPlacement:
    """Where the ranks of a process group compute and how they talk, and why."""

    device: str  # "cpu" | "cuda": each rank's compute device (cuda: GPU number = local rank)
    backend: str  # "gloo" | "nccl": the process group's backend
    reason: str  # one line: the GPUs seen and why this placement


def rank_placement(nproc: int, device: str = "auto", backend: str = "auto") -> RankPlacement:
    """Return where `nproc` local ranks run: NCCL with one GPU per rank when there are enough, else gloo on the CPU."""
    check_int("nproc", nproc, 1)
    check_choice("device", device, DEVICE_CHOICES)
    check_choice("backend", backend, RANK_BACKENDS)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < nproc:
        raise ParameterError(f"device='cuda' needs one GPU per rank: nproc={nproc} ranks, {gpus} GPUs visible")
    dev = device if device != "auto" else ("cuda" if gpus >= nproc else "cpu")
    chosen = backend if backend != "auto" else ("nccl" if dev == "cuda" else "gloo")
    if chosen == "nccl" and dev != "cuda":
        raise ParameterError(f"backend='nccl' needs CUDA devices; the ranks run on {dev}: use backend 'gloo'")
    if dev == "cuda":
        reason = f"{nproc} ranks on {gpus} GPUs: one GPU per rank, {chosen}"
    elif gpus == 0:
        reason = f"{nproc} ranks on the CPU with {chosen}: torch sees no GPU"
    elif device == "cpu":
        reason = f"{nproc} ranks on the CPU with {chosen}, as asked ({gpus} GPUs visible)"
    else:
        reason = (f"{nproc} ranks, {gpus} GPU{'s' if gpus > 1 else ''}: the ranks run on the CPU with gloo, because "
                  f"NCCL needs one GPU per rank (it refuses two ranks on one GPU); {nproc} GPUs would run them "
                  "on CUDA with NCCL")
        if reason not in _ANNOUNCED:
            _ANNOUNCED.add(reason)
            print(f"device='auto': {reason}")
    return RankPlacement(dev, chosen, reason)


@dataclass
class RankResult:
    """What one rank produced, as plain data."""

    rank: int  # the rank's index in the group
    value: object = None  # what main returned (JSON-able); None when it failed
    records: dict = field(default_factory=dict)  # what the rank labkit.record()ed
    meters: dict = field(default_factory=dict)  # meter summaries by name (labkit.dist.meter)
    spans: list = field(default_factory=list)  # [label, start_s, end_s] on the rank's clock (0: start barrier)
    core_waits: list = field(default_factory=list)  # seconds of each span spent waiting for a CPU core (Linux)
    device: str = ""  # the rank's compute device
    stdout: str = ""  # what the rank printed (the last OUTPUT_CHARS characters)
    stderr: str = ""  # what it wrote to stderr (idem)
    exitcode: int | None = None  # its exit status (negative: killed by that signal; None: not known)
    error: str | None = None  # its traceback, or how it died or was stopped; None when it finished
    failed_at: float | None = None  # when it raised (time.time()), to tell the first failure from its echoes

    @property
    def ok(self) -> bool:
        """Tell whether the rank finished and reported."""
        return self.error is None


class RankFailure(RuntimeError):
    """One or more ranks failed, died, hung past the timeout or were stopped; `.results`, `.first` (failed first)."""

    def __init__(self, message: str, results: list[RankResult], first: RankResult):
        super().__init__(message)
        self.results = results
        self.first = first


def _failure(results: list[RankResult]) -> RankFailure:
    """Build the RankFailure: the first failure with its whole traceback, then one line for each other rank."""
    failed = [r for r in results if not r.ok]
    died = [r for r in failed if r.error.startswith(("died from", "exited with"))]
    raised = sorted((r for r in failed if r.failed_at is not None), key=lambda r: r.failed_at)
    if not died and not raised:  # nobody failed on its own: the group timed out
        return RankFailure("\n".join(f"rank {r.rank}: {r.error}" for r in failed), results, failed[0])
    first = (died or raised)[0]
    lines = [f"rank {first.rank} failed first: {first.error.rstrip()}"]
    for r in failed:
        if r is not first:
            last = r.error.strip().splitlines()[-1] if r.error.strip() else r.error
            lines.append(f"rank {r.rank} (after rank {first.rank}): {last}")
    return RankFailure("\n".join(lines), results, first)


def _cli(params: dict) -> list[str]:
    """Turn {"micro_batches": 4, "schedule": "1F1B"} into ["--micro_batches", "4", "--schedule", "'1F1B'"]."""
    out = []
    for name, value in params.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ParameterError(f"params: names must be identifiers, got {name!r}")
        json.dumps(value)  # plain data only: the rank reads it back as a Python literal
        out += [f"--{name}", repr(value)]
    return out


def launch(script: str | os.PathLike, nproc: int = 2, *, params: dict | None = None, device: str = "auto",
           backend: str = "auto", timeout_s: float = 120.0, check: bool = True, echo: bool = True,
           threads_per_rank: int | None = None) -> list[RankResult]:
    """Run `script` on `nproc` local ranks and return their results in rank order; raise RankFailure if one fails.

    echo prints each rank's output after the run; threads_per_rank defaults to the cores shared out.
    """
    check_int("nproc", nproc, 1, 64)
    check_float("timeout_s", timeout_s, 0.0, 24 * 3600.0, lo_open=True)
    script = Path(script)
    if not script.is_file():
        raise ParameterError(f"script: no such file {str(script)!r}")
    placement = rank_placement(nproc, device, backend)  # checks device and backend
    dev, backend = placement.device, placement.backend
    cli = _cli(params or {})
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    check_int("threads_per_rank", threads, 1)

    from torch.distributed import TCPStore

    workdir = tempfile.mkdtemp(prefix="labkit-launch-")
    results_dir = os.path.join(workdir, "results")
    os.mkdir(results_dir)
    store = TCPStore("127.0.0.1", 0, nproc, True, wait_for_workers=False)  # port 0: the OS picks a free one
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
              "TORCHELASTIC_RUN_ID": "labkit", RESULT_DIR_ENV: results_dir,
              DEVICE_ENV: dev, BACKEND_ENV: backend, TIMEOUT_ENV: str(timeout_s), "OMP_NUM_THREADS": str(threads),
              "PYTHONUNBUFFERED": "1"}
    if sys.platform.startswith("linux"):  # the ranks talk over loopback only (gloo, and NCCL's bootstrap sockets)
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in os.environ:
                common[name] = "lo"
    logs = [(os.path.join(workdir, f"rank{r}.out"), os.path.join(workdir, f"rank{r}.err")) for r in range(nproc)]
    timed_out = False
    children = ChildProcesses()  # each rank forked from the fork server (labkit.children.fork_context)
    try:
        with children:  # also on KeyboardInterrupt: every rank is stopped before the interrupt goes on
            for r in range(nproc):
                children.start_forked(rank_main, (str(script), cli), {**common, "RANK": str(r), "LOCAL_RANK": str(r)},
                                      *logs[r], preload=RANK_PRELOAD)
            deadline = time.monotonic() + timeout_s
            while True:  # until every rank has ended, one has failed, or the time is up
                codes = [p.poll() for p in children.procs]
                if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                    break
                if time.monotonic() >= deadline:
                    timed_out = True
                    break
                multiprocessing.connection.wait([p.sentinel for p in children.procs if p.poll() is None],
                                                timeout=min(0.5, max(deadline - time.monotonic(), 0.01)))
    finally:
        del store
    try:
        results = _collect([p.returncode for p in children.procs], [_tail(path) for path, _ in logs],
                           [_tail(path) for _, path in logs], results_dir, timed_out, timeout_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if echo:
        for r in results:
            for stream in (r.stdout, r.stderr if r.ok else ""):
                for line in stream.splitlines():
                    print(f"[rank {r.rank}] {line}")
    if check and any(not r.ok for r in results):
        raise _failure(results)
    return results


def rank_main(script: str, argv: list) -> None:
    """In a rank's process: run `script` as `python -u script *argv` would."""
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def _tail(path: str | None) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-OUTPUT_CHARS:]


def _collect(codes: list, stdouts: list, stderrs: list, results_dir: str, timed_out: bool,
             timeout_s: float) -> list[RankResult]:
    """Read each rank's report and exit status into RankResults, naming what happened to each."""
    out = []
    for r in range(len(codes)):
        path = os.path.join(results_dir, f"rank{r}.json")
        report = json.loads(Path(path).read_text(encoding="utf-8")) if os.path.exists(path) else {}
        kept = {k: report[k] for k in ("value", "records", "meters", "spans", "core_waits", "device", "failed_at")
                if k in report}
        out.append(RankResult(rank=r, **kept, stdout=stdouts[r], stderr=stderrs[r], exitcode=codes[r],
                              error=report.get("error") if report else "no report"))
    if timed_out:
        for res in out:
            if res.error == "no report":
                res.error = f"did not finish within timeout_s={timeout_s:g} s: stopped"
        return out
    stopped_by_us = -signal.SIGTERM
    for res in out:  # a rank that died on its own: a signal it did not get from us, or a bad exit status
        if res.error == "no report" and res.exitcode not in (None, 0, stopped_by_us):
            res.error = (f"died from signal {signal.Signals(-res.exitcode).name}" if res.exitcode < 0
                         else f"exited with status {res.exitcode} without a report")
    failed = ", ".join(f"rank {o.rank}" for o in out if o.error not in (None, "no report")) or "another rank"
    for res in out:
        if res.error == "no report":
            res.error = f"stopped because {failed} failed"
    return out
