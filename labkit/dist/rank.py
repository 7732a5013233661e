"""Inside a rank: join the process group from the environment, run the rank's code, report what it produced."""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from labkit.children import PARENT_ENV, die_with_parent
from labkit.meter import MemoryMeter
from labkit.results import jsonable, recorded
from labkit.stages import LOSS_KIND

RESULT_DIR_ENV = "LABKIT_RESULT_DIR"  # where a launched rank writes rank<r>.json
DEVICE_ENV = "LABKIT_DEVICE"  # "cpu" or "cuda", chosen by the launcher ("auto" under torchrun)
TIMEOUT_ENV = "LABKIT_TIMEOUT_S"  # collectives give up after this many seconds
BACKEND_ENV = "LABKIT_BACKEND"  # "gloo" or "nccl", chosen by the launcher (by the device under torchrun)

_state = {"t0": None, "t0_event": None, "spans": [], "core_waits": [], "meters": {}}


def rank() -> int:
    """Return this process's rank in the group (0 outside a group)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Return the number of ranks in the group (1 outside a group)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def device() -> torch.device:
    """Return this rank's compute device: its own GPU (LOCAL_RANK) under NCCL, else the CPU."""
    choice = os.environ.get(DEVICE_ENV, "auto")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def now_s() -> float:
    """Return seconds since the start barrier on this rank's clock (the clock spans use)."""
    t0 = _state["t0"] if _state["t0"] is not None else time.perf_counter()
    return time.perf_counter() - t0


def core_wait_s() -> float:
    """Return the seconds this thread has spent ready to run but waiting for a CPU core (Linux; 0.0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


@contextlib.contextmanager
def span(label: str):
    """Time the block as a labelled span of this rank's timeline (on CUDA: from CUDA events, unsynchronised).

    Also notes how long the rank waited for a CPU core inside the block (RankResult.core_waits).
    """
    cuda = device().type == "cuda" and _state["t0_event"] is not None
    start, wait0 = now_s(), core_wait_s()
    if cuda:
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
    try:
        yield
    finally:
        end = now_s()
        if cuda:
            finish = torch.cuda.Event(enable_timing=True)
            finish.record()
            _state["spans"].append((label, begin, finish))  # read in _spans(), after one synchronize
        else:
            _state["spans"].append((label, start, end))
        _state["core_waits"].append(min(max(core_wait_s() - wait0, 0.0), end - start))


def _spans() -> list[list]:
    """Return every span as [label, start_s, end_s], reading CUDA spans from their events (one synchronize)."""
    t0 = _state["t0_event"]
    if t0 is not None and any(not isinstance(a, float) for _, a, _ in _state["spans"]):
        torch.cuda.synchronize()
    out = []
    for label, a, b in _state["spans"]:
        if not isinstance(a, float):  # CUDA events: milliseconds since the barrier's event
            a, b = t0.elapsed_time(a) / 1e3, t0.elapsed_time(b) / 1e3
        out.append([label, a, b])
    return out


@contextlib.contextmanager
def meter(name: str, budget_bytes: int | None = None):
    """Open a MemoryMeter on this rank's device; its summary goes back to the launcher under `name`."""
    m = MemoryMeter(device(), budget_bytes=budget_bytes, timeline=False)
    try:
        with m:
            yield m
    finally:
        _state["meters"][name] = m.summary()


def parse_args(argv: list[str]) -> dict:
    """Read `--name value` pairs into a dict (values as Python literals where they parse, else strings)."""
    out, i = {}, 0
    while i < len(argv):
        key = argv[i]
        if not key.startswith("--") or i + 1 >= len(argv):
            raise SystemExit(f"expected --name value pairs, got {argv[i:]!r}")
        try:
            value = ast.literal_eval(argv[i + 1])
        except (ValueError, SyntaxError):
            value = argv[i + 1]
        out[key[2:].replace("-", "_")] = value
        i += 2
    return out


