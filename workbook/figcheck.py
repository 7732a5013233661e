"""Check a matplotlib figure for what a reader needs to read it: titles, axis labels with units, legends clear of data.

`figure_problems(fig)` returns one line per problem (an empty list: nothing found). The rules, where
matplotlib can tell:

- **title**: every axes that shows something has a title, or the figure has a suptitle.
- **label**: every numeric axis (its tick labels are numbers) with visible ticks has a label. Axes whose
  ticks name categories (bar names, settings) need none: the names say what they are.
- **unit**: a numeric axis's label names its unit in parentheses or brackets, `"peak (MiB)"`,
  `"step time [s]"`, unless the quantity has no unit (`dimensionless`): a ratio, fraction, share or loss
  (`RATIO_WORDS`: "bubble fraction", "loss", "FLOPs / plain", "cost relative to s = 1"), or a count (`COUNT_WORDS` as a whole word: "micro-batches
  per step", "layers", "trial", "allocation/free event") whose label names no time or size
  (`NEEDS_UNIT`: "step time", "tokens/s", "bytes per parameter, one rank" still need their unit).
- **legend**: an axes with two or more labelled series has a legend (its own or the figure's); a legend
  inside an axes covers none of its data: line vertices and points along its segments, scatter points,
  bars (any overlap of a bar's box with the legend's box).
- **empty legend entry**: every legend entry whose series is on the axes draws something there: a line with a
  finite point, a scatter with a point, bars not all of zero height, a filled area with a vertex (a proxy
  handle made only for the legend is not checked). Not on a `labkit.plots.LiveFigure`'s frames: an early frame
  lists series still to come, and the kernel's hook cannot tell which frame is the last.
- **overlap**: no two of these texts overlap: the suptitle, each axes' titles, axis labels and legends,
  and neighbouring tick labels of one axis; none of them runs past the figure's edge (cut off).

`python -m workbook.runner` (`make run`, and the tests' `execute_notebook`) loads this module into
every kernel it starts (`load_ipython_extension`): each figure the chapter renders is checked as it is
drawn, and the problems land in the chapter's results entry, by cell (`figure_problems`). Nothing runs a
chapter a second time for it.
"""

from __future__ import annotations

import json
import os
import re
import threading

import numpy as np

OUT_ENV = "LABKIT_FIGURE_CHECK"  # a file the kernel's checks append to, one JSON object a line
RATIO_WORDS = ("ratio", "fraction", "share", "speed-up", "speedup", "×", "%", "loss", "utilisation", "utilization",
               "relative", " / ")
COUNT_WORDS = ("count", "number of", "steps", "step", "layers", "layer", "segments", "ranks", "rank", "trial",
               "trials", "micro-batch", "micro-batches", "microbatches", "index", "samples", "batch", "tokens",
               "workers", "seed", "event", "events", "round", "rounds", "values", "accumulation", "stage", "stages", "k", "n")
NEEDS_UNIT = ("time", "memory", "bytes", "bandwidth", "throughput", "latency", "/s", "per second", "size")
_UNIT = re.compile(r"[\(\[][^\)\]]+[\)\]]")
_NUMBER = re.compile(r"^[\-−+]?(\d[\d,]*\.?\d*|\.\d+)([eE][\-−+]?\d+)?\s*(%|×|x)?$")
_MATH_POWER = re.compile(r"^\$\\mathdefault\{[\-−]?\d+(\^\{[\-−]?\d+\})?\}\$$|^\$[\-−]?\d+\^\{[\-−]?\d+\}\$$")
_local = threading.local()


def dimensionless(label: str) -> bool:
    """Return whether an axis label names a quantity without a unit: a ratio or fraction, or a count (not a time or size)."""
    low = label.lower()
    if any(w in low for w in RATIO_WORDS):
        return True
    counts = any(re.search(rf"(?<![\w-]){re.escape(w)}(?![\w-])", low) for w in COUNT_WORDS)
    return counts and not any(w in low for w in NEEDS_UNIT)


def _renderer(fig):
    fig.draw_without_rendering()  # constrained layout and tick labels as they will be printed
    return fig._get_renderer()


def _visible_texts(texts):
    return [t for t in texts if t is not None and t.get_visible() and t.get_text().strip()]


def _shows_something(ax) -> bool:
    return bool(ax.lines or ax.patches or ax.collections or ax.images or ax.containers)


def _is_numeric(axis, renderer) -> bool:
    labels = [t.get_text().strip() for t in axis.get_ticklabels() if t.get_visible() and t.get_text().strip()]
    if not labels:
        return False
    return all(_NUMBER.match(s.replace(",", "")) or _MATH_POWER.match(s) for s in labels)


def _title(ax) -> str:
    return " ".join(t.get_text() for t in (ax._left_title, ax.title, ax._right_title) if t.get_text().strip())


