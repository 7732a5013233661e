"""labkit.techniques.pipeline: the ideal GPipe and 1F1B schedules and their bubble; labkit.pipelinerun: bubbles measured
from spans."""

from __future__ import annotations

import statistics
import sys

import pytest

from labkit.dist import time_actions
from labkit.pipelinerun import BubbleVerdict, actions_within, measured_bubble
from labkit.plots import plot_gantt
from labkit.techniques.pipeline import bubble_theory, ideal_schedule, replay, simulate_order, stage_order, torch_schedule_order


def test_stage_orders_of_gpipe_and_1f1b():
    assert stage_order("GPipe", 0, 2, 3) == ["F0", "F1", "F2", "B0", "B1", "B2"]
    assert stage_order("1F1B", 0, 2, 4) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert stage_order("1F1B", 1, 2, 4) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert stage_order("1F1B", 0, 4, 2) == ["F0", "F1", "B0", "B1"]  # fewer micro-batches than stages
    with pytest.raises(ValueError, match="schedule"):
        stage_order("zigzag", 0, 2, 2)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("stages, micro_batches", [(2, 1), (2, 4), (4, 8), (3, 5)])
def test_ideal_schedules_have_gpipes_bubble(schedule, stages, micro_batches):
    plan = ideal_schedule(schedule, stages, micro_batches, t_f=1.0, t_b=2.0)
    assert sorted(plan) == list(range(stages))
    for s, actions in plan.items():
        assert [label for label, _, _ in actions] == stage_order(schedule, s, stages, micro_batches)
        assert all(b > a for _, a, b in actions)
        assert all(actions[i][2] <= actions[i + 1][1] for i in range(len(actions) - 1))  # one action at a time
    measured = measured_bubble(plan)
    assert measured["makespan_s"] == pytest.approx((micro_batches + stages - 1) * 3.0)
    assert measured["bubble_fraction"] == pytest.approx(bubble_theory(stages, micro_batches))


def test_1f1b_holds_at_most_k_micro_batches_gpipe_all_of_them():
    def most_in_flight(actions):
        live = peak = 0
        for label, _, _ in actions:
            live += 1 if label[0] == "F" else -1
            peak = max(peak, live)
        return peak
    K, M = 4, 8
    assert [most_in_flight(ideal_schedule("GPipe", K, M)[s]) for s in range(K)] == [M] * K
    assert [most_in_flight(ideal_schedule("1F1B", K, M)[s]) for s in range(K)] == [K - s for s in range(K)]


def test_an_uneven_pipeline_idles_more_than_the_formula():
    even = measured_bubble(ideal_schedule("1F1B", 2, 8, t_f=[1.0, 1.0], t_b=[2.0, 2.0]))["bubble_fraction"]
    uneven = measured_bubble(ideal_schedule("1F1B", 2, 8, t_f=[1.0, 2.0], t_b=[2.0, 4.0]))["bubble_fraction"]
    assert even == pytest.approx(bubble_theory(2, 8)) and uneven > even
    with pytest.raises(ValueError, match="one time per stage"):
        ideal_schedule("GPipe", 3, 2, t_f=[1.0, 1.0])


def test_bubble_theory_and_its_interleaved_form():
    assert bubble_theory(2, 1) == 0.5
    assert bubble_theory(4, 12) == pytest.approx(3 / 15)
    assert bubble_theory(2, 4, virtual_stages=2) == pytest.approx(1 / 9)
    assert bubble_theory(1, 7) == 0.0
    with pytest.raises(ValueError, match="micro_batches"):
        bubble_theory(2, 0)


