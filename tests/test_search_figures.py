"""labkit.search.figures on hand-made trials: one name per kind of trial, legend entries only for kinds
the study has, a projected speed labelled as counted work alone, every front point ringed whatever its kind."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from labkit import plots
from labkit.search import figures
from workbook.figcheck import figure_problems


def _trial(number, status, speed, peak_mib, over=-1.0, state=TrialState.COMPLETE):
    """Return a speed trial as the study stores it: value, constraint (peak over the budget), status and peak."""
    t = optuna.trial.create_trial(
        params={"micro_batch": number}, distributions={"micro_batch": optuna.distributions.IntDistribution(0, 99)},
        value=speed if state == TrialState.COMPLETE else None, state=state,
        user_attrs={"status": status, "peak_bytes": peak_mib * 2**20},
        system_attrs={"constraints": [over]} if state == TrialState.COMPLETE else {})
    t.number = number
    return t


TRIALS = [_trial(0, "ok", 0.9, 30), _trial(1, "ok", 1.2, 20), _trial(2, None, None, 10, state=TrialState.FAIL),
          _trial(3, "predicted", 1.4, 25), _trial(4, "predicted", 1.1, 15), _trial(5, "ok", 0.5, 12)]


def test_each_trial_has_one_kind():
    assert [figures.trial_kind(t) for t in TRIALS] == ["fits (metered)", "fits (metered)", "failed",
                                                       "fits (predicted, not run here)",
                                                       "fits (predicted, not run here)", "fits (metered)"]
    assert figures.trial_kind(_trial(6, "predicted_oom", 0.0, 60, over=5.0)) == "does not fit"
    assert all(figures.trial_kind(t) in figures.KINDS for t in TRIALS)


def test_a_projected_speed_is_labelled_by_counted_work_alone_and_a_measured_one_is_not():
    assert figures.speed_basis("projected on the t4") == "projected on the t4, by counted work alone"
    assert figures.speed_label("measured on this GPU") == "speed, x the plain step\n(measured on this GPU)"


def test_progress_names_each_kind_once_and_only_kinds_the_study_has():
    fig, ax = plots.new_figure(width_in=7.0, height_in=3.4)
    figures.draw_progress(fig, ax, TRIALS, "projected on the t4")
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["best that fits so far", "fits (metered)", "fits (predicted, not run here)", "the plain step's speed"]
    assert [len(c.get_offsets()) for c in ax.collections] == [3, 2]  # the failed trial has no speed: no point
    best = ax.get_lines()[0]
    assert list(best.get_ydata()) == [0.9, 1.2, 1.2, 1.4, 1.4, 1.4]  # the best that fits so far
    assert best.get_drawstyle() == "steps-post"  # it holds until a trial beats it: no slope between two trials
    assert "counted work alone" in ax.get_title()
    assert figure_problems(fig) == []


def test_the_front_rings_every_front_point_and_marks_each_predicted_point_alike():
    fig, ax = plots.new_figure(width_in=7.0, height_in=3.6)
    front = [TRIALS[5], TRIALS[4], TRIALS[1], TRIALS[3]]  # by peak: 12, 15, 20, 25 MiB
    figures.draw_front(ax, TRIALS, front, 32 * 2**20, "projected on the t4")
    hollow = next(c for c in ax.collections if c.get_label() == "fits (predicted, not run here)")
    assert len(hollow.get_offsets()) == 2  # both predicted trials, the one on the front too
    ring = next(line for line in ax.get_lines() if line.get_label().startswith("Pareto front"))
    assert list(ring.get_xdata()) == [12, 15, 20, 25] and ring.get_markerfacecolor() == "none"
    assert figure_problems(fig) == []


def test_progress_before_any_trial_fits_has_no_running_best_entry():
    """A live figure's first frames: a trial that did not fit, one still running; nothing in the legend draws nothing."""
    fig, ax = plots.new_figure(width_in=7.0, height_in=3.4)
    early = [_trial(0, "predicted_oom", 0.0, 60, over=5.0), _trial(1, None, None, 10, state=TrialState.RUNNING)]
    figures.draw_progress(fig, ax, early, "measured on this GPU")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["does not fit", "the plain step's speed"]
    assert figure_problems(fig) == []
