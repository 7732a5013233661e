"""One trial of the workbook's search: a setting of the chapters' knobs, predicted, then trained under the budget.

Reference for notebook 08. Everything a trial needs is plain data, so that a worker process (or a
Katib pod) can run it from the study's stored settings:

    config = StudyConfig(budget_bytes=ex.budget_bytes)          # shared by every trial of a study
    params = {"technique": "checkpoint", "segments": 2, "precision": "fp32", "micro_batch": 8, "lr": 3e-3}
    predict_peak_bytes(params, config)     # the same step on fake tensors: seconds, nothing allocated
    measure_setting(params, config)        # predicted not to fit: skipped; else metered under the budget, then timed
    train(params, config)                  # the same, trained for `train_steps` with validation losses
    time_settings({"a": params, ...}, config, rounds=5)   # step times of several settings, interleaved

The step is built from the chapters' tested references: micro-batches and autocast
(`precision.amp_train_step`: 01, 03), checkpointed blocks (`checkpointing.checkpoint_blocks`: 02),
offload hooks (`offload.OffloadHooks`: 04), the layer-to-layer trainer (`l2l.L2LTrainer`: 05).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from labkit.accumulation import split_batch
from labkit.checkpointing import checkpoint_blocks
from labkit.data import MarkovTokens
from labkit.device import as_device, resolve_device
from labkit.estimate import example_batch
from labkit.l2l import L2LTrainer
from labkit.meter import MemoryMeter, OutOfMemory
from labkit.models import GPT, GPTConfig
from labkit.offload import OffloadHooks
from labkit.precision import amp_train_step, check_precision
from labkit.search.space import check_params, workbook_space
from labkit.throughput import Throughput, measure_throughputs, timed_call
from labkit.train import create_optimizer_state, make_optimizer
from labkit.validate import check_int

STATUSES = ("ok", "predicted_oom", "oom", "pruned")
MEMORY_KNOBS = ("technique", "segments", "precision", "micro_batch")
"""The parameters that change a step's memory and speed; the learning rate changes neither."""
"""ok: trained; predicted_oom: the estimate said it does not fit, nothing ran; oom: the budget
refused an allocation during training; pruned: stopped early by the study's pruner."""


@dataclass(frozen=True)
class StudyConfig:
    """What every trial of a study shares: the model, the data, the budget and how long each trial trains."""

    budget_bytes: int  # the simulated device's memory: a setting whose step needs more does not fit
    n_layer: int = 4  # transformer blocks (the running example's shape by default)
    n_embd: int = 128  # model width
    n_head: int = 4  # attention heads
    vocab_size: int = 256  # tokens of the synthetic language
    batch: int = 16  # samples per optimizer step, however it is split into micro-batches
    seq_len: int = 64  # tokens per sample
    train_steps: int = 8  # optimizer steps per trial: every trial trains on the same batch * seq_len * train_steps tokens
    eval_every: int = 2  # validation loss every this many steps (what a pruner sees)
    eval_batch: int = 32  # held-out samples of the validation loss (the same for every trial)
    metered_steps: int = 2  # steps run under the meter and the budget (a steady step is the second); the rest are timed
    timed_steps: int = 3  # steps timed for the speed objective (after one warm-up step)
    seed: int = 0  # weights and data: every trial starts from the same model and sees the same batches
    device: str = "cpu"  # "cpu" or "cuda" (never "auto": a stored study must mean the same thing on every worker)
    precisions: tuple = ("fp32", "bf16")  # the precisions searched (fp16 only on CUDA; bf16 where the CPU is fast at it)

    def __post_init__(self):
        check_int("budget_bytes", self.budget_bytes, 1)
        for name in ("n_layer", "n_embd", "n_head", "vocab_size", "batch", "seq_len", "train_steps", "eval_every",
                     "eval_batch", "metered_steps", "timed_steps"):
            check_int(name, getattr(self, name), 1)
        check_int("seed", self.seed, 0)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.metered_steps > self.train_steps:
            raise ValueError(f"metered_steps ({self.metered_steps}) must be <= train_steps ({self.train_steps})")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        object.__setattr__(self, "precisions", tuple(self.precisions))  # (a stored study gives a list)
        if not self.precisions or any(p not in ("fp32", "bf16", "fp16") for p in self.precisions):
            raise ValueError(f"precisions must be a non-empty subset of ('fp32', 'bf16', 'fp16'), got {self.precisions}")
        if "fp16" in self.precisions and self.device != "cuda":
            raise ValueError("fp16 is searched only on CUDA: fp16 compute on a CPU runs on slow generic kernels")

    @property
    def gpt(self) -> GPTConfig:
        """Return the model's config."""
        return dataclasses.replace(GPTConfig(), n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head,
                                   vocab_size=self.vocab_size, block_size=self.seq_len)

    @property
    def tokens_per_step(self) -> int:
        """Return the tokens of one optimizer step."""
        return self.batch * self.seq_len

    def space(self, precisions: tuple | None = None, only: tuple | None = None):
        """Return the workbook's search space for this model and batch (`only`: just these parameters)."""
        full = workbook_space(self.n_layer, self.batch, precisions=precisions or self.precisions)
        return full if only is None else [p for p in full if p.name in only]

    def to_dict(self) -> dict:
        """Return the config as plain data (what a study stores for its workers)."""
        d = dataclasses.asdict(self)
        d["precisions"] = list(self.precisions)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "StudyConfig":
        """Rebuild a config from `to_dict`'s output."""
        return cls(**d)


