"""The way in from a hosted notebook (Colab, Kaggle) or an existing CUDA environment, reproduced on this machine.

Environments here are fresh virtual environments that see the project's installed packages through a view of
its site-packages (symlinks, without labkit): "an environment with Jupyter and torch already installed", built
in a second. A torch of another version is a fake dist-info (pip reads only its metadata): nothing here
downloads or installs a real torch.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import site
import subprocess
import sys
import time
import venv
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from labkit.results import BUILD_DIR_ENV, build_dir
from workbook import hosted
from workbook.nbcheck import find_notebooks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
README = ROOT / "README.md"
HOSTED_CHAPTER = "01_gradient_accumulation.ipynb"  # the chapter whose opening runs in the fresh environment


# -- the cells every chapter carries --------------------------------------------------------------------------
def test_every_chapter_has_the_links_and_the_canonical_install_cell():
    chapters = find_notebooks(NOTEBOOKS)
    assert [p.name.split("_")[0] for p in chapters] == [f"{i:02d}" for i in range(7)] + ["06b"] + [f"{i:02d}" for i in range(7, 11)]
    assert hosted.apply(NOTEBOOKS, check=True) == [], "run: python -m workbook.hosted notebooks"
    for path in chapters:
        cells = json.loads(path.read_text())["cells"]
        assert hosted.links_line(path.name) in "".join(cells[0]["source"]), path.name
        install = cells[1]
        assert install["id"] == hosted.INSTALL_CELL_ID and install["cell_type"] == "code"
        assert "".join(install["source"]) == hosted.install_cell_source() and install["outputs"] == []
        first_import = next(i for i, c in enumerate(cells)
                            if c["cell_type"] == "code" and "import labkit" in "".join(c["source"]))
        assert first_import > 1, f"{path.name}: labkit is imported before the cell that installs it"


def test_apply_replaces_an_edited_cell_and_is_idempotent(tmp_path):
    src = NOTEBOOKS / HOSTED_CHAPTER
    nb = json.loads(src.read_text())
    nb["cells"][1]["source"] = ["print('an old install cell')\n"]
    nb["cells"][0]["source"] = [ln.replace("<owner>", "someone") for ln in nb["cells"][0]["source"]]
    (tmp_path / src.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    assert hosted.main([str(tmp_path), "--check"]) == 1
    assert hosted.main([str(tmp_path)]) == 0
    assert (tmp_path / src.name).read_text() == src.read_text()
    assert hosted.apply(tmp_path) == []  # a second run changes nothing
    published = hosted.with_hosted_cells(json.loads(src.read_text()), src.name, repository="ann/fit")
    assert "colab.research.google.com/github/ann/fit/blob/main/notebooks/01_" in "".join(published["cells"][0]["source"])
    assert '"git+https://github.com/ann/fit"' in "".join(published["cells"][1]["source"])


def _run_install_cell(monkeypatch, labkit_found: bool) -> str:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (real(name, *a) if labkit_found or name != "labkit"
                                                                       else None))

    def no_pip(*args, **kwargs):
        raise AssertionError(f"the cell ran {args}")

    monkeypatch.setattr(subprocess, "run", no_pip)
    out = io.StringIO()
    with redirect_stdout(out):
        exec(compile(hosted.install_cell_source(), "<install cell>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def test_the_install_cell_does_nothing_in_the_checkout_and_says_so(monkeypatch):
    import torch
    out = _run_install_cell(monkeypatch, labkit_found=True)
    assert out == f"labkit from {ROOT / 'labkit'}; torch=={torch.__version__} as it was\n"


def test_the_install_cell_accepts_a_checkout_on_the_path_without_package_metadata(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version

    def not_installed(name):
        if name == "labkit":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)  # PYTHONPATH=checkout, never pip-installed
    out = _run_install_cell(monkeypatch, labkit_found=True)
    assert out.startswith(f"labkit from {ROOT / 'labkit'}; torch=="), out


def test_the_install_cell_refuses_the_placeholder_address_naming_the_variable(monkeypatch):
    monkeypatch.delenv(hosted.SOURCE_ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"does not know labkit's repository: set {hosted.SOURCE_ENV}"):
        _run_install_cell(monkeypatch, labkit_found=False)


def test_readme_links_every_chapter_and_shares_the_binder_placeholder():
    text = README.read_text()
    binder = re.search(r"https://mybinder\.org/v2/gh/(\S+?)/HEAD", text)
    assert binder and binder.group(1) == hosted.REPOSITORY
    for path in find_notebooks(NOTEBOOKS):
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| `{path.stem}`"))
        assert f"colab.research.google.com/github/{hosted.REPOSITORY}/blob/{hosted.BRANCH}/notebooks/{path.name}" in row
        assert f"kaggle.com/kernels/welcome?src=https://github.com/{hosted.REPOSITORY}/blob/" in row
    assert hosted.SOURCE_ENV in text and "python -m labkit.tools.gpucheck" in text


def test_readme_shows_the_one_line_install_and_explains_every_gpu_check_row():
    from labkit.tools import gpucheck

    text = README.read_text()
    one_line = (f'pip install "git+https://github.com/{hosted.REPOSITORY}" '
                '"torch==$(python -c \'import torch; print(torch.__version__)\')"')
    assert one_line in text, "README lost the one-line install into an environment that has its torch"
    for check in gpucheck.CHECKS:  # the rows `python -m labkit.tools.gpucheck` prints
        assert re.search(rf"^{check}\s+ok\s", text, re.M), f"README's healthy run has no {check} row"
        assert re.search(rf"^\| `{check}` \|[^|]+\|[^|]+\|[^|]+\|$", text, re.M), f"README does not explain the {check} row"


# -- where the chapters write --------------------------------------------------------------------------------
def test_build_dir_in_the_checkout_the_working_directory_or_the_temp_folder(monkeypatch, tmp_path):
    from labkit import results
    from labkit.search.storage import default_build_dir

    monkeypatch.delenv(BUILD_DIR_ENV, raising=False)
    assert build_dir("search") == ROOT / "build" / "search" == default_build_dir()  # make setup's editable labkit
    monkeypatch.setattr(results, "checkout_root", lambda: None)  # labkit from a wheel
    monkeypatch.chdir(tmp_path)
    assert build_dir("search") == tmp_path / "build" / "search" and (tmp_path / "build" / "search").is_dir()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setattr(Path, "cwd", classmethod(lambda cls: blocked))  # build/ cannot be made there
    fallback = build_dir("search")
    assert fallback.parent.name.startswith("labkit-build-") and fallback.is_dir() and os.access(fallback, os.W_OK)
    monkeypatch.setenv(BUILD_DIR_ENV, str(tmp_path / "mine"))
    assert build_dir("search") == tmp_path / "mine" / "search"
    monkeypatch.setenv(BUILD_DIR_ENV, str(blocked))
    with pytest.raises(OSError):
        build_dir("search")  # asked for and impossible: said, not silently moved


# -- environments that already have a torch ------------------------------------------------------------------
def _labkit_source(tmp_path: Path) -> Path:
    """Copy what pip needs to build labkit (pyproject, README, the package) out of the checkout."""
    src = tmp_path / "labkit-src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "labkit", src / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    return src


def _environment(tmp_path: Path, keep_torch: bool, fake_torch: str | None = None) -> Path:
    """Make a fresh venv that sees this one's packages without labkit (and without torch unless keep_torch).

    fake_torch: a torch of that version instead (a `torch` package holding only `__version__`, and its dist-info).
    """
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env)
    view = tmp_path / "site-view"
    view.mkdir()
    ours = Path(site.getsitepackages()[0])
    for entry in ours.iterdir():
        name = entry.name.lower()
        if "labkit" in name or (not keep_torch and (name == "torch" or name.startswith("torch-"))):
            continue
        (view / entry.name).symlink_to(entry)
    pure = Path(subprocess.run([env / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (pure / "zz_project_view.pth").write_text(f"import site; site.addsitedir({str(view)!r})\n")
    if fake_torch:
        _fake_dist(pure, "torch", fake_torch)
        (pure / "torch").mkdir()
        (pure / "torch" / "__init__.py").write_text(f"__version__ = {fake_torch!r}\n")
    return env


def _fake_dist(where: Path, name: str, version: str) -> Path:
    info = where / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "WHEEL").write_text("Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    return info


def _fake_wheel_index(tmp_path: Path, version: str = "2.13.0") -> Path:
    """Return a folder holding a torch wheel of `version` with nothing in it: an index pip can resolve against offline."""
    import zipfile

    index = tmp_path / "index"
    index.mkdir()
    with zipfile.ZipFile(index / f"torch-{version}-py3-none-any.whl", "w") as whl:
        for file in _fake_dist(tmp_path / "wheel", "torch", version).iterdir():
            whl.write(file, f"{file.parent.name}/{file.name}")
    return index


# pip offline: no index, no config file (the machine's find-links), no build isolation ("0" turns it off in pip's
# reading); labkit builds with the setuptools the environment sees
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_NO_BUILD_ISOLATION": "0"}


def _dry_run(env: Path, *args: str) -> dict[str, str]:
    """Return {name: version} that `pip install` would install into env (offline; labkit from this checkout)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install",
                           "--disable-pip-version-check", "--dry-run", "--quiet", "--report", "-", *args],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}


