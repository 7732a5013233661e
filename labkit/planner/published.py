"""Published measurements of real training runs beside the planner's figures (chapter 09's validation table).

Each run in data/published_runs.json has its exact source, the configuration it ran and the counter its memory figure
is. `validation()` sets the planner's figure beside each published one: where the run lists the planner's arguments
("plan"), the peak of the plan's step for its combination and that step's reserved peak (its allocations replayed
through the CUDA caching allocator's rules, labkit.planner.allocator); tokens/s from the GPU's achieved fraction of peak
(labkit.gpus), which comes from a different published run than the one it is checked on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from labkit import gpus
from labkit.planner.plan import REPLAY_MARGIN
from labkit.planner.runs import RUNS_PATH, fsdp2_gaps, published_runs  # noqa: F401 (this module's API too)

GiB = 2**30
TARGETS = {"peak active": 0.05, "peak allocated": 0.05, "peak reserved": REPLAY_MARGIN, "tokens/s per GPU": 0.25}
"""Largest relative error allowed for each kind of figure (issue 35): allocated and active peaks 5%, reserved 10%,
tokens/s 25%."""


@dataclass(frozen=True)
class Check:
    """One published figure beside the planner's."""

    run: str  # the run's id in data/published_runs.json
    figure: str  # a key of TARGETS
    published: tuple  # (low, high): the run's figure (low == high where it gives one number), GiB or tokens/s
    predicted: float | None  # the planner's, same unit; None: not modelled (see basis)
    basis: str  # where the prediction comes from, or why there is none

    @property
    def error(self) -> float | None:
        """Return the relative error to the nearer end of the published range (0 inside it; None: no prediction)."""
        if self.predicted is None:
            return None
        lo, hi = self.published
        if self.predicted > hi:
            return self.predicted / hi - 1
        return self.predicted / lo - 1 if self.predicted < lo else 0.0

    @property
    def within(self) -> bool | None:
        """Return whether the error is within the figure's target (None: no prediction)."""
        return None if self.error is None else abs(self.error) <= TARGETS[self.figure]


def run_config(run: dict):
    """Return the GPTConfig of a published run's model (labkit's GPT, Llama options; grouped-query attention where
    its key/value heads are fewer than its heads)."""
    from labkit.models import GPTConfig
    m = run["model"]
    return GPTConfig(n_layer=m["layers"], n_embd=m["hidden"], n_head=m["heads"],
                     n_kv_head=None if m["kv_heads"] == m["heads"] else m["kv_heads"], block_size=run["seq_len"],
                     vocab_size=m["vocab"], bias=False, mlp="swiglu", mlp_hidden=m["ffn_hidden"], norm="rms",
                     pos="rope", attn="sdpa", fused_qkv=False, tie_weights=m["tied"])


def flops_per_token(run: dict) -> float:
    """Return labkit.work's FLOPs per token of a published run's step: a bf16 step of one row of seq_len tokens on fake
    tensors at depths 1 and 2, each further block adding the same (the optimizer's elementwise ops count none). Its
    attention is the kernel the run's GPU runs (plan._as_gpu_runs_it: CUDA's flash, whose output op-level
    checkpointing keeps), not this CPU's flash kernel, which that save list leaves to be recomputed."""
    from labkit.techniques.checkpointing import checkpoint_blocks
    from labkit.estimate import fake_mode
    from labkit.models import build_model
    from labkit.planner.plan import _as_gpu_runs_it
    from labkit.work import count_work
    cfg, layers = _as_gpu_runs_it(run_config(run), run["gpu"]), run["model"]["layers"]
    flops = []
    for depth in (1, 2):
        with fake_mode(allow_non_fake_inputs=True):
            model = build_model(dataclasses.replace(cfg, n_layer=depth))
            kind = run.get("plan", {}).get("checkpointing") or _checkpointing(run)
            if kind != "none":  # every block, the last too (the runs here checkpoint as torchtitan does)
                checkpoint_blocks(model, segments=depth, checkpoint_last=True, op_level=kind == "op")
            x = torch.randint(cfg.vocab_size, (1, run["seq_len"]))

            def step():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    _, loss = model(x, x)
                loss.backward()
            flops.append(count_work(step).total_flops)
    return (flops[0] + (flops[1] - flops[0]) * (layers - 1)) / run["seq_len"]