def test_actions_within_a_window_and_the_measured_bubble():
    spans = [("step A", 0.0, 1.0), ("F0", 0.1, 0.2), ("B0", 0.5, 0.7), ("step B", 2.0, 3.0), ("F0", 2.1, 2.2)]
    assert actions_within(spans, "step A") == [("F0", 0.1, 0.2), ("B0", 0.5, 0.7)]
    with pytest.raises(ValueError, match="one span"):
        actions_within(spans, "step C")
    m = measured_bubble({0: [("F0", 0.0, 1.0)], 1: [("F0", 1.0, 2.0)]})
    assert m["makespan_s"] == 2.0 and m["busy_s"] == {0: 1.0, 1: 1.0} and m["bubble_fraction"] == 0.5
    with pytest.raises(ValueError):
        measured_bubble({0: []})


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_a_replay_removes_the_waiting_and_keeps_the_compute(schedule):
    """Measured actions delayed by waits (sends, a neighbour, a busy core) replay into the compute-only schedule."""
    K, M = 3, 5
    compact = ideal_schedule(schedule, K, M, t_f=[1.0, 1.5, 1.2], t_b=[2.0, 2.5, 3.0])
    assert replay(compact) == compact  # nothing to remove
    delayed = {}
    for s, actions in compact.items():  # every action starts later by a growing wait: the order stays the same
        delayed[s] = [(label, a + 0.3 * (n + 1) + 0.1 * s, b + 0.3 * (n + 1) + 0.1 * s)
                      for n, (label, a, b) in enumerate(actions)]
    again = replay(delayed)
    assert {s: [(label, pytest.approx(a), pytest.approx(b)) for label, a, b in acts] for s, acts in again.items()} \
        == compact
    assert measured_bubble(delayed)["bubble_fraction"] > measured_bubble(again)["bubble_fraction"]
    assert measured_bubble(delayed)["busy_s"] == pytest.approx(measured_bubble(again)["busy_s"])


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_a_replay_lies_between_the_ideal_steps_of_its_fastest_and_slowest_actions(schedule):
    """Actions of unequal length, each after a wait (the ranks' clocks apart): the replay keeps no waiting and loses
    no compute, so its step lies between the ideal schedules fed each stage's fastest and slowest forward and backward."""
    import random

    rng = random.Random(0)
    K, M = 3, 6
    measured = {}
    for s, actions in ideal_schedule(schedule, K, M, t_f=[1.0, 1.5, 1.2], t_b=[2.0, 2.5, 3.0]).items():
        t, rows = 0.0, []
        for label, a, b in actions:
            start = t + rng.uniform(0.0, 0.5)  # a wait before every action
            t = start + (b - a) * rng.uniform(0.5, 1.5)  # an action of its own length
            rows.append((label, start, t))
        measured[s] = rows
    plan = replay(measured)

    def ideal_makespan(pick):
        t_f = [pick(b - a for label, a, b in plan[s] if label[0] == "F") for s in range(K)]
        t_b = [pick(b - a for label, a, b in plan[s] if label[0] == "B") for s in range(K)]
        return measured_bubble(ideal_schedule(schedule, K, M, t_f=t_f, t_b=t_b))["makespan_s"]

    makespan = measured_bubble(plan)["makespan_s"]
    assert ideal_makespan(min) - 1e-9 <= makespan <= ideal_makespan(max) + 1e-9


def test_a_replay_follows_the_stage_named_in_each_label():
    """Interleaved: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; "F0/s2" is stage 2's forward."""
    acts = {0: [("F0/s0", 0, 1), ("F0/s2", 5, 6), ("B0/s2", 9, 10), ("B0/s0", 13, 14)],
            1: [("F0/s1", 2, 3), ("F0/s3", 7, 8), ("B0/s3", 8, 9), ("B0/s1", 11, 12)]}
    plan = replay(acts)
    assert plan[0] == [("F0/s0", 0, 1), ("F0/s2", 2, 3), ("B0/s2", 5, 6), ("B0/s0", 7, 8)]
    assert plan[1] == [("F0/s1", 1, 2), ("F0/s3", 3, 4), ("B0/s3", 4, 5), ("B0/s1", 6, 7)]
    with pytest.raises(ValueError, match="order"):
        replay({0: [("B0", 0, 1), ("F0", 1, 2)], 1: [("F0", 0, 1), ("B0", 1, 2)]})  # B before its F: impossible


def test_actions_within_can_leave_out_the_wait_for_a_core():
    spans = [("F0", 0.1, 0.3), ("step", 0.0, 1.0), ("B0", 0.4, 0.9)]
    assert actions_within(spans, "step", core_waits=[0.05, 0.0, 0.2]) == [("F0", 0.1, pytest.approx(0.25)),
                                                                           ("B0", 0.4, pytest.approx(0.7))]
    with pytest.raises(ValueError, match="one entry per span"):
        actions_within(spans, "step", core_waits=[0.0])


