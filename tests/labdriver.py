"""JupyterLab in a real browser, for the tests: a server as `make lab` starts it, Debian's Chromium driven by
Playwright (which downloads nothing here), and a chapter run as a person runs it.

`Lab(base, root)` is one JupyterLab server on `root` and one Chromium for a test process (conftest's session
fixture `lab_session`); `Lab.run_chapter(folder, stem, out, timeout_s)` is how the whole-chapter tests of
conftest's BROWSER_CHAPTERS run their chapter when Chromium is there (conftest's `execute_notebook`): a fresh
browser context, Run All, the chapter's widget panel run twice (a control moved between), the notebook saved and
read back from disk: its records, errors, figure checks and PASS lines, as the runner reports a papermill run. The
chapter's kernel and page end with the call, on failure too; the server and the browser end with `Lab.close()`.
`panel_cell(stem)` is the same two panel runs as a last cell for a chapter run under papermill.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from workbook import lab

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("LABKIT_CHROMIUM", "/usr/bin/chromium")
SHOTS = ROOT / "build" / "browser"
RUN_ALL_TIMEOUT_S = 600
PAGE_S = 120  # the page's load, then the kernel's start, each waited for up to this (slow on a loaded machine, not lost)
PANEL_RUN_S = 180  # one press of a panel's Run, waited for up to this
SAVE_S = 60  # the save, and the slack of the waits' polling
# the key pressed on the panel's first slider: a value that changes the plot and stays cheap to run
KEYS = {"06_model_and_tensor_parallel": ["ArrowRight"],  # twice the batch
        "06b_pipeline_parallel": ["ArrowRight"],  # 3 ranks
        "07_sharded_data_parallel": ["Home"],  # from test_nb07's 4 ranks to 2 (ArrowRight launched 8 processes)
        "08_memory_aware_search": ["End"]}  # a 64 MiB budget: every setting fits
# keys pressed on a panel's other sliders before its first Run, (slider index, keys): a cheaper run of the same code
PRESETS = {"08_memory_aware_search": [(1, ["Home"])]}  # 2 trials a study, not 8: each trial meters and times steps
# controls that must open on the chapter's parameters (control -> parameter), checked before the first Run
OPENS_ON = {"09_will_it_fit": {"model": "MODEL", "gpu": "GPU", "seq_len": "PLAN_SEQ_LEN", "batch": "PLAN_BATCH"}}
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-breakpad", "--disable-crash-reporter"]  # no crash handler to outlive the browser


def have_chromium() -> bool:
    """Return whether the browser the tests drive is installed."""
    return os.path.exists(CHROMIUM)


def jupyter_url(runtime: Path, proc: subprocess.Popen, log: Path, limit_s: float = 120) -> str:
    """Return the URL of the Jupyter server `proc` once it listens, read from the file it writes in `runtime`.

    Started with `--ServerApp.port=0`, the server binds a port the system gives it and names it in its server-info
    file: no port chosen free beforehand that another process can take before the server binds it.
    """
    deadline = time.monotonic() + limit_s
    while True:
        for info in runtime.glob(f"jpserver-{proc.pid}.json"):
            try:
                return f"http://127.0.0.1:{json.loads(info.read_text())['port']}"
            except (json.JSONDecodeError, KeyError):
                pass  # being written
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"Jupyter wrote no server-info file within {limit_s:.0f} s"
        time.sleep(0.2)


def listening_port(proc: subprocess.Popen, log: Path, what: str, limit_s: float = 60) -> int:
    """Return the TCP port `proc`, started with port 0, listens on once it does (psutil, ipykernel's dependency)."""
    import psutil

    deadline = time.monotonic() + limit_s
    while True:
        ports = [c.laddr.port for c in psutil.Process(proc.pid).net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN]
        if ports:
            return ports[0]
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{what} did not listen within {limit_s:.0f} s"
        time.sleep(0.2)


def wait_until_answers(url: str, proc: subprocess.Popen, log: Path, what: str, limit_s: float = 120) -> None:
    """Wait until `url` answers; fail with the log's tail if `proc` dies first or `limit_s` passes."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except OSError:
            pass
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{what} did not answer within {limit_s:.0f} s"
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """Terminate a process started in its own session; kill its group if it does not end in 20 s."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


KERNEL_CONFIG = """import json, os, sys
sys.path.insert(0, {root!r})  # `workbook` is found from any working directory
c.IPKernelApp.extra_extensions = ['workbook.figcheck']
_env = os.path.join({envs!r}, os.path.realpath(os.getcwd()).replace(os.sep, '%') + '.json')
if os.path.exists(_env):  # the run of the notebook in this folder: its variables, its figure-check file
    with open(_env) as _f:
        _changes = json.load(_f)
    os.environ.update(_changes['set'])
    for _name in _changes['unset']:
        os.environ.pop(_name, None)
"""


def kernel_env_file(envs: Path, folder: Path) -> Path:
    """Return the file a kernel started in `folder` reads its environment changes from (KERNEL_CONFIG)."""
    return envs / (os.path.realpath(folder).replace(os.sep, "%") + ".json")


@contextlib.contextmanager
def serve(base: Path, root: Path, env: dict, figure_checks: bool = False):
    """Start JupyterLab as `make lab` does, on `root`; yield (url, token); stop it.

    With `figure_checks`, every kernel it starts loads workbook.figcheck and first applies the environment
    changes `kernel_env_file(base / "kernel-env", folder)` holds for its notebook's folder, if any.
    """
    lab.install_settings()  # what `make lab` does first
    token, runtime = secrets.token_hex(16), Path(tempfile.mkdtemp(prefix="lab-rt-"))  # kernels' sockets: a short path
    env = dict(env, JUPYTER_CONFIG_DIR=str(base / "config"), JUPYTERLAB_SETTINGS_DIR=str(base / "settings"),
               JUPYTER_RUNTIME_DIR=str(runtime))
    env.setdefault("LABKIT_BUILD_DIR", str(base / "build"))
    env.pop("LABKIT_BATCH", None)  # a person at a browser: live plots and widgets
    if figure_checks:
        profile = base / "ipython" / "profile_default"
        profile.mkdir(parents=True, exist_ok=True)
        (base / "kernel-env").mkdir(exist_ok=True)
        (profile / "ipython_kernel_config.py").write_text(
            KERNEL_CONFIG.format(root=str(ROOT), envs=str(base / "kernel-env")))
        env["IPYTHONDIR"] = str(base / "ipython")
    (base / "workspaces").mkdir(parents=True, exist_ok=True)
    argv = lab.command(root, base / "workspaces", [
        "--no-browser", "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0", "--KernelManager.transport=ipc",
        f"--IdentityProvider.token={token}", "--LabApp.expose_app_in_browser=True"])  # no port to lose (jupyter_url)
    log_path = base / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = jupyter_url(runtime, proc, log_path)
            wait_until_answers(f"{url}/api/status?token={token}", proc, log_path, "JupyterLab")
            yield url, token
        finally:
            stop(proc)
            shutil.rmtree(runtime, ignore_errors=True)


def start_chromium(profile: Path) -> tuple[subprocess.Popen, int]:
    """Start Debian's Chromium in its own process group; return (process, its debugging port) once it answers.

    Its port is the one the system gives it (`--remote-debugging-port=0`), read from the DevToolsActivePort file it
    writes in its profile, as Puppeteer does.
    """
    active = profile / "DevToolsActivePort"
    active.unlink(missing_ok=True)
    proc = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, "--remote-debugging-port=0",
                             f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            port = int(active.read_text().split()[0])
            urllib.request.urlopen(f"http://127.0.0.1:{port}/json/version", timeout=5).close()
            return proc, port
        except (OSError, ValueError, IndexError):
            if proc.poll() is not None or time.monotonic() > deadline:
                kill_group(proc)
                raise AssertionError("Chromium did not start")
            time.sleep(0.2)


def kill_group(proc: subprocess.Popen) -> None:
    """Kill a process started in its own session, with its group, and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def watchdog_limit_s(timeout_s: float, panel: bool) -> float:
    """Return the seconds after which run_chapter's watchdog kills the browser: the sum of what its waits allow.

    Each wait has its own limit and its own message; the watchdog only stops a call that has none (it once fired
    at 540 s while every wait was still within its limit: a slow run on a loaded 2-core machine, failed for nothing).
    """
    return 60 + 2 * PAGE_S + timeout_s + (2 * PANEL_RUN_S if panel else 0) + SAVE_S


def watchdog(proc: subprocess.Popen, limit_s: float) -> tuple[threading.Timer, threading.Event]:
    """Start a timer that kills `proc`'s group after `limit_s`; return it and the event it sets when it does."""
    expired = threading.Event()

    def kill():
        expired.set()
        os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(limit_s, kill)
    timer.daemon = True
    timer.start()
    return timer, expired


def start_session(url: str, token: str, path: str) -> None:
    """Start the kernel of the notebook at `path` (relative to the server's root): JupyterLab opens it attached."""
    kernel = json.loads(urllib.request.urlopen(f"{url}/api/contents/{path}?token={token}&content=1", timeout=60)
                        .read())["content"]["metadata"].get("kernelspec", {}).get("name", "python3")
    body = {"path": path, "name": path.rsplit("/", 1)[-1], "type": "notebook", "kernel": {"name": kernel}}
    req = urllib.request.Request(f"{url}/api/sessions?token={token}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=120).close()


def delete_sessions(url: str, token: str) -> None:
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


def run_all(page, stop_on_error: bool = True, timeout_s: float = RUN_ALL_TIMEOUT_S) -> dict:
    """Run every cell of the open notebook; return its state (errors, cells not run) once the kernel is idle."""
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.sessionContext", timeout=60_000)
    page.wait_for_function("() => window.jupyterapp.shell.currentWidget.sessionContext.isReady",
                           timeout=PAGE_S * 1000)
    # started, not awaited: the command's promise settles only when every cell has run
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); return true; }")
    deadline = time.monotonic() + timeout_s
    idle_since = None
    while time.monotonic() < deadline:
        state = page.evaluate(STATE_JS)
        if state["errors"] and stop_on_error:
            return state
        quiet = state["status"] == "idle" and state["running"] == 0
        idle_since = (idle_since or time.monotonic()) if quiet else None
        if quiet and (state["notRun"] == 0 or time.monotonic() - idle_since > 5):
            return state
        time.sleep(0.5)
    raise AssertionError(f"Run All did not finish within {timeout_s:.0f} s: {page.evaluate(STATE_JS)}")