def _checkpointing(run: dict) -> str:
    """Return the plan's name of a run's checkpointing from its description: "none", "full" or "op" (op level)."""
    for prefix, kind in (("none", "none"), ("full", "full"), ("selective, op level", "op")):
        if run["checkpointing"].startswith(prefix):
            return kind
    raise ValueError(f"run {run['id']}: checkpointing {run['checkpointing']!r} is not one the plan names")


def _range(value) -> tuple:
    return (value, value) if isinstance(value, (int, float)) else tuple(value)


def run_plan(run: dict) -> tuple:
    """Return (model, Combination) of the plan for a run that lists the planner's arguments (run["plan"])."""
    from dataclasses import replace

    from labkit.planner.plan import PRESETS, Combination
    a = run["plan"]
    return (replace(PRESETS[a["model"]], logits_fp32=a["logits_fp32"], attn=a["attention"]),
            Combination(a["gpus"], a["parallel"], a["micro_batch"], a["batch"] // a["gpus"] // a["micro_batch"],
                        a["checkpointing"], a["precision"], adam_impl=a["adam_impl"], keep_logits=a["keep_logits"]))


def memory_checks(runs: list[dict]) -> list[Check]:
    """Return the runs' memory figures beside the plan's for each one's configuration (run["plan"]): the peak of the
    plan's step at full depth (the figure a plan's fast depth reaches by arithmetic) and its reserved
    peak, the step's allocations replayed through the CUDA caching allocator's rules (labkit.planner.plan.replayed)."""
    from labkit.planner.plan import replayed
    plans = [run_plan(run) for run in runs]
    figures = replayed([(model, c, run["plan"]["seq_len"]) for (model, c), run in zip(plans, runs)])  # (one call:
    out = []  # every run's step shared among the plan's workers)
    for run, (model, c), (peak, reserved, _, reserved_expandable) in zip(runs, plans, figures):
        a = run["plan"]
        expandable = a.get("expandable_segments", False)  # the run's allocator setting
        basis = (f"the plan's step for {c.ranks} × {c.parallel}, micro-batch {c.micro_batch} × {c.accum_steps}, "
                 f"{a['attention']} attention, {c.checkpointing} checkpointing, {c.precision}, {c.adam_impl} Adam, "
                 f"logits {'held through' if c.keep_logits else 'freed before'} backward, its allocations at full depth "
                 "written out from fake steps of a few blocks (labkit.planner.events: event for event a step of every block's)")
        for key, figure in (("peak_allocated_gib", "peak allocated"), ("peak_active_gib", "peak active")):
            if key in run["memory"]:
                out.append(Check(run["id"], figure, _range(run["memory"][key]), peak / GiB, basis))
        if "peak_reserved_gib" in run["memory"]:
            out.append(Check(run["id"], "peak reserved", _range(run["memory"]["peak_reserved_gib"]),
                             (reserved_expandable if expandable else reserved) / GiB,
                             basis + "; its allocations replayed through the CUDA caching allocator's "
                             + ("rules with expandable_segments:True, which the run's launcher sets (assumed: the "
                                "run does not say how it was launched; labkit.planner.allocator: one segment per pool "
                                "and stream, growing by 2 MiB / 20 MiB pages; best fit, splits" if expandable else "default rules (labkit.planner.allocator: segments, best "
                                "fit, splits") + "; each of FSDP2's streams a pool of its own; FSDP2 as torch "
                             f"{torch.__version__.split('+')[0]} runs it, the run's {a['torch']})"))
    return out


