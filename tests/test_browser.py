"""JupyterLab and Optuna's dashboard in a real browser: the lab `make lab` opens, the student lab, the dashboard.

JupyterLab starts on loopback with a token, by the command `make lab` runs (workbook.lab), on a
copy of the notebooks; headless Chromium is Debian's (`/usr/bin/chromium`, or $LABKIT_CHROMIUM),
driven by Playwright, which downloads nothing here (tests/labdriver.py). Every chapter's Run All and
widget panel run in the browser too, in its whole-chapter test (conftest's `execute_notebook`), so
that no test here runs a chapter again; the last test checks that a run there which fails leaves the
next its own kernel and environment. Screenshots land in build/browser/. The servers started here end
with their module, on failure too; the browser is the test process's one (conftest's `lab_session`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import nbformat
import pytest

import labdriver
from workbook import lab

ROOT = Path(__file__).resolve().parents[1]
SHOTS = labdriver.SHOTS
STUDENT_CHAPTER = "01_gradient_accumulation.ipynb"  # the chapter opened in the student lab
TEACHER_COMMANDS = ["nbgrader:open-create-assignment", "nbgrader:open-formgrader", "nbgrader:open-course-list",
                    "nbgrader:open-assignment-list"]  # what nbgrader's teacher plugins add to JupyterLab

pytestmark = [pytest.mark.notebook,
              pytest.mark.skipif(not labdriver.have_chromium(), reason=f"no Chromium at {labdriver.CHROMIUM} "
                                 "(Debian: apt-get install chromium; .ci/run installs it)")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Start JupyterLab as `make lab` does, on a copy of the notebooks; yield (url, token); stop it."""
    base = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", base / "notebooks", ignore=shutil.ignore_patterns("*_ranks.py", "*.pickle"))
    with labdriver.serve(base, base / "notebooks", dict(os.environ)) as served:
        yield served


@pytest.fixture(scope="module")
def student_server(tmp_path_factory):
    """Start the student lab (`make lab STUDENT=1`) on the student copy of STUDENT_CHAPTER; yield (url, token)."""
    from workbook import classroom

    base = tmp_path_factory.mktemp("student-lab")
    (base / "teacher").mkdir()
    shutil.copy2(ROOT / "notebooks" / STUDENT_CHAPTER, base / "teacher" / STUDENT_CHAPTER)
    classroom.build_student_copies(base / "teacher", base / "course", base / "student")
    with labdriver.serve(base, base / "student", lab.student_env(base / "student-config")) as served:
        yield served


@pytest.fixture
def browser(lab_session):
    """The test process's Chromium (conftest's `lab_session`), driven by Playwright for this test."""
    with lab_session.chromium() as b:
        yield b


def test_jupyterlab_opens_on_the_first_chapter_without_a_prompt(server, browser):
    url, token = server
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    try:
        page.goto(f"{url}/?token={token}", timeout=120_000)
        try:
            page.wait_for_function(f"() => window.jupyterapp?.shell.currentWidget?.title.label === '{lab.FIRST_CHAPTER}'",
                                   timeout=60_000)
        except Exception:
            title = page.evaluate("() => window.jupyterapp?.shell.currentWidget?.title.label")
            raise AssertionError(f"JupyterLab opened {title!r}, not {lab.FIRST_CHAPTER}; it is at {page.url}") from None
        page.wait_for_timeout(3000)  # the news question, where asked, shows within a second or two
        assert page.get_by_text("Would you like to get notified").count() == 0
        assert page.locator(".jp-Notification-Toast").count() == 0
        has = page.evaluate(f"() => {json.dumps(TEACHER_COMMANDS)}.filter(c => window.jupyterapp.commands.hasCommand(c))")
        assert has == TEACHER_COMMANDS, f"the teacher's lab lacks nbgrader's tools: only {has}"  # the student lab's differ
    finally:
        page.context.close()
        labdriver.delete_sessions(url, token)


