"""Widget panels offer only what their function accepts: every control at every position passes its checks.

The chapters' panels are rebuilt here without running the chapters: the cells up to the validation
cell run as in `validate_parameters`, then only the cheap statements of the later cells (imports,
definitions, assignments that call nothing but builtins), then the panel cell. Each panel then moves
its checked controls through every combination (`ControlPanel.refusals`); nothing of an experiment runs.
"""

from __future__ import annotations

import ast
import builtins
import linecache
import math
from pathlib import Path

import ipywidgets as W
import pytest

from labkit import validate
from labkit.widgets import ControlPanel, choices, control_panel, positions, refusal, validation_of
from workbook.nbcheck import find_notebooks

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CHAPTERS = [p.stem for p in find_notebooks(NOTEBOOKS)]
CHEAP_CALLS = {n for n in dir(builtins) if not n[0].isupper() and n not in {"exec", "eval", "open", "input",
                                                                              "compile", "__import__", "print"}}
CHEAP_ATTRS = {"running_example", "replace"}  # labkit's running example is an estimate: nothing runs
BATCH, N_LAYER = 16, 4


# -- the checks behind a panel, on functions shaped like the chapters' --------------------------------

def pipeline(ranks=2, micro_batches=4, schedule="1F1B"):
    """Chapter 06b's checks, then work."""
    validate.check_int("ranks", ranks, 2, N_LAYER)
    validate.check_divides("BATCH", BATCH, "micro_batches", micro_batches)
    if schedule == "1F1B" and micro_batches < ranks:
        raise validate.ParameterError(f"1F1B needs micro_batches >= ranks ({ranks}), got {micro_batches}")
    raise AssertionError("the experiment ran: only the checks may")


def sharded(ranks=2, point="DDP"):
    """Chapter 07's checks: a message and an early return."""
    if BATCH % ranks:
        print(f"{ranks} ranks do not divide BATCH = {BATCH}")
        return None
    budget = 0 if point else 1  # work starts here
    raise AssertionError(f"the experiment ran with budget {budget}")


def clamped(micro_batch, batch_size):
    """No checks: a clamp, then work that fails for its own reasons."""
    micro_batch = min(micro_batch, batch_size)
    if micro_batch > 2:
        raise ZeroDivisionError("an error of the run, not a refusal")
    return micro_batch


def test_validation_of_keeps_the_leading_checks_only():
    checks, names = validation_of(pipeline)
    assert names == {"ranks", "micro_batches", "schedule"}
    assert refusal(checks, dict(ranks=2, micro_batches=4, schedule="1F1B")) is None  # the work did not run
    assert "1F1B needs micro_batches >= ranks (4)" in refusal(checks, dict(ranks=4, micro_batches=2, schedule="1F1B"))
    assert "ranks" in refusal(checks, dict(ranks=5, micro_batches=4, schedule="GPipe"))
    checks, names = validation_of(sharded)
    assert names == {"ranks"}
    assert refusal(checks, dict(ranks=3, point="DDP")) == "3 ranks do not divide BATCH = 16"
    assert refusal(checks, dict(ranks=4, point="DDP")) is None
    assert validation_of(clamped) == (None, set())  # a clamp and a run's own error are no refusal
    assert validation_of(lambda n: n) == (None, set())


def test_a_panel_that_offers_a_refused_value_is_not_built():
    with pytest.raises(ValueError, match=r"offers \{'ranks': 3\}, which sharded refuses \(3 ranks do not divide"):
        control_panel(sharded, ranks=(2, 8, 1, 2), point=["DDP"])  # chapter 07's old slider
    with pytest.raises(ValueError, match="which pipeline refuses"):
        control_panel(pipeline, ranks=(2, 4, 1, 2), micro_batches=[1, 2, 4, 8, 16], schedule=["1F1B", "GPipe"])
    old = control_panel(sharded, check=False, ranks=(2, 8, 1, 2), point=["DDP"])
    assert [s["ranks"] for s, _ in old.refusals()] == [3, 5, 6, 7]  # what issue 20 saw offered and refused
    panel = control_panel(sharded, ranks=choices([n for n in range(2, 9) if BATCH % n == 0], 2), point=["DDP", "ZeRO-1"])
    assert panel.refusals() == [] and [positions(w) for w in panel.controls.values()] == [[2, 4, 8], ["DDP", "ZeRO-1"]]
    panel = control_panel(pipeline, ranks=(2, 4, 1, 2), micro_batches=[4, 8, 16], schedule=["1F1B", "GPipe"])
    assert [len(positions(w)) for w in panel.controls.values()] == [3, 3, 2]
    assert panel.refusals() == []
    assert control_panel(clamped, micro_batch=(1, 64, 1, 4), batch_size=(1, 64, 1, 16)).run() is None  # built; a run may fail


