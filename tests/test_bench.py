"""The machine report every timing comes with (workbook.cpureport), `make bench`'s table and its map of the suite's CPU
time (workbook.cpumap)."""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys
import time

import pytest

from labkit import cpu
from workbook import cpureport
from workbook import bench, cpumap

REPORT = cpureport.CpuReport(model="Some CPU", cores=2, capability="AVX512", bf16_flags=("avx512_bf16",), dispatch_env={},
                       fp32_matmul_s=0.005, bf16_matmul_s=0.001, bf16_native=True)


@pytest.mark.parametrize("flags, capability, env, native", [
    ({"avx512_bf16"}, "AVX512", {}, True),  # bf16 units, and torch dispatches to them
    ({"amx_bf16", "avx512_bf16"}, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True),
    ({"avx512_bf16"}, "AVX2", {}, False),  # ATEN_CPU_CAPABILITY=avx2: the units are there, torch does not use them
    ({"avx512_bf16"}, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False),  # oneDNN capped below AVX-512-BF16
    ({"avx2", "fma"}, "AVX2", {}, False),  # no bf16 units
    ({"bf16", "asimd"}, "DEFAULT", {}, True),  # Arm's BF16 extension
])
def test_bf16_is_native_only_with_its_units_and_a_dispatch_that_uses_them(flags, capability, env, native):
    assert cpu.bf16_native(flags, capability, env) is native


@pytest.mark.parametrize("flags, capability, env, words", [
    ((), "AVX2", {}, "this CPU has no bf16 units"),
    (("avx512_bf16", "amx_bf16"), "AVX2", {}, "torch's kernels here (AVX2) use none of this CPU's bf16 units "
                                              "(avx512_bf16, amx_bf16)"),
    (("avx512_bf16",), "AVX2", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "HOME": "/root"},
     "torch's kernels here (AVX2, set by ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2) use none of this CPU's "
     "bf16 units (avx512_bf16)"),  # the reference machine's emulation, named
])
def test_the_chapters_say_whether_the_cpu_lacks_bf16_units_or_torch_does_not_use_them(flags, capability, env, words):
    assert cpu.no_bf16_words(flags, capability, env) == words


def test_the_line_names_the_cpu_its_vector_level_the_dispatch_variables_and_the_ratio():
    line = dataclasses.replace(REPORT, dispatch_env={"ATEN_CPU_CAPABILITY": "avx2"}, bf16_matmul_s=0.18,
                               bf16_native=False).line()
    assert line.startswith("CPU: Some CPU, 2 cores, torch capability AVX512, bf16 flags avx512_bf16 "
                           "(ATEN_CPU_CAPABILITY=avx2)")
    assert "fp32 5.00 ms, bf16 180.00 ms (bf16/fp32 = 36.0x: no native bf16)" in line


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX2 dispatch variables are x86's")
def test_the_avx2_variables_make_this_cpu_report_no_native_bf16():
    """What `make bench` and the chapters read under the reference machine's emulation (or on an AVX2 machine)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    code = "from labkit.cpu import bf16_native; from workbook.cpureport import cpu_report; r = cpu_report(); print(r.capability, bf16_native(), r.bf16_ratio > 2)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    capability, native, slow = out.stdout.split()
    assert capability in ("AVX2", "DEFAULT") and native == "False" and slow == "True", out.stdout  # and it shows


def test_the_pytest_closing_line_is_read_for_the_suites_time():
    line = "========== 1104 passed, 17 skipped, 150 warnings in 566.30s (0:09:26) =========="
    match = bench.PYTEST_LINE.search(line)
    assert match["counts"] == "1104 passed, 17 skipped, 150 warnings" and float(match["s"]) == 566.30


def test_the_table_sets_every_figure_beside_its_limit():
    results = {"chapters": {"by_chapter_s": {"00_a": 12.5, "01_b": None}, "failed": ["01_b"], "total_s": 20.0,
                            "exit_code": 1},
               "plan": {"wall_s": 9.5, "exit_code": 0},
               "suite": {"pytest_s": None, "counts": None, "exit_code": 2}}
    rows = bench.table(results).splitlines()
    assert rows[2:] == ["| chapter 00_a | 12.5 | 60 |", "| chapter 01_b | not run | 60 |",
                        "| `make run`, all chapters (failed: 01_b) | 20.0 | 360 |",
                        "| `make plan MODEL=llama-7b GPU=a100-80gb GPUS=8` | 9.5 | 30 |",
                        "| `make test`, pytest (None) | failed to run | 600 |"]


def test_the_last_line_gives_the_machines_speed_before_and_after():
    assert bench.drift_line(0.00456, 0.00684) == ("this machine during the bench: 512x512 fp32 matmul 4.56 ms before, "
                                                  "6.84 ms after (1.50x)")
    assert bench.drift_line(0.00263, 0.00395, during="this run") == (  # the suite's last line (tests/conftest.py)
        "this machine during this run: 512x512 fp32 matmul 2.63 ms before, 3.95 ms after (1.50x)")


@pytest.mark.parametrize("fp32_s, words", [
    (0.00283, "this machine's fp32 2.83 ms, 1.8x the reference's speed: times here run shorter than on the reference"),
    (0.0048, "this machine's fp32 4.80 ms, about the reference's speed"),
    (0.0052, "this machine's fp32 5.20 ms, about the reference's speed"),
    (0.0100, "this machine's fp32 10.00 ms, 2.0x slower than the reference: times here run longer than on it"),
])
def test_the_reference_line_says_whether_this_machine_runs_faster_or_slower_than_the_reference(fp32_s, words):
    """The AVX2 variables pick the reference's kernels, not its speed: the bench says how this machine compares."""
    line = bench.reference_line(fp32_s)
    assert line == ("beside the reference (issue 34's 2-core AMD EPYC, AVX2 only: fp32 5.00 ms): " + words), line


