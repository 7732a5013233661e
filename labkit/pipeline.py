"""Pipeline schedules as timelines: the ideal one (GPipe's formula) and the measured one, and their bubbles.

Reference for notebook 06. K stages, M micro-batches; a stage's forward of one micro-batch takes
t_f, its backward t_b (about 2·t_f for matmuls).

    ideal_schedule("1F1B", K, M)           # {stage: [(label, start, end), ...]} with every stage alike
    replay(actions_by_rank)                # measured actions again, communication free and no waiting
    bubble_theory(K, M)                    # (K - 1) / (M + K - 1), GPipe's bubble fraction
    time_actions(stage, schedule=sched)    # inside a rank: every forward/backward of a PipelineStage
                                           # becomes a labkit.dist span "F3", "B3" (or "F3/s2", naming
                                           # the stage, when a rank holds several); the last stage's
                                           # loss is added to its forward
    torch_schedule_order("1F1B", K, M)     # torch's own action order (its schedule IR), to compare
    simulate_order(orders)                 # the step an order implies with free communication
    actions_within(spans, "GPipe M=4 #0")  # the actions inside one labelled span (one timed step)
    measured_bubble(actions_by_rank)       # the same fraction, from measured actions

**Which bubble.** The fraction plotted here is idle rank-time over total rank-time within the
step: 1 - (busy time summed over ranks) / (K × the step's makespan, first action to last). For
equal stages this is exactly (K - 1)/(M + K - 1) for GPipe and 1F1B alike (Huang et al. 2019;
Narayanan et al. 2021). The Ultra-Scale Playbook quotes the bubble as a ratio to the ideal time,
r = (K - 1)/M; the fraction is r / (1 + r). Interleaving V stages per rank divides the bubble by
V: (K - 1)/(V·M + K - 1).
"""

from __future__ import annotations

import functools

from labkit.validate import check_choice, check_int

SCHEDULES = ("GPipe", "1F1B")
ACTION_KINDS = ("F", "B", "W")  # forward, backward (input and weights), weight-only backward (zero bubble)
LOSS_KIND = "L"  # the last stage's loss of one micro-batch: part of that micro-batch's forward


