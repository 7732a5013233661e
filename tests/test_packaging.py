"""One set of dependencies: pyproject.toml declares it, environment.yml mirrors it; one command per task.

environment.yml is read with PyYAML (papermill, a test dependency, requires it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project runs on 3.11; tomli is the same parser for 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
ENVIRONMENT = ROOT / "environment.yml"
README = ROOT / "README.md"
MAKEFILE = ROOT / "Makefile"
CI = ROOT / ".ci" / "run"
CONSTRAINTS = ROOT / "constraints.txt"

CONDA_TO_PIP = {"pytorch": "torch"}  # conda-forge package name -> PyPI name
NOT_IN_PYPROJECT = {"python", "pip"}  # environment.yml entries with no pyproject dependency line

SPEC = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:(==|>=|<=|~=|!=|=|>|<)\s*([A-Za-z0-9.*+!-]+"
                  r"(?:\s*,\s*(?:==|>=|<=|~=|!=|>|<)\s*[A-Za-z0-9.*+!-]+)*))?\s*$")  # name, or name and specifiers


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _split(requirement: str, conda: bool) -> tuple[str, str]:
    """Return (normalised PyPI name, pip-style spec): 'numpy>=1.26' -> ('numpy', '>=1.26'); conda 'x=1' -> '==1'."""
    m = SPEC.match(requirement)
    assert m, f"cannot read the requirement {requirement!r} (expected name, name>=x, name==x or conda's name=x)"
    name, op, version = m.group(1), m.group(2) or "", re.sub(r"\s+", "", m.group(3) or "")
    if conda:
        name = CONDA_TO_PIP.get(name, name)
        if op == "=":
            op = "=="
    else:
        assert op != "=", f"{requirement!r}: pip has no '=' operator"
    return _norm(name), f"{op}{version}"


def _environment() -> dict:
    if not ENVIRONMENT.exists():
        pytest.skip("environment.yml does not exist yet")
    loaded = yaml.safe_load(ENVIRONMENT.read_text())
    deps = loaded["dependencies"]
    out = {k: v for k, v in loaded.items() if k != "dependencies"}
    out["dependencies"] = [d for d in deps if isinstance(d, str)]
    pips = [d["pip"] for d in deps if isinstance(d, dict)]
    assert len(pips) <= 1, "environment.yml holds more than one pip list"
    if pips:
        out["pip"] = pips[0]
    return out


def _pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


def test_split_reads_pip_and_conda_specs():
    assert _split("pytorch=2.13.0", conda=True) == ("torch", "==2.13.0")
    assert _split("Foo_Bar>=1", conda=False) == ("foo-bar", ">=1")
    assert _split("torch>=2.6, <3", conda=False) == ("torch", ">=2.6,<3")
    with pytest.raises(AssertionError, match="cannot read"):
        _split("numpy >= 1.26; python_version < '3.12'", conda=False)


def test_environment_mirrors_pyproject():
    env = _environment()
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    declared = list(project["dependencies"]) + list(extras["test"]) + list(extras["classroom"])
    want = dict(_split(r, conda=False) for r in declared)
    assert len(want) == len(declared), "a dependency is listed twice in pyproject.toml"
    want.update(_constraints())  # environment.yml installs the versions CI tests (torch's pin), not the ranges

    got: dict[str, str] = {}
    for item in env["dependencies"]:
        name, spec = _split(item, conda=True)
        if name in NOT_IN_PYPROJECT:
            continue
        assert name not in got, f"{name} is listed twice in environment.yml"
        got[name] = spec
    for item in env.get("pip", []):
        if item == "-e .":
            continue
        name, spec = _split(item, conda=False)
        got[name] = spec

    assert got == want, {"only in environment.yml": sorted(set(got.items()) - set(want.items())),
                         "only in pyproject.toml": sorted(set(want.items()) - set(got.items()))}
    assert {"pytest", "nbval"} <= set(got)  # the test extras are part of the environment


def test_environment_installs_labkit_and_a_supported_python():
    env = _environment()
    assert env.get("name") == "fit-the-model"
    assert env.get("channels") == ["conda-forge"]
    assert "pip" in env["dependencies"]
    assert env.get("pip") == ["-e ."]  # labkit itself, editable; everything else comes from conda
    pythons = [d for d in env["dependencies"] if re.match(r"python\s*[=<>]", d)]
    assert len(pythons) == 1
    version = tuple(int(v) for v in re.findall(r"\d+", pythons[0])[:2])
    lowest = tuple(int(v) for v in re.findall(r"\d+", _pyproject()["project"]["requires-python"])[:2])
    assert version >= lowest


def _constraints() -> dict[str, str]:
    """Return {name: '==version'} of constraints.txt."""
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, spec = _split(line, conda=False)
            assert spec.startswith("==") and "," not in spec, f"constraints.txt pins exact versions: {line!r}"
            out[name] = spec
    return out


# The torch APIs labkit and the chapters use that set the floor of its torch range, with the release each
# first appeared in (public, under this name). The floor in pyproject.toml is the newest of them.
TORCH_API_FLOOR = {
    "torch.distributed.fsdp.fully_shard": (2, 6),  # FSDP2, public in torch.distributed.fsdp (before: _composable)
    "torch.distributed.fsdp.MixedPrecisionPolicy": (2, 6),
    "torch.distributed.fsdp.CPUOffloadPolicy": (2, 6),
    "torch.accelerator.is_available": (2, 6),
    "torch.distributed.tensor.DTensor": (2, 5),  # public DTensor (before: torch.distributed._tensor)
    "torch.OutOfMemoryError": (2, 5),
    "torch.distributed.pipelining.ScheduleGPipe": (2, 4),
    "torch.utils.checkpoint.create_selective_checkpoint_contexts": (2, 4),
    "torch._functorch.config.activation_memory_budget": (2, 4),
    "torch.amp.GradScaler": (2, 3),  # torch.amp.GradScaler("cpu")
    "torch._subclasses.fake_tensor.FakeTensorMode": (2, 0),
}


def _torch_spec() -> str:
    deps = [_split(r, conda=False) for r in _pyproject()["project"]["dependencies"]]
    (spec,) = [spec for name, spec in deps if name == "torch"]
    return spec


def test_torch_is_a_range_and_its_exact_pin_lives_in_constraints():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    spec = SpecifierSet(_torch_spec())
    assert {s.operator for s in spec} == {">=", "<"}, f"torch must be a range labkit is tested with, got {spec}"
    pin = _constraints()["torch"]
    assert re.fullmatch(r"==\d+\.\d+\.\d+", pin), pin
    assert Version(pin[2:]) in spec, f"the pinned torch {pin} is outside labkit's range {spec}"
    import torch
    assert torch.__version__.split("+")[0] == pin[2:], "the installed torch is not the pinned one: run make setup"
    for version in ("2.6.0", "2.9.1+cu126", "2.13.0+cpu"):
        assert Version(version) in spec, version
    for version in ("2.5.1", "3.0.0"):
        assert Version(version) not in spec, version


def test_the_torch_floor_is_the_newest_api_labkit_uses():
    import importlib

    import torch
    from packaging.specifiers import SpecifierSet

    floor = next(s.version for s in SpecifierSet(_torch_spec()) if s.operator == ">=")
    assert tuple(int(v) for v in floor.split(".")[:2]) == max(TORCH_API_FLOOR.values()), floor
    for dotted in TORCH_API_FLOOR:
        module, _, attr = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), attr), f"{dotted} is gone from torch {torch.__version__}"


def test_make_setup_and_only_it_uses_the_constraints():
    setup = _make_targets()["$(STAMP)"]
    makefile = MAKEFILE.read_text()
    assert "PIP_INSTALL := $(PY) -m pip install" in makefile and "-c constraints.txt" in makefile
    installs = [line for line in setup if "pip install" in line or "$(PIP_INSTALL)" in line]
    assert len(installs) == 4 and all(line.startswith("$(PIP_INSTALL)") for line in installs), installs
    assert "classroom" in installs[0] and "test" in installs[0]
    assert not re.search(r"==", " ".join(_pyproject()["project"]["dependencies"])), "pins belong in constraints.txt"


def _make_targets() -> dict[str, list[str]]:
    targets: dict[str, list[str]] = {}
    current = None
    for line in MAKEFILE.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.$()-]+)\s*:(?!=)", line)
        if m:
            current = m.group(1)
            targets[current] = []
        elif line.startswith("\t") and current is not None:
            targets[current].append(line.strip())
        elif line.strip() and not line.startswith("#"):
            current = None
    return targets


def test_makefile_has_the_three_commands():
    targets = _make_targets()
    assert {"run", "test", "lab", "student", "grade"} <= set(targets)
    phony = re.search(r"^\.PHONY:(.*)$", MAKEFILE.read_text(), re.M)
    assert phony and {"run", "test", "lab"} <= set(phony.group(1).split())
    test_recipe = " ".join(targets["test"])
    assert "pytest tests" in test_recipe and "--nbval" in test_recipe and "--durations" in test_recipe
    assert "workbook.runner" in " ".join(targets["run"])
    unit_recipe = " ".join(targets["unit"])
    assert '-m "not notebook"' in unit_recipe and "nbval" not in unit_recipe
    assert "workbook.lab" in " ".join(targets["lab"])
    assert "workbook.classroom student" in " ".join(targets["student"])
    assert "workbook.classroom grade" in " ".join(targets["grade"])
    assert "workbook.gpucheck" in " ".join(targets["gpu-check"])


def test_pip_installs_labkit_alone_and_the_library_imports_no_tooling():
    """workbook/ (the repository's tooling) is not installed; labkit imports neither it nor, outside tools/, labkit.tools."""
    import ast

    assert _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"] == ["labkit*"]
    for path in sorted((ROOT / "labkit").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        names += [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
        assert not [m for m in names if m.split(".")[0] == "workbook"], f"{path} imports the repository's tooling"
        if "tools" not in path.relative_to(ROOT).parts:
            assert not [m for m in names if m.startswith("labkit.tools")], f"{path}: library code imports labkit.tools"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA: make gpu-check runs for real")
def test_make_gpu_check_without_cuda_exits_2_with_its_reason():
    import subprocess
    proc = subprocess.run(["make", "-s", "--no-print-directory", "gpu-check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.startswith("make gpu-check needs CUDA:") and proc.stdout.count("\n") == 1, proc.stdout


def test_ci_runs_make_test_and_nothing_else():
    lines = [ln.strip() for ln in CI.read_text().splitlines()]
    commands = [ln for ln in lines if ln and not ln.startswith("#")]
    own = [c for c in commands if not c.startswith(("set ", "cd "))]
    assert own[-1] == "make test", own
    for extra in own[:-1]:  # only: install Debian's Chromium for the browser test when it is missing
        assert extra.startswith("command -v chromium >/dev/null ||") and "apt-get install" in extra, extra
    assert "pytest" not in CI.read_text()
    assert CI.stat().st_mode & 0o111, ".ci/run must be executable"


def test_readme_shows_the_three_commands():
    if not README.exists():
        pytest.skip("README.md does not exist yet")
    text = README.read_text()
    code = "\n".join(re.findall(r"```[^\n]*\n(.*?)```", text, re.S))  # fenced code blocks
    for command in ("make run", "make test", "make lab"):
        assert re.search(rf"^\s*{command}\b", code, re.M), f"README has no code line starting with `{command}`"


def test_binder_postbuild_installs_the_lab_settings(tmp_path):
    """Binder runs postBuild after environment.yml: it writes overrides.json that answers the news prompt."""
    import json
    import os
    import subprocess
    import sys

    postbuild = ROOT / "postBuild"
    assert postbuild.stat().st_mode & 0o111, "postBuild must be executable"
    env = dict(os.environ, LAB_SETTINGS_PREFIX=str(tmp_path), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    subprocess.run(["bash", str(postbuild)], check=True, env=env, cwd=ROOT, capture_output=True)
    overrides = json.loads((tmp_path / "share" / "jupyter" / "lab" / "settings" / "overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"] == {"fetchNews": "false", "checkForUpdates": False}
    assert "urlpath=lab/tree/notebooks/00_where_the_memory_goes.ipynb" in README.read_text()  # Binder opens chapter 00