def press_run(panel, output) -> tuple[str, str]:
    """Press the panel's Run; wait until its output changed and settled; return (status, output html)."""
    before = output.inner_html()
    button = panel.locator("button:has-text('Run')").first
    button.click()
    status = panel.locator(".widget-hbox .widget-html").first
    deadline = time.monotonic() + PANEL_RUN_S
    last = None
    while time.monotonic() < deadline:
        time.sleep(0.5)
        text, html = status.inner_text().strip(), output.inner_html()
        settled = text in ("done", "does not fit") or text.startswith("error")
        if settled and not button.is_disabled() and html != before and html == last:
            return text, html
        last = html
    raise AssertionError(f"the panel's Run did not change its output within {PANEL_RUN_S} s (status {status.inner_text()!r})")


PANEL_CELL = """\
# (added by the tests: the chapter's widget panel run twice in its kernel, as tests/labdriver.py runs it in the browser)
import gc as _gc
from IPython.utils.capture import capture_output as _capture
from labkit.widgets import ControlPanel as _Panel, positions as _positions

_panels = [o for o in _gc.get_objects() if issubclass(type(o), _Panel)]  # (isinstance raises on a dead weakref proxy)
assert len(_panels) == 1, f"{stem}: expected one widget panel after Run All, found {{len(_panels)}}"
_panel = _panels[0]
_sliders = [w for w in _panel.controls.values() if type(w).__name__.endswith("Slider")]  # the page's .noUi-handle


def _press(slider, key):
    at = _positions(slider)
    i = at.index(slider.value) if slider.value in at else 0
    slider.value = at[{{"Home": 0, "End": len(at) - 1, "ArrowRight": min(i + 1, len(at) - 1)}}[key]]


class _Shown:  # stands in for the panel's Output widget (no frontend here): keeps what a Run prints and shows

    def clear_output(self, wait=False):
        pass

    def __enter__(self):
        self.capture = _capture()
        self.shown = self.capture.__enter__()

    def __exit__(self, *exc):
        return self.capture.__exit__(*exc)


def _run():
    _panel.output = _Shown()
    _panel.run()
    shown = _panel.output.shown
    settled = _panel.status.value == "done" or "does not fit" in _panel.status.value  # as press_run waits for
    why = shown.stdout[-1000:] + shown.stderr[-2000:]
    assert settled, f"{stem}: the panel's Run ended in {{_panel.status.value!r}}: {{why}}"
    images = [o.data["image/png"] for o in shown.outputs if "image/png" in o.data]
    assert images, f"{stem}: the panel drew no plot on Run (every panel shows its experiment as one)"
    return shown.stdout, images


for _name, _parameter in {opens_on!r}.items():  # the panel opens on the reader's settings, not on its first choices
    _value, _wanted = _panel.controls[_name].value, globals()[_parameter]
    assert _value == _wanted, f"{stem}: the panel's {{_name}} opens on {{_value!r}}, not on {{_parameter}} = {{_wanted!r}}"
for _index, _keys in {presets!r}:
    for _key in _keys:
        _press(_sliders[_index], _key)
_before = _run()
for _key in {keys!r}:
    _press(_sliders[0], _key)
assert _run() != _before, "{stem}: the panel's output did not change after its first slider moved"
"""


