"""Estimate how long an executed chapter takes to read, its appendix left out (`make readtime`).

    python -m workbook.readtime [build/notebooks] [--limit-min 60]

The formula the chapter-per-sitting issue set (the readers' own estimates were close to it): prose (markdown) at
200 words a minute, printed output (a cell's text and stream outputs) at 150 words a minute, code at 10 non-blank
lines a minute. Figures and tables drawn as images count nothing. A chapter's appendix, from a heading whose title
starts with "Appendix" to the next heading of its level or above, is skippable and not counted; neither are the
cells the tests append (`# (added by the tests` as their first line).

Prints one row per chapter and exits 1 when a chapter is over the limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

PROSE_WORDS_PER_MIN = 200
OUTPUT_WORDS_PER_MIN = 150
CODE_LINES_PER_MIN = 10
LIMIT_MIN = 60  # a sitting
HEADING = re.compile(r"^(#{1,6})\s+(.*)$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.MULTILINE | re.DOTALL)  # a fenced block: its "# ..." lines are code
TEST_CELL = "# (added by the tests"


@dataclasses.dataclass
class Reading:
    """What a reader of one executed chapter reads, its appendix left out."""

    name: str  # the notebook's file name, without .ipynb
    prose_words: int  # words in markdown cells
    output_words: int  # words in printed output (text/plain and streams)
    code_lines: int  # non-blank lines of code cells
    appendix_cells: int  # cells left out as the appendix

    @property
    def minutes(self) -> float:
        """Return the reading time in minutes by the formula."""
        return (self.prose_words / PROSE_WORDS_PER_MIN + self.output_words / OUTPUT_WORDS_PER_MIN
                + self.code_lines / CODE_LINES_PER_MIN)


def _text(source) -> str:
    return "".join(source) if isinstance(source, list) else source


def _output_text(output: dict) -> str:
    if output.get("output_type") == "stream":
        return _text(output.get("text", ""))
    if output.get("output_type") in ("execute_result", "display_data"):
        data = output.get("data", {})
        return _text(data.get("text/plain", "")) if "image/png" not in data and "text/html" not in data else ""
    return ""  # errors: a chapter that ran to its end has none worth reading


def reading(nb: dict, name: str = "") -> Reading:
    """Return what `nb` (a notebook as JSON) asks a reader to read, its appendix left out."""
    prose = output = code = skipped = 0
    appendix_level = None  # the heading level of the appendix being skipped
    for cell in nb["cells"]:
        source = _text(cell.get("source", ""))
        if cell["cell_type"] == "markdown":
            for hashes, title in HEADING.findall(FENCE.sub("", source)):
                if appendix_level is not None and len(hashes) <= appendix_level:
                    appendix_level = None
                if appendix_level is None and title.strip().lower().startswith("appendix"):
                    appendix_level = len(hashes)
        if appendix_level is not None or source.startswith(TEST_CELL):
            skipped += 1
            continue
        if cell["cell_type"] == "markdown":
            prose += len(source.split())
        elif cell["cell_type"] == "code":
            code += sum(1 for line in source.splitlines() if line.strip())
            output += sum(len(_output_text(o).split()) for o in cell.get("outputs", []))
    return Reading(name, prose, output, code, skipped)


def read_folder(folder: Path) -> list[Reading]:
    """Return the reading of every notebook in `folder`, in name order."""
    return [reading(json.loads(p.read_text()), p.stem) for p in sorted(Path(folder).glob("*.ipynb"))]


def table(readings: list[Reading], limit_min: float = LIMIT_MIN) -> str:
    """Return a Markdown table of the readings, each against the limit."""
    rows = ["| chapter | prose words | output words | code lines | minutes | within the limit |",
            "|---|---:|---:|---:|---:|---|"]
    for r in readings:
        rows.append(f"| {r.name} | {r.prose_words:,} | {r.output_words:,} | {r.code_lines:,} | {r.minutes:.0f} | "
                    f"{'yes' if r.minutes <= limit_min else f'no, over {limit_min:g}'} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", default="build/notebooks", help="executed notebooks (make run writes them)")
    ap.add_argument("--limit-min", type=float, default=LIMIT_MIN, help="minutes a chapter may take (a sitting)")
    args = ap.parse_args(argv)
    readings = read_folder(Path(args.folder))
    if not readings:
        print(f"no notebooks in {args.folder}: run `make run` first", file=sys.stderr)
        return 2
    print(f"Reading time: prose at {PROSE_WORDS_PER_MIN} words/min, output at {OUTPUT_WORDS_PER_MIN} words/min, code "
          f"at {CODE_LINES_PER_MIN} lines/min; appendices left out")
    print(table(readings, args.limit_min))
    return 1 if any(r.minutes > args.limit_min for r in readings) else 0


if __name__ == "__main__":
    sys.exit(main())
