"""labkit.dist: rank code on N local processes, results back as plain data, and failure as a result.

Every test checks that no rank process is left behind: each rank writes its pid to a marker file,
and the test asserts those processes are gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

import labkit
import labkit.dist as ld
from labkit.work import WorkCounter

pytestmark = pytest.mark.usefixtures("one_thread")

RANKS = textwrap.dedent('''
    import os, signal, time
    import torch, torch.distributed as dist
    import labkit, labkit.dist as ld

    def main(mode="ok", marker="", scale=1.0, env="", pad=0):
        r = ld.rank()
        if env:
            labkit.record("env", os.environ.get(env, ""))
        if marker:  # written whole, then renamed: a test polling the folder never reads an empty file
            with open(f"{marker}~{r}", "w") as f:
                f.write(str(os.getpid()))
            os.replace(f"{marker}~{r}", f"{marker}.{r}")
        print(f"hello from rank {r} of {ld.world_size()}")
        if mode == "raise" and r == 1:
            raise ValueError("rank 1 breaks on purpose")
        if mode == "hang" and r == 1:
            time.sleep(3600)
        if mode == "kill" and r == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "wait":
            time.sleep(3600)
        with ld.span("all_reduce"), ld.meter("sum"):
            x = torch.full((256,), float(r + 1) * scale)
            dist.all_reduce(x)  # the other ranks wait here for a rank that failed
        labkit.record("total", float(x[0]))
        return {"rank": r, "sum": float(x.sum()), "device": str(ld.device())} | ({"pad": "x" * pad} if pad else {})

    if __name__ == "__main__":
        ld.run(main)
''')


@pytest.fixture
def ranks_script(tmp_path):
    path = tmp_path / "ranks.py"
    path.write_text(RANKS)
    return path


def _pids(marker) -> list[int]:
    folder, stem = os.path.dirname(marker), os.path.basename(marker)
    return [int(open(os.path.join(folder, f)).read()) for f in os.listdir(folder) if f.startswith(stem + ".")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead but not yet reaped
        return f.read().split(")")[-1].split()[0] != "Z"


def _assert_none_left(marker, expected: int):
    pids = _pids(marker)
    assert len(pids) == expected, pids
    deadline = time.monotonic() + 60  # (a killed launcher: its fork server ends, then the ranks' death signal; on a
    #                                    loaded 2-core machine seconds, not a defect: a rank that never ends fails)
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]


def test_values_records_meters_spans_and_output_come_back(ranks_script, tmp_path, capsys):
    marker = str(tmp_path / "m")
    results = ld.launch(ranks_script, 2, params={"marker": marker, "scale": 0.5, "env": "NCCL_SOCKET_IFNAME"},
                        device="cpu")
    assert [r.rank for r in results] == [0, 1] and all(r.ok and r.exitcode == 0 for r in results)
    expected_sum = 256 * (0.5 + 1.0)  # (1 + 2) × 0.5 in each of 256 elements
    for r in results:
        assert r.value == {"rank": r.rank, "sum": expected_sum, "device": "cpu"}
        # NCCL's sockets pinned to loopback as gloo's are, unless the user chose an interface
        assert r.records == {"total": 1.5, "env": os.environ.get("NCCL_SOCKET_IFNAME", "lo")}
        assert r.meters["sum"]["peak_bytes"] >= 256 * 4  # the tensor the rank reduced
        (label, start, end), = r.spans
        assert label == "all_reduce" and 0 <= start < end
        assert f"hello from rank {r.rank} of 2" in r.stdout
    assert "[rank 1] hello from rank 1 of 2" in capsys.readouterr().out  # echoed into the cell
    _assert_none_left(marker, 2)


def test_a_rank_that_raises_shows_its_rank_and_traceback(ranks_script, tmp_path):
    marker = str(tmp_path / "m")
    start = time.monotonic()
    with pytest.raises(ld.RankFailure) as info:
        ld.launch(ranks_script, 2, params={"mode": "raise", "marker": marker}, timeout_s=180, echo=False)
    assert time.monotonic() - start < 180  # ended by the failure, not by the timeout (a loaded machine starts slowly)
    assert not any("did not finish within" in (r.error or "") for r in info.value.results)
    text = str(info.value)
    assert text.startswith("rank 1 failed first: Traceback") and "ValueError: rank 1 breaks on purpose" in text
    assert "\nrank 0 (after rank 1): " in text  # stopped, or its all_reduce lost its peer: either way named
    assert info.value.first.rank == 1
    r0, r1 = info.value.results
    assert r1.exitcode == 1 and "breaks on purpose" in r1.error and r0.value is None and r0.error
    _assert_none_left(marker, 2)


def test_a_hung_rank_ends_the_group_at_the_timeout(ranks_script, tmp_path):
    marker = str(tmp_path / "m")
    start = time.monotonic()
    with pytest.raises(ld.RankFailure) as info:
        ld.launch(ranks_script, 2, params={"mode": "hang", "marker": marker}, timeout_s=20, echo=False)
    assert 20 <= time.monotonic() - start < 120  # ended at the timeout (both ranks reach the hang on a loaded 2-core
    #                                              machine within it), not left hanging
    assert all("did not finish within timeout_s=20 s" in r.error for r in info.value.results)
    assert str(info.value).splitlines()[0] == "rank 0: did not finish within timeout_s=20 s: stopped"
    assert [r.exitcode for r in info.value.results] == [-signal.SIGTERM] * 2  # from the launcher's public result
    _assert_none_left(marker, 2)


def test_a_rank_killed_by_a_signal_ends_the_group(ranks_script, tmp_path):
    marker = str(tmp_path / "m")
    with pytest.raises(ld.RankFailure) as info:
        ld.launch(ranks_script, 2, params={"mode": "kill", "marker": marker}, timeout_s=60, echo=False)
    r0, r1 = info.value.results
    assert r1.error == "died from signal SIGKILL" and r1.exitcode == -signal.SIGKILL
    assert info.value.first is r1 and str(info.value).startswith("rank 1 failed first: died from signal SIGKILL")
    assert r0.error is not None  # its all_reduce lost its peer: an error or a stop, never a hang
    _assert_none_left(marker, 2)


DRIVER = textwrap.dedent('''
    import faulthandler, signal, sys, labkit.dist as ld
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung driver shows where it hangs
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    print(f"driver started with SIGINT handler {signal.getsignal(signal.SIGINT)!r}, blocked {blocked}", file=sys.stderr)
    # A kernel runs a cell with SIGINT unblocked and raising KeyboardInterrupt, whatever its parent set
    # (a process inherits an ignored or blocked SIGINT from the one that started it):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    ld.launch(sys.argv[1], 2, params={"mode": "wait", "marker": sys.argv[2]}, timeout_s=120, echo=False)
''')


def _start_driver(ranks_script, marker):
    """Run a launch in another Python (as a notebook kernel runs a cell); return it once both ranks run."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(ranks_script), marker],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(_pids(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_pids(marker)) == 2, driver.communicate(timeout=5)
    return driver


