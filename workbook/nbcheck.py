"""Prepare notebooks for nbval: checked cells carry their expected output in their own source.

Notebooks are committed without outputs, so nbval has nothing stored to compare a checked cell
with. Instead, a cell marked `# NBVAL_CHECK_OUTPUT` ends with its expected output, written as a
comment block that readers see too:

    # NBVAL_CHECK_OUTPUT
    assert ratio < 1
    print("PASS: offload lowers the device peak")
    # Expected output:
    # PASS: offload lowers the device peak

`python -m workbook.nbcheck notebooks build/nbval` copies every numbered notebook into
`build/nbval/`, with those expected lines stored as the cell's output; `make test` runs
`pytest --nbval-lax` on the copies.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from pathlib import Path

NOTEBOOK_GLOB = "[0-9][0-9]*_*.ipynb"
CHAPTER_NAME = re.compile(r"\d\d[a-z]?_")  # "06_...", and "06b_..." for a chapter that follows 06

CHECK_MARKER = "# NBVAL_CHECK_OUTPUT"
EXPECT_HEADER = "# Expected output:"


def expected_output(source: str) -> str | None:
    """Return the expected stdout declared at the end of a cell's source (None when absent)."""
    lines = source.splitlines()
    try:
        start = max(i for i, line in enumerate(lines) if line.strip() == EXPECT_HEADER)
    except ValueError:
        return None
    body = []
    for line in lines[start + 1:]:
        if not line.startswith("#"):
            raise ValueError(f"lines after {EXPECT_HEADER!r} must all be comments, got {line!r}")
        body.append(line[2:] if line.startswith("# ") else line[1:])
    return "\n".join(body) + "\n"


def with_expected_outputs(nb):
    """Return the notebook with each checked cell's expected output stored as its output."""
    import nbformat

    nb = nbformat.from_dict(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        cell.outputs = []
        cell.execution_count = None
        if CHECK_MARKER in cell.source:
            text = expected_output(cell.source)
            if text is None:
                raise ValueError(f"cell {i} is marked {CHECK_MARKER} but declares no '{EXPECT_HEADER}' block")
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
            cell.execution_count = i + 1  # nbval refuses outputs on a cell that looks unrun
    return nb


def pass_lines_by_section(nb) -> dict[str, int]:
    """Count the PASS lines an executed notebook printed under each heading (any level; "(top)" before the first)."""
    counts: dict[str, int] = {}
    section = "(top)"
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            headings = [line.lstrip("#").strip() for line in cell.source.splitlines() if line.startswith("#")]
            section = headings[-1] if headings else section
            continue
        for out in cell.get("outputs", []):
            text = out.get("text", "") if out.get("output_type") == "stream" else ""
            text = "".join(text) if isinstance(text, list) else text
            n = sum(line.startswith("PASS") for line in text.splitlines())
            if n:
                counts[section] = counts.get(section, 0) + n
    return counts


def find_notebooks(dir: str | Path, only: Iterable[str] = ()) -> list[Path]:
    """Return the numbered notebooks in `dir`, sorted, keeping those whose name contains any `only` pattern."""
    only = tuple(only)
    found = []
    for path in sorted(Path(dir).glob(NOTEBOOK_GLOB)):
        if ".student" in path.name or "checkpoints" in path.parts or not CHAPTER_NAME.match(path.name):
            continue
        if only and not any(pattern in path.name for pattern in only):
            continue
        found.append(path)
    return found


def crowded_sections(nb) -> list[str]:
    """Return "heading: n PASS lines" for each section of an executed notebook that printed more than one."""
    return [f"{s}: {n} PASS lines" for s, n in pass_lines_by_section(nb).items() if n > 1]


def prepare(src_dir: str | Path, out_dir: str | Path, only=()) -> list[Path]:
    """Write a copy of every numbered notebook in `src_dir`, with expected outputs, into `out_dir`."""
    import nbformat

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.ipynb"):
        stale.unlink()
    written = []
    for path in find_notebooks(src_dir, only):
        try:
            nb = with_expected_outputs(nbformat.read(path, as_version=4))
        except ValueError as e:
            raise ValueError(f"{path.name}: {e}") from None
        dest = out_dir / path.name
        nbformat.write(nb, dest)
        written.append(dest)
    return written


def main(argv: list[str] | None = None) -> int:
    """Copy notebooks with their expected outputs (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m workbook.nbcheck", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="folder of the numbered notebooks")
    parser.add_argument("out", help="folder to write the prepared copies into")
    parser.add_argument("--only", action="append", default=[], help="only notebooks whose name contains this")
    args = parser.parse_args(argv)
    if not Path(args.src).is_dir():
        parser.error(f"src: {args.src!r} is not a folder")
    written = prepare(args.src, args.out, args.only)
    print(f"prepared {len(written)} notebooks for nbval in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
