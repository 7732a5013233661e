"""Plan training of a model on some GPUs: every technique combination's peak from a fake-tensor step, the fastest fit.

Memory comes from labkit.estimate.fake_step (one step on fake tensors); a step time is a roofline, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import pickle
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                          UnsupportedOperatorException)
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.autocast_ops import CudaAutocastOps, recompute_context_fn
from labkit.children import ChildProcesses, die_with_parent
from labkit.cpu import one_thread
from labkit.estimate import MemoryEstimate, data_parallel_rank, example_batch, fake_sharded, fake_step, remembered
from labkit.fastfake import direct_dispatch, fast_fake_mode
from labkit.gpus import GPUS, RESERVE_FRACTION, DeviceProfile, device_profile
from labkit.meter import CATEGORIES, MemoryMeter, _inner, active_meter, format_bytes
from labkit.models import ATTENTION, GPTConfig, blocks_of, build_model
from labkit.planner.allocator import cpu_stream_tags, meter_events, replay
from labkit.planner.events import deeper, peak_bytes
from labkit.planner.overheads import non_tensor_bytes
from labkit.planner.runs import fsdp2_gaps
from labkit.progress import progress
from labkit.sharded import label_accumulated_gradients
from labkit.techniques.accumulation import split_batch
from labkit.techniques.checkpointing import checkpoint_blocks
from labkit.techniques.hosttier import host_tier
from labkit.techniques.offload import OffloadHooks
from labkit.techniques.precision import GRAD_SYNCS, PRECISIONS, amp_train_step
from labkit.train import ADAM_IMPLS, create_optimizer_state, make_optimizer, seeded_model
from labkit.validate import ParameterError, check_choice, check_divides, check_float, check_int, check_int_list
from labkit.work import WorkCounter

CHECKPOINTING = ("none", "every", "full", "sqrt", "selective", "op")  # every block but the last (kept whole: its
#   backward comes first); every block, the last too (torchtitan's "full", transformers' gradient checkpointing); sqrt(n)
#   segments; every block but the last, matmul outputs kept; torchtitan's op-level selective (every block, the last
#   too: SDPA's outputs and every second matmul's kept, a matmul with a bias always,
#   labkit.techniques.checkpointing.op_level_policy)
PLAN_CHECKPOINTING = ("none", "every", "sqrt", "selective")  # a CPU plan's choices unless it names others: the
#   chapters' (02), each checked against the meter
GPU_CHECKPOINTING = ("none", "full", "sqrt", "op")  # a GPU plan's: torchtitan's two modes (full, op-level selective)
#   beside none and sqrt(n) (left out past FULL_MAX_LAYERS blocks)
GPU_ADAM_IMPL = "fused"  # a GPU plan's Adam unless it names others: torchtitan's default (optimizer.implementation),
#   and what torchtune's recipes set (fused=True); a CPU plan's: the chapters' for-loop, which the meter checks
LAYER_LEVEL = re.compile(r"layer([0-9]+)")  # "layer<k>" (k >= 2): every k-th block checkpointed whole, the others kept
#   (torchtitan's layer-level selective checkpointing, selective_ac_option="k": blocks k, 2k, ... counted from 1; its
#   pull request 125 made "2" its first default). Its blocks repeat every k, not every one: the fast depth's two runs
#   are k blocks apart (_fit_depths)
OPTIMIZER_PLACES = ("device", "host")  # Adam's state and step on the device; on the host (ZeRO-Offload style, one device)
OFFLOAD_MIN_BYTES = 0  # activation offload moves every saved tensor but the parameters: rows stay exact lines
NOT_MODELLED = {  # combinations left out of every plan, and why (never guessed)
    "activation offload with checkpointing": "inside a checkpointed block checkpointing's own saved-tensor hooks "
                                             "take the tensors, so offload would move only what lies outside the "
                                             "blocks: planned with checkpointing none only",
    "activation offload or optimizer on the host with fsdp2": "FSDP2's CPUOffloadPolicy and offload hooks around "
                                                              "its gathered parameters are not run on the fake step",
    "optimizer on the host with several ranks": "ZeRO-Offload partitions the host state over the ranks and moves "
                                                "gradients during backward: planned on one device only",
    "gradients on the host during backward": "with the optimizer on the host the gradients stay on the device until "
                                             "the optimizer step (ZeRO-Offload moves them in buckets as they are "
                                             "reduced, lowering the peak by up to the gradients' bytes)",
    "gradients accumulated in another dtype": "micro-batches accumulate into the gradients their precision gives "
                                              "(fp32 under autocast and bf16-mp; bf16 in bf16-pure; with "
                                              "grad_sync='last', FSDP2's unsharded ones in its reduce dtype): an fp32 "
                                              "buffer over bf16 weights (Megatron's main_grad, DeepSpeed's "
                                              "grad_accum_dtype) is not planned",
}
MIXED_POLICY = "bf16-mp"  # FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), torchtitan's default:
#                          fp32 shards, gradients and Adam state; bf16 gathered parameters, compute and activations
PURE_BF16 = "bf16-pure"  # bf16 weights, gradients and Adam state, no autocast: torchtune's single-device default
REDUCE_DTYPES = ("fp32", "bf16")  # MIXED_POLICY's reduce_dtype: fp32 (torchtitan's default,
#   mixed_precision_reduce = "float32") or bf16 (MixedPrecisionPolicy's own when reduce_dtype is None: param_dtype's)
PLAN_PRECISIONS = (*PRECISIONS, MIXED_POLICY, PURE_BF16)  # a plan's precisions: autocast's (bf16, fp16 over fp32
#                                                           weights), FSDP2's policy, pure bf16
GRADSCALER_BYTES = 16  # fp16 rows: bf16's fake step plus GradScaler's four 4-byte scalars
COMM_UNITS = {"single": 0, "ddp": 2, "zero1": 3, "fsdp2": 2, "fsdp2-reshard": 3}  # parameter-sized ring passes:
#   per step for DDP and ZeRO-1 (which all-gathers the updated parameters too), per micro-batch for FSDP2 (chapter 07)
_FLOPS: dict = {}  # fake run's key -> (fp32 FLOPs, 16-bit FLOPs, bytes accessed, host bytes) per micro-batch, optimizer
#                   left out (labkit.work.WorkCounter); per micro-batch of n_micro (the second accumulates gradients)
_FITS: dict = {}  # (model key, Step with micro_batch 0) -> _fit's figures or None
_RISE: dict = {}  # (model key, shard, Adam's implementation, depth, pure bf16) -> bytes its update adds to what its
#                   start holds
_PLANNED: dict = {}  # (model key, Step, depth) -> _extrapolated's figures (from this process or a worker)
PLAN_WORKERS_ENV = "LABKIT_PLAN_WORKERS"  # processes a plan's fake steps run in (plan_workers)
MIN_GROUPS_PER_WORKER = 4  # fewer groups of fake steps run here: a worker's start (~3 s to import torch) costs more
#                            (a REPLAY group is one step at full depth, seconds at 7B: one is worth a worker)
PLAN_PRELOAD = ("torch.distributed.fsdp",)  # torch's modules a plan worker imports beyond torch (FSDP2 rows)
WORKER_TIMEOUT_S = 3600  # a plan worker still running after this is stopped (the 7B plan: ~35 s each, 2 cores)
DEPTHS = ("fast", "full")  # fast: exact arithmetic over runs at FAST_DEPTHS; full: every block (the reference)
REPLAY = "replay"  # _fake_steps' depth for full-depth steps whose allocations are replayed (_replay)
FAST_DEPTHS = {"none": (1, 2), "every": (2, 3), "full": (2, 3), "selective": (2, 3), "op": (2, 3)}  # blocks of the
#                                                                                     small runs, one apart
SHARDED_DEPTHS = (4, 5)  # the same for FSDP2 (its first two and last blocks stand apart)
REPLAY_DEPTHS = (3, 4)  # a replay's small depths on one device (its first block and its last stand apart: the
#                         embedding's output enters the first, the loss's gradient the last)
FULL_MAX_LAYERS = 12  # depth="fast" plans sqrt(n) and every FSDP2 rank count up to this many blocks (full-depth
#                       steps); past it, or wherever the two small runs take fewer blocks, its steps take _fit's runs


def _gpt2(n_layer: int, n_embd: int, n_head: int) -> GPTConfig:
    """Return a GPT-2 shape (learned positions up to 1024, tied embeddings)."""
    return GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=1024, vocab_size=50257)


def _llama(n_layer: int, n_embd: int, n_head: int, hidden: int, n_kv_head: int | None = None, vocab_size: int = 32000,
           block_size: int = 4096) -> GPTConfig:
    """Return a Llama-style shape (RoPE, RMSNorm, SwiGLU, untied; multi-head attention and Llama 2's vocabulary and
    context unless given)."""
    return GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head, block_size=block_size,
                     vocab_size=vocab_size, bias=False, mlp="swiglu", mlp_hidden=hidden, norm="rms", pos="rope",
                     attn="sdpa", fused_qkv=False, tie_weights=False)


PRESETS = {
    "gpt2": _gpt2(12, 768, 12),  # 124 M
    "gpt2-medium": _gpt2(24, 1024, 16),  # 355 M
    "gpt2-large": _gpt2(36, 1280, 20),  # 774 M
    "gpt2-xl": _gpt2(48, 1600, 25),  # 1.5 B
    "llama-1b": _llama(22, 2048, 32, 5632, n_kv_head=4),  # TinyLlama 1.1B (grouped-query attention): 1.1 B
    "llama-7b": _llama(32, 4096, 32, 11008),  # Llama 2 7B: 6.7 B
    "llama-13b": _llama(40, 5120, 40, 13824),  # Llama 2 13B: 13 B
    "llama-70b": _llama(80, 8192, 64, 28672, n_kv_head=8),  # Llama 2 70B (grouped-query attention): 69 B
    "llama3-8b": _llama(32, 4096, 32, 14336, n_kv_head=8, vocab_size=128256, block_size=8192),  # Llama 3 8B: 8.0 B
}


@dataclass(frozen=True)
class ModelSpec:
    """A model to plan: build(n_layer or None, rows, seq_len) returns (model, batch) with model(*batch) -> (_, loss)."""

    name: str  # shown in the table
    build: Callable  # (n_layer, rows, seq_len) -> (nn.Module, tuple of tensors with `rows` rows)
    n_layer: int | None  # identical blocks: their number (depth="fast": small runs, _fast); None: always full depth
    key: str | None  # names the model in the memo of fake runs (estimate.remembered; None: not remembered)
    max_seq_len: int | None = None  # longest sequence the model takes (a learned position table), None: any
    checkpointing: tuple = CHECKPOINTING  # the choices it takes (a transformers model: none, full)
    batch: Callable | None = None  # (rows, seq_len) -> the batch alone, no model built (None: build's batch)
    plain: "ModelSpec | None" = None  # the same parameters behind the plainest forward (a GPT's manual attention, no
    #                                   dropout, logits in the compute dtype): _rise measures Adam's update on it; None:
    #                                   this spec. (A spec replace()d with another build must set it again.)


def gpt_spec(cfg: GPTConfig, name: str = "GPTConfig") -> ModelSpec:
    """Return the spec of a labkit GPT."""
    def build(n_layer, rows, seq_len):
        c = replace(cfg, n_layer=cfg.n_layer if n_layer is None else n_layer)
        if c.pos == "rope":
            c = replace(c, block_size=seq_len)  # rotary positions: no table, any length
        return build_model(c), example_batch(c, rows, seq_len)
    plain = replace(cfg, attn=ATTENTION[0], dropout=0.0, logits_fp32=False)  # (none of the three makes a parameter)
    return ModelSpec(name, build, cfg.n_layer, repr(cfg), cfg.block_size if cfg.pos == "learned" else None,
                     batch=lambda rows, seq_len: example_batch(cfg, rows, seq_len),
                     plain=None if plain == cfg else gpt_spec(plain, name))


def callable_spec(fn: Callable, name: str = "model") -> ModelSpec:
    """Return the spec of fn(rows, seq_len) -> (nn.Module, batch): any model, run at full depth."""
    return ModelSpec(name, lambda n_layer, rows, seq_len: fn(rows, seq_len), None, None, checkpointing=("none",))


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
        c = config
        if n_layer is not None:
            c = config.__class__.from_dict(config.to_dict())
            c.num_hidden_layers = n_layer
        x = torch.randint(config.vocab_size, (rows, seq_len))
        return _CausalLM(AutoModelForCausalLM.from_config(c)), (x, x.clone())
    return ModelSpec(name, build, config.num_hidden_layers, "transformers:" + config.to_json_string(),
                     checkpointing=("none", "full"))  # its gradient checkpointing: every layer, the last too


def model_spec(model) -> ModelSpec:
    """Return the spec of a preset name, a GPTConfig, a config.json path, a transformers config or a ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, GPTConfig):  # named by its preset where it is one (its logits upcast or not, its attention)
        name = next((k for k, v in PRESETS.items() if replace(v, attn=model.attn) == replace(model, logits_fp32=False)),
                    None)
        return gpt_spec(model, (name or "GPTConfig") + (", fp32 logits" if model.logits_fp32 else "")
                        + (f", {model.attn} attention" if name and model.attn != PRESETS[name].attn else ""))
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
    parallel: str  # a key of COMM_UNITS; fsdp2-reshard: FSDP2 with reshard_after_forward
    micro_batch: int  # rows per micro-batch (per rank)
    accum_steps: int  # micro-batches per optimizer step
    checkpointing: str  # one of CHECKPOINTING
    precision: str  # "fp32", "bf16" (autocast), "fp16" (autocast + GradScaler), MIXED_POLICY (FSDP2's policy) or
    #                 PURE_BF16 (bf16 everywhere)
    offload: bool = False  # activation offload: every saved tensor but the parameters to the host (OffloadHooks)
    optimizer: str = "device"  # one of OPTIMIZER_PLACES: Adam's state and step on the device, or on the host
    adam_impl: str = "for-loop"  # one of labkit.train.ADAM_IMPLS: for-loop, foreach (CUDA's default) or fused
    keep_logits: bool = True  # the logits held through backward (`logits, loss = model(...)`); False: freed before
    grad_sync: str = "every"  # FSDP2 rows: reduce-scatter after every micro-batch, or the "last" only (GRAD_SYNCS)
    reduce_dtype: str = "fp32"  # MIXED_POLICY rows: the dtype FSDP2 reduce-scatters in (REDUCE_DTYPES)