def test_a_page_without_live_widgets_shows_what_the_panel_is_not_its_widget_tree():
    """An executed chapter read as a static page (GitHub, a saved copy) shows the panel's text/plain."""
    panel = control_panel(sharded, check=False, ranks=choices([2, 4, 8], 4), point=["DDP", "ZeRO-1"])
    text = panel._repr_mimebundle_()["text/plain"]
    assert text == "[a panel that runs in Jupyter, controls: ranks, point]", text


def test_choices_are_a_slider_over_numbers_and_a_dropdown_otherwise():
    c = control_panel(sharded, check=False, ranks=choices([2, 4, 8], 4), point=["DDP", "ZeRO-1"]).controls
    assert type(c["ranks"]) is W.SelectionSlider and c["ranks"].value == 4 and positions(c["ranks"]) == [2, 4, 8]
    assert type(c["point"]) is W.Dropdown and c["point"].value == "DDP"
    assert positions(W.IntSlider(min=1, max=9, step=4)) == [1, 5, 9]
    assert positions(W.FloatSlider(min=0.0, max=1.0, step=0.25)) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert positions(W.Checkbox()) == [False, True]
    with pytest.raises(ValueError, match="not among"):
        choices([2, 4], 3)


# -- every chapter's panel -----------------------------------------------------------------------------

def _cheap(stmt: ast.stmt) -> bool:
    """An import, a definition, or an assignment that calls only builtins, `math.*` and CHEAP_ATTRS."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
        return True
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
        for node in ast.walk(stmt.value):
            if isinstance(node, ast.Call):
                f = node.func
                if not ((isinstance(f, ast.Name) and f.id in CHEAP_CALLS) or (isinstance(f, ast.Attribute) and (
                        f.attr in CHEAP_ATTRS or isinstance(f.value, ast.Name) and f.value.id == "math"))):
                    return False
        return True
    return False


def _exec(source: str, name: str, namespace: dict, keep=lambda stmt: True, strict: bool = True) -> None:
    """Run the statements of `source` that `keep` accepts; their functions' source stays readable (inspect)."""
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    tree = ast.parse(source)
    for stmt in tree.body:
        if keep(stmt):
            try:
                try:
                    exec(compile(ast.Module(body=[stmt], type_ignores=[]), name, "exec"), namespace)
                except Exception:
                    if not isinstance(stmt, ast.FunctionDef):
                        raise
                    # its defaults need what an experiment computes; the panel passes every argument
                    stmt.args.defaults = [ast.Constant(None) for _ in stmt.args.defaults]
                    stmt.args.kw_defaults = [d and ast.Constant(None) for d in stmt.args.kw_defaults]
                    exec(compile(ast.fix_missing_locations(ast.Module(body=[stmt], type_ignores=[])), name, "exec"),
                         namespace)
            except Exception:
                if strict:
                    raise
                # it needs what an experiment computes: the panel cell will say if it mattered


# What a chapter's experiments compute and its panel reads, as a CPU run computes it (the experiments do not run here)
RUN_STANDINS = {"07_sharded_data_parallel": {"half_point": "FSDP2 ZeRO-3 bf16"}}  # CPU ranks name their 16-bit point so


def chapter_panel(stem: str) -> ControlPanel:
    """Build chapter `stem`'s panel (unchecked) from its cells without running its experiments."""
    import nbformat

    nb = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    first = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", [])) + 1  # validation
    panel_cells = [i for i, c in enumerate(cells) if "control_panel(" in c.source]
    assert len(panel_cells) == 1, f"{stem}: one panel cell expected, found {len(panel_cells)}"
    built = []

    def build(run_fn, title="", **controls):
        built.append(ControlPanel(run_fn, title=title, check=False, **controls))
        return built[-1]

    namespace = {"__name__": "__main__", **RUN_STANDINS.get(stem, {})}
    for i, cell in enumerate(cells[:panel_cells[0] + 1]):
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        everything = i <= first
        _exec(source, f"<{stem} cell {i}>", namespace, (lambda s: True) if everything else _cheap, strict=everything)
        namespace["control_panel"] = build
    _exec(cells[panel_cells[0]].source, f"<{stem} panel>", namespace)  # all of it: a panel cell only builds
    assert built, f"{stem}: its panel cell did not build a panel from the chapter's cheap statements"
    return built[-1]


@pytest.mark.parametrize("stem", CHAPTERS)
def test_every_position_of_every_chapters_panel_is_accepted(stem, monkeypatch):
    monkeypatch.setenv("LABKIT_BATCH", "1")
    monkeypatch.chdir(NOTEBOOKS)
    panel = chapter_panel(stem)
    checks, names = validation_of(panel.run_fn)
    refused = panel.refusals()
    assert refused == [], f"{stem}: the panel offers settings its function refuses, e.g. {refused[:3]}"
    if stem[:2] in ("00", "06", "07", "08"):  # these functions check their arguments first: the test moved them
        assert checks is not None and names, f"{stem}: no leading checks found in {panel.run_fn.__name__}"
    print(stem, {n: len(positions(w)) for n, w in panel.controls.items()}, "checked:", sorted(names))
