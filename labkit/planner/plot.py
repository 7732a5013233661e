"""Figures of a plan (chapter 09): each combination's predicted peak against its predicted step time.

The planner's figure: `draw_plan(plan)`; its check against the meter: `draw_check(check)`; the marker, colour and
edge of a combination (`PRECISION_MARKERS`, `CKPT_COLORS`, `edge_of`) are the chapter's figure legend everywhere it
draws combinations.
"""

from __future__ import annotations

import math

from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, LogLocator, MaxNLocator, NullFormatter, ScalarFormatter

from labkit import plots
from labkit.gpus import GiB
from labkit.planner.plan import combination_words, layer_every

PRECISION_MARKERS = {"fp32": "o", "bf16": "s", "fp16": "^", "bf16-mp": "D", "bf16-pure": "v"}  # a row's marker
CKPT_COLORS = {"none": "#505050", "every": "#64b5cd", "sqrt": "#da8bc3", "selective": "#e6b800", "full": "#4c72b0",
               "op": "#dd8452", "layer<k>": "#55a868"}  # a row's fill by checkpointing (ckpt_kind)
PLACEMENT_EDGES = {"offload": "#c44e52", "Adam on the host": "#8172b2",  # edge colours of the rows that use the host
                   "offload + Adam on the host": "#8c564b"}  # brown: apart from every fill (none's grey)


def ckpt_kind(checkpointing: str) -> str:
    """Return a row's key of CKPT_COLORS: its checkpointing, every layer-level choice (layer2, layer3, ...) as one."""
    return "layer<k>" if layer_every(checkpointing) else checkpointing


def log_ticks(lo: float, hi: float, min_ratio: float = 1.3) -> list:
    """Return plain tick values for a log axis from lo to hi: 1, 2 and 5 times powers of ten, or, where fewer than two
    of them fall in range, 1, 1.5, 2, 3, 5 and 7 times; neighbours at least `min_ratio` apart (chapter 09)."""
    decades = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
    for subs in ((1, 2, 5), (1, 1.5, 2, 3, 5, 7)):
        ticks = [t for t in sorted(m * 10.0**k for k in decades for m in subs) if lo <= t <= hi]
        if len(ticks) >= 2:
            break
    out = []
    for t in ticks:
        if not out or t / out[-1] >= min_ratio:
            out.append(t)
    return out


def placement_of(c) -> str | None:
    """Return which of PLACEMENT_EDGES' uses of the host a combination makes (None: none)."""
    host = c.optimizer == "host"
    return ("offload + Adam on the host" if host else "offload") if c.offload else ("Adam on the host" if host else None)


def edge_of(c) -> str:
    """Return the marker edge colour of a combination: red with offload, purple with Adam on the host, brown with
    both, else its fill."""
    where = placement_of(c)
    return CKPT_COLORS[ckpt_kind(c.checkpointing)] if where is None else PLACEMENT_EDGES[where]


_LABEL_PARTS = (lambda c: f"{c.ranks}×{c.parallel}", lambda c: f"mb {c.micro_batch}×{c.accum_steps}",
               lambda c: c.checkpointing, lambda c: c.precision, lambda c: "offl" if c.offload else "",
               lambda c: "Adam host" if c.optimizer == "host" else "")


def _point_label(r, rows):
    """Return what tells a row apart among `rows`: ranks × parallelism, micro-batch × accumulation, checkpointing,
    precision, offload, Adam on the host (the parts that differ among them), e.g. "2×ddp mb 1×1, offl"."""
    varying = [part for part in _LABEL_PARTS if len({part(x.combination) for x in rows}) > 1]
    return ", ".join(t for t in (part(r.combination) for part in varying) if t)


