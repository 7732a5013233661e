"""Shared fixtures: a tiny GPT and its batches, one torch thread, and two ways to run a notebook.

- `execute_notebook(stem, **parameters)`: the whole chapter under papermill, as `make run` does, in
  its *student copy* (nbgrader: solutions replaced by stubs): one run checks both the chapter's
  invariants and that a student copy runs to its end with only the exercises' checks failing
  (nbval runs the teacher's copy, solutions included); returns its results entry.
- `validate_parameters(stem, **parameters)`: only the cells up to the parameters cell and the
  validation cell after it, in this process, with the parameters injected as papermill injects
  them; returns the exception the validation raised (None when the parameters are valid).

Tests that use either are marked `notebook` (`make unit` leaves them out).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

# Figure problems the chapters had when the figure check came (workbook.figcheck, found by `make run`), as
# {chapter: rules} (figcheck.rule_of): a test that runs a whole chapter allows these and fails on any other.
# Remove a chapter's rules once its figures pass: the list only shrinks.
KNOWN_FIGURE_PROBLEMS: dict[str, set[str]] = {}  # every chapter passes every rule since 2026-11-30 (08's trial
#                                                  timeline, whose x label was cut off at small sizes, left the page)
NOTEBOOK_FIXTURES = {"execute_notebook", "validate_parameters"}
# The chapters whose whole-chapter test runs in JupyterLab in the browser where Chromium is installed; the others
# run under papermill with their widget panel run twice in the kernel (labdriver.panel_cell). The browser cost about
# 10 CPU-seconds a chapter (Chromium loads JupyterLab and renders every output; 76 s against 36 s for 01, 03, 04
# and 05), 8% of make test's CPU over the ten chapters; it runs 00, the chapter a student opens first, and 07,
# whose panel starts rank processes from a live kernel (the browser found it starting eight). tests/test_browser.py
# opens the labs themselves.
BROWSER_CHAPTERS = {"00_where_the_memory_goes", "07_sharded_data_parallel"}
SLOWEST_FIRST = ["tests/test_nb08.py", "tests/test_nb06b.py", "tests/test_nb06.py",
                 "07_sharded_data_parallel.ipynb", "tests/test_nb07.py", "tests/test_plan.py",
                 "08_memory_aware_search.ipynb", "tests/test_search_workers.py", "tests/test_dist.py",
                 "tests/test_browser.py", "tests/test_search_study.py", "02_activation_checkpointing.ipynb",
                 "tests/test_search_engines.py", "06b_pipeline_parallel.ipynb",
                 "06_model_and_tensor_parallel.ipynb", "tests/test_nb09.py", "09_will_it_fit.ipynb",
                 "tests/test_runner.py", "tests/test_nb00.py", "tests/test_nb02.py", "tests/test_classroom.py",
                 "tests/test_nb04.py", "tests/test_nb03.py", "tests/test_nb01.py", "tests/test_search_trial.py",
                 "tests/test_nb05.py", "tests/test_hosted.py", "tests/test_search_storage.py",
                 "tests/test_estimate.py", "tests/test_closing.py", "tests/test_l2l.py"]  # files of 10 s or more (make test's
#                                 --durations), longest first: the Makefile passes --no-loadscope-reorder, or xdist
#                                 would order files by their test count
SESSION_TAG = "LABKIT_TEST_SESSION"  # inherited by every process the session starts


def pytest_configure(config):
    """Tag every process this test session starts (ranks, kernels) through an inherited variable; give them one folder
    to share fake steps in (labkit.estimate.remembered: the notebooks, their ranks and the search workers ask for the
    same steps); have nbval see a kernel that died, and start its kernels over Unix sockets; check each chapter's
    reading time on nbval's run (ChapterReadingTime)."""
    import os
    if not hasattr(config, "workerinput"):  # the controller, before any worker starts
        import tempfile
        import uuid

        from labkit.estimate import SHARED_DIR_ENV
        os.environ.setdefault(SESSION_TAG, uuid.uuid4().hex)
        if SHARED_DIR_ENV not in os.environ:
            config.fake_steps_dir = os.environ[SHARED_DIR_ENV] = tempfile.mkdtemp(prefix="labkit-fake-steps-")
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")  # a kernel that crashes prints its Python stack to the log
    _watch_nbval_kernels()
    _nbval_kernels_over_ipc()
    config.pluginmanager.register(ChapterReadingTime(), "chapter-reading-time")


