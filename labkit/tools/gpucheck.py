"""Run every CUDA path of the workbook at a GPU-sized model, print a table, write build/gpu-check.json.

    make gpu-check                                            # GPT-2 small, batch 4 x 1024 tokens (workbook.gpucheck)
    python -m labkit.tools.gpucheck --n-layer 6 --batch 2     # a hosted notebook (labkit installed, no repository)

One row per check (`CHECKS`): what was measured, what it is held against, ok or not. The rows live here
once: tests/test_cuda.py runs them at a small size. From the repository, `make gpu-check` runs them through
workbook.gpucheck, which adds two rows of its own: the other `cuda` tests and the chapters on CUDA. Without CUDA it
says so and exits with status 2; `--rehearse-on-cpu` runs the same code on the CPU at a tiny size (the tests'), with
no CUDA figure.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from labkit.data import MarkovTokens
from labkit.device import as_device, half_precision, hardware_report, synchronize
from labkit.hostlink import copy_bandwidth
from labkit.meter import OutOfMemory, format_bytes, try_fit
from labkit.models import GPT, GPTConfig, count_params
from labkit.results import build_dir
from labkit.techniques.checkpointing import checkpoint_blocks
from labkit.techniques.l2l import L2LTrainer, measure_l2l_step
from labkit.techniques.offload import OffloadHooks
from labkit.techniques.precision import amp_train_step, forward_activation_bytes
from labkit.throughput import measure_throughputs
from labkit.train import make_optimizer, measure_step, seeded_model, train_step

CHECKS = ("meter", "budget", "offload", "l2l", "precision", "checkpoint", "roofline", "plan")
METER_TOLERANCE = 0.05  # the meter's peak within 5% of max_memory_allocated
PLAN_TOLERANCE = 0.03  # labkit.planner.plan's predicted peak within 3% of max_memory_allocated (issue 24's target) ...
WORKSPACE_ALLOWANCE_BYTES = 128 * 2**20  # ... or below it by no more than this: cuBLAS's workspaces, which the allocator
#                                           counts and no tensor shows (67-91 MiB at GPT-2 small on the H200, 2026-11-30)
TENSOR_TOLERANCE = 0.01  # the plan's fake tensors within 1% of the meter's real ones on this GPU (CUDA's own dtypes)
ROOFLINE_SLACK = 0.9  # no step may run faster than 90% of its roofline (10% for clocks and timing noise)


@dataclass
class Row:
    """One check: its figures, what they are held against, and the verdict."""

    check: str  # one of CHECKS
    measured: str  # the figure(s), formatted for the table
    expected: str  # theory, torch's own figure, or the invariant held
    ok: bool | None  # None: not run (the reason is in `note`)
    note: str = ""  # why it differs, or why it did not run
    figures: dict = field(default_factory=dict)  # the raw numbers, for build/gpu-check.json


@dataclass
class Setup:
    """The model shape and the device every check uses."""

    device: torch.device
    cfg: GPTConfig
    batch: int
    seq_len: int
    steps: int  # timed rounds per comparison
    train_steps: int  # optimizer steps of the fp16 GradScaler run
    min_offload_bytes: int = 65536  # saved tensors smaller than this stay on the device (OffloadHooks.min_bytes)

    def model(self, seed: int = 0) -> GPT:
        """Return a freshly initialised model on the device (same weights for the same seed)."""
        return seeded_model(self.cfg, seed, self.device)

    def data(self, seed: int = 0):
        """Return one (inputs, targets) batch from a learnable source, on the device."""
        src = MarkovTokens(vocab_size=self.cfg.vocab_size, seed=seed)
        x, y = src.batch(self.batch, self.seq_len, generator=torch.Generator().manual_seed(seed))
        return x.to(self.device), y.to(self.device)


def _cuda(setup: Setup) -> bool:
    return setup.device.type == "cuda"


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _step_s(setup: Setup, fns: dict) -> dict[str, float]:
    """Return each function's median seconds per call, timed in interleaved rounds."""
    times = measure_throughputs(fns, samples_per_step=setup.batch, device=setup.device, steps=setup.steps)
    return {k: t.step_s for k, t in times.items()}


