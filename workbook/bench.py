"""Time the workbook on this machine: the CPU, each chapter's defaults, the 7B plan and the test suite (`make bench`).

    python -m workbook.bench [--only cpu chapters plan suite] [--out build/bench]

Prints a header line (`labkit.cpu.CpuReport.line`: the CPU model, torch's vector level, bf16 flags, the AVX2 dispatch
variables when set, a bf16 matmul's time over fp32's), then a table: each chapter's `make run` time (its own run of
`workbook.runner` into OUT/run), `make plan MODEL=llama-7b GPU=a100-80gb GPUS=8` (the whole command) and the pytest
time of `make test` (its closing line). Writes OUT/bench.json. Every timing figure reported with an issue comes with
this header: on an AVX-512/AMX machine, set ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 to dispatch as a 2-core AVX2 machine does (the bf16/fp32 ratio then reads 30-50x).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from workbook.runner import ROOT

PARTS = ("cpu", "chapters", "plan", "suite")
LIMITS_S = {"chapter": 60, "chapters": 360, "plan": 30, "suite": 600}  # issue 34's targets on the 2-core AVX2 machine
PYTEST_LINE = re.compile(r"=+ (?P<counts>.*?) in (?P<s>[\d.]+)s")


def _timed(argv: list, log: Path) -> tuple[float, int, str]:
    """Run `argv` from the repository's root, its output to `log`; return (wall seconds, exit code, output).

    torch.compile's kernels go to a fresh cache in log's folder: every run compiles as a new user's first run does,
    and no kernel built for another vector level is reused (inductor's cache is not keyed by ATEN_CPU_CAPABILITY: a
    kernel cached under the AVX2 variables and run without them crashed the process here, and the reverse gave
    gradients 1e24 off).
    """
    cache = log.parent / "inductor-cache"
    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.perf_counter()
    out = subprocess.run(argv, cwd=ROOT, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}, stdin=subprocess.DEVNULL,
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
    argv = [sys.executable, "-m", "labkit.plan", "--model", "llama-7b", "--gpu", "a100-80gb", "--gpus", "8"]
    wall_s, code, text = _timed(argv, out / "plan.log")
    return {"command": " ".join(argv[1:]), "wall_s": wall_s, "exit_code": code,
            "fastest": next((line for line in text.splitlines() if line.startswith("fastest that fits")), None)}


def bench_suite(out: Path) -> dict:
    """Run `make test`; return its pytest time and counts (pytest's closing line) and the whole command's time."""
    wall_s, code, text = _timed(["make", "test"], out / "suite.log")
    found = [m for m in PYTEST_LINE.finditer(text)]
    last = found[-1] if found else None
    return {"pytest_s": float(last["s"]) if last else None, "counts": last["counts"] if last else None,
            "wall_s": wall_s, "exit_code": code}


def table(results: dict) -> str:
    """Return the bench's figures as a markdown table, each against its limit (issue 34's targets)."""
    rows = ["| what | seconds | limit on the 2-core AVX2 machine |", "|---|---:|---:|"]
    chapters = results.get("chapters")
    if chapters:
        for stem, s in chapters["by_chapter_s"].items():
            rows.append(f"| chapter {stem} | {s:.1f} | {LIMITS_S['chapter']} |" if s is not None else
                        f"| chapter {stem} | not run | {LIMITS_S['chapter']} |")
        rows.append(f"| `make run`, all chapters{' (failed: ' + ', '.join(chapters['failed']) + ')' if chapters['failed'] else ''} "
                    f"| {chapters['total_s']:.1f} | {LIMITS_S['chapters']} |")
    plan = results.get("plan")
    if plan:
        rows.append(f"| `make plan MODEL=llama-7b GPU=a100-80gb GPUS=8` | {plan['wall_s']:.1f} | {LIMITS_S['plan']} |")
    suite = results.get("suite")
    if suite:
        s = "failed to run" if suite["pytest_s"] is None else f"{suite['pytest_s']:.1f}"
        rows.append(f"| `make test`, pytest ({suite['counts']}) | {s} | {LIMITS_S['suite']} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    """Measure the parts asked for; print the CPU line and the table; write OUT/bench.json. Exit 1 if a part failed."""
    ap = argparse.ArgumentParser(prog="python -m workbook.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="the parts to measure")
    ap.add_argument("--out", default="build/bench", help="folder for the logs, the chapters' run and bench.json")
    args = ap.parse_args(argv)
    from labkit.cpu import cpu_report

    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = cpu_report()
    print(report.line(), flush=True)
    results = {"cpu": {**report.__dict__, "bf16_ratio": report.bf16_ratio, "bf16_native": report.bf16_native,
                       "line": report.line()}, "load_average_before": os.getloadavg()[0]}
    for part, fn in (("chapters", bench_chapters), ("plan", bench_plan), ("suite", bench_suite)):
        if part in args.only:
            print(f"{part} ...", flush=True)
            results[part] = fn(out)
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    failed = [p for p in ("chapters", "plan", "suite") if p in results and results[p]["exit_code"] != 0]
    if failed:
        print(f"failed: {', '.join(failed)} (logs in {out})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