@dataclass
class TrialResult:
    """What one trial measured."""

    params: dict  # the setting
    status: str  # one of STATUSES
    predicted_peak_bytes: int  # the fake-tensor estimate of one steady step
    fits_predicted: bool  # predicted_peak_bytes <= the budget
    peak_bytes: int | None = None  # measured over the metered steps (None when nothing ran)
    val_loss: float | None = None  # after the last step run (the untrained model's when nothing ran)
    val_losses: list = field(default_factory=list)  # [(optimizer steps done, validation loss), ...]
    steps_run: int = 0  # optimizer steps trained
    step_s: float | None = None  # median seconds per step of the unmetered steps
    tokens_per_s: float | None = None  # tokens per second from step_s
    relative_speed: float | None = None  # median over timed rounds of a reference step's seconds over this one's
    error: str = ""  # the budget's message for an "oom"

    @property
    def fits(self) -> bool:
        """Return True when the setting ran its metered steps within the budget."""
        return self.status in ("ok", "pruned")


# -- building a setting's step ------------------------------------------------------------------------
def check_setting(params: dict, config: StudyConfig) -> dict:
    """Return `params` if it is a point of `config`'s search space (fp16 also on CPU is refused)."""
    check_params(params, config.space(precisions=("fp32", "bf16", "fp16")))
    if "precision" in params:
        check_precision(params["precision"], config.device)
    return params


class SettingStep:
    """A model, its optimizer and the step of one setting, built the way the chapters build them."""

    def __init__(self, params: dict, config: StudyConfig, device: torch.device | str):
        check_setting(params, config)
        self.params, self.config, self.device = params, config, as_device(device)
        self.technique = params["technique"]
        torch.manual_seed(config.seed)  # every setting starts from the same weights
        model = GPT(config.gpt)
        if self.technique == "l2l":  # 05: the master copy and Adam live on the host
            self.l2l = L2LTrainer(model, self.device, lr=params["lr"])
            self.model = self.l2l.model
            return
        self.model = model if self.device.type == "cpu" else model.to(self.device)  # (fake tensors cannot move)
        if self.technique == "checkpoint":  # 02: s segments, every one recomputed in backward
            checkpoint_blocks(self.model, params["segments"], checkpoint_last=True)
        self.optimizer = make_optimizer("adam", self.model.parameters(), lr=params["lr"])
        self.hooks = OffloadHooks(self.model).track_layers(self.model.blocks) if self.technique == "offload" else None
        self.micro_batch = params["micro_batch"]  # 01: batch / micro_batch accumulation steps
        self.precision = params["precision"]  # 03
        # 03: fp16 needs loss scaling (a GradScaler); fp16 runs only on CUDA, and the fake-tensor prediction on
        # "cpu" leaves the scaler's two scalars out
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" and self.device.type == "cuda" else None

    def step(self, batch) -> None:
        """Run one optimizer step on `batch` = (inputs, targets)."""
        if self.technique == "l2l":
            self.l2l.step(batch)
            return
        with self.hooks if self.hooks is not None else contextlib.nullcontext():  # 04: saved tensors to the host
            amp_train_step(self.model, self.optimizer, split_batch(batch, self.micro_batch), precision=self.precision,
                           scaler=self.scaler)

    def create_optimizer_state(self) -> None:
        """Create Adam's state without a forward pass (zero gradients, one update): a steady step's bytes."""
        create_optimizer_state(self.l2l.optimizer if self.technique == "l2l" else self.optimizer)

    def attach(self, meter: MemoryMeter) -> None:
        """Let `meter` count this setting's parameters, gradients and optimizer state by category."""
        if self.technique == "l2l":
            self.l2l.attach(meter)
        else:
            meter.track(self.model, self.optimizer)

    @torch.no_grad()
    def val_loss(self, batch) -> float:
        """Return the model's fp32 loss on a held-out batch."""
        x, y = batch
        dev = next(self.model.parameters()).device  # L2L: the host master copy
        return float(self.model(x.to(dev), y.to(dev))[1])