KERNEL_POLL_S = 5.0  # how often nbval's wait for a cell's reply checks that the kernel still lives


class KernelDied(RuntimeError):
    """The notebook's kernel process ended while a cell ran (a crash: a signal, or the OOM killer)."""


def _nbval_kernels_over_ipc() -> None:
    """Start nbval's kernels as papermill's (labkit.execute.over_ipc): no TCP port another process can take first."""
    try:
        import nbval.kernel
    except ImportError:
        return
    import os

    from labkit.execute import over_ipc

    if os.name == "posix" and nbval.kernel.KernelManager.__name__ != "IPCKernelManager":
        nbval.kernel.KernelManager = over_ipc(nbval.kernel.KernelManager)


def _watch_nbval_kernels() -> None:
    """Make nbval's wait for a cell's reply fail at once, saying so, when the kernel process has died.

    nbval waits --nbval-cell-timeout (2000 s by default) for the reply of a kernel that crashed, and then reports a
    timeout ("Failed to interrupt kernel"): a crash read as a hang, after half an hour.
    """
    try:
        from queue import Empty

        from nbval.kernel import RunningKernel
    except ImportError:
        return
    if getattr(RunningKernel.await_reply, "watches_death", False):
        return
    original = RunningKernel.await_reply

    def await_reply(self, msg_id, timeout=None):
        import time
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                wait_s = KERNEL_POLL_S if left is None else max(0.0, min(KERNEL_POLL_S, left))
                return original(self, msg_id, timeout=wait_s)
            except Empty:
                if left is not None and left <= KERNEL_POLL_S:
                    raise  # nbval's own timeout
                if not self.is_alive():
                    process = getattr(getattr(self.km, "provisioner", None), "process", None)
                    code = process.poll() if process is not None else None
                    how = ("" if code is None else f" (exit code {code}" + (
                        f", signal {-code}" if code < 0 else "") + ")")
                    raise KernelDied(f"the kernel died{how} while running this cell: a crash, not a slow cell; its "
                                     "stack, if Python could print one, is in the log above (PYTHONFAULTHANDLER)")

    await_reply.watches_death = True
    RunningKernel.await_reply = await_reply


def leftover_processes(tag: str | None = None, wait_s: float = 10.0) -> list[str]:
    """Return "pid: command" of the live processes carrying SESSION_TAG=`tag` (default: this session's), this one aside.

    Waits up to `wait_s` for them to exit first: processes stopped a moment ago may still be exiting.
    Zombies (exited, not yet reaped) do not count. Linux only (reads /proc); elsewhere returns [].
    """
    import os
    import time
    if not os.path.isdir("/proc"):
        return []
    tag = os.environ.get(SESSION_TAG) if tag is None else tag
    marker = f"{SESSION_TAG}={tag}".encode()
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(")")[-1].split()[0] == "Z":
                        continue  # exited, waiting to be reaped
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace")
                left.append(f"{pid}: {command[:200]}")
            except OSError:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def pytest_report_header(config):
    """Print the CPU line (workbook.cpureport) at the top of the run: every timing a run reports comes with its machine;
    keep the clock, the machine's busy CPU-seconds and the fp32 matmul for the run's last line."""
    import time

    from workbook.bench import machine_cpu_s
    from workbook.cpureport import cpu_report
    report = cpu_report()
    config.run_start = (time.monotonic(), machine_cpu_s(), report.fp32_matmul_s)
    return report.line()


