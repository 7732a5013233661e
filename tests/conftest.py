"""Shared fixtures: run a notebook with papermill and read back what it recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


@pytest.fixture
def execute_notebook(tmp_path):
    """Return a function that runs notebooks/<stem>.ipynb with parameters and returns its results entry."""
    from labkit.runner import run_notebook

    def run(stem: str, timeout_s: float = 300, **parameters) -> dict:
        path = NOTEBOOKS / f"{stem}.ipynb"
        assert path.exists(), path
        entry = run_notebook(path, tmp_path, parameters, timeout_s)
        entry["path"] = tmp_path / entry["executed"]
        return entry

    return run