# -- prediction ---------------------------------------------------------------------------------------
_PREDICTED: dict = {}  # memory key -> predicted peak bytes (the learning rate changes no byte)


def _memory_key(params: dict, config: StudyConfig) -> tuple:
    shape = tuple(v for k, v in config.to_dict().items() if k in ("n_layer", "n_embd", "n_head", "vocab_size",
                                                                    "batch", "seq_len", "device"))
    return shape + tuple(sorted((k, v) for k, v in params.items() if k != "lr"))


def predict_peak_bytes(params: dict, config: StudyConfig) -> int:
    """Return the peak bytes of one steady step of the setting, run on fake tensors (cached by setting)."""
    check_setting(params, config)
    key = _memory_key(params, config)
    if key not in _PREDICTED:
        with FakeTensorMode():  # (on "cpu": fake CUDA autograd aborts a CPU-only build; the bytes are the same)
            step = SettingStep(params, config, "cpu")
            batch = example_batch(config.gpt, config.batch, config.seq_len)
            step.create_optimizer_state()  # as after a first step, at half the cost of running one
            with MemoryMeter("cpu", timeline=False) as meter:
                step.attach(meter)
                meter.track(*batch)
                step.step(batch)
        _PREDICTED[key] = meter.peak_bytes
    return _PREDICTED[key]


# -- training -----------------------------------------------------------------------------------------
def _batches(config: StudyConfig, device):
    """Return an endless iterator over the training batches every trial sees, in the same order."""
    data = MarkovTokens(config.vocab_size, seed=config.seed)  # now: its transition tables are not the step's bytes
    gen = torch.Generator().manual_seed(config.seed)

    def batches():
        while True:
            yield tuple(t.to(device) for t in data.batch(config.batch, config.seq_len, generator=gen))
    return batches()


def validation_batch(config: StudyConfig, device="cpu"):
    """Return the held-out batch every trial is evaluated on."""
    data = MarkovTokens(config.vocab_size, seed=config.seed)
    gen = torch.Generator().manual_seed(config.seed + 1_000_003)
    return tuple(t.to(device) for t in data.batch(config.eval_batch, config.seq_len, generator=gen))


_UNTRAINED: dict = {}


def untrained_loss(config: StudyConfig) -> float:
    """Return the validation loss of the untrained model: the value of a setting that trained nothing."""
    key = json.dumps(config.to_dict(), sort_keys=True)
    if key not in _UNTRAINED:
        torch.manual_seed(config.seed)
        with torch.no_grad():
            _UNTRAINED[key] = float(GPT(config.gpt)(*validation_batch(config))[1])
    return _UNTRAINED[key]


def train(params: dict, config: StudyConfig, report=None) -> TrialResult:
    """Predict the setting's peak; if it fits, train it under the budget and return what it measured.

    `report(result)` is called after each validation with the result so far (`steps_run`,
    `val_loss`, `peak_bytes`); a pruner raises from it. The first `metered_steps` steps run under a
    MemoryMeter with the budget (a real OutOfMemory gives status "oom"); the others are timed,
    outside the meter.
    """
    result, step, batches = _start(params, config)
    if step is None:
        result.val_loss = untrained_loss(config)
        return result
    val = validation_batch(config, step.device)
    times = []
    try:
        _metered_steps(step, batches, config, result)
        if result.steps_run % config.eval_every == 0:
            _validate(step, val, result, report)
        while result.steps_run < config.train_steps:
            times.append(_timed_step(step, next(batches), step.device))
            result.steps_run += 1
            if result.steps_run % config.eval_every == 0 or result.steps_run == config.train_steps:
                _validate(step, val, result, report)
    except torch.OutOfMemoryError as e:  # the budget's OutOfMemory, or a real device's
        _out_of_memory(result, e)
        result.val_loss = untrained_loss(config)
    _set_speed(result, times, config)
    return result


