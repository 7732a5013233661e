"""Student copies (nbgrader) build for every chapter, hide every solution, and autograde: the teacher's
notebook to full marks, a blank copy to zero, a half-solved copy to exactly what it solved. That a
student copy runs with only the exercises' checks failing is checked by every whole-chapter test
(conftest's `execute_notebook` runs the student copy), and that the teacher's solutions pass their checks
by nbval: the autograder is run on a two-exercise chapter written here, built and graded as a chapter is,
so that no chapter runs more than twice per `make test`."""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pytest

from workbook import classroom
from workbook.nbcheck import find_notebooks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = [p.stem for p in find_notebooks(NOTEBOOKS)]
GRADED = "01_two_exercises"  # a chapter of two exercises in the chapters' nbgrader form, written below and autograded three times

pytestmark = pytest.mark.notebook


@pytest.fixture(scope="module")
def course(student_copies):
    """Every chapter's student copy, built once per test run (conftest's `student_copies`, which the
    whole-chapter tests run); return (course folder, student copies folder)."""
    return student_copies.parent / "course", student_copies


def _solution_lines(nb: dict) -> list[str]:
    """Return the teacher's solution lines (between the delimiters) found nowhere else in the notebook."""
    pattern = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)
    sources = ["".join(cell["source"]) for cell in nb["cells"]]
    elsewhere = "\n".join(pattern.sub("", src) for src in sources)
    lines = []
    for src in sources:
        for block in pattern.findall(src):
            lines += [ln.strip() for ln in block.splitlines()
                      if len(ln.strip()) > 12 and not ln.strip().startswith("#") and ln.strip() not in elsewhere]
    return lines


def test_every_exercise_carries_nbgrader_metadata():
    for stem in CHAPTERS:
        nb = json.loads((NOTEBOOKS / f"{stem}.ipynb").read_text())
        cells = classroom.exercise_cells(nb)
        solutions = [c for c in nb["cells"] if "### BEGIN SOLUTION" in "".join(c["source"])]
        assert solutions and all(c["metadata"]["nbgrader"]["solution"] for c in solutions), stem
        checks = [c for c in cells.values() if c["metadata"]["nbgrader"]["grade"]]
        assert len(checks) == len(solutions), stem
        assert all(c["metadata"]["nbgrader"]["locked"] and c["metadata"]["nbgrader"]["points"] > 0 for c in checks)


def test_student_copies_build_for_every_chapter_without_solutions(course):
    _, student = course
    assert sorted(p.stem for p in student.glob("*.ipynb")) == CHAPTERS
    for stem in CHAPTERS:
        teacher = json.loads((NOTEBOOKS / f"{stem}.ipynb").read_text())
        text = (student / f"{stem}.ipynb").read_text()
        copy = json.loads(text)
        code = "\n".join("".join(c["source"]) for c in copy["cells"])
        assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text, stem
        hidden = _solution_lines(teacher)
        assert hidden, stem
        leaked = [ln for ln in hidden if ln in code]
        assert not leaked, (stem, leaked)
        assert text.count("YOUR CODE HERE") == len(re.findall("### BEGIN SOLUTION", json.dumps(teacher)))
        assert all(not c.get("outputs") for c in copy["cells"] if c["cell_type"] == "code"), stem
        checks = [c for c in classroom.exercise_cells(copy).values() if c["metadata"]["nbgrader"]["grade"]]
        assert checks and all("raises-exception" in c["metadata"]["tags"] for c in checks), stem
        teacher_cells = [c for c in teacher["cells"] if classroom.TEACHER_ONLY not in c["metadata"].get("tags", [])]
        assert len(teacher_cells) < len(teacher["cells"]), f"{stem}: no teacher-only cell (where the solutions are)"
        assert len(copy["cells"]) == len(teacher_cells), stem
        assert "make lab STUDENT=1" not in text, stem  # the teacher's pointer to the student copies is not in them


