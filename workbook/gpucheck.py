"""`make gpu-check`: labkit's GPU checks (labkit.tools.gpucheck) and two rows that need this repository: the other
tests marked `cuda`, and the chapters executed with DEVICE="cuda".

    make gpu-check                                            # every row, GPT-2 small
    make gpu-check GPU_CHECK_ARGS="--chapters 02 07"          # the notebooks row runs these chapters only
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

from labkit.tools import gpucheck
from labkit.tools.gpucheck import Row, Setup

ROOT = Path(__file__).resolve().parents[1]
REPO_CHECKS = ("tests", "notebooks")  # after labkit's own rows
ROWS_TEST = "tests/test_cuda.py::test_gpu_check_rows_hold"  # labkit's rows: run above, not again


def _rehearsal(check: str, expected: str, setup: Setup) -> Row | None:
    """Return the row of a check that needs CUDA on a CPU rehearsal (not run, said so), else None."""
    return Row(check, "not run", expected, None, "rehearsal on cpu") if setup.device.type != "cuda" else None


def check_tests(setup: Setup, out: Path) -> Row:
    """Run the tests marked `cuda` but labkit's own rows."""
    if row := _rehearsal("tests", "pytest -m cuda passes", setup):
        return row
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                           "--deselect", ROWS_TEST], cwd=ROOT, capture_output=True, text=True)
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    return Row("tests", last, "pytest -m cuda passes", proc.returncode == 0,
               "" if proc.returncode == 0 else proc.stdout[-2000:], {"returncode": proc.returncode})


def chapter_notebooks(chapters=None) -> list[Path]:
    """Return the chapters' notebooks in order: all, or those whose number is in `chapters` ("04", "06b")."""
    found = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    if not chapters:
        return found
    numbers = {nb.name.split("_")[0]: nb for nb in found}
    unknown = sorted(set(chapters) - set(numbers))
    if unknown:
        raise ValueError(f"--chapters: no chapter {', '.join(unknown)}; choose among {', '.join(numbers)}")
    return [nb for number, nb in numbers.items() if number in chapters]


def check_notebooks(setup: Setup, out: Path, chapters=None) -> Row:
    """Execute the chapters' notebooks with DEVICE="cuda" (the multi-rank chapters: "auto" with fewer GPUs than ranks).

    `chapters`: the chapter numbers to run ("04", "06b"); None runs every chapter."""
    if row := _rehearsal("notebooks", "every notebook ok with DEVICE='cuda'", setup):
        return row
    import papermill

    gpus = torch.cuda.device_count()
    status, seconds, own_default = {}, {}, []
    for nb in chapter_notebooks(chapters):
        multi_rank = nb.name[:2] in ("06", "07")
        device = "cuda" if not multi_rank or gpus >= 2 else "auto"
        declared = papermill.inspect_notebook(str(nb)).get("DEVICE")
        if declared is None or "cuda" not in declared["help"]:  # no DEVICE, or a CPU-only one (09's check)
            own_default.append(nb.stem[:2])
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "workbook.runner", "--notebooks", str(ROOT / "notebooks"),
                               "--out", str(out / "gpu-check-notebooks"), "--only", nb.name,
                               *(() if nb.stem[:2] in own_default else ("-p", "DEVICE", device))],
                              cwd=ROOT, capture_output=True, text=True)
        seconds[nb.stem] = time.perf_counter() - t0
        status[nb.stem] = "ok" if proc.returncode == 0 else f"failed: {(proc.stdout + proc.stderr)[-600:]}"
        print(f"  notebooks: {nb.stem} {status[nb.stem][:6].rstrip(':')} in {seconds[nb.stem]:.0f} s", flush=True)
    failed = [k for k, v in status.items() if v != "ok"]
    return Row("notebooks", f"{len(status) - len(failed)}/{len(status)} ok" + (f"; failed {failed}" if failed else ""),
               "every notebook ok with DEVICE='cuda'", not failed and bool(status),
               "; ".join(([] if gpus >= 2 else ["06 and 07 need one GPU per rank: with one GPU they ran with "
                                               "DEVICE='auto' (cpu)"])
                         + ([f"{', '.join(own_default)} ran with their own DEVICE (no 'cuda' among its choices)"]
                            if own_default else [])),
               {"status": status, "seconds": seconds, "gpus": gpus, "own_device": own_default})


def main(argv=None) -> int:
    """Run labkit's GPU checks and this repository's two rows; return the exit status."""
    p = gpucheck.parser("python -m workbook.gpucheck", REPO_CHECKS)
    p.add_argument("--chapters", nargs="+", default=None, metavar="NN",
                   help="the notebooks row runs only these chapters, e.g. 04 08 (default: every chapter)")
    args = p.parse_args(argv)
    try:
        chapter_notebooks(args.chapters)  # an unknown chapter: said before any work, CUDA or not
    except ValueError as e:
        p.error(str(e))
    return gpucheck.run(args, {"tests": check_tests,
                               "notebooks": lambda setup, out: check_notebooks(setup, out, args.chapters)})


if __name__ == "__main__":
    raise SystemExit(main())