def figure_name(fig) -> str:
    """Return a figure's name for a report: its suptitle, else its first axes' title, else "untitled"."""
    if fig._suptitle is not None and fig._suptitle.get_text().strip():
        return fig._suptitle.get_text().strip()
    for ax in fig.axes:
        if _title(ax):
            return _title(ax)
    return "untitled"


def _data_points(ax, steps: int = 16) -> np.ndarray:
    """Return display coordinates of an axes' plotted points: line vertices and points along each segment."""
    found = []
    for line in ax.lines:
        if not line.get_visible() or len(line.get_xydata()) == 0:
            continue
        xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
        xy = xy[np.isfinite(xy).all(axis=1)]
        if len(xy) > 1:
            t = np.linspace(0, 1, steps)[:, None, None]
            xy = (xy[:-1][None] * (1 - t) + xy[1:][None] * t).reshape(-1, 2)
        found.append(xy)
    for coll in ax.collections:
        offsets = coll.get_offsets() if coll.get_visible() else []
        if len(offsets):
            xy = coll.get_offset_transform().transform(np.asarray(offsets, dtype=float))
            found.append(xy[np.isfinite(xy).all(axis=1)])
    if not found:
        return np.zeros((0, 2))
    points = np.concatenate(found)
    box = ax.get_window_extent()
    inside = ((points[:, 0] >= box.x0) & (points[:, 0] <= box.x1) & (points[:, 1] >= box.y0) & (points[:, 1] <= box.y1))
    return points[inside]


def _bar_boxes(ax, renderer):
    from matplotlib.patches import Rectangle

    legend = ax.get_legend()
    legend_patches = set(map(id, legend.get_patches())) if legend is not None else set()
    boxes = []
    for patch in ax.patches:
        if isinstance(patch, Rectangle) and patch.get_visible() and id(patch) not in legend_patches:
            box = patch.get_window_extent(renderer)
            if box.width > 0 and box.height > 0:
                boxes.append(box.intersection(box, ax.get_window_extent(renderer)) or box)
    return boxes


def _draws_nothing(artist) -> bool:
    """Return whether a legend's series draws nothing: no finite point, no scatter point, only zero-height bars."""
    from matplotlib.collections import Collection, PathCollection
    from matplotlib.container import BarContainer
    from matplotlib.lines import Line2D

    if isinstance(artist, Line2D):
        xy = np.asarray(artist.get_xydata(), dtype=float).reshape(-1, 2)
        return not np.isfinite(xy).all(axis=1).any()
    if isinstance(artist, BarContainer):
        return all(not np.isfinite(bar.get_height()) or bar.get_height() == 0 or bar.get_width() == 0
                   for bar in artist.patches)
    if isinstance(artist, PathCollection):
        return len(artist.get_offsets()) == 0
    if isinstance(artist, Collection):  # fill_between and other polygons: drawn where a path has a vertex
        return not any(len(path.vertices) for path in artist.get_paths())
    return False


def _empty_legend_entries(ax, legend) -> list[str]:
    """Return the legend's labels whose series, found on the axes by that label, all draw nothing."""
    series = [a for a in [*ax.lines, *ax.collections, *ax.containers] if not str(a.get_label()).startswith("_")]
    empty = []
    for text in legend.get_texts():
        label = text.get_text()
        found = [a for a in series if a.get_label() == label]
        if found and all(_draws_nothing(a) for a in found):
            empty.append(label)
    return empty


def _overlap(a, b, slack_px: float = 1.0) -> bool:
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > slack_px) and (min(a.y1, b.y1) - max(a.y0, b.y0) > slack_px)


