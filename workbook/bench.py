"""Time the workbook on this machine: the CPU, each chapter's defaults, the 7B plan and the test suite (`make bench`).

    python -m workbook.bench [--only cpu chapters plan suite] [--out build/bench] [--repeats N]

Prints a header line (`workbook.cpureport.CpuReport.line`: the CPU model, torch's vector level, bf16 flags, the AVX2 dispatch
variables when set, a bf16 matmul's time over fp32's), a line setting its fp32 matmul beside the reference machine's
(`reference_line`), then a table: each chapter's `make run` time (its own run of `workbook.runner` into OUT/run),
`make plan MODEL=llama-7b GPU=a100-80gb GPUS=8` (the whole command) and the pytest time of `make test` (its closing
line). With --repeats N the parts run N times, interleaved (chapters, plan,
suite, then again), and each figure is their median, its range beside it: a shared machine's times vary by a fifth
from run to run. Under the table: how busy the machine's cores were during `make test` (its CPU-seconds against
what its 600 s allow at full use: where the cores are busy throughout, the suite's time is its CPU work over the
cores) and where they went by kind of process (its last round's; `workbook.cpumap`), and the fp32 matmul's time
again after the parts, beside the first. Writes OUT/bench.json. Every timing figure reported with an issue comes with
this header: on an AVX-512/AMX machine, set ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 to dispatch as a 2-core AVX2 machine does (the bf16/fp32 ratio then reads 30-50x); they
do not slow the machine to the reference's speed, which the second line compares.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from workbook.cpumap import CpuMap, cpu_map_lines
from workbook.runner import ROOT

PARTS = ("cpu", "chapters", "plan", "suite")
LIMITS_S = {"chapter": 60, "chapters": 360, "plan": 30, "suite": 600}  # issue 34's targets on the 2-core AVX2 machine
REFERENCE_FP32_MATMUL_S = 5.0e-3  # issue 34's machine (a 2-core AMD EPYC with AVX2 only): one 512x512 fp32 matmul
SAME_SPEED = 1.1  # a machine within this factor of the reference's matmul time is "about its speed"
MAKE_VARS = ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")  # what make hands the commands it runs
PYTEST_LINE = re.compile(r"=+ (?P<counts>.*?) in (?P<s>[\d.]+)s")


def _timed(argv: list, log: Path) -> tuple[float, int, str]:
    """Run `argv` from the repository's root, its output to `log`; return (wall seconds, exit code, output).

    torch.compile's kernels go to a fresh cache in log's folder: every run compiles as a new user's first run does,
    and no kernel built for another vector level is reused (inductor's cache is not keyed by ATEN_CPU_CAPABILITY: a
    kernel cached under the AVX2 variables and run without them crashed the process here, and the reverse gave
    gradients 1e24 off). The command runs as typed in a shell: without the variables `make bench` hands its sub-makes
    (MAKE_VARS; a sub-make prints "Entering directory" lines a test of `make gpu-check`'s one line did not expect).
    """
    cache = log.parent / "inductor-cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in MAKE_VARS}
    t0 = time.perf_counter()
    out = subprocess.run(argv, cwd=ROOT, env={**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)}, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall_s = time.perf_counter() - t0
    log.write_text(out.stdout)
    return wall_s, out.returncode, out.stdout


def bench_chapters(out: Path) -> dict:
    """Run every chapter with its defaults (workbook.runner into out/run); return {chapter: seconds}, and the total."""
    wall_s, code, _ = _timed([sys.executable, "-m", "workbook.runner", "--notebooks", "notebooks", "--out",
                              str(out / "run")], out / "chapters.log")
    entries = json.loads((out / "run" / "results.json").read_text())["notebooks"]
    return {"by_chapter_s": {stem: e.get("wall_s") for stem, e in entries.items()},
            "failed": [stem for stem, e in entries.items() if e.get("status") != "ok"], "total_s": wall_s,
            "exit_code": code}


def bench_plan(out: Path) -> dict:
    """Time `make plan MODEL=llama-7b GPU=a100-80gb GPUS=8` (the whole command, imports included)."""
    argv = [sys.executable, "-m", "labkit.planner", "--model", "llama-7b", "--gpu", "a100-80gb", "--gpus", "8"]
    wall_s, code, text = _timed(argv, out / "plan.log")
    return {"command": " ".join(argv[1:]), "wall_s": wall_s, "exit_code": code,
            "fastest": next((line for line in text.splitlines() if line.startswith("fastest that fits")), None)}


def machine_cpu_s(stat: Path = Path("/proc/stat")) -> float | None:
    """Return the CPU-seconds every core of this machine has been busy since boot (Linux's /proc/stat), else None."""
    try:
        ticks = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:8]]
    except (OSError, ValueError):
        return None  # (no /proc: macOS, Windows)
    # user, nice, system, then irq and softirq; not idle, iowait, nor steal (the 8th: time the hypervisor gave
    # another machine, no work done here)
    return (sum(ticks[:3]) + sum(ticks[5:7])) / os.sysconf("SC_CLK_TCK")


