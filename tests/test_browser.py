"""Every chapter in JupyterLab in a real browser: run all cells, use the widget panel, see no error.

JupyterLab starts on loopback with a token, by the command `make lab` runs (labkit.tools.lab), on a
copy of the notebooks; headless Chromium is Debian's (`/usr/bin/chromium`, or $LABKIT_CHROMIUM),
driven by Playwright, which downloads nothing here. A screenshot of each chapter's panel lands in
build/browser/. The server and the browser end with the module, on failure too.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from labkit.tools import lab

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("LABKIT_CHROMIUM", "/usr/bin/chromium")
CHAPTERS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SHOTS = ROOT / "build" / "browser"
# the key pressed on the panel's first slider: a value that changes the plot and stays cheap to run
KEYS = {"06_model_and_pipeline_parallel.ipynb": ["ArrowRight"],  # 3 ranks
        "07_sharded_data_parallel.ipynb": ["ArrowRight"],  # 4 ranks: the slider offers only divisors of the batch
        "08_memory_aware_search.ipynb": ["End"]}  # a 64 MiB budget: every setting fits
RUN_ALL_TIMEOUT_S = 600
STUDENT_CHAPTER = "01_gradient_accumulation.ipynb"  # the chapter opened in the student lab
TEACHER_COMMANDS = ["nbgrader:open-create-assignment", "nbgrader:open-formgrader", "nbgrader:open-course-list",
                    "nbgrader:open-assignment-list"]  # what nbgrader's teacher plugins add to JupyterLab

pytestmark = [pytest.mark.notebook,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no Chromium at {CHROMIUM} "
                                 "(Debian: apt-get install chromium; .ci/run installs it)")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(base: Path, root: Path, env: dict):
    """Start JupyterLab as `make lab` does, on `root`; yield (url, token); stop it."""
    lab.install_settings()  # what `make lab` does first
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(env, JUPYTER_CONFIG_DIR=str(base / "config"), JUPYTERLAB_SETTINGS_DIR=str(base / "settings"),
               JUPYTER_RUNTIME_DIR=str(base / "runtime"), LABKIT_BUILD_DIR=str(base / "build"))
    env.pop("LABKIT_BATCH", None)  # a person at a browser: live plots and widgets
    (base / "workspaces").mkdir(exist_ok=True)
    argv = lab.command(root, base / "workspaces", [
        "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
        f"--IdentityProvider.token={token}", "--LabApp.expose_app_in_browser=True"])
    log = open(base / "server.log", "w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (base / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "JupyterLab did not answer within 120 s"
            time.sleep(0.5)
        yield url, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()


def _small_copies(folder: Path, small_parameters: dict, names=None) -> Path:
    """Copy the chapters (or `names`) into `folder` with the small parameters injected as papermill -p would."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    folder.mkdir(parents=True)
    for name in names or CHAPTERS:
        shutil.copy2(ROOT / "notebooks" / name, folder / name)
    for stem, parameters in small_parameters.items():  # a cell after `parameters`
        path = folder / f"{stem}.ipynb"
        if path.exists():
            nbformat.write(parameterize_notebook(load_notebook_node(str(path)), parameters), path)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, small_parameters):
    """Start JupyterLab as `make lab` does, on a copy of the notebooks; yield (url, token); stop it."""
    base = tmp_path_factory.mktemp("lab")
    yield from _serve(base, _small_copies(base / "notebooks", small_parameters), dict(os.environ))


@pytest.fixture(scope="module")
def student_server(tmp_path_factory, small_parameters):
    """Start the student lab (`make lab STUDENT=1`) on the student copy of STUDENT_CHAPTER; yield (url, token)."""
    from labkit.tools import classroom

    base = tmp_path_factory.mktemp("student-lab")
    teacher = _small_copies(base / "teacher", small_parameters, [STUDENT_CHAPTER])
    classroom.build_student_copies(teacher, base / "course", base / "student")
    yield from _serve(base, base / "student", lab.student_env(base / "student-config"))


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-breakpad", "--disable-crash-reporter"]  # no crash handler to outlive the browser
CHAPTER_LIMIT_S = RUN_ALL_TIMEOUT_S + 240  # past this the watchdog kills the browser: no call waits for ever