def test_interrupting_the_cell_stops_every_rank(ranks_script, tmp_path):
    marker = str(tmp_path / "m")
    driver = _start_driver(ranks_script, marker)
    driver.send_signal(signal.SIGINT)  # what JupyterLab's interrupt button sends the kernel
    try:
        _, err = driver.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        status = Path(f"/proc/{driver.pid}/status")
        sig_lines = [l for l in status.read_text().splitlines() if l.startswith("Sig")] if status.exists() else []
        driver.send_signal(signal.SIGUSR1)  # every thread's stack to stderr, then stop it
        time.sleep(2)
        driver.kill()
        _, err = driver.communicate(timeout=30)
        raise AssertionError(f"the launch did not end within 60 s of SIGINT; its signal state {sig_lines}; "
                             f"its stderr and stacks:\n{err[-6000:]}") from None
    assert driver.returncode != 0 and "KeyboardInterrupt" in err
    _assert_none_left(marker, 2)
    first = err.splitlines()[0] if err else ""
    if "default_int_handler" not in first or "blocked False" not in first:  # which earlier test changed it? say so
        warnings.warn(f"the test process passed a changed SIGINT on to its children: {first}")


def test_ranks_die_with_a_launcher_that_is_killed(ranks_script, tmp_path):
    marker = str(tmp_path / "m")
    driver = _start_driver(ranks_script, marker)
    driver.kill()  # a dead kernel gets no chance to clean up: the ranks must notice by themselves
    driver.communicate(timeout=30)
    _assert_none_left(marker, 2)