# -- the checks ----------------------------------------------------------------------------------
def check_meter(setup: Setup) -> Row:
    """Compare the meter's peak of one Adam training step with the CUDA allocator's max_memory_allocated."""
    model, batch = setup.model(), setup.data()
    opt = make_optimizer("adam", model.parameters())
    step = measure_step(model, opt, batch)  # warm-up first: Adam's state and cuBLAS's workspace exist
    meter = step.meter
    figures = {"meter_peak_bytes": meter.peak_bytes, "peak_split": step.split}
    if not _cuda(setup):
        return Row("meter", format_bytes(meter.peak_bytes), "max_memory_allocated (CUDA only)", None,
                   "rehearsal on cpu: no allocator figure", figures)
    allocated = meter.cuda_max_allocated_bytes
    rel = allocated / meter.peak_bytes - 1
    figures.update(cuda_max_allocated_bytes=allocated, cuda_reserved_bytes=meter.cuda_reserved_bytes,
                   relative_difference=rel)
    return Row("meter", f"{format_bytes(meter.peak_bytes)} vs allocator {format_bytes(allocated)} ({rel:+.2%})",
               f"|difference| <= {METER_TOLERANCE:.0%}", abs(rel) <= METER_TOLERANCE,
               "the allocator rounds every block up to 512 B and counts cuBLAS's workspace, which no tensor "
               f"holds; reserved (cached) {format_bytes(meter.cuda_reserved_bytes)}", figures)


def check_budget(setup: Setup) -> Row:
    """Refuse a step over a budget (labkit.OutOfMemory with allocator figures), free its memory, run the next."""
    model, batch = setup.model(), setup.data()
    opt = make_optimizer("adam", model.parameters())
    peak = measure_step(model, opt, batch).peak_bytes
    synchronize(setup.device)
    base = torch.cuda.memory_allocated(setup.device) if _cuda(setup) else None
    budget = int(0.8 * peak)
    refused = try_fit(measure_step, model, opt, batch, budget_bytes=budget, warmup=False)
    opt.zero_grad(set_to_none=True)  # gradients a refused backward had already written
    err = refused.error
    after = torch.cuda.memory_allocated(setup.device) if _cuda(setup) else None
    returned = after is None or after - base <= 2**20
    following = try_fit(train_step, model, opt, batch)
    has_figures = isinstance(err, OutOfMemory) and (not _cuda(setup) or err.cuda_allocated_bytes is not None)
    ok = (not refused.fits) and has_figures and returned and following.fits
    figures = {"budget_bytes": budget, "peak_bytes": peak, "refused": not refused.fits,
               "error": str(err) if err else None, "allocated_before_bytes": base, "allocated_after_bytes": after,
               "next_step_ran": following.fits}
    left = "" if after is None else f", {format_bytes(after - base)} left over"
    return Row("budget", f"refused at {format_bytes(budget)} (80% of the peak){left}; next step "
               f"{'ran' if following.fits else 'failed'}",
               "OutOfMemory with allocator figures, memory returned, next step runs", ok,
               str(err).split("; ")[-1] if err else "no refusal", figures)