def test_repeated_rounds_give_medians_with_their_range():
    rounds = [{"by_chapter_s": {"00_a": s, "01_b": t}, "failed": f, "total_s": s + t, "exit_code": int(bool(f))}
              for s, t, f in ((12.0, 5.0, []), (14.0, 4.0, ["01_b"]), (11.0, 6.0, []))]
    chapters = bench.combined("chapters", rounds)
    assert chapters["by_chapter_s"] == {"00_a": 12.0, "01_b": 5.0} and chapters["total_s"] == 17.0
    assert chapters["by_chapter_runs_s"]["00_a"] == [12.0, 14.0, 11.0] and chapters["total_runs_s"] == [17.0, 18.0, 17.0]
    assert chapters["failed"] == ["01_b"] and chapters["exit_code"] == 1  # a failure in any round is reported
    plan = bench.combined("plan", [{"wall_s": w, "exit_code": 0} for w in (31.0, 36.5, 29.0)])
    assert plan["wall_s"] == 31.0 and plan["wall_runs_s"] == [31.0, 36.5, 29.0]
    rows = bench.table({"repeats": 3, "chapters": chapters, "plan": plan}).splitlines()
    assert rows[0] == "| what | seconds, median of 3 (range) | limit on the 2-core AVX2 machine |"
    assert rows[2] == "| chapter 00_a | 12.0 (11.0–14.0) | 60 |"
    assert rows[-1] == "| `make plan MODEL=llama-7b GPU=a100-80gb GPUS=8` | 31.0 (29.0–36.5) | 30 |"
    assert bench.combined("plan", [{"wall_s": 9.0, "exit_code": 0}]) == {"wall_s": 9.0, "exit_code": 0}  # one round


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the machine's busy time is read from Linux's /proc/stat")
def test_the_machines_busy_time_holds_this_processs_own_work():
    before, cpu_before = bench.machine_cpu_s(), time.process_time()
    while time.process_time() - cpu_before < 0.5:  # half a CPU-second of work
        sum(range(10_000))
    assert bench.machine_cpu_s() - before >= 0.45  # (a clock tick's rounding below; other processes only add)


def test_the_machines_busy_time_leaves_out_idle_waits_and_the_hypervisors_steal(tmp_path):
    stat = tmp_path / "stat"  # user nice system idle iowait irq softirq steal guest guest_nice, in clock ticks
    stat.write_text("cpu  700 100 200 5000 300 20 30 900 0 0\ncpu0 350 50 100 2500 150 10 15 450 0 0\n")
    assert bench.machine_cpu_s(stat) == (700 + 100 + 200 + 20 + 30) / os.sysconf("SC_CLK_TCK")
    assert bench.machine_cpu_s(tmp_path / "absent") is None


def test_the_suites_cpu_line_sets_its_busy_time_beside_what_its_limit_allows():
    suite = {"busy_cpu_s": 1585.2, "cores": 2, "wall_s": 800.3, "pytest_s": 792.7}
    assert bench.cpu_line(suite) == ("during `make test`: the machine's 2 cores busy 1,585 CPU-s in 800 s (99% of them); "
                                     "600 s of pytest allows 1,200 CPU-s at full use")
    assert bench.cpu_line({**suite, "busy_cpu_s": None}) is None  # not read (no /proc/stat): no line
    assert bench.cpu_line(suite, during="this run", limit=False) == (  # the suite's last lines (tests/conftest.py)
        "during this run: the machine's 2 cores busy 1,585 CPU-s in 800 s (99% of them)")
    rounds = [{**suite, "busy_cpu_s": b, "wall_s": w, "pytest_s": w - 7, "counts": "9 passed", "exit_code": 0}
              for b, w in ((1500.0, 760.0), (1600.0, 820.0), (1550.0, 790.0))]
    both = bench.combined("suite", rounds)
    assert (both["busy_cpu_s"], both["wall_s"], both["pytest_s"]) == (1550.0, 790.0, 783.0)
    assert both["busy_cpu_runs_s"] == [1500.0, 1600.0, 1550.0] and both["pytest_runs_s"] == [753.0, 813.0, 783.0]