@dataclass(frozen=True)
class Step:
    """What one device runs in a training step, as a fake step takes it: every knob a plan's fake steps vary.

    A Combination (a plan's row) runs the Step with n_micro = min(accum_steps, 2) (micro-batches beyond the second add
    only their input rows: plan() adds them) and fp16 rows run bf16's Step (plus GradScaler's scalars).
    """

    micro_batch: int  # rows per micro-batch
    n_micro: int = 1  # micro-batches run (1, or 2: the second accumulates into the first's gradients)
    seq_len: int = 1024  # tokens per row
    checkpointing: str = "none"  # one of CHECKPOINTING
    precision: str = "fp32"  # "fp32", "bf16" (autocast over fp32 weights), MIXED_POLICY (FSDP2 only) or PURE_BF16
    offload: bool = False  # activation offload: every saved tensor but the parameters to the host (OffloadHooks)
    shard: tuple | None = None  # (ranks, reshard_after_forward): rank 0 of FSDP2; None: one process
    adam_impl: str = "for-loop"  # one of labkit.train.ADAM_IMPLS: what Adam's update allocates (its "rise")
    keep_logits: bool = True  # the logits held through backward; False: freed before it (torchtitan's `del pred`)
    autocast_of: str = "cuda"  # whose autocast a 16-bit step's dtypes follow: "cuda" (autocast_ops.CudaAutocastOps on
    #                            the fake CPU step: a GPU's plan) or "cpu" (a plan of this CPU, checked against its meter)
    grad_sync: str = "every"  # FSDP2's reduce-scatter after every micro-batch, or the "last" only (GRAD_SYNCS: the
    #                           unsharded gradients accumulate between micro-batches in the reduce dtype)
    reduce_dtype: str = "fp32"  # MIXED_POLICY: MixedPrecisionPolicy's reduce_dtype (REDUCE_DTYPES; bf16: the
    #                             reduce-scatter's buffer a bf16 copy of the gradients, half the fp32 one)


REPLAY_MARGIN = 0.10  # a replayed reserved peak is trusted within this share: the error chapter 09's validation
#   allows it against published runs (published.TARGETS), and the margin a reserved plan's verdict keeps
FITS_BY = {  # a row's verdict, by what it compared (plan(reserved=True) judges every row it can replay by the replay)
    "reserve": "peak ≤ the GPU's memory less the plan's reserve",
    "replay": f"reserved × {1 + REPLAY_MARGIN:g} (the replay's margin) + the CUDA context + NCCL's buffers (the high "
              "end of their range) ≤ the GPU's memory",
    "replayed reserve": f"reserved × {1 + REPLAY_MARGIN:g} ≤ the GPU's memory less the plan's reserve (NCCL's buffers "
                        "not modelled: past one server or between PCIe GPUs)",
    "tensors": "not replayed (off the front): peak + the CUDA context + NCCL's buffers (high end) ≤ the GPU's memory, "
               "needed, not enough: a replay may still refuse it",
}


@dataclass
class Row:
    """A combination's prediction: per-device peak and its split, verdict, roofline step time."""

    combination: Combination
    peak_bytes: int  # per-device peak (fake-tensor step, plus exact arithmetic)
    split: dict  # bytes at the peak by category
    fits: bool  # the verdict, by fits_by's rule (FITS_BY; without reserved: peak_bytes <= the plan's budget_bytes)
    flops: int  # FLOPs per optimizer step per device, recomputation included
    compute_s: float  # roofline on the device: max(FLOPs / peak FLOP/s, bytes accessed / memory bandwidth)
    comm_s: float  # communicated bytes / the ring's bandwidth (device-to-device in a server, the network beyond)
    step_s: float  # compute_s + comm_s + host_s: nothing overlapped (compute alone: the roofline, a lower bound)
    tokens_per_s: float  # global batch tokens / step_s (compute alone: an upper bound)
    bytes_accessed: int = 0  # bytes the step's operators read and write (each once: no fusion), optimizer included
    host_s: float = 0.0  # host link transfers (offload; with Adam on the host its traffic and its step)
    reserved_bytes: int | None = None  # the CUDA caching allocator's reserved peak: the full-depth fake step's
    #   allocations replayed by labkit.planner.allocator (plan(reserved=True): the rows on the front, and those the
    #   replay refused a place on it; None: not computed)
    used_bytes: tuple | None = None  # (low, high) of what the GPU would show used (nvidia-smi): reserved_bytes plus
    #   the CUDA context and NCCL's buffers (labkit.planner.overheads; None: no reserved peak, or past one server)
    fits_by: str = "reserve"  # what `fits` compares: of FITS_BY

    @property
    def overlapped_s(self) -> float:
        """Return the step time with communication wholly hidden behind compute (FSDP2's prefetch, DDP's buckets at
        best): max(compute_s, comm_s) + host_s; step_s, nothing hidden, is the other end of the range."""
        return max(self.compute_s, self.comm_s) + self.host_s


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
    memory_bytes: int = 0  # the device's memory (its profile's)
    rows: list = field(default_factory=list)
    left_out: dict = field(default_factory=dict)  # what -> why
    fake_steps: int = 0  # memory-relevant combinations run on fake tensors (each at FAST_DEPTHS or full depth)
    expandable_segments: bool = False  # the rows' reserved peaks under expandable segments' rules (else the default's)
    elapsed_s: float = 0.0

    @property
    def fastest(self) -> Row | None:
        """Return the fastest row that fits (None: nothing fits)."""
        return next(iter(self.pareto), None)

    @property
    def pareto(self) -> list:
        """Return the fitting rows no other fitting row beats in both peak and step time, fastest first."""
        front = []
        for r in sorted((r for r in self.rows if r.fits), key=lambda r: (r.step_s, r.peak_bytes)):
            if not front or r.peak_bytes < front[-1].peak_bytes:
                front.append(r)
        return front


def plan_step(model, optimizer, batch, step: Step, offload: OffloadHooks | None = None):
    """Run one optimizer step over `batch` in micro-batches of step.micro_batch rows at step.precision, under
    `offload`'s hooks if given (the model is checkpointed and sharded as `step` says already)."""
    precision = "fp32" if step.precision in (MIXED_POLICY, PURE_BF16) else step.precision  # (no autocast: the
    #                                                       policy casts; pure bf16 weights compute in bf16 themselves)
    with offload if offload is not None else contextlib.nullcontext():
        return amp_train_step(model, optimizer, split_batch(batch, step.micro_batch), precision=precision,
                              keep_logits=step.keep_logits, grad_sync=step.grad_sync)


class _AtOptimizer(Exception):
    """Raised where a traced step's optimizer step starts: what follows is _RISE's, the same in every combination."""


def _repeated_blocks(model) -> torch.nn.Module:
    """Return the model's repeated blocks: a labkit model's, or a transformers model's longest ModuleList of layers."""
    try:
        return blocks_of(model)
    except TypeError:
        return max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)


def _block_records(meter, model, opt) -> dict:
    """Return {id of the meter's record: block index} for each block's parameters and their optimizer state."""
    out = {}
    for i, block in enumerate(_repeated_blocks(model)):
        for p in block.parameters():
            for t in (p, *opt.state.get(p, {}).values()):
                for inner in _inner(t) if isinstance(t, torch.Tensor) else ():
                    record = meter._records.get(id(inner.untyped_storage()))
                    if record is not None:
                        out[id(record)] = i
    return out


class _OptimizerBlocks(TorchDispatchMode):
    """Note the block of each tensor the optimizer step allocates (by allocation seq, in `blocks`): the block of the
    parameter (or its gradient or state) it is computed from, output i of a foreach operator from the i-th tensor of
    its first list. The step runs inside the meter's mode, so each operator's outputs are counted when it returns."""

    def __init__(self, meter, positions: dict):
        super().__init__()
        self.meter, self.positions, self.blocks, self._by_seq = meter, positions, {}, None

    def _block(self, t):
        record = self.meter._records.get(id(t.untyped_storage())) if isinstance(t, torch.Tensor) else None
        if record is None:
            return None
        if id(record) in self.positions:
            return self.positions[id(record)]
        where = self._by_seq.get(record.alloc_seq)  # (a gradient: the block whose backward made it)
        return where if isinstance(where, int) else self.blocks.get(record.alloc_seq)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.meter._phase() != "optimizer":
            return out
        if self._by_seq is None:
            self._by_seq = {seq: tag[1] for seq, _, _, _, tag in self.meter._timeline if tag is not None}
        outs = out if isinstance(out, (list, tuple)) else (out,)
        first = args[0] if args and isinstance(args[0], (list, tuple)) and len(args[0]) == len(outs) else None
        shared = None if first is not None else next(
            (b for a in args for t in (a if isinstance(a, (list, tuple)) else (a,)) if (b := self._block(t)) is not None),
            None)
        for i, t in enumerate(outs):
            record = self.meter._records.get(id(t.untyped_storage())) if isinstance(t, torch.Tensor) else None
            block = self._block(first[i]) if first is not None else shared
            if record is not None and block is not None:
                self.blocks.setdefault(record.alloc_seq, block)
        return out


def _tagged_events(meter, positions: dict, optimizer_blocks: dict, n_blocks: int) -> list:
    """Return meter_events' list, each event with its tag (micro-batch, phase, position): the block running
    (_tag_blocks, on the timeline; in the optimizer step the block of what an allocation is computed from,
    optimizer_blocks by seq), or for a tensor the step starts with (tracked, not on the timeline) its block
    (positions, by record) or "model". A free outside the blocks takes a block: its allocation's where it is one of a
    wave of frees of several blocks' tensors (accumulated gradients, gradients zeroed; in the optimizer step of every
    block's: a foreach update's lists), else in the optimizer step the block whose tensors it last allocated (a
    for-loop frees a parameter's temporaries at the next's, one block's the next block's first)."""
    at = {seq: (phase, tag) for seq, _, _, phase, tag in meter._timeline}

    def tag(seq, record):
        if seq not in at:
            return (None, "start", positions.get(id(record), "model"))
        phase, where = at[seq]
        micro, pos = (None, "outside") if where is None else where
        return micro, phase, optimizer_blocks.get(seq, pos)
    events = []
    for r in meter._history:
        if not r.host:
            made = tag(r.alloc_seq, r)
            events.append((r.alloc_seq, id(r), r.nbytes, r.stream, made, None))
            if r.free_seq is not None:
                events.append((r.free_seq, id(r), None, r.stream, tag(r.free_seq, None), made[2]))
    events.sort(key=lambda e: e[0])
    out, current = [], None
    for i, (_, key, nbytes, stream, (micro, phase, pos), made) in enumerate(events):
        if phase == "optimizer" and nbytes is not None:
            current = pos if isinstance(pos, int) else current
        elif nbytes is None and not isinstance(pos, int) and isinstance(made, int) and _in_wave(
                events, i, n_blocks if phase == "optimizer" else 2):
            pos = made
        elif phase == "optimizer" and not isinstance(pos, int) and current is not None:
            pos = current
        out.append((key, nbytes, stream, (micro, phase, pos)))
    return out


def _in_wave(events: list, i: int, n_blocks: int) -> bool:
    """Tell whether free i of `events` (sorted (seq, key, nbytes, stream, tag, its allocation's position)) is among
    consecutive frees with its tag that end tensors of `n_blocks` blocks or more."""
    lo = hi = i
    while lo > 0 and events[lo - 1][2] is None and events[lo - 1][4] == events[i][4]:
        lo -= 1
    while hi + 1 < len(events) and events[hi + 1][2] is None and events[hi + 1][4] == events[i][4]:
        hi += 1
    return len({e[5] for e in events[lo:hi + 1] if isinstance(e[5], int)}) >= n_blocks


def _tag_blocks(meter, model) -> None:
    """Make the meter tag each event (micro-batch, position): "pre", the index of the block that runs, or "post"."""
    blocks = _repeated_blocks(model)
    micro = [-1]

    def tag(pos):
        meter.tag = (micro[0], pos)

    def model_pre(module, args):
        if torch._C._current_graph_task_id() == -1:
            micro[0] += 1
            tag("pre")

    def block_pre(i, module, args):
        if torch._C._current_graph_task_id() == -1:  # (not a checkpoint's recomputation in backward)
            tag(i)
            if i == 0 and args[0].requires_grad:
                args[0].register_hook(lambda grad: tag("pre"))  # backward leaves the blocks

    def block_post(i, module, args, out):
        if torch._C._current_graph_task_id() == -1:
            if out.requires_grad:
                out.register_hook(lambda grad: tag(i))  # backward reaches block i
            if i == len(blocks) - 1:
                tag("post")
    model.register_forward_pre_hook(model_pre)
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(functools.partial(block_pre, i))
        block.register_forward_hook(functools.partial(block_post, i))


def _fake_run(spec: ModelSpec, step: Step, n_layer, trace: bool = False, whole: bool = True,
              reserved: bool | str = False):
    """Run `step` with `n_layer` blocks on fake tensors (estimate.fake_step); return peak, split, states, n, work per
    micro-batch (remembered by model, depth and step when the model has a key).

    trace: a sixth item, the events tagged by block; whole=False: stop where the optimizer step starts; reserved:
    states["peak_reserved"] and states["peak_allocated"], the CUDA caching allocator's reserved and allocated peaks for
    the step's allocations (labkit.planner.allocator, each stream FSDP2 selects a pool of its own); reserved="tagged":
    states["events"], those allocations tagged by micro-batch, phase and block (labkit.planner.events.deeper's input).
    """
    count = functools.partial(_count_fake_run, spec, step, n_layer, trace, whole, reserved)
    if spec.key is None:
        return count()
    out = remembered(("plan", spec.key, n_layer, step, trace, whole, reserved), count)
    if out[4] is not None:  # (counted in another process: its trace needs no count)
        _FLOPS.setdefault((spec.key, n_layer, step), out[4])
    return out


