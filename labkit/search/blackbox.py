"""A black-box objective (notebook 08): each trial runs a chapter notebook with papermill and returns one of its
records."""

from __future__ import annotations

from pathlib import Path

from labkit.results import checkout_root
from labkit.search.space import Param, suggest


def notebook_objective(notebook: str | Path, space: list[Param], value: str, out_dir: str | Path,
                       feasible: str | None = None, fixed: dict | None = None, timeout_s: float = 300):
    """Return an Optuna objective that runs `notebook` with the trial's parameters and returns its record `value`.

    A relative name is a workbook chapter where one exists; `feasible` names a boolean record (False: infeasible).
    """
    from labkit.execute import run_notebook  # the same papermill run as `make run`'s

    notebook = Path(notebook)
    root = checkout_root()  # None where labkit is installed without the workbook
    workbook = root / "notebooks" / notebook if root else notebook
    if not notebook.is_absolute() and workbook.exists():
        notebook = workbook  # a chapter's name means the workbook's own chapter, wherever this kernel runs
    if not notebook.exists():
        raise FileNotFoundError(f"notebook {notebook} does not exist")
    fixed = dict(fixed or {})

    def objective(trial):
        params = suggest(trial, space)
        executed = Path(out_dir) / f"trial-{trial.number}" / notebook.name
        entry = run_notebook(notebook, executed, {**fixed, **params}, timeout_s)
        trial.set_user_attr("wall_s", entry["wall_s"])
        if entry["status"] != "ok":
            raise RuntimeError(f"{notebook.name} failed: {entry.get('error', '')}")
        records = entry["measurements"]
        missing = [k for k in (value, feasible) if k is not None and k not in records]
        if missing:
            raise KeyError(f"{notebook.name} recorded no {missing}; it recorded {sorted(records)}")
        if feasible is not None:
            trial.set_user_attr(feasible, bool(records[feasible]))
            trial.set_constraint(feasible, 0.0 if records[feasible] else 1.0)
        return float(records[value])

    objective.notebook = notebook  # the notebook it runs
    return objective