def panel_cell(stem: str) -> str:
    """Return a code cell that runs the chapter's panel in its kernel as exercise_panel does in the browser."""
    return PANEL_CELL.format(stem=stem, presets=PRESETS.get(stem, []), keys=KEYS.get(stem, ["Home"]),
                             opens_on=OPENS_ON.get(stem, {}))


def exercise_panel(page, stem: str) -> None:
    """Run the chapter's widget panel, move its first slider, run it again: a plot each time, no error.

    PRESETS first sets a chapter's costly sliders (chapter 08's trial count) to a cheap value: the same code runs.
    """
    panel = page.locator(".widget-vbox:has(> .widget-hbox > button:has-text('Run'))").last
    try:
        panel.scroll_into_view_if_needed()
    except Exception as e:  # no panel on the page: say what the run left (errors, cells not run), not only a timeout
        raise AssertionError(f"{stem}: no widget panel to run after Run All: {page.evaluate(STATE_JS)}") from e
    output = panel.locator(".widget-output").first
    for index, keys in PRESETS.get(stem, []):
        handle = panel.locator(".noUi-handle").nth(index)
        handle.focus()
        for key in keys:
            handle.press(key)
    first, before = press_run(panel, output)
    assert not first.startswith("error") and "Traceback" not in output.inner_text(), output.inner_text()[-2000:]
    slider = panel.locator(".noUi-handle").first
    slider.focus()
    for key in KEYS.get(stem, ["Home"]):
        slider.press(key)
    second, after = press_run(panel, output)  # fails unless the output changed
    assert not second.startswith("error") and "Traceback" not in output.inner_text(), output.inner_text()[-2000:]
    assert "<img" in before, f"{stem}: the panel drew no plot on Run (every panel shows its experiment as one)"
    assert "<img" in after, f"{stem}: the panel's plot is gone after the second Run"
    SHOTS.mkdir(parents=True, exist_ok=True)
    panel.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / f"{stem}.png"))