def join(dev: torch.device, timeout: timedelta) -> None:
    """Join the process group (NCCL bound to this rank's GPU: device_id), wait at a barrier, start the clock."""
    backend = os.environ.get(BACKEND_ENV) or ("nccl" if dev.type == "cuda" else "gloo")
    dist.init_process_group(backend, timeout=timeout, device_id=dev if dev.type == "cuda" else None)
    dist.barrier()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        _state["t0_event"] = torch.cuda.Event(enable_timing=True)
        _state["t0_event"].record()
    _state["t0"] = time.perf_counter()


def run(main) -> None:
    """Join the group, call main(**command-line parameters), report the results, leave the group."""
    die_with_parent()
    params = parse_args(sys.argv[1:])
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, 1800)))
    report: dict = {"rank": int(os.environ.get("RANK", 0)), "device": str(dev)}
    ok = False
    try:
        join(dev, timeout)
        report["value"] = jsonable(main(**params))
        ok = True
    except BaseException:  # noqa: BLE001 - everything, KeyboardInterrupt included, is reported
        report["error"] = traceback.format_exc()
        report["failed_at"] = time.time()  # the launcher names the rank that failed first
    try:
        spans = _spans()
    except BaseException:  # noqa: BLE001 - a device that failed cannot give its events back
        spans, ok = [], False
        report.setdefault("error", traceback.format_exc())
        report.setdefault("failed_at", time.time())
    report.update(records=jsonable(recorded()), meters=jsonable(_state["meters"]), spans=spans,
                  core_waits=list(_state["core_waits"]))
    _write(report)
    if ok:
        dist.destroy_process_group()
    else:
        sys.stderr.write(report["error"])
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown: the process group's C++ threads can abort or hang a normal exit
    os._exit(0 if ok else 1)


def _write(report: dict) -> None:
    folder = os.environ.get(RESULT_DIR_ENV)
    if folder:
        path = os.path.join(folder, f"rank{report['rank']}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)  # complete or absent, never half-written
    else:  # under torchrun: one line per rank
        shown = {k: v for k, v in report.items() if k not in ("spans", "core_waits")}
        line = f"[rank {report['rank']}] {json.dumps(shown)}\n".encode()  # whole: a cut line is not JSON
        sys.stdout.flush()
        while line:  # one write call where it can: the ranks share torchrun's stdout (pipes keep 4 KiB writes whole)
            line = line[os.write(sys.stdout.fileno(), line):]


def time_actions(stage, name_stage: bool = False, schedule=None) -> None:
    """Make every forward and backward of a torch.distributed.pipelining stage a labkit.dist span ("F3", "B3").

    Given the `schedule`, the last stage's loss of each micro-batch is timed too, as a span "L3".
    """
    suffix = f"/s{stage.stage_index}" if name_stage else ""
    if schedule is not None and not getattr(schedule, "_labkit_timed_loss", False):
        compute_loss = schedule._maybe_compute_loss  # private: pinned by tests/test_pipeline.py

        @functools.wraps(compute_loss)
        def timed_loss(st, output, target_mbs, mb_index, *args, **kwargs):
            if not st.is_last or getattr(schedule, "_loss_fn", None) is None:
                return compute_loss(st, output, target_mbs, mb_index, *args, **kwargs)
            with span(f"{LOSS_KIND}{mb_index}" + (f"/s{st.stage_index}" if name_stage else "")):
                return compute_loss(st, output, target_mbs, mb_index, *args, **kwargs)
        schedule._maybe_compute_loss = timed_loss
        schedule._labkit_timed_loss = True

    def wrap(method: str, kind: str):
        fn = getattr(stage, method)

        @functools.wraps(fn)
        def timed(chunk_id, *args, **kwargs):
            with span(f"{kind}{chunk_id}{suffix}"):
                return fn(chunk_id, *args, **kwargs)
        setattr(stage, method, timed)

    wrap("forward_one_chunk", "F")
    wrap("backward_one_chunk", "B")
    wrap("backward_weight_one_chunk", "W")