def throughput_checks(runs: list[dict]) -> list[Check]:
    """Return each run's tokens/s per GPU beside the prediction from its GPU's achieved fraction of peak (labkit.gpus):
    fraction x bf16 peak / the run's counted FLOPs per token; a run the fraction is taken from is its source."""
    out = []
    for run in runs:
        if "tokens_per_s_per_gpu" not in run:
            continue
        profile = gpus.GPUS[run["gpu"]]
        eff = profile.efficiency
        if eff is None:
            out.append(Check(run["id"], "tokens/s per GPU", _range(run["tokens_per_s_per_gpu"]), None,
                             f"no published fraction of peak for the {run['gpu']}"))
        elif run["id"] in eff.source:
            out.append(Check(run["id"], "tokens/s per GPU", _range(run["tokens_per_s_per_gpu"]), None,
                             f"the {run['gpu']}'s fraction of peak ({eff.fraction:.3f}) is taken from this run: "
                             "not a check"))
        else:
            counted = flops_per_token(run)
            out.append(Check(run["id"], "tokens/s per GPU", _range(run["tokens_per_s_per_gpu"]),
                             eff.fraction * profile.flops_per_s["bf16"] / counted,
                             f"{eff.fraction:.3f} of the {run['gpu']}'s bf16 peak (from {eff.source.split(':')[0]}; "
                             "FLOPs counted as run, recomputation included: assumed the same share with and without "
                             f"checkpointing) over {counted / 1e9:.2f} GFLOP per token counted, recomputation included"
                             + _other_model(run)))
    return out


def _gpu_memory_gib(run: dict) -> tuple[float, float] | None:
    """Return (the run's GPU memory, its profile's) in GiB where the run gives its own and the two differ by 2% or
    more, else None."""
    if (run_gib := run.get("gpu_memory_gib")) is None:
        return None
    profile_gib = gpus.GPUS[run["gpu"]].memory_bytes / 2**30
    return None if abs(run_gib / profile_gib - 1) < 0.02 else (run_gib, profile_gib)


def _other_model(run: dict) -> str:
    """Return a clause saying the run's GPUs are another model than its profile's (their memory differs), else ""."""
    if (gib := _gpu_memory_gib(run)) is None:
        return ""
    run_gib, profile_gib = gib
    return (f"; the run's GPUs hold {run_gib:.0f} GiB, another model than the {run['gpu']} profile's "
            f"{profile_gib:.1f} GiB ({run.get('gpu_note', 'its rates not published')}): priced at the profile's "
            "datasheet rates, so this check crosses GPU models")


def validation() -> list[Check]:
    """Return every published figure beside the planner's: memory where a run gives the plan's arguments (a figure the
    plan does not model listed with the run's reason, "memory_not_modelled"), tokens/s where its GPU has a published
    fraction of peak."""
    runs = published_runs()
    unmodelled = [Check(run["id"], key.removesuffix("_gib").replace("_", " "), _range(value), None,
                        f"not modelled: {run['memory_not_modelled']}")
                  for run in runs if "memory_not_modelled" in run for key, value in run["memory"].items()
                  if key.endswith("_gib")]
    return (memory_checks([run for run in runs if "plan" in run and "memory" in run]) + unmodelled
            + throughput_checks(runs))


NOT_A_CHECK = {"source": "source: not a check, the run labkit.gpus takes its GPU's fraction of peak from "
                         "(predicting it would return its own figure)",
               "not modelled": "not modelled: not a check, the plan does not model that figure of the run",
               "no fraction": "no fraction: not a check, no published fraction of peak for that GPU"}
"""What each mark of format_validation's target column means, for a figure that is not a check."""


