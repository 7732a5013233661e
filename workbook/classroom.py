"""Student copies and autograding with nbgrader: `python -m workbook.classroom student|grade`.

Each chapter is one nbgrader assignment of a course directory under build/classroom/ (nbgrader's
own layout: source/, release/, submitted/, autograded/, gradebook.db). The teacher notebooks carry
nbgrader's cell metadata: an exercise's solution cell (`### BEGIN SOLUTION` ... `### END SOLUTION`)
and the graded check cell after it, locked, with its points.

    python -m workbook.classroom student                  # build/student/<chapter>.ipynb
    python -m workbook.classroom grade --submissions DIR  # build/grades/scores.csv and scores.html

DIR holds one folder per student with that student's chapters, as `DIR/<student>/<chapter>.ipynb`
or as nbgrader's `collect` leaves them, `DIR/<student>/<chapter>/<chapter>.ipynb`.
"""

from __future__ import annotations

import argparse
import csv
import html
import json
import os
import shutil
import sys
from pathlib import Path

from labkit import execute
from workbook.nbcheck import find_notebooks

ROOT = Path(__file__).resolve().parents[1]
CODE_STUB = "# YOUR CODE HERE\npass"  # valid in a function body too; the check cell below then fails
TEACHER_ONLY = "teacher-only"  # a cell with this tag is left out of the student copy (e.g. "the solution is below")
CELL_TIMEOUT_S = 900  # nbgrader's default, 30 s a cell, is shorter than the chapters' longest cells


def exercise_cells(nb: dict) -> dict[str, dict]:
    """Return the nbgrader cells of a notebook by grade_id."""
    return {c["metadata"]["nbgrader"]["grade_id"]: c for c in nb["cells"] if "nbgrader" in c.get("metadata", {})}


def _api(course: Path, log_level: str = "WARN"):
    from nbgrader.apps import NbGraderAPI
    from traitlets.config import Config

    bindir = str(Path(sys.executable).parent)  # nbgrader runs the `alembic` command of its environment by name
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    c = Config()
    course = course.resolve()
    c.CourseDirectory.root = str(course)
    c.CourseDirectory.db_url = f"sqlite:///{course / 'gradebook.db'}"
    c.ClearSolutions.code_stub = {"python": CODE_STUB}
    c.Execute.timeout = CELL_TIMEOUT_S
    if os.name == "posix":  # kernels over Unix sockets, as papermill's (labkit.execute.over_ipc says why)
        c.KernelManager.transport = "ipc"
        c.KernelManager.ip = execute.socket_prefix()
    c.Application.log_level = log_level
    return NbGraderAPI(config=c)


def _check(result: dict, what: str) -> None:
    if not result.get("success"):
        raise RuntimeError(f"nbgrader {what} failed:\n{result.get('error') or result.get('log')}")


