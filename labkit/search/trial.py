"""One trial of the search (notebook 08): a setting's step built from the chapters, predicted on fake tensors (its peak
and its counted work), then metered under the budget and trained; its speed projected on a GPU (measured on CUDA)."""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
from dataclasses import dataclass, field

import torch

from labkit.autocast_ops import CudaAutocastOps
from labkit.cpu import bf16_native
from labkit.data import MarkovTokens
from labkit.device import as_device, resolve_device
from labkit.estimate import example_batch, fake_step, remembered
from labkit.fastfake import direct_dispatch, fast_fake_mode
from labkit.gpus import step_time
from labkit.meter import MemoryMeter, OutOfMemory
from labkit.models import GPT
from labkit.search.config import StudyConfig
from labkit.search.space import check_params
from labkit.techniques.accumulation import split_batch
from labkit.techniques.checkpointing import checkpoint_blocks
from labkit.techniques.l2l import L2LTrainer
from labkit.techniques.offload import OffloadHooks
from labkit.techniques.precision import amp_train_step, check_precision
from labkit.throughput import Throughput, measure_throughputs, timed_call
from labkit.train import create_optimizer_state, make_optimizer
from labkit.validate import check_int
from labkit.work import Work, WorkCounter


@dataclass
class TrialResult:
    """What one trial measured."""

    params: dict  # the setting
    status: str  # "ok" ran; "predicted_oom" not run; "oom" refused by the budget; "pruned" stopped by the pruner;
    #              "predicted" fits by its prediction, not run on this machine (16-bit on a CPU without 16-bit units)
    predicted_peak_bytes: int  # the fake-tensor estimate of one steady step
    fits_predicted: bool  # predicted_peak_bytes <= the budget
    work: Work | None = None  # one optimizer step's counted work on fake tensors (the same on every machine)
    projected_step_s: float | None = None  # that work's step time on config.gpu (labkit.gpus.step_time)
    peak_bytes: int | None = None  # measured over the metered steps (None when nothing ran)
    val_loss: float | None = None  # after the last step run (the untrained model's when nothing ran)
    val_losses: list = field(default_factory=list)  # [(optimizer steps done, validation loss), ...]
    steps_run: int = 0  # optimizer steps trained
    step_s: float | None = None  # median seconds per step of the unmetered steps (measured here)
    tokens_per_s: float | None = None  # tokens per second from step_s; measure_setting on a CPU: from projected_step_s
    relative_speed: float | None = None  # a reference step's time over this one's: projected on config.gpu on a CPU,
    #                                      on CUDA the median over timed rounds of the paired ratios
    error: str = ""  # the budget's message for an "oom"

    @property
    def peak_here_bytes(self) -> int:
        """Return the metered peak where the setting ran here, else its predicted one (chapter 08's table)."""
        return self.peak_bytes if self.peak_bytes is not None else self.predicted_peak_bytes

    @property
    def fits(self) -> bool:
        """Return True when the setting ran its metered steps within the budget (or, not run here, is predicted to)."""
        return self.status in ("ok", "pruned", "predicted")


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
        prefetch = config.device == "cuda"  # 04's and 05's prefetch: CUDA's, and its fake steps' on "cpu"
        if self.technique == "l2l":  # 05: the master copy and Adam live on the host
            self.l2l = L2LTrainer(model, self.device, lr=params["lr"], prefetch=prefetch)
            self.model, self.optimizer = self.l2l.model, self.l2l.optimizer
            return
        self.model = model if self.device.type == "cpu" else model.to(self.device)  # (fake tensors cannot move)
        if self.technique == "checkpoint":  # 02: s segments, every one recomputed in backward
            checkpoint_blocks(self.model, params["segments"], checkpoint_last=True)
        self.optimizer = make_optimizer("adam", self.model.parameters(), lr=params["lr"])
        self.hooks = (OffloadHooks(self.model, prefetch=prefetch).track_layers(self.model.blocks)
                      if self.technique == "offload" else None)
        self.micro_batch = params["micro_batch"]  # 01: batch / micro_batch accumulation steps
        self.precision = params["precision"]  # 03
        # fp16 needs a GradScaler and runs only on CUDA; the fake-tensor prediction on "cpu" leaves its scalars out
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" and self.device.type == "cuda" else None

    def step(self, batch) -> None:
        """Run one optimizer step on `batch` = (inputs, targets)."""
        if self.technique == "l2l":
            self.l2l.step(batch)
            return
        # 03 on a CPU: a 16-bit step takes CUDA autocast's dtypes, as the GPU the search answers for runs it
        half_on_cpu = self.precision != "fp32" and self.device.type == "cpu"
        gpu_dtypes = CudaAutocastOps() if half_on_cpu else contextlib.nullcontext()
        with self.hooks if self.hooks is not None else contextlib.nullcontext(), gpu_dtypes:  # 04: saved tensors to host
            amp_train_step(self.model, self.optimizer, split_batch(batch, self.micro_batch), precision=self.precision,
                           scaler=self.scaler)

    def attach(self, meter: MemoryMeter, batch) -> None:
        """Let `meter` count this setting's parameters, gradients, optimizer state and `batch` by category."""
        if self.technique == "l2l":
            self.l2l.attach(meter)
        else:
            meter.track(self.model, self.optimizer)
        meter.track(*batch)

    def metered_step(self, batch, budget_bytes: int) -> int:
        """Run one step on `batch` under a MemoryMeter with the budget; return its peak bytes (OutOfMemory above it)."""
        with MemoryMeter(self.device, budget_bytes=budget_bytes, timeline=False) as meter:
            self.attach(meter, batch)
            self.step(batch)
        return meter.peak_bytes

    @torch.no_grad()
    def val_loss(self, batch) -> float:
        """Return the model's fp32 loss on a held-out batch."""
        x, y = batch
        dev = next(self.model.parameters()).device  # L2L: the host master copy
        return float(self.model(x.to(dev), y.to(dev))[1])