def test_the_last_stages_loss_is_part_of_its_forward():
    """A loss span "L0" right after "F0" (the schedule computes it then) extends F0: compute, not bubble."""
    spans = [("step", 0.0, 1.0), ("F0", 0.1, 0.2), ("L0", 0.2, 0.35), ("F1", 0.4, 0.5), ("L1", 0.5, 0.6),
             ("B0", 0.6, 0.8)]
    assert actions_within(spans, "step", core_waits=[0, 0, 0.05, 0, 0, 0]) == [
        ("F0", 0.1, pytest.approx(0.3)), ("F1", 0.4, 0.6), ("B0", 0.6, 0.8)]
    without_loss = measured_bubble({0: actions_within([s for s in spans if s[0][0] != "L"], "step")})
    with_loss = measured_bubble({0: actions_within(spans, "step")})
    assert with_loss["busy_s"][0] == pytest.approx(without_loss["busy_s"][0] + 0.15 + 0.1)


def test_time_actions_times_the_loss_through_the_schedules_private_hook(monkeypatch):
    """Pins torch's private `_maybe_compute_loss(stage, output, target_mbs, mb_index, ...)` that time_actions wraps."""
    import inspect

    from torch.distributed.pipelining.schedules import _PipelineSchedule

    assert list(inspect.signature(_PipelineSchedule._maybe_compute_loss).parameters)[:5] == [
        "self", "stage", "output", "target_mbs", "mb_index"]
    spans = []

    class Span:
        def __init__(self, label):
            self.label = label

        def __enter__(self):
            spans.append(self.label)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(sys.modules["labkit.dist.rank"], "span", Span)  # (time_actions' module)

    class Stage:
        stage_index, is_last = 1, True

        def forward_one_chunk(self, chunk_id, *args):
            return chunk_id

        def backward_one_chunk(self, chunk_id, *args):
            return None

        def backward_weight_one_chunk(self, chunk_id, *args):
            return None

    class Schedule:
        _loss_fn = staticmethod(lambda out, target: out + target)

        def __init__(self):
            self.losses = []

        def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
            self.losses.append(self._loss_fn(output, target_mbs[mb_index]))

    stage, schedule = Stage(), Schedule()
    time_actions(stage, schedule=schedule)
    time_actions(stage, schedule=schedule)  # a second stage of the same schedule: the loss is wrapped once
    out = stage.forward_one_chunk(0)
    schedule._maybe_compute_loss(stage, out, [10], 0)
    assert schedule.losses == [10] and spans == ["F0", "F0", "L0"]  # (forward wrapped twice here: two calls)


def test_torchs_own_schedule_orders_beside_labkits():
    """torch's schedule IR (get_schedule_ops, private: pinned here): GPipe as labkit's; 1F1B's last rank numbered
    from 1 in torch 2.13's IR (its execution runs F0 first); interleaved's order gives (K-1)/(VM+K-1)."""
    K, M = 2, 4
    assert torch_schedule_order("GPipe", K, M) == {s: stage_order("GPipe", s, K, M) for s in range(K)}
    torch_1f1b = torch_schedule_order("1F1B", K, M)
    assert torch_1f1b[0] == stage_order("1F1B", 0, K, M)
    kinds = [label[0] for label in torch_1f1b[K - 1]]
    assert kinds == [label[0] for label in stage_order("1F1B", K - 1, K, M)]  # the same F/B pattern
    assert sorted(int(label[1:]) for label in torch_1f1b[K - 1] if label[0] == "F") == list(range(1, M + 1))
    with pytest.raises(ValueError, match="order"):
        simulate_order(torch_1f1b)  # F4 exists on no other stage: the IR is not a runnable order
    assert measured_bubble(simulate_order(torch_schedule_order("GPipe", K, M)))["bubble_fraction"] == \
        pytest.approx(bubble_theory(K, M))
    # only a rank with no warm-up forward (the last) starts its count at 1: notebook 06 renumbers those from 0
    four = torch_schedule_order("1F1B", 4, 6)
    assert [min(int(label[1:]) for label in four[r] if label[0] == "F") for r in range(4)] == [0, 0, 0, 1]
    inter = torch_schedule_order("Interleaved1F1B", K, M, stages_per_rank=2)
    assert sorted(inter[0]) == sorted([f"{k}{i}/s{s}" for k in "FB" for i in range(M) for s in (0, 2)])
    assert measured_bubble(simulate_order(inter))["bubble_fraction"] == pytest.approx(bubble_theory(K, M, 2))


