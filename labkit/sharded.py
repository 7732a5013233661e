"""Sharded data parallelism's instruments (chapter 07): what a rank's meter and counter cannot see by themselves.

The technique (DDP, ZeroRedundancyOptimizer, `fully_shard`) stays in chapter 07's rank script; these functions
measure it. Inside a rank: `watch_ddp_buckets`, `label_gathered_parameters`, `full_tensor`, `grad_diffs` and
`measured_step` (with `activations_by_phase`). In the notebook, reading the ranks' results: `per_param`, `held_to_formula`, `formula_errors`,
`total_errors`, `formula_failures`, `print_state_table`, `sent_by_collective`.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from labkit.meter import MemoryMeter, OutOfMemory, _storage_ids, active_meter
from labkit.work import WorkCounter, ring_factor

STATE_KINDS = ("parameters", "gradients", "optimizer_state")  # ZeRO's model states
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")  # the ones chapter 07's points issue


def watch_ddp_buckets(ddp) -> dict[int, torch.Tensor]:
    """Issue DDP's all-reduce from Python, where a WorkCounter sees it; return {bucket: its flat buffer} (chapter 07).

    DDP all-reduces from C++, out of any Python mode's sight; `allreduce_hook` is the same all-reduce, called from
    a comm hook. The returned dict fills in during backward with DDP's flat bucket tensors, for a meter to track.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buckets: dict[int, torch.Tensor] = {}

    def allreduce(state, bucket):
        buckets[bucket.index()] = bucket.buffer()
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, allreduce)
    return buckets


def _label_parameters(module, args) -> None:
    meter = active_meter()
    if meter is not None:
        for p in module.parameters():
            meter.label(p, "parameters")


def label_gathered_parameters(modules) -> None:
    """Make an open meter count FSDP2's gathered copies as parameters, not activations (chapter 07).

    A forward pre-hook registered after `fully_shard`'s own runs after its all-gather; the label stays with the
    storage, which FSDP2 frees and grows back with `resize_`, so the backward's second all-gather counts too.
    """
    for module in modules:
        module.register_forward_pre_hook(_label_parameters)


def _label_accumulated(module, args) -> None:
    meter = active_meter()
    if meter is None:
        return
    for m in module.modules():
        group = m._get_fsdp_state()._fsdp_param_group if hasattr(m, "_get_fsdp_state") else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            unsharded = getattr(fsdp_param, "_unsharded_param", None)  # (fp32: the gradient stays on it)
            for t in (fsdp_param.unsharded_accumulated_grad, None if unsharded is None else unsharded.grad):
                if t is not None:
                    meter.label(t, "gradients")


