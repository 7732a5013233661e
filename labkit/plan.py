"""Plan training of a model on some GPUs: every technique combination's peak from a fake-tensor step, the fastest fit.

Memory comes from labkit.estimate.fake_step (one step on fake tensors); a step time is a roofline, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, UnsupportedOperatorException

from labkit.accumulation import split_batch
from labkit.checkpointing import checkpoint_blocks
from labkit.estimate import estimate_training_memory, example_batch, fake_step
from labkit.flops import count_flops
from labkit.gpus import DeviceProfile, device_profile
from labkit.meter import active_meter, format_bytes
from labkit.models import GPTConfig, blocks_of, build_model
from labkit.precision import PRECISIONS, amp_train_step
from labkit.progress import progress
from labkit.train import create_optimizer_state, make_optimizer
from labkit.validate import ParameterError, check_choice, check_float, check_int

RESERVE_FRACTION = 0.10  # share of device memory kept for what tensors do not show: CUDA context, allocator
#                          rounding and fragmentation, communication buffers
CHECKPOINTING = ("none", "every", "sqrt", "selective")  # every block; sqrt(n) segments; every block, matmuls kept
PARALLEL = ("single", "ddp", "zero1", "fsdp2", "fsdp2-reshard")  # one device; DDP (gradient buckets); ZeRO-1 (Adam
#   sharded); FSDP2 with reshard_after_forward False / True (labkit.estimate's fake process group, rank 0)
NOT_MODELLED = {  # combinations left out of every plan, and why (never guessed)
    "activation offload on": "no fake-tensor step with offload hooks yet",
    "fsdp2 with accumulation, autocast or checkpointing": "estimate's FSDP2 path runs one plain fp32 micro-batch",
    "fsdp2 of a model not a GPTConfig": "estimate's FSDP2 path builds labkit GPTs only",
    "optimizer state on host": "no fake-tensor step with a host optimizer yet",
}
GRADSCALER_BYTES = 16  # fp16 rows: bf16's fake step (the same 2-byte casts; the scaler's skip test reads a value, which
#                        fake tensors lack) plus GradScaler's scale, growth tracker, found_inf and inv_scale (4 B each)
_AT_OPTIMIZER: dict = {}  # fake_step's key -> bytes by category when the optimizer step started
_FLOPS: dict = {}  # (model key, depth, micro-batch, seq_len, checkpointing) -> FLOPs per micro-batch
PROBE_DEPTHS = {"none": (3, 4), "every": (3, 4), "selective": (3, 4)}  # depths run on fake tensors for depth="probe"
DEPTHS = ("full", "probe")  # full: every block on fake tensors (exact); probe: lines through PROBE_DEPTHS (lower bound)
SQRT_MAX_LAYERS = 12  # depth="probe": sqrt(n) segments change with depth, so run at full depth up to this many blocks


def _gpt2(n_layer: int, n_embd: int, n_head: int) -> GPTConfig:
    """Return a GPT-2 shape (learned positions up to 1024, tied embeddings)."""
    return GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=1024, vocab_size=50257)


def _llama(n_layer: int, n_embd: int, n_head: int, hidden: int) -> GPTConfig:
    """Return a Llama-style shape (multi-head attention, RoPE, RMSNorm, SwiGLU, vocabulary 32000, untied)."""
    return GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=4096, vocab_size=32000, bias=False,
                     mlp="swiglu", mlp_hidden=hidden, norm="rms", pos="rope", attn="sdpa", fused_qkv=False,
                     tie_weights=False)


PRESETS = {
    "gpt2": _gpt2(12, 768, 12),  # 124 M
    "gpt2-medium": _gpt2(24, 1024, 16),  # 355 M
    "gpt2-large": _gpt2(36, 1280, 20),  # 774 M
    "gpt2-xl": _gpt2(48, 1600, 25),  # 1.5 B
    "llama-1b": _llama(22, 2048, 32, 5632),  # TinyLlama's shape with multi-head attention: 1.3 B
    "llama-7b": _llama(32, 4096, 32, 11008),  # Llama 2 7B: 6.7 B
    "llama-13b": _llama(40, 5120, 40, 13824),  # Llama 2 13B: 13 B
    "llama-70b": _llama(80, 8192, 64, 28672),  # Llama 2 70B's shape with multi-head attention: 78 B
}


@dataclass(frozen=True)
class ModelSpec:
    """A model to plan: build(n_layer or None, rows, seq_len) returns (model, batch) with model(*batch) -> (_, loss)."""

    name: str  # shown in the table
    build: Callable  # (n_layer, rows, seq_len) -> (nn.Module, tuple of tensors with `rows` rows)
    n_layer: int | None  # identical blocks (checkpointable): their number; None: no labkit blocks, always full depth
    key: str | None  # identifies the model in fake_step's cache (None: not cached)
    max_seq_len: int | None = None  # longest sequence the model takes (a learned position table), None: any
    config: GPTConfig | None = None  # a labkit GPT's config (FSDP2 rows need it)


def gpt_spec(cfg: GPTConfig, name: str = "GPTConfig") -> ModelSpec:
    """Return the spec of a labkit GPT."""
    def build(n_layer, rows, seq_len):
        c = replace(cfg, n_layer=cfg.n_layer if n_layer is None else n_layer)
        if c.pos == "rope":
            c = replace(c, block_size=seq_len)  # rotary positions: no table, any length
        return build_model(c), example_batch(c, rows, seq_len)
    return ModelSpec(name, build, cfg.n_layer, repr(cfg), cfg.block_size if cfg.pos == "learned" else None, cfg)


def callable_spec(fn: Callable, name: str = "model") -> ModelSpec:
    """Return the spec of fn(rows, seq_len) -> (nn.Module, batch): any model, run at full depth."""
    return ModelSpec(name, lambda n_layer, rows, seq_len: fn(rows, seq_len), None, None)


class _CausalLM(torch.nn.Module):
    """A transformers causal LM called as model(input_ids, labels) -> (logits, loss)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        out = self.model(input_ids=input_ids, labels=labels)
        return out.logits, out.loss