@pytest.mark.parametrize("kwargs, words", [
    (dict(nproc=0), ["nproc", "[1, 64]"]),
    (dict(device="tpu"), ["device", "'auto', 'cpu', 'cuda'"]),
    (dict(backend="mpi"), ["backend", "'auto', 'gloo', 'nccl'"]),
    (dict(device="cpu", backend="nccl"), ["backend='nccl'", "CUDA"]),
    (dict(timeout_s=0), ["timeout_s"]),
    (dict(params={"bad name": 1}), ["params", "identifiers"]),
    (dict(params={"x": object()}), ["JSON"]),
])
def test_bad_input_fails_before_any_process_starts(ranks_script, tmp_path, kwargs, words):
    marker = str(tmp_path / "m")
    kwargs = {"nproc": 2, **kwargs, "params": {"marker": marker, **kwargs.get("params", {})}}
    with pytest.raises((labkit.ParameterError, TypeError)) as info:
        ld.launch(ranks_script, **kwargs)
    assert all(word in str(info.value) for word in words), str(info.value)
    assert _pids(marker) == []


def test_a_missing_script_and_cuda_without_gpus_are_refused(ranks_script, tmp_path):
    with pytest.raises(labkit.ParameterError, match="script"):
        ld.launch(tmp_path / "missing.py", 2)
    import torch
    if torch.cuda.device_count() < 2:
        with pytest.raises(labkit.ParameterError, match="one GPU per rank"):
            ld.launch(ranks_script, 2, device="cuda")


def test_two_launches_at_once_do_not_collide(ranks_script, tmp_path):
    """Each launch hosts its rendezvous store on a port the OS picked: two notebooks never meet."""
    code = "import sys, labkit.dist as ld; print(ld.launch(sys.argv[1], 2, echo=False)[0].value['sum'])"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(ranks_script)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [float(o.strip()) for o in outs] == [256 * 3.0, 256 * 3.0]


def test_parse_args_reads_literals_and_strings():
    from labkit.dist.rank import parse_args
    assert parse_args(["--micro_batches", "4", "--schedule", "1F1B", "--sizes", "[1, 2]", "--name", "'x'"]) == {
        "micro_batches": 4, "schedule": "1F1B", "sizes": [1, 2], "name": "x"}
    with pytest.raises(SystemExit):
        parse_args(["--lonely"])


def test_writefiles_writes_the_rank_scripts_of_a_notebook_as_running_it_would(tmp_path):
    """The scripts a terminal user runs with torchrun are the notebook's %%writefile cells, byte for byte."""
    import shutil

    import nbformat

    from labkit.tools.writefiles import write, written_files

    src = __import__("pathlib").Path(__file__).resolve().parents[1] / "notebooks" / "06_model_and_tensor_parallel.ipynb"
    nb = nbformat.read(src, as_version=4)
    files = dict(written_files(nb))
    assert {"06_model_parallel_ranks.py", "06_tensor_parallel_ranks.py", "06_fails_ranks.py"} <= set(files)
    assert all("labkit.dist.run(main)" in text for text in files.values())
    copy = tmp_path / src.name
    shutil.copy(src, copy)
    paths = write(copy)
    assert sorted(p.name for p in paths) == sorted(files)
    for p in paths:
        compile(p.read_text(), str(p), "exec")  # valid Python
        assert p.read_text() == files[p.name]


