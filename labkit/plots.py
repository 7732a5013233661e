"""Memory and throughput plots on headless matplotlib Figures, shown as PNG images; live ones redraw in place."""

from __future__ import annotations

import io

from matplotlib.figure import Figure

from labkit.runmode import in_kernel
from labkit.meter import CATEGORIES, PHASES, MemoryMeter, TimelinePoint

MiB = 2**20
# categories and phases never share a colour: a figure with a timeline beside a split reads each colour one way
CATEGORY_COLORS = {"parameters": "#8172b2", "gradients": "#ccb974", "optimizer_state": "#937860",
                   "activations": "#dd8452"}
PHASE_COLORS = {"forward": "#4c72b0", "backward": "#c44e52", "optimizer": "#55a868", "other": "#8c8c8c"}
# methods, precisions, schedules: one colour per series, none a category's or a phase's (a figure beside a memory
# split or a timeline reads each colour one way); take them in order, SERIES_COLORS[i] for the i-th series
SERIES_COLORS = ("#505050", "#64b5cd", "#da8bc3", "#e6b800")  # dark grey (a hatch shows on it), sky, pink, gold


def new_figure(nrows: int = 1, ncols: int = 1, width_in: float = 6.0, height_in: float = 3.2):
    """Return a headless Figure and its axes (one Axes, or an array for several), rows first as in matplotlib."""
    fig = Figure(figsize=(width_in * ncols, height_in * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols)
    return fig, axes


def png_bytes(fig: Figure, **savefig) -> bytes:
    """Render a figure to PNG bytes (at 90 dpi; `savefig` adds keyword arguments of Figure.savefig)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, **savefig)
    return buf.getvalue()


def show(fig: Figure, **savefig) -> None:
    """Display a figure as a PNG image in the notebook (nothing outside a kernel)."""
    if in_kernel():
        from IPython.display import Image, display
        display(Image(png_bytes(fig, **savefig)))


def show_pyplot(draw, width_in: float = 6.0, height_in: float = 3.2, after=None) -> Figure:
    """Run `draw()`, a pyplot plot that returns its Axes (Optuna's), show it as a PNG in the look of labkit's figures,
    close it, restore rcParams.

    `after(ax)` may add to the plot (a budget line).
    """
    import matplotlib
    import matplotlib.pyplot as plt

    with matplotlib.rc_context():
        with matplotlib.rc_context():
            ax = draw()  # (Optuna's plots set ggplot's style sheet: gone on leaving)
        first = ax.flat[0] if hasattr(ax, "flat") else ax
        fig = first.figure
        restyle(fig)
        if after is not None:
            after(first)
        fig.set_size_inches(width_in, height_in)
        show(fig, bbox_inches="tight")  # no label cut off, whatever its layout
    plt.close(fig)  # else the inline backend shows it a second time at the end of the cell
    return fig


def restyle(fig: Figure) -> None:
    """Give a figure drawn under another style sheet (Optuna's plots set ggplot's: grey panel, white grid, larger
    grey labels) the look of the rcParams in force, as labkit's figures have: panel, frame, grid, ticks, labels, title
    and legend."""
    import matplotlib

    rc = matplotlib.rcParams
    for ax in fig.axes:
        ax.set_facecolor(rc["axes.facecolor"])
        for spine in ax.spines.values():
            spine.set_edgecolor(rc["axes.edgecolor"]), spine.set_linewidth(rc["axes.linewidth"])
        ax.grid(False)
        if rc["axes.grid"]:
            ax.grid(True, color=rc["grid.color"], linestyle=rc["grid.linestyle"], linewidth=rc["grid.linewidth"])
        ax.tick_params(colors=rc["xtick.color"], labelsize=rc["xtick.labelsize"])
        for label in (ax.xaxis.label, ax.yaxis.label):
            label.set_color(rc["axes.labelcolor"]), label.set_fontsize(rc["axes.labelsize"])
        ax.title.set_fontsize(rc["axes.titlesize"])
        ax.title.set_color(rc["text.color"] if rc["axes.titlecolor"] == "auto" else rc["axes.titlecolor"])
        legend = ax.get_legend()
        if legend is not None:
            frame = legend.get_frame()
            frame.set_facecolor(rc["axes.facecolor"] if rc["legend.facecolor"] == "inherit" else rc["legend.facecolor"])
            frame.set_edgecolor(rc["axes.edgecolor"] if rc["legend.edgecolor"] == "inherit" else rc["legend.edgecolor"])


def plot_timeline(source: MemoryMeter | list[TimelinePoint], ax=None, budget_bytes: int | None = None,
                  title: str = "Device memory during the step"):
    """Plot device MiB against allocation events, coloured by phase; mark the peak and budget."""
    points = source.timeline if isinstance(source, MemoryMeter) else list(source)
    if budget_bytes is None and isinstance(source, MemoryMeter):
        budget_bytes = source.budget_bytes
    ax = new_figure()[1] if ax is None else ax
    if not points:
        ax.text(0.5, 0.5, "no allocations recorded", ha="center", transform=ax.transAxes)
        return ax
    x = list(range(len(points)))
    y = [p.bytes / MiB for p in points]
    ax.plot(x, y, color="#333333", lw=0.8)
    for phase in PHASES:  # only phases with events enter the legend
        xs = [i for i, p in enumerate(points) if p.phase == phase]
        if xs:
            sparse = len(xs) < max(3, len(points) // 50)  # a few events: larger dots, counted, or the line hides them
            ax.scatter(xs, [y[i] for i in xs], s=18 if sparse else 4, color=PHASE_COLORS[phase],
                       label=f"{phase} ({len(xs)} event{'s' * (len(xs) > 1)})" if sparse else phase,
                       zorder=4 if sparse else 3, edgecolors="black" if sparse else "face", linewidths=0.4,
                       clip_on=not sparse)  # a dot at 0 MiB shows whole
    peak = max(range(len(y)), key=y.__getitem__)
    ax.annotate(f"peak {y[peak]:.1f} MiB", (peak, y[peak]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if budget_bytes:
        ax.axhline(budget_bytes / MiB, color="black", ls="--", lw=1, label=f"budget {budget_bytes / MiB:.0f} MiB")
    ax.set_ylim(0, max(max(y), (budget_bytes or 0) / MiB) * 1.15)  # headroom: the peak's label stays inside
    ax.set(xlabel="allocation/free event", ylabel="device memory (MiB)", title=title)
    legend = ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside: on no data
    for handle in legend.legend_handles:
        if hasattr(handle, "set_sizes"):
            handle.set_sizes([14])  # one marker size in the key, whatever size the dots are drawn
    return ax


def plot_memory_bars(splits: dict[str, dict[str, int]], ax=None, budget_bytes: int | None = None,
                     title: str = "Memory at the peak, by category", names: dict[str, str] | None = None):
    """Plot stacked bars of bytes by category, in MiB, one bar per label.

    A category with no bytes in any bar is not drawn, so the legend lists only what the bars show; one too thin to
    see (under 1.5% of the axis) says its largest size in the legend.
    `names` renames categories in the legend, e.g. {"activations": "other"} for memory at rest.
    """
    names = names or {}
    ax = new_figure()[1] if ax is None else ax
    labels = list(splits)
    bottom = [0.0] * len(labels)
    drawn = [cat for cat in CATEGORIES if any(splits[k].get(cat, 0) for k in labels)]
    layers = {}
    for cat in drawn or CATEGORIES[:1]:  # all empty: one layer of zero bars keeps the labels on the x axis
        vals = [splits[k].get(cat, 0) / MiB for k in labels]
        layers[cat] = ax.bar(labels, vals, bottom=bottom, color=CATEGORY_COLORS[cat],
                             label=names.get(cat, cat.replace("_", " ")) if drawn else "_empty")
        bottom = [b + v for b, v in zip(bottom, vals)]
    if budget_bytes:
        ax.axhline(budget_bytes / MiB, color="black", ls="--", lw=1, label="budget")
    thin_mib = 0.015 * max(bottom + [(budget_bytes or 0) / MiB])  # a layer this thin is a hairline: say its size
    for cat in drawn:
        most = max(splits[k].get(cat, 0) for k in labels) / MiB
        if most < thin_mib:
            layers[cat].set_label(f"{layers[cat].get_label()}\n(≤ {most:.2f} MiB)")  # no wider than the others
    ax.set(ylabel="memory (MiB)", title=title)
    if drawn or budget_bytes:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the bars, on none
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    return ax


def plot_grouped_bars(series: dict[str, dict[str, float]], ax=None, title: str = "", ylabel: str = "",
                      colors: dict[str, str] | None = None, hatches: dict[str, str] | None = None,
                      names: dict[str, str] | None = None):
    """Plot {series label: {group: value}} as bars side by side, one group per key; return the bar containers.

    A series without a value for a group leaves its slot empty; `colors` and `hatches` style series by label.
    """
    names, colors, hatches = names or {}, colors or {}, hatches or {}
    ax = new_figure()[1] if ax is None else ax
    groups = list(dict.fromkeys(g for values in series.values() for g in values))
    width = 0.8 / max(len(series), 1)
    bars = {}
    for i, (label, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, g in enumerate(groups) if g in values]
        ys = [values[g] for g in groups if g in values]
        bars[label] = ax.bar(xs, ys, width=width, label=label, color=colors.get(label),
                             hatch=hatches.get(label), edgecolor="white" if label not in hatches else "black", lw=0.3)
    ax.set_xticks(range(len(groups)), [names.get(g, g.replace("_", " ")) for g in groups])
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if series:
        ax.legend(fontsize=6, ncols=2)
    return bars


def plot_series(ax, x, series: dict[str, list], xlabel: str, ylabel: str, title: str = "", logx: bool = False,
                colors: dict[str, str] | None = None):
    """Plot named y-series against x on one axes (`colors`: a colour by series name, where one must match another
    figure's; the rest take matplotlib's cycle)."""
    for name, ys in series.items():
        n = min(len(x), len(ys))
        style = {"color": colors[name]} if colors and name in colors else {}
        ax.plot(list(x)[:n], list(ys)[:n], marker="o", label=name, **style)
    if logx:
        ax.set_xscale("log", base=2)
        plain_ticks(ax.xaxis)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if series:
        ax.legend(fontsize=8)
    return ax


def plot_fit(ax, xs, ys, fit=None, xlabel: str = "", ylabel: str = "", title: str = "", scale: float = 1.0,
             fit_label: str = "fitted curve"):
    """Plot measured points (ys so far, against the first xs) and, once known, `fit` as a dashed curve over the xs'
    range, every value divided by `scale` (chapter 00: activation bytes in MiB against the batch and the sequence)."""
    ax.plot(list(xs)[:len(ys)], [y / scale for y in ys], "o", ms=6, color="#4c72b0",
            label="measured" if ys else "_measured", zorder=3)  # in the legend once a point is drawn
    if fit is not None:
        fine = [xs[0] + (xs[-1] - xs[0]) * k / 50 for k in range(51)]
        ax.plot(fine, [fit(x) / scale for x in fine], "--", color="black", lw=1, label=fit_label)
    ax.set_xticks(list(xs))
    ax.set(xlabel=xlabel, ylabel=ylabel, ylim=(0, None))
    if ys or fit is not None:
        ax.legend(fontsize=8, loc="lower right")  # measured sizes rise to the upper right
    ax.set_title(title, fontsize=10)
    return ax


class LiveFigure:
    """A figure that redraws in place as results arrive (one display handle, updated)."""

    def __init__(self, draw, ncols: int = 2, width_in: float = 5.0, height_in: float = 3.2):
        """`draw(fig, axes, data)` draws everything from `data` (one row of axes); call `update(data)` per result."""
        self._draw = draw
        self._shape = (1, ncols, width_in, height_in)
        self._handle = None
        self.fig = None

    def update(self, data) -> Figure:
        """Redraw the figure from `data` and refresh its display."""
        fig, axes = new_figure(*self._shape)
        fig._labkit_live = True  # workbook.figcheck: a series still to come may have a legend entry and no point yet
        self._draw(fig, axes, data)
        self.fig = fig
        if in_kernel():
            from IPython.display import Image, display
            img = Image(png_bytes(fig))
            if self._handle is None:
                self._handle = display(img, display_id=True)
            else:
                self._handle.update(img)
        return fig


ACTION_COLORS = {"F": "#4c72b0", "B": "#c44e52", "W": "#dd8452"}  # forward, backward, weight-only backward
WAIT_COLOR, COMM_COLOR = "#c8c8c8", "#0f7b6c"  # a rank idle in recv; sending or in a collective (no category's colour)
GANTT_KINDS = {"F": "forward", "B": "backward", "W": "weight-only backward", "wait": "waiting (recv)",
               "comm": "send / all-reduce (incl. waiting for peers)"}


def _gantt_kind(label) -> str:
    """Return a span's kind for its colour: "F", "B", "W" (pipeline actions), "wait", or "comm" (anything else)."""
    label = str(label)
    if label[:1] in ACTION_COLORS and (len(label) == 1 or label[1:2].isdigit()):
        return label[:1]
    return "wait" if label == "wait" else "comm"


def plain_ticks(axis) -> None:
    """Label a log axis 1, 2, 4, 16 (not 2^0 ... 2^4), with no labels on its minor ticks."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_gantt(spans_by_rank: dict, ax=None, title: str = "Timeline by rank", unit: str = "ms",
               xlabel: str | None = None, legend: bool = False):
    """Draw each rank's (label, start_s, end_s) spans as bars on its own row, coloured by kind (see _gantt_kind).

    A bar is labelled only where its text fits; legend: a colour key under the axes.
    """
    ax = new_figure()[1] if ax is None else ax
    scale = {"s": 1.0, "ms": 1e3}[unit]
    colors = {**ACTION_COLORS, "wait": WAIT_COLOR, "comm": COMM_COLOR}
    starts = [a for spans in spans_by_rank.values() for _, a, _ in spans]
    t0 = min(starts) if starts else 0.0
    span_x = max((b - t0 for spans in spans_by_rank.values() for _, _, b in spans), default=0.0) * scale or 1.0
    ranks = sorted(spans_by_rank)
    kinds = []
    for row, rank in enumerate(ranks):
        for label, a, b in spans_by_rank[rank]:
            kind = _gantt_kind(label)
            kinds.append(kind)
            ax.barh(row, (b - a) * scale, left=(a - t0) * scale, height=0.6, color=colors[kind], edgecolor="white",
                    lw=0.5)
            text = str(label).split("/")[0]
            if (b - a) * scale >= 0.011 * span_x * (len(text) + 1):  # about 6-pt characters
                ax.text((a - t0 + (b - a) / 2) * scale, row, text, ha="center", va="center", fontsize=6,
                        color="black" if kind == "wait" else "white", clip_on=True)
    if legend:
        from matplotlib.patches import Patch

        shown = [k for k in GANTT_KINDS if k in kinds]
        ax.legend([Patch(color=colors[k]) for k in shown], [GANTT_KINDS[k] for k in shown], fontsize=7,
                  ncols=len(shown), loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" if isinstance(r, int) else str(r) for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel or f"time ({unit})")
    ax.set_title(title)
    return ax