def bubble_theory(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Return the idle fraction of a pipeline with equal stages: (K - 1) / (V·M + K - 1)."""
    check_int("stages", stages, 1)
    check_int("micro_batches", micro_batches, 1)
    check_int("virtual_stages", virtual_stages, 1)
    return (stages - 1) / (virtual_stages * micro_batches + stages - 1)


def stage_order(schedule: str, stage: int, stages: int, micro_batches: int) -> list[str]:
    """Return the actions one stage runs, in order: "F0", "F1", ..., "B0", ... (GPipe) or interleaved (1F1B).

    1F1B (PipeDream-Flush): stage s first runs K - s forwards (fewer if M is smaller), then
    alternates one backward and one forward, then runs the remaining backwards. It holds at most
    K - s micro-batches of activations instead of GPipe's M.
    """
    check_choice("schedule", schedule, SCHEDULES)
    if schedule == "GPipe":
        return [f"F{i}" for i in range(micro_batches)] + [f"B{i}" for i in range(micro_batches)]
    warmup = min(stages - stage, micro_batches)
    order = [f"F{i}" for i in range(warmup)]
    f, b = warmup, 0
    while b < micro_batches:
        order.append(f"B{b}")
        b += 1
        if f < micro_batches:
            order.append(f"F{f}")
            f += 1
    return order


def _simulate(orders: dict[int, list[tuple[str, int, float]]], stages: int) -> dict[int, list]:
    """Run each rank's (label, stage, seconds) actions in order, each as soon as its rank is free and its input ready.

    F(s, i) needs F(s-1, i); B(s, i) needs B(s+1, i), or F(K-1, i) on the last stage. Communication
    is free. Returns {rank: [(label, start, end), ...]}.
    """
    done: dict[tuple[int, str], float] = {}
    out: dict[int, list] = {r: [] for r in orders}
    free = dict.fromkeys(orders, 0.0)
    pos = dict.fromkeys(orders, 0)
    while any(pos[r] < len(orders[r]) for r in orders):
        progressed = False
        for r in orders:
            if pos[r] == len(orders[r]):
                continue
            label, s, seconds = orders[r][pos[r]]
            kind, i = label[0], int(label[1:].split("/")[0])
            first = kind == "F" and s == 0
            dep = (s - 1, f"F{i}") if kind == "F" else ((s + 1, f"B{i}") if s < stages - 1 else (s, f"F{i}"))
            if first or dep in done:
                start = max(free[r], 0.0 if first else done[dep])
                out[r].append((label, start, start + seconds))
                done[(s, f"{kind}{i}")] = free[r] = start + seconds
                pos[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("the actions cannot run in the order given: each rank's order must respect the "
                             "pipeline's dependencies")
    return out


def ideal_schedule(schedule: str, stages: int, micro_batches: int, t_f=1.0,
                   t_b=2.0) -> dict[int, list[tuple[str, float, float]]]:
    """Simulate a pipeline with free communication; return each stage's (label, start, end) actions.

    t_f, t_b: a forward's and a backward's time, the same on every stage (a number) or one per
    stage (a sequence: measured stage times, imbalance included). An action starts when its stage
    is free and its input is ready: F(s, i) after F(s-1, i); B(s, i) after B(s+1, i), or after
    F(K-1, i) on the last stage.
    """
    check_int("stages", stages, 1)
    check_int("micro_batches", micro_batches, 1)
    t_f = [float(t_f)] * stages if isinstance(t_f, (int, float)) else [float(t) for t in t_f]
    t_b = [float(t_b)] * stages if isinstance(t_b, (int, float)) else [float(t) for t in t_b]
    if len(t_f) != stages or len(t_b) != stages:
        raise ValueError(f"t_f and t_b need one time per stage ({stages}), got {len(t_f)} and {len(t_b)}")
    orders = {s: [(label, s, t_f[s] if label[0] == "F" else t_b[s])
                  for label in stage_order(schedule, s, stages, micro_batches)] for s in range(stages)}
    return _simulate(orders, stages)


def simulate_order(orders: dict[int, list[str]], t_f=1.0, t_b=2.0) -> dict[int, list[tuple[str, float, float]]]:
    """Simulate given per-rank action orders ("F0", "B3", or "F0/s2" naming the stage) with free communication.

    t_f, t_b: a forward's and a backward's time on every stage. Each action starts when its rank is
    free and its input is ready (see ideal_schedule); an order that breaks the dependencies raises.
    """
    stages = 1 + max(int(label.split("/s")[1]) if "/s" in label else r for r, labels in orders.items() for label in labels)
    rows = {r: [(label, int(label.split("/s")[1]) if "/s" in label else r, t_f if label[0] == "F" else t_b)
                for label in labels] for r, labels in orders.items()}
    return _simulate(rows, stages)


def torch_schedule_order(schedule: str, ranks: int, micro_batches: int,
                         stages_per_rank: int = 1) -> dict[int, list[str]]:
    """Return torch.distributed.pipelining's own action order for a schedule, per rank, as labkit labels.

    From `torch.distributed.pipelining._schedule_visualizer.get_schedule_ops` (private; its use
    here is pinned by tests/test_pipeline.py): the schedule's IR (`pipeline_order`), idle slots and
    the gradient reduction left out. Labels name the stage ("F0/s2") when a rank holds several.
    """
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    check_int("ranks", ranks, 1)
    check_int("micro_batches", micro_batches, 1)
    ops = get_schedule_ops(schedule, ranks, micro_batches, num_stages_per_rank=stages_per_rank)
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    out = {}
    for r, actions in enumerate(ops):
        labels = []
        for a in actions:
            kind = kinds.get(a.computation_type.name) if a is not None else None
            if kind is None:  # an idle slot, or bookkeeping (REDUCE_GRAD, ...)
                continue
            suffix = f"/s{a.stage_index}" if stages_per_rank > 1 else ""
            labels.append(f"{kind}{a.microbatch_index}{suffix}")
        out[r] = labels
    return out


def replay(actions_by_rank: dict[int, list]) -> dict[int, list[tuple[str, float, float]]]:
    """Replay measured actions with free communication: same order on each rank, same durations, no waiting.

    Each action starts as soon as its rank is free and its input is ready (see ideal_schedule);
    what is left is the step the measured compute alone allows. A rank holding one stage is that
    stage; labels "F3/s2" name the stage when a rank holds several. Waiting can only add to a step:
    the measured makespan is at least the replay's (up to the ranks' clock offsets).
    """
    stages = 0
    orders: dict[int, list] = {}
    for r, acts in actions_by_rank.items():
        rows = []
        for label, a, b in sorted(acts, key=lambda act: act[1]):
            s = int(label.split("/s")[1]) if "/s" in label else r
            stages = max(stages, s + 1)
            rows.append((label, s, float(b) - float(a)))
        orders[r] = rows
    return _simulate(orders, stages)


def time_actions(stage, name_stage: bool = False, schedule=None) -> None:
    """Make every forward and backward of a torch.distributed.pipelining stage a labkit.dist span.

    The schedules call `stage.forward_one_chunk(...)` and `stage.backward_one_chunk(...)` on the
    stage object, so wrapping those two methods (and the zero-bubble schedules' weight-only
    backward) times compute alone: waiting for a neighbour's send is left out. Given the
    `schedule`, the last stage's loss of each micro-batch (the schedule's `_maybe_compute_loss`,
    called right after that micro-batch's forward) is timed too, as a span "L3" that
    `actions_within` adds to the forward "F3": compute, not bubble.
    """
    from labkit.dist import span

    suffix = f"/s{stage.stage_index}" if name_stage else ""
    if schedule is not None and not getattr(schedule, "_labkit_timed_loss", False):
        compute_loss = schedule._maybe_compute_loss  # private: pinned by tests/test_pipeline.py

        @functools.wraps(compute_loss)
        def timed_loss(st, output, target_mbs, mb_index, *args, **kwargs):
            if not st.is_last or getattr(schedule, "_loss_fn", None) is None:
                return compute_loss(st, output, target_mbs, mb_index, *args, **kwargs)
            with span(f"{LOSS_KIND}{mb_index}" + (f"/s{st.stage_index}" if name_stage else "")):
                return compute_loss(st, output, target_mbs, mb_index, *args, **kwargs)
        schedule._maybe_compute_loss = timed_loss
        schedule._labkit_timed_loss = True

    def wrap(method: str, kind: str):
        fn = getattr(stage, method)

        @functools.wraps(fn)
        def timed(chunk_id, *args, **kwargs):
            with span(f"{kind}{chunk_id}{suffix}"):
                return fn(chunk_id, *args, **kwargs)
        setattr(stage, method, timed)

    wrap("forward_one_chunk", "F")
    wrap("backward_one_chunk", "B")
    wrap("backward_weight_one_chunk", "W")


def actions_within(spans: list, window: str, core_waits: list | None = None) -> list[tuple[str, float, float]]:
    """Return the pipeline actions ("F…", "B…", "W…") of a rank's spans inside the span labelled `window`.

    core_waits: the rank's RankResult.core_waits (one per span). Given, each action ends earlier by
    the time its rank waited for a CPU core inside it: the action's own work, as on an idle machine.
    """
    if core_waits is not None and len(core_waits) != len(spans):
        raise ValueError(f"core_waits needs one entry per span ({len(spans)}), got {len(core_waits)}")
    waits = core_waits if core_waits is not None else [0.0] * len(spans)
    frames = [(a, b) for label, a, b in spans if label == window]
    if len(frames) != 1:
        raise ValueError(f"expected one span labelled {window!r}, found {len(frames)}")
    lo, hi = frames[0]
    inside = [(label, float(a), float(b), float(w)) for (label, a, b), w in zip(spans, waits)
              if label[:1] in (*ACTION_KINDS, LOSS_KIND) and label != window and lo <= a and b <= hi]
    out, forward_at = [], {}
    for label, a, b, w in inside:
        if label[0] == LOSS_KIND and ("F" + label[1:]) in forward_at:  # the loss ends its micro-batch's forward
            i = forward_at["F" + label[1:]]
            f_label, f_a, f_b, f_w = out[i]
            out[i] = (f_label, f_a, b, f_w + w)
            continue
        if label[0] == "F":
            forward_at[label] = len(out)
        out.append((label, a, b, w))
    return [(label, a, b - w) for label, a, b, w in out]


def measured_bubble(actions_by_rank: dict[int, list]) -> dict:
    """Return the makespan, each rank's busy seconds and the bubble fraction of measured actions."""
    actions = {r: [(label, float(a), float(b)) for label, a, b in acts] for r, acts in actions_by_rank.items()}
    if not actions or not all(actions.values()):
        raise ValueError("every rank needs at least one F/B/W action")
    start = min(a for acts in actions.values() for _, a, _ in acts)
    end = max(b for acts in actions.values() for _, _, b in acts)
    busy = {r: sum(b - a for _, a, b in acts) for r, acts in actions.items()}
    makespan = end - start
    return {"makespan_s": makespan, "busy_s": busy,
            "bubble_fraction": 1.0 - sum(busy.values()) / (len(actions) * makespan)}
