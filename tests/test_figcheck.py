"""workbook.figcheck: each rule passes a figure that keeps it and names the one that breaks it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.figure import Figure

from workbook.figcheck import figure_problems, problems_by_cell


def _fig(width_in=6.0, height_in=3.2):
    fig = Figure(figsize=(width_in, height_in), layout="constrained")
    return fig, fig.subplots()


def good_figure():
    fig, ax = _fig()
    x = np.arange(1, 9)
    ax.plot(x, x * 2.0, label="plain")
    ax.plot(x, x * 1.0, label="checkpointed")
    ax.set(title="Peak memory grows with the batch", xlabel="batch (samples)", ylabel="peak (MiB)")
    ax.legend(loc="upper left")
    return fig


def test_a_complete_figure_passes():
    assert figure_problems(good_figure()) == []


def test_title_missing_and_a_suptitle_that_stands_for_it():
    fig = good_figure()
    fig.axes[0].set_title("")
    assert any("no title" in p for p in figure_problems(fig))
    fig.suptitle("Peak memory grows with the batch")
    assert figure_problems(fig) == []


def test_numeric_axis_without_label():
    fig = good_figure()
    fig.axes[0].set_xlabel("")
    assert any("numeric x axis has no label" in p for p in figure_problems(fig))


def test_label_without_unit_and_the_dimensionless_exception():
    fig = good_figure()
    fig.axes[0].set_ylabel("peak memory")
    assert any("y label 'peak memory' names no unit" in p for p in figure_problems(fig))
    fig.axes[0].set_ylabel("peak memory ratio")
    assert figure_problems(fig) == []
    fig.axes[0].set_ylabel("peak [MiB]")
    assert figure_problems(fig) == []


def test_category_axis_needs_no_label():
    fig, ax = _fig()
    ax.bar(["plain", "bf16", "offload"], [30, 20, 10])
    ax.set(title="Peak by technique", ylabel="peak (MiB)")
    assert figure_problems(fig) == []


def test_legend_covering_a_line():
    fig, ax = _fig()
    x = np.linspace(0, 1, 50)
    ax.plot(x, np.ones_like(x) * 0.95, label="flat high")  # runs under an upper legend
    ax.plot(x, x * 0.5, label="rising")
    ax.set(title="t", xlabel="time (s)", ylabel="memory (MiB)", ylim=(0, 1))
    ax.legend(loc="upper center")
    problems = figure_problems(fig)
    assert any("legend covers data" in p and "plotted points" in p for p in problems), problems
    ax.legend(loc="center left")
    assert figure_problems(fig) == []


def test_legend_covering_bars():
    fig, ax = _fig()
    ax.bar([1, 2, 3, 4], [10, 10, 10, 10], label="tall")
    ax.bar([1, 2, 3, 4], [1, 1, 1, 1], label="short")
    ax.set(title="t", xlabel="ranks (count)", ylabel="bytes (MiB)", ylim=(0, 10.5))
    ax.legend(loc="upper left")
    assert any("legend covers data" in p and "bars" in p for p in figure_problems(fig))
    ax.set_ylim(0, 20)
    assert figure_problems(fig) == []


def test_several_series_need_a_legend():
    fig = good_figure()
    fig.axes[0].get_legend().remove()
    assert any("2 labelled series and no legend" in p for p in figure_problems(fig))


def test_title_overlapping_the_legend():
    fig, ax = _fig()
    x = np.arange(5)
    ax.plot(x, x, label="a")
    ax.plot(x, -x, label="b")
    ax.set(title="A title", xlabel="x (s)", ylabel="y (MiB)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0))  # above the axes, where the title is
    assert any("title overlaps" in p and "legend" in p or "legend overlaps" in p and "title" in p
               for p in figure_problems(fig)), figure_problems(fig)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.12))
    assert not any("overlaps" in p for p in figure_problems(fig))


def test_crowded_tick_labels():
    fig, ax = _fig(width_in=2.0)
    ax.plot([0, 1], [0, 1])
    ax.set_xticks(np.linspace(0, 1, 12), [f"{v:,.0f}" for v in np.linspace(10**6, 2 * 10**6, 12)])
    ax.set(title="t", xlabel="bytes (B)", ylabel="y (s)")
    assert any("x tick labels" in p and "overlap" in p for p in figure_problems(fig))


def test_problems_by_cell_skips_the_injected_parameters_cell():
    nb = {"cells": [
        {"cell_type": "markdown", "metadata": {}},
        {"cell_type": "code", "metadata": {"tags": ["parameters"]}, "execution_count": 1},
        {"cell_type": "code", "metadata": {"tags": ["injected-parameters"]}, "execution_count": 2},
        {"cell_type": "code", "metadata": {}, "execution_count": 3},
    ]}
    lines = [{"execution_count": 3, "figure": "f", "problems": ["p", "p"]}]
    assert problems_by_cell(nb, lines) == [{"cell": 2, "figure": "f", "problem": "p"}]
    assert json.dumps(problems_by_cell(nb, []))  == "[]"


@pytest.mark.parametrize("maker", [good_figure])
def test_checking_leaves_the_figure_printable(maker):
    import io
    fig = maker()
    figure_problems(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_rule_of_names_each_rule():
    from workbook.figcheck import rule_of

    fig = good_figure()
    ax = fig.axes[0]
    ax.set_title("")
    ax.set_ylabel("peak memory")
    ax.get_legend().remove()
    rules = {rule_of(p) for p in figure_problems(fig)}
    assert rules == {"title", "unit", "legend"}, figure_problems(fig)


@pytest.mark.parametrize("label, ok", [("micro-batches per step", True), ("bubble fraction", True), ("loss", True),
                                        ("layers", True), ("step time", False), ("tokens/s", False),
                                        ("memory per layer", False), ("tokens/s (thousands)", True),
                                        ("allocation/free event", True), ("bytes per parameter, one rank", False),
                                        ("FLOPs / plain", True), ("MiB", False), ("micro-batches held at the peak", True)])
def test_unit_rule_on_labels(label, ok):
    fig = good_figure()
    fig.axes[0].set_ylabel(label)
    assert (not any("names no unit" in p for p in figure_problems(fig))) == ok, label


def test_a_title_wider_than_the_figure_is_cut_off():
    fig = good_figure()
    fig.axes[0].set_title("A title far too long for a figure six inches wide, so that its ends fall off both sides")
    assert any("title is cut off" in p for p in figure_problems(fig)), figure_problems(fig)


def test_labkits_stacked_memory_bars_pass():
    """plot_memory_bars puts its legend beside the bars (stacked bars and a budget line fill the axes)."""
    from labkit.plots import new_figure, plot_memory_bars

    splits = {name: {"parameters": 10 * 2**20, "gradients": 10 * 2**20, "optimizer_state": 20 * 2**20,
                     "activations": act * 2**20} for name, act in (("plain", 30), ("bf16", 15), ("checkpointed", 5))}
    fig, axes = new_figure(ncols=2)
    for ax in axes.flat:
        plot_memory_bars(splits, ax=ax, budget_bytes=60 * 2**20)
    assert figure_problems(fig) == []


@pytest.mark.parametrize("draw", ["zero bars", "empty line", "empty scatter", "empty area"])
def test_a_legend_entry_that_draws_nothing(draw):
    from matplotlib.patches import Patch

    from workbook.figcheck import rule_of

    fig, ax = _fig()
    ax.bar(["plain", "offload"], [30, 20], label="activations")
    if draw == "zero bars":
        ax.bar(["plain", "offload"], [0, 0], bottom=[30, 20], label="gradients")
    elif draw == "empty line":
        ax.plot([], [], label="gradients")
    elif draw == "empty scatter":
        ax.scatter([], [], label="gradients")
    else:
        ax.fill_between([], [], label="gradients")
    ax.set(title="Peak by technique", ylabel="peak (MiB)", ylim=(0, 60))
    ax.legend(loc="upper right")
    problems = figure_problems(fig)
    assert [p for p in problems if "draws nothing" in p] == ["panel 1 ('Peak by technique'): the legend entry "
                                                              "'gradients' draws nothing"], problems
    assert rule_of(problems[0]) == "empty legend entry"
    # the same entry passes once it draws something, and a proxy handle made only for the legend is not checked
    fig, ax = _fig()
    ax.bar(["plain", "offload"], [30, 20], label="activations")
    ax.bar(["plain", "offload"], [0, 4], bottom=[30, 20], label="gradients")
    ax.set(title="Peak by technique", ylabel="peak (MiB)", ylim=(0, 60))
    ax.legend(handles=[*ax.containers, Patch(color="grey", label="budget")], loc="upper right")
    assert figure_problems(fig) == []


def test_labkits_figures_list_only_what_they_draw():
    """plot_memory_bars leaves out a category with no bytes; plot_timeline a phase with no events."""
    from labkit.meter import TimelinePoint
    from labkit.plots import new_figure, plot_memory_bars, plot_timeline

    fig, (ax0, ax1) = new_figure(ncols=2)
    plot_memory_bars({"plain": {"parameters": 2**20, "gradients": 0, "activations": 300 * 2**20},
                      "L2L": {"parameters": 2**20, "gradients": 2**18, "activations": 2**20}}, ax=ax0)
    assert [t.get_text() for t in ax0.get_legend().get_texts()] == [  # no optimizer state; two hairlines sized
        "parameters\n(≤ 1.00 MiB)", "gradients\n(≤ 0.25 MiB)", "activations"]
    points = [TimelinePoint(i, 0.0, b * 2**20, "other" if i == 0 else "forward") for i, b in enumerate(range(1, 200))]
    plot_timeline(points, ax=ax1)
    assert [t.get_text() for t in ax1.get_legend().get_texts()] == ["forward", "other (1 event)"]
    sizes = {c.get_label(): c.get_sizes()[0] for c in ax1.collections}
    assert sizes["other (1 event)"] > sizes["forward"]  # one event: a larger dot, not hidden under the line
    assert figure_problems(fig) == []


def test_a_live_figures_frames_may_list_series_still_to_come():
    """LiveFigure marks its frames: the first lists the second sweep's entry before its first point."""
    from labkit.plots import LiveFigure

    def draw(fig, axes, d):
        for ax, name in zip(axes, ("batch", "seq")):
            ax.plot(range(len(d[name])), d[name], "o", label="measured")
            ax.plot([0, 3], [0, 3], "--", label="bound")
            ax.set(title=name, xlabel="batch (samples)", ylabel="bytes (MiB)")
            ax.legend(loc="upper left")

    frame = LiveFigure(draw).update({"batch": [1.0], "seq": []})
    assert not any("draws nothing" in p for p in figure_problems(frame))
    frame._labkit_live = False  # the same frame drawn once, not live: its empty entry is named
    assert any("'measured' draws nothing" in p for p in figure_problems(frame)), figure_problems(frame)