def not_a_check(check: Check) -> str:
    """Return why a figure without a prediction is not a check: source, not modelled or no fraction (chapter 09)."""
    if "taken from this run" in check.basis:
        return "source"
    return "not modelled" if check.basis.startswith("not modelled") else "no fraction"


def format_validation(checks: list[Check]) -> str:
    """Return the checks as a table: run, its GPUs and parallelism, figure, published, the plan's, error, within the
    target (a tokens/s prediction marked an estimate: another run's share of peak, not the plan's step time)."""
    # a planned run's parallelism by the plan's name; the others' as published, in capitals (no plan name)
    setups = {r["id"]: f"{r['gpus']} {r['plan']['parallel'] if 'plan' in r else r['parallel'].upper()}"
              for r in published_runs()}
    lines = [f"{'run':28s} {'GPUs, parallel':16s} {'figure':17s} {'published':>13s} {'predicted':>9s} {'error':>7s}  "
             "target", "-" * 103]
    for c in checks:
        lo, hi = c.published
        unit = ".2f" if "peak" in c.figure else ",.0f"
        pub = f"{lo:{unit}}" if lo == hi else f"{lo:{unit}}–{hi:{unit}}"
        pred = "—" if c.predicted is None else f"{c.predicted:{unit}}"
        err = "—" if c.error is None else f"{c.error:+.1%}"
        verdict = not_a_check(c) if c.within is None else f"±{TARGETS[c.figure]:.0%} " + ("yes" if c.within else "NO")
        estimate = " (estimate)" if c.predicted is not None and "peak" not in c.figure else ""
        lines.append(f"{c.run:28s} {setups.get(c.run, ''):16s} {c.figure:17s} {pub:>13s} {pred:>9s} {err:>7s}  "
                     f"{verdict}{estimate}")
    lines.append("GPUs, parallel: a planned run's by the plan's names (fsdp2-reshard: FSDP2 resharding after forward), "
                 "the others' as published, in capitals; memory in GiB (2^30 B), predicted: the peak of the plan's step "
                 "for the run (reserved: its allocations replayed through the caching allocator's rules); tokens/s "
                 "predicted: a fraction of peak from another run (its source) x the GPU's peak / the run's counted FLOPs "
                 "per token (recomputation included, no communication), an estimate, not the plan's step time; error: "
                 "to the nearer end of a published range (0 inside it); target: the largest error allowed"
                 + "".join(f"; {NOT_A_CHECK[m]}" for m in dict.fromkeys(not_a_check(c) for c in checks
                                                                       if c.within is None))
                 + _larger_gpus([c for c in checks if "peak" in c.figure and c.predicted is not None]))
    return "\n".join(lines)


def _larger_gpus(memory_checks: list[Check]) -> str:
    """Return a clause naming the memory checks' runs whose GPUs held more than their profile's, else ""."""
    runs = {r["id"]: r for r in published_runs()}
    larger = {}  # (gpu, its GiB, the profile's) -> [(run, whether its GiB is assumed)] on such GPUs
    for c in memory_checks:
        run = runs.get(c.run)
        if run is None or (gib := _gpu_memory_gib(run)) is None:
            continue
        run_gib, profile_gib = gib
        if run_gib > profile_gib:
            assumed = run.get("gpu_note", "").startswith("assumed")  # (not published for that run: its hosts')
            larger.setdefault((run["gpu"], run_gib, profile_gib), []).append((c.run, assumed))
    clauses = []
    for (gpu, run_gib, profile_gib), ids in larger.items():
        assumed = ", ".join(dict.fromkeys(i for i, a in ids if a))
        clauses.append(f"; {', '.join(dict.fromkeys(i for i, _ in ids))}: their {gpu}s held {run_gib:.1f} GiB"
                       + (f" ({assumed}: assumed, not published for it)" if assumed else "")
                       + f", more than the {gpu} profile's {profile_gib:.1f} GiB, so a published peak above "
                       f"{profile_gib:.1f} GiB could run there")
    return "".join(clauses)