def measure_setting(params: dict, config: StudyConfig, reference: dict | None = None) -> TrialResult:
    """Predict the setting's peak; if it fits, run `metered_steps` under the budget, then time `timed_steps` steps.

    What one trial of the speed study measures: the peak (metered) and the tokens per second
    (median of the timed steps, outside the meter). No validation: no number learned changes speed.
    With a `reference` setting, each timed step alternates with a step of the reference (built
    once per process, no budget), and `relative_speed` is the median of the paired ratios: what
    else the machine does in that moment slows both alike and cancels out.
    """
    result, step, batches = _start(params, config)
    if step is None:
        return result
    try:
        _metered_steps(step, batches, config, result)
    except torch.OutOfMemoryError as e:
        _out_of_memory(result, e)
        return result
    if reference is None:
        times = [_timed_step(step, next(batches), step.device) for _ in range(config.timed_steps)]
    else:
        ref_step, ref_batches = _reference(reference, config, step.device)
        times, ref_times = [], []
        for i in range(config.timed_steps):
            pair = [(step, batches, times), (ref_step, ref_batches, ref_times)]
            for s, b, out in pair if i % 2 == 0 else pair[::-1]:
                out.append(_timed_step(s, next(b), step.device))
        result.relative_speed = statistics.median(r / t for r, t in zip(ref_times, times))
    result.steps_run += len(times)
    _set_speed(result, times, config)
    return result


_REFERENCES: dict = {}  # memory key -> (SettingStep, batches): one warm reference per setting and process


def _reference(params: dict, config: StudyConfig, device):
    """Return the reference setting's step and batches, built (and warmed up) once per process."""
    key = _memory_key(params, config)
    if key not in _REFERENCES:
        step, batches = SettingStep(params, config, device), _batches(config, device)
        step.step(next(batches))  # warm-up: allocator, kernels, Adam's state
        _REFERENCES.clear()  # one at a time: a study has one reference
        _REFERENCES[key] = (step, batches)
    return _REFERENCES[key]


def plain_setting(config: StudyConfig, lr: float = 1e-3) -> dict:
    """Return the plain step's setting (fp32, the whole batch at once): chapter 00's step, the unit of speed."""
    return {"technique": "none", "precision": "fp32", "micro_batch": config.batch, "lr": lr}


def _start(params: dict, config: StudyConfig):
    """Return (result, step, batches) of a setting predicted to fit, or (result, None, None) of one that does not."""
    predicted = predict_peak_bytes(params, config)
    result = TrialResult(params, "predicted_oom", predicted, predicted <= config.budget_bytes)
    if not result.fits_predicted:
        return result, None, None
    device = resolve_device(config.device, "config.device")
    result.status = "ok"
    return result, SettingStep(params, config, device), _batches(config, device)


def _metered_steps(step: SettingStep, batches, config: StudyConfig, result: TrialResult) -> None:
    """Run `metered_steps` steps, each under its own MemoryMeter with the budget; record the largest peak."""
    result.peak_bytes = 0
    for _ in range(config.metered_steps):  # one meter per step: the batch is drawn outside it (the data's
        batch = next(batches)             # lookup tables are not the step's bytes)
        with MemoryMeter(step.device, budget_bytes=config.budget_bytes, timeline=False) as meter:
            step.attach(meter)
            meter.track(*batch)
            step.step(batch)
        del batch
        result.steps_run += 1
        result.peak_bytes = max(result.peak_bytes, meter.peak_bytes)


def _out_of_memory(result: TrialResult, error: torch.OutOfMemoryError) -> None:
    """Mark `result` as refused by the budget (or a real device), keeping what the step asked for."""
    result.status, result.error = "oom", str(error).splitlines()[0]
    if isinstance(error, OutOfMemory):
        result.peak_bytes = error.requested_bytes + error.in_use_bytes  # what the step asked for when refused