def test_simulate_order_reproduces_the_ideal_schedule():
    orders = {s: stage_order("1F1B", s, 3, 5) for s in range(3)}
    assert simulate_order(orders) == ideal_schedule("1F1B", 3, 5)


def test_plot_gantt_draws_a_row_per_rank():
    ax = plot_gantt(ideal_schedule("1F1B", 2, 4))
    assert len(ax.patches) == 16  # 2 stages × (4 forwards + 4 backwards)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    colors = {p.get_facecolor()[:3] for p in ax.patches}
    assert len(colors) == 2  # forward and backward


def test_plot_gantt_colours_waiting_and_communication_apart_and_labels_only_what_fits():
    spans = {0: [("F", 0.0, 0.050), ("send", 0.050, 0.051), ("wait", 0.051, 0.150), ("B", 0.150, 0.250)],
             1: [("wait", 0.0, 0.050), ("F", 0.050, 0.100), ("B", 0.100, 0.200), ("all_reduce", 0.200, 0.260)]}
    ax = plot_gantt(spans, legend=True)
    assert len({p.get_facecolor()[:3] for p in ax.patches}) == 4  # forward, backward, waiting, communication
    assert sorted(t.get_text() for t in ax.texts) == ["B", "B", "F", "F", "all_reduce", "wait", "wait"]  # no "send"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward", "waiting (recv)",
                                                                   "send / all-reduce (incl. waiting for peers)"]


def test_partition_shares_out_the_blocks_and_refuses_more_pieces_than_blocks(tiny_gpt):
    import labkit
    from labkit.techniques.pipeline import partition

    model = tiny_gpt()  # 2 blocks
    pieces = partition(model, 2)
    assert len(pieces) == 2
    held = [{id(p) for p in piece.parameters()} for piece in pieces]
    assert held[0] | held[1] == {id(p) for p in model.parameters()}  # every parameter is held somewhere
    assert held[0] & held[1] == {id(model.tok_emb.weight)}  # only the tied embedding/head weight is on both ends
    with pytest.raises(labkit.ParameterError, match=r"parts \(3\) must not exceed the model's 2 blocks"):
        partition(model, 3)
    with pytest.raises(labkit.ParameterError, match="parts"):
        partition(model, 0)


# -- chapter 06b's bookkeeping: timed steps read back, replayed and split; micro-batches held from bytes -------------

class _Rank:
    """A stand-in for labkit.dist's RankResult: its rank, spans and waits for a core."""

    def __init__(self, rank, spans, core_waits):
        self.rank, self.spans, self.core_waits = rank, spans, core_waits


def _ranks_from(plan_by_step, gap_s=0.0, core_s=0.0):
    """Turn ideal plans {t: {rank: actions}} into ranks' spans "GPipe M=4 #t", each action pushed `gap_s` later per
    action before it (time between actions) and lengthened by `core_s` spent waiting for a core (each a number, or
    a list with one per step)."""
    ranks = {}
    t0 = 0.0
    gaps, cores = ([x] * len(plan_by_step) if isinstance(x, float) else x for x in (gap_s, core_s))
    for t, plan in plan_by_step.items():
        gap_s, core_s = gaps[t], cores[t]
        end = t0
        for r, acts in plan.items():
            spans, waits = ranks.setdefault(r, ([], []))
            for i, (label, a, b) in enumerate(acts):
                shift = t0 + i * (gap_s + core_s)
                spans.append((label, a + shift, b + shift + core_s))
                waits.append(core_s)
                end = max(end, b + shift + core_s)
        for r in plan:
            ranks[r][0].append((f"GPipe M=4 #{t}", t0, end))
            ranks[r][1].append(0.0)
        t0 = end + 1.0
    return [_Rank(r, spans, waits) for r, (spans, waits) in sorted(ranks.items())]