def pytest_terminal_summary(terminalreporter, config):
    """End the run with the machine's side of its time: how busy its cores were, and its fp32 matmul before and after
    (a shared machine can slow down by a quarter within a run: then so does the suite, with the same work)."""
    import os
    import time

    from workbook.bench import cpu_line, drift_line, machine_cpu_s
    from workbook.cpureport import cpu_report
    if not hasattr(config, "run_start"):
        return
    start_s, busy_s, fp32_s = config.run_start
    busy_end_s = machine_cpu_s()
    busy = cpu_line({"busy_cpu_s": None if busy_s is None or busy_end_s is None else busy_end_s - busy_s,
                     "cores": os.cpu_count(), "wall_s": time.monotonic() - start_s}, during="this run", limit=False)
    for line in (busy, drift_line(fp32_s, cpu_report(fresh=True).fp32_matmul_s, during="this run")):
        if line:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a process it started (a rank, a kernel, a worker) is still alive at the end.

    First this process's own helpers go: labkit.children's fork server and multiprocessing's resource tracker live as long
    as the process that launched ranks (here a test process, which is still running).
    """
    from multiprocessing import resource_tracker

    from labkit.children import stop_fork_server
    stop_fork_server()
    resource_tracker._resource_tracker._stop()
    if hasattr(session.config, "workerinput"):
        return
    if hasattr(session.config, "fake_steps_dir"):
        import shutil
        shutil.rmtree(session.config.fake_steps_dir, ignore_errors=True)
    left = leftover_processes()
    if left:
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            "processes started by the tests are still running:\n  " + "\n  ".join(left), red=True)
        session.exitstatus = 1


def pytest_collection_modifyitems(config, items):
    """Mark every test that runs notebook cells with `notebook`; skip `cuda` tests, saying why, without CUDA."""
    import torch

    no_cuda = None if torch.cuda.is_available() else pytest.mark.skip(
        reason="requires CUDA: torch sees no CUDA device here (run `make gpu-check` on a machine with one)")
    for item in items:
        if NOTEBOOK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.notebook)
        if no_cuda is not None and "cuda" in item.keywords:
            item.add_marker(no_cuda)
    # the longest files first (xdist's loadscope hands out files in this order): two workers then end together
    # instead of one running chapter 08's nbval alone at the end
    items.sort(key=lambda item: next((i for i, name in enumerate(SLOWEST_FIRST) if item.nodeid.startswith(name)
                                      or f"/{name}" in item.nodeid.split("::")[0]), len(SLOWEST_FIRST)))


class ChapterReadingTime:
    """Fail nbval's last cell of a chapter that takes longer than a sitting to read (workbook.readtime), its outputs
    those nbval received: the defaults' reading time, checked on the run nbval makes anyway; print every chapter's.

    A plugin registered by pytest_configure: a conftest's own hooks reach only the items under its folder, and nbval's
    run build/nbval. The whole-chapter tests check their own runs (execute_notebook), whose outputs differ."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when != "call" or not hasattr(item, "test_outputs") or not hasattr(item.parent, "nb"):
            return  # not an nbval cell
        report = outcome.get_result()
        nb = item.parent.nb
        outputs = item.parent.__dict__.setdefault("_outputs_read", {})
        outputs[item.cell_num] = item.test_outputs if report.passed else None
        code_cells = [c for c in nb.cells if c.cell_type == "code"]
        if item.cell_num != len(code_cells) - 1 or len(outputs) != len(code_cells) or None in outputs.values():
            return  # not the last cell, or a cell failed or was skipped: that failure is the report
        from workbook.readtime import LIMIT_MIN, reading
        cells, code = [], iter(range(len(code_cells)))
        for cell in nb.cells:
            cells.append(dict(cell, outputs=outputs[next(code)]) if cell.cell_type == "code" else cell)
        stem = Path(str(item.parent.fspath)).stem
        minutes = reading({"cells": cells}, stem).minutes
        report.user_properties.append(("minutes_to_read", minutes))  # for the summary line (xdist sends it back)
        if minutes > LIMIT_MIN:
            report.outcome = "failed"
            report.longrepr = (f"{stem}: {minutes:.1f} minutes to read with its default parameters (workbook.readtime, "
                               f"the outputs of this run), over a sitting's {LIMIT_MIN}")

    def pytest_terminal_summary(self, terminalreporter):
        minutes = {Path(r.nodeid.split("::")[0]).stem: v for kind in ("passed", "failed")
                   for r in terminalreporter.getreports(kind) for k, v in r.user_properties if k == "minutes_to_read"}
        if minutes:
            from workbook.readtime import LIMIT_MIN
            terminalreporter.write_line(
                f"minutes to read each chapter's default run (workbook.readtime; a sitting is {LIMIT_MIN}): "
                + ", ".join(f"{stem[:3].rstrip('_')} {m:.1f}" for stem, m in sorted(minutes.items())))


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests on one torch thread: byte counts do not depend on threads, and one
    thread keeps small ops fast when other processes share the cores."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_config():
    """The tests' tiny GPT: 2 blocks of width 32, 2 heads, sequences up to 16 tokens, 64 tokens."""
    import labkit

    return labkit.GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)