def hf_spec(config, name: str = "transformers") -> ModelSpec:
    """Return the spec of a transformers config (a config object or a config.json path), built with from_config."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ParameterError("model: a transformers config needs the optional extra transformers "
                             "(pip install transformers)") from None
    if isinstance(config, str):
        config = AutoConfig.from_pretrained(config)  # a local config.json: no weights, no hub

    def build(n_layer, rows, seq_len):
        c = config if n_layer is None else replace_hf_layers(config, n_layer)
        x = torch.randint(config.vocab_size, (rows, seq_len))
        return _CausalLM(AutoModelForCausalLM.from_config(c)), (x, x.clone())
    return ModelSpec(name, build, None, None)


def replace_hf_layers(config, n_layer: int):
    """Return a copy of a transformers config with `n_layer` hidden layers."""
    out = config.__class__.from_dict(config.to_dict())
    out.num_hidden_layers = n_layer
    return out


def model_spec(model) -> ModelSpec:
    """Return the spec of a preset name, a GPTConfig, a config.json path, a transformers config or a ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, GPTConfig):
        return gpt_spec(model)
    if isinstance(model, str) and model in PRESETS:
        return gpt_spec(PRESETS[model], model)
    if isinstance(model, str) and model.endswith(".json"):
        return hf_spec(model, model)
    if hasattr(model, "to_dict") and hasattr(model, "vocab_size"):
        return hf_spec(model, type(model).__name__)
    raise ParameterError(f"model must be one of {tuple(PRESETS)}, a GPTConfig, a config.json path, "
                         f"a transformers config or a ModelSpec, got {model!r}")


@dataclass(frozen=True)
class Combination:
    """One way to run the training step."""

    ranks: int  # data-parallel devices
    parallel: str  # one of PARALLEL
    micro_batch: int  # rows per micro-batch (per rank)
    accum_steps: int  # micro-batches per optimizer step
    checkpointing: str  # one of CHECKPOINTING
    precision: str  # "fp32", "bf16" (autocast) or "fp16" (autocast + GradScaler)