def test_pipeline_timings_replay_the_compute_and_split_the_rest():
    from labkit.pipelinerun import PipelineTimings

    plan = ideal_schedule("GPipe", 2, 4)
    exact = PipelineTimings(_ranks_from({0: plan, 1: plan}), 2)
    assert exact.bubbles("GPipe", 4) == pytest.approx([bubble_theory(2, 4)] * 2)
    assert exact.replayed_bubble("GPipe", 4) == pytest.approx(bubble_theory(2, 4))
    assert exact.ideal_bubble_with_stage_times("GPipe", 4) == pytest.approx(bubble_theory(2, 4))
    assert exact.step_parts_s("GPipe", 4) == pytest.approx((15.0, 0.0, 0.0))  # (M + K - 1)·3 of compute, nothing else
    slow = PipelineTimings(_ranks_from({0: plan, 1: plan}, gap_s=0.5, core_s=0.25), 2)
    compute, core, between = slow.step_parts_s("GPipe", 4)
    assert compute == pytest.approx(15.0) and core > 0 and between > 0  # the waits and the gaps, told apart
    measured, whole, compute_only = slow.makespans_s("GPipe", 4)[0]
    assert compute_only < whole < measured and measured == pytest.approx(compute + core + between)
    assert slow.per_action_s("GPipe", 4)[0] == pytest.approx(1.5)  # 4 forwards of 1 s and 4 backwards of 2 s
    assert slow.replayed_bubble("GPipe", 4) == pytest.approx(bubble_theory(2, 4))  # the compute alone: the formula
    assert slow.median_step("GPipe", 4)[0] > bubble_theory(2, 4)  # what the gaps add
    assert not slow.rise_told("GPipe", 4, 4)  # a point is not apart from itself
    assert exact.bubble_parts("GPipe", 4) == pytest.approx((bubble_theory(2, 4), 0.0, 0.0))
    replayed, core, between = slow.bubble_parts("GPipe", 4)
    assert replayed == pytest.approx(bubble_theory(2, 4)) and between > 0  # the gaps idle both ranks
    assert replayed + core + between == pytest.approx(slow.bubbles("GPipe", 4)[0])  # the parts add up
    # steps that differ (rank 1 three times slower in the first, gaps in the others): the parts' medians over steps
    # would not add up to the median bubble; the median step's parts do
    def rank1_slower(k):
        acts, t = [], plan[1][0][1]
        for label, a, b in plan[1]:
            acts.append((label, max(t, a), max(t, a) + k * (b - a)))
            t = acts[-1][2]
        return {0: plan[0], 1: acts}

    steps = [(3.0, 0.0), (1.0, 1.0), (1.0, 0.4)]  # (rank 1's slowdown, time between actions) per step
    mixed = PipelineTimings(_ranks_from({t: rank1_slower(k) for t, (k, _) in enumerate(steps)},
                                        gap_s=[g for _, g in steps]), 3)
    median, t = mixed.median_step("GPipe", 4)
    assert sum(mixed.bubble_parts("GPipe", 4)) == pytest.approx(median) == pytest.approx(mixed.bubbles("GPipe", 4)[t])
    alone = [PipelineTimings(_ranks_from({0: rank1_slower(k)}, gap_s=g), 1).bubble_parts("GPipe", 4) for k, g in steps]
    assert sum(statistics.median(part) for part in zip(*alone)) < median - 0.02  # what the parts' medians gave before


def test_micro_batches_held_come_out_of_the_bytes():
    from labkit.pipelinerun import fit_inverse_m, micro_batches_held

    assert fit_inverse_m([1, 2, 4], [3 + 8 / m for m in (1, 2, 4)]) == pytest.approx((3.0, 8.0))
    K, saved, fixed, working = 2, [100.0, 80.0], [10.0, 20.0], [6.0, 4.0]
    ms = [2, 4, 8, 16]
    peaks = {"GPipe": {m: [fixed[s] + saved[s] + working[s] / m for s in range(K)] for m in ms},
             "1F1B": {m: [fixed[s] + ((K - s) * saved[s] + working[s]) / m for s in range(K)] for m in ms}}
    fit = micro_batches_held(peaks, {"GPipe": ms, "1F1B": ms}, saved)
    assert fit.fixed_bytes == pytest.approx(fixed) and fit.working_bytes == pytest.approx(working)
    assert fit.fit_saved_bytes == pytest.approx(saved)
    assert all(fit.held["GPipe"][m] == pytest.approx([m, m]) for m in ms)
    assert all(fit.held["1F1B"][m] == pytest.approx([2, 1]) for m in ms)