@pytest.fixture
def tiny_gpt(tiny_config):
    """Return make(seed=0, **overrides): the tiny GPT (config fields overridden), initialised from `seed`."""
    import torch

    import labkit

    def make(seed: int = 0, **overrides):
        torch.manual_seed(seed)
        return labkit.GPT(dataclasses.replace(tiny_config, **overrides))

    return make


@pytest.fixture
def tiny_batch(tiny_config):
    """Return make(rows, seq_len=16, seed=0, padded=False, vocab_size=64): (inputs, targets) of a Markov language.

    padded=True gives each row 1..seq_len real tokens (targets -100 beyond), as in notebook 01.
    """
    import torch

    from labkit.data import MarkovTokens

    def make(rows: int, seq_len: int = 16, seed: int = 0, padded: bool = False,
             vocab_size: int = tiny_config.vocab_size):
        data = MarkovTokens(vocab_size, seed=seed)
        g = torch.Generator().manual_seed(seed + 1)
        if padded:
            x, y, _ = data.padded_batch(rows, seq_len, generator=g)
            return x, y
        return data.batch(rows, seq_len, g)

    return make


@pytest.fixture(scope="session")
def student_copies(tmp_path_factory) -> Path:
    """Build every chapter's student copy once per test run (nbgrader: ~10 CPU-s; the first test process that asks
    builds them for every xdist worker, under a lock); return their folder (read only: tests copy it)."""
    import os

    from filelock import FileLock

    from workbook import classroom

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, which every worker's own folder lies in
    base = root / "student-copies"
    with FileLock(str(root / "student-copies.lock")):
        if not (base / "built").exists():
            classroom.build_student_copies(NOTEBOOKS, base / "course", base / "student")
            (base / "built").touch()
    return base / "student"


def exercise_failures(nb: dict) -> tuple[dict, set, list]:
    """Return an executed notebook's {cell: (grade_id, error)}, its graded check cells, and the code cells that never ran."""
    failed = {}
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            if out["output_type"] == "error":
                failed[i] = (cell["metadata"].get("nbgrader", {}).get("grade_id"), f"{out['ename']}: {out['evalue']}")
    checks = {i for i, c in enumerate(nb["cells"]) if c["metadata"].get("nbgrader", {}).get("grade")}
    not_run = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and not c.get("execution_count")]
    return failed, checks, not_run


@pytest.fixture(scope="session")
def lab_session(tmp_path_factory):
    """One JupyterLab server and one Chromium for this test process, started at their first chapter (labdriver.Lab).

    The server's root is the process's temporary folder, so that every test's copy of a chapter lies under it.
    """
    import labdriver

    with labdriver.Lab(tmp_path_factory.mktemp("lab"), tmp_path_factory.getbasetemp()) as lab:
        yield lab


