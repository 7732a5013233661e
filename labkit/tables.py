"""Text tables: a chapter's summary rows printed in aligned columns (chapters 00-08's summaries)."""

from __future__ import annotations

from collections.abc import Sequence


def format_rows(rows: Sequence[Sequence], align: str = "") -> str:
    """Return rows of cells (label, value, ...) as lines of aligned columns, each as wide as its widest cell.

    `align`: one character per column, "<" (left, the default) or ">" (right); the last column is not padded.
    """
    rows = [[str(cell) for cell in row] for row in rows]
    n = max((len(row) for row in rows), default=0)
    if any(a not in "<>" for a in align) or len(align) > n:
        raise ValueError(f"align: one of '<' or '>' per column, at most {n} characters; got {align!r}")
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(n)]
    sides = align.ljust(n, "<")
    lines = []
    for row in rows:
        cells = [f"{cell:{sides[i]}{widths[i]}}" if i < len(row) - 1 or sides[i] == ">" else cell
                 for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def print_rows(rows: Sequence[Sequence], align: str = "") -> None:
    """Print rows of cells (label, value, ...) in aligned columns (format_rows)."""
    print(format_rows(rows, align))