class Lab:
    """One JupyterLab server on `root` and one Chromium, each started when first needed and again if it died.

    Chapters run one after another, each in a fresh browser context, its kernel shut down after it: a chapter
    that fails, or that the watchdog stopped (it kills the browser), does not carry over into the next.
    """

    def __init__(self, base: Path, root: Path):
        self.base, self.root = base, root
        self.server = None  # (ExitStack, url, token)
        self.browser = None  # (Chromium's process, its debugging port)
        self.env: dict = {}  # the server's environment: a chapter's kernel gets what differs from it

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def address(self) -> tuple[str, str]:
        """Return the server's (url, token), starting the server first where it is not running."""
        if self.server is not None:
            _, url, token = self.server
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=10).close()
                return url, token
            except OSError:
                self._stop_server()
        stack = contextlib.ExitStack()
        self.env = dict(os.environ)
        url, token = stack.enter_context(serve(self.base, self.root, self.env, figure_checks=True))
        self.server = (stack, url, token)
        return url, token

    def _chromium(self) -> tuple[subprocess.Popen, int]:
        if self.browser is not None:
            proc, port = self.browser
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/json/version", timeout=10).close()
                return self.browser
            except OSError:
                self._stop_browser()
        self.browser = start_chromium(self.base / "profile")
        return self.browser

    @contextlib.contextmanager
    def chromium(self):
        """Yield the Playwright browser connected to the process's Chromium (started where it is not running).

        Playwright's sync API holds an asyncio loop in this thread while it runs: it stops when the block ends,
        so that the tests after it may run their own loops (papermill, nbclient).
        """
        from playwright.sync_api import sync_playwright

        _, port = self._chromium()
        with sync_playwright() as p:
            b = p.chromium.connect_over_cdp(f"http://127.0.0.1:{port}")
            try:
                yield b
            finally:
                try:
                    b.close()  # disconnects: Chromium goes on
                except Exception:
                    pass  # killed by the watchdog already

    def _stop_browser(self) -> None:
        if self.browser is not None:
            proc = self.browser[0]
            self.browser = None
            kill_group(proc)

    def _stop_server(self) -> None:
        if self.server is not None:
            stack = self.server[0]
            self.server = None
            stack.close()

    def close(self) -> None:
        """Stop the browser and the server (every kernel it started goes with it)."""
        try:
            self._stop_browser()
        finally:
            self._stop_server()

    def kernel_env(self, figure_checks: Path) -> dict:
        """Return the environment changes a chapter's kernel applies: this process's variables, its figure file."""
        from workbook import figcheck

        now = dict(os.environ, **{figcheck.OUT_ENV: str(figure_checks)})
        now.pop("LABKIT_BATCH", None)  # a person at a browser: live plots and widgets
        return {"set": {k: v for k, v in now.items() if self.env.get(k) != v},
                "unset": sorted(k for k in self.env if k not in now and k != "LABKIT_BATCH")}

    def run_chapter(self, folder: Path, stem: str, out: Path, timeout_s: float = RUN_ALL_TIMEOUT_S,
                    panel: bool = True) -> dict:
        """Run folder/<stem>.ipynb in JupyterLab as a person would; return a results entry like the runner's.

        `folder` lies under the server's root. Run All going on past failed cells tagged `raises-exception` (a
        student copy's exercise checks), then the widget panel twice (with `panel`); the notebook is saved by
        JupyterLab and read back: {status, wall_s, measurements, figure_problems, crowded_sections, path}.
        """
        import nbformat

        from labkit.execute import records_from_notebook
        from workbook import figcheck
        from workbook.nbcheck import crowded_sections

        run_dir = out / f"lab-{stem}"
        run_dir.mkdir(parents=True, exist_ok=True)
        checks = run_dir / "figures.jsonl"
        start = time.perf_counter()
        url, token = self.address()
        proc, _ = self._chromium()
        env_file = kernel_env_file(self.base / "kernel-env", folder)
        env_file.write_text(json.dumps(self.kernel_env(checks)))
        relative = (Path(folder) / f"{stem}.ipynb").resolve().relative_to(Path(self.root).resolve()).as_posix()
        limit_s = watchdog_limit_s(timeout_s, panel)
        timer, expired = watchdog(proc, limit_s)
        phases, watched = [], time.perf_counter()  # (what, seconds): what the message says if the watchdog fires

        def done(what: str) -> None:
            phases.append((what, time.perf_counter() - watched - sum(s for _, s in phases)))

        try:
            start_session(url, token, relative)  # the kernel starts while the page loads
            with self.chromium() as b:
                context = b.new_context(viewport={"width": 1400, "height": 1000})
                try:
                    page = context.new_page()
                    page.goto(f"{url}/lab/tree/{relative}?token={token}&reset", timeout=PAGE_S * 1000)
                    done("page loaded")
                    run_all(page, stop_on_error=False, timeout_s=timeout_s)  # the saved notebook tells what ran
                    done("Run All")
                    if panel:
                        exercise_panel(page, stem)
                        done("the panel run twice")
                    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
                finally:
                    try:
                        context.close()
                    except Exception:
                        pass  # the browser is gone (watchdog)
        except Exception as e:
            if expired.is_set():
                took = ", ".join(f"{what} after {s:.0f} s" for what, s in phases) or "nothing finished"
                raise AssertionError(f"{stem} still ran after the watchdog's limit of {limit_s:.0f} s: it killed the "
                                     f"browser ({took})") from e
            raise
        finally:
            timer.cancel()
            if expired.is_set():
                self._stop_browser()
            env_file.unlink(missing_ok=True)
            delete_sessions(url, token)  # its kernel, and the kernel's children, end here
        path = folder / f"{stem}.ipynb"
        nb = nbformat.read(path, as_version=4)
        return {"status": "ok", "wall_s": round(time.perf_counter() - start, 3),
                "measurements": records_from_notebook(nb),
                "figure_problems": figcheck.problems_by_cell(nb, figcheck.read_lines(checks)),
                "crowded_sections": crowded_sections(nb), "path": path}