def _graded_chapter(notebooks: Path) -> None:
    """Write GRADED: a setup cell, a teacher-only note and two exercises (solution, locked check), as the chapters do."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell

    def graded(grade_id: str, source: str, points: int = 0):
        meta = {"grade": bool(points), "grade_id": grade_id, "locked": bool(points), "schema_version": 3,
                "solution": not points, "task": False, **({"points": points} if points else {})}
        return new_code_cell(source, metadata={"nbgrader": meta})

    cells = [new_markdown_cell("# 01 · Two exercises"), new_code_cell("import math"),
             new_markdown_cell("Each exercise's solution sits right below it.",
                               metadata={"tags": [classroom.TEACHER_ONLY]})]
    for n, (name, body, check) in enumerate([("double", "return 2 * x", "double(3) == 6"),
                                             ("root", "return math.sqrt(x)", "root(9) == 3")], 1):
        cells += [new_markdown_cell(f"## Exercise {n}"),
                  graded(f"exercise-{n}", f"def {name}(x):\n    ### BEGIN SOLUTION\n    {body}\n    ### END SOLUTION"),
                  graded(f"exercise-{n}-check", f"assert {check}, 'FAIL: {name}'\nprint('PASS: {name}')", points=1)]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    notebooks.mkdir(parents=True)
    nbformat.write(nb, notebooks / f"{GRADED}.ipynb")


@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")  # nbgrader's own gradebook code
def test_autograding_gives_what_was_earned(tmp_path, monkeypatch):
    notebooks, course_dir, student = tmp_path / "notebooks", tmp_path / "course", tmp_path / "student"
    _graded_chapter(notebooks)
    classroom.build_student_copies(notebooks, course_dir, student)
    teacher = json.loads((notebooks / f"{GRADED}.ipynb").read_text())
    blank = json.loads((student / f"{GRADED}.ipynb").read_text())
    half = json.loads(json.dumps(blank))  # exercise 1 solved as the teacher did, exercise 2 left blank
    answer = {c["metadata"]["nbgrader"]["grade_id"]: c["source"] for c in teacher["cells"] if "nbgrader" in c["metadata"]}
    for cell in half["cells"]:
        if cell["metadata"].get("nbgrader", {}).get("grade_id") == "exercise-1":
            cell["source"] = answer["exercise-1"]
    submissions = tmp_path / "submissions"
    for who, nb in (("teacher", teacher), ("blank", blank)):
        (submissions / who).mkdir(parents=True)
        (submissions / who / f"{GRADED}.ipynb").write_text(json.dumps(nb))
    (submissions / "half" / GRADED).mkdir(parents=True)  # nbgrader collect's layout works too
    (submissions / "half" / GRADED / f"{GRADED}.ipynb").write_text(json.dumps(half))
    monkeypatch.chdir(tmp_path)
    assert classroom.main(["--notebooks", str(notebooks), "--course", str(course_dir), "grade", "--submissions", str(submissions),
                           "--out", str(tmp_path / "grades"), "--student-copies", str(student)]) == 0
    with open(tmp_path / "grades" / "scores.csv") as f:
        rows = list(csv.DictReader(f))
    score = {(r["student"], r["exercise"]): (float(r["score"]), float(r["max_score"])) for r in rows}
    ids = ["exercise-1-check", "exercise-2-check"]
    assert {k for k in score} == {(s, e) for s in ("teacher", "blank", "half") for e in ids}
    assert all(score[("teacher", e)][0] == score[("teacher", e)][1] > 0 for e in ids)  # full marks
    assert all(score[("blank", e)][0] == 0 for e in ids)  # nothing earned
    assert score[("half", "exercise-1-check")][0] == score[("half", "exercise-1-check")][1]
    assert score[("half", "exercise-2-check")][0] == 0  # no marks it did not earn
    page = (tmp_path / "grades" / "scores.html").read_text()
    assert "<table>" in page and all(s in page for s in ("teacher", "blank", "half"))


def test_grading_refuses_a_chapter_that_does_not_exist(course, tmp_path):
    course_dir, student = course
    (tmp_path / "subs" / "ann").mkdir(parents=True)
    (tmp_path / "subs" / "ann" / "99_nothing.ipynb").write_text("{}")
    with pytest.raises(SystemExit, match="99_nothing"):
        classroom.grade(tmp_path / "subs", NOTEBOOKS, course_dir, tmp_path / "grades", student)