def test_the_same_script_runs_under_torchrun(ranks_script, tmp_path):
    """`labkit.dist.run(main)` under torch's own torchrun: the group forms, each rank prints its report line."""
    marker = str(tmp_path / "m")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", str(ranks_script),
                           "--marker", repr(marker), "--scale", "0.5", "--pad", "3000"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = {}
    for line in proc.stdout.splitlines():
        if line.startswith("[rank ") and line.endswith("}"):
            tag, _, payload = line.partition("] ")
            reports[int(tag[len("[rank "):])] = __import__("json").loads(payload)
    assert sorted(reports) == [0, 1], proc.stdout
    for r, report in reports.items():
        # (1 + 2) × 0.5, 256 elements; the line is whole JSON however long (3,000 characters of padding)
        assert report["value"] == {"rank": r, "sum": 256 * 1.5, "device": "cpu", "pad": "x" * 3000}
        assert report["records"] == {"total": 1.5} and "sum" in report["meters"]
        assert f"hello from rank {r} of 2" in proc.stdout
    _assert_none_left(marker, 2)


def _one_rank_group():
    """Join a one-process gloo group in this process (a HashStore: nothing listens on a port)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())


def test_comm_counter_counts_calls_and_bytes_by_hand():
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    _one_rank_group()
    try:
        x = torch.ones(256)  # 1024 B of fp32
        outs = [torch.empty(256)]
        with WorkCounter() as comm:
            dist.all_reduce(x)
            dist.all_reduce(x[:100])  # 400 B
            dist.all_gather(outs, x)  # this rank's shard: 1024 B
            dist.broadcast(torch.zeros(8, dtype=torch.float64), src=0)  # 64 B
            z = funcol.all_reduce(torch.ones(16), "sum", dist.group.WORLD)  # DTensor's path: 64 B
            y = x * 2  # not a collective: not counted
        assert float(z[0]) == 1.0  # (waits for the functional collective)
        assert comm.calls == {"all_reduce": 3, "all_gather": 1, "broadcast": 1}
        assert comm.bytes == {"all_reduce": 1024 + 400 + 64, "all_gather": 1024, "broadcast": 64}
        assert sum(comm.bytes.values()) == 1488 + 1024 + 64
        # ring algorithms on K = 4 ranks: an all-reduce sends 2(K-1)/K of its payload, an all-gather K-1 shards
        assert comm.wire_bytes(4) == pytest.approx(1.5 * 1488 + 3 * 1024 + 0.75 * 64)
        assert comm.work().sent_bytes == 0  # one rank: a ring sends nothing
        assert float(y[0]) == 2.0
        b = torch.zeros(8)
        with WorkCounter() as launches:  # each collective is one kernel on the GPU: a launch of the host's
            dist.all_reduce(x)
            dist.broadcast(b, src=0)
        assert launches.work().kernels == 2
    finally:
        dist.destroy_process_group()


def test_comm_counter_counts_coalesced_collectives_and_refuses_an_unknown_one(monkeypatch):
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from labkit import work as comm_mod

    # every c10d operator this torch registers is counted or known to carry no payload
    ops = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
           if n.startswith(("c10d::", "_c10d_functional::"))}
    assert ops <= set(comm_mod.COLLECTIVES) | comm_mod.NOT_COMMUNICATION | {"batch_p2p_ops"}, \
        ops - set(comm_mod.COLLECTIVES) - comm_mod.NOT_COMMUNICATION
    _one_rank_group()
    try:
        with WorkCounter() as comm, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # all_reduce_coalesced is deprecated
            dist.all_reduce_coalesced([torch.ones(10), torch.ones(6)])  # one call, 64 B
            out = funcol.all_reduce_coalesced([torch.ones(4), torch.ones(4)], "sum", dist.group.WORLD)  # 32 B
            dist.barrier()  # no payload
        assert float(out[0][0]) == float(out[1][0]) == 1.0  # (waits for both)
        assert comm.calls == {"all_reduce": 2} and comm.bytes == {"all_reduce": 96}
        monkeypatch.delitem(comm_mod.COLLECTIVES, "allreduce_")
        with pytest.raises(NotImplementedError, match="c10d::allreduce_"), ld.CommCounter():  # the old name, too
            dist.all_reduce(torch.ones(1))
    finally:
        dist.destroy_process_group()


SEND_RECV = textwrap.dedent('''
    import torch, torch.distributed as dist
    import labkit.dist as ld
    from labkit.work import WorkCounter

    def main():
        with WorkCounter() as comm:
            if ld.rank() == 0:
                dist.send(torch.ones(10), dst=1)  # 40 B
                dist.send(torch.ones(3, dtype=torch.float64), dst=1)  # 24 B
            else:
                a, b = torch.empty(10), torch.empty(3, dtype=torch.float64)
                dist.recv(a, src=0)
                dist.recv(b, src=0)
        return {"calls": comm.calls, "bytes": comm.bytes, "wire": comm.wire_bytes(2), "sent": comm.work().sent_bytes}

    if __name__ == "__main__":
        ld.run(main)
''')


def test_comm_counter_counts_point_to_point_sends_and_receives(tmp_path):
    script = tmp_path / "p2p.py"
    script.write_text(SEND_RECV)
    r0, r1 = ld.launch(script, 2, device="cpu", echo=False)
    assert r0.value == {"calls": {"send": 2}, "bytes": {"send": 64}, "wire": 64.0, "sent": 64.0}
    assert r1.value == {"calls": {"recv": 2}, "bytes": {"recv": 64}, "wire": 0.0, "sent": 0.0}  # receiving sends none


def test_the_suites_guard_finds_a_process_left_behind():
    """conftest's session-end guard: a process carrying the session's tag and still alive is reported, by pid."""
    from conftest import SESSION_TAG, leftover_processes

    tag = f"guard-test-{os.getpid()}"  # a tag of its own: the real session's processes stay out of it
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
                               env={**os.environ, SESSION_TAG: tag}, stdout=subprocess.PIPE, text=True)
    try:
        # Popen returns once exec has begun; the kernel sets the new environment's bounds a moment later, and until
        # then /proc/<pid>/environ reads empty (a loaded CI machine caught that moment): wait for the child to run
        assert sleeper.stdout.readline() == "up\n"
        left = leftover_processes(tag, wait_s=0)
        assert [line.split(":")[0] for line in left] == [str(sleeper.pid)]
        assert "time.sleep(600)" in left[0]
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
        sleeper.stdout.close()
    assert leftover_processes(tag, wait_s=5) == []  # gone (and reaped): nothing to report


class _FakeEvent:
    """A CUDA event on a fake GPU clock: record() notes the clock; elapsed_time() in milliseconds, as torch's."""

    clock_s = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at_s = None

    def record(self, stream=None):
        self.at_s = _FakeEvent.clock_s

    def elapsed_time(self, end):
        return (end.at_s - self.at_s) * 1e3


