"""JupyterLab for a classroom: on the chapters, on the first one, with no prompt and a fresh layout.

    python -m workbook.lab [jupyter lab options]     # what `make lab` runs
    python -m workbook.lab --student [options]       # `make lab STUDENT=1`: the student copies
    python -m workbook.lab --install-settings PREFIX  # what Binder's postBuild runs

`--student` writes the student copies first (`make student`: build/student/, exercises stubbed,
their checks kept) and serves those, with nbgrader's teacher tools (the Create Assignment panel,
Formgrader, the course and assignment lists, its menu) switched off in that lab only: a
`labconfig/page_config.json` in a folder of its own on JUPYTER_CONFIG_PATH. nbgrader's Validate
button stays.

JupyterLab asks on first start whether to fetch Jupyter's news and checks for updates: a room of
students each answering a popup. `overrides.json` in the environment's lab settings folder answers
for them (a student can still change it in Settings). Each start gets an empty workspaces folder,
so the layout is the default one, whatever the last session left open.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_CHAPTER = "00_where_the_memory_goes.ipynb"
OVERRIDES = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}}
STUDENT_DIR = ROOT / "build" / "student"
TEACHER_PLUGINS = tuple(f"@jupyter/nbgrader:{p}" for p in ("create-assignment", "formgrader", "course-list",
                                                            "assignment-list", "menu"))  # off in the student lab


def install_settings(prefix: str | Path = sys.prefix) -> Path:
    """Write the classroom's settings into PREFIX/share/jupyter/lab/settings/overrides.json, keeping others."""
    path = Path(prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(path.read_text()) if path.exists() else {}
    for plugin, values in OVERRIDES.items():
        current[plugin] = {**current.get(plugin, {}), **values}
    path.write_text(json.dumps(current, indent=2) + "\n")
    return path


def command(notebooks: Path, workspaces: Path, extra: list[str]) -> list[str]:
    """Return the `jupyter lab` command line: root at `notebooks`, the first chapter open, no update check."""
    argv = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={notebooks}",
            f"--LabApp.default_url=/lab/tree/{FIRST_CHAPTER}", f"--LabApp.workspaces_dir={workspaces}",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        argv.append("--allow-root")  # containers and CI run as root
    return argv + list(extra)


def student_env(config: Path, env: dict | None = None) -> dict:
    """Return `env` (default: os.environ) with nbgrader's teacher plugins disabled through a config folder `config`."""
    env = dict(os.environ if env is None else env)
    page = Path(config) / "labconfig" / "page_config.json"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(json.dumps({"disabledExtensions": {p: True for p in TEACHER_PLUGINS}}, indent=2) + "\n")
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(p for p in (str(config), env.get("JUPYTER_CONFIG_PATH")) if p)
    return env


def student_copies(out: Path = STUDENT_DIR) -> Path:
    """Write the student copy of every chapter to `out` (what `make student` does); return `out`."""
    from workbook import classroom

    classroom.build_student_copies(ROOT / "notebooks", ROOT / "build" / "classroom", out)
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--install-settings"]:
        print(install_settings(args[1] if len(args) > 1 else sys.prefix))
        return 0
    student = "--student" in args
    args = [a for a in args if a != "--student"]
    install_settings()
    root, env = ROOT / "notebooks", dict(os.environ)
    scratch = Path(tempfile.mkdtemp(prefix="labkit-lab-"))  # an empty workspaces folder: a fresh layout on every start
    (scratch / "workspaces").mkdir()
    try:
        import subprocess

        if student:
            print(f"writing the student copies to {STUDENT_DIR} (exercises stubbed, checks kept) ...", flush=True)
            root, env = student_copies(), student_env(scratch / "config", env)
        return subprocess.call(command(root, scratch / "workspaces", args), env=env)
    except KeyboardInterrupt:
        return 130
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
