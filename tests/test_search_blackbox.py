"""labkit.search.blackbox: a notebook as the trial, its records as the value and the constraint."""

from __future__ import annotations

from pathlib import Path

import nbformat
import optuna
import pytest

from labkit.search.blackbox import notebook_objective
from labkit.search.space import Param

pytestmark = pytest.mark.notebook


def _notebook(path: Path, body: str) -> Path:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("X = 0  # the knob")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_a_notebook_trial_returns_its_record_and_its_feasibility(tmp_path):
    nb = _notebook(tmp_path / "square.ipynb", "import labkit\nlabkit.record('square', X * X)\n"
                                               "labkit.record('small', X <= 2)")
    fn = notebook_objective(nb, [Param("X", "int", 1, 4)], value="square", feasible="small", out_dir=tmp_path / "out")
    study = optuna.create_study()
    for x in (1, 3):
        study.enqueue_trial({"X": x})
    study.optimize(fn, n_trials=2)
    first, second = study.trials
    assert (first.value, second.value) == (1.0, 9.0)
    assert first.constraints == {"small": 0.0} and second.constraints == {"small": 1.0}
    assert second.user_attrs["small"] is False and first.user_attrs["wall_s"] > 0


def test_a_failing_notebook_fails_the_trial_with_its_error(tmp_path):
    nb = _notebook(tmp_path / "boom.ipynb", "raise ValueError('no good')")
    fn = notebook_objective(nb, [Param("X", "int", 1, 4)], value="square", out_dir=tmp_path / "out")
    study = optuna.create_study()
    study.optimize(fn, n_trials=1, catch=(RuntimeError,))
    assert study.trials[0].state == optuna.trial.TrialState.FAIL
    with pytest.raises(RuntimeError, match="no good"):
        fn(optuna.trial.FixedTrial({"X": 2}))


def test_a_chapter_name_means_the_workbooks_chapter(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a folder of student copies would not do: their exercises are unsolved
    fn = notebook_objective("04_activation_offload.ipynb", [Param("MIN_OFFLOAD_BYTES", "int", 1, 2)],
                            value="bytes_offloaded_per_step", out_dir=tmp_path)
    assert fn.notebook == Path(__file__).resolve().parents[1] / "notebooks" / "04_activation_offload.ipynb"
    with pytest.raises(FileNotFoundError, match="nope.ipynb"):
        notebook_objective("nope.ipynb", [], value="v", out_dir=tmp_path)
