"""Shared fixtures: run a notebook with papermill and read back what it recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests on one torch thread: byte counts do not depend on threads, and one
    thread keeps small ops fast when other processes share the cores."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


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
