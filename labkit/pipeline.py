"""Pipeline schedules as timelines: the ideal one (GPipe's formula) and the measured one, and their bubbles.

Reference for notebook 06. K stages, M micro-batches; a stage's forward of one micro-batch takes
t_f, its backward t_b (about 2·t_f for matmuls).

    ideal_schedule("1F1B", K, M)           # {stage: [(label, start, end), ...]} with every stage alike
    bubble_theory(K, M)                    # (K - 1) / (M + K - 1), GPipe's bubble fraction
    time_actions(stage)                    # inside a rank: every forward/backward of a PipelineStage
                                           # becomes a labkit.dist span "F3", "B3" (or "F3/s2", naming
                                           # the stage, when a rank holds several)
    actions_within(spans, "step GPipe M=4")   # the actions inside one labelled span (one timed step)
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


def bubble_theory(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Return the idle fraction of a pipeline with equal stages: (K - 1) / (V·M + K - 1)."""
    check_int("stages", stages, 1)
    check_int("microbatches", microbatches, 1)
    check_int("virtual_stages", virtual_stages, 1)
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


def stage_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[str]:
    """Return the actions one stage runs, in order: "F0", "F1", ..., "B0", ... (GPipe) or interleaved (1F1B).

    1F1B (PipeDream-Flush): stage s first runs K - s forwards (fewer if M is smaller), then
    alternates one backward and one forward, then runs the remaining backwards. It holds at most
    K - s micro-batches of activations instead of GPipe's M.
    """
    check_choice("schedule", schedule, SCHEDULES)
    if schedule == "GPipe":
        return [f"F{i}" for i in range(microbatches)] + [f"B{i}" for i in range(microbatches)]
    warmup = min(stages - stage, microbatches)
    order = [f"F{i}" for i in range(warmup)]
    f, b = warmup, 0
    while b < microbatches:
        order.append(f"B{b}")
        b += 1
        if f < microbatches:
            order.append(f"F{f}")
            f += 1
    return order


def ideal_schedule(schedule: str, stages: int, microbatches: int, t_f=1.0,
                   t_b=2.0) -> dict[int, list[tuple[str, float, float]]]:
    """Simulate a pipeline with free communication; return each stage's (label, start, end) actions.

    t_f, t_b: a forward's and a backward's time, the same on every stage (a number) or one per
    stage (a sequence: measured stage times, imbalance included). An action starts when its stage
    is free and its input is ready: F(s, i) after F(s-1, i); B(s, i) after B(s+1, i), or after
    F(K-1, i) on the last stage.
    """
    check_int("stages", stages, 1)
    check_int("microbatches", microbatches, 1)
    t_f = [float(t_f)] * stages if isinstance(t_f, (int, float)) else [float(t) for t in t_f]
    t_b = [float(t_b)] * stages if isinstance(t_b, (int, float)) else [float(t) for t in t_b]
    if len(t_f) != stages or len(t_b) != stages:
        raise ValueError(f"t_f and t_b need one time per stage ({stages}), got {len(t_f)} and {len(t_b)}")
    orders = {s: stage_order(schedule, s, stages, microbatches) for s in range(stages)}
    done: dict[tuple[int, str], float] = {}
    out: dict[int, list] = {s: [] for s in range(stages)}
    free = dict.fromkeys(range(stages), 0.0)
    pos = dict.fromkeys(range(stages), 0)
    while any(pos[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] == len(orders[s]):
                continue
            label = orders[s][pos[s]]
            kind, i = label[0], int(label[1:])
            dep = (s - 1, f"F{i}") if kind == "F" else ((s + 1, f"B{i}") if s < stages - 1 else (s, f"F{i}"))
            if (kind == "F" and s == 0) or dep in done:
                start = max(free[s], 0.0 if (kind == "F" and s == 0) else done[dep])
                end = start + (t_f[s] if kind == "F" else t_b[s])
                out[s].append((label, start, end))
                done[(s, label)] = end
                free[s] = end
                pos[s] += 1
                progressed = True
        assert progressed, "the schedule deadlocked"  # cannot happen for GPipe and 1F1B
    return out


def time_actions(stage, name_stage: bool = False) -> None:
    """Make every forward and backward of a torch.distributed.pipelining stage a labkit.dist span.

    The schedules call `stage.forward_one_chunk(...)` and `stage.backward_one_chunk(...)` on the
    stage object, so wrapping those two methods (and the zero-bubble schedules' weight-only
    backward) times compute alone: waiting for a neighbour's send is left out.
    """
    from labkit.dist import span

    suffix = f"/s{stage.stage_index}" if name_stage else ""

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


def actions_within(spans: list, window: str) -> list[tuple[str, float, float]]:
    """Return the pipeline actions ("F…", "B…", "W…") of a rank's spans inside the span labelled `window`."""
    frames = [(a, b) for label, a, b in spans if label == window]
    if len(frames) != 1:
        raise ValueError(f"expected one span labelled {window!r}, found {len(frames)}")
    lo, hi = frames[0]
    return [(label, float(a), float(b)) for label, a, b in spans
            if label[:1] in ACTION_KINDS and label != window and lo <= a and b <= hi]


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