def test_forwards_from_zero_and_the_step_from_the_first_forward():
    from labkit.techniques.pipeline import forwards_from_zero
    from labkit.pipelinerun import seconds_in, step_from_first_forward

    assert forwards_from_zero({0: ["F0", "B0"], 1: ["F1", "B0", "F2", "B1"]}) == {0: ["F0", "B0"],
                                                                                  1: ["F0", "B0", "F1", "B1"]}
    assert forwards_from_zero({0: ["F1/s0", "B1/s0"]}) == {0: ["F1/s0", "B1/s0"]}  # stage labels as they are
    spans = {0: [("F", 1.0, 2.0), ("send", 2.0, 2.5), ("B", 4.0, 5.0), ("step", 0.5, 5.0)],
             1: [("wait", 0.2, 2.5), ("F", 2.5, 3.0), ("B", 3.0, 4.0), ("step", 0.2, 4.0)]}
    cut, offsets = step_from_first_forward(spans)
    assert offsets == pytest.approx({0: 0.0, 1: 0.8})  # rank 1 began waiting 0.8 s before the first forward
    assert cut[1][0] == ("wait", 1.0, 2.5) and all(label != "step" for s in cut.values() for label, _, _ in s)
    assert seconds_in(cut[0], "F", "B") == pytest.approx(2.0) and seconds_in(cut[1], "wait") == pytest.approx(1.5)
    with pytest.raises(ValueError, match="one span labelled 'step'"):
        step_from_first_forward({0: [("F", 0.0, 1.0)]})


def test_level_stretch_takes_the_pairwise_overlapping_points_around_the_lowest():
    from labkit.pipelinerun import level_stretch

    ys = [0.511, 0.383, 0.375, 0.327, 0.370]
    assert level_stretch(ys, [(0.511, 0.512), (0.374, 0.387), (0.359, 0.401), (0.223, 0.333), (0.276, 0.458)]) == (3, 4)
    assert level_stretch([0.2, 0.3, 0.3], [(0.1, 0.3), (0.2, 0.4), (0.25, 0.35)]) == (0, 2)  # every pair overlaps
    assert level_stretch([0.5, 0.4, 0.3], [(0.5, 0.5), (0.4, 0.4), (0.3, 0.3)]) == (2, 2)  # one timed step each
    # chapter 06b's GPipe: M = 4 and M = 16 apart, M = 8 overlapping both: the stretch stops before M = 16
    gpipe = [0.509, 0.357, 0.323, 0.353, 0.407]
    assert level_stretch(gpipe, GPIPE_RANGES) == (1, 3)


GPIPE_RANGES = [(0.508, 0.510), (0.353, 0.419), (0.318, 0.373), (0.322, 0.448), (0.397, 0.436)]


def test_describe_bubble_states_the_rise_between_points_whose_spreads_do_not_overlap():
    from labkit.pipelinerun import bubble_shape, describe_bubble

    ms, ys = [1, 2, 4, 8, 16], [0.509, 0.357, 0.323, 0.353, 0.407]
    words = describe_bubble(ms, ys, GPIPE_RANGES)
    assert words == ("falls from 0.509 at M = 1 to level within the timed steps' spread (0.318-0.448) from M = 2 to "
                     "M = 8, then rises to 0.407 at M = 16, its steps (0.397-0.436) above M = 4's (0.318-0.373), "
                     "within M = 2's (0.353-0.419) and M = 8's (0.322-0.448)")
    assert "level from M = 8" not in words
    assert bubble_shape(ms, ys, GPIPE_RANGES) == "falls, level M = 2-8, rises at M = 16 (above M = 4 only)"
    # a rise before the last point, the rest within the risen point's spread
    noisy = [(0.505, 0.538), (0.330, 0.456), (0.323, 0.420), (0.424, 0.468), (0.411, 0.505)]
    ys = [0.509, 0.378, 0.376, 0.449, 0.438]
    assert describe_bubble(ms, ys, noisy) == (
        "falls from 0.509 at M = 1 to level within the timed steps' spread (0.323-0.456) from M = 2 to M = 4, then "
        "rises to 0.449 at M = 8, its steps (0.424-0.468) above M = 4's (0.323-0.420), within M = 2's (0.330-0.456), "
        "and stays within its spread to M = 16")
    assert bubble_shape(ms, ys, noisy) == "falls, level M = 2-4, rises at M = 8 (above M = 4 only)"