def _leave_room_left(fig, ax, labels, pad_px=20):
    """Lower the left x-limit until every annotation of `labels` (drawn left of its point) clears the y-axis line by
    `pad_px` pixels. The limits map linearly to pixels in the axis's scale (log10 on a log axis), so the arithmetic
    is done there; a text's width is known once the figure is laid out, and the layout may resize the axes after a
    change: laid out again, up to three times. A linear axis starts at 0 at the lowest (a time is never negative): a
    label that cannot fit left of its point goes right of it."""
    scale = ax.xaxis.get_transform()  # data to scaled coordinates: the identity, or log10
    for _ in range(3 if labels else 0):
        fig.draw_without_rendering()
        width = ax.get_window_extent().width
        lo, hi = scale.transform(ax.get_xlim())
        wanted = lo
        for label in labels:
            left_px = ax.transData.transform(label.xy)[0] - label.get_window_extent().x0 + pad_px  # left of its point
            share = min(left_px / width, 0.9)  # the share of the axes' width it needs left of its point (at most 90%)
            x = scale.transform([label.xy[0]])[0]
            wanted = min(wanted, (x - share * hi) / (1 - share))  # so that x - lo >= share * (hi - lo)
        if ax.get_xscale() == "linear":
            wanted = max(wanted, 0.0)  # a time is never negative: the axis starts at 0 at the lowest
        if wanted >= lo:
            break
        ax.set_xlim(scale.inverted().transform([wanted])[0], None)
    if ax.get_xscale() == "linear" and ax.get_xlim()[0] < 0:  # margins widened it below 0: clamp
        ax.set_xlim(0.0, None)
    if labels:  # a label that still reaches the y-axis goes right of its point
        fig.draw_without_rendering()
        for label in labels:
            if label.get_window_extent().x0 < ax.get_window_extent().x0 + pad_px:
                label.set(position=(4, -4), ha="left")


def _collide(fig, labels):
    """Tell whether any two of `labels` overlap once the figure is laid out."""
    fig.draw_without_rendering()
    boxes = [label.get_window_extent() for label in labels]
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


FRONT_ZORDER = 2.5  # the Pareto front's points over the others (matplotlib's lines: 2): a labelled point stays seen