def check_offload(setup: Setup) -> Row:
    """Time offload with prefetch, without, and torch's save_on_cpu against the plain step; measure copy bandwidth."""
    model, batch = setup.model(), setup.data()
    opt = make_optimizer("adam", model.parameters())
    train_step(model, opt, batch)
    cuda = _cuda(setup)
    kw = {"min_bytes": setup.min_offload_bytes}
    timed = OffloadHooks(model, prefetch=cuda, time_copies=True, **kw).track_layers(model.blocks)
    hooks = {"plain": None, "offload+prefetch": OffloadHooks(model, prefetch=cuda, **kw).track_layers(model.blocks),
             "offload": OffloadHooks(model, prefetch=False, **kw),
             "save_on_cpu": torch.autograd.graph.save_on_cpu(pin_memory=cuda)}
    steps = {k: functools.partial(train_step, forward_context=h) for k, h in hooks.items()}
    times = _step_s(setup, {k: (lambda f=f: f(model, opt, batch)) for k, f in steps.items()})
    ratios = {k: _ratio(t, times["plain"]) for k, t in times.items() if k != "plain"}
    peaks = {k: measure_step(model, opt, batch, steps[k], warmup=False).peak_bytes
             for k in ("plain", "offload+prefetch")}
    train_step(model, opt, batch, forward_context=timed)
    stats = timed.stats()
    figures = {"step_s": times, "ratio_to_plain": ratios, "peak_bytes": peaks,
               "bytes_to_host": stats["bytes_to_host"], "copy_to_host_bytes_per_s": stats["copy_to_host_bytes_per_s"]}
    measured = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
    measured += f"; peak {format_bytes(peaks['offload+prefetch'])} vs {format_bytes(peaks['plain'])}"
    ok = peaks["offload+prefetch"] < peaks["plain"] and stats["offloaded"] > 0
    note = "rehearsal on cpu: copies are synchronous, no bandwidth figure"
    if cuda:
        one_gib = torch.empty(2**28, device=setup.device)  # the most a copy to the host can get: one large pinned copy
        reference = copy_bandwidth(torch.empty(one_gib.shape, pin_memory=True), one_gib)
        del one_gib
        achieved = stats["copy_to_host_bytes_per_s"]
        figures.update(one_pinned_copy_bytes_per_s=reference, bandwidth_fraction=achieved / reference)
        measured += f"; copies {achieved / 1e9:.1f} GB/s = {achieved / reference:.0%} of one 1 GiB pinned copy"
        ok = ok and ratios["offload+prefetch"] <= ratios["offload"] * 1.05
        note = ("prefetch must not be slower than copying back on demand (5% noise allowed); save_on_cpu copies "
                "out synchronously on the compute stream, only its copy back is non-blocking")
    return Row("offload", measured, "device peak below plain; prefetch <= on-demand", ok, note, figures)


def check_l2l(setup: Setup) -> Row:
    """Time L2L with and without weight prefetch; compare device peaks with the plain step."""
    base = setup.model().cpu()
    batch = setup.data()
    cuda = _cuda(setup)
    trainers = {"l2l+prefetch": L2LTrainer(copy.deepcopy(base), setup.device, prefetch=cuda),
                "l2l": L2LTrainer(copy.deepcopy(base), setup.device, prefetch=False)}
    times = _step_s(setup, {k: (lambda t=t: t.step(batch)) for k, t in trainers.items()})
    peaks = {k: measure_l2l_step(t, batch, timeline=False).peak_bytes for k, t in trainers.items()}
    plain = base.to(setup.device)
    plain_peak = measure_step(plain, make_optimizer("adam", plain.parameters()), batch).peak_bytes
    ratio = _ratio(times["l2l+prefetch"], times["l2l"])
    figures = {"step_s": times, "peak_bytes": peaks, "plain_peak_bytes": plain_peak, "prefetch_over_none": ratio}
    ok = max(peaks.values()) < plain_peak and (not cuda or ratio <= 1.05)
    return Row("l2l", f"prefetch/none step time {ratio:.2f}; device peak {format_bytes(peaks['l2l+prefetch'])} "
               f"vs plain {format_bytes(plain_peak)}", "peak below plain; prefetch not slower", ok,
               "" if cuda else "rehearsal on cpu: no side stream, prefetch off in both", figures)


