"""labkit.plots: the grouped bar plot puts one bar per series in each group, side by side."""

from __future__ import annotations

import dataclasses

import pytest

from labkit import plots


def test_grouped_bars_place_each_series_beside_the_others_and_skip_missing_values():
    series = {"DDP": {"parameters": 4.0, "activations": 9.0}, "DDP formula": {"parameters": 4.0},
              "ZeRO-3": {"parameters": 1.0, "activations": 9.0}}
    fig, ax = plots.new_figure()
    bars = plots.plot_grouped_bars(series, ax=ax, hatches={"DDP formula": "//"}, names={"activations": "acts"})
    assert [len(b) for b in bars.values()] == [2, 1, 2]  # no formula bar for activations
    heights = {label: [r.get_height() for r in b] for label, b in bars.items()}
    assert heights == {"DDP": [4.0, 9.0], "DDP formula": [4.0], "ZeRO-3": [1.0, 9.0]}
    lefts = [b[0].get_x() for b in bars.values()]  # first group: the three bars side by side, in series order
    assert lefts == sorted(lefts) and len(set(lefts)) == 3
    assert all(abs(b[0].get_x() + b[0].get_width() / 2) < 0.5 for b in bars.values())  # all within group 0
    assert bars["DDP formula"][0].get_hatch() == "//" and bars["DDP"][0].get_hatch() is None
    assert [t.get_text() for t in ax.get_xticklabels()] == ["parameters", "acts"]
    assert plots.png_bytes(fig).startswith(b"\x89PNG")


def test_series_colors_share_none_with_categories_phases_or_gantt():
    """A method's colour never reads as a memory category, a phase or a Gantt kind."""
    from labkit import plots

    taken = {c.lower() for c in (*plots.CATEGORY_COLORS.values(), *plots.PHASE_COLORS.values(),
                                 *plots.ACTION_COLORS.values(), plots.WAIT_COLOR, plots.COMM_COLOR)}
    assert len(set(plots.SERIES_COLORS)) == len(plots.SERIES_COLORS)
    assert not {c.lower() for c in plots.SERIES_COLORS} & taken
    assert plots.COMM_COLOR.lower() not in {c.lower() for c in plots.CATEGORY_COLORS.values()}


def _plan_of(rows):
    """Return a Plan of synthetic rows (peak GiB, step ms, precision, checkpointing, fits): nothing run."""
    from labkit.planner.plan import Combination, Plan, Row
    out = Plan("m", "h100", 1, 16, 8, 10**9, 60 * 2**30, 0.1)
    for i, (gib, ms, precision, ckpt, fits) in enumerate(rows):
        c = Combination(1, "single", 1 + i, 1, ckpt, precision)
        out.rows.append(Row(c, int(gib * 2**30), {}, fits, 10**12, ms / 1e3, 0.0, ms / 1e3, 1e5))
    return out


def test_the_plan_figure_keeps_its_labels_apart_clear_of_the_axis_and_its_times_positive():
    """draw_plan (chapter 09): the front's labels left of their points, none over another, each clear of the y-axis;
    a linear time axis starts at 0, never below; every precision and checkpointing drawn has its
    legend entry (bf16-mp and bf16-pure too)."""
    from matplotlib.text import Annotation

    from labkit.planner.plot import draw_plan
    rows = [(50, 100, "fp32", "none", True), (40, 110, "bf16-mp", "every", True), (30, 120, "bf16-pure", "full", True),
            (20, 130, "bf16", "op", True), (70, 900, "fp32", "selective", False),  # the front near the slowest's 1/4
            (75, 950, "fp32", "layer2", False)]  # (layer2, layer3, ...: one legend entry)
    fig = draw_plan(_plan_of(rows))  # 900/100: a linear axis
    ax = fig.axes[0]
    fig.draw_without_rendering()
    labels = [t for t in ax.texts if isinstance(t, Annotation)]
    boxes = [t.get_window_extent() for t in labels]
    assert len(labels) == 6 and not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert min(b.x0 for b in boxes) >= ax.get_window_extent().x0  # clear of the y-axis line
    assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0  # widened for the labels, never below 0
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"fp32", "bf16", "bf16-mp", "bf16-pure", "ckpt none", "ckpt every", "ckpt full", "ckpt op",
            "ckpt selective", "ckpt layer<k>", "does not fit (hollow)"} <= legend


