"""ZeRO on paper (Rajbhandari et al. 2020): model-state bytes per parameter and rank, traffic, DeepSpeed configs.

Chapter 07: a tested reference (labkit.techniques).
"""

from __future__ import annotations

import math

from labkit.meter import format_bytes
from labkit.validate import check_budget, check_choice, check_int

STAGES = (0, 1, 2, 3)
MIXED_ADAM = {"param_bytes": 2, "grad_bytes": 2, "state_bytes": 12}  # fp16 weights and gradients; fp32 master, m, v


def model_state_bytes_per_param(stage: int, world_size: int, param_bytes: int = 4, grad_bytes: int = 4,
                                state_bytes: int = 8) -> dict[str, float]:
    """Return the paper's model-state bytes per parameter on one rank, by category, for a ZeRO stage."""
    check_choice("stage", stage, STAGES)
    n = check_int("world_size", world_size, 1)
    return {"parameters": param_bytes / (n if stage >= 3 else 1),
            "gradients": grad_bytes / (n if stage >= 2 else 1),
            "optimizer_state": state_bytes / (n if stage >= 1 else 1)}


def comm_elements_per_param(stage: int) -> int:
    """Return the paper's communication per rank and step in units of Ψ: 2 for DDP and stages 1-2, 3 for stage 3."""
    check_choice("stage", stage, STAGES)
    return 3 if stage == 3 else 2


def ring_factor(world_size: int) -> float:
    """Return (N - 1)/N: the share of a collective's volume each rank sends on a ring of N ranks."""
    n = check_int("world_size", world_size, 1)
    return (n - 1) / n


STEP_TIE = 0.01  # projected steps within 1% of each other tie: the roofline and the launch count are estimates


def _tie_key(p: str, peak_bytes: dict, step_s: dict | None) -> tuple[float, float]:
    return peak_bytes[p], (step_s or {}).get(p, math.inf)


def cheapest_fit(peak_bytes: dict[str, float], sent_bytes: dict[str, float], budget_bytes: float,
                 costs: dict[str, str], step_s: dict[str, float] | None = None) -> tuple[list[str], str | None]:
    """Return the points that fit the budget, and the fitting one that sends least (None when none fits) (chapter 07).

    A point in `costs` (point -> what else it pays, e.g. "precision") is chosen only when every fitting point pays.
    Points that send as much are told apart by their peak, then by `step_s` (point -> projected step seconds, e.g.
    with the host's launches; a point without one comes last); the first listed of exact equals is chosen.
    """
    if check_budget("budget_bytes", budget_bytes) is None:
        raise ValueError("budget_bytes must be a positive number of bytes, got None")
    missing = set(peak_bytes) - set(sent_bytes)
    if missing:
        raise ValueError(f"sent_bytes has no figure for {sorted(missing)}")
    fits = [p for p, b in peak_bytes.items() if b <= budget_bytes]
    free = [p for p in fits if p not in costs] or fits
    return fits, min(free, key=lambda p: (sent_bytes[p], *_tie_key(p, peak_bytes, step_s)), default=None)


def describe_fit(peak_bytes: dict[str, float], sent_bytes: dict[str, float], budget_bytes: float,
                 costs: dict[str, str], step_s: dict[str, float] | None = None,
                 step_label: str = "projected step") -> str:
    """Return one sentence from measured figures: which points fit the budget, and which of them to use (cheapest_fit).

    Points that send as much as the chosen one are named with what tells them apart: a higher peak, a step longer
    by more than STEP_TIE (`step_label` names `step_s`), or nothing: a tie.
    """
    fits, best = cheapest_fit(peak_bytes, sent_bytes, budget_bytes, costs, step_s)
    if best is None:
        low = min(peak_bytes, key=peak_bytes.get)
        return (f"no point fits {format_bytes(budget_bytes)}: the lowest peak, {low}'s "
                f"{format_bytes(peak_bytes[low])}, is {format_bytes(peak_bytes[low] - budget_bytes)} over")

    def named(p):
        return f"{p} (pays in {costs[p]})" if p in costs else p

    among = ("each paying something besides bytes; " if best in costs else
             "" if len(fits) == 1 else "of those that pay nothing besides bytes, ")
    candidates = [p for p in fits if p not in costs] or fits
    tied = [p for p in candidates if p != best and sent_bytes[p] == sent_bytes[best]]
    figures = f"{format_bytes(sent_bytes[best])} per step, peak {format_bytes(peak_bytes[best])}"
    if not tied:
        fewest = f"sends the fewest ({figures})"
    else:
        step = (step_s or {}).get(best, math.inf)
        higher = [p for p in tied if peak_bytes[p] > peak_bytes[best]]
        slower = [p for p in tied if p not in higher and (step_s or {}).get(p, math.inf) > step * (1 + STEP_TIE)]
        even = [p for p in tied if p not in higher and p not in slower]

        def whose(group):
            return "theirs" if len(group) == len(tied) > 1 else f"{', '.join(group)}'s"

        apart = ([f"a lower peak than {whose(higher)}"] if higher else []) + (
            [f"a {step_label} ×{step / min(step_s[p] for p in slower):.2f} of {whose(slower)}"] if slower else [])
        fewest = (f"sends the fewest ({figures}), as {', '.join(map(named, tied))} do{'es' if len(tied) == 1 else ''}"
                  + (f"; it has {' and '.join(apart)}" if apart else "")
                  + (f"; a tie with {', '.join(even)} in peak" + (" and step" if step_s else "") + " too: the first "
                     "listed" if even else ""))
    others = [named(p) for p in fits if p != best and p not in tied]  # the tied ones are named already
    return (f"{len(fits)} of {len(peak_bytes)} points fit {format_bytes(budget_bytes)}; {among}{named(best)} {fewest}"
            + (f"; also fit{'s' if len(others) == 1 else ''}: {', '.join(others)}" if others else ""))


def deepspeed_config(stage: int, micro_batch: int, world_size: int = 1, precision: str = "fp32",
                     offload_optimizer: bool = False, offload_params: bool = False,
                     activation_checkpointing: bool = False, param_persistence_threshold: int | None = None) -> dict:
    """Return the DeepSpeed config (a dict to dump as JSON) for a setting of notebook 07 (lr 1e-3, no accumulation).

    `param_persistence_threshold` (stage 3): DeepSpeed keeps every parameter tensor of at most that many elements
    whole on every rank (its default: 1e5); None leaves DeepSpeed's default, 0 shards every tensor.
    """
    check_choice("stage", stage, STAGES)
    check_int("micro_batch", micro_batch, 1)
    check_int("world_size", world_size, 1)
    check_choice("precision", precision, ("fp32", "bf16", "fp16"))
    if offload_params and stage != 3:
        raise ValueError("offload_params needs stage 3: only stage 3 shards (and so can offload) the parameters")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs a ZeRO stage >= 1")
    if param_persistence_threshold is not None:
        if stage != 3:
            raise ValueError("param_persistence_threshold needs stage 3: only stage 3 shards the parameters")
        check_int("param_persistence_threshold", param_persistence_threshold, 0)
    zero: dict = {"stage": stage}
    if param_persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = param_persistence_threshold
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_batch_size": micro_batch * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
    }
    if activation_checkpointing:
        config["activation_checkpointing"] = {"partition_activations": False,  # splits checkpoints across
                                              "cpu_checkpointing": False,  # *model*-parallel ranks only
                                              "contiguous_memory_optimization": False,
                                              "synchronize_checkpoint_boundary": False, "profile": False}
    return config