def _memory_key(params: dict, config: StudyConfig) -> tuple:
    """Return what decides a setting's bytes: the model's shape, the device and the knobs (the learning rate: none)."""
    shape = tuple(v for k, v in config.to_dict().items() if k in ("n_layer", "n_embd", "n_head", "vocab_size",
                                                                    "batch", "seq_len", "device"))
    return shape + tuple(sorted((k, v) for k, v in params.items() if k != "lr"))


def predict_step(params: dict, config: StudyConfig) -> tuple[int, Work]:
    """Return one steady step's peak bytes and counted work (optimizer step included), run once on fake tensors
    (remembered by setting)."""
    check_setting(params, config)
    key = ("setting", *_memory_key(params, config))
    counter = direct_dispatch(WorkCounter)()

    def build():  # on "cpu": fake CUDA autograd aborts a CPU-only build (SettingStep takes CUDA autocast's dtypes)
        step = SettingStep(params, config, "cpu")
        batch = example_batch(config.gpt, config.batch, config.seq_len)
        create_optimizer_state(step.optimizer)  # as after a first step, at half the cost of running one

        def run():
            with counter:
                step.step(batch)
        return step.model, lambda meter: step.attach(meter, batch), run
    meter = direct_dispatch(MemoryMeter)  # (nothing compiled in a fake step: torch's wrapper left out)
    return remembered(key, lambda: (fake_step(build, mode=fast_fake_mode, meter_class=meter)[0], counter.work()))


def predict_peak_bytes(params: dict, config: StudyConfig) -> int:
    """Return the peak bytes of one steady step of the setting, run on fake tensors (remembered by setting)."""
    return predict_step(params, config)[0]


def projected_step_s(params: dict, config: StudyConfig) -> float:
    """Return the setting's step time on config.gpu from its counted work (labkit.gpus.step_time: an estimate at a
    published run's share of peak where the GPU class has one, else the roofline bound)."""
    return step_time(predict_step(params, config)[1], config.gpu).time_s


def runs_here(params: dict, config: StudyConfig) -> bool:
    """Return whether this machine computes the setting's precision on its own units: fp32 always; 16-bit on CUDA,
    or on a CPU with bf16 units (labkit.cpu.bf16_native). Elsewhere a 16-bit step runs generic kernels tens of times
    slower (chapter 03): the search predicts it and does not run it."""
    return params.get("precision", "fp32") == "fp32" or config.device == "cuda" or bf16_native()