def bench_suite(out: Path) -> dict:
    """Run `make test`; return its pytest time and counts (pytest's closing line), the whole command's time, and the
    CPU-seconds every core of the machine was busy meanwhile (the suite's processes, its engines' daemons, and
    anything else running: on a machine left alone, the suite's CPU work) with the machine's core count, and where
    that CPU time went by kind of process (workbook.cpumap)."""
    busy_before = machine_cpu_s()
    with CpuMap() if busy_before is not None else contextlib.nullcontext() as cpu:  # (no /proc: no map)
        wall_s, code, text = _timed(["make", "test"], out / "suite.log")
    busy_after = machine_cpu_s()
    found = [m for m in PYTEST_LINE.finditer(text)]
    last = found[-1] if found else None
    return {"pytest_s": float(last["s"]) if last else None, "counts": last["counts"] if last else None,
            "wall_s": wall_s, "exit_code": code, "cores": os.cpu_count(),
            "busy_cpu_s": None if busy_before is None or busy_after is None else busy_after - busy_before,
            "cpu_by_kind": None if cpu is None else cpu.by_kind()}


def cpu_line(suite: dict, during: str = "`make test`", limit: bool = True) -> str | None:
    """Return the line that says how busy the machine was during `make test` (or `during`), and with `limit` what the
    suite's limit allows: at full use, LIMITS_S["suite"] x the cores (None where the busy time could not be read)."""
    busy, cores, wall = suite.get("busy_cpu_s"), suite.get("cores"), suite.get("wall_s")
    if busy is None or not cores or not wall:
        return None
    allows = f"; {LIMITS_S['suite']} s of pytest allows {LIMITS_S['suite'] * cores:,} CPU-s at full use" if limit else ""
    return (f"during {during}: the machine's {cores} cores busy {busy:,.0f} CPU-s in {wall:,.0f} s "
            f"({busy / (wall * cores):.0%} of them){allows}")


def combined(part: str, rounds: list) -> dict:
    """Return one part's figures over its repeated rounds: each time the median of the rounds, their values kept in
    a `runs` list beside it (`by_chapter_runs_s` for the chapters); failures and exit codes from every round."""
    if len(rounds) == 1:
        return rounds[0]
    med = lambda xs: statistics.median(xs) if xs and None not in xs else None  # noqa: E731 (None: a round failed)
    out = {**rounds[-1], "exit_code": max(r["exit_code"] for r in rounds)}
    keys = {"chapters": ["total_s"], "plan": ["wall_s"], "suite": ["pytest_s", "wall_s", "busy_cpu_s"]}[part]
    for key in keys:
        out[key], out[key.replace("_s", "_runs_s")] = med([r.get(key) for r in rounds]), [r.get(key) for r in rounds]
    if part == "chapters":
        runs = {stem: [r["by_chapter_s"].get(stem) for r in rounds] for stem in rounds[0]["by_chapter_s"]}
        out["by_chapter_s"], out["by_chapter_runs_s"] = {stem: med(v) for stem, v in runs.items()}, runs
        out["failed"] = sorted({stem for r in rounds for stem in r["failed"]})
    return out


def _seconds(value, runs=None) -> str:
    """Return a time for the table: the median, and the range of the runs when there were several."""
    if value is None:
        return "not run"
    return f"{value:.1f}" + (f" ({min(runs):.1f}–{max(runs):.1f})" if runs and len(runs) > 1 else "")


def table(results: dict) -> str:
    """Return the bench's figures as a markdown table, each against its limit (issue 34's targets)."""
    repeats = results.get("repeats", 1)
    head = "seconds" if repeats == 1 else f"seconds, median of {repeats} (range)"
    rows = [f"| what | {head} | limit on the 2-core AVX2 machine |", "|---|---:|---:|"]
    chapters = results.get("chapters")
    if chapters:
        runs = chapters.get("by_chapter_runs_s", {})
        for stem, s in chapters["by_chapter_s"].items():
            rows.append(f"| chapter {stem} | {_seconds(s, runs.get(stem))} | {LIMITS_S['chapter']} |")
        rows.append(f"| `make run`, all chapters{' (failed: ' + ', '.join(chapters['failed']) + ')' if chapters['failed'] else ''} "
                    f"| {_seconds(chapters['total_s'], chapters.get('total_runs_s'))} | {LIMITS_S['chapters']} |")
    plan = results.get("plan")
    if plan:
        rows.append(f"| `make plan MODEL=llama-7b GPU=a100-80gb GPUS=8` | {_seconds(plan['wall_s'], plan.get('wall_runs_s'))} "
                    f"| {LIMITS_S['plan']} |")
    suite = results.get("suite")
    if suite:
        s = "failed to run" if suite["pytest_s"] is None else _seconds(suite["pytest_s"], suite.get("pytest_runs_s"))
        rows.append(f"| `make test`, pytest ({suite['counts']}) | {s} | {LIMITS_S['suite']} |")
    return "\n".join(rows)