def _install_cell(env: Path, src: Path) -> subprocess.CompletedProcess:
    """Run the chapters' install cell in env's Python, pointed at src."""
    return subprocess.run([env / "bin" / "python", "-c", hosted.install_cell_source()], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **OFFLINE, hosted.SOURCE_ENV: str(src)}, cwd=env)


def _dists(env: Path, name: str) -> list[str]:
    return sorted(p.name for p in env.glob(f"lib/python*/site-packages/{name}-*.dist-info"))


@pytest.mark.parametrize("allowed", ["2.6.0", "2.9.1+cu126"])  # the floor, and a Colab-style CUDA build
def test_installing_labkit_keeps_an_allowed_torch(tmp_path, allowed):
    env = _environment(tmp_path, keep_torch=False, fake_torch=allowed)
    src = _labkit_source(tmp_path)
    index = _fake_wheel_index(tmp_path)  # a newer torch pip could take, were it asked to
    plan = _dry_run(env, "--find-links", str(index), str(src))
    assert plan == {"labkit": "0.1.0"}, plan  # torch (and everything else) already satisfies labkit
    readme_line = _dry_run(env, "--find-links", str(index), str(src), f"torch=={allowed}")  # README's one-line install
    assert readme_line == {"labkit": "0.1.0"}, readme_line
    proc = _install_cell(env, src)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.fullmatch(rf"labkit from {re.escape(str(env))}/lib/python[\d.]+/site-packages/labkit; "
                        rf"torch=={re.escape(allowed)} as it was\n", proc.stdout), proc.stdout
    assert _dists(env, "torch") == [f"torch-{allowed}.dist-info"] and _dists(env, "labkit") == ["labkit-0.1.0.dist-info"]