def _set_speed(result: TrialResult, times: list, config: StudyConfig) -> None:
    """Set the result's median step time and tokens per second from the timed steps (none: left unset)."""
    if times:
        result.step_s = statistics.median(times)
        result.tokens_per_s = config.tokens_per_step / result.step_s


def _validate(step: SettingStep, val, result: TrialResult, report) -> None:
    loss = step.val_loss(val)
    if not math.isfinite(loss):
        loss = untrained_loss(step.config)  # a diverged setting is no better than no training
    result.val_loss = loss
    result.val_losses.append((result.steps_run, loss))
    if report is not None:
        report(result)


def confirm_oom(params: dict, config: StudyConfig) -> bool:
    """Run one step of a setting under the budget; return True if the budget refused it (an OutOfMemory).

    What `train` never does for a setting predicted not to fit: check that it really does not.
    """
    device = resolve_device(config.device, "config.device")
    step = SettingStep(params, config, device)
    batches = _batches(config, device)
    step.step(next(batches))  # warm-up outside the budget: the steady step is the one that must not fit
    batch = next(batches)
    try:
        with MemoryMeter(device, budget_bytes=config.budget_bytes, timeline=False) as meter:
            step.attach(meter)
            meter.track(*batch)
            step.step(batch)
    except torch.OutOfMemoryError:
        return True
    return False


def _timed_step(step: SettingStep, batch, device) -> float:
    """Run one optimizer step on `batch`; return its seconds, the device synchronised on both sides."""
    return timed_call(lambda: step.step(batch), device)


def time_settings(settings: dict[str, dict], config: StudyConfig, rounds: int) -> dict[str, Throughput]:
    """Return each setting's Throughput over `rounds` interleaved rounds (one step of each per round), after a warm-up.

    What else the machine does falls on every setting alike: compare settings round by round
    (`step_times_s` are paired by round) or by medians. No budget here: check what fits first.
    """
    check_int("rounds", rounds, 1)
    if not settings:
        raise ValueError("time_settings needs at least one setting")
    device = resolve_device(config.device, "config.device")
    fns = {}
    for name, params in settings.items():
        step, batches = SettingStep(params, config, device), _batches(config, device)
        fns[name] = lambda step=step, batches=batches: step.step(next(batches))
    return measure_throughputs(fns, samples_per_step=config.batch, tokens_per_step=config.tokens_per_step,
                               device=device, warmup_steps=1, steps=rounds)


# -- the chapters' own settings ------------------------------------------------------------------------
def chapter_settings(config: StudyConfig, lr: float = 1e-3) -> dict[str, dict]:
    """Return each single-device chapter's fitting setting (01–05), as that chapter trains it (Adam, lr 1e-3).

    01: the fewest accumulation steps whose micro-batch fits (predicted); 02: every block
    checkpointed; 03: bf16 autocast (fp16 with a GradScaler where the config searches fp16 and not
    bf16; left out where it searches neither); 04: saved activations offloaded; 05: layer to layer.
    """
    choices = next(p.choices for p in config.space() if p.name == "micro_batch")  # largest first
    micro = [m for m in choices
             if predict_peak_bytes(_plain(config, m, lr), config) <= config.budget_bytes]
    out = {}
    if micro:
        out["01 gradient accumulation"] = _plain(config, micro[0], lr)
    out["02 activation checkpointing"] = {"technique": "checkpoint", "segments": config.n_layer, "precision": "fp32",
                                          "micro_batch": config.batch, "lr": lr}
    half = next((p for p in ("bf16", "fp16") if p in config.precisions), None)  # fp16 where a GPU lacks bf16
    if half is not None:
        out[f"03 mixed precision ({half})"] = {"technique": "none", "precision": half, "micro_batch": config.batch,
                                               "lr": lr}
    out["04 activation offload"] = {"technique": "offload", "precision": "fp32", "micro_batch": config.batch, "lr": lr}
    out["05 layer to layer"] = {"technique": "l2l", "lr": lr}
    return out


def _plain(config: StudyConfig, micro_batch: int, lr: float) -> dict:
    return dict(plain_setting(config, lr), micro_batch=micro_batch)