@dataclass
class Row:
    """A combination's prediction: per-device peak and its split, verdict, roofline step time."""

    combination: Combination
    peak_bytes: int  # per-device peak (fake-tensor step, plus exact arithmetic)
    split: dict  # bytes at the peak by category
    fits: bool  # peak_bytes <= the plan's budget_bytes
    flops: int  # FLOPs per optimizer step per device, recomputation included
    compute_s: float  # roofline: max(FLOPs / peak FLOP/s, memory bytes / memory bandwidth)
    comm_s: float  # communicated bytes / device-to-device bandwidth
    step_s: float  # compute_s + comm_s (no overlap assumed)
    tokens_per_s: float  # global batch tokens / step_s


@dataclass
class Plan:
    """Every combination's row, what was left out and why, the fastest that fits and the Pareto front."""

    model: str
    device: str
    gpus: int
    seq_len: int
    batch: int  # global batch (samples per optimizer step)
    n_params: int
    budget_bytes: int  # device memory less the reserve
    reserve_fraction: float
    rows: list = field(default_factory=list)
    left_out: dict = field(default_factory=dict)  # what -> why
    fake_steps: int = 0  # memory-relevant combinations run on fake tensors (each at PROBE_DEPTHS or full depth)
    elapsed_s: float = 0.0

    @property
    def fastest(self) -> Row | None:
        """Return the fastest row that fits (None: nothing fits)."""
        fitting = [r for r in self.rows if r.fits]
        return min(fitting, key=lambda r: (r.step_s, r.peak_bytes)) if fitting else None

    @property
    def pareto(self) -> list:
        """Return the fitting rows no other fitting row beats in both peak and step time, fastest first."""
        front = []
        for r in sorted((r for r in self.rows if r.fits), key=lambda r: (r.step_s, r.peak_bytes)):
            if not front or r.peak_bytes < front[-1].peak_bytes:
                front.append(r)
        return front


def _segments(checkpointing: str, n_layer: int) -> dict | None:
    """Return checkpoint_blocks' arguments for a checkpointing choice at a depth (None: none)."""
    if checkpointing == "none":
        return None
    if checkpointing == "sqrt":
        return {"segments": max(1, round(math.sqrt(n_layer)))}
    return {"segments": n_layer, "selective": checkpointing == "selective"}


def plan_step(model, optimizer, batch, micro_batch: int, precision: str):
    """Run one optimizer step over `batch` in micro-batches of `micro_batch` rows (labkit.precision.amp_train_step)."""
    return amp_train_step(model, optimizer, split_batch(batch, micro_batch), precision=precision)


def _fake_run(spec: ModelSpec, n_layer, micro_batch: int, n_micro: int, seq_len: int, checkpointing: str,
              precision: str):
    """Run the step on fake tensors (estimate.fake_step); return peak, split, states, n, FLOPs per micro-batch."""
    key = None if spec.key is None else ("plan", spec.key, n_layer, micro_batch, n_micro, seq_len, checkpointing,
                                         precision)
    flops_key = (spec.key, n_layer, micro_batch, seq_len, checkpointing)  # FLOPs: the same in every precision
    count = spec.key is None or flops_key not in _FLOPS

    def build():
        model, batch = spec.build(n_layer, micro_batch * n_micro, seq_len)
        seg = _segments(checkpointing, len(blocks_of(model))) if checkpointing != "none" else None
        if seg is not None:
            checkpoint_blocks(model, **seg)
        opt = make_optimizer("adam", model.parameters())
        create_optimizer_state(opt)
        opt.register_step_pre_hook(lambda *_: _AT_OPTIMIZER.__setitem__(key, active_meter().current_split()))

        def run():
            if count:
                _FLOPS[flops_key] = count_flops(plan_step, model, opt, batch, micro_batch, precision) / n_micro
            else:
                plan_step(model, opt, batch, micro_batch, precision)
        return model, lambda meter: meter.track(model, opt, *batch), run
    try:
        peak, split, states, n = fake_step(key, build)
    except (DataDependentOutputException, UnsupportedOperatorException) as e:
        raise ParameterError(f"model: {spec.name} cannot run on fake tensors ({type(e).__name__}: {e}); make the "
                             "operation independent of tensor values or pass a callable that builds a model "
                             "without it") from None
    states["at_optimizer"] = _AT_OPTIMIZER[key]  # bytes by category when the optimizer step starts
    return peak, split, states, n, _FLOPS[flops_key]


