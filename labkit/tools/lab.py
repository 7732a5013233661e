"""JupyterLab for a classroom: on the chapters, on the first one, with no prompt and a fresh layout.

    python -m labkit.tools.lab [jupyter lab options]     # what `make lab` runs
    python -m labkit.tools.lab --install-settings PREFIX  # what Binder's postBuild runs

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

ROOT = Path(__file__).resolve().parents[2]
FIRST_CHAPTER = "00_where_the_memory_goes.ipynb"
OVERRIDES = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}}


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


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--install-settings"]:
        print(install_settings(args[1] if len(args) > 1 else sys.prefix))
        return 0
    install_settings()
    workspaces = Path(tempfile.mkdtemp(prefix="labkit-lab-workspaces-"))  # a fresh layout on every start
    try:
        import subprocess

        return subprocess.call(command(ROOT / "notebooks", workspaces, args))
    except KeyboardInterrupt:
        return 130
    finally:
        shutil.rmtree(workspaces, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