def figure_problems(fig) -> list[str]:
    """Return the figure's problems, one line each (see the module docstring); [] when it passes."""
    renderer = _renderer(fig)
    problems = []
    suptitle = fig._suptitle if fig._suptitle is not None and fig._suptitle.get_text().strip() else None
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.axison and _shows_something(ax)]
    texts = [("suptitle", suptitle)] if suptitle is not None else []
    for legend in fig.legends:
        texts.append(("figure legend", legend))
    for n, ax in enumerate(panels):
        where = f"panel {n + 1}" + (f" ({_title(ax)!r})" if _title(ax) else "")
        if not _title(ax) and suptitle is None:
            problems.append(f"{where}: no title (and no suptitle)")
        for name, axis, label in (("x", ax.xaxis, ax.xaxis.label), ("y", ax.yaxis, ax.yaxis.label)):
            if not axis.get_visible() or not _is_numeric(axis, renderer):
                continue
            text = label.get_text().strip()
            if not text:
                problems.append(f"{where}: the numeric {name} axis has no label")
            elif not _UNIT.search(text) and not dimensionless(text):
                problems.append(f"{where}: {name} label {text!r} names no unit (in parentheses or brackets)")
            ticks = [t for t in axis.get_ticklabels() if t.get_visible() and t.get_text().strip()]
            extents = [t.get_window_extent(renderer) for t in ticks]
            for (ta, a), (tb, b) in zip(zip(ticks, extents), zip(ticks[1:], extents[1:])):
                if _overlap(a, b):
                    problems.append(f"{where}: {name} tick labels {ta.get_text()!r} and {tb.get_text()!r} overlap")
                    break
        labelled = [a for a in [*ax.lines, *ax.collections, *ax.containers]
                    if not str(a.get_label()).startswith("_") and str(a.get_label()).strip()]
        legend = ax.get_legend()
        if len(labelled) >= 2 and legend is None and not fig.legends:
            problems.append(f"{where}: {len(labelled)} labelled series and no legend")
        if legend is not None and legend.get_visible():
            box = legend.get_window_extent(renderer)
            points = _data_points(ax)
            covered = int(((points[:, 0] > box.x0) & (points[:, 0] < box.x1)
                           & (points[:, 1] > box.y0) & (points[:, 1] < box.y1)).sum())
            bars = sum(_overlap(box, b) for b in _bar_boxes(ax, renderer))
            if covered or bars:
                what = ", ".join(s for s in (f"{covered} plotted points" if covered else "",
                                             f"{bars} bars" if bars else "") if s)
                problems.append(f"{where}: the legend covers data ({what})")
            texts.append((f"{where} legend", legend))
            for label in [] if getattr(fig, "_labkit_live", False) else _empty_legend_entries(ax, legend):
                problems.append(f"{where}: the legend entry {label!r} draws nothing")
        for title in _visible_texts([ax._left_title, ax.title, ax._right_title]):
            texts.append((f"{where} title", title))
        for name, label in (("x label", ax.xaxis.label), ("y label", ax.yaxis.label)):
            if label.get_visible() and label.get_text().strip():
                texts.append((f"{where} {name}", label))
    boxes = [(name, artist.get_window_extent(renderer)) for name, artist in texts]
    edge = fig.bbox
    for name, box in boxes:
        if box.x0 < edge.x0 - 1 or box.x1 > edge.x1 + 1 or box.y0 < edge.y0 - 1 or box.y1 > edge.y1 + 1:
            problems.append(f"{name} is cut off at the figure's edge")
    for i, (name_a, a) in enumerate(boxes):
        for name_b, b in boxes[i + 1:]:
            if _overlap(a, b):
                problems.append(f"{name_a} overlaps {name_b}")
    return problems


RULES = {"no title": "title", "has no label": "label", "names no unit": "unit", "and no legend": "legend",
         "legend covers data": "legend over data", "draws nothing": "empty legend entry", "tick labels": "ticks",
         "overlaps": "overlap",
         "cut off": "cut off",
         "the figure check failed": "check failed"}


def rule_of(problem: str) -> str:
    """Return the rule a problem line breaks (RULES' values, e.g. title, unit, empty legend entry); else "other"."""
    return next((rule for words, rule in RULES.items() if words in problem), "other")


# -- in a kernel: check every figure as it is drawn ------------------------------------------------------------
def _append(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def load_ipython_extension(ip) -> None:
    """Check every figure this kernel prints (inline display, savefig, labkit.plots) into $LABKIT_FIGURE_CHECK."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = os.environ.get(OUT_ENV)
    if not path or getattr(FigureCanvasBase.print_figure, "_labkit_checked", False):
        return
    original = FigureCanvasBase.print_figure
    seen: set = set()

    def print_figure(self, *args, **kwargs):
        if not getattr(_local, "busy", False):
            _local.busy = True
            try:
                fig = self.figure
                try:
                    problems = figure_problems(fig)
                except Exception as exc:  # a check that breaks must not break the chapter
                    problems = [f"the figure check failed: {type(exc).__name__}: {exc}"]
                count = ip.execution_count - 1  # IPython counts the running cell before running it
                key = (count, id(fig), tuple(problems))
                if key not in seen:
                    seen.add(key)
                    _append(path, {"execution_count": count, "figure": figure_name(fig),
                                   "problems": problems})
            finally:
                _local.busy = False
        return original(self, *args, **kwargs)

    print_figure._labkit_checked = True
    FigureCanvasBase.print_figure = print_figure


def problems_by_cell(nb, lines: list[dict]) -> list[dict]:
    """Return [{cell, figure, problem}] from the kernel's check lines, `cell` the index in the unexecuted notebook.

    `nb` is the executed notebook: its cells' execution counts place each line; papermill's injected
    parameters cell is not counted, so `cell` is the index a reader finds in notebooks/.
    """
    index, n = {}, 0
    for cell in nb["cells"]:
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            continue
        if cell.get("cell_type") == "code" and cell.get("execution_count") is not None:
            index[cell["execution_count"]] = n
        n += 1
    found, seen = [], set()
    for line in lines:
        for problem in line["problems"]:
            row = {"cell": index.get(line["execution_count"]), "figure": line["figure"], "problem": problem}
            key = json.dumps(row, sort_keys=True)
            if key not in seen:
                seen.add(key)
                found.append(row)
    return found


def read_lines(path) -> list[dict]:
    """Return the JSON lines the kernel's checks wrote ([] when it wrote none)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
