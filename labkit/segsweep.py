"""Chapter 02's segment sweep: measure a checkpointed forward + backward layout by layout, and draw the sweep."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from labkit import gpus
from labkit.data import MarkovTokens
from labkit.plots import plot_memory_bars
from labkit.throughput import PairedRatio, measure_throughputs, paired_ratio
from labkit.train import make_optimizer, measure_step, seeded_model
from labkit.validate import check_choice, check_int
from labkit.work import Work, WorkCounter, count_work

MiB = 2**20
LAYOUTS = ("balanced", "torch", "all", "selective", "selective-linear")
"""The sweep's layouts: s balanced segments, torch's checkpoint_sequential, every block, two selective policies."""
BALANCED, TORCH, TIME, MEASURED = "#4c72b0", "#dd8452", "#8c8c8c", "#c44e52"  # one colour per meaning, both panels
DODGE = 0.2  # the right panel draws the FLOPs this far left of each s, the times this far right


@dataclass(frozen=True)
class SweepPoint:
    """One layout's forward + backward: memory at its peak, counted work, time on a GPU (chapter 02)."""

    layout: str
    segments: int
    peak_bytes: int  # most bytes live at once during forward + backward
    split: dict  # bytes at that peak by category
    flops: int  # forward + backward, recomputation included
    work: Work  # forward + backward + the Adam update
    gpu: gpus.StepTime  # `work` on the chosen GPU (roofline)
    time: PairedRatio | None = None  # measured against the plain step, CUDA only

    @property
    def activation_bytes(self) -> int:
        """Return the activation bytes at the peak (gradient bytes are constant through the step)."""
        return self.split["activations"]


def launch_clause(plain: gpus.StepTime, other: gpus.StepTime) -> str:
    """Return "; × r counting the host's launches" when either step is launch-bound, else "" (chapter 02)."""
    if not (plain.launch_bound or other.launch_bound):
        return ""
    return f"; × {other.with_launches_s / plain.with_launches_s:.2f} counting the host's launches"


class SegmentSweep:
    """Run one model's forward + backward checkpointed layout by layout, warmed up once per shape (chapter 02).

    `forward(model, idx, targets, layout, segments)` returns (logits, loss): the chapter's technique.
    `config(n_layer, n_embd)` returns the model's config; its vocabulary sets the batch's tokens. `n_layer`, `n_embd`,
    `batch_size` and `timed_steps` are run()'s defaults.
    """

    def __init__(self, forward: Callable, config: Callable, gpu, device: torch.device | str, seq_len: int,
                 n_layer: int, n_embd: int, batch_size: int, timed_steps: int = 0, seed: int = 0):
        self.forward, self.config, self.gpu = forward, config, gpu
        self.device, self.seq_len, self.seed = torch.device(device), seq_len, seed
        self.shape = {"n_layer": n_layer, "n_embd": n_embd, "batch_size": batch_size}  # run()'s defaults
        self.timed_steps = timed_steps
        self._warm: dict = {}

    def step(self, model, optimizer, batch, layout: str = "balanced", segments: int = 1, update: bool = True):
        """Run forward and backward (and with `update`, the optimizer step), gradients zeroed in place."""
        _, loss = self.forward(model, *batch, layout, segments)
        loss.backward()
        if update:
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # gradient bytes stay constant through the step
        return loss.detach()

    def warm(self, n_layer: int, n_embd: int, batch_size: int):
        """Return (model, Adam optimizer, batch, the update's Work), built and warmed up once per shape."""
        key = (n_layer, n_embd, batch_size)
        if key not in self._warm:
            self._warm.clear()  # keep one model alive at a time
            cfg = self.config(n_layer, n_embd)
            model = seeded_model(cfg, self.seed, self.device)
            opt = make_optimizer("adam", model.parameters())
            tokens = MarkovTokens(cfg.vocab_size, seed=self.seed).batch(batch_size, self.seq_len)
            data = tuple(t.to(self.device) for t in tokens)  # 2 × (B, T)
            self.step(model, opt, data)  # creates Adam's state and the gradient tensors
            self._warm[key] = (model, opt, data, count_work(opt.step))  # the update: the same at every layout
        return self._warm[key]

    def run(self, layout: str, segments: int, n_layer: int | None = None, n_embd: int | None = None,
            batch_size: int | None = None, timed_steps: int | None = None) -> SweepPoint:
        """Measure the memory and count the work of one layout; on CUDA, time it against the plain step."""
        shape = dict(self.shape)
        shape.update({k: v for k, v in (("n_layer", n_layer), ("n_embd", n_embd), ("batch_size", batch_size))
                      if v is not None})
        timed_steps = self.timed_steps if timed_steps is None else timed_steps
        check_choice("layout", layout, LAYOUTS)
        check_int("segments", segments, 1, shape["n_layer"])
        batch_size = shape["batch_size"]
        model, opt, data, update_work = self.warm(**shape)

        def fwd_bwd(m, o, b):
            return self.step(m, o, b, layout, segments, update=False)

        with WorkCounter() as counter:  # one run metered and counted: the counter observes, it allocates nothing
            mem = measure_step(model, opt, data, step_fn=fwd_bwd, warmup=False)
        opt.zero_grad(set_to_none=False)
        work = counter.work()
        time = None
        if self.device.type == "cuda" and timed_steps:  # the GPU's own time, in paired rounds against the plain step
            t = measure_throughputs({"plain": lambda: self.step(model, opt, data),
                                     "this": lambda: self.step(model, opt, data, layout, segments)},
                                    samples_per_step=batch_size, device=self.device, steps=timed_steps)
            time = paired_ratio(t, "this", "plain")
        total = work + update_work
        return SweepPoint(layout, segments, mem.peak_bytes, mem.split, work.total_flops, total,
                          gpus.step_time(total, self.gpu), time)