def test_a_torch_outside_the_range_is_refused_and_kept(tmp_path):
    env = _environment(tmp_path, keep_torch=False, fake_torch="2.5.1")
    src = _labkit_source(tmp_path)
    plan = _dry_run(env, "--find-links", str(_fake_wheel_index(tmp_path)), str(src))
    assert plan == {"labkit": "0.1.0", "torch": "2.13.0"}, plan  # a plain pip would replace it: hence the cell's pin
    proc = _install_cell(env, src)
    assert proc.returncode != 0
    message = proc.stderr[proc.stderr.index("RuntimeError"):]
    assert message.startswith("RuntimeError: labkit was not installed; torch==2.5.1 left as it was. pip said:"), message
    assert "ResolutionImpossible" in message, message
    assert re.search(r"labkit 0\.1\.0 depends on torch<3(\.0)?(,| and )>=2\.6", message), message
    assert _dists(env, "torch") == ["torch-2.5.1.dist-info"] and _dists(env, "labkit") == []


# -- the hosted-notebook path, end to end --------------------------------------------------------------------
def _opening(nb: dict) -> dict:
    """Return the chapter cut after its validation cell: the install cell, hardware, setup, parameters, validation."""
    code = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    tagged = [i for i in code if "parameters" in nb["cells"][i]["metadata"].get("tags", [])]
    assert len(tagged) == 1, tagged
    validation = next(i for i in code if i > tagged[0])
    return {**nb, "cells": nb["cells"][:validation + 1]}


# every module of the package, imported; the files pip installed, listed (no __pycache__)
INSTALLED = ("import importlib, json, pathlib, pkgutil, torch, labkit; root = pathlib.Path(labkit.__file__).parent; "
             "[importlib.import_module(m.name) for m in pkgutil.walk_packages(labkit.__path__, 'labkit.')]; "
             "from labkit.search.storage import default_build_dir; "
             "print(json.dumps({'torch': [torch.__version__, torch.__file__], 'labkit': labkit.__file__, "
             "'build_dir': str(default_build_dir()), 'files': sorted(p.relative_to(root).as_posix() "
             "for p in root.rglob('*') if p.is_file() and '__pycache__' not in p.parts)}))")  # (one process: each
