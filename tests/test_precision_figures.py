"""labkit.precision_figures: chapter 03's loss-curve figure."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from labkit.precision_figures import plot_loss_curves  # noqa: E402
from workbook.figcheck import figure_problems  # noqa: E402

COLORS = {"fp32": "#505050", "bf16": "#64b5cd", "fp16": "#da8bc3"}


def test_loss_curves_draw_each_curve_and_its_difference_from_fp32():
    curves = {"fp32": [5.0, 4.0, 3.0], "bf16": [5.0, 4.1, 3.2], "fp16": [5.0, 3.9, 3.1]}
    fig = plot_loss_curves(curves, COLORS, best_loss=2.0, title="Loss curves", suptitle="a summary")
    ax, ax_diff = fig.axes[:2]
    assert [line.get_label() for line in ax.get_lines()][:3] == ["fp32", "bf16", "fp16"]
    diffs = {line.get_label(): list(line.get_ydata()) for line in ax_diff.get_lines() if "−" in line.get_label()}
    assert diffs["bf16 − fp32"] == pytest.approx([0.0, 0.1, 0.2]) and diffs["fp16 − fp32"] == pytest.approx([0.0, -0.1, 0.1])
    assert any(list(line.get_ydata()) == [2.0, 2.0] for line in ax.get_lines())  # the best possible loss
    assert fig._suptitle.get_text() == "a summary"
    assert figure_problems(fig) == []


def test_loss_curves_need_fp32():
    with pytest.raises(ValueError, match="fp32"):
        plot_loss_curves({"bf16": [1.0, 0.5]}, COLORS)


def test_step_memory_and_time_draws_bars_and_the_time_ratio():
    from labkit.precision_figures import plot_step_memory_and_time

    splits = {"fp32 step": {"parameters": 400, "activations": 800}, "bf16 step": {"parameters": 400, "activations": 500}}
    fig = plot_step_memory_and_time(splits, {"fp32": 2.0, "bf16": 1.6}, COLORS, "t4", "Memory, width 8", "roofline bound")
    ax_mem, ax_time = fig.axes[:2]
    assert [round(p.get_height(), 6) for p in ax_time.patches] == [2.0, 1.6]
    fig.canvas.draw()  # every bar label inside the axes: none cut at the frame
    frame = ax_time.get_window_extent()
    assert all(frame.y0 <= t.get_window_extent().y0 and t.get_window_extent().y1 <= frame.y1 for t in ax_time.texts)
    assert ax_time.get_title() == "bf16: × 0.80 fp32's time" and "t4" in ax_time.get_ylabel()
    assert "roofline bound" in ax_time.get_ylabel()
    assert [t.get_text() for t in ax_mem.get_legend().get_texts()] == ["parameters", "activations"]
    assert ax_mem.get_title() == "Memory, width 8"
    assert figure_problems(fig) == []
    with pytest.raises(ValueError, match="fp32"):
        plot_step_memory_and_time(splits, {"bf16": 1.0}, COLORS, "t4")
    both = plot_step_memory_and_time(splits, {"fp32": 2.0, "bf16": 2.4}, COLORS, "t4", work_ratio=0.5)
    assert both.axes[1].get_title() == "bf16: × 1.20 fp32's time\n(× 0.50 by its work alone)"
    assert figure_problems(both) == []


def test_legend_used_categories_drops_categories_zero_in_every_bar():
    from labkit.plots import new_figure, plot_memory_bars
    from labkit.precision_figures import legend_used_categories

    splits = {"a": {"parameters": 400, "gradients": 0, "activations": 800}, "b": {"parameters": 400, "activations": 0}}
    _, ax = new_figure()
    plot_memory_bars(splits, ax=ax, budget_bytes=1000)
    legend_used_categories(ax, splits)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["budget", "parameters", "activations"]