@dataclass
class SweepCurves:
    """The sweep's curves against the segment count s, filled point by point (chapter 02)."""

    n_layer: int
    gpu_name: str
    s: list = field(default_factory=list)
    balanced_bytes: list = field(default_factory=list)  # activations at the peak, balanced segments
    torch_bytes: list = field(default_factory=list)  # the same with checkpoint_sequential (may lag behind `s`)
    flop_ratio: list = field(default_factory=list)  # counted FLOPs over the plain step's
    gpu_ratio: list = field(default_factory=list)  # time on the GPU over the plain step's
    launch_ratio: list = field(default_factory=list)  # the same with the host's launches counted (with_launches_s)
    launch_bound: bool = False  # whether any point so far, or the plain step, is launch-bound
    measured: list = field(default_factory=list)  # PairedRatio or None per s
    chen_bytes: list | None = None  # Chen's model of the balanced curve, once known
    flop_model: list | None = None  # the predicted FLOP ratio, once known

    def add(self, point: SweepPoint, plain: SweepPoint) -> None:
        """Append a balanced point, its ratios taken against `plain` (s = 1)."""
        self.s.append(point.segments)
        self.balanced_bytes.append(point.activation_bytes)
        self.flop_ratio.append(point.flops / plain.flops)
        self.gpu_ratio.append(point.gpu.time_s / plain.gpu.time_s)
        self.launch_ratio.append(point.gpu.with_launches_s / plain.gpu.with_launches_s)
        self.launch_bound = self.launch_bound or point.gpu.launch_bound or plain.gpu.launch_bound
        self.measured.append(point.time)