#   start imports torch, seconds on two cores)


@pytest.mark.notebook
def test_a_chapter_runs_from_an_empty_folder_in_a_fresh_environment(tmp_path):
    """An empty folder, one chapter, a venv with Jupyter and torch but no labkit: the first cell installs it.

    The chapter runs under papermill through its validation cell: the install cell, the hardware report, every
    import of its setup, its parameters checked. The rest of it runs twice per `make test` already (nbval, and
    tests/test_nb01.py in the browser) with labkit from this checkout; what the fresh environment could lack
    beyond that, a module or file pip left out of the installed package, is checked on the whole package: every
    module imports there and the installed modules are the checkout's.
    """
    env = _environment(tmp_path, keep_torch=True)
    python = env / "bin" / "python"
    folder = tmp_path / "colab"
    folder.mkdir()
    (folder / HOSTED_CHAPTER).write_text(json.dumps(_opening(json.loads((NOTEBOOKS / HOSTED_CHAPTER).read_text()))))
    probe = "import torch, importlib.util; print(torch.__version__, torch.__file__, importlib.util.find_spec('labkit'))"

    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JUPYTER", "VIRTUAL_ENV"))}
    environ.update({**OFFLINE, hosted.SOURCE_ENV: str(_labkit_source(tmp_path)), "JUPYTER_DATA_DIR": str(tmp_path / "jupyter"),
                    "PATH": f"{env / 'bin'}:{environ.get('PATH', '')}", "LABKIT_BATCH": "1"})
    before = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True, cwd=folder,
                            env=environ).stdout
    assert before.endswith(" None\n"), before  # labkit cannot be imported before the first cell runs
    kernel = tmp_path / "jupyter" / "kernels" / "python3"  # the user's kernel dir comes before any system one
    kernel.mkdir(parents=True)
    (kernel / "kernel.json").write_text(json.dumps({"argv": [str(python), "-m", "ipykernel_launcher", "-f",
                                                             "{connection_file}"],
                                                    "display_name": "Python 3 (ipykernel)", "language": "python"}))
    t0 = time.perf_counter()
    proc = subprocess.run([python, "-m", "papermill", HOSTED_CHAPTER, "out.ipynb", "--cwd", str(folder)],
                          cwd=folder, env=environ, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    cells = json.loads((folder / "out.ipynb").read_text())["cells"]
    said = "".join("".join(o.get("text", "")) for o in cells[1]["outputs"])
    assert re.fullmatch(rf"labkit from {re.escape(str(env))}/lib/python[\d.]+/site-packages/labkit; torch==\S+ as it was\n",
                        said), said  # installed into the environment, its torch kept
    installed = subprocess.run([python, "-c", INSTALLED], capture_output=True, text=True, cwd=folder, env=environ)
    assert installed.returncode == 0, installed.stderr[-3000:]  # every module imports in the fresh environment
    try:
        after = json.loads(installed.stdout.splitlines()[-1])  # (its last line: what an import printed comes before)
    except (IndexError, ValueError):
        pytest.fail(f"the probe's last line is not its JSON: {installed.stdout[-3000:]}")
    assert after["torch"] == before.split()[:2], (before, after["torch"])  # same torch version, same files
    assert after["labkit"].startswith(str(env)), after["labkit"]  # installed into the fresh environment, not ours
    ours = sorted(p.relative_to(ROOT / "labkit").as_posix() for p in (ROOT / "labkit").rglob("*")
                  if "__pycache__" not in p.parts and (p.suffix == ".py" or p.parent.name == "data" and p.is_file()))
    assert after["files"] == ours  # pip installed every module of the package and its data (published runs)
    assert "data/published_runs.json" in ours
    assert after["build_dir"] == str(folder / "build" / "search"), after["build_dir"]  # the chapters write beside the notebook
    check = subprocess.run([python, "-m", "labkit.tools.gpucheck"], capture_output=True, text=True, cwd=folder, env=environ)
    assert check.returncode == 2 and check.stdout.startswith("make gpu-check needs CUDA:"), check.stdout + check.stderr
    print(f"hosted path: chapter {HOSTED_CHAPTER[:2]}'s opening with the install in {seconds:.1f} s")