def _extrapolated(spec: ModelSpec, micro_batch: int, n_micro: int, seq_len: int, checkpointing: str, precision: str,
                  depth: str = "full"):
    """Return (peak, split, param bytes, opt bytes, n, FLOPs per micro-batch) at full depth, run or extrapolated.

    depth="probe": the peak is the larger of two lines through the probes (their peaks; the bytes when the optimizer
    starts plus the rise over them of a step whose activations are negligible). The peak is a maximum of lines in
    the depth, so this is a lower bound, exact while no steeper line takes over between the probes and full depth.
    """
    full, probes = spec.n_layer, PROBE_DEPTHS.get(checkpointing)
    if depth == "full" or full is None or probes is None or full <= sum(probes):  # (sqrt(n): segments vary by depth)
        peak, split, states, n, fl = _fake_run(spec, full, micro_batch, n_micro, seq_len, checkpointing, precision)
        return peak, split, states["parameters"], states["optimizer_state"], n, fl
    runs = [_fake_run(spec, d, micro_batch, n_micro, seq_len, checkpointing, precision) for d in probes]
    (a, b), steps = probes, full - probes[0]

    def line(lo, hi):
        return lo + (hi - lo) * steps // (b - a)
    lo, hi = runs
    peak, split = line(lo[0], hi[0]), {k: line(lo[1][k], hi[1][k]) for k in lo[1]}
    at_opt = {k: line(lo[2]["at_optimizer"][k], hi[2]["at_optimizer"][k]) for k in lo[1]}
    quiet = _fake_run(spec, b, 1, n_micro, 1, "none", precision)  # one token per row: the states' own rise
    rise = quiet[0] - sum(quiet[2]["at_optimizer"].values())
    if sum(at_opt.values()) + rise > peak:
        peak, split = sum(at_opt.values()) + rise, {**at_opt, "activations": at_opt["activations"] + rise}
    return (peak, split, line(lo[2]["parameters"], hi[2]["parameters"]),
            line(lo[2]["optimizer_state"], hi[2]["optimizer_state"]), line(lo[3], hi[3]), line(lo[4], hi[4]))


def _data_parallel(peak: int, split: dict, param_bytes: int, opt_bytes: int, parallel: str, ranks: int):
    """Return (peak, split) of one rank: DDP adds gradient buckets (the gradients' bytes), ZeRO-1 keeps 1/N of Adam."""
    split = dict(split)
    if parallel in ("ddp", "zero1"):
        peak += param_bytes  # gradients have the parameters' dtype and size
        split["activations"] += param_bytes
    if parallel == "zero1":
        dropped = opt_bytes - opt_bytes // ranks
        peak -= dropped
        split["optimizer_state"] -= dropped
    return peak, split


def _input_bytes_per_row(spec: ModelSpec, seq_len: int) -> int:
    """Return the bytes of one batch row (all input tensors), built on the meta device."""
    with torch.device("meta"):
        _, batch = spec.build(1 if spec.n_layer else None, 1, seq_len)
    return sum(t.numel() * t.element_size() for t in batch)


def _divisors(n: int) -> list:
    """Return the powers of two that divide n, and n."""
    return sorted({d for d in (2**k for k in range(n.bit_length())) if n % d == 0} | {n})