@pytest.fixture
def fake_cuda_rank(monkeypatch):
    """A rank on a fake GPU: labkit.dist.rank sees a cuda device, CUDA events and synchronize are recorded fakes."""
    import torch

    rank_mod = sys.modules["labkit.dist.rank"]  # the module (labkit.dist.rank is also a function)

    syncs = []
    monkeypatch.setattr(rank_mod, "device", lambda: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    monkeypatch.setattr(rank_mod, "_state", {"t0": None, "t0_event": None, "spans": [], "core_waits": [], "meters": {}})
    return rank_mod, syncs


def test_cuda_spans_are_timed_with_events_and_never_synchronise(fake_cuda_rank, monkeypatch):
    import torch.distributed as dist

    rank_mod, syncs = fake_cuda_rank
    joined = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.update(backend=backend, **kw))
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.delenv(rank_mod.BACKEND_ENV, raising=False)
    from datetime import timedelta
    _FakeEvent.clock_s = 10.0
    rank_mod.join(rank_mod.device(), timedelta(seconds=5))
    # NCCL bound to this rank's GPU (device_id): eager init, and no guessing from the global rank
    assert joined["backend"] == "nccl" and joined["device_id"] == rank_mod.device()
    syncs.clear()
    with rank_mod.span("F0"):
        _FakeEvent.clock_s = 10.25  # the GPU ran the block's work from 10.0 to 10.25 s
        with rank_mod.span("send"):
            _FakeEvent.clock_s = 10.5
    assert syncs == []  # nothing waited for the device while the step ran
    spans = rank_mod._spans()
    assert spans == [["send", 0.25, 0.5], ["F0", 0.0, 0.5]]  # seconds since the barrier's event
    assert len(syncs) == 1  # read back once, at the report


