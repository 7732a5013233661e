"""`make lab` serves JupyterLab on notebooks/ with token authentication on."""

import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _get(url: str) -> tuple[int, str]:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(url, timeout=60) as r:  # a loaded 2-core machine: the server answers late, not never
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""


def _first_answer(url: str, proc, log, wait_s: float = 60.0) -> tuple[int, str]:
    """GET `url` once the server accepts connections; fail with the server's log if it never does."""
    deadline = time.time() + wait_s
    while True:
        try:
            return _get(url)
        except urllib.error.URLError as e:
            if not isinstance(e.reason, ConnectionRefusedError) or time.time() > deadline or proc.poll() is not None:
                log.seek(0)
                raise AssertionError(f"no answer from {url} ({e.reason}); server exit status {proc.poll()}; "
                                     f"its log:\n{log.read()}") from e
            time.sleep(0.5)


def test_make_lab_serves_notebooks_with_a_token(tmp_path):
    args = "--no-browser --ip=127.0.0.1 --port=0"  # the port the system gives the server: none to lose to another
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    log = open(tmp_path / "lab.log", "w+")
    proc = subprocess.Popen(["make", "-s", "lab", f"LAB_ARGS={args}"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        token = None
        deadline = time.time() + 90
        while time.time() < deadline and token is None:
            time.sleep(0.5)
            log.seek(0)
            found = re.search(r"http://127\.0\.0\.1:(\d+)/lab[^?\s]*\?token=([0-9a-f]+)", log.read())
            port, token = found.groups() if found else (None, None)
            if proc.poll() is not None:
                log.seek(0)
                raise AssertionError(f"make lab exited early:\n{log.read()}")
        assert token, "no token URL printed: token authentication must be on"
        base = f"http://127.0.0.1:{port}"
        status, _ = _first_answer(f"{base}/api/contents", proc, log)
        assert status in (401, 403), f"the API answered {status} without a token"
        status, body = _get(f"{base}/api/contents?token={token}")
        assert status == 200
        assert "00_where_the_memory_goes.ipynb" in body  # served from notebooks/
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        log.close()


def _page_config(root: Path, env: dict, tmp_path: Path) -> dict:
    """Start JupyterLab as workbook.lab does on `root` with `env`; return the page config of its /lab page."""
    import json
    import secrets

    import labdriver

    from workbook import lab

    token = secrets.token_hex(8)
    env = {**env, "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    (tmp_path / "ws").mkdir(parents=True)
    argv = lab.command(root, tmp_path / "ws", ["--no-browser", "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0",
                                               f"--IdentityProvider.token={token}"])
    log = open(tmp_path / "lab.log", "w+")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = labdriver.jupyter_url(tmp_path / "rt", proc, tmp_path / "lab.log", 90)
        status, body = _first_answer(f"{url}/lab?token={token}", proc, log, wait_s=90)
        assert status == 200, status
        found = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', body, re.S)
        assert found, body[:2000]
        return json.loads(found.group(1))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def test_the_student_lab_switches_off_only_nbgrader_teacher_tools(tmp_path):
    from workbook import lab

    (tmp_path / "nb").mkdir()
    teacher = _page_config(tmp_path / "nb", dict(os.environ), tmp_path / "teacher")
    assert not set(lab.TEACHER_PLUGINS) & set(teacher["disabledExtensions"])
    assert "@jupyter/nbgrader" in [e["name"] for e in teacher["federated_extensions"]]  # the teacher's lab has them
    env = lab.student_env(tmp_path / "student-config", dict(os.environ, JUPYTER_CONFIG_PATH="/elsewhere"))
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep) == [str(tmp_path / "student-config"), "/elsewhere"]
    student = _page_config(tmp_path / "nb", env, tmp_path / "student")
    assert set(lab.TEACHER_PLUGINS) <= set(student["disabledExtensions"])
    assert "@jupyter/nbgrader:validate-assignment" not in student["disabledExtensions"]  # a student's Validate button stays
    import sys

    bundle = "".join(p.read_text(errors="replace") for p in
                     (Path(sys.prefix) / "share/jupyter/labextensions/@jupyter/nbgrader/static").glob("*.js"))
    missing = [p for p in lab.TEACHER_PLUGINS if f'"{p}"' not in bundle]
    assert not missing, f"nbgrader's lab extension has no plugins {missing}: disabling them does nothing"


def test_make_lab_student_passes_the_flag():
    out = subprocess.run(["make", "-n", "lab", "STUDENT=1"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "workbook.lab --student" in out
    out = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "workbook.lab" in out and "--student" not in out
