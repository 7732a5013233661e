"""Give every chapter its way in from a hosted notebook: Colab and Kaggle links, and a cell that installs labkit.

    python -m workbook.hosted notebooks            # write the links and the install cell into every chapter
    python -m workbook.hosted notebooks --check    # exit 1, naming the chapters, where either differs

Each chapter's first markdown cell carries an "Open in Colab / Kaggle" line, and its first code cell
(`INSTALL_CELL_ID`) installs labkit when it is missing: from the repository's address (the placeholder
`<owner>/<repository>` of the README's Binder link until the repository is published), or from
`$LABKIT_SOURCE` (any pip address: a git URL, a folder, a wheel). It pins the torch already installed, so
pip keeps it or refuses; in the project's checkout (`make setup` installed labkit) it does nothing. Both are
written by this tool and nowhere by hand: run it again after editing a chapter's first cells.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workbook.nbcheck import find_notebooks

REPOSITORY = "<owner>/<repository>"  # GitHub owner/name; the README's Binder link uses the same placeholder
BRANCH = "main"  # the branch Colab and Kaggle open
SOURCE_ENV = "LABKIT_SOURCE"  # the one variable that points the install cell elsewhere (a folder, a git URL)
INSTALL_CELL_ID = "labkit-install"
LINKS_MARK = "colab.research.google.com"  # how the links line is found again in the first markdown cell

INSTALL_CELL = '''\
# Colab, Kaggle or a Jupyter without labkit: pip installs it and keeps this machine's torch ({env}: a folder,
# git or wheel address to install from instead). In the project's checkout (`make setup`) nothing happens.
import importlib, importlib.metadata as meta, importlib.util as util, os, subprocess, sys

source = os.environ.get("{env}") or "git+https://github.com/{repository}"
keep = [f"torch=={{meta.version('torch')}}"] if util.find_spec("torch") else []  # pip keeps that torch or refuses
if util.find_spec("labkit") is None:
    if "<owner>" in source:
        raise RuntimeError("this copy of the notebook does not know labkit's repository: set {env} to its pip "
                           "address (git+https://github.com/OWNER/NAME or a folder) and run this cell again")
    pip = subprocess.run([sys.executable, "-m", "pip", "install", source, *keep], capture_output=True, text=True)
    if pip.returncode:
        raise RuntimeError(f"labkit was not installed; {{' '.join(keep) or 'torch'}} left as it was. pip said:\\n"
                           + (pip.stdout[-1500:] + pip.stderr[-1500:]).strip())
    importlib.invalidate_caches()
print(f"labkit from {{os.path.dirname(util.find_spec('labkit').origin)}}; {{' '.join(keep) or 'no torch'}} as it was")'''


def install_cell_source(repository: str = REPOSITORY) -> str:
    """Return the source of the install cell for labkit at github.com/`repository`."""
    return INSTALL_CELL.format(env=SOURCE_ENV, repository=repository)


def links_line(notebook_name: str, repository: str = REPOSITORY, branch: str = BRANCH) -> str:
    """Return the markdown line with the chapter's Colab and Kaggle links."""
    path = f"{repository}/blob/{branch}/notebooks/{notebook_name}"
    return (f"[Open in Colab](https://colab.research.google.com/github/{path}) · "
            f"[Open in Kaggle](https://kaggle.com/kernels/welcome?src=https://github.com/{path}) · "
            "or run it here after `make setup`")


def with_hosted_cells(nb: dict, notebook_name: str, repository: str = REPOSITORY, branch: str = BRANCH) -> dict:
    """Return the notebook (a JSON dict) with the links line and the install cell in place, replacing old ones."""
    nb = json.loads(json.dumps(nb))
    cells = nb["cells"]
    first = cells[0]
    if first["cell_type"] != "markdown" or not "".join(first["source"]).startswith("# "):
        raise ValueError(f"{notebook_name}: the first cell must be the markdown title cell ('# NN · Title')")
    lines = "".join(first["source"]).split("\n")
    lines = [ln for ln in lines if LINKS_MARK not in ln]
    if len(lines) > 1 and lines[1] == "" and len(lines) > 2 and lines[2] == "":
        del lines[1]  # the blank line the links line stood between
    lines[1:1] = ["", links_line(notebook_name, repository, branch)]
    first["source"] = _source_list("\n".join(lines))
    cells[:] = [c for c in cells if c.get("id") != INSTALL_CELL_ID]
    cells.insert(1, {"cell_type": "code", "execution_count": None, "id": INSTALL_CELL_ID, "metadata": {},
                     "outputs": [], "source": _source_list(install_cell_source(repository))})
    return nb


def _source_list(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _dump(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def apply(folder: str | Path, check: bool = False, repository: str = REPOSITORY, branch: str = BRANCH) -> list[Path]:
    """Write the links and install cell into every chapter of `folder` (check: write nothing); return those changed."""
    differ = []
    for path in find_notebooks(folder):
        text = path.read_text(encoding="utf-8")
        new = _dump(with_hosted_cells(json.loads(text), path.name, repository, branch))
        if new != text:
            differ.append(path)
            if not check:
                path.write_text(new, encoding="utf-8")
    return differ


def main(argv: list[str] | None = None) -> int:
    """Apply or check the hosted-notebook cells of every chapter in a folder."""
    p = argparse.ArgumentParser(prog="python -m workbook.hosted", description=__doc__.splitlines()[0])
    p.add_argument("folder", nargs="?", default="notebooks", help="folder of chapter notebooks (default notebooks)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 naming the chapters that differ")
    p.add_argument("--repository", default=REPOSITORY, help=f"GitHub owner/name (default the placeholder {REPOSITORY})")
    p.add_argument("--branch", default=BRANCH, help=f"branch the links open (default {BRANCH})")
    args = p.parse_args(argv)
    if not find_notebooks(args.folder):
        p.error(f"{args.folder!r}: no chapter notebooks (NN_*.ipynb)")
    differ = apply(args.folder, check=args.check, repository=args.repository, branch=args.branch)
    for path in differ:
        print(f"{'differs' if args.check else 'wrote'} {path}")
    if args.check and differ:
        print("run: python -m workbook.hosted " + args.folder)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