@pytest.fixture
def browser(tmp_path):
    """Start Debian's Chromium (this test's own process group) and connect Playwright to it; kill it after.

    Yields (browser, expired): a watchdog kills the browser after CHAPTER_LIMIT_S, which ends any
    Playwright call still waiting on it; `expired()` then says so.
    """
    import signal
    import threading

    from playwright.sync_api import sync_playwright

    port = _free_port()
    proc = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, f"--remote-debugging-port={port}",
                             f"--user-data-dir={tmp_path / 'profile'}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    expired = threading.Event()

    def kill():
        expired.set()
        os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(CHAPTER_LIMIT_S, kill)
    watchdog.daemon = True
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/json/version", timeout=5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "Chromium did not start"
                time.sleep(0.2)
        watchdog.start()
        with sync_playwright() as p:
            b = p.chromium.connect_over_cdp(f"http://127.0.0.1:{port}")
            try:
                yield b, expired.is_set
            finally:
                try:
                    b.close()
                except Exception:
                    pass  # killed by the watchdog already
    finally:
        watchdog.cancel()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _delete_sessions(url: str, token: str) -> None:
    """Shut down every kernel the page started (a chapter's kernel must not outlive its test)."""
    with urllib.request.urlopen(f"{url}/api/sessions?token={token}", timeout=30) as r:
        sessions = json.load(r)
    for s in sessions:
        req = urllib.request.Request(f"{url}/api/sessions/{s['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(req, timeout=60).close()


STATE_JS = """() => {
  const nb = window.jupyterapp.shell.currentWidget;
  const code = nb.content.widgets.filter(c => c.model.type === 'code');
  const errors = code.flatMap(c => c.model.toJSON().outputs.filter(o => o.output_type === 'error')
                                    .map(o => o.ename + ': ' + o.evalue));
  return {status: nb.sessionContext.session?.kernel?.status ?? 'none',
          running: code.filter(c => (c.promptNode?.textContent ?? '').includes('*')).length,
          notRun: code.filter(c => c.model.executionCount === null).length, errors};
}"""


def _run_all(page, stop_on_error: bool = True) -> dict:
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.sessionContext", timeout=60_000)
    page.wait_for_function("() => window.jupyterapp.shell.currentWidget.sessionContext.isReady", timeout=120_000)
    # started, not awaited: the command's promise settles only when every cell has run
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); return true; }")
    deadline = time.monotonic() + RUN_ALL_TIMEOUT_S
    idle_since = None
    while time.monotonic() < deadline:
        state = page.evaluate(STATE_JS)
        if state["errors"] and stop_on_error:
            return state
        quiet = state["status"] == "idle" and state["running"] == 0
        idle_since = (idle_since or time.monotonic()) if quiet else None
        if quiet and (state["notRun"] == 0 or time.monotonic() - idle_since > 5):
            return state
        time.sleep(1)
    raise AssertionError(f"Run All did not finish within {RUN_ALL_TIMEOUT_S} s: {page.evaluate(STATE_JS)}")


def _press_run(panel, output) -> tuple[str, str]:
    """Press the panel's Run; wait until its output changed and settled; return (status, output html)."""
    before = output.inner_html()
    button = panel.locator("button:has-text('Run')").first
    button.click()
    status = panel.locator(".widget-hbox .widget-html").first
    deadline = time.monotonic() + 180
    last = None
    while time.monotonic() < deadline:
        time.sleep(1)
        text, html = status.inner_text().strip(), output.inner_html()
        settled = text in ("done", "does not fit") or text.startswith("error")
        if settled and not button.is_disabled() and html != before and html == last:
            return text, html
        last = html
    raise AssertionError(f"the panel's Run did not change its output within 180 s (status {status.inner_text()!r})")


def test_jupyterlab_opens_on_the_first_chapter_without_a_prompt(server, browser):
    url, token = server
    page = browser[0].new_context(viewport={"width": 1400, "height": 1000}).new_page()
    try:
        page.goto(f"{url}/?token={token}")
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
        page.close()
        _delete_sessions(url, token)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_a_chapter_runs_in_the_browser_and_its_panel_redraws(server, browser, chapter):
    url, token = server
    b, expired = browser
    page = b.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    try:
        page.goto(f"{url}/lab/tree/{chapter}?token={token}&reset")
        state = _run_all(page)
        assert state["errors"] == [], f"{chapter}: {state['errors']}"
        assert state["notRun"] == 0, f"{chapter}: {state['notRun']} code cells did not run"
        panel = page.locator(".widget-vbox:has(> .widget-hbox > button:has-text('Run'))").last
        panel.scroll_into_view_if_needed()
        output = panel.locator(".widget-output").first
        first, before = _press_run(panel, output)
        assert not first.startswith("error") and "Traceback" not in output.inner_text(), output.inner_text()[-2000:]
        slider = panel.locator(".noUi-handle").first
        slider.focus()
        for key in KEYS.get(chapter, ["Home"]):
            slider.press(key)
        second, after = _press_run(panel, output)  # fails unless the output changed
        assert not second.startswith("error") and "Traceback" not in output.inner_text(), output.inner_text()[-2000:]
        assert "<img" in before, f"{chapter}: the panel drew no plot on Run (every panel shows its experiment as one)"
        assert "<img" in after, f"{chapter}: the panel's plot is gone after the second Run"
        SHOTS.mkdir(parents=True, exist_ok=True)
        panel.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / f"{Path(chapter).stem}.png"))
    except Exception as e:
        if expired():
            raise AssertionError(f"{chapter} still ran after {CHAPTER_LIMIT_S} s: the watchdog killed the browser") from e
        raise
    finally:
        try:
            page.close()
        except Exception:
            pass  # the browser is gone (watchdog)
        _delete_sessions(url, token)  # its kernel, and the kernel's children, end here


