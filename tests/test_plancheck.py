"""labkit.planner.check and planplot.draw_check (chapter 09): the plan's rows beside the meter's peaks and the timer."""

from __future__ import annotations

import dataclasses
import math

import pytest

from labkit.gpus import GPUS
from labkit.planner.check import PlanCheck, memory_bound, random_order_rho, short_name
from labkit.planner.plan import Combination, Row
from labkit.throughput import Throughput
from workbook.figcheck import figure_problems


def _row(peak_bytes, step_s, checkpointing="none", precision="fp32", offload=False, optimizer="device", mb=4,
         host_s=0.0, flops=10**9, bytes_accessed=10**6):
    c = Combination(1, "single", mb, 4 // mb, checkpointing, precision, offload, optimizer)
    return Row(c, peak_bytes, {}, True, flops, step_s, 0.0, step_s, 1.0, bytes_accessed, host_s)


def _timed(step_s):
    return Throughput(step_s, 1 / step_s, None, 1, (step_s,))


@pytest.fixture
def check():
    rows = [_row(1000, 0.010), _row(700, 0.011, optimizer="host", host_s=0.001), _row(800, 0.012, offload=True),
            _row(1000, 0.010, checkpointing="sqrt"), _row(900, 0.013, precision="bf16")]
    predicted = {short_name(r.combination): r for r in rows}
    measured = dict(zip(predicted, [1000, 700, 810, 1000, 905]))
    timed = dict(zip(list(predicted)[:4], map(_timed, [0.020, 0.030, 0.040, 0.025])))
    return PlanCheck(predicted, measured, timed, budget_bytes=805)


def test_short_name_names_only_what_is_set():
    c = Combination(1, "single", 2, 2, "every", "bf16", True, "host")
    assert short_name(c) == "mb 2 × 2, every, bf16, offload, Adam on host"
    assert short_name(Combination(1, "single", 4, 1, "none", "fp32")) == "mb 4 × 1, none, fp32"


def test_random_order_rho_shrinks_with_more_rows():
    assert random_order_rho(5) == pytest.approx(0.98)
    assert random_order_rho(101) == pytest.approx(0.196)
    assert random_order_rho(1) == math.inf


def test_errors_worst_and_fit_verdicts(check):
    assert check.errors["mb 4 × 1, none, fp32, offload"] == pytest.approx(10 / 810)
    assert check.worst == "mb 4 × 1, none, fp32, offload"
    assert check.fitting == 1  # only 700 <= 805 measured
    assert check.fits_agree == 4  # offload: predicted 800 fits, measured 810 does not


def test_ratios_rank_correlation_and_faster_rows(check):
    assert check.timed_names == list(check.predicted)[:4]
    assert check.ratios == pytest.approx([2.0, 30 / 11, 40 / 12, 2.5])
    assert check.rank_names == list(check.predicted)[:3]  # sqrt's row runs none's code: compared once
    assert check.rho == pytest.approx(1.0)  # 10, 11, 12 ms predicted; 20, 30, 40 measured: one order
    assert check.faster == []
    assert check.noise == pytest.approx(0.25)  # none and sqrt: identical code, same peak, 20 and 25 ms


def test_twins_pair_rows_that_differ_in_one_knob(check):
    assert check.twins("optimizer") == [("mb 4 × 1, none, fp32, Adam on host", "mb 4 × 1, none, fp32")]
    assert check.twins("offload") == [("mb 4 × 1, none, fp32, offload", "mb 4 × 1, none, fp32")]


def test_table_and_ratio_rows(check):
    table = check.table_rows()
    assert len(table) == 1 + 5 and table[2][1:] == ("700", "700", "0.000%", "yes", "11.00", "30.0")
    assert table[5][-1] == "-"  # the bf16 row was not timed
    ratio = check.ratio_rows(GPUS["a100-80gb"])
    assert [r[:2] for r in ratio[1:]] == [("fp32, roofline (bound)", 3), ("fp32, roofline + host (estimate)", 1)]


def test_memory_bound_compares_the_two_roofline_terms():
    gpu = GPUS["a100-80gb"]
    assert memory_bound(_row(1, 1.0, flops=1, bytes_accessed=10**9), gpu)
    assert not memory_bound(_row(1, 1.0, flops=10**15, bytes_accessed=1), gpu)


def test_draw_check_plots_every_row_and_the_timed_ones(check):
    from labkit.planner.plot import draw_check

    fig = draw_check(check, ("fp32",))
    peaks, times = fig.axes[:2]
    assert sum(len(line.get_xdata()) == 1 for line in peaks.lines) == 5  # one point per measured row
    assert sum(len(line.get_xdata()) == 1 for line in times.lines) == 4  # one per timed row
    labels = [t.get_text() for t in times.get_legend().get_texts()]
    assert "bf16 (peaks only, not timed)" in labels and "offload" in labels and "Adam on the host" in labels
    assert not [q for q in figure_problems(fig) if "draws nothing" in q]  # the legend's keys are proxies, not series
    ratios = [check.timed[n].step_s / check.predicted[n].step_s for n in check.timed_names]
    assert f"measured {min(ratios):.1f}-{max(ratios):.1f}x the prediction" in times.get_title()
    assert f"above it, faster than predicted: {len(check.faster)} of {len(check.timed_names)})" in times.get_title()


def test_draw_check_sets_the_time_panel_y_limits_from_the_predictions(check):
    from labkit.planner.plot import draw_check

    times = draw_check(check, ("fp32",)).axes[1]
    # predictions of the timed rows: 10, 11, 12, 10 ms (measured 20-40 ms): y spans them, not the measured ones
    assert times.get_ylim() == pytest.approx((10 / 1.2, 12 * 1.2))
    assert times.get_xlim() == pytest.approx((10 / 1.2, 40 * 1.2))
    times.figure.canvas.draw()
    lo, hi = times.get_ylim()
    shown = [t.get_position()[1] for t in times.get_yticklabels() if t.get_text() and lo <= t.get_position()[1] <= hi]
    assert len(shown) >= 3 and max(shown) > 10  # within a decade: labels past 10 ms too (not 7, 8, 9, 10 alone)


def test_the_time_axis_keeps_plain_ticks_apart_where_one_1_2_5_tick_is_in_range():
    from labkit.planner.plot import draw_check, log_ticks

    assert log_ticks(10, 110) == [10, 20, 50, 100]
    assert log_ticks(55, 105) == [70, 100]  # (CI85: matplotlib's LogLocator labelled 90 and 100 side by side)
    rows = [_row(1000, s) for s in (0.055, 0.060, 0.070)]
    rows = [dataclasses.replace(r, combination=dataclasses.replace(r.combination, micro_batch=m)) for r, m in zip(rows, (1, 2, 4))]
    predicted = {short_name(r.combination): r for r in rows}
    check = PlanCheck(predicted, dict.fromkeys(predicted, 1000),
                      dict(zip(predicted, map(_timed, [0.060, 0.075, 0.088]))), budget_bytes=2000)
    fig = draw_check(check, ("fp32",))
    assert not [q for q in figure_problems(fig) if "overlap" in q], figure_problems(fig)


def test_draw_plan_starts_a_linear_time_axis_at_zero():
    from labkit.planner.plan import Plan
    from labkit.planner.plot import draw_plan

    p = Plan("m", "h100", 1, 16, 8, 10**9, 60 * 2**30, 0.1)
    p.rows.extend([_row(40 * 2**30, 0.100), _row(30 * 2**30, 0.110, checkpointing="sqrt"),
                   _row(20 * 2**30, 0.120, precision="bf16"), _row(50 * 2**30, 0.900, mb=2)])
    ax = draw_plan(p).axes[0]  # margins of 25% of 100-900 ms would start the axis at -100 ms
    assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0
    assert not [q for q in figure_problems(ax.figure) if "draws nothing" in q]  # keys: proxies, not empty series