def draw_segment_sweep(fig, axes, c: SweepCurves) -> None:
    """Draw the segment sweep's activation bytes and cost ratios against s (chapter 02; a LiveFigure's draw)."""
    ax0, ax1 = axes
    ax0.plot(c.s, [b / MiB for b in c.balanced_bytes], "o-", color=BALANCED, label="balanced segments")
    if c.torch_bytes:
        ax0.plot(c.s[:len(c.torch_bytes)], [b / MiB for b in c.torch_bytes], "s--", ms=4, color=TORCH,
                 label="checkpoint_sequential")
    if c.chen_bytes:
        ax0.plot(c.s, [b / MiB for b in c.chen_bytes], ":", color="black", label="Chen's model")
    ax0.axvline(math.sqrt(c.n_layer), color="grey", lw=1, ls="--", label="√n")
    ax0.set_xlabel("segments s")
    ax0.set_ylabel("activations at the peak (MiB)")
    best = min(range(len(c.balanced_bytes)), key=lambda k: (c.balanced_bytes[k], k))  # from the sweep so far
    ax0.set_title(f"{c.n_layer}-block GPT, the last segment plain: activations lowest at s = {c.s[best]} "
                  f"({c.balanced_bytes[best] / c.balanced_bytes[0]:.0%} of s = 1)", fontsize=9)
    ax0.legend(fontsize=7)
    # the FLOPs just left of each s, the times just right: the two often lie within a few hundredths of each other
    flops_x, time_x = [s - DODGE for s in c.s], [s + DODGE for s in c.s]
    ax1.plot(flops_x, c.flop_ratio, "D", ms=5, mfc="none", color=BALANCED, label="FLOPs / plain (counted)")
    if c.flop_model:
        ax1.plot(flops_x, c.flop_model, ":", color="black", label="FLOPs / plain (one block's count)")
    ax1.plot(time_x, c.gpu_ratio, "^-", ms=4, lw=1, color=TIME, zorder=3, label=f"time on the {c.gpu_name} / plain")
    if c.launch_bound:
        ax1.plot(time_x, c.launch_ratio, "x--", ms=4, lw=1, color=TIME, label="the same, launches counted")
    medians = [m.median if m is not None else float("nan") for m in c.measured]
    if any(m is not None for m in c.measured):
        ax1.plot(time_x, medians, "v", mfc="none", color=MEASURED, label="measured here / plain (median)")
    ax1.axhline(4 / 3, color="black", ls="--", lw=1, label="one extra forward (4/3): a bound on FLOPs")
    ax1.set_xlabel("segments s")
    ax1.set_ylabel("cost relative to s = 1")
    ratios = [4 / 3, 1.0, *c.flop_ratio, *c.gpu_ratio, *c.launch_ratio, *(m for m in medians if not math.isnan(m))]
    top, low = max(ratios), min(ratios)
    ax1.set_ylim(low - (top - low), top + 0.15 * (top - low))  # the ratios in the upper half, the legend below them
    ax1.set_title(f"Recomputation, s ≥ 2: FLOPs × {min(c.flop_ratio[1:] or [1]):.2f}–{max(c.flop_ratio):.2f};"
                  f"\non the {c.gpu_name} × {min(c.gpu_ratio[1:] or [1]):.2f}–{max(c.gpu_ratio):.2f} the plain "
                  "step's time"
                  + (f"\n(× {min(c.launch_ratio[1:] or [1]):.2f}–{max(c.launch_ratio):.2f} counting launches)"
                     if c.launch_bound else ""), fontsize=9)
    ax1.legend(fontsize=6, ncol=2, loc="lower right")  # below the lowest ratio: no data there


def draw_against_plain(axes, plain: SweepPoint, point: SweepPoint, name: str, gpu_name: str,
                       title: str = "Peak of forward + backward") -> None:
    """Draw one layout beside the plain step: memory at the peak by category, and time on the GPU (chapter 02)."""
    ax0, ax1 = axes
    plot_memory_bars({"plain": plain.split, name: point.split}, ax=ax0, title=title)
    ms = [p.gpu.time_s * 1e3 for p in (plain, point)]
    ax1.bar(["plain", name], ms, color=[TIME, MEASURED])
    ax1.set_ylabel(f"step time on the {gpu_name} (ms)")
    ax1.set_title(f"On the {gpu_name}: × {ms[1] / ms[0]:.2f} the plain step's time\n(counted work, "
                  f"{'estimate' if plain.gpu.estimate_s else 'roofline'})"
                  + launch_clause(plain.gpu, point.gpu).replace("; ", "\n").replace("the host's ", ""), fontsize=9)
    ax1.tick_params(axis="x", labelrotation=20, labelsize=8)