def test_optuna_dashboard_shows_a_study_of_the_chapters_storage(browser, tmp_path):
    """`make dashboard`'s command on a SQLite study like chapter 08's: the page lists the study and its trials."""
    if shutil.which("optuna-dashboard", path=os.path.dirname(os.sys.executable)) is None:
        pytest.skip("optuna-dashboard is not installed (the engines extra)")
    import optuna

    from labkit import search
    from labkit.search import study as studies

    url = studies.storage_url(tmp_path / "studies.db")
    config = search.StudyConfig(budget_bytes=1 << 30, n_layer=2, n_embd=32, n_head=2, vocab_size=64, batch=4,
                                seq_len=16, timed_steps=1)
    study = studies.create_study("dashboard-check", studies.make_storage(url), config, "speed", sampler="random")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    studies.optimize(study, 2)
    port = _free_port()
    exe = os.path.join(os.path.dirname(os.sys.executable), "optuna-dashboard")
    log = open(tmp_path / "dashboard.log", "w")
    proc = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), url], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5).close()
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "dashboard.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "optuna-dashboard did not answer within 60 s"
                time.sleep(0.5)
        b, _ = browser
        page = b.contexts[0].new_page() if b.contexts else b.new_page()
        page.goto(f"http://127.0.0.1:{port}/dashboard", timeout=60_000)
        page.wait_for_selector("text=dashboard-check", timeout=60_000)
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "optuna-dashboard.png"), full_page=True)
        page.click("text=dashboard-check")
        page.wait_for_url("**/studies/**", timeout=60_000)  # the study's own page
        page.wait_for_load_state("networkidle", timeout=60_000)
        page.screenshot(path=str(SHOTS / "optuna-dashboard-study.png"), full_page=True)
        page.close()
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=20)
        log.close()


ERRORED_CELLS_JS = """() => window.jupyterapp.shell.currentWidget.content.widgets
  .filter(c => c.model.type === 'code')
  .map((c, i) => ({index: i, nbgrader: c.model.getMetadata('nbgrader') ?? null, source: c.model.sharedModel.getSource(),
                   errors: c.model.toJSON().outputs.filter(o => o.output_type === 'error').map(o => o.ename)}))
  .filter(c => c.errors.length)"""


def test_the_student_lab_runs_a_student_copy_without_the_teacher_tools(student_server, browser):
    """`make lab STUDENT=1`: Run All on a student copy fails only in the exercises' checks; no teacher tools."""
    url, token = student_server
    b, expired = browser
    page = b.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    try:
        page.goto(f"{url}/lab/tree/{STUDENT_CHAPTER}?token={token}&reset")
        state = _run_all(page, stop_on_error=False)
        assert state["notRun"] == 0, f"{state['notRun']} code cells did not run: {state['errors']}"
        errored = page.evaluate(ERRORED_CELLS_JS)
        stubs = page.evaluate("() => window.jupyterapp.shell.currentWidget.content.widgets.filter(c =>"
                              " c.model.sharedModel.getSource().includes('# YOUR CODE HERE')).length")
        assert stubs > 0, "the student copy holds no exercise stub: the solutions are there"
        assert errored, "no exercise check failed: the student copy runs the solutions"
        assert all((c["nbgrader"] or {}).get("grade") for c in errored), \
            f"cells other than the exercises' checks failed: {[(c['index'], c['errors'], c['source'][:80]) for c in errored]}"
        has = page.evaluate(f"() => {json.dumps(TEACHER_COMMANDS)}.filter(c => window.jupyterapp.commands.hasCommand(c))")
        assert has == [], f"the student lab shows nbgrader's teacher tools: {has}"
        assert page.get_by_text("Create Assignment").count() == 0 and page.get_by_text("Formgrader").count() == 0
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"student-{Path(STUDENT_CHAPTER).stem}.png"))
    except Exception as e:
        if expired():
            raise AssertionError(f"the student copy still ran after {CHAPTER_LIMIT_S} s: the watchdog killed the browser") from e
        raise
    finally:
        try:
            page.close()
        except Exception:
            pass
        _delete_sessions(url, token)