def build_student_copies(notebooks: Path, course: Path, out: Path) -> list[Path]:
    """Generate each chapter's student copy with nbgrader; write them to `out`; return their paths."""
    course.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    api = _api(course)
    written = []
    for nb_path in find_notebooks(notebooks):
        name = nb_path.stem
        assert exercise_cells(json.loads(nb_path.read_text())), f"{nb_path.name} has no nbgrader cells"
        src = course / "source" / name
        src.mkdir(parents=True, exist_ok=True)
        shutil.copy2(nb_path, src / nb_path.name)
        _check(api.generate_assignment(name, force=True, create=True), f"generate_assignment {name}")
        released = course / "release" / name / nb_path.name
        nb = json.loads(released.read_text())
        nb["cells"] = [c for c in nb["cells"] if TEACHER_ONLY not in c["metadata"].get("tags", [])]
        for cell in exercise_cells(nb).values():  # papermill and JupyterLab's Run All go on past a failed check
            if cell["metadata"]["nbgrader"].get("grade"):
                tags = cell["metadata"].setdefault("tags", [])
                if "raises-exception" not in tags:
                    tags.append("raises-exception")
        (out / nb_path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        written.append(out / nb_path.name)
    return written


def _submissions(folder: Path) -> dict[tuple[str, str], Path]:
    """Return {(student, chapter): notebook} found in a submissions folder (either layout)."""
    found = {}
    for student in sorted(p for p in folder.iterdir() if p.is_dir()):
        for nb in sorted(student.glob("*.ipynb")) + sorted(student.glob("*/*.ipynb")):
            found[(student.name, nb.stem)] = nb
    return found


def grade(submissions: Path, notebooks: Path, course: Path, out: Path, student_dir: Path) -> list[dict]:
    """Autograde every submitted chapter with nbgrader; write scores.csv and scores.html to `out`; return the rows."""
    known = {p.stem for p in find_notebooks(notebooks)}
    found = _submissions(submissions)
    unknown = sorted({ch for _, ch in found} - known)
    if unknown:
        raise SystemExit(f"submissions name chapters that do not exist: {unknown} (expected names like {min(known)})")
    if not found:
        raise SystemExit(f"no submissions under {submissions}: expected <student>/<chapter>.ipynb")
    if not all((course / "release" / ch).is_dir() for _, ch in found):
        build_student_copies(notebooks, course, student_dir)
    api = _api(course)
    rows = []
    for (student, chapter), nb in found.items():
        dest = course / "submitted" / student / chapter
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(nb, dest / f"{chapter}.ipynb")
        work = course / "work" / student  # the student's own build/ (notebook 08's studies)
        work.mkdir(parents=True, exist_ok=True)
        env = {"LABKIT_BATCH": "1", "LABKIT_BUILD_DIR": str(work)}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the grading kernel inherits them
        try:
            _check(api.autograde(chapter, student, force=True, create=True), f"autograde {student}/{chapter}")
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        rows += _scores(course, chapter, student)
    out.mkdir(parents=True, exist_ok=True)
    _write_tables(rows, out)
    return rows


def _scores(course: Path, chapter: str, student: str) -> list[dict]:
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course.resolve() / 'gradebook.db'}") as gb:
        nb = gb.find_submission_notebook(chapter, chapter, student)
        return [{"student": student, "chapter": chapter, "exercise": g.name, "score": float(g.score),
                 "max_score": float(g.max_score)} for g in sorted(nb.grades, key=lambda g: g.name)]


def _write_tables(rows: list[dict], out: Path) -> None:
    with open(out / "scores.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["student", "chapter", "exercise", "score", "max_score"])
        w.writeheader()
        w.writerows(rows)
    columns = sorted({(r["chapter"], r["exercise"]) for r in rows})
    students = sorted({r["student"] for r in rows})
    cell = {(r["student"], r["chapter"], r["exercise"]): r for r in rows}
    head = "".join(f"<th>{html.escape(ch[:2])} {html.escape(ex)}</th>" for ch, ex in columns)
    body = []
    for s in students:
        got = [cell.get((s, ch, ex)) for ch, ex in columns]
        total = sum(r["score"] for r in got if r)
        possible = sum(r["max_score"] for r in got if r)
        tds = "".join(f"<td>{r['score']:g} / {r['max_score']:g}</td>" if r else "<td>—</td>" for r in got)
        body.append(f"<tr><td>{html.escape(s)}</td>{tds}<td><b>{total:g} / {possible:g}</b></td></tr>")
    (out / "scores.html").write_text(
        "<!doctype html><meta charset='utf-8'><title>Scores</title>"
        "<style>td,th{border:1px solid #ccc;padding:4px 8px;text-align:center}table{border-collapse:collapse}</style>"
        f"<table><tr><th>student</th>{head}<th>total</th></tr>{''.join(body)}</table>\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbook.classroom", description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks", help="the teacher notebooks")
    parser.add_argument("--course", type=Path, default=ROOT / "build" / "classroom", help="nbgrader's course folder")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("student", help="write a student copy of every chapter")
    s.add_argument("--out", type=Path, default=ROOT / "build" / "student")
    g = sub.add_parser("grade", help="autograde submitted chapters; write a score table")
    g.add_argument("--submissions", type=Path, required=True, help="<student>/<chapter>.ipynb under this folder")
    g.add_argument("--out", type=Path, default=ROOT / "build" / "grades")
    g.add_argument("--student-copies", type=Path, default=ROOT / "build" / "student")
    args = parser.parse_args(argv)
    if args.command == "student":
        for p in build_student_copies(args.notebooks, args.course, args.out):
            print(p)
        return 0
    if not args.submissions.is_dir():
        parser.error(f"--submissions {args.submissions} is not a folder")
    rows = grade(args.submissions, args.notebooks, args.course, args.out, args.student_copies)
    by_student = {}
    for r in rows:
        got, possible = by_student.get(r["student"], (0.0, 0.0))
        by_student[r["student"]] = (got + r["score"], possible + r["max_score"])
    for student, (got, possible) in by_student.items():
        print(f"{student}: {got:g} / {possible:g}")
    print(f"wrote {args.out / 'scores.csv'} and {args.out / 'scores.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