def test_describe_bubble_says_level_only_where_the_spreads_overlap():
    from labkit.pipelinerun import bubble_shape, describe_bubble

    ms, ys = [1, 2, 4, 8, 16], [0.511, 0.383, 0.375, 0.327, 0.370]
    ranges = [(0.511, 0.512), (0.374, 0.387), (0.359, 0.401), (0.223, 0.333), (0.276, 0.458)]
    words = describe_bubble(ms, ys, ranges)
    assert words == ("falls from 0.511 at M = 1 to level within the timed steps' spread (0.223-0.458) from M = 8 to "
                     "M = 16")
    assert bubble_shape(ms, ys, ranges) == "falls, level M = 8-16"
    assert "rise" not in words
    points = [(y, y) for y in ys]  # one timed step each: the medians' own trend, rise and all
    assert describe_bubble(ms, ys, points) == ("falls from 0.511 at M = 1 to its lowest, 0.327 at M = 8, then rises "
                                               "to 0.370 at M = 16")
    assert describe_bubble([2, 4], [0.3, 0.31], [(0.2, 0.4), (0.25, 0.35)]).startswith("stays level within")
    # chapter 06b's 1F1B of one run: M = 16 overlaps M = 8's steps but lies below M = 4's: neither level nor a rise
    ms, ys = [2, 4, 8, 16], [0.311, 0.290, 0.223, 0.252]
    ranges = [(0.300, 0.330), (0.279, 0.304), (0.200, 0.285), (0.216, 0.274)]
    assert describe_bubble(ms, ys, ranges) == (
        "falls from 0.311 at M = 2 to level within the timed steps' spread (0.200-0.304) from M = 4 to M = 8; M = 16's "
        "steps (0.216-0.274) overlap M = 8's (0.200-0.285), and lie below M = 4's (0.279-0.304)")  # each spread named
    assert bubble_shape(ms, ys, ranges) == "falls, level M = 4-8, M = 16 within M = 8's spread"


def test_a_rise_after_the_lowest_m_is_a_finding_only_beyond_the_spread_and_not_mostly_core_waits():
    from labkit.pipelinerun import PipelineTimings

    class Fixed(PipelineTimings):  # each M's timed steps' range and its median step's three parts, given
        def __init__(self, ranges, parts):
            super().__init__([], 2)
            self.ranges, self.parts = ranges, parts

        def bubble_range(self, schedule, micro_batches):
            return self.ranges[micro_batches]

        def bubble_parts(self, schedule, micro_batches):
            return self.parts[micro_batches]

    ms, ys = [1, 4, 16], [0.5, 0.3, 0.4]  # medians: down to M = 4, then up
    apart = {1: (0.49, 0.51), 4: (0.29, 0.31), 16: (0.39, 0.41)}  # M = 16's steps all above M = 4's
    between = Fixed(apart, {1: (0.5, 0, 0), 4: (0.2, 0.05, 0.05), 16: (0.2, 0.06, 0.14)}).verdict("GPipe", ms, ys)
    assert between.rise_told is True and between.why_not is None and between.words.endswith("0.300 -> 0.400: a rise)")
    # the rise in the median step's three shares, at M = 4 and M = 16 (that step's own replay, not the table's median)
    assert between.rise_ms == (4, 16)
    assert between.parts == {"replay": (0.2, 0.2), "core waits": (0.05, 0.06), "between actions": (0.05, 0.14)}
    assert between.parts_rows() == [("", "M = 4", "M = 16", "change"), ("replay", "0.200", "0.200", "+0.000"),
                                    ("core waits", "0.050", "0.060", "+0.010"),
                                    ("between actions", "0.050", "0.140", "+0.090"),
                                    ("the bubble (their sum)", "0.300", "0.400", "+0.100")]  # the measured bubbles
    cores = Fixed(apart, {1: (0.5, 0, 0), 4: (0.2, 0.05, 0.05), 16: (0.2, 0.14, 0.06)}).verdict("GPipe", ms, ys)
    assert cores.rise_told is False and cores.why_not == "mostly core waits" and ", then rises" not in cores.words
    spread = {1: (0.49, 0.51), 4: (0.25, 0.42), 16: (0.35, 0.45)}  # M = 16's steps overlap M = 4's
    within = Fixed(spread, {1: (0.5, 0, 0), 4: (0.2, 0.05, 0.05), 16: (0.2, 0.06, 0.14)}).verdict("GPipe", ms, ys)
    assert within.rise_told is False and within.why_not == "within the steps' spread"
    flat = Fixed(apart, {}).verdict("GPipe", ms, [0.5, 0.3, 0.302])  # no rise beyond BUBBLE_LEVEL: no verdict on one
    assert flat.rise_told is None and flat.parts == {} and flat.rise_ms is None and flat.parts_rows() == []