def label_accumulated_gradients(model: torch.nn.Module) -> None:
    """Make an open meter count the unsharded gradients FSDP2 accumulates between micro-batches without a
    reduce-scatter (`set_requires_gradient_sync(False)`) as gradients, not activations (chapter 09).

    A forward pre-hook on the root labels them at each micro-batch's start, while they are held.
    """
    model.register_forward_pre_hook(_label_accumulated)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Return a whole tensor from a DTensor shard (an all-gather on its mesh's device), or `t` itself (chapter 07)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    local, mesh = t.to_local(), t.device_mesh
    if local.device.type != mesh.device_type:  # CPU offload: the shard lives on the host, NCCL gathers on the GPU
        t = DTensor.from_local(local.to(mesh.device_type), mesh, t.placements, shape=t.shape, stride=t.stride())
    return t.full_tensor()


def grad_diffs(model: torch.nn.Module, ref_grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Return the largest per-tensor and the overall relative difference of gradients from `ref_grads` (chapter 07).

    Sharded gradients are gathered whole first; DDP's "module." prefix is dropped from the names.
    """
    from labkit.compare import max_rel_diff, rel_diff

    grads = {n.removeprefix("module."): full_tensor(p.grad) for n, p in model.named_parameters()}
    return {"max_rel_grad_diff": max_rel_diff(grads, ref_grads),
            "rel_grad_diff": rel_diff(torch.cat([g.flatten() for g in grads.values()]),
                                      torch.cat([ref_grads[n].flatten() for n in grads]))}


@dataclasses.dataclass
class StepProbe:
    """What the body of `measured_step` can ask for: the model states at rest, read when it calls `at_rest()`."""

    meter: MemoryMeter
    buckets: list = dataclasses.field(default_factory=list)  # DDP's flat buckets: handed to all-reduces, kept
    rest: dict[str, int] | None = None
    unsettled_bytes: int = 0  # of the collectives' buffers, those still held when settle's wait ran out

    def at_rest(self) -> None:
        """Read the live bytes by category now (right after the optimizer step: every state exists), once the
        collectives' buffers the step let go of are released (`MemoryMeter.settle`)."""
        self.unsettled_bytes = self.meter.settle(keep=self.buckets)
        self.rest = self.meter.current_split()


def activations_by_phase(meter: MemoryMeter, exclude=()) -> dict[str, int]:
    """Return the activation bytes live at the meter's peak by the phase each was allocated in (chapter 07).

    "forward": what the forward kept for backward; "backward": what backward had allocated by the peak (gradients
    of activations, buffers of its own). Needs the meter's timeline; the storages of `exclude` (DDP's buckets) are
    left out. Reads the meter's records of the storages live at the peak.
    """
    meter._classify()
    phase_at = {point.seq: point.phase for point in meter.timeline}
    skip = {id(meter._records.get(key)) for t in exclude for key in _storage_ids(t)}
    out: dict[str, int] = {}
    for r in meter._history:
        if meter._at_peak(r) and (r.category or "activations") == "activations" and id(r) not in skip:
            phase = phase_at.get(r.alloc_seq, "other")
            out[phase] = out.get(phase, 0) + r.nbytes
    return out


@contextlib.contextmanager
def measured_step(name: str, result: dict, model, optimizer, *inputs, buckets: dict | None = None,
                  budget_bytes: int | None = None):
    """Meter the step run in the body into `result` (chapter 07): states at rest, peak by category, sends, work.

    `result` gains fits, states (at rest: parameters, gradients, optimizer_state, other), unsettled_bytes (of
    "other", collectives' buffers still held when `MemoryMeter.settle` stopped waiting), peak (the same and
    activations), peak_phase, peak_activations_by_phase (`activations_by_phase`), comm_bytes and comm_calls (by
    collective), wire_bytes and work. DDP's `buckets` (from `watch_ddp_buckets`) are tracked from the start and counted as "other" (as gradients under
    gradient_as_bucket_view). A step the budget refuses leaves fits=False and the refused allocation instead of
    raising. The meter's summary goes back to the launcher under `name` (`labkit.dist.meter`).
    """
    from labkit.costs import work_record
    from labkit.dist.rank import meter as rank_meter, world_size

    buckets = list((buckets or {}).values())
    try:
        with rank_meter(name, budget_bytes=budget_bytes) as meter, WorkCounter() as counter:
            meter.keep_timeline = True  # when the peak comes: forward, backward or the optimizer step
            meter.track(model, optimizer, *inputs, *buckets)
            probe = StepProbe(meter, buckets)
            yield probe
    except OutOfMemory as refused:
        result.update(fits=False, refused={"requested_bytes": refused.requested_bytes,
                                           "in_use_bytes": refused.in_use_bytes, "budget_bytes": refused.budget_bytes})
        return
    if probe.rest is None:
        raise RuntimeError("measured_step: call probe.at_rest() in the step, right after the optimizer step")
    rest = dict(probe.rest)
    rest["other"] = rest.pop("activations")  # at rest: the batch, the last logits, DDP's buckets
    peak = meter.peak_split()
    bucket_bytes = 0 if getattr(model, "gradient_as_bucket_view", False) else meter.peak_bytes_of(*buckets)
    peak["activations"] -= bucket_bytes  # the meter counts untracked-category storage with the activations
    peak["other"] = bucket_bytes
    n = world_size()
    result.update(fits=True, states=rest, unsettled_bytes=probe.unsettled_bytes, peak=peak,
                  peak_phase=next(p.phase for p in meter.timeline if p.bytes == meter.peak_bytes),
                  peak_activations_by_phase=activations_by_phase(meter, buckets),
                  comm_bytes=dict(counter.bytes), comm_calls=dict(counter.calls), wire_bytes=counter.wire_bytes(n),
                  work=work_record(counter.work()))


def per_param(split: dict[str, float], psi: int) -> dict[str, float]:
    """Return a split of bytes by category in bytes per parameter (chapter 07)."""
    return {k: v / psi for k, v in split.items()}


def held_to_formula(point: str, stage: int) -> int:
    """Return the ZeRO stage a point's states at rest are held to: FSDP2 keeps parameters sharded (chapter 07)."""
    return 3 if point.startswith("FSDP2") else stage


def formula_errors(rank_values: list[dict], psi: int, n: int, stages: dict[str, int]) -> dict[str, dict[str, float]]:
    """Return {point: {category: worst relative error over the ranks}} of the states at rest (chapter 07).

    `rank_values`: each rank's {point: its result, with "states"}; `stages`: {point: ZeRO stage}; each point is held
    to `held_to_formula`'s stage, fp32 Adam.
    """
    from labkit.techniques.zero import model_state_bytes_per_param

    out = {}
    for point, stage in stages.items():
        want = model_state_bytes_per_param(held_to_formula(point, stage), n)
        out[point] = {k: max(abs(v[point]["states"][k] / psi - want[k]) / want[k] for v in rank_values)
                      for k in STATE_KINDS}
    return out


def total_errors(value: dict, psi: int, n: int, stages: dict[str, int]) -> dict[str, float]:
    """Return {point: relative error} of one rank's model-state total against its own stage's formula (chapter 07)."""
    from labkit.techniques.zero import model_state_bytes_per_param

    out = {}
    for point, stage in stages.items():
        want = sum(model_state_bytes_per_param(stage, n).values())
        out[point] = abs(sum(value[point]["states"][k] for k in STATE_KINDS) / psi - want) / want
    return out


def formula_failures(rank_values: list[dict], psi: int, n: int, stages: dict[str, int], block_bytes: int,
                     root_bytes: int, tolerance: float = 0.05) -> list[str]:
    """Return what breaks ZeRO's accounting on any rank, one phrase each (empty when it all holds) (chapter 07).

    Every model state within `tolerance` of its formula; FSDP2 no-reshard off the paper's stage 2 (its parameters
    stay sharded at rest); DDP's buckets 4 B/param; DDP's and ZeRO-1's activations equal; FSDP2's at most one
    block's and the root's fp32 parameters above DDP's.
    """
    failures = [f"{point}'s {k} is {err:.1%} off stage {held_to_formula(point, stages[point])}'s formula on some rank"
                for point, errs in formula_errors(rank_values, psi, n, stages).items()
                for k, err in errs.items() if err > tolerance]
    if "FSDP2 no-reshard" in stages and total_errors(rank_values[0], psi, n, stages)["FSDP2 no-reshard"] <= tolerance:
        failures.append("FSDP2 no-reshard matches the paper's stage 2: it should keep its parameters sharded at rest")
    for r, v in enumerate(rank_values):
        if v["DDP"]["peak"]["other"] != 4 * psi:
            failures.append(f"rank {r}: DDP's buckets hold {v['DDP']['peak']['other'] / psi:.2f} B/param, not 4")
        if v["DDP"]["peak"]["activations"] != v["ZeRO-1"]["peak"]["activations"]:
            failures.append(f"rank {r}: DDP and ZeRO-1 should hold the same activations")
        for point in ("FSDP2 no-reshard", "FSDP2 ZeRO-3"):
            extra = v[point]["peak"]["activations"] - v["DDP"]["peak"]["activations"]
            if not 0 <= extra <= block_bytes + root_bytes:
                failures.append(f"rank {r}: {point}'s activations differ from DDP's by {extra:,} B")
    return failures


def print_state_table(value: dict, psi: int, n: int, stages: dict[str, int]) -> None:
    """Print one rank's bytes per parameter by category: at rest beside ZeRO's formula, and at the peak (chapter 07)."""
    from labkit.techniques.zero import model_state_bytes_per_param

    print(f"N = {n} ranks, rank 0, bytes per parameter")
    print(f"{'':17s}{'at rest: measured (formula held to)':^42s} | {'at the peak':^34s}")
    print(f"{'':16s} {'params':>11s} {'grads':>11s} {'optimizer':>11s} {'other':>6s} |"
          f" {'params':>6s} {'grads':>6s} {'optim':>6s} {'activ':>6s} {'other':>6s}")
    for point, stage in stages.items():
        rest, peak = per_param(value[point]["states"], psi), per_param(value[point]["peak"], psi)
        want = model_state_bytes_per_param(held_to_formula(point, stage), n)
        print(f"{point:16s} " + " ".join(f"{rest[k]:5.2f} ({want[k]:4.2f})" for k in STATE_KINDS)
              + f" {rest['other']:6.2f} | "
              + " ".join(f"{peak[k]:6.2f}" for k in (*STATE_KINDS, "activations", "other")))


def sent_by_collective(comm_bytes: dict[str, int], comm_calls: dict[str, int], n: int) -> dict[str, dict]:
    """Return {collective: calls, input_bytes, sent_bytes} for one rank on a ring of n ranks (chapter 07)."""
    return {k: {"calls": comm_calls.get(k, 0), "input_bytes": comm_bytes.get(k, 0),
                "sent_bytes": ring_factor(k, n) * comm_bytes.get(k, 0)} for k in COLLECTIVES}


def plot_rank_peaks(peaks: dict[str, dict[str, int]], budget_bytes: int, n: int, bucket_views=()):
    """Draw one rank's peak by category per point, DDP's buckets on top, one device's budget and 1/n of it (chapter 07).

    `peaks`: {point: peak split with "other" holding DDP's buckets}; `bucket_views`: points run with
    gradient_as_bucket_view, whose "gradients" are DDP's buckets (the gradients are views into them): drawn as
    buckets. Return (figure, axes).
    """
    from labkit import plots

    peaks = {p: {**s, "gradients": 0, "other": s.get("other", 0) + s["gradients"]} if p in bucket_views else s
             for p, s in peaks.items()}
    fits = {p: (sum(s.values()) <= budget_bytes, sum(s.values()) <= budget_bytes // n) for p, s in peaks.items()}
    fig, ax = plots.new_figure(width_in=7.5, height_in=3.4)
    labels = {p: p.replace("FSDP2 ", "FSDP2\n").replace(" + ", "\n+ ").replace("DDP ", "DDP\n") for p in peaks}
    whole, part = sum(w for w, _ in fits.values()), sum(p for _, p in fits.values())
    plots.plot_memory_bars({labels[p]: {k: v for k, v in s.items() if k != "other"} for p, s in peaks.items()}, ax=ax,
                           title=f"Peak of one rank, N = {n}: {whole} of {len(peaks)} points fit one device's budget, "
                                 f"{part} fit 1/{n} of it")
    below = [(sum(s.values()) - s.get("other", 0)) / plots.MiB for s in peaks.values()]
    ax.bar(list(labels.values()), [s.get("other", 0) / plots.MiB for s in peaks.values()], bottom=below,
           color="#8c8c8c", label="DDP's buckets")
    ax.axhline(budget_bytes / plots.MiB, color="black", lw=1, label="one device's budget")
    ax.axhline(budget_bytes // n / plots.MiB, color="black", ls="--", lw=1, label=f"1/{n} of it")
    ax.get_legend().remove()
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    ax.tick_params(axis="x", labelrotation=0, labelsize=7)
    ax.set_ylim(top=max(ax.get_ylim()[1], 1.08 * budget_bytes / plots.MiB))  # the budget's line clear of the frame
    return fig, ax


def plot_rank_memory(title: str, value: dict, budget_bytes: int | None = None):
    """Draw one rank's memory by category at the peak and at rest from one point's result (chapter 07's explore).

    Activations and "other" (DDP's buckets; at rest: the batch and logits) share one bar segment. Return (figure, axes).
    """
    from labkit import plots

    peak, rest = value["peak"], value["states"]
    fig, ax = plots.new_figure(width_in=5.0)
    plots.plot_memory_bars({"peak": {**peak, "activations": peak["activations"] + peak.get("other", 0)},
                            "at rest": {**rest, "activations": rest.get("other", 0)}}, ax=ax,
                           budget_bytes=budget_bytes or None, title=title, names={"activations": "activations, other"})
    return fig, ax