def _count_fake_run(spec: ModelSpec, step: Step, n_layer, trace: bool, whole: bool, reserved: bool | str = False):
    """Return _fake_run's figures, counted now."""
    flops_key = (spec.key, n_layer, step)
    tagged, trace = reserved == "tagged", trace or reserved == "tagged"  # (tags: _tag_blocks, on the timeline)
    tagging = []  # (tagged) the optimizer step's _OptimizerBlocks, made once the meter tracks the step's tensors
    count = not reserved and (spec.key is None or flops_key not in _FLOPS)  # (a replay's run counts no work: 2x faster)
    rows, n_micro, seq_len, shard = step.micro_batch * step.n_micro, step.n_micro, step.seq_len, step.shard
    at_optimizer, replays = [], []  # (bytes by category at the optimizer step's start, (peak, split)); allocator replays

    def build():
        if shard is None:
            with _built_in(step):
                model, batch = spec.build(n_layer, rows, seq_len)
            _checkpoint(model, step.checkpointing)
        else:
            model = meta_model
            model.to_empty(device="cpu")  # the meta shards become fake cpu ones: FSDP2's meta init
            label_accumulated_gradients(model)  # (grad_sync "last": the unsharded gradients held between micro-batches)
            batch = tuple(torch.empty_like(t, device="cpu") for t in meta_batch)
        opt = make_optimizer("adam", model.parameters(), implementation=step.adam_impl)
        create_optimizer_state(opt)
        counter = direct_dispatch(WorkCounter)()
        hooks = OffloadHooks(model, min_bytes=OFFLOAD_MIN_BYTES) if step.offload else None

        def at_optimizer_step(*_):  # keep what the step holds where its optimizer step starts (its bytes: by formula)
            counter.counting_bytes = False
            meter = active_meter()
            at_optimizer[:] = meter.current_split(), (meter.peak_bytes, meter.peak_split())
            if not whole:
                raise _AtOptimizer
        opt.register_step_pre_hook(at_optimizer_step)

        def attach(meter):
            meter.every_record = meter.every_record or reserved  # (before any allocation: the replay needs them all)
            meter.track(model, opt, *batch)
            if trace:
                _tag_blocks(meter, model)
            if tagged:
                tagging.append(_OptimizerBlocks(meter, _block_records(meter, model, opt)))

        def run():
            with counter if count else contextlib.nullcontext(), contextlib.suppress(_AtOptimizer), \
                    CudaAutocastOps() if step.autocast_of == "cuda" else contextlib.nullcontext(), \
                    cpu_stream_tags(active_meter()) if reserved else contextlib.nullcontext(), \
                    _local_adam() if shard is not None else contextlib.nullcontext(), \
                    tagging[0] if tagged else contextlib.nullcontext():
                plan_step(model, opt, batch, step, hooks)
            if tagged:
                replays.append(_tagged_events(active_meter(), tagging[0].positions, tagging[0].blocks,
                                              len(_repeated_blocks(model))))
            elif reserved:  # (the default rules, then expandable segments')
                events = meter_events(active_meter())
                replays.extend(replay(events, expandable_segments=rules) for rules in (False, True))
            if count:
                w = counter.work()
                half = sum(n for p, n in w.flops.items() if p != "fp32")
                _FLOPS[flops_key] = (w.flops.get("fp32", 0) / n_micro, half / n_micro, w.bytes_accessed / n_micro,
                                     w.host_bytes / n_micro)
        return model, attach, run
    try:
        if shard is None:
            peak, split, states, n, *events = fake_step(build, trace, fast_fake_mode, direct_dispatch(MemoryMeter))
        else:
            with torch.device("meta"), _built_in(step):  # FSDP2 splits every parameter N ways: cheap on meta
                meta_model, meta_batch = spec.build(n_layer, rows, seq_len)  # tensors only
            _checkpoint(meta_model, step.checkpointing)
            with fake_sharded(meta_model, _repeated_blocks(meta_model), *shard, mp_policy=_policy(step)):
                peak, split, states, n, *events = fake_step(build, trace, fast_fake_mode, direct_dispatch(MemoryMeter))
    except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as e:
        raise ParameterError(f"model: {spec.name} cannot run on fake tensors ({type(e).__name__}: {e}); make the "
                             "operation independent of tensor values or pass a callable that builds a model "
                             "without it") from None
    states["at_optimizer"], states["before_optimizer"] = at_optimizer
    if tagged:
        states["events"] = replays[0]
    elif reserved:
        states["peak_reserved"] = replays[0].peak_reserved_bytes
        states["peak_allocated"] = replays[0].peak_allocated_bytes
        states["peak_reserved_expandable"] = replays[1].peak_reserved_bytes
    return (peak, split, states, n, _FLOPS.get(flops_key), *events)


@contextlib.contextmanager
def _local_adam():
    """Run Adam's update on each DTensor's local shard (FSDP2's parameters, gradients and state): what DTensor runs
    for it, the same allocations, without the sharding propagation DTensor does for every foreach operator over
    lists of all the parameters (seconds per fake step at 7B)."""
    from torch.distributed.tensor import DTensor
    from torch.optim import adam
    originals = {name: getattr(adam, name) for name in ("_single_tensor_adam", "_multi_tensor_adam", "_fused_adam")}

    def on_shards(update):
        def run(*lists, **kwargs):
            return update(*([t.to_local() if isinstance(t, DTensor) else t for t in ts] if isinstance(ts, list)
                            else ts for ts in lists), **kwargs)
        return run
    for name, update in originals.items():
        setattr(adam, name, on_shards(update))
    try:
        yield
    finally:
        for name, update in originals.items():
            setattr(adam, name, update)