def _check(spec: ModelSpec, device: DeviceProfile, gpus: int, seq_len: int, batch: int, reserve_fraction: float,
           precisions) -> None:
    """Raise ParameterError naming the field for bad input, before any work."""
    check_int("gpus", gpus, 1, 1 if device.name == "cpu" else 4096)
    check_int("seq_len", seq_len, 1)
    if spec.max_seq_len is not None:
        check_int("seq_len", seq_len, 1, spec.max_seq_len)
    check_int("batch", batch, 1)
    if batch % gpus:
        raise ParameterError(f"batch ({batch}) must be divisible by gpus ({gpus}): every rank takes batch / gpus rows")
    check_float("reserve_fraction", reserve_fraction, 0.0, 1.0, hi_open=True)
    for p in precisions:
        check_choice("precision", p, PRECISIONS)
        if p not in device.flops_per_s:
            raise ParameterError(f"precision {p!r}: the {device.name} has no {p} compute "
                                 f"(it has {tuple(device.flops_per_s)})")


def plan(model, gpu: str | DeviceProfile = "a100-80gb", gpus: int = 1, seq_len: int = 1024, batch: int = 8,
         precisions=None, checkpointing=None, reserve_fraction: float = RESERVE_FRACTION, depth: str = "full") -> Plan:
    """Return the plan of every combination: per-device peak on fake tensors, verdict, roofline time, tokens/s."""
    spec = model_spec(model)
    device = gpu if isinstance(gpu, DeviceProfile) else device_profile(gpu)
    precisions = tuple(p for p in PRECISIONS if p in device.flops_per_s) if precisions is None else tuple(precisions)
    _check(spec, device, gpus, seq_len, batch, reserve_fraction, precisions)
    check_choice("depth", depth, DEPTHS)
    if checkpointing is None:
        checkpointing = CHECKPOINTING if spec.n_layer is not None else ("none",)
    for c in checkpointing:
        if c != "none" and spec.n_layer is None:
            raise ParameterError(f"checkpointing {c!r}: {spec.name} has no labkit blocks to checkpoint")
        check_choice("checkpointing", c, CHECKPOINTING)
    left_out = dict(NOT_MODELLED)
    if depth == "probe":
        left_out["exact peaks"] = "depth='probe' extrapolates from a few blocks: each peak is a lower bound"
    if depth == "probe" and "sqrt" in checkpointing and spec.n_layer is not None and spec.n_layer > SQRT_MAX_LAYERS:
        checkpointing = tuple(c for c in checkpointing if c != "sqrt")
        left_out["checkpointing sqrt"] = (f"{spec.n_layer} blocks: sqrt(n) segments do not extrapolate from "
                                          f"a few blocks, and a full-depth fake step per combination is slow")
    t0 = time.perf_counter()
    ranks_list = sorted({r for r in (2**k for k in range(gpus.bit_length())) if batch % r == 0} | {gpus})
    per_rank = [batch // r for r in ranks_list]
    memory_keys = sorted({(mb, min(rows // mb, 2)) for rows in per_rank for mb in _divisors(rows)})
    row_bytes = _input_bytes_per_row(spec, seq_len)
    out = Plan(spec.name, device.name, gpus, seq_len, batch, 0, int(device.memory_bytes * (1 - reserve_fraction)),
               reserve_fraction, left_out=left_out)
    fake = {}
    fake_precisions = sorted({"bf16" if p == "fp16" else p for p in precisions})
    todo = [(mb, n_micro, c, p) for mb, n_micro in memory_keys for c in checkpointing for p in fake_precisions]
    for mb, n_micro, c, p in progress(todo, desc="fake steps"):
        fake[mb, n_micro, c, p] = _extrapolated(spec, mb, n_micro, seq_len, c, p, depth)
    for mb, n_micro, c, p in todo:
        if p == "bf16" and "fp16" in precisions:
            peak, split, *rest = fake[mb, n_micro, c, p]
            scaler_split = {**split, "activations": split["activations"] + GRADSCALER_BYTES}
            fake[mb, n_micro, c, "fp16"] = (peak + GRADSCALER_BYTES, scaler_split, *rest)
        if p not in precisions:
            del fake[mb, n_micro, c, p]
    out.fake_steps = len(todo)
    for ranks in ranks_list:
        rows = batch // ranks
        for (mb, n_micro, c, p), (peak, split, param_bytes, opt_bytes, n, fl) in fake.items():
            if rows % mb or min(rows // mb, 2) != n_micro:
                continue
            out.n_params = n
            peak += (rows - mb * n_micro) * row_bytes  # the whole per-rank batch is held; the fake step held n_micro
            split = {**split, "activations": split["activations"] + (rows - mb * n_micro) * row_bytes}
            for parallel in (("single",) if ranks == 1 else ("ddp", "zero1")):
                rank_peak, rank_split = _data_parallel(peak, split, param_bytes, opt_bytes, parallel, ranks)
                out.rows.append(_row(Combination(ranks, parallel, mb, rows // mb, c, p), rank_peak, rank_split,
                                     out.budget_bytes, fl, param_bytes, opt_bytes, device, seq_len * batch))
    if spec.config is not None and "fp32" in precisions and "none" in checkpointing:
        out.rows += _fsdp_rows(spec.config, ranks_list, batch, seq_len, device, out.budget_bytes, depth)
    out.elapsed_s = time.perf_counter() - t0
    return out


def _fsdp_rows(cfg: GPTConfig, ranks_list, batch: int, seq_len: int, device: DeviceProfile, budget: int,
               depth: str) -> list:
    """Return FSDP2 rows (fp32, no accumulation, no checkpointing): rank 0's step from labkit.estimate's fake group."""
    rows = []
    for ranks in (r for r in ranks_list if r > 1):
        mb = batch // ranks
        flops = _extrapolated(gpt_spec(cfg), mb, 1, seq_len, "none", "fp32", depth)[5]
        for parallel, stage in (("fsdp2", 2), ("fsdp2-reshard", 3)):
            est = estimate_training_memory(cfg, mb, seq_len, "adam", ranks, stage)
            param_bytes = 4 * est.n_params  # the full fp32 parameters: what all-gathers and reduce-scatters move
            row = _row(Combination(ranks, parallel, mb, 1, "none", "fp32"), est.peak_bytes, est.split, budget, flops,
                       param_bytes // ranks, est.states["optimizer_state"], device, seq_len * batch)
            gathers = 2 if stage == 3 else 1  # all-gathers per step (forward, and again in backward when resharded)
            row.comm_s = (gathers + 1) * (ranks - 1) / ranks * param_bytes / device.peer_bytes_per_s
            row.step_s = row.compute_s + row.comm_s
            row.tokens_per_s = seq_len * batch / row.step_s
            rows.append(row)
    return rows


def _row(comb: Combination, peak: int, split: dict, budget: int, flops_per_micro: float, param_bytes: int,
         opt_bytes: int, device: DeviceProfile, tokens: int) -> Row:
    """Return a combination's row: the roofline step time over the device's rates."""
    flops = int(flops_per_micro * comb.accum_steps)
    traffic = comb.accum_steps * (3 * param_bytes + 2 * split["activations"]) + 3 * param_bytes + 2 * opt_bytes
    compute_s = max(flops / device.flops_per_s[comb.precision], traffic / device.memory_bytes_per_s)
    comm_bytes = 0 if comb.ranks == 1 else 2 * (comb.ranks - 1) / comb.ranks * param_bytes  # ring all-reduce
    comm_s = comm_bytes / device.peer_bytes_per_s
    step_s = compute_s + comm_s
    return Row(comb, peak, split, peak <= budget, flops, compute_s, comm_s, step_s, tokens / step_s)


def format_plan(p: Plan, all_rows: bool = False) -> str:
    """Return the plan as a text table: the Pareto front (every row with all_rows) and the fastest that fits."""
    head = (f"{p.model} ({format_count(p.n_params)} parameters) on {p.gpus} × {p.device}, seq_len {p.seq_len}, "
            f"batch {p.batch}: budget {format_bytes(p.budget_bytes)} per device ({p.reserve_fraction:.0%} reserved); "
            f"{len(p.rows)} combinations, {p.fake_steps} run on fake tensors, {p.elapsed_s:.1f} s")
    cols = (f"{'ranks':>5} {'parallel':>13} {'micro':>5} {'accum':>5} {'ckpt':>9} {'prec':>4} {'peak':>10} {'fits':>4} "
            f"{'step (ms)':>10} {'tokens/s':>10}")
    shown, title = p.rows, "all combinations:"
    if not all_rows:
        shown, title = p.pareto, "Pareto front (memory against roofline time):"
    if not shown:
        shown, title = sorted(p.rows, key=lambda r: r.peak_bytes)[:5], "nothing fits; the smallest peaks:"
    lines = [head, "", title, cols]
    for r in shown:
        c = r.combination
        lines.append(f"{c.ranks:>5} {c.parallel:>13} {c.micro_batch:>5} {c.accum_steps:>5} {c.checkpointing:>9} "
                     f"{c.precision:>4} {format_bytes(r.peak_bytes):>10} {'yes' if r.fits else 'no':>4} "
                     f"{r.step_s * 1e3:>10,.4g} {r.tokens_per_s:>10,.0f}")
    best = p.fastest
    lines.append("")
    lines.append("fastest that fits: " + ("none" if best is None else ", ".join(
        f"{k} {v}" for k, v in asdict(best.combination).items()) + f" ({format_bytes(best.peak_bytes)}, roofline "
        f"{best.step_s * 1e3:,.4g} ms/step, {best.tokens_per_s:,.0f} tokens/s, a bound: real steps are slower)"))
    lines.append("left out: " + "; ".join(f"{k} ({v})" for k, v in p.left_out.items()))
    return "\n".join(lines)


def plan_json(p: Plan) -> dict:
    """Return the plan as JSON-able data."""
    best = p.fastest
    return {**{k: v for k, v in asdict(p).items() if k != "rows"}, "rows": [asdict(r) for r in p.rows],
            "fastest": None if best is None else asdict(best), "pareto": [asdict(r) for r in p.pareto]}


def main(argv=None) -> int:
    """Print the plan of `--model` on `--gpus` x `--gpu` (a table, or JSON with --json)."""
    ap = argparse.ArgumentParser(prog="python -m labkit.plan", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", help=f"a preset {tuple(PRESETS)} or a transformers config.json")
    ap.add_argument("--gpu", default="a100-80gb", help="a GPU of labkit.gpus.GPUS or cpu (measured)")
    ap.add_argument("--gpus", type=int, default=1, help="devices (data-parallel ranks at most)")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sample")
    ap.add_argument("--batch", type=int, default=8, help="global batch: samples per optimizer step")
    ap.add_argument("--reserve", type=float, default=RESERVE_FRACTION, help="share of device memory held back")
    ap.add_argument("--depth", choices=DEPTHS, default="full",
                    help="full: every block on fake tensors (exact); probe: from a few blocks (faster, a lower bound)")
    ap.add_argument("--all", action="store_true", help="print every combination, not only the Pareto front")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    try:
        p = plan(args.model, args.gpu, args.gpus, args.seq_len, args.batch, reserve_fraction=args.reserve,
                 depth=args.depth)
    except ParameterError as e:
        ap.error(str(e))
    print(json.dumps(plan_json(p), indent=1) if args.json else format_plan(p, args.all))
    return 0


def combination_step(cfg: GPTConfig, combination: Combination, seed: int = 0, device="cpu"):
    """Return (model, optimizer, step_fn) running a one-device combination for real: what the meter checks a row by."""
    from labkit.train import seeded_model

    model = seeded_model(cfg, seed, device)
    segments = _segments(combination.checkpointing, cfg.n_layer)
    if segments is not None:
        checkpoint_blocks(model, **segments)
    optimizer = make_optimizer("adam", model.parameters())

    def step_fn(model, optimizer, batch):
        return plan_step(model, optimizer, batch, combination.micro_batch, combination.precision)
    return model, optimizer, step_fn


def format_count(n: int) -> str:
    """Return a parameter count for reading: "437,760" below a million, else "124.4 M" or "6.74 B"."""
    if n < 10**6:
        return f"{n:,}"
    return f"{n / 1e6:.1f} M" if n < 10**9 else f"{n / 1e9:.2f} B"


if __name__ == "__main__":
    raise SystemExit(main())