def test_cpu_join_passes_no_device_id(monkeypatch):
    import torch
    import torch.distributed as dist

    rank_mod = sys.modules["labkit.dist.rank"]  # the module (labkit.dist.rank is also a function)

    joined = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.update(backend=backend, **kw))
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(rank_mod, "_state", {"t0": None, "t0_event": None, "spans": [], "core_waits": [], "meters": {}})
    monkeypatch.delenv(rank_mod.BACKEND_ENV, raising=False)
    from datetime import timedelta
    rank_mod.join(torch.device("cpu"), timedelta(seconds=5))
    assert joined["backend"] == "gloo" and joined["device_id"] is None
    with rank_mod.span("x"):
        pass
    (label, a, b), = rank_mod._spans()
    assert label == "x" and 0 <= a <= b


PRELOADED = textwrap.dedent('''
    import sys
    imported_before = "torch" in sys.modules  # this script has imported nothing yet
    import os
    import labkit.dist as ld

    def main(x):
        return {"torch_imported_before": imported_before, "x": x, "late": os.environ.get("LABKIT_TEST_LATE"),
                "threads": __import__("torch").get_num_threads(),
                "argv": sys.argv[1:], "cwd": os.getcwd(), "main": __name__}

    if __name__ == "__main__":
        ld.run(main)
''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server: Linux here")
def test_ranks_start_from_a_fork_server_that_imported_torch_once(tmp_path, monkeypatch):
    """A rank forks from a server that has imported torch: it runs its script as `python -u script args` would, on
    the threads it was given, in the launcher's folder and environment; the server ends when asked (and with the
    launcher)."""
    from labkit.children import stop_fork_server
    script = tmp_path / "preloaded.py"
    script.write_text(PRELOADED)
    monkeypatch.chdir(tmp_path)
    for late in (None, "set after the server started"):  # the second launch reuses the server the first started
        if late:  # a rank sees the launcher's environment as it is at the launch, not as the server found it
            monkeypatch.setenv("LABKIT_TEST_LATE", late)
        results = ld.launch(script, 2, device="cpu", echo=False, threads_per_rank=1, params={"x": 1})
        for r in results:
            assert r.value == {"torch_imported_before": True, "threads": 1, "argv": ["--x", "1"], "late": late,
                               "x": 1, "cwd": str(tmp_path), "main": "__main__"}
    from multiprocessing import forkserver
    server = forkserver._forkserver._forkserver_pid
    assert server is not None and _alive(server)
    stop_fork_server()
    assert not os.path.exists(f"/proc/{server}") or not _alive(server)