def test_time_actions_still_imports_from_pipeline_with_a_warning():
    import labkit.techniques.pipeline
    with pytest.warns(DeprecationWarning, match="labkit.techniques.pipeline.time_actions moved to labkit.dist.time_actions"):
        assert labkit.techniques.pipeline.time_actions is time_actions
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        labkit.techniques.pipeline.nothing



def test_a_measured_runs_names_still_import_from_pipeline_with_a_warning():
    import labkit.techniques.pipeline
    import labkit.pipelinerun
    for name in ("PipelineTimings", "describe_bubble", "measured_bubble", "BUBBLE_LEVEL", "seconds_in"):
        with pytest.warns(DeprecationWarning, match=f"labkit.techniques.pipeline.{name} moved to labkit.pipelinerun.{name}"):
            assert getattr(labkit.techniques.pipeline, name) is getattr(labkit.pipelinerun, name)
    with pytest.warns(DeprecationWarning):
        from labkit.techniques.pipeline import PipelineTimings  # a from-import of a moved name: the same
    assert PipelineTimings is labkit.pipelinerun.PipelineTimings


def test_chapter_06bs_figure_and_shapes_come_from_the_timings():
    """bubble_shapes says each schedule's trend in words (a rise only as its verdict says) and draw_bubbles draws
    both schedules' measured bubbles (bars: their steps' range) and replays beside the formula, apart on M."""
    from labkit.pipelinerun import bubble_shapes, draw_bubbles

    class Timed:  # two timed steps per point, their ranges around the medians
        ranks, steps = [0, 1], 2

        def bubble_range(self, schedule, m):
            return measured[schedule][m] - 0.01, measured[schedule][m] + 0.01
    points = {"GPipe": [1, 2, 4], "1F1B": [2, 4]}
    measured = {"GPipe": {1: 0.5, 2: 0.35, 4: 0.25}, "1F1B": {2: 0.33, 4: 0.2}}
    replayed = {"GPipe": {1: 0.5, 2: 0.33, 4: 0.2}, "1F1B": {2: 0.33, 4: 0.2}}
    verdicts = {name: BubbleVerdict("", None, None, {}, None) for name in points}
    shapes = bubble_shapes(Timed(), points, measured, verdicts, 4)
    assert set(shapes) == {"GPipe", "1F1B"} and all("falls" in words for words in shapes.values())
    theory = {m: bubble_theory(2, m) for m in (1, 2, 4)}
    fig = draw_bubbles(Timed(), points, [1, 2, 4], theory, measured, replayed, shapes, {"GPipe": "k", "1F1B": "b"})
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert labels[0] == "formula (K-1)/(M+K-1)" and "GPipe measured (bar: its steps' range)" in labels
    xs = {line.get_label(): list(line.get_xdata()) for line in ax.lines}
    assert xs["GPipe replayed (compute only)"] == pytest.approx([0.94, 1.88, 3.76])  # drawn a little apart on M
    assert "K = 2, M = 4: formula 0.200" in ax.get_title()