@pytest.fixture
def execute_notebook(tmp_path, student_copies, monkeypatch, request):
    """Return a function that runs the student copy of notebooks/<stem>.ipynb with parameters; return its results entry.

    A chapter of BROWSER_CHAPTERS runs in JupyterLab in the browser where Chromium is installed (`lab_session`, the
    test process's server and browser; tests/labdriver.py: Run All, its widget panel twice, the notebook saved and
    read back); the others, or every chapter with LABKIT_TEST_PAPERMILL=1 or without Chromium, run under papermill
    as `make run` runs them, with a last cell that runs the widget panel twice in the kernel
    (labdriver.panel_cell: a plot each time, the output changed after a slider moved). Either way the copy must
    run to its end with exactly the exercises' checks failing (their stubs solve nothing). Its figures are checked
    as they are drawn (workbook.figcheck): a problem not in KNOWN_FIGURE_PROBLEMS fails; so does a section (text
    under one heading) that printed more than one PASS line.
    """
    import json
    import os
    import shutil

    import labdriver
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    from workbook.figcheck import rule_of
    from workbook.readtime import LIMIT_MIN as READ_LIMIT_MIN
    from workbook.readtime import reading
    from workbook.runner import run_notebook

    monkeypatch.setenv("LABKIT_BUILD_DIR", str(tmp_path / "build"))  # chapter 08's studies: this test's own
    browser = labdriver.have_chromium() and not os.environ.get("LABKIT_TEST_PAPERMILL")

    def run(stem: str, timeout_s: float = 300, **parameters) -> dict:
        assert (NOTEBOOKS / f"{stem}.ipynb").exists(), stem
        work = tmp_path / "student"
        if not work.exists():
            shutil.copytree(student_copies, work)  # %%writefile and friends write beside the notebook
        path = work / f"{stem}.ipynb"
        shutil.copy2(student_copies / path.name, path)  # a second run starts from the clean copy
        in_browser = browser and stem in BROWSER_CHAPTERS
        nb = load_notebook_node(str(path))
        if parameters:  # as papermill -p injects them: a cell after the one tagged `parameters`
            nb = parameterize_notebook(nb, parameters)
        if not in_browser:
            nb.cells.append(nbformat.v4.new_code_cell(labdriver.panel_cell(stem)))
        nbformat.write(nb, path)
        if in_browser:
            entry = request.getfixturevalue("lab_session").run_chapter(work, stem, tmp_path, timeout_s)
        else:
            entry = run_notebook(path, tmp_path, {}, timeout_s)
            entry["path"] = tmp_path / entry["executed"]
        failed, checks, not_run = exercise_failures(json.loads(entry["path"].read_text()))
        assert entry["status"] == "ok" or failed, f"{stem} did not run: {entry.get('error')}"  # e.g. its kernel died
        assert set(failed) == checks, f"{stem}: cells that failed {failed}, the exercises' checks {sorted(checks)}"
        assert not not_run, f"{stem}: code cells that did not run: {not_run}"
        if entry["status"] == "failed" and failed:  # papermill reports the exercises' failed checks: expected here
            entry["status"] = "ok"
            entry.pop("error", None)
        known = KNOWN_FIGURE_PROBLEMS.get(stem, set())
        new = [p for p in entry.get("figure_problems", []) if rule_of(p["problem"]) not in known]
        assert not new, f"{stem}: figures that break CONTRIBUTING.md's rules (cell, figure, problem): {new}"
        minutes = reading(json.loads(entry["path"].read_text()), stem).minutes
        assert minutes <= READ_LIMIT_MIN, (f"{stem}: {minutes:.1f} minutes to read (workbook.readtime), over a "
                                           f"sitting's {READ_LIMIT_MIN}")
        crowded = entry.get("crowded_sections", [])
        assert not crowded, f"{stem}: sections with more than one PASS line (CONTRIBUTING.md: one check per section): {crowded}"
        return entry

    return run


@pytest.fixture
def validate_parameters(monkeypatch):
    """Return run(stem, **parameters) -> the exception the notebook's validation cell raises, or None.

    Executes, in this process, the code cells up to the one tagged `parameters`, the parameters
    given (as papermill injects them, after that cell), and the validation cell that follows
    (CONTRIBUTING.md: it checks every parameter before any work). Asserts nothing was recorded.
    """
    import nbformat

    from labkit import results

    monkeypatch.setenv("LABKIT_BATCH", "1")
    monkeypatch.chdir(NOTEBOOKS)

    def run(stem: str, **parameters) -> BaseException | None:
        nb = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
        cells = [c for c in nb.cells if c.cell_type == "code"]
        tagged = [i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{stem}: expected one cell tagged 'parameters', found {len(tagged)}"
        i = tagged[0]
        assert "validate." in cells[i + 1].source, f"{stem}: the cell after the parameters must validate them"
        sources = [c.source for c in cells[:i + 1]]
        sources.append("\n".join(f"{name} = {value!r}" for name, value in parameters.items()))
        sources.append(cells[i + 1].source)
        namespace = {"__name__": "__main__"}
        results.clear()
        try:
            for n, source in enumerate(sources):
                exec(compile(source, f"<{stem} cell {n}>", "exec"), namespace)
        except Exception as e:  # what the learner would see in the cell
            return e
        finally:
            assert results.recorded() == {}, "a cell before the validation recorded a measurement"
        return None

    return run