def test_each_timed_command_compiles_into_a_fresh_inductor_cache(tmp_path, monkeypatch):
    """A kernel cached under one vector level must not be reused under another (inductor does not key its cache by it);
    the command runs as typed in a shell, not as a sub-make of `make bench`."""
    stale = tmp_path / "inductor-cache" / "stale-kernel"
    stale.parent.mkdir()
    stale.write_text("built for another vector level")
    for name in bench.MAKE_VARS:
        monkeypatch.setenv(name, "1")  # as `make bench` sets them
    code = ("import os, pathlib; d = os.environ['TORCHINDUCTOR_CACHE_DIR']; print(d, list(pathlib.Path(d).glob('*')), "
            f"[k for k in {bench.MAKE_VARS!r} if k in os.environ])")
    wall_s, rc, text = bench._timed([sys.executable, "-c", code], tmp_path / "x.log")
    assert rc == 0 and wall_s > 0
    assert text.split()[0] == str(tmp_path / "inductor-cache") and "stale-kernel" not in text
    assert text.rstrip().endswith("[]"), text  # no make variable reached it
    assert (tmp_path / "x.log").read_text() == text


@pytest.mark.parametrize("cmdline, cwd, kind", [
    ("/x/.venv/bin/python -m ipykernel_launcher -f /tmp/k.json", "/tmp/ci/build/nbval", "nbval's kernels"),
    ("/x/.venv/bin/python -m ipykernel_launcher -f /tmp/k.json", "/tmp/pytest-of-root/pytest-3/popen-gw0/t0/student",
     "other kernels"),
    ("/x/python -B -c from multiprocessing.forkserver import main; main(3, 5, ['torch'])", "/tmp", "forked from a fork"),
    ("/x/python -m labkit.tools.search trial --config {}", "/tmp", "labkit's search commands"),
    ("/usr/lib/chromium/chromium --type=renderer", "/", "Chromium and JupyterLab"),
    ("/x/python -m jupyterlab --ServerApp.root_dir=/tmp/n", "/tmp/n", "Chromium and JupyterLab"),
    ("/x/site-packages/ray/core/src/ray/raylet/raylet --node-ip-address=192.0.2.2", "/", "Ray Tune's"),
    ("ray::ImplicitFunc.train", "/tmp/ray/session_1", "Ray Tune's"),  # (a Ray worker renames itself)
    ("/x/python /x/site-packages/pip/__pip-runner__.py install torch", "/tmp", "pip"),
    ("/usr/lib/gcc/x86_64-linux-gnu/12/cc1plus -quiet", "/tmp", "compilers"),
    ("/x/.venv/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))", "/tmp/ci", "pytest and its workers"),
    ("/x/python -c import labkit", "/tmp/pytest-of-root/pytest-3/popen-gw0/t0", "other processes"),  # (cwd: not pytest)
])
def test_each_process_of_the_suite_is_given_its_kind(cmdline, cwd, kind):
    assert cpumap.kind_of(cmdline, cwd).startswith(kind)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="the map reads Linux's /proc")
def test_the_map_holds_the_cpu_time_of_processes_started_while_it_samples_and_no_other():
    """(Other processes of the suite start meanwhile: only these two are looked at.)"""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(1.0)"
    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])  # started before: not counted
    try:
        with cpumap.CpuMap(every_s=0.1) as cpu_map:
            during = subprocess.Popen([sys.executable, "-c", burn])
            assert during.wait() == 0
    finally:
        before.kill()
        before.wait()
    seen = {int(pid): figures for (pid, _), figures in cpu_map.processes.items()}
    assert before.pid not in seen
    kind, cpu_s = seen[during.pid]
    assert kind == cpumap.kind_of(f"{sys.executable} -c {burn}", os.getcwd()) and 0.5 <= cpu_s <= 2.0, seen[during.pid]


def test_the_maps_lines_give_each_kinds_share_and_the_total_beside_the_machines_busy_time():
    by_kind = {"pytest and its workers (the tests' own code)": {"cpu_s": 600.0, "processes": 3},
               cpumap.OTHER: {"cpu_s": 200.0, "processes": 40}}
    assert cpumap.cpu_map_lines(by_kind, 1000.0) == [
        "where `make test`'s CPU went (800 CPU-s in processes sampled each second, 80% of the machine's 1,000 busy CPU-s):",
        "      600 CPU-s  75%  pytest and its workers (the tests' own code) (3 processes)",
        "      200 CPU-s  25%  other processes (40 processes)"]
    assert cpumap.cpu_map_lines({}, 1000.0) == []