def draw_plan(p):
    """Return a figure of a plan's peaks (GiB) against predicted step times (ms): fits, Pareto front, fastest."""
    fig, ax = plots.new_figure(width_in=7.5, height_in=3.8)
    front = p.pareto
    for r in p.rows:
        c = r.combination
        fill = CKPT_COLORS[ckpt_kind(c.checkpointing)]
        ax.plot(r.step_s * 1e3, r.peak_bytes / GiB, PRECISION_MARKERS[c.precision],
                color=fill, mfc=fill if r.fits else "none", ms=6, zorder=FRONT_ZORDER if r in front else 2,
                mec=edge_of(c), mew=1.5 if edge_of(c) in PLACEMENT_EDGES.values() else 1)
    if front:
        ax.plot([r.step_s * 1e3 for r in front], [r.peak_bytes / GiB for r in front], "-", color="#55a868", lw=1,
                zorder=3)  # over the other points
        ax.plot(front[0].step_s * 1e3, front[0].peak_bytes / GiB, "*", color="black", ms=12)
    labelled = p.rows if len(p.rows) <= 12 else front  # all points while they are few, else the front
    left_labels, other_labels = [], []  # the front's labels extend left of their points; the others right
    if len(labelled) > 1:
        for r in labelled:  # a front point's label below and left of it: no point is faster and smaller
            on_front = r in front
            label = ax.annotate(_point_label(r, labelled), (r.step_s * 1e3, r.peak_bytes / GiB), fontsize=6,
                                xytext=(-4, -4) if on_front else (3, 3), textcoords="offset points",
                                ha="right" if on_front else "left", va="top" if on_front else "bottom")
            (left_labels if on_front else other_labels).append(label)
        ax.margins(x=0.25)
    peaks = [r.peak_bytes / GiB for r in p.rows]
    lo, hi = min(peaks), max(peaks)
    budget = p.budget_bytes / GiB
    if lo * 0.8 <= budget <= hi * 1.25:  # the budget is drawn where it does not squash the data
        ax.axhline(budget, color="black", ls="--", lw=1)
        lo, hi = min(lo, budget), max(hi, budget)
    ax.set_ylim(lo - 0.12 * (hi - lo + 1e-9), hi + 0.1 * (hi - lo + 1e-9))  # room below for the front's labels
    times = [r.step_s for r in p.rows]
    if max(times) > 10 * min(times):  # a log axis where the times span more than a decade
        ax.set_xscale("log")
        plots.plain_ticks(ax.xaxis)
    ax.set_xlabel("predicted step time (ms): roofline + communication + host transfers")
    ax.set_ylabel("peak per device (GiB)")
    c = None if p.fastest is None else p.fastest.combination
    verdict = "nothing fits" if c is None else f"fastest: {combination_words(c)}"
    replayed = any(r.fits_by != "reserve" for r in p.rows)  # (a reserved plan: the dashed budget is the other rows')
    ax.set_title(f"{p.model} on {p.gpus} × {p.device}, global batch {p.batch} × {p.seq_len}; budget {budget:.1f} GiB "
                 f"({p.reserve_fraction:.0%} reserved{'; rows replayed: judged by their replay' if replayed else ''})"
                 f"\n{verdict}", fontsize=9)
    handles = [Line2D([], [], marker=mk, color="grey", ls="none", label=k)
               for k, mk in PRECISION_MARKERS.items() if any(r.combination.precision == k for r in p.rows)]
    handles += [Line2D([], [], marker="o", color=col, ls="none", label=f"ckpt {k}")
                for k, col in CKPT_COLORS.items() if any(ckpt_kind(r.combination.checkpointing) == k for r in p.rows)]
    for what, col in PLACEMENT_EDGES.items():
        if any(placement_of(r.combination) == what for r in p.rows):
            handles.append(Line2D([], [], marker="o", color="#a6a6a6", mec=col, mew=1.5, ls="none",
                                  label=what))  # filled: hollow means only "does not fit"
    if not all(r.fits for r in p.rows):
        hollow = dict(marker="o", color="grey", mfc="none", ls="none")
        handles.append(Line2D([], [], **hollow, label="does not fit (hollow)"))
    if front:
        handles.append(Line2D([], [], ls="-", marker="*", color="#55a868", mfc="black", mec="black",
                              label="Pareto front, fastest"))
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), borderaxespad=0)
    if _collide(fig, left_labels + other_labels):  # too close to read: the front's points get their row numbers
        for label in other_labels:
            label.remove()
        places = [(r.step_s * 1e3, r.peak_bytes / GiB) for r in front]
        for label in left_labels:  # the row of the front's table (format_plan's #), fastest first
            label.set_text(str(1 + places.index(label.xy)))
        left_labels.sort(key=lambda label: int(label.get_text()))
        if _collide(fig, left_labels):  # numbers close together: every second one above and right of its point
            for label in left_labels[1::2]:
                label.set(position=(4, 4), ha="left", va="bottom")
            left_labels = left_labels[::2]  # (those above and right of their points cannot reach the y-axis)
        ax.text(1.01, 0.0, "1, 2, ...: the Pareto\nfront's rows (#) in\nthe table above", transform=ax.transAxes,
                fontsize=7, va="bottom")
    # last: a label's width in data units depends on the scale, and on the axes' width once title and legend are in
    _leave_room_left(fig, ax, left_labels)
    return fig


def _check_style(c) -> dict:
    """Return the plot style of a checked combination: `none` hollow and larger (the `sqrt` rows, identical at two
    blocks, sit inside it), the host rows' edge red, purple or near-black (edge_of)."""
    style = dict(marker=PRECISION_MARKERS[c.precision], color=CKPT_COLORS[ckpt_kind(c.checkpointing)], ls="none",
                 ms=9 if c.checkpointing == "none" else 6)
    if c.checkpointing == "none":
        style.update(mfc="none", mew=1.5)
    if edge_of(c) in PLACEMENT_EDGES.values():
        style.update(mec=edge_of(c), mew=1.5)
    return style