@contextlib.contextmanager
def _built_in(step: Step):
    """Build a step's model in its weights' dtype: bf16 for PURE_BF16 (torch's default dtype while it is built: a
    fake tensor's dtype cannot be converted in place), else fp32."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if step.precision == PURE_BF16 else torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _policy(step: Step):
    """Return FSDP2's MixedPrecisionPolicy for a MIXED_POLICY step (bf16 gathered parameters, its reduce dtype), else
    None."""
    if step.precision != MIXED_POLICY:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                reduce_dtype=torch.bfloat16 if step.reduce_dtype == "bf16" else torch.float32)


def layer_every(checkpointing: str) -> int:
    """Return k of a layer-level checkpointing choice "layer<k>" (LAYER_LEVEL), else 0."""
    m = LAYER_LEVEL.fullmatch(checkpointing) if isinstance(checkpointing, str) else None
    return int(m.group(1)) if m else 0


def _check_checkpointing(c, spec: ModelSpec) -> None:
    """Raise ParameterError unless `c` is one of the model's checkpointing choices, or "layer<k>" (2 <= k <= its
    blocks) where it has blocks to checkpoint."""
    blocks = "every" in spec.checkpointing  # (a labkit model: its blocks known)
    if blocks and layer_every(c):
        check_int(f"checkpointing {c}: k of layer<k> (every k-th block; 1 is full)", layer_every(c), 2, spec.n_layer)
    elif c not in spec.checkpointing:
        layer = f" or layer<k> (every k-th block, 2 <= k <= {spec.n_layer})" if blocks else ""
        raise ParameterError(f"checkpointing must be one of {spec.checkpointing}{layer}, got {c!r}")


def _checkpoint(model, checkpointing: str) -> None:
    """Checkpoint a labkit model's blocks (checkpoint_blocks) or a transformers model's layers (its own switch)."""
    if checkpointing == "none":
        return
    if isinstance(model, _CausalLM):  # "full", the one choice hf_spec takes
        kwargs = {"use_reentrant": False, "context_fn": recompute_context_fn()}  # (CUDA's dtypes in the recomputation)
        if hasattr(model.model, "activation_checkpointing_enable"):  # transformers 5.x's name
            model.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return
    n = len(blocks_of(model))
    if layer_every(checkpointing):
        checkpoint_blocks(model, segments=n, checkpoint_last=True, every=layer_every(checkpointing))
    elif checkpointing == "sqrt":
        checkpoint_blocks(model, segments=max(1, round(math.sqrt(n))))
    else:
        checkpoint_blocks(model, segments=n, checkpoint_last=checkpointing in ("full", "op"),
                          selective=checkpointing == "selective", op_level=checkpointing == "op")


def _extrapolated(spec: ModelSpec, step: Step, depth: str = "fast", one_size: bool = False):
    """Return (peak, split, param bytes, opt bytes, n, work per micro-batch, host peak, bytes by category where the
    optimizer step starts) of `step` at full depth, exact.

    depth="fast" where _fast says so: arithmetic over small runs (_fit; one_size: the only micro-batch size asked of
    this fit, so its own runs, not a line's), else a full-depth run.
    """
    full = spec.n_layer
    base = replace(step, adam_impl=ADAM_IMPLS[0])  # what every Adam implementation shares: all but the update
    if _fast(spec, step, depth):
        fit_key = (spec.key, replace(base, micro_batch=0))  # one fit serves every micro-batch and implementation
        fits, mb = _FITS.get(fit_key, {}), step.micro_batch
        if fits is not None and mb not in fits and (mb == 1 or one_size or not {1, 2} <= fits.keys()):
            more = _fit(spec, base, (mb,) if mb == 1 or one_size else (1, 2, 3))
            _FITS[fit_key] = None if more is None else {**fits, **more}
        if _FITS[fit_key] is not None:
            rise = _rise(spec, step.shard, step.adam_impl, full, step.precision == PURE_BF16)
            return _at_rows(_FITS[fit_key], step.micro_batch, rise)
    reuse = depth != "full" and full is not None and step != base  # the base step's run, the update's rise added
    peak, split, states, n, work = _fake_run(spec, base if reuse else step, full)
    at_opt = dict(states["at_optimizer"])
    if reuse:
        peak, split = _with_rise(*states["before_optimizer"], at_opt, _rise(spec, step.shard, step.adam_impl, full, step.precision == PURE_BF16))
    return (peak, split, states["parameters"], states["optimizer_state"], n, work,
            _host_optimizer(*states["before_optimizer"], at_opt), at_opt)


def _fast(spec: ModelSpec, step: Step, depth: str) -> bool:
    """Return whether `step` takes _fit's small runs at depth="fast": past FULL_MAX_LAYERS blocks, or wherever its two
    small runs take fewer blocks than one full-depth run (the same figures: exact arithmetic, tests/test_plan.py)."""
    if depth == "full" or spec.n_layer is None or not (step.checkpointing in FAST_DEPTHS
                                                       or layer_every(step.checkpointing)):
        return False
    depths = _fit_depths(spec, step)[0][0]
    if layer_every(step.checkpointing) and depths[1] >= spec.n_layer:
        return False  # (layer<k> with k near the depth: its small runs as deep as the model)
    return spec.n_layer > min(FULL_MAX_LAYERS, sum(depths))


def _with_rise(peak: int, split: dict, at_optimizer: dict, rise: int) -> tuple:
    """Return the step's (peak, split): the peak before its optimizer step, or where the update's temporaries (`rise`
    bytes, counted as activations as the meter counts them) top what the optimizer step starts with."""
    if sum(at_optimizer.values()) + rise > peak:
        return sum(at_optimizer.values()) + rise, {**at_optimizer, "activations": at_optimizer["activations"] + rise}
    return peak, dict(split)


def _rise(spec: ModelSpec, shard, adam_impl: str, n_layer: int, pure: bool = False) -> int:
    """Return the bytes Adam's update (`adam_impl`) adds, at its peak, to what the optimizer step starts with, for
    `n_layer` blocks: a line through two shallow steps (one row, one token), exact.

    for-loop: temporaries of one parameter at a time (the largest's: the same at any depth, one step measures it);
    foreach: a list of temporaries of every parameter (one block's more per block: two steps); fused: none. The
    optimizer's Python code is the same on CUDA and on a CPU: what it allocates here it allocates there. Measured on
    spec.plain where it has one: GPT specs that differ only in attention kind, dropout or logits dtype share one rise.
    """
    spec = spec.plain or spec
    depths = (FAST_DEPTHS["none"] if shard is None else SHARDED_DEPTHS) if spec.n_layer is not None else (None,)
    depths = depths if adam_impl == "foreach" else depths[:1]
    at = []
    for d in depths:
        key = (spec.key, shard, adam_impl, d, pure)
        if key not in _RISE or spec.key is None:
            precision = PURE_BF16 if pure else "fp32"  # (the update's temporaries: its parameters' dtype)
            run = _fake_run(spec, Step(1, 1, 1, shard=shard, adam_impl=adam_impl, precision=precision), d, trace=True)
            start = next((k for k, (phase, _, _) in enumerate(run[5]) if phase == "optimizer"), len(run[5]))
            held = sum(run[2]["at_optimizer"].values())  # (fused: no allocation, no event in the update)
            _RISE[key] = max((sum(v) for _, _, v in run[5][start:]), default=held) - held
        at.append(_RISE[key])
    return at[0] if len(at) == 1 else at[0] + (at[1] - at[0]) * (n_layer - depths[0]) // (depths[1] - depths[0])


def _host_optimizer(peak_before: int, split_before: dict, at_optimizer: dict) -> tuple:
    """Return the device's (peak, split) with the optimizer state and its step in the host tier (ZeRO-Offload style):
    what the step held before its optimizer step, less the state."""
    peak, split = max((peak_before, split_before), (sum(at_optimizer.values()), at_optimizer), key=lambda x: x[0])
    state = split["optimizer_state"]
    return peak - state, {**split, "optimizer_state": 0}


def _keyed(events, n_layer: int, apart: tuple, period: int = 1) -> list:
    """Return [(key, block index or None, bytes by category)]: a traced step's rises, keyed alike at every depth.

    apart: (first, last): the first `first` blocks and (last=True) the last are positions of their own. period: the
    blocks repeat every `period` (layer<k>: k): the index counts groups of that many blocks, the key holds the place in
    the group.
    """
    out, runs, prev, j, before = [], {}, None, 0, 0
    for phase, tag, split in events:
        micro, pos = (None, "start") if tag is None else tag
        if apart[1] and pos == n_layer - 1:
            pos = "last"
        elif isinstance(pos, int) and pos < apart[0]:
            pos = ("first", pos)
        elif isinstance(pos, int):
            pos -= apart[0]
        here = (micro, phase, pos)
        if here != prev:
            runs[here] = runs.get(here, -1) + 1
            prev, j = here, 0
        now, before = before, sum(split)
        if before <= now:
            continue
        block = isinstance(pos, int)
        kind = ("block" if period == 1 else ("block", pos % period)) if block else pos
        out.append(((micro, phase, kind, runs[here], j), pos // period if block else None, split))
        j += 1
    return out


def _line(lo, hi, steps: int) -> tuple:
    """Return lo + (hi - lo) * steps, element by element."""
    return tuple(a + (b - a) * steps for a, b in zip(lo, hi))


def _full_depth_events(small, big, n_layer: int, depths, apart: tuple, period: int = 1) -> list | None:
    """Return the full depth's candidate events [(key, bytes by category)] in time order from runs at `depths`, one
    `period` apart (_fit_depths; None: the runs do not repeat block by block, or every `period` blocks)."""
    d0, d1 = depths
    n0, n1, n = ((d - sum(apart)) // period for d in (d0, d1, n_layer))  # blocks (groups of `period`) keyed as blocks
    if any((d - sum(apart)) % period for d in (d0, d1, n_layer)) or d1 - d0 != period:
        return None
    keyed = _keyed(big, d1, apart, period)
    at0 = {(k, i): v for k, i, v in _keyed(small, d0, apart, period)}
    at1 = {(k, i): v for k, i, v in keyed}
    blocks = {k for k, i in at1 if i is not None}
    if ({k for k, i in at0 if i is None} != {k for k, i in at1 if i is None}
            or blocks != {k for k, i in at0 if i is not None} or len(at0) != len(at1) - len(blocks) * (n1 - n0)
            or any((k, i) not in at1 for k in blocks for i in range(n1)) or n1 < 2):
        return None
    out = []
    for k, i, v in keyed:
        if i is None:
            out.append((k, _line(at0[k, i], v, n - n0)))
            continue
        step = tuple(b - a for a, b in zip(at1[k, 0], at1[k, 1]))  # one block further in
        if any(at[k, b] != tuple(x + s * b for x, s in zip(at[k, 0], step))
               for at, m in ((at0, n0), (at1, n1)) for b in range(m)):
            return None
        first = _line(at0[k, 0], at1[k, 0], n - n0)
        if i == 0:
            out.append((k, first))
        elif i == n1 - 1:
            out.append((k + ("last",), tuple(x + s * (n - 1) for x, s in zip(first, step))))
    return out


def _fit_depths(spec: ModelSpec, step: Step) -> list:
    """Return [(depths, apart, period)], what _fit tries in turn: its two small runs' blocks, which blocks stand apart
    in them ((first, last): the first `first`, and with last=True the last) and every how many blocks the rest repeat.

    Every block alike (period 1): FAST_DEPTHS (FSDP2's: SHARDED_DEPTHS), one block apart, each `apart` keyed on the same
    two runs. layer<k>: the blocks repeat every k (k - 1 kept, one recomputed), so the runs are k blocks apart and hold
    whole groups of k past the blocks standing apart, as the full depth does (the same place in a group for its last).
    """
    aparts = ((0, False), (0, True), (2, True))
    k = layer_every(step.checkpointing)
    if not k:
        depths = FAST_DEPTHS[step.checkpointing] if step.shard is None else SHARDED_DEPTHS
        return [(depths, apart, 1) for apart in aparts]
    out = []
    for first, last in aparts if step.shard is None else aparts[::-1]:  # (FSDP2: its first two blocks stand apart)
        first += (spec.n_layer - first - last) % k  # the fewest blocks apart that leave whole groups of k
        out.append(((first + last + k, first + last + 2 * k), (first, last), k))
    return out


def _fit(spec: ModelSpec, step: Step, micro_batches: tuple):
    """Return {rows: full-depth figures of `step` at micro-batches of that many rows} from traced runs at the depths
    _fit_depths gives (None: inexact).

    micro_batches (1, 2, 3): the line _at_rows draws to any other size; where 1 and 2 rows raise the bytes at other
    events, it goes through 2 and 3, else 3 is not run. One size alone: that size's own runs (two, not six).
    """
    L, rows = spec.n_layer, {}
    for mb in micro_batches:
        if mb == 3 and 1 in rows and [k for k, _ in rows[1][0]] == [k for k, _ in rows[2][0]]:
            break
        at = {}  # depth -> its run (each depth run once, whichever ways of keying its blocks are tried)
        for depths, apart, period in _fit_depths(spec, step):
            if depths[1] > L:
                continue  # (layer<k> past the first way of keying: runs deeper than the model)
            runs = [at[d] if d in at else at.setdefault(d, _fake_run(spec, replace(step, micro_batch=mb), d,
                                                                        trace=True, whole=False)) for d in depths]
            if (events := _full_depth_events(runs[0][5], runs[1][5], L, depths, apart, period)) is not None:
                break
        else:
            return None
        at_opt = [tuple(r[2]["at_optimizer"][c] for c in CATEGORIES) for r in runs]
        groups = (L - depths[0]) // period  # groups of `period` blocks past the small run's
        rows[mb] = (events, _line(*at_opt, groups), _line(runs[0][4], runs[1][4], groups),
                    _line((runs[0][3],), (runs[1][3],), groups)[0])
    if 3 in rows and 2 in rows and [k for k, _ in rows[2][0]] != [k for k, _ in rows[3][0]]:
        return None
    return rows


def _at_rows(rows: dict, micro_batch: int, rise: int):
    """Return _extrapolated's tuple at `micro_batch` rows from _fit's figures (its own, else a line in the rows), the
    optimizer's update adding `rise` bytes (_rise)."""
    if micro_batch in rows:
        one, two, steps = rows[micro_batch], rows[micro_batch], 0
    elif 3 in rows:
        one, two, steps = rows[2], rows[3], micro_batch - 2
    else:
        one, two, steps = rows[1], rows[2], micro_batch - 1
    split = max((_line(a, b, steps) for (_, a), (_, b) in zip(one[0], two[0])), key=sum)
    peak = sum(split)
    at_opt = _line(one[1], two[1], steps)
    at_split = dict(zip(CATEGORIES, at_opt))
    host = _host_optimizer(peak, dict(zip(CATEGORIES, split)), at_split)
    peak, split = _with_rise(peak, dict(zip(CATEGORIES, split)), at_split, rise)
    work = _line(one[2], two[2], steps)  # (fp32 FLOPs, 16-bit FLOPs, bytes accessed, host bytes) per micro-batch
    return peak, split, at_opt[0], at_opt[2], one[3], work, host, at_split


def _divisors(n: int, top: int) -> list:
    """Return the powers of two up to `top` that divide n, and top."""
    return sorted({d for d in (2**k for k in range(top.bit_length())) if n % d == 0} | {top})


@dataclass
class _Asked:
    """A plan's arguments, checked and made tuples (plan's docstring says what each is), and what follows from them."""

    spec: ModelSpec
    device: DeviceProfile
    gpus: int
    seq_len: int
    batch: int
    precisions: tuple
    checkpointing: tuple
    offload: tuple
    optimizers: tuple
    adam_impls: tuple
    keep_logits: bool
    parallels: tuple
    micro_batches: list | None
    rate: dict  # precision -> the compute rate it runs at (a key of the device's flops_per_s)
    autocast_of: str  # "cuda": a GPU's 16-bit steps take CUDA autocast's dtypes; "cpu": this CPU's own
    deep: bool = False  # past FULL_MAX_LAYERS at the fast depth: what only full depth gives is left out
    grad_syncs: tuple = ("every",)  # FSDP2 rows with micro-batches: of GRAD_SYNCS, a row each
    reduce_dtypes: tuple = ("fp32",)  # MIXED_POLICY rows: of REDUCE_DTYPES, a row each
    autocast_sharded: bool = True  # FSDP2 rows run autocast's 16 bits too (False: by default, where MIXED_POLICY is
    #                                their 16-bit row, as torchtitan's)


def plan(model, gpu: str | DeviceProfile = "a100-80gb", gpus: int = 1, seq_len: int = 1024, batch: int = 8,
         precisions=None, checkpointing=None, reserve_fraction: float = RESERVE_FRACTION, depth: str = "fast",
         offload=(False, True), optimizers=OPTIMIZER_PLACES, workers: int | None = None,
         adam_impls=None, keep_logits: bool | None = None, parallels=tuple(COMM_UNITS),
         micro_batches=None, reserved: bool = False, expandable_segments: bool = False,
         grad_syncs=("every",), reduce_dtypes=("fp32",)) -> Plan:
    """Return the plan of every combination: per-device peak on fake tensors, verdict, roofline time, tokens/s.

    precisions: of PLAN_PRECISIONS (None: the GPU's of PRECISIONS, FSDP2's 16-bit rows MIXED_POLICY instead of autocast
    where it has bf16, torchtitan's default); offload: activation offload off (False) and/or on (True); optimizers:
    Adam's state on the "device" and/or the "host" (its step too; one device); workers: processes the fake steps run in
    (None: plan_workers()); adam_impls: Adam's implementations (labkit.train.ADAM_IMPLS), each a row of its own on the
    device (they differ only in what the update allocates: no fake step more, two small ones for foreach; None: on a GPU
    GPU_ADAM_IMPL, torchtitan's, on the CPU the chapters' for-loop); keep_logits:
    False frees the logits before backward in every row (torchtitan's step) instead of holding them (the chapters'; None:
    as the model's loop does, torchtitans_loop: a Llama preset named on a GPU frees its fp32 logits, the rest hold them);
    parallels: the ways of running on the GPUs to plan (keys of COMM_UNITS; the others' fake steps are not run);
    micro_batches: the rows per micro-batch to plan (None: every one dividing a GPU's share of the batch); reserved:
    each Pareto-front row's `reserved_bytes`, from its allocations at full depth (_replay; single-device and FSDP2 rows with
    Adam on the device and at most two micro-batches: there the fake step allocates all the row does), and its verdict
    from it: the replayed reserve with REPLAY_MARGIN, plus the CUDA context and NCCL's buffers, within the GPU's
    memory (FITS_BY; a row that does not fit leaves the front and the rows that join it are replayed in turn);
    expandable_segments: that reserved peak under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True's rules (torchtitan's
    launcher sets it), else the allocator's default rules; grad_syncs: FSDP2 rows of two or more micro-batches
    reduce-scatter their gradients after "every" one (FSDP2's default) and/or the "last" only, a row each
    (set_requires_gradient_sync(False) before the others: the unsharded gradients held between micro-batches in the
    reduce dtype, fewer bytes sent); reduce_dtypes: the dtypes MIXED_POLICY rows reduce-scatter in, a row each
    (REDUCE_DTYPES: fp32, torchtitan's default, and/or bf16).
    """
    if keep_logits is None:
        keep_logits = not torchtitans_loop(model, gpu)
    as_run = _as_gpu_runs_it(model, gpu)  # (what the fake steps run, here and in a worker process, which rebuilds it)
    ask = _asked(model_spec(as_run), gpu, gpus, seq_len, batch, precisions, checkpointing,
                 reserve_fraction, depth, offload, optimizers, adam_impls, keep_logits, parallels, micro_batches,
                 grad_syncs, reduce_dtypes)
    spec, workers = ask.spec, plan_workers() if workers is None else workers
    if expandable_segments and not reserved:
        raise ParameterError("expandable_segments: the rules of a reserved peak; pass reserved=True too")
    if reserved and ask.device.name == "cpu":
        raise ParameterError("reserved: the CUDA caching allocator's reserved peak, a GPU's; this plan's device is the "
                             "CPU (gpu='cpu'): plan a GPU of labkit.gpus.GPUS, or leave reserved off")
    left_out = _left_out(ask)
    t0 = time.perf_counter()
    out = Plan(spec.name, ask.device.name, gpus, seq_len, batch, 0,
               int(ask.device.memory_bytes * (1 - reserve_fraction)), reserve_fraction, ask.device.memory_bytes,
               left_out=left_out, expandable_segments=expandable_segments)
    ranks_list = _divisors(batch, gpus)
    flat_ranks = [r for r in ranks_list  # one process per rank, unsharded: one GPU, DDP, ZeRO-1
                  if ("single" if r == 1 else "ddp") in ask.parallels or r > 1 and "zero1" in ask.parallels]
    row_bytes = _row_bytes(spec, seq_len)
    todo = _steps_needed(ask, ranks_list, flat_ranks)
    # sqrt(n) segments round to one at n <= 2 blocks: that segment is the last, kept whole (checkpoint_blocks), so the
    # step is the one without checkpointing, operation for operation: its fake step serves both
    same = {st: replace(st, checkpointing="none") for st in todo
            if st.checkpointing == "sqrt" and spec.n_layer is not None and round(math.sqrt(spec.n_layer)) <= 1}
    if not todo and micro_batches is not None:
        raise ParameterError(f"micro_batches: none of {ask.micro_batches} divides a GPU's share of the batch "
                             f"({', '.join(str(batch // r) for r in ranks_list)} rows on "
                             f"{', '.join(map(str, ranks_list))} GPUs)")
    if not todo:
        raise ParameterError(f"parallels: none of {ask.parallels} runs on {gpus} GPU(s) of this model here "
                             f"({', '.join(left_out) or 'nothing left out'})")
    run = list(dict.fromkeys(same.get(st, st) for st in todo))
    fake = _fake_steps(as_run, spec, run, depth, workers)
    fake = {st: fake[same.get(st, st)] for st in todo}
    out.fake_steps = len({replace(st, adam_impl=ADAM_IMPLS[0]) for st in run})  # (Adam's implementations: one)
    if "foreach" in ask.adam_impls and gpus > 1:
        left_out["zero1 with foreach Adam"] = ("ZeroRedundancyOptimizer's update lists 1/N of the parameters, not "
                                               "the whole list a foreach update allocates here: not modelled")
    replayable = _add_rows(out, ask, fake, flat_ranks, row_bytes)
    if reserved:
        _judged_by_replay(out, ask, as_run, replayable, workers, expandable_segments)
    out.elapsed_s = time.perf_counter() - t0
    return out


def torchtitans_loop(model, gpu) -> bool:
    """Tell whether a plan of `model` on `gpu` runs torchtitan's training loop by default: a Llama preset (rotary
    positions) named on a GPU, whose loss upcasts the logits to fp32 and whose step frees them before backward (`del
    pred`). A GPT-2 preset runs nanoGPT's (`logits, loss = model(x, y)`: held, in the compute dtype), as a config does."""
    name = gpu.name if isinstance(gpu, DeviceProfile) else gpu
    return name != "cpu" and isinstance(model, str) and model in PRESETS and PRESETS[model].pos == "rope"


def _as_gpu_runs_it(model, gpu):
    """Return `model` as the device planned runs it: on a GPU a labkit GPT's attn="sdpa" is the kernel SDPA picks there
    ("flash": flash in 16 bits, memory-efficient in fp32, labkit.models._cuda_attention; "efficient" before Ampere,
    where flash does not run: the profiles without bf16, the T4), not this CPU's flash kernel, which torchtitan's
    op-level save list does not name; a Llama preset's logits upcast to fp32 (torchtitans_loop)."""
    name = gpu.name if isinstance(gpu, DeviceProfile) else gpu
    profile = gpu if isinstance(gpu, DeviceProfile) else GPUS.get(gpu)  # (None: "cuda", the device a check runs on)
    cfg = PRESETS.get(model) if isinstance(model, str) else model
    if torchtitans_loop(model, gpu):
        cfg = model = replace(cfg, logits_fp32=True)
    flash = profile is None or profile.half == "bf16"  # (flash runs from Ampere on: the profiles with bf16)
    if name != "cpu" and isinstance(cfg, GPTConfig) and cfg.attn == "flash" and not flash:
        raise ParameterError(f"attention: CUDA's flash kernel runs on Ampere GPUs and newer (sm80), not the "
                             f"{name}; SDPA runs its memory-efficient kernel there: 'efficient' (or 'sdpa')")
    if name != "cpu" and isinstance(cfg, GPTConfig) and cfg.attn == "sdpa":
        return replace(cfg, attn="flash" if flash else "efficient")
    return model


def _asked(spec: ModelSpec, gpu, gpus, seq_len, batch, precisions, checkpointing, reserve_fraction, depth, offload,
           optimizers, adam_impls, keep_logits, parallels, micro_batches, grad_syncs=("every",),
           reduce_dtypes=("fp32",)) -> _Asked:
    """Return plan()'s arguments checked (a ParameterError names a bad one and its choices, before any work)."""
    device = gpu if isinstance(gpu, DeviceProfile) else device_profile(gpu)
    check_int("gpus", gpus, 1, 1 if device.name == "cpu" else 4096)
    parallels = tuple(parallels)
    if not parallels:
        raise ParameterError(f"parallels: give one or more of {tuple(COMM_UNITS)}")
    for q in parallels:
        check_choice("parallels", q, tuple(COMM_UNITS))
    sharded = gpus > 1 and spec.n_layer is not None and any(q.startswith("fsdp2") for q in parallels)
    autocast_sharded = precisions is not None or "bf16" not in device.flops_per_s or not sharded  # (no FSDP2 row:
    #                                                       nothing for its policy; a CPU plans one device only)
    if precisions is None:  # the GPU's formats; FSDP2's 16 bits: its MixedPrecisionPolicy where the GPU has bf16
        precisions = tuple(p for p in PRECISIONS if p in device.flops_per_s) + (MIXED_POLICY,) * (not autocast_sharded)
    precisions = tuple(precisions)
    rate = {p: "bf16" if p in (MIXED_POLICY, PURE_BF16) else p for p in precisions}  # each precision's compute rate
    check_int("seq_len", seq_len, 1, spec.max_seq_len)
    check_int("batch", batch, 1)
    check_divides("batch", batch, "gpus", gpus)
    check_float("reserve_fraction", reserve_fraction, 0.0, 1.0, hi_open=True)
    for p in precisions:
        check_choice("precision", p, PLAN_PRECISIONS)
        if rate[p] not in device.flops_per_s:
            raise ParameterError(f"precision {p!r}: the {device.name} has no {rate[p]} compute "
                                 f"(it has {tuple(device.flops_per_s)})")
    check_choice("depth", depth, DEPTHS)
    offload, optimizers = tuple(offload), tuple(optimizers)
    for o in offload:
        check_choice("offload", o, (False, True))
    for o in optimizers:
        check_choice("optimizers", o, OPTIMIZER_PLACES)
    adam_impls = (("for-loop",) if device.name == "cpu" else (GPU_ADAM_IMPL,)) if adam_impls is None else \
        tuple(adam_impls)
    if not adam_impls:
        raise ParameterError(f"adam_impls: give one or more of {ADAM_IMPLS}")
    for a in adam_impls:
        check_choice("adam_impls", a, ADAM_IMPLS)
    check_choice("keep_logits", keep_logits, (True, False))
    grad_syncs, reduce_dtypes = tuple(grad_syncs), tuple(reduce_dtypes)
    for name, given, choices in (("grad_syncs", grad_syncs, GRAD_SYNCS), ("reduce_dtypes", reduce_dtypes, REDUCE_DTYPES)):
        if not given:
            raise ParameterError(f"{name}: give one or more of {choices}")
        for g in given:
            check_choice(name, g, choices)
    if micro_batches is not None:
        micro_batches = check_int_list("micro_batches", list(micro_batches), 1, batch)
    if checkpointing is None:  # a transformers model's "full" is its one way to checkpoint: planned by default
        defaults = PLAN_CHECKPOINTING if device.name == "cpu" else GPU_CHECKPOINTING
        checkpointing = tuple(c for c in spec.checkpointing if c in defaults or "every" not in spec.checkpointing)
    for c in checkpointing:
        _check_checkpointing(c, spec)
    return _Asked(spec, device, gpus, seq_len, batch, precisions, tuple(checkpointing), offload, optimizers,
                  adam_impls, keep_logits, parallels, micro_batches, rate,
                  "cpu" if device.name == "cpu" else "cuda",
                  depth != "full" and spec.n_layer is not None and spec.n_layer > FULL_MAX_LAYERS, grad_syncs,
                  reduce_dtypes, autocast_sharded)


def _left_out(ask: _Asked) -> dict:
    """Return what the plan leaves out and why (NOT_MODELLED and what this model and depth rule out); sqrt(n) is
    taken out of `ask.checkpointing` where only a full-depth step gives it."""
    spec = ask.spec
    left_out = dict(NOT_MODELLED)
    if spec.checkpointing != CHECKPOINTING:
        left_out["checkpointing " + " and ".join(c for c in CHECKPOINTING if c not in spec.checkpointing)] = (
            "a transformers model checkpoints every layer (its own switch) and nothing finer" if
            "full" in spec.checkpointing else "a callable model has no blocks known to checkpoint")
    if spec.n_layer is None:
        left_out["fsdp2 of a callable model"] = "no repeated blocks known to shard one by one"
    if ask.deep and "sqrt" in ask.checkpointing:
        ask.checkpointing = tuple(c for c in ask.checkpointing if c != "sqrt")
        left_out["checkpointing sqrt"] = (f"{spec.n_layer} blocks: sqrt(n) segments change with depth, so only a "
                                          "full-depth fake step is exact (--depth full)")
    if ask.deep and ask.gpus > 2:
        left_out["fsdp2 below the largest rank count"] = (f"{spec.n_layer} blocks: FSDP2 is planned on {ask.gpus} "
                                                           "ranks only (--depth full plans every rank count)")
    if MIXED_POLICY in ask.precisions:
        left_out[f"{MIXED_POLICY} without fsdp2"] = ("MixedPrecisionPolicy is FSDP2's: one device, DDP and ZeRO-1 "
                                                     "rows run autocast (bf16)")
    if not ask.autocast_sharded:
        left_out["autocast (bf16) with fsdp2"] = (f"FSDP2's 16-bit rows are its MixedPrecisionPolicy ({MIXED_POLICY}, "
                                                  "torchtitan's default); --precision fp32 bf16 bf16-mp plans autocast "
                                                  "over fp32 shards too")
    return left_out


def _row_bytes(spec: ModelSpec, seq_len: int) -> int:
    """Return the bytes of one batch row's input tensors."""
    with torch.device("meta"):  # (without a model where the spec can: initialising meta weights imports
        #                          torch._dynamo, 2 s of `make plan` whose fake steps run in workers)
        row = spec.batch(1, seq_len) if spec.batch else spec.build(1 if spec.n_layer else None, 1, seq_len)[1]
        return sum(t.numel() * t.element_size() for t in row)


def _steps_needed(ask: _Asked, ranks_list: list, flat_ranks: list) -> dict:
    """Return every Step the plan's rows need (a dict used as an ordered set): each a fake step, once."""
    spec, batch = ask.spec, ask.batch
    fake_precisions = sorted({"bf16" if p == "fp16" else p for p in ask.precisions} - {MIXED_POLICY})  # (PURE_BF16
    #                                                                      too: a fake step of its own, sharded or not)
    shards = [None] * bool(flat_ranks) + [
        (r, reshard) for r in ranks_list if r > 1 and spec.n_layer is not None and (not ask.deep or r == ask.gpus)
        for reshard in (False, True) if ("fsdp2-reshard" if reshard else "fsdp2") in ask.parallels]
    todo = {}
    for shard in shards:
        precisions = [p for p in fake_precisions if shard is None or ask.autocast_sharded or p != "bf16"]
        precisions += [MIXED_POLICY] * (shard is not None and MIXED_POLICY in ask.precisions)
        for rows in [batch // r for r in flat_ranks] if shard is None else [batch // shard[0]]:
            todo.update(dict.fromkeys(Step(mb, min(rows // mb, 2), ask.seq_len, c, p, o, shard, a, ask.keep_logits,
                                           ask.autocast_of, g, rd)
                                      for mb in _divisors(rows, rows) if ask.micro_batches is None
                                      or mb in ask.micro_batches for c in ask.checkpointing for p in precisions
                                      for o in (ask.offload if shard is None and c == "none" else (False,))
                                      for a in ask.adam_impls
                                      for g in (ask.grad_syncs if shard and rows > mb else ("every",))
                                      for rd in (ask.reduce_dtypes if p == MIXED_POLICY else ("fp32",))))
    return todo


def _add_rows(out: Plan, ask: _Asked, fake: dict, flat_ranks: list, row_bytes: int) -> dict:
    """Add to `out` the rows each fake step gives (every precision, rank count, parallel and optimizer place it
    serves); return {id(row): its Step} for the rows whose fake step is all the row allocates (no DDP buckets, no
    micro-batches beyond the two run, Adam on the device): those a reserved plan can replay."""
    replayable = {}
    for st, (peak, split, param_bytes, opt_bytes, n, work, host, _) in fake.items():
        shard, mb, n_micro, c, p, o = st.shard, st.micro_batch, st.n_micro, st.checkpointing, st.precision, st.offload
        out.n_params = n
        for prec in [q for q in ask.precisions if q == p or (q, p) == ("fp16", "bf16")]:
            for ranks in flat_ranks if shard is None else [shard[0]]:
                rows = ask.batch // ranks
                if rows % mb or min(rows // mb, 2) != n_micro:
                    continue
                # held too: the rows beyond the n_micro micro-batches run; fp16: GradScaler's scalars
                extra = (rows - mb * n_micro) * row_bytes + (GRADSCALER_BYTES if prec == "fp16" else 0)
                kinds = [q for q in (("fsdp2-reshard" if shard[1] else "fsdp2",) if shard else ("single",)
                                     if ranks == 1 else ("ddp", "zero1")) if q in ask.parallels]
                variants = [(parallel, "device", (peak, split)) for parallel in kinds if "device" in ask.optimizers
                            and not (parallel == "zero1" and st.adam_impl == "foreach")]
                if ranks == 1 and "host" in ask.optimizers and st.adam_impl == ask.adam_impls[0] and kinds:  # (the
                    variants.append(("single", "host", host))  # update on the host: one row, whatever the device's Adam)
                for parallel, where, (at_peak, at_split) in variants:
                    buckets = param_bytes if parallel in ("ddp", "zero1") else 0  # DDP's gradient buckets
                    dropped = opt_bytes - opt_bytes // ranks if parallel == "zero1" else 0  # ZeRO-1 keeps 1/N of Adam
                    rank_split = {**at_split, "activations": at_split["activations"] + extra + buckets,
                                  "optimizer_state": at_split["optimizer_state"] - dropped}
                    comb = Combination(ranks, parallel, mb, rows // mb, c, prec, o, where, st.adam_impl,
                                       ask.keep_logits, st.grad_sync, st.reduce_dtype)
                    whole = (2 if prec == PURE_BF16 else 4) * n if shard else param_bytes  # one whole copy's bytes
                    out.rows.append(_row(out, ask.device, ask.rate[prec], comb, at_peak + extra + buckets - dropped,
                                         rank_split, work, param_bytes, opt_bytes - dropped, whole))
                    if rows == mb * n_micro and not buckets and where == "device":  # the fake step: the row's step
                        replayable[id(out.rows[-1])] = st  # (fp16: bf16's, GradScaler's 16 bytes not replayed)
    return replayable


def _judged_by_replay(out: Plan, ask: _Asked, model, replayable: dict, workers: int, expandable: bool) -> None:
    """Judge every row that can be replayed by its replay instead of the plan's flat reserve (FITS_BY): the front's
    rows are replayed; one that does not fit leaves it, and the rows that then join it are replayed, until every row of
    the front was replayed or cannot be (those keep the reserve). A row not replayed keeps a necessary condition.

    A row refused here might still run on the GPU: near its memory the allocator releases its cache and retries
    (slower); the replay, not capped, does not follow that (a replay capped at the GPU's memory would: not done).
    """
    outside, replays = {}, {}  # (replays: each step once, whatever the model's key)
    for r in out.rows:
        if id(r) in replayable:
            outside[id(r)] = o = non_tensor_bytes(ask.device.name, r.combination.ranks, r.combination.parallel,
                                                  ask.device.gpus_per_node)
            if o is not None:  # a candidate while its tensors leave room for what they do not show
                r.fits, r.fits_by = r.peak_bytes + o.total[1] <= out.memory_bytes, "tensors"
    while front := [r for r in out.pareto if id(r) in replayable and r.reserved_bytes is None]:
        todo = [st for st in dict.fromkeys(replayable[id(r)] for r in front) if st not in replays]
        replays.update(_fake_steps(model, ask.spec, todo, REPLAY, workers) if todo else {})
        for r in front:
            r.reserved_bytes = replays[replayable[id(r)]][3 if expandable else 1]
            with_margin, o = math.ceil(r.reserved_bytes * (1 + REPLAY_MARGIN)), outside[id(r)]
            if o is None:
                r.fits, r.fits_by = with_margin <= out.budget_bytes, "replayed reserve"
            else:
                r.used_bytes = tuple(r.reserved_bytes + b for b in o.total)
                r.fits, r.fits_by = with_margin + o.total[1] <= out.memory_bytes, "replay"


def combination_fake_step(comb: Combination, seq_len: int, autocast_of: str = "cuda") -> Step:
    """Return the Step a plan runs on fake tensors for a row's combination (fp16: bf16's; at most two micro-batches)."""
    shard = (comb.ranks, comb.parallel == "fsdp2-reshard") if comb.parallel.startswith("fsdp2") else None
    return Step(comb.micro_batch, min(comb.accum_steps, 2), seq_len, comb.checkpointing,
                "bf16" if comb.precision == "fp16" else comb.precision, comb.offload, shard, comb.adam_impl,
                comb.keep_logits, autocast_of, comb.grad_sync, comb.reduce_dtype)


def replayed(runs: list, workers: int | None = None) -> list:
    """Return [(peak bytes, reserved peak bytes, allocated peak bytes, reserved peak bytes with expandable segments)],
    one per run (model, Combination, seq_len): its step's allocations at full depth (_replay). The peak is the reference a
    plan's fast depth reproduces by arithmetic (the bytes requested); the reserved and allocated peaks are its
    allocations replayed through the CUDA caching allocator's rules (labkit.planner.allocator: allocated counts each
    block handed out, rounded). Every run's step shared among `workers` processes (None: plan_workers()), whatever its
    model, run as a GPU plan runs it (_as_gpu_runs_it: "sdpa" as CUDA's kernel, a Llama preset's name in torchtitan's
    loop). Exact for a single device or FSDP2 with Adam on the device and at most two micro-batches (else
    ParameterError: the row holds more than its fake step allocates)."""
    for _, comb, _ in runs:
        if comb.parallel in ("ddp", "zero1") or comb.optimizer != "device" or comb.accum_steps > 2:
            raise ParameterError(f"combination: {comb.parallel}, Adam on the {comb.optimizer}, {comb.accum_steps} "
                                 "micro-batches: its row holds more than its fake step allocates (DDP's buckets, Adam "
                                 "on the host, micro-batches beyond two); replayed takes single or fsdp2 rows only")
    runs = [(_as_gpu_runs_it(model, "cuda"), comb, seq_len) for model, comb, seq_len in runs]  # (as a GPU plan runs it)
    jobs = {}  # the model's repr -> (model, its ModelSpec, its steps)
    for model, comb, seq_len in runs:
        job = jobs.setdefault(repr(model), (model, model_spec(model), []))
        job[2].append(combination_fake_step(comb, seq_len))
    outs = dict(zip(jobs, _fake_steps_of([(m, spec, list(dict.fromkeys(steps))) for m, spec, steps in jobs.values()],
                                         REPLAY, plan_workers() if workers is None else workers)))
    return [outs[repr(model)][combination_fake_step(comb, seq_len)] for model, comb, seq_len in runs]


def _replay(spec: ModelSpec, step: Step) -> tuple:
    """Return (peak, reserved peak, allocated peak, reserved peak with expandable segments) of `step` at full depth,
    its allocations replayed (labkit.planner.allocator): written out from steps at REPLAY_DEPTHS (FSDP2's: at
    SHARDED_DEPTHS) where they take fewer blocks and repeat block by block (labkit.planner.events.deeper, exact), else
    from a full-depth fake step."""
    depths = REPLAY_DEPTHS if step.shard is None else SHARDED_DEPTHS
    if (spec.n_layer is not None and step.checkpointing in FAST_DEPTHS
            and spec.n_layer > min(FULL_MAX_LAYERS, sum(depths))):
        small, big = (_fake_run(spec, step, d, reserved="tagged")[2]["events"] for d in depths)
        events = deeper(small, big, depths, spec.n_layer)
        if events is not None:
            default, grown = (replay(events, expandable_segments=rules) for rules in (False, True))
            return peak_bytes(events), default.peak_reserved_bytes, default.peak_allocated_bytes, grown.peak_reserved_bytes
    peak, _, states, *_ = _fake_run(spec, step, spec.n_layer, reserved=True)
    return peak, states["peak_reserved"], states["peak_allocated"], states["peak_reserved_expandable"]


def deep_estimate(cfg: GPTConfig, batch_size: int, seq_len: int, world_size: int = 1,
                  zero_stage: int | None = None) -> MemoryEstimate:
    """Return what estimate_training_memory(cfg, batch_size, seq_len, world_size, zero_stage) returns, the same bytes,
    from two shallow fake steps and exact arithmetic (the planner's depth="fast"): seconds for a model of 48 blocks.

    fp32 Adam; stage 2 and 3: rank 0 of FSDP2, resharding after forward at stage 3; 0 and 1: the one-process step with
    DDP's buckets (and ZeRO-1's 1/N of Adam's state). `states`: the model states where the optimizer step starts
    (every gradient exists; the step changes no size), and under "other" what else the step holds there (4 bytes
    more than the estimator's after its step: the planner's step keeps its loss sum).
    """
    step = _deep_step(batch_size, seq_len, world_size, zero_stage)
    peak, split, _, _, n, _, _, at_opt = _fake_steps(cfg, gpt_spec(cfg), [step], "fast", 1)[step]
    states = {k: at_opt[k] for k in ("parameters", "gradients", "optimizer_state")}
    states["other"] = at_opt["activations"]
    split = dict(split)
    if world_size > 1 and step.shard is None:
        peak, split, states = data_parallel_rank(peak, split, states, world_size, zero_stage)
    return MemoryEstimate(peak, split, n, batch_size, seq_len, world_size, zero_stage if world_size > 1 else None,
                          states)


def deep_estimates(requests: list, workers: int | None = None) -> list:
    """Return [deep_estimate(*request)] for each request (cfg, batch_size, seq_len, world_size, zero_stage), their
    fake steps shared among `workers` processes (None: plan_workers())."""
    jobs = {}  # the model's repr -> (its GPTConfig, its spec, its steps)
    for cfg, *args in requests:
        jobs.setdefault(repr(cfg), (cfg, gpt_spec(cfg), []))[2].append(_deep_step(*args))  # (each checked first)
    _fake_steps_of([(cfg, spec, list(dict.fromkeys(steps))) for cfg, spec, steps in jobs.values()], "fast",
                   plan_workers() if workers is None else workers)  # (remembered: deep_estimate takes them from there)
    return [deep_estimate(*request) for request in requests]


def _deep_step(batch_size: int, seq_len: int, world_size: int, zero_stage: int | None) -> Step:
    """Return deep_estimate's fake step, its arguments checked."""
    check_int("world_size", world_size, 1)
    if zero_stage is not None:
        check_int("zero_stage", zero_stage, 0, 3)
        if world_size == 1:
            raise ValueError("zero_stage needs world_size > 1: one process has nothing to shard")
    return Step(batch_size, 1, seq_len, shard=(world_size, zero_stage == 3) if zero_stage in (2, 3) else None)


def plan_workers() -> int:
    """Return the processes a plan's fake steps run in: $LABKIT_PLAN_WORKERS (1: in this process), else this
    process's CPUs, at most 4 (make test sets 1: its test processes already fill the cores)."""
    value = os.environ.get(PLAN_WORKERS_ENV, "")
    if value:
        if not value.isdigit() or not 1 <= int(value) <= 64:
            raise ParameterError(f"{PLAN_WORKERS_ENV} must be a whole number from 1 to 64, got {value!r}")
        return int(value)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cpus))


def _groups(spec: ModelSpec, steps: list, depth: str) -> list:
    """Return the steps in groups that share their fake steps (one fit at fast depth, else one step each), the
    costliest first (sharded, then checkpointed), each group's largest micro-batch first (its fit serves them all)."""
    groups = {}
    for step in steps:
        fast = _fast(spec, step, depth)
        base = replace(step, adam_impl=ADAM_IMPLS[0])  # Adam's implementations share the rest of their steps
        groups.setdefault(replace(base, micro_batch=0) if fast else base, []).append(step)
    return sorted((sorted(g, key=lambda st: -st.micro_batch) for g in groups.values()), key=_group_cost, reverse=True)


def _group_cost(group: list) -> tuple:
    """Return a key that orders groups of fake steps by their cost: sharded, then checkpointed, then the most steps."""
    return group[0].shard is not None, group[0].checkpointing != "none", len(group)


def _run_group(spec: ModelSpec, group: list, depth: str) -> list:
    """Return [(step, _extrapolated's figures)] for one group of steps (in this process or a worker's); depth REPLAY:
    [(step, (peak, reserved peak, allocated peak))] (_replay)."""
    one_size = len({step.micro_batch for step in group}) == 1  # (a fast group: its fit takes that size's runs only)
    with one_thread():  # (FSDP2 sharding meta tensors between the fake steps too: a second thread only slows it)
        return [(step, _replay(spec, step) if depth == REPLAY else _extrapolated(spec, step, depth, one_size))
                for step in group]


def _run_claimed(specs, groups: list, depth: str, claims: str, bar=None) -> list:
    """Run the groups [(job, group)] this process claims first, in their order (a file created in the claims folder,
    or not at all: another process has it); return [(job, step, _extrapolated's figures)]. Claiming as they go, the
    processes end within one group of each other whatever each group costs. Each group run leaves "<i>.done" there:
    `bar` (a progress bar) counts every process's. specs(job): the job's ModelSpec."""
    out = []
    for i, (j, g) in enumerate(groups):
        try:
            os.close(os.open(os.path.join(claims, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        out.extend((j, *figures) for figures in _run_group(specs(j), g, depth))
        open(os.path.join(claims, f"{i}.done"), "w").close()
        if bar is not None:
            bar.update(sum(name.endswith(".done") for name in os.listdir(claims)) - bar.n)
    return out


def _worker_main(task_path: str, out_path: str) -> None:
    """Run the plan groups (a pickled ([(model, its ModelSpec's key)], groups, depth, claims folder)) this worker
    claims first (_run_claimed) and pickle their figures to out_path."""
    die_with_parent()
    with open(task_path, "rb") as f:
        models, groups, depth, claims = pickle.load(f)

    specs = [model_spec(model) for model, _ in models]  # each job's model rebuilt here: the one the plan runs, by key
    for spec, (_, key) in zip(specs, models):
        if spec.key != key:
            raise RuntimeError(f"a plan worker rebuilt {spec.key} where the plan runs {key}")
    out = _run_claimed(specs.__getitem__, groups, depth, claims)
    with open(out_path + ".part", "wb") as f:
        pickle.dump(out, f)
    os.replace(out_path + ".part", out_path)


def _started_meanwhile(children: ChildProcesses, starts: list) -> threading.Thread:
    """Return a started thread that starts each (target, args, log path) as a forked child of `children` (with
    PLAN_PRELOAD); its `error` is what stopped it, or None."""
    def start_all():
        try:
            for target, args, log in starts:
                children.start_forked(target, args, stdout_path=log, preload=PLAN_PRELOAD)
        except BaseException as e:  # (raised in the caller's thread, after join)
            thread.error = e
    thread = threading.Thread(target=start_all, daemon=True)
    thread.error = None
    thread.start()
    return thread


def _fake_steps(model, spec: ModelSpec, steps: list, depth: str, workers: int) -> dict:
    """Return {step: _extrapolated's figures} for every step of one model (_fake_steps_of)."""
    return _fake_steps_of([(model, spec, steps)], depth, workers)[0]


def _fake_steps_of(jobs: list, depth: str, workers: int) -> list:
    """Return [{step: _extrapolated's figures}] for every step of each job (model, its ModelSpec, steps): from this
    process's memo, run here, or shared among this process and `workers` - 1 child processes when there are
    MIN_GROUPS_PER_WORKER groups a worker or more (a REPLAY's: one; preset or GPTConfig models; each child dies with
    this process, and leaving stops them)."""
    memos = [{} if spec.key is None else {step: (spec.key, step, depth) for step in steps} for _, spec, steps in jobs]
    outs = [{step: _PLANNED[memo[step]] for step in steps if memo.get(step) in _PLANNED}
            for memo, (_, _, steps) in zip(memos, jobs)]
    groups = sorted(((j, g) for j, (_, spec, steps) in enumerate(jobs)  # the costliest first, whatever the model
                     for g in _groups(spec, [step for step in steps if step not in outs[j]], depth)),
                    key=lambda jg: _group_cost(jg[1]), reverse=True)
    per_worker = 1 if depth == REPLAY else MIN_GROUPS_PER_WORKER
    if workers > 1 and len(groups) >= per_worker * workers and all(isinstance(m, (str, GPTConfig)) for m, *_ in jobs):
        with tempfile.TemporaryDirectory(prefix="labkit-plan-") as tmp, ChildProcesses() as children:
            task, claims, paths = os.path.join(tmp, "task"), os.path.join(tmp, "claims"), []
            os.mkdir(claims)
            with open(task, "wb") as f:  # every group for every worker: each runs those it claims first
                pickle.dump(([(m, spec.key) for m, spec, _ in jobs], groups, depth, claims), f)
            for k in range(workers - 1):  # this process is the last worker
                result, log = os.path.join(tmp, f"result{k}"), os.path.join(tmp, f"log{k}")
                open(log, "w").close()  # (there even if the worker fails before it writes)
                paths.append((result, log))
            # the children start in a thread: a new fork server's imports (~3 s) overlap this process's fake steps
            starting = _started_meanwhile(children, [(_worker_main, (task, result), log) for result, log in paths])
            with progress(desc=f"fake steps ({workers} processes)", total=len(groups)) as bar:
                try:
                    with one_thread():
                        ran = _run_claimed(lambda j: jobs[j][1], groups, depth, claims, bar)
                finally:
                    starting.join()  # (every child started is one ChildProcesses stops on leaving)
                if starting.error is not None:
                    raise starting.error
                codes = children.wait(WORKER_TIMEOUT_S)
                bar.update(sum(name.endswith(".done") for name in os.listdir(claims)) - bar.n)
            for code, (result, log) in zip(codes, paths):
                if code != 0 or not os.path.exists(result):
                    with open(log) as f:
                        tail = f.read()[-2000:]
                    raise RuntimeError(f"a plan worker process ended with exit code {code}:\n{tail}")
                with open(result, "rb") as f:
                    ran.extend(pickle.load(f))
    else:
        ran = [(j, *figures) for j, g in progress(groups, desc="fake steps")
               for figures in _run_group(jobs[j][1], g, depth)]
    for j, step, figures in ran:
        outs[j][step] = figures
    for memo, out in zip(memos, outs):
        for step, key in memo.items():
            _PLANNED[key] = out[step]
    return [{step: out[step] for step in steps} for out, (_, _, steps) in zip(outs, jobs)]  # in the todo's order


def _row(p: Plan, device: DeviceProfile, rate: str, comb: Combination, peak: int, split: dict, work: tuple,
         param_bytes: int, opt_bytes: int, whole_param_bytes: int) -> Row:
    """Return a combination's row: the roofline time on the device plus communication and host transfers, added;
    16-bit FLOPs at the device's `rate` (a key of its flops_per_s).

    work: (fp32 FLOPs, 16-bit FLOPs, bytes accessed, host bytes) per micro-batch; each precision's FLOPs at its own
    rate (autocast leaves the non-matmul ops in fp32). The optimizer step reads the parameters, their gradients and its
    state and writes the parameters and the state: on the device, or on the host.
    """
    fp32_per_micro, half_per_micro, bytes_per_micro, offloaded_per_micro = work
    flops = int((fp32_per_micro + half_per_micro) * comb.accum_steps)
    optimizer_bytes = 3 * param_bytes + 2 * opt_bytes
    on_host = comb.optimizer == "host"
    accessed = int(bytes_per_micro * comb.accum_steps) + (0 if on_host else optimizer_bytes)
    compute_s = max(comb.accum_steps * (fp32_per_micro / device.flops_per_s["fp32"] +
                                        half_per_micro / device.flops_per_s[rate]),
                    accessed / device.memory_bytes_per_s)
    ring = (comb.ranks - 1) / comb.ranks
    passes = COMM_UNITS[comb.parallel] * (comb.accum_steps if comb.parallel.startswith("fsdp2") else 1)
    if comb.grad_sync == "last":  # FSDP2's reduce-scatter once a step, its all-gathers every micro-batch
        passes -= comb.accum_steps - 1
    sent = passes * whole_param_bytes
    if comb.precision == MIXED_POLICY:  # its all-gathers move bf16, half the bytes; its reduce-scatters too in bf16
        reduce_scatters = 1 if comb.grad_sync == "last" else comb.accum_steps
        sent -= (passes - (0 if comb.reduce_dtype == "bf16" else reduce_scatters)) * whole_param_bytes // 2
    comm_s = ring * sent / device.link_bytes_per_s(comb.ranks)
    host_s = offloaded_per_micro * comb.accum_steps / device.host_bytes_per_s
    if on_host:
        host_s += 2 * param_bytes / device.host_bytes_per_s + optimizer_bytes / device.host_memory_bytes_per_s
    step_s = compute_s + comm_s + host_s
    return Row(comb, peak, split, peak <= p.budget_bytes, flops, compute_s, comm_s, step_s,
               p.seq_len * p.batch / step_s, accessed, host_s)


def _grads(c: Combination) -> str:
    """Return an FSDP2 row's gradient sync and reduce dtype as the table's grads column shows them ("last, bf16"), or
    "—" for a row without FSDP2's reduce-scatter."""
    return f"{c.grad_sync}, {c.reduce_dtype}" if c.parallel.startswith("fsdp2") else "—"


def _at_published_share(p: Plan, best: Row | None) -> list:
    """Return the line of the fastest row's time at a published run's achieved share of the GPU's peak (labkit.gpus:
    the estimate chapter 09's section 4 checks against other published runs), or nothing where no share is published."""
    profile = None if best is None or p.device == "cpu" else device_profile(p.device)
    if profile is None or profile.efficiency is None:
        return []
    eff = profile.efficiency
    own_s = best.compute_s / eff.fraction  # the roofline's compute at the achieved share
    none_s, all_s = own_s + best.comm_s + best.host_s, max(own_s, best.comm_s) + best.host_s
    tokens = p.batch * p.seq_len
    return [f"at a published run's share of the {p.device}'s peak ({eff.fraction:.1%}, {eff.source.split(':')[0]}: "
            f"labkit.gpus), the fastest takes {none_s * 1e3:,.0f} ms/step, {tokens / none_s:,.0f} tokens/s"
            + (f" ({tokens / none_s / p.gpus:,.0f} per GPU, the unit torchtitan reports in)" if p.gpus > 1 else "")
            + (f", with its communication hidden {all_s * 1e3:,.0f} ms, {tokens / all_s:,.0f} tokens/s"
               + (f" ({tokens / all_s / p.gpus:,.0f} per GPU)" if p.gpus > 1 else "") if best.comm_s > 0 else "")
            + ": an estimate (chapter 09's section 4 checks it against other published runs, within 25%), where the "
            "roofline above is a bound"]


def _fsdp2_reserve_note(p: Plan) -> list:
    """Return the line that says where FSDP2 rows judged by the plan's reserve alone hold back less than published
    FSDP2 runs' allocators kept beyond their tensors plus the CUDA context and NCCL's buffers at their modelled high
    end (chapter 09's Appendix C adds the same two), or nothing."""
    if not any(r.combination.parallel.startswith("fsdp2") and r.fits_by == "reserve" for r in p.rows):
        return []
    gaps = fsdp2_gaps()
    widest = max((g * GPUS[gpu].memory_bytes for gpu, gs in gaps.items() for g in gs), default=0) / p.memory_bytes
    ranks = max(r.combination.ranks for r in p.rows if r.combination.parallel.startswith("fsdp2"))
    outside = non_tensor_bytes(p.device, ranks, "fsdp2-reshard") if p.device in GPUS else None
    need = widest + (0 if outside is None else outside.total[1] / p.memory_bytes)
    if need <= p.reserve_fraction:  # (the widest gap in bytes, as a share of this plan's GPU)
        return []
    kept = "; ".join(" and ".join(f"{g * GPUS[gpu].memory_bytes / 2**30:.1f} GiB ({g:.1%} of the {gpu} profile's "
                                  f"{GPUS[gpu].memory_bytes / 2**30:.1f} GiB)" for g in gs) for gpu, gs in gaps.items())
    on_top = ("that gap alone; the CUDA context and NCCL's buffers come on top, not modelled for these GPUs"
              if outside is None else f"that gap with the CUDA context and NCCL's buffers, "
              f"{outside.total[1] / 2**30:.2f} GiB at most, labkit.planner.overheads")
    return [f"fits, FSDP2 rows: the plan's {p.reserve_fraction:.0%} reserve is not verified for FSDP2, whose published "
            f"runs kept {kept} reserved by the allocator but not active in tensors (labkit.planner.runs): "
            + (f"on the {p.device}'s {p.memory_bytes / 2**30:.1f} GiB, plan FSDP2 with --reserve "
               f"{math.ceil(need * 100) / 100} or more ({on_top}), or" if need < 1 else
               f"that gap exceeds the {p.device}'s memory: plan FSDP2")
            + " with --reserved to judge the front by its allocator replay"]


def _describe_row(r: Row) -> str:
    """Return a row's combination, its FSDP2 knobs only where FSDP2 runs, and its peak and time in words (format_plan's
    fastest that fits)."""
    c = r.combination
    knobs = ", ".join(f"{k} {v}" for k, v in asdict(c).items()
                      if c.parallel.startswith("fsdp2") or k not in ("grad_sync", "reduce_dtype"))
    return (knobs + f" ({format_bytes(r.peak_bytes)}, "
            + ("" if r.reserved_bytes is None else f"{format_bytes(r.reserved_bytes)} reserved, ")
            + f"{r.step_s * 1e3:,.2f} ms/step, {r.tokens_per_s:,.0f} tokens/s, " + (
                "a roofline bound for eager, unfused PyTorch)" if r.comm_s + r.host_s == 0 else
                "the roofline's bound + " + " + ".join(f"{t * 1e3:,.2f} ms of {what}" for t, what in (
                    (r.comm_s, "communication"), (r.host_s, "host transfers")) if t > 0) + ", not overlapped"
                + (f"; {r.overlapped_s * 1e3:,.2f} ms/step with the communication hidden behind compute, as FSDP2's "
                   "prefetch and DDP's buckets at best hide it)" if r.comm_s > 0 else ")")))


def format_plan(p: Plan, all_rows: bool = False) -> str:
    """Return the plan as a text table: the Pareto front (every row with all_rows) and the fastest that fits."""
    n = p.n_params  # "437,760" below a million, else "124.4 M" or "6.74 B"
    with_grads = any((r.combination.grad_sync, r.combination.reduce_dtype) != ("every", "fp32") for r in p.rows)
    count = f"{n:,}" if n < 10**6 else f"{n / 1e6:.1f} M" if n < 10**9 else f"{n / 1e9:.2f} B"
    head = (f"{p.model} ({count} parameters) on {p.gpus} × {p.device}, seq_len {p.seq_len}, global batch {p.batch}: "
            f"budget {format_bytes(p.budget_bytes)} per device ({p.reserve_fraction:.0%} reserved"
            + ("; rows replayed: judged by their replay" if any(r.fits_by != "reserve" for r in p.rows) else "")
            + "); "
            f"{len(p.rows)} combinations, {p.fake_steps} run on fake tensors, {p.elapsed_s:.1f} s"
            + ("; the logits freed before backward" if any(not r.combination.keep_logits for r in p.rows) else "")
            + ("; grads: FSDP2's reduce-scatter after every micro-batch or the last only "
               "(set_requires_gradient_sync(False) before the others), in its reduce dtype" if with_grads else ""))
    width = max([4, *(len(r.combination.precision) for r in p.rows)])
    with_reserved = any(r.reserved_bytes is not None for r in p.rows)  # (plan(reserved=True): a column of its own)
    with_hidden = any(r.comm_s > 0 for r in p.rows)  # several ranks: the step with the communication hidden too
    cols = (f"{'#':>3} {'ranks':>5} {'parallel':>13} {'micro':>5} {'accum':>5} {'ckpt':>9} {'prec':>{width}} "
            f"{'offl':>4} "
            f"{'opt':>6} {'adam':>8} " + (f"{'grads':>10} " if with_grads else "") + f"{'peak':>10} "
            + (f"{'reserved':>10} " if with_reserved else "") +
            f"{'fits':>4} {'step (ms)':>10} {'comm (ms)':>10} " + (f"{'hidden (ms)':>11} " if with_hidden else "")
            + f"{'host (ms)':>10} {'tokens/s':>10}")
    shown, title = (p.rows, "all combinations:") if all_rows else (
        p.pareto, "Pareto front (memory against predicted step time):")
    if not shown:
        shown, title = sorted(p.rows, key=lambda r: r.peak_bytes)[:5], "nothing fits; the smallest peaks:"
    lines = [head, "", title, cols]
    front = {id(r): i for i, r in enumerate(p.pareto, 1)}  # "#": a row's place on the front (a figure's labels)
    for r in shown:
        c = r.combination
        lines.append(f"{front.get(id(r), ''):>3} {c.ranks:>5} {c.parallel:>13} {c.micro_batch:>5} {c.accum_steps:>5} "
                     f"{c.checkpointing:>9} {c.precision:>{width}} {'on' if c.offload else 'off':>4} {c.optimizer:>6} "
                     f"{c.adam_impl:>8} " + (f"{_grads(c):>10} " if with_grads else "") + f"{format_bytes(r.peak_bytes):>10} "
                     + (f"{'—' if r.reserved_bytes is None else format_bytes(r.reserved_bytes):>10} "
                        if with_reserved else "") + f"{_fits_mark(r):>4} {r.step_s * 1e3:>10,.2f} "
                     f"{r.comm_s * 1e3:>10,.2f} " + (f"{r.overlapped_s * 1e3:>11,.2f} " if with_hidden else "")
                     + f"{r.host_s * 1e3:>10,.2f} {r.tokens_per_s:>10,.0f}")
    best = p.fastest
    lines += ["", "fastest that fits: " + ("none" if best is None else _describe_row(best))]
    lines += _at_published_share(p, best) + _fsdp2_reserve_note(p)
    lines += [
              "#: the row's place on the Pareto front (1: the fastest; blank: not on it, or a tie of a row on it); "
              "peak: per device" + ("; reserved: the caching allocator's reserved peak, the step's allocations "
                                    "replayed from an empty cache through its "
                                    + ("rules with expandable_segments:True (pages mapped" if p.expandable_segments
                                       else "default rules (no expandable_segments") + ": labkit.planner.allocator); "
                                    "—: not on the Pareto front, or the "
                                    "row holds more than its fake step allocates: DDP's buckets, micro-batches beyond "
                                    "two, Adam on the host)" if with_reserved else "")
              + "; step = roofline + comm + host, each in ms per optimizer step; comm: between GPUs "
              "(in a server at its GPU-to-GPU rate, beyond it at its network's per GPU: labkit.gpus)"
              + ("; hidden: the step with comm wholly hidden behind compute, as FSDP2's prefetch and DDP's buckets at "
                 "best hide it (the front and the fastest go by step, nothing hidden)" if with_hidden else ""),
              "host: over the host link, the offloaded activations and, with opt = host, also Adam's gradients, "
              "parameters and update; offl: activation offload; opt: where Adam's state and update live; adam: its "
              "implementation (for-loop, foreach, fused: what its update allocates); tokens/s: the global batch's; "
              "keep_logits: the logits held through backward (False: deleted before it, torchtitan's `del pred`)",
              "left out: " + "; ".join(f"{k} ({v})" for k, v in p.left_out.items())]
    used = [(front[id(r)], r) for r in p.pareto if r.reserved_bytes is not None]
    if used:  # (what the reserve stands for, modelled: the context and NCCL's buffers beside the replayed reserve)
        by_extra = {}  # the same range added to every row of one parallelism and rank count
        for i, r in used:
            extra = None if r.used_bytes is None else (r.used_bytes[0] - r.reserved_bytes,
                                                       r.used_bytes[1] - r.reserved_bytes)
            by_extra.setdefault(extra, []).append(i)
        lines.append("used (what nvidia-smi would show) = reserved + the CUDA context + NCCL's buffers, ranges from "
                     "published figures and an H200 of ours (labkit.planner.overheads: one process group, NCCL 2.22 or "
                     "later with its "
                     "defaults, GPUs of one NVLink server): " + "; ".join(
                         f"row{'s' * (len(rows) > 1)} {', '.join(map(str, rows))}: not modelled (NCCL's buffers "
                         "past one server or between PCIe GPUs)" if extra is None else
                         f"row{'s' * (len(rows) > 1)} {', '.join(map(str, rows))}: + {format_bytes(extra[0])} to "
                         f"{format_bytes(extra[1])}" for extra, rows in by_extra.items())
                     + f"; the profile's memory: {format_bytes(p.memory_bytes)}")
    if any(r.fits_by != "reserve" for r in p.rows):  # (a reserved plan: its verdicts, rule by rule)
        lines.append(_fits_legend(p, shown))
    return "\n".join(lines)


def _fits_legend(p: Plan, shown: list) -> str:
    """Return a reserved plan's legend of its verdicts: each rule in use (FITS_BY), and the rows its replay refused."""
    refused = [r for r in p.rows if r.fits_by in ("replay", "replayed reserve") and not r.fits]
    rules = [f"yes/no with a reserved figure: {FITS_BY['replay']} (where NCCL is not modelled: "
             f"{FITS_BY['replayed reserve'].split(' (')[0]})", f"yes/no with —: {FITS_BY['reserve']}"]
    if any(r.fits_by == "tensors" for r in shown):
        rules.append(f"yes*/no*: {FITS_BY['tensors']}")
    worst = min(refused, key=lambda r: r.step_s) if refused else None
    return "fits: " + "; ".join(rules) + (
        f"; {len(refused)} row{'s' * (len(refused) > 1)} left the front once replayed (the fastest: "
        f"{combination_words(worst.combination)}, {format_bytes(worst.reserved_bytes)} reserved; on the GPU it might still "
        "run, the allocator releasing its cache and retrying near its memory, slower: not modelled)"
        if refused else "; no row left the front once replayed")


def _fits_mark(r: Row) -> str:
    """Return a row's fits column: yes or no (yes* and no*: by FITS_BY["tensors"], not replayed)."""
    return ("yes" if r.fits else "no") + ("*" if r.fits_by == "tensors" else "")


def combination_words(c: Combination) -> str:
    """Return a combination in a few words: ranks, parallel, micro-batch x steps, checkpointing, precision."""
    return f"{c.ranks} × {c.parallel}, micro-batch {c.micro_batch} × {c.accum_steps}, {c.checkpointing}, {c.precision}"


def plan_json(p: Plan) -> dict:
    """Return the plan as JSON-able data."""
    best = p.fastest
    return {**{k: v for k, v in asdict(p).items() if k != "rows"}, "rows": [asdict(r) for r in p.rows],
            "fastest": None if best is None else asdict(best), "pareto": [asdict(r) for r in p.pareto]}


def _arguments() -> argparse.ArgumentParser:
    """Return the command's parser: every knob of plan() with its default stated."""
    ap = argparse.ArgumentParser(prog="python -m labkit.planner", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", help=f"a preset {tuple(PRESETS)} or a transformers config.json (default: gpt2)")
    ap.add_argument("--gpu", default="a100-80gb", help="a GPU of labkit.gpus.GPUS or cpu (measured; default: a100-80gb)")
    ap.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                    help="each GPU's memory in GiB in place of --gpu's profile (what torch reports: "
                         "torch.cuda.get_device_properties(0).total_memory / 2**30), its rates and links kept: what "
                         "another job leaves free, or a variant of it by memory alone (its times are then --gpu's)")
    ap.add_argument("--gpus", type=int, default=1, help="devices (data-parallel ranks at most; default: 1)")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (default: 1024; torchtitan's Llama 3 8B runs 8192)")
    ap.add_argument("--batch", type=int, default=8, help="global batch: samples per optimizer step (default: 8; each GPU takes its share)")
    ap.add_argument("--reserve", type=float, default=RESERVE_FRACTION, help=f"share of device memory held back (default: {RESERVE_FRACTION})")
    ap.add_argument("--depth", choices=DEPTHS, default="fast",
                    help="fast: exact arithmetic over a few blocks; full: every block on fake tensors (the reference)")
    ap.add_argument("--precision", nargs="+", choices=PLAN_PRECISIONS, default=None,
                    help=f"precisions to plan (default: those the GPU has of {PRECISIONS}, FSDP2's 16-bit rows "
                         f"{MIXED_POLICY} where it has bf16, as torchtitan's); {MIXED_POLICY}: FSDP2's "
                         "MixedPrecisionPolicy, bf16 parameters gathered and computed, fp32 shards and reduction; "
                         f"{PURE_BF16}: bf16 weights, gradients and Adam state, no autocast (torchtune's default)")
    ap.add_argument("--parallel", nargs="+", choices=tuple(COMM_UNITS), default=list(COMM_UNITS),
                    help="ways of running on the GPUs to plan (default: all); fsdp2-reshard: FSDP2 resharding after "
                         "forward")
    ap.add_argument("--checkpointing", nargs="+", metavar="{" + ",".join(CHECKPOINTING) + ",layer<k>}", default=None,
                    help=f"checkpointing choices to plan (default: {', '.join(GPU_CHECKPOINTING)}, torchtitan's full "
                         f"and op beside none and sqrt; --gpu cpu: {', '.join(PLAN_CHECKPOINTING)}, the chapters'; a "
                         "transformers model: none, full); every: every block but the last; full: the last too (torchtitan's "
                         "full activation checkpointing); op: torchtitan's op-level selective (SDPA's and every "
                         "second matmul's outputs kept); layer<k>, e.g. layer2: torchtitan's layer-level selective, "
                         "every k-th block checkpointed whole, the others kept (a fake step of every block per row)")
    ap.add_argument("--adam-impl", nargs="+", choices=ADAM_IMPLS, default=None,
                    help=f"Adam's implementations to plan, each a row of its own (default: {GPU_ADAM_IMPL}, "
                         "torchtitan's and torchtune's recipes'; --gpu cpu: for-loop, the chapters'; foreach: torch's "
                         "default on CUDA)")
    ap.add_argument("--logits-fp32", action=argparse.BooleanOptionalAction, default=None,
                    help="a preset's logits upcast to fp32 before the loss (default: on a GPU a Llama preset's, as "
                         "torchtitan's Llama does; a GPT-2 preset's not, as nanoGPT's; transformers' loss does it "
                         "already)")
    ap.add_argument("--free-logits", action=argparse.BooleanOptionalAction, default=None,
                    help="free the logits before backward, as torchtitan's step does (default: on a GPU a Llama "
                         "preset's, torchtitan's loop; else held, as nanoGPT's `logits, loss = model(x, y)` holds them)")
    ap.add_argument("--grad-sync", nargs="+", choices=GRAD_SYNCS, default=["every"],
                    help="FSDP2 rows of two or more micro-batches: reduce-scatter the gradients after every one "
                         "(default: FSDP2's and torchtitan's) and/or after the last only, a row each "
                         "(model.set_requires_gradient_sync(False) before the others: the whole unsharded gradients "
                         "held between micro-batches in the reduce dtype, fp32 under bf16-mp; fewer bytes sent)")
    ap.add_argument("--reduce-dtype", nargs="+", choices=REDUCE_DTYPES, default=["fp32"],
                    help=f"{MIXED_POLICY} rows: MixedPrecisionPolicy's reduce_dtype, a row each (default: fp32, "
                         "torchtitan's; bf16: the reduce-scatter's buffer is a bf16 copy, half the fp32 one, and half "
                         "the bytes sent; with --grad-sync last the gradients accumulate in bf16)")
    ap.add_argument("--attention", choices=ATTENTION, default=None,
                    help="a preset's attention: manual (T×T scores kept), sdpa (the kernel torch picks on the device: "
                         "on a GPU flash, memory-efficient in fp32), flash or efficient (CUDA's kernels: what each "
                         "saves for backward)")
    ap.add_argument("--reserved", action="store_true",
                    help="each Pareto-front row's reserved peak: its step's allocations at full depth (for a deep "
                         "model written out from fake steps of a few blocks, exact), replayed through the CUDA "
                         "caching allocator's default rules, and what the GPU would show used: that reserve plus the CUDA context and NCCL's "
                         "buffers, ranges from published figures and an H200 of ours; and judges each replayed row by that figure, "
                         "with a margin (a front row that does not fit leaves the front, and the rows that join it "
                         "are replayed in turn)")
    ap.add_argument("--expandable-segments", action="store_true",
                    help="with --reserved: replay under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True's rules "
                         "(torchtitan's launcher's setting: segments grow by 2 MiB / 20 MiB pages) instead of the "
                         "default's")
    ap.add_argument("--all", action="store_true", help="print every combination, not only the Pareto front")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def main(argv=None) -> int:
    """Print the plan of `--model` on `--gpus` x `--gpu` (a table, or JSON with --json)."""
    ap = _arguments()
    args = ap.parse_args(argv)
    gpu = args.gpu
    if args.gpu_memory is not None:  # checked before any work: a GPU of the table, a positive size
        if args.gpu not in GPUS:
            ap.error(f"--gpu-memory: replaces the memory of a GPU of labkit.gpus.GPUS ({', '.join(GPUS)}), "
                     f"not of --gpu {args.gpu}")
        if not 0 < args.gpu_memory < 2**20:
            ap.error(f"--gpu-memory must be a size in GiB above 0 (e.g. 87.5), got {args.gpu_memory:g}")
        gpu = replace(GPUS[args.gpu], memory_bytes=round(args.gpu_memory * 2**30))
    model = args.model
    titan = torchtitans_loop(model, args.gpu)  # a Llama preset on a GPU: torchtitan's loop unless a flag says otherwise
    if args.logits_fp32 is not None and model not in PRESETS:
        ap.error(f"--logits-fp32: a preset's option ({', '.join(PRESETS)}); a transformers model's loss upcasts "
                 "its logits already")
    if args.attention and model not in PRESETS:
        ap.error(f"--attention: a preset's option ({', '.join(PRESETS)}); a transformers config sets its own "
                 "(attn_implementation)")
    if model in PRESETS and (args.logits_fp32 is not None or args.attention):
        model = replace(PRESETS[model], logits_fp32=titan if args.logits_fp32 is None else args.logits_fp32,
                        attn=args.attention or PRESETS[model].attn)
    try:
        p = plan(model, gpu, args.gpus, args.seq_len, args.batch, reserve_fraction=args.reserve,
                 depth=args.depth, adam_impls=args.adam_impl, precisions=args.precision, checkpointing=args.checkpointing,
                 parallels=args.parallel, keep_logits=not (titan if args.free_logits is None else args.free_logits),
                 reserved=args.reserved, expandable_segments=args.expandable_segments, grad_syncs=args.grad_sync,
                 reduce_dtypes=args.reduce_dtype)
    except ParameterError as e:
        ap.error(str(e))
    if args.gpu_memory is not None and not args.json:
        print(f"{args.gpu}'s rates and links with {format_bytes(gpu.memory_bytes)} of memory each (--gpu-memory; the "
              f"{args.gpu} profile's: {format_bytes(GPUS[args.gpu].memory_bytes)})")
    print(json.dumps(plan_json(p), indent=1) if args.json else format_plan(p, args.all))
    return 0


def combination_step(cfg: GPTConfig, combination: Combination, seed: int = 0, device="cpu"):
    """Return (model, optimizer, step_fn) running a one-device combination for real: what the meter checks a row by.

    Measure its step without a warm-up (labkit.measure_step(..., warmup=False)): with the optimizer on the device,
    Adam's state is created here as a first step leaves it (train.create_optimizer_state, no forward: a warm-up step
    of bf16 on a CPU without bf16 units costs tens of fp32 steps); on the host, its first step creates the state in
    the host tier.
    """
    model = seeded_model(cfg, seed, device)
    _checkpoint(model, combination.checkpointing)
    if combination.precision == PURE_BF16:
        model.to(torch.bfloat16)
    optimizer = make_optimizer("adam", model.parameters(), implementation=combination.adam_impl)
    if combination.optimizer == "device":
        create_optimizer_state(optimizer)
    else:
        device_step = optimizer.step

        def host_step(*args, **kwargs):
            with host_tier():  # the state and the step's temporaries: host memory
                return device_step(*args, **kwargs)
        optimizer.step = host_step
    hooks = OffloadHooks(model, min_bytes=OFFLOAD_MIN_BYTES) if combination.offload else None

    step = Step(combination.micro_batch, precision=combination.precision, checkpointing=combination.checkpointing,
                offload=combination.offload, adam_impl=combination.adam_impl, keep_logits=combination.keep_logits)

    def step_fn(model, optimizer, batch):
        return plan_step(model, optimizer, batch, step, hooks)
    return model, optimizer, step_fn


if __name__ == "__main__":  # (python -m labkit.planner.plan) run as the module labkit.planner.plan: the Steps its
    from labkit.planner import plan as _module  # workers unpickle are labkit.planner.plan.Step, never __main__.Step
    raise SystemExit(_module.main())
