"""Write a notebook's `%%writefile` files next to it without running it (the rank scripts, for torchrun).

    python -m labkit.tools.writefiles notebooks/06_model_and_tensor_parallel.ipynb
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MAGIC = "%%writefile"


def written_files(nb) -> list[tuple[str, str]]:
    """Return (path, text) for every `%%writefile` cell of a notebook, in order (later cells win)."""
    out = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        first, _, body = cell.source.partition("\n")
        if first.startswith(MAGIC + " "):
            args = first[len(MAGIC):].split()
            if args[0] in ("-a", "--append"):
                raise ValueError(f"{MAGIC} --append is not supported: {first!r}")
            out.append((args[-1], body if body.endswith("\n") else body + "\n"))
    return out


def write(notebook: str | Path) -> list[Path]:
    """Write the notebook's `%%writefile` files next to it; return their paths."""
    import nbformat

    notebook = Path(notebook)
    written = []
    for name, text in written_files(nbformat.read(notebook, as_version=4)):
        path = notebook.parent / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """Write the files of each notebook given."""
    parser = argparse.ArgumentParser(prog="python -m labkit.tools.writefiles", description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", help="notebook files")
    args = parser.parse_args(argv)
    for nb in args.notebooks:
        if not Path(nb).is_file():
            parser.error(f"{nb!r}: no such notebook")
        for path in write(nb):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