def reference_line(fp32_matmul_s: float) -> str:
    """Return the line that sets this machine's fp32 matmul beside the reference machine's.

    The AVX2 variables make torch pick the kernels an AVX2 machine runs, not run them at its speed: a newer CPU under
    them still runs faster (a Zen 4 EPYC took 2.6-3.6 ms, where issue 34's machine took 5.0 ms).
    """
    speed = REFERENCE_FP32_MATMUL_S / fp32_matmul_s
    if speed >= SAME_SPEED:
        how = f"{speed:.1f}x the reference's speed: times here run shorter than on the reference"
    elif speed <= 1 / SAME_SPEED:
        how = f"{1 / speed:.1f}x slower than the reference: times here run longer than on it"
    else:
        how = "about the reference's speed"
    reference_ms = REFERENCE_FP32_MATMUL_S * 1e3
    return (f"beside the reference (issue 34's 2-core AMD EPYC, AVX2 only: fp32 {reference_ms:.2f} ms): "
            f"this machine's fp32 {fp32_matmul_s * 1e3:.2f} ms, {how}")


def drift_line(before_s: float, after_s: float, during: str = "the bench") -> str:
    """Return the line that says how this machine's speed moved during the bench (or `during`): the fp32 matmul before
    and after.

    A shared machine's speed can move by 2x within a day: figures compare only with a similar line.
    """
    return (f"this machine during {during}: 512x512 fp32 matmul {before_s * 1e3:.2f} ms before, {after_s * 1e3:.2f} ms "
            f"after ({after_s / before_s:.2f}x)")


def main(argv=None) -> int:
    """Measure the parts asked for; print the CPU line and the table; write OUT/bench.json. Exit 1 if a part failed."""
    ap = argparse.ArgumentParser(prog="python -m workbook.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="the parts to measure")
    ap.add_argument("--out", default="build/bench", help="folder for the logs, the chapters' run and bench.json")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of the parts, interleaved: medians (1 to 9)")
    args = ap.parse_args(argv)
    if not 1 <= args.repeats <= 9:
        ap.error(f"--repeats must be a whole number from 1 to 9, got {args.repeats}")
    from workbook.cpureport import cpu_report

    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = cpu_report()
    print(report.line(), flush=True)
    print(reference_line(report.fp32_matmul_s), flush=True)
    results = {"cpu": {**report.__dict__, "bf16_ratio": report.bf16_ratio, "bf16_native": report.bf16_native,
                       "line": report.line()}, "load_average_before": os.getloadavg()[0], "repeats": args.repeats}
    parts = [(part, fn) for part, fn in (("chapters", bench_chapters), ("plan", bench_plan), ("suite", bench_suite))
             if part in args.only]
    rounds = {part: [] for part, _ in parts}
    for k in range(args.repeats):  # interleaved: a slow spell of a shared machine falls on every part alike
        for part, fn in parts:
            print(f"{part} ..." + (f" (round {k + 1} of {args.repeats})" if args.repeats > 1 else ""), flush=True)
            rounds[part].append(fn(out))
    results.update({part: combined(part, r) for part, r in rounds.items()})
    results["fp32_matmul_after_s"] = cpu_report(fresh=True).fp32_matmul_s
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    if "suite" in results and cpu_line(results["suite"]):
        print(cpu_line(results["suite"]))
    if "suite" in results and results["suite"].get("cpu_by_kind"):
        suite = results["suite"]  # (the map is the last round's: beside that round's busy time, not the median)
        print("\n".join(cpu_map_lines(suite["cpu_by_kind"], suite.get("busy_cpu_runs_s", [suite["busy_cpu_s"]])[-1])))
    print(drift_line(report.fp32_matmul_s, results["fp32_matmul_after_s"]))
    failed = [p for p in ("chapters", "plan", "suite") if p in results and results[p]["exit_code"] != 0]
    if failed:
        print(f"failed: {', '.join(failed)} (logs in {out})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