def draw_check(check, timed_precisions=("fp32", "bf16")):
    """Return a figure of a labkit.planner.check.PlanCheck: predicted against measured peaks (MiB) and step times (ms)."""
    fig, (ax0, ax1) = plots.new_figure(ncols=2, width_in=4.6, height_in=3.6)
    MiB = 2**20
    predicted, measured, timed = check.predicted, check.measured_bytes, check.timed
    for n in check.names:
        style = _check_style(predicted[n].combination)
        ax0.plot(measured[n] / MiB, predicted[n].peak_bytes / MiB, **style)
        if n in timed:
            ax1.plot(timed[n].step_s * 1e3, predicted[n].step_s * 1e3, **style)
    lo, hi = min(measured.values()) / MiB * 0.95, max(measured.values()) / MiB * 1.05
    ax0.plot([lo, hi], [lo, hi], color="grey", lw=1, ls=":")
    ax0.axvline(check.budget_bytes / MiB, color="black", lw=1, ls="--")
    ax0.axhline(check.budget_bytes / MiB, color="black", lw=1, ls="--")
    ax0.set_xlabel("measured peak (MiB)")
    ax0.set_ylabel("predicted peak (MiB)")
    ax0.set_title(f"Peak: {len(check.names)} combinations, largest error {check.errors[check.worst]:.2%}\n"
                  "(dashed: the budget; dotted: exact)", fontsize=9)
    names = check.timed_names
    steps_ms = [timed[n].step_s * 1e3 for n in names] + [predicted[n].step_s * 1e3 for n in names]
    t_lo, t_hi = min(steps_ms) / 1.2, max(steps_ms) * 1.2
    ax1.plot([t_lo, t_hi], [t_lo, t_hi], color="grey", lw=1, ls=":")
    ax1.set_xscale("log")  # log-log: the roofline's few ms and the measured tens of ms both readable
    ax1.set_yscale("log")
    for axis in (ax1.xaxis, ax1.yaxis):  # plain numbers at 1, 2 and 5 times the powers of ten
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax1.xaxis.set_major_locator(FixedLocator(log_ticks(t_lo, t_hi)))  # (LogLocator falls back to linear ticks,
    ax1.set_xlim(t_lo, t_hi)  #                                   crowded on a log axis, when one 1-2-5 tick is in range)
    pred_ms = [predicted[n].step_s * 1e3 for n in names]
    y_lo, y_hi = min(pred_ms) / 1.2, max(pred_ms) * 1.2  # the predictions' own span: y = x may leave the panel
    if y_hi / y_lo < 10:  # within a decade: evenly spaced ticks (a decade's 1-9 multiples leave 11-19 unlabelled)
        ax1.yaxis.set_major_locator(MaxNLocator(nbins=6))
    ax1.set_ylim(y_lo, y_hi)
    ax1.set_xlabel("measured step time (ms, median)")
    ax1.set_ylabel("predicted step time (ms):\nroofline + host transfers")
    untimed = "" if len(names) == len(check.names) else ", fp32 rows only (bf16 untimed)"
    ratios = [timed[n].step_s / predicted[n].step_s for n in names]  # measured over predicted: y = x is 1
    ax1.set_title(f"Step time{untimed}: rank correlation {check.rho:.2f};\nmeasured {min(ratios):.1f}-"
                  f"{max(ratios):.1f}x the prediction (dotted: y = x;\nabove it, faster than predicted: "
                  f"{len(check.faster)} of {len(names)})", fontsize=9)
    combos = [predicted[n].combination for n in check.names]
    handles = [Line2D([], [], marker=mk, color="grey", ls="none",
                      label=p if p in timed_precisions else f"{p} (peaks only, not timed)")
               for p, mk in PRECISION_MARKERS.items() if any(c.precision == p for c in combos)]
    handles += [Line2D([], [], marker="o", color=col, ls="none", mfc="none" if k == "none" else col,
                       label=f"ckpt {k}" + (" (hollow)" if k == "none" else ""))
                for k, col in CKPT_COLORS.items() if any(ckpt_kind(c.checkpointing) == k for c in combos)]
    for what, col in PLACEMENT_EDGES.items():
        if any(placement_of(c) == what for c in combos):
            handles.append(Line2D([], [], marker="o", color="white", mec=col, mew=1.5, ls="none", label=what))
    ax1.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    return fig