def test_the_plans_front_points_are_drawn_over_the_points_beside_them():
    """A slower, larger row drawn at almost the front point's place (chapter 09's T4 plan: fp16 `op` over `sqrt`) does
    not hide the point its label names."""
    from labkit.planner.plot import draw_plan
    plan = _plan_of([(2.49, 84, "fp16", "sqrt", True), (2.53, 88, "fp16", "op", True), (3.4, 70, "fp16", "none", True)])
    ax = draw_plan(plan).axes[0]
    markers = {(round(line.get_xdata()[0]), line.get_marker()): line.get_zorder() for line in ax.get_lines()
               if len(line.get_xdata()) == 1 and line.get_marker() != "*"}
    assert markers[(84, "^")] > markers[(88, "^")], markers  # the front's sqrt over the dominated op


def test_plot_fit_draws_the_points_so_far_and_the_fit_over_the_whole_range():
    from labkit.trend import fit_polynomial
    fig, ax = plots.new_figure()
    plots.plot_fit(ax, [2, 4, 8, 16], [2 * 2**20, 4 * 2**20], scale=2**20)  # two points measured, no fit yet
    (points,) = ax.get_lines()
    assert list(points.get_xdata()) == [2, 4] and list(points.get_ydata()) == [2, 4]
    fig, ax = plots.new_figure()
    fit = fit_polynomial([2, 4, 8, 16], [2, 4, 8, 16], 1)
    plots.plot_fit(ax, [2, 4, 8, 16], [2, 4, 8, 16], fit, fit_label="fitted line")
    points, curve = ax.get_lines()
    assert curve.get_xdata()[0] == 2 and curve.get_xdata()[-1] == 16 and curve.get_ydata()[-1] == pytest.approx(16)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["measured", "fitted line"]


def test_each_use_of_the_host_has_its_own_edge_and_legend_entry():
    """A row with offload and Adam on the host is not drawn as offload alone (chapter 09's figures)."""
    from labkit.planner.plot import PLACEMENT_EDGES, draw_plan, edge_of
    out = _plan_of([(50, 100, "fp32", "none", True)])
    c = out.rows[0].combination
    kinds = {(False, "device"): None, (True, "device"): "offload", (False, "host"): "Adam on the host",
             (True, "host"): "offload + Adam on the host"}
    for (offload, optimizer), what in kinds.items():
        row = dataclasses.replace(out.rows[0], combination=dataclasses.replace(c, offload=offload, optimizer=optimizer))
        out.rows.append(row)
        assert edge_of(row.combination) == (PLACEMENT_EDGES[what] if what else edge_of(c))
    assert len(set(PLACEMENT_EDGES.values())) == 3
    legend = {t.get_text() for t in draw_plan(out).axes[0].get_legend().get_texts()}
    assert set(PLACEMENT_EDGES) <= legend


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # (Optuna's plots are "experimental")
def test_an_optuna_plot_takes_labkits_look_and_leaves_the_style_as_it_was():
    """Optuna's matplotlib plots set ggplot's style sheet (grey panel, white grid, larger grey labels): show_pyplot
    shows them as labkit's figures look (matplotlib's defaults here), `after` draws in that look, and rcParams come
    back as they were."""
    import matplotlib
    import optuna
    import optuna.visualization.matplotlib as ovm
    from matplotlib.colors import to_rgba
    from matplotlib.font_manager import FontProperties

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    for lr in (1e-3, 1e-2):  # two trials: Optuna draws a legend
        trial = study.ask()
        for step in (1, 2):
            trial.report(lr / step, step)
        study.tell(trial, lr)
    before = dict(matplotlib.rcParams)
    seen = {}
    fig = plots.show_pyplot(lambda: ovm.plot_intermediate_values(study),
                            after=lambda ax: seen.update(facecolor=matplotlib.rcParams["axes.facecolor"]))
    ax = fig.axes[0]
    white, black, d = to_rgba("white"), to_rgba("black"), matplotlib.rcParamsDefault
    assert to_rgba(ax.get_facecolor()) == white and seen == {"facecolor": d["axes.facecolor"]}
    assert to_rgba(ax.get_legend().get_frame().get_facecolor())[:3] == white[:3]  # (the legend's own alpha, 0.8)
    assert all(to_rgba(s.get_edgecolor()) == black and s.get_linewidth() == d["axes.linewidth"]
               for s in ax.spines.values())
    assert not any(line.get_visible() for line in ax.get_xgridlines() + ax.get_ygridlines())
    size = lambda key: FontProperties(size=d[key]).get_size_in_points()
    for text, key in ((ax.xaxis.label, "axes.labelsize"), (ax.yaxis.label, "axes.labelsize"),
                      (ax.title, "axes.titlesize"), (ax.get_xticklabels()[0], "xtick.labelsize")):
        assert to_rgba(text.get_color()) == black and text.get_fontsize() == size(key), (text.get_text(), key)
    assert dict(matplotlib.rcParams) == before  # ggplot's sheet gone with the plot