def check_precision(setup: Setup) -> Row:
    """Train with fp16 + GradScaler for real (count skipped steps); time bf16 and fp16 against fp32."""
    cuda = _cuda(setup)
    precisions = ("fp32", "bf16", "fp16") if cuda else ("fp32", "bf16")  # never fp16 compute on a CPU
    batch = setup.data()
    models = {p: setup.model() for p in precisions}
    opts = {p: make_optimizer("adam", m.parameters()) for p, m in models.items()}
    scaler = torch.amp.GradScaler(setup.device.type) if cuda else None
    figures: dict = {}
    if cuda:
        src = MarkovTokens(vocab_size=setup.cfg.vocab_size, seed=1)
        gen = torch.Generator().manual_seed(1)
        initial_scale, results = scaler.get_scale(), []
        for _ in range(setup.train_steps):
            x, y = src.batch(setup.batch, setup.seq_len, generator=gen)
            results.append(amp_train_step(models["fp16"], opts["fp16"], [(x.to(setup.device), y.to(setup.device))],
                                          precision="fp16", scaler=scaler))
        skipped = sum(not r.stepped for r in results)
        figures.update(fp16_losses=[r.loss for r in results], fp16_skipped_steps=skipped,
                       fp16_initial_scale=initial_scale, fp16_final_scale=results[-1].scale)
    steps = {p: (lambda p=p: amp_train_step(models[p], opts[p], [batch], precision=p,
                                            scaler=scaler if p == "fp16" else None))  # the trained scale
             for p in precisions}
    times = _step_s(setup, steps)
    act = {p: forward_activation_bytes(models[p], batch, precision=p) for p in precisions}
    speedup = {p: _ratio(times["fp32"], times[p]) for p in precisions if p != "fp32"}
    act_ratio = {p: _ratio(act[p], act["fp32"]) for p in precisions if p != "fp32"}
    figures.update(step_s=times, speedup_over_fp32=speedup,
                   activation_bytes=act, activation_ratio_to_fp32=act_ratio)
    choice = half_precision(setup.device)  # what the chapters train in here: bf16, or fp16 + GradScaler before Ampere
    figures["chosen"] = {"precision": choice.precision, "needs_scaler": choice.needs_scaler, "reason": choice.reason}
    measured = (f"chapters use {choice.precision}{' + GradScaler' if choice.needs_scaler else ''}; "
                + ", ".join(f"{p} at {speedup[p]:.2f}x fp32's speed, activations {act_ratio[p]:.2f}x" for p in speedup))
    ok = all(r < 1.0 for r in act_ratio.values())
    expected = "16-bit activations < fp32's"
    if cuda:
        losses = figures["fp16_losses"]
        trained = all(map(lambda v: v == v and abs(v) != float("inf"), losses)) and losses[-1] < losses[0]
        measured = (f"fp16+GradScaler {setup.train_steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                    f"{figures['fp16_skipped_steps']} skipped; " + measured)
        ok = ok and trained and figures["fp16_skipped_steps"] < setup.train_steps // 2
        expected += "; fp16 loss finite and falling, < half the steps skipped"
    return Row("precision", measured, expected, ok, _scaler_note(figures) if cuda else
               "rehearsal on cpu: fp16 is never run on a CPU", figures)


def _scaler_note(figures: dict) -> str:
    """Say what GradScaler did in the fp16 run: how many steps it skipped and where its scale ended."""
    skipped, first, last = (figures[k] for k in ("fp16_skipped_steps", "fp16_initial_scale", "fp16_final_scale"))
    if skipped:
        return (f"GradScaler skipped {skipped} steps (inf/NaN gradients) while its scale came down from {first:g} to "
                f"{last:g}, what the gradients allow")
    return f"GradScaler skipped no step: the gradients stayed finite at its scale ({first:g} at first, {last:g} last)"


def check_checkpoint(setup: Setup) -> Row:
    """Hold full checkpointing's step-time ratio against Chen's bound: one extra forward per step."""
    batch = setup.data()
    plain, ckpt = setup.model(), setup.model()
    checkpoint_blocks(ckpt, segments=setup.cfg.n_layer, checkpoint_last=True)  # every block recomputed
    opts = {m: make_optimizer("adam", m.parameters()) for m in (plain, ckpt)}

    def forward_only():
        with torch.no_grad():
            plain(*batch)

    times = _step_s(setup, {"plain": lambda: train_step(plain, opts[plain], batch),
                            "checkpointed": lambda: train_step(ckpt, opts[ckpt], batch), "forward": forward_only})
    ratio = _ratio(times["checkpointed"], times["plain"])
    bound = 1 + _ratio(times["forward"], times["plain"])
    figures = {"step_s": times, "ratio": ratio, "one_extra_forward_bound": bound}
    ok = 1.0 <= ratio * 1.02 and ratio <= bound * 1.05 if _cuda(setup) else None  # 2% and 5% for timing noise
    return Row("checkpoint", f"step time {ratio:.2f}x plain", f"1 <= ratio <= 1 + forward/step = {bound:.2f}", ok,
               "the bound counts the whole forward (embedding and head are not recomputed, so the ratio may "
               "sit below it)" if _cuda(setup) else "rehearsal on cpu: one timed round, not judged", figures)


def check_roofline(setup: Setup) -> Row:
    """Time a training step per precision beside its roofline here: counted FLOPs and bytes (WorkCounter) at
    this GPU's datasheet rates (labkit.gpus), the bound every chapter's GPU time comes from."""
    from labkit.gpus import cuda_profile, device_profile, step_time
    from labkit.validate import ParameterError
    from labkit.work import count_work

    cuda = _cuda(setup)
    try:
        profile = cuda_profile(setup.device) if cuda else device_profile("cpu")
    except ParameterError:  # a card without a datasheet profile in labkit.gpus.GPUS: nothing to hold it against
        return Row("roofline", "not run", "a datasheet profile of this GPU in labkit.gpus.GPUS", None,
                   f"no profile for {torch.cuda.get_device_name(setup.device)}: add its datasheet figures to GPUS")
    choice = half_precision(setup.device)
    precisions = ("fp32", choice.precision) if cuda else ("fp32",)  # never 16-bit timing on a CPU
    batch = setup.data()
    models = {p: setup.model() for p in precisions}
    opts = {p: make_optimizer("adam", m.parameters()) for p, m in models.items()}
    scaler = choice.scaler(setup.device, init_scale=2.0**10) if cuda else None  # fp16 only; a scale that steps
    steps = {p: (lambda p=p: amp_train_step(models[p], opts[p], [batch], precision=p,
                                            scaler=scaler if p == "fp16" else None)) for p in precisions}
    for p, fn in steps.items():  # warm-up: Adam's state exists and (fp16) the scaler steps, so each counted step is steady
        for _ in range(20):
            if fn().stepped:
                break
    synchronize(setup.device)
    works = {p: count_work(fn) for p, fn in steps.items()}
    times = _step_s(setup, steps)
    bounds = {p: step_time(w, profile) for p, w in works.items()}
    ratio = {p: times[p] / bounds[p].bound_s for p in precisions}
    figures = {"gpu": profile.name, "step_s": times, "bound_s": {p: b.bound_s for p, b in bounds.items()},
               "compute_s": {p: b.compute_s for p, b in bounds.items()},
               "memory_s": {p: b.memory_s for p, b in bounds.items()},
               "launch_s": {p: b.launch_s for p, b in bounds.items()},  # kernels x labkit.gpus.EAGER_OPERATOR_S
               "estimate_s": {p: b.estimate_s for p, b in bounds.items()},
               "flops": {p: w.flops for p, w in works.items()},
               "bytes_accessed": {p: w.bytes_accessed for p, w in works.items()},
               "kernels": {p: w.kernels for p, w in works.items()}, "measured_over_bound": ratio}
    measured = "; ".join(f"{p} {times[p] * 1e3:.2f} ms = {ratio[p]:.2f}x its roofline {bounds[p].bound_s * 1e3:.3f} ms "
                         f"({'FLOPs' if bounds[p].compute_s >= bounds[p].memory_s else 'bytes'}), "
                         f"launches {bounds[p].launch_s * 1e3:.2f} ms" for p in precisions)
    ok = all(r >= ROOFLINE_SLACK for r in ratio.values()) if cuda else None
    return Row("roofline", measured, f"measured >= {ROOFLINE_SLACK:.0%} of the roofline on {profile.name}", ok,
               "the roofline is a bound: the ratio is how far this GPU's kernels are from its datasheet peak "
               "(unfused operators, launches); below the bound the counted work or the profile is wrong"
               if cuda else "rehearsal on cpu: fp32 only, not judged", figures)


def check_plan(setup: Setup) -> Row:
    """Hold labkit.planner.plan's predicted peaks (fake tensors) against the real steps' max_memory_allocated."""
    from labkit.gpus import DeviceProfile
    from labkit.planner.plan import Combination, combination_step, plan

    half = half_precision(setup.device).precision if _cuda(setup) else "bf16"
    wanted = [Combination(1, "single", setup.batch, 1, "none", "fp32"),
              Combination(1, "single", max(1, setup.batch // 2), min(2, setup.batch), "every", half),
              Combination(1, "single", 1, setup.batch, "selective", half)]
    memory = torch.cuda.get_device_properties(setup.device).total_memory if _cuda(setup) else 2**40
    profile = DeviceProfile(setup.device.type, memory, {"fp32": 1e12, half: 1e12}, 1e12, 1e12, 1e12)
    rows = plan(setup.cfg, profile, 1, setup.seq_len, setup.batch, precisions=("fp32", half),
                checkpointing=("none", "every", "selective"), reserve_fraction=0.0,
                adam_impls=("for-loop",)).rows  # (the Adam combination_step runs: a GPU plan's default is fused)
    batch = setup.data()
    errors, tensor_errors, figures = {}, {}, {}
    for c, name in zip(wanted, _names(wanted)):
        predicted = next(r.peak_bytes for r in rows if r.combination == c)
        model, opt, step_fn = combination_step(setup.cfg, c, 0, setup.device)
        meter = measure_step(model, opt, batch, step_fn).meter
        measured = meter.cuda_max_allocated_bytes if _cuda(setup) else meter.peak_bytes
        errors[name] = predicted / measured - 1
        tensor_errors[name] = predicted / meter.peak_bytes - 1
        figures[name] = {"predicted_peak_bytes": predicted, "measured_bytes": measured,
                         "meter_peak_bytes": meter.peak_bytes}
        del model, opt
        if _cuda(setup):
            torch.cuda.empty_cache()
    worst = max(errors, key=lambda n: abs(errors[n]))
    worst_tensors = max(tensor_errors, key=lambda n: abs(tensor_errors[n]))
    figures["relative_difference"], figures["tensor_difference"] = errors, tensor_errors
    if not _cuda(setup):
        return Row("plan", f"largest difference {errors[worst]:+.2%} ({worst}) over {len(errors)} combinations",
                   f"|predicted / the meter (rehearsal on cpu) - 1| <= {PLAN_TOLERANCE:.0%}", None,
                   "rehearsal on cpu: the meter is exact here, no allocator figure", figures)
    under = {n: figures[n]["measured_bytes"] - figures[n]["predicted_peak_bytes"] for n in errors}
    allocator_ok = all(abs(errors[n]) <= PLAN_TOLERANCE or 0 <= under[n] <= WORKSPACE_ALLOWANCE_BYTES for n in errors)
    return Row("plan", f"tensors: largest difference {tensor_errors[worst_tensors]:+.2%} from the meter "
                       f"({worst_tensors}); allocator: {errors[worst]:+.2%} ({worst}, "
                       f"{format_bytes(under[worst])} below it) over {len(errors)} combinations",
               f"tensors within {TENSOR_TOLERANCE:.0%} of the meter; |predicted / max_memory_allocated - 1| <= "
               f"{PLAN_TOLERANCE:.0%}, or below it by at most {format_bytes(WORKSPACE_ALLOWANCE_BYTES)}",
               abs(tensor_errors[worst_tensors]) <= TENSOR_TOLERANCE and allocator_ok,
               "the plan counts tensors (fake, with CUDA autocast's dtypes); the allocator also counts cuBLAS's "
               "workspaces and its 512 B rounding, which the plan's reserve covers", figures)


def _names(combinations) -> list[str]:
    """Return the plan row's names of its combinations."""
    return [f"mb {c.micro_batch} x {c.accum_steps}, {c.checkpointing}, {c.precision}" for c in combinations]


# -- running and reporting -----------------------------------------------------------------------
def run_checks(setup: Setup, only=CHECKS, on_row=None, extra: dict | None = None, out: Path = Path("build")) -> list[Row]:
    """Run the chosen checks in order; a check that raises becomes a failed row with its error.

    `on_row(rows)`: called with the rows so far after each one (main writes the report, so a run stopped
    part-way leaves the rows it finished). `extra`: more checks by name, each called as fn(setup, out) (the
    repository's rows, workbook.gpucheck)."""
    funcs = {"meter": check_meter, "budget": check_budget, "offload": check_offload, "l2l": check_l2l,
             "precision": check_precision, "checkpoint": check_checkpoint, "roofline": check_roofline,
             "plan": check_plan, **{name: functools.partial(fn, out=out) for name, fn in (extra or {}).items()}}
    rows = []
    for name in only:
        t0 = time.perf_counter()
        try:
            row = funcs[name](setup)
        except Exception as e:  # a broken path is a finding to report beside the others
            row = Row(name, f"error: {type(e).__name__}", "runs", False, traceback.format_exc()[-1500:])
        row.figures["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(format_row(row), flush=True)
        if on_row is not None:
            on_row(rows)
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_row(row: Row) -> str:
    """Format one row of the table."""
    verdict = {True: "ok", False: "FAIL", None: "-"}[row.ok]
    return f"{row.check:<11} {verdict:<4} {row.measured}  [expected: {row.expected}]"


def table(rows: list[Row]) -> str:
    """Format the rows as the table `make gpu-check` prints."""
    lines = [f"{'check':<11} {'ok':<4} measured  [expected]", "-" * 100]
    lines += [format_row(r) + (f"\n{'':16}{r.note}" if r.note else "") for r in rows]
    return "\n".join(lines)


def parser(prog: str = "python -m labkit.tools.gpucheck", extra_checks: tuple = ()) -> argparse.ArgumentParser:
    """Return the command's argument parser (`extra_checks`: more rows `--skip` may name)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--n-layer", type=int, default=12, help="transformer blocks (default 12: GPT-2 small)")
    p.add_argument("--n-embd", type=int, default=768, help="width (default 768)")
    p.add_argument("--n-head", type=int, default=12, help="attention heads (default 12)")
    p.add_argument("--vocab-size", type=int, default=50304, help="tokens (default 50304)")
    p.add_argument("--batch", type=int, default=4, help="samples per step (default 4)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (default 1024)")
    p.add_argument("--steps", type=int, default=5, help="timed rounds per comparison (default 5)")
    p.add_argument("--train-steps", type=int, default=40, help="fp16 GradScaler optimizer steps (default 40)")
    p.add_argument("--skip", action="append", default=[], choices=CHECKS + tuple(extra_checks),
                   help="leave a check out (repeatable)")
    p.add_argument("--out", default=None, help="folder for gpu-check.json (default: build/ of the checkout, else of the "
                                               "working directory)")
    p.add_argument("--rehearse-on-cpu", action="store_true",
                   help="run the checks' code on the CPU at a tiny size (labkit's own tests); no GPU figures")
    return p


def main(argv=None) -> int:
    """Run the GPU checks (see the module docstring); return the exit status."""
    return run(parser().parse_args(argv))


def run(args: argparse.Namespace, extra: dict | None = None) -> int:
    """Run the checks `args` asks for, then the `extra` ones (name -> fn(setup, out)); print the table, write the
    report; return the exit status (2 without CUDA, 1 when a check failed)."""
    if not torch.cuda.is_available() and not args.rehearse_on_cpu:
        print(f"make gpu-check needs CUDA: torch {torch.__version__} sees no CUDA device "
              f"(CUDA build: {torch.version.cuda or 'no, a CPU build'}); see README 'Using a GPU'")
        return 2
    if args.rehearse_on_cpu:
        device = torch.device("cpu")
        cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
        args.batch, args.seq_len, args.steps, args.train_steps = 2, 16, 1, 2
    else:
        device = as_device("cuda")
        cfg = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.seq_len,
                        vocab_size=args.vocab_size, attn="sdpa")
    setup = Setup(device, cfg, args.batch, args.seq_len, args.steps, args.train_steps,
                  min_offload_bytes=0 if args.rehearse_on_cpu else 65536)
    out = Path(args.out) if args.out else build_dir()
    header = (f"{hardware_report(device)}\nmodel: {count_params(GPT(cfg)) / 1e6:.1f}M parameters "
              f"({cfg.n_layer} layers, width {cfg.n_embd}), batch {args.batch} x {args.seq_len} tokens")
    print(header, flush=True)
    path = out / "gpu-check.json"
    wanted = [c for c in CHECKS + tuple(extra or {}) if c not in args.skip]

    def write_report(rows: list[Row]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        report = {"hardware": hardware_report(device), "torch": torch.__version__, "config": asdict(cfg),
                  "batch": args.batch, "seq_len": args.seq_len, "rehearsal": args.rehearse_on_cpu,
                  "complete": len(rows) == len(wanted), "rows": [asdict(r) for r in rows]}
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")

    rows = run_checks(setup, wanted, on_row=write_report, extra=extra, out=out)
    write_report(rows)  # also when every check was skipped
    print("\n" + header + "\n" + table(rows))
    failed = [r.check for r in rows if r.ok is False]
    print(f"\n{path}: {len(rows) - len(failed)}/{len(rows)} checks without failure"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
