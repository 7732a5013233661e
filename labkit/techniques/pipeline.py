"""Pipeline schedules: a model cut into one piece per rank, the ideal GPipe and 1F1B timelines, the order torch runs,
a measured step replayed with free communication, and the bubble in theory (a measured run read back:
labkit.pipelinerun).

Chapters 06 and 06b: a tested reference (labkit.techniques).
"""

from __future__ import annotations

import torch.nn as nn

from labkit.models import GPT
from labkit.stages import (ACTION_KINDS, LOSS_KIND, EmbedStage, GPTHeadStage, MLPHeadStage,  # noqa: F401
                           split_stages, stage_name)
#    (a model's stages: labkit.stages; these names stay importable from here)
from labkit.validate import ParameterError, check_choice, check_int

SCHEDULES = ("GPipe", "1F1B")


def partition(model: nn.Module, parts: int) -> list[nn.Sequential]:
    """Return the model's stages in `parts` contiguous pieces, one per rank, blocks shared out evenly (larger first).

    A GPT's first piece starts with the embedding, its last ends with the head (logits, no loss); an MLP's
    last piece ends with its classifier head. Pieces share the model's parameters.
    """
    stages = split_stages(model)
    body = stages[1:-1] if isinstance(model, GPT) else stages[:-1]
    check_int("parts", parts, 1)
    if parts > len(body):
        unit = "blocks" if isinstance(model, GPT) else "layers"
        raise ParameterError(f"parts ({parts}) must not exceed the model's {len(body)} {unit}: each piece needs at "
                             f"least one (more ranks than {unit} would leave a rank with nothing to hold)")
    q, r = divmod(len(body), parts)
    pieces, start = [], 0
    for i, size in enumerate([q + 1] * r + [q] * (parts - r)):
        piece = list(body[start:start + size])
        start += size
        if i == 0 and isinstance(model, GPT):
            piece.insert(0, stages[0])
        if i == parts - 1:
            piece.append(stages[-1] if isinstance(model, GPT) else stages[-1].head)
        pieces.append(nn.Sequential(*piece))
    return pieces


def bubble_theory(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Return the idle fraction of a pipeline with equal stages: (K - 1) / (V·M + K - 1)."""
    check_int("stages", stages, 1)
    check_int("micro_batches", micro_batches, 1)
    check_int("virtual_stages", virtual_stages, 1)
    return (stages - 1) / (virtual_stages * micro_batches + stages - 1)


def stage_order(schedule: str, stage: int, stages: int, micro_batches: int) -> list[str]:
    """Return the actions one stage runs in order: all forwards, then all backwards (GPipe), or 1F1B's interleaving."""
    check_choice("schedule", schedule, SCHEDULES)
    if schedule == "GPipe":
        return [f"F{i}" for i in range(micro_batches)] + [f"B{i}" for i in range(micro_batches)]
    warmup = min(stages - stage, micro_batches)  # forwards before the first backward
    order = [f"F{i}" for i in range(warmup)]
    for b in range(micro_batches):
        order += [f"B{b}"] + ([f"F{warmup + b}"] if warmup + b < micro_batches else [])
    return order


def _stage_of(label: str, rank: int) -> int:
    """Return the stage an action label names ("F3/s2": stage 2), or the rank's own stage."""
    return int(label.split("/s")[1]) if "/s" in label else rank


def _simulate(orders: dict[int, list[tuple[str, int, float]]]) -> dict[int, list]:
    """Run each rank's (label, stage, seconds) actions once its rank is free and its input ready; return the times."""
    stages = 1 + max((s for acts in orders.values() for _, s, _ in acts), default=-1)
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

    t_f, t_b: a forward's and a backward's seconds, one number for every stage or one per stage.
    """
    check_int("stages", stages, 1)
    check_int("micro_batches", micro_batches, 1)
    t_f, t_b = ([float(t)] * stages if isinstance(t, (int, float)) else [float(x) for x in t] for t in (t_f, t_b))
    if len(t_f) != stages or len(t_b) != stages:
        raise ValueError(f"t_f and t_b need one time per stage ({stages}), got {len(t_f)} and {len(t_b)}")
    orders = {s: [(label, s, t_f[s] if label[0] == "F" else t_b[s])
                  for label in stage_order(schedule, s, stages, micro_batches)] for s in range(stages)}
    return _simulate(orders)


def simulate_order(orders: dict[int, list[str]], t_f=1.0, t_b=2.0) -> dict[int, list[tuple[str, float, float]]]:
    """Simulate per-rank action orders ("F0", "B3", or "F0/s2" naming the stage) with free communication.

    Raises ValueError for an order that breaks the pipeline's dependencies.
    """
    rows = {r: [(label, _stage_of(label, r), t_f if label[0] == "F" else t_b) for label in labels]
            for r, labels in orders.items()}
    return _simulate(rows)


def torch_schedule_order(schedule: str, ranks: int, micro_batches: int,
                         stages_per_rank: int = 1) -> dict[int, list[str]]:
    """Return torch.distributed.pipelining's own action order for a schedule, per rank, as labkit labels."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    check_int("ranks", ranks, 1)
    check_int("micro_batches", micro_batches, 1)
    ops = get_schedule_ops(schedule, ranks, micro_batches, num_stages_per_rank=stages_per_rank)
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    named = stages_per_rank > 1  # labels name the stage when a rank holds several
    return {r: [f"{kinds[a.computation_type.name]}{a.microbatch_index}" + (f"/s{a.stage_index}" if named else "")
                for a in actions if a is not None and a.computation_type.name in kinds]  # no idle slot, no REDUCE_GRAD
            for r, actions in enumerate(ops)}


def replay(actions_by_rank: dict[int, list]) -> dict[int, list[tuple[str, float, float]]]:
    """Replay measured actions with free communication (same order and durations, no waiting); return the timeline."""
    by_start = {r: sorted(acts, key=lambda act: act[1]) for r, acts in actions_by_rank.items()}
    return _simulate({r: [(label, _stage_of(label, r), float(b) - float(a)) for label, a, b in acts]
                      for r, acts in by_start.items()})


def forwards_from_zero(order: dict[int, list[str]]) -> dict[int, list[str]]:
    """Return per-rank labels with each rank's forwards renumbered from 0 (torch's 1F1B numbers its last rank's
    from 1); labels naming a stage ("F0/s2") as they are (chapter 06b)."""
    out = {}
    for r, labels in order.items():
        first = min(int(x[1:].split("/")[0]) for x in labels if x[0] == "F")
        out[r] = [f"F{int(x[1:]) - first}" if x[0] == "F" and "/" not in x else x for x in labels]
    return out


_MOVED = {"time_actions": "labkit.dist.rank", **dict.fromkeys(
    ("actions_within", "measured_bubble", "fit_inverse_m", "HeldCounts", "micro_batches_held", "step_with_bubble_s",
     "PipelineTimings", "BubbleVerdict", "level_stretch", "describe_bubble", "bubble_shape", "step_from_first_forward",
     "seconds_in", "BUBBLE_LEVEL"), "labkit.pipelinerun")}
#   names that lived here: time_actions marks a rank's spans (labkit.dist); the rest read a measured run back


def __getattr__(name: str):
    """Return a name that moved out of this module (_MOVED), with a DeprecationWarning."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    import warnings
    public = "labkit.dist" if name == "time_actions" else _MOVED[name]
    warnings.warn(f"labkit.techniques.pipeline.{name} moved to {public}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
