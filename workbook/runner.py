"""Run the workbook's notebooks in batch and collect their measurements (the engine of `make run`).

    python -m workbook.runner [--notebooks DIR] [--out DIR] [--only PATTERN ...] [-p NAME VALUE ...]

Each numbered notebook is executed with papermill (kernel "python3", LABKIT_BATCH=1, working
directory = the notebooks folder) into OUT/notebooks/. The values each notebook `record()`s are
gathered into OUT/results.json, and OUT/report.html (`workbook.report`) shows them with the
notebook's plots; results.json is rewritten after each notebook, so a later notebook (the closing page)
reads the figures of the earlier ones of the same run. Every kernel loads `workbook.figcheck`: each figure is checked as it is drawn
(titles, axis labels with units, legends clear of data) and the problems go to the entry's
`figure_problems`, by cell.
Exit status: 0 if every notebook ran, 1 if any failed, 2 for bad command-line input.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from labkit import execute
from labkit.results import RESULTS_ENV
from workbook import figcheck
from workbook.nbcheck import NOTEBOOK_GLOB, crowded_sections, find_notebooks

FIGURE_CHECK = "workbook.figcheck"  # the IPython extension every kernel of a run loads
ROOT = Path(__file__).resolve().parents[1]  # the repository: `workbook` is imported from here


def run_notebook(path: str | Path, out_dir: str | Path, parameters: dict, timeout_s: float) -> dict:
    """Execute one notebook into OUT/notebooks/ with the figure check loaded; return its results.json entry."""
    import nbformat

    path = Path(path).resolve()
    out_dir = Path(out_dir)
    executed = out_dir / "notebooks" / path.name
    checks = executed.with_suffix(".figures.jsonl")
    checks.unlink(missing_ok=True)
    env = {figcheck.OUT_ENV: str(checks.resolve()),  # the kernel finds `workbook` from any working directory
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           RESULTS_ENV: str((out_dir / "results.json").resolve())}  # a chapter reads this run's figures, wherever OUT is
    entry = execute.run_notebook(path, executed, parameters, timeout_s, extensions=[FIGURE_CHECK], env=env)
    if executed.exists():
        try:
            nb = nbformat.read(executed, as_version=4)
            entry["figure_problems"] = figcheck.problems_by_cell(nb, figcheck.read_lines(checks))
            entry["crowded_sections"] = crowded_sections(nb)  # sections that printed more than one PASS line
        except Exception as exc:  # an unreadable partial notebook must not hide the run's error
            entry.setdefault("error", f"could not read executed notebook: {execute.error_text(exc)}")
    checks.unlink(missing_ok=True)
    entry["executed"] = executed.relative_to(out_dir).as_posix()
    keys = ("status", "wall_s", "measurements", "figure_problems", "crowded_sections", "error", "executed")
    return {k: entry[k] for k in keys if k in entry}


def write_results(entries: dict[str, dict], out_dir: str | Path, parameters: dict, *, merge: bool = False) -> Path:
    """Write OUT/results.json from the per-notebook entries (merge: keep other notebooks' existing entries)."""
    import torch
    from workbook.cpureport import cpu_report
    from labkit.device import hardware_report

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "results.json"
    notebooks: dict[str, dict] = {}
    if merge and target.exists():
        try:
            notebooks = dict(json.loads(target.read_text(encoding="utf-8")).get("notebooks", {}))
        except (json.JSONDecodeError, AttributeError):
            notebooks = {}
    notebooks.update(entries)
    results = {
        "generated_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware_report(),
        "cpu": cpu_report().line(),
        "torch": torch.__version__,
        "parameters": dict(parameters),
        "notebooks": {stem: notebooks[stem] for stem in sorted(notebooks)},
    }
    target.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return target


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workbook.runner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebooks", default="notebooks", help="folder of numbered notebooks (default: notebooks)")
    parser.add_argument("--out", default="build", help="output folder (default: build)")
    parser.add_argument("--only", action="append", default=[], metavar="PATTERN",
                        help="run only notebooks whose file name contains PATTERN (repeatable); merges into results.json")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="papermill parameter for every notebook (repeatable); VALUE is a Python literal or a string")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per-cell timeout in seconds (default: 600)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the selected notebooks, write results.json and report.html, and return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    notebooks_dir = Path(args.notebooks)
    if not notebooks_dir.is_dir():
        parser.error(f"--notebooks {args.notebooks!r}: no such folder")
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s must be positive, got {args.timeout_s}")
    for name, _ in args.parameter:
        if not name.isidentifier():
            parser.error(f"-p: parameter name must be a Python identifier, got {name!r}")
    paths = find_notebooks(notebooks_dir, args.only)
    if not paths:
        if args.only:
            parser.error(f"--only {args.only!r} matched none of the {NOTEBOOK_GLOB} notebooks in --notebooks {args.notebooks!r}")
        parser.error(f"--notebooks {args.notebooks!r} holds no notebook matching {NOTEBOOK_GLOB}")
    parameters = {name: _parse_value(value) for name, value in args.parameter}
    out_dir = Path(args.out)

    from workbook.cpureport import cpu_report

    print(cpu_report().line(), flush=True)  # every timing comes with the machine it ran on
    entries: dict[str, dict] = {}
    for i, path in enumerate(paths, 1):
        print(f"[{i}/{len(paths)}] {path.stem} ... ", end="", flush=True)
        entry = run_notebook(path, out_dir, parameters, args.timeout_s)
        entries[path.stem] = entry
        print(f"{entry['status']} {entry['wall_s']:.1f} s", flush=True)
        if entry["status"] != "ok":
            print(f"    {entry.get('error', '').splitlines()[0] if entry.get('error') else ''}", flush=True)
        # after each notebook: the closing page (10), run last, reads this run's figures of 00-08 from it
        results_path = write_results(entries, out_dir, parameters, merge=bool(args.only))
    from workbook.report import write_report

    report_path = write_report(json.loads(results_path.read_text(encoding="utf-8")), out_dir)
    failed = [stem for stem, e in entries.items() if e["status"] != "ok"]
    print(f"wrote {results_path} and {report_path}; {len(entries) - len(failed)} ok, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