def test_optuna_dashboard_shows_a_study_of_the_chapters_storage(browser, tmp_path):
    """`make dashboard`'s command on a SQLite study like chapter 08's: the page lists the study and its trials."""
    if shutil.which("optuna-dashboard", path=os.path.dirname(os.sys.executable)) is None:
        pytest.skip("optuna-dashboard is not installed (the engines extra)")
    import optuna

    from labkit import search
    from labkit.search import storage as stores
    from labkit.search import study as studies

    url = stores.sqlite_url(tmp_path / "studies.db")
    config = search.StudyConfig(budget_bytes=1 << 30, n_layer=2, n_embd=32, n_head=2, vocab_size=64, batch=4,
                                seq_len=16, timed_steps=1)
    study = studies.create_study("dashboard-check", stores.make_storage(url), config, "speed", sampler="random")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    studies.optimize(study, 2)
    exe = os.path.join(os.path.dirname(os.sys.executable), "optuna-dashboard")
    log = open(tmp_path / "dashboard.log", "w")
    proc = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", "0", url], stdout=log,  # the port the system gives
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        port = labdriver.listening_port(proc, tmp_path / "dashboard.log", "optuna-dashboard")
        labdriver.wait_until_answers(f"http://127.0.0.1:{port}/api/studies", proc, tmp_path / "dashboard.log",
                                     "optuna-dashboard", 60)
        page = browser.new_context().new_page()
        page.goto(f"http://127.0.0.1:{port}/dashboard", timeout=60_000)
        page.wait_for_selector("text=dashboard-check", timeout=60_000)
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "optuna-dashboard.png"), full_page=True)
        page.click("text=dashboard-check")
        page.wait_for_url("**/studies/**", timeout=60_000)  # the study's own page
        page.wait_for_load_state("networkidle", timeout=60_000)
        page.screenshot(path=str(SHOTS / "optuna-dashboard-study.png"), full_page=True)
        page.context.close()
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=20)
        log.close()


def test_the_student_lab_opens_a_student_copy_without_the_teacher_tools(student_server, browser):
    """`make lab STUDENT=1`: the student copy opens with its exercise stubs and a kernel; no teacher tools.

    That a student copy runs to its end with only the exercises' checks failing is every whole-chapter test's
    own check (they run the student copies in this browser): this test does not run the chapter again.
    """
    url, token = student_server
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    try:
        page.goto(f"{url}/lab/tree/{STUDENT_CHAPTER}?token={token}&reset", timeout=120_000)
        page.wait_for_function("() => window.jupyterapp?.shell.currentWidget?.sessionContext?.isReady", timeout=120_000)
        stubs = page.evaluate("() => window.jupyterapp.shell.currentWidget.content.widgets.filter(c =>"
                              " c.model.sharedModel.getSource().includes('# YOUR CODE HERE')).length")
        assert stubs > 0, "the student copy holds no exercise stub: the solutions are there"
        has = page.evaluate(f"() => {json.dumps(TEACHER_COMMANDS)}.filter(c => window.jupyterapp.commands.hasCommand(c))")
        assert has == [], f"the student lab shows nbgrader's teacher tools: {has}"
        assert page.get_by_text("Create Assignment").count() == 0 and page.get_by_text("Formgrader").count() == 0
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"student-{Path(STUDENT_CHAPTER).stem}.png"))
    finally:
        page.context.close()
        labdriver.delete_sessions(url, token)


def _tiny_notebook(path: Path, *sources: str) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in sources])
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def test_a_chapter_that_hangs_leaves_the_next_one_a_fresh_kernel_and_its_own_environment(lab_session, tmp_path,
                                                                                       monkeypatch):
    """The process's shared server and browser (conftest's `lab_session`): a run that fails does not leak into
    the next run, which sees its own variables and figure-check file, and no kernel outlives its run."""
    monkeypatch.setenv("LABKIT_BUILD_DIR", str(tmp_path / "hung-build"))
    plot = "import matplotlib.pyplot as plt\nplt.plot([0, 1])\nplt.show()"
    _tiny_notebook(tmp_path / "hung" / "hang.ipynb", plot, "import time\ntime.sleep(600)")
    with pytest.raises(AssertionError, match="did not finish"):
        lab_session.run_chapter(tmp_path / "hung", "hang", tmp_path / "out-hung", timeout_s=10, panel=False)
    monkeypatch.setenv("LABKIT_BUILD_DIR", str(tmp_path / "next-build"))
    _tiny_notebook(tmp_path / "next" / "next.ipynb", "import os\nprint(os.environ['LABKIT_BUILD_DIR'])", plot)
    entry = lab_session.run_chapter(tmp_path / "next", "next", tmp_path / "out-next", timeout_s=120, panel=False)
    nb = nbformat.read(entry["path"], as_version=4)
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.outputs)
    assert printed.strip() == str(tmp_path / "next-build"), printed
    assert [c.execution_count for c in nb.cells] == [1, 2], "the second run's kernel is not a fresh one"
    assert (tmp_path / "out-next" / "lab-next" / "figures.jsonl").read_text().count("\n") == 1
    assert (tmp_path / "out-hung" / "lab-hang" / "figures.jsonl").read_text().count("\n") == 1
    url, token = lab_session.address()
    with urllib.request.urlopen(f"{url}/api/kernels?token={token}", timeout=30) as r:
        assert json.load(r) == [], "a run's kernel outlived it"
    asyncio.run(asyncio.sleep(0))  # Playwright left no event loop running: papermill's runs after it work