def _batches(config: StudyConfig, device):
    """Yield the training batches every trial sees, in the same order, endlessly (drawn outside any meter)."""
    data = MarkovTokens(config.vocab_size, seed=config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    while True:
        yield tuple(t.to(device) for t in data.batch(config.batch, config.seq_len, generator=gen))


def validation_batch(config: StudyConfig, device="cpu"):
    """Return the held-out batch every trial is evaluated on."""
    data = MarkovTokens(config.vocab_size, seed=config.seed)
    gen = torch.Generator().manual_seed(config.seed + 1_000_003)
    return tuple(t.to(device) for t in data.batch(config.eval_batch, config.seq_len, generator=gen))


@functools.cache
def untrained_loss(config: StudyConfig) -> float:
    """Return the validation loss of the untrained model: the value of a setting that trained nothing."""
    torch.manual_seed(config.seed)
    with torch.no_grad():
        return float(GPT(config.gpt)(*validation_batch(config))[1])


def train(params: dict, config: StudyConfig, report=None) -> TrialResult:
    """Predict the setting's peak; if it fits, meter `metered_steps` under the budget, train the rest timed; return it.

    `report(result)` runs after each validation with the result so far; a pruner raises from it.
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
    """Predict the setting's peak and work; if it fits, meter `metered_steps` under the budget (where it runs here).

    On CUDA it then times `timed_steps`, each alternating with a step of the `reference` setting when one is given
    (`relative_speed`: the median of the paired ratios). On a CPU nothing is timed: CPU time ranks no setting for a
    GPU; `relative_speed` is the reference's projected step time on config.gpu over this setting's.
    """
    result, step, batches = _start(params, config)
    if step is None:
        return result
    if not runs_here(params, config):
        result.status = "predicted"
    else:
        try:
            _metered_steps(step, batches, config, result)
        except torch.OutOfMemoryError as e:
            _out_of_memory(result, e)
            return result
    if step.device.type != "cuda":
        result.tokens_per_s = config.tokens_per_step / result.projected_step_s
        if reference is not None:
            result.relative_speed = projected_step_s(reference, config) / result.projected_step_s
        return result
    if reference is None:
        times = [_timed_step(step, next(batches), step.device) for _ in range(config.timed_steps)]
    else:
        times, ref_times = _paired_times(step, batches, *_reference(reference, config, step.device), config.timed_steps)
        result.relative_speed = statistics.median(r / t for r, t in zip(ref_times, times))
    result.steps_run += len(times)
    _set_speed(result, times, config)
    return result


def _paired_times(step: SettingStep, batches, ref_step: SettingStep, ref_batches, n: int) -> tuple[list, list]:
    """Return n step times of `step` and of `ref_step`, each step beside one of the other (which goes first alternates)."""
    times, ref_times = [], []
    for i in range(n):
        pair = [(step, batches, times), (ref_step, ref_batches, ref_times)]
        for s, b, out in pair if i % 2 == 0 else pair[::-1]:
            out.append(_timed_step(s, next(b), step.device))
    return times, ref_times


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


def _start(params: dict, config: StudyConfig):
    """Return (result, step, batches) of a setting predicted to fit, or (result, None, None) of one that does not."""
    predicted, work = predict_step(params, config)
    result = TrialResult(params, "predicted_oom", predicted, predicted <= config.budget_bytes, work,
                         step_time(work, config.gpu).time_s)
    if not result.fits_predicted:
        return result, None, None
    device = resolve_device(config.device, "config.device")
    result.status = "ok"
    return result, SettingStep(params, config, device), _batches(config, device)


def _metered_steps(step: SettingStep, batches, config: StudyConfig, result: TrialResult) -> None:
    """Run `metered_steps` steps, each under its own MemoryMeter with the budget; record the largest peak."""
    result.peak_bytes = 0
    for _ in range(config.metered_steps):  # the batch is drawn outside the meter: the data's tables are not the step's
        peak = step.metered_step(next(batches), config.budget_bytes)
        result.steps_run += 1
        result.peak_bytes = max(result.peak_bytes, peak)


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
    """Record the validation loss after the steps run so far (a diverged one: the untrained loss) and report it."""
    loss = step.val_loss(val)
    if not math.isfinite(loss):
        loss = untrained_loss(step.config)
    result.val_loss = loss
    result.val_losses.append((result.steps_run, loss))
    if report is not None:
        report(result)


def confirm_oom(params: dict, config: StudyConfig) -> bool:
    """Run one warm-up step, then one step under the budget; return True if the budget refused it."""
    device = resolve_device(config.device, "config.device")
    step = SettingStep(params, config, device)
    batches = _batches(config, device)
    step.step(next(batches))  # warm-up outside the budget: the steady step is the one that must not fit
    try:
        step.metered_step(next(batches), config.budget_bytes)
    except torch.OutOfMemoryError:
        return True
    return False


def _timed_step(step: SettingStep, batch, device) -> float:
    """Run one optimizer step on `batch`; return its seconds, the device synchronised on both sides."""
    return timed_call(lambda: step.step(batch), device)


def time_settings(settings: dict[str, dict], config: StudyConfig, rounds: int) -> dict[str, Throughput]:
    """Return each setting's Throughput over `rounds` interleaved rounds after a warm-up (no budget)."""
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


@dataclass
class FinalistTiming:
    """A fair timing of a study's finalists beside other settings (chapter 08 on CUDA): `time_finalists`."""

    finalists: dict  # name -> knobs: the study's distinct settings it timed fastest
    candidates: dict  # name -> setting timed (lr included): the finalists, the noise control, the others
    timed: dict  # name -> Throughput over `rounds` interleaved rounds
    twin_ratios: dict  # (a, b) -> b's step time over a's, round by round (median): two copies of one setting
    rounds: int
    noise_limit: float

    @property
    def noise(self) -> float:
        """Return the twin ratio furthest from 1: how far apart two copies of one setting timed."""
        return max(self.twin_ratios.values(), key=lambda r: abs(r - 1))

    @property
    def reliable(self) -> bool:
        """Tell whether two copies of one setting timed within noise_limit of each other."""
        return abs(self.noise - 1) <= self.noise_limit

    def ratio(self, a: str, b: str) -> float:
        """Return the median over rounds of b's step time over a's (above 1: a is faster)."""
        from labkit.throughput import paired_ratio
        return paired_ratio(self.timed, b, a).median

    @property
    def chosen(self) -> str:
        """Return the finalist that beats each other finalist round by round (by its worst paired ratio)."""
        names = list(self.finalists)
        return max(names, key=lambda n: min(self.ratio(n, o) for o in names if o != n) if len(names) > 1 else 0)


CONTROL = "search #1 again (noise control)"  # the second copy of the study's fastest setting


def time_finalists(trials, others: dict[str, dict], config: StudyConfig, most: int, band: float, rounds: int,
                   noise_limit: float, attempts: int = 3) -> FinalistTiming:
    """Time a speed study's finalists fairly beside `others` (name -> setting): chapter 08's answer on CUDA.

    trials: the study's feasible trials, fastest first. Finalists: its distinct settings timed at `band` of the fastest or
    more, at most `most`. Every setting runs one step per round, interleaved, on one thread (as each worker did); a
    second copy of the fastest, and each other setting equal to a finalist, must time within `noise_limit` of its
    twin, or the timing is repeated with twice the rounds, `attempts` times in all (then `reliable` is False).
    """
    finalists: dict = {}
    for t in trials:  # distinct settings: a retried or repeated setting counts once
        knobs = dict(sorted(t.params.items()))
        if knobs not in finalists.values() and len(finalists) < most and t.value >= band * trials[0].value:
            finalists[f"search #{len(finalists) + 1} (trial {t.number})"] = knobs
    if not finalists:
        raise ValueError("time_finalists needs at least one feasible trial")
    first = next(iter(finalists))
    candidates = {**{n: dict(k, lr=1e-3) for n, k in finalists.items()}, CONTROL: dict(finalists[first], lr=1e-3),
                  **others}
    twins = [(first, CONTROL)] + [(f, o) for o, p in others.items() for f, k in finalists.items()
                                  if {n: v for n, v in p.items() if n != "lr"} == k]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread is not disturbed by other processes' threads
    try:
        for attempt in range(attempts):
            n = rounds * 2 ** attempt  # more rounds each time: a median over more of them
            timing = FinalistTiming(finalists, candidates, time_settings(candidates, config, rounds=n), {}, n,
                                    noise_limit)
            timing.twin_ratios.update({pair: timing.ratio(*pair) for pair in twins})
            if timing.reliable:
                break
    finally:
        torch.set_num_threads(threads)
    return timing
