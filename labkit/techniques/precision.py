"""Mixed precision: an autocast training step (GradScaler, accumulation, clipping) and fp16 range statistics.

Chapter 03: a tested reference (labkit.techniques).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from labkit.compare import flat
from labkit.meter import MemoryMeter
from labkit.models import blocks_of, build_model, token_weights
from labkit.train import create_optimizer_state, make_optimizer, seeded_model
from labkit.validate import ParameterError, check_choice, check_float
from labkit.work import Work, count_work

PRECISIONS = ("fp32", "bf16", "fp16")
GRAD_SYNCS = ("every", "last")  # FSDP2's reduce-scatter after every micro-batch (its default), or after the last only
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

FP16_MIN_SUBNORMAL = 2.0**-24  # smallest positive fp16 value (≈ 5.96e-8)
FP16_MIN_NORMAL = 2.0**-14  # smallest normal fp16 value (≈ 6.10e-5); below it, fewer mantissa bits
FP16_MAX = 65504.0  # largest finite fp16 value
_FP16_NORMAL_BITS, _FP16_INF_BITS = 0x0400, 0x7C00  # fp16 bit patterns (sign bit off): 2^-14, +inf


def check_precision(precision: str, device: torch.device | str) -> None:
    """Raise ParameterError for an unknown precision, or for fp16 compute on a CPU (slow generic kernels)."""
    check_choice("precision", precision, PRECISIONS)
    if precision == "fp16" and torch.device(device).type == "cpu":
        raise ParameterError("fp16 compute on CPU runs on slow generic kernels (notebook 03 never runs it there); "
                         "use bf16 on CPU, or study fp16's range with casts (fp16_cast_stats)")


def autocast(precision: str, device: torch.device | str):
    """Return the autocast context for "fp32" (autocast off), "bf16" or "fp16" on the device's type."""
    check_choice("precision", precision, PRECISIONS)
    device_type = torch.device(device).type
    if precision == "fp32":
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=DTYPES[precision])


@dataclass(frozen=True)
class AmpStep:
    """What one optimizer step of `amp_train_step` did."""

    loss: float  # the step's loss: token-weighted mean over all micro-batches (unscaled)
    stepped: bool  # False when GradScaler found inf/NaN gradients and skipped optimizer.step()
    scale: float | None  # GradScaler's scale after update() (None without a scaler)
    grad_norm: float | None  # total gradient norm before clipping (None without clipping)


def amp_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, *,
                   precision: str = "bf16", scaler: torch.amp.GradScaler | None = None,
                   clip_norm: float | None = None, keep_logits: bool = True, grad_sync: str = "every") -> AmpStep:
    """Run one optimizer step over the micro-batches `batches` under autocast, token-weighted; return an AmpStep.

    keep_logits: each micro-batch's logits held through its backward, as `logits, loss = model(x, y)` holds them (the
    chapters' steps); False frees them before backward, as torchtitan's step does (`del pred`). grad_sync (an FSDP2
    model's): "every" micro-batch's gradients reduce-scattered into the sharded ones (FSDP2's default), or only the
    "last"'s (`set_requires_gradient_sync(False)` before the others: the whole unsharded gradients accumulate between
    micro-batches, in the reduce dtype, and one reduce-scatter sends them).
    """
    batches = list(batches)  # the micro-batches (a count is `micro_batches` elsewhere in labkit)
    if not batches:
        raise ValueError("amp_train_step needs at least one micro-batch")
    check_choice("grad_sync", grad_sync, GRAD_SYNCS)
    if grad_sync == "last" and not hasattr(model, "set_requires_gradient_sync"):
        raise ParameterError(f"grad_sync: 'last' skips FSDP2's reduce-scatters; {type(model).__name__} is not an "
                             "FSDP2 module (torch.distributed.fsdp.fully_shard)")
    device = next(model.parameters()).device
    check_precision(precision, device)
    weights = [1.0] if len(batches) == 1 else token_weights(b[-1] for b in batches)
    loss_sum = 0.0
    try:
        for i, (batch, w) in enumerate(zip(batches, weights)):
            if grad_sync == "last":
                model.set_requires_gradient_sync(i == len(batches) - 1)  # reduce-scatter after the last one only
            with autocast(precision, device):
                logits, loss = model(*batch)  # fp32 loss: cross-entropy runs in fp32 under autocast
            if not keep_logits:
                del logits  # (what the loss saved for backward stays)
            loss = loss.float() * w if w != 1.0 else loss.float()
            (scaler.scale(loss) if scaler is not None else loss).backward()
            loss_sum += loss.detach()
    finally:  # (a micro-batch that failed, an OOM: the model syncs again, as FSDP2 leaves it by default)
        if grad_sync == "last":
            model.set_requires_gradient_sync(True)
    grad_norm = None
    if clip_norm is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = _as_float(torch.nn.utils.clip_grad_norm_(params, clip_norm))
    stepped, scale = True, None
    if scaler is not None:
        before = scaler.get_scale()
        scaler.step(optimizer)  # skips optimizer.step() when a gradient is inf/NaN
        scaler.update()  # a skip multiplies the scale by backoff_factor < 1
        scale = scaler.get_scale()
        stepped = scale >= before
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return AmpStep(_as_float(loss_sum), stepped, scale, grad_norm)


def _as_float(t) -> float:
    """Return a tensor's value as a float (nan for fake tensors, which carry no values)."""
    if isinstance(t, FakeTensor):
        return math.nan
    return float(t)


def amp_step_fn(precision: str, scaler: torch.amp.GradScaler | None = None):
    """Return step_fn(model, optimizer, batch) running `amp_train_step`, for labkit.measure_step."""
    def step_fn(model, optimizer, batch):
        return amp_train_step(model, optimizer, [batch], precision=precision, scaler=scaler)
    return step_fn


@contextlib.contextmanager
def captured_grads(optimizer: torch.optim.Optimizer):
    """Yield a list that receives, at every optimizer.step(), a flat fp32 copy of the gradients it uses."""
    seen: list[torch.Tensor] = []

    def hook(opt, args, kwargs):
        seen.append(flat(p.grad for group in opt.param_groups for p in group["params"]).float())

    handle = optimizer.register_step_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def step_outcome(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step):
    """Run step(model, optimizer) once; return the gradients the optimizer used (flat), the parameters after the step
    (flat) and the gradients' dtypes (chapter 03)."""
    dtypes: list[torch.dtype] = []
    handle = optimizer.register_step_pre_hook(lambda *_: dtypes.extend(p.grad.dtype for p in model.parameters()))
    try:
        with captured_grads(optimizer) as seen:
            step(model, optimizer)
    finally:
        handle.remove()
    return seen[0], flat(model), dtypes


def forward_activation_bytes(model: torch.nn.Module, batch, precision: str = "fp32") -> int:
    """Return the bytes one forward pass leaves alive for backward (meter count after minus before)."""
    device = next(model.parameters()).device
    with MemoryMeter(device=device, timeline=False) as meter:
        meter.track(model, *[t for t in batch if isinstance(t, torch.Tensor)])
        before = meter.current_bytes
        with autocast(precision, device):
            loss = model(*batch)[1]  # logits dropped: only what the graph keeps stays alive
        after = meter.current_bytes
    del loss
    return after - before


@dataclass(frozen=True)
class Fp16CastStats:
    """What casting fp32 values (times a loss scale) to fp16 does to the nonzero ones."""

    scale: float  # the loss scale the values were multiplied by before the cast
    nonzero: int  # nonzero fp32 values examined
    zero_fraction: float  # share that became exactly 0 in fp16 (flushed to zero: the value is lost)
    subnormal_fraction: float  # share that became fp16 subnormals (nonzero, below 2^-14: fewer mantissa bits)
    overflow_fraction: float  # share that became ±inf in fp16 (above 65504)
    below_min_subnormal_fraction: float  # share with |scale·g| < 2^-24: flushed to zero, or rounded up to 2^-24
    normal_fraction: float = 0.0  # share that became finite normal fp16 numbers: with zero, subnormal and overflow, 1

    @property
    def bins(self) -> dict[str, float]:
        """Return the disjoint shares by what the cast gave: they sum to 1 (chapter 03)."""
        return {"flushed to zero": self.zero_fraction, "subnormal": self.subnormal_fraction,
                "normal": self.normal_fraction, "overflow": self.overflow_fraction}


def fp16_cast_stats(values: torch.Tensor, scale: float = 1.0) -> Fp16CastStats:
    """Cast scale·values to fp16 and count the nonzero fp32 values flushed to 0, made subnormal, or overflowed."""
    check_float("scale", scale, 0.0, torch.finfo(torch.float32).max, lo_open=True)  # fp32's: the zeros stay zeros
    x = values.detach().flatten().float()
    n = int(torch.count_nonzero(x))  # the zeros stay zeros: counted below with the flushed ones, then taken off
    if n == 0:
        return Fp16CastStats(float(scale), 0, 0.0, 0.0, 0.0, 0.0)
    v = x * scale  # (N,) fp32; a power-of-two scale is exact
    h = v.to(torch.float16)  # round to nearest even; |v| <= 2^-25 flushes to 0, |v| >= 65520 overflows
    bits = h.view(torch.int16) & 0x7FFF  # the magnitude's bits: 0 zero, below 0x0400 subnormal, 0x7C00 inf, above NaN
    zeros = x.numel() - n
    zero = int(torch.count_nonzero(bits == 0)) - zeros
    sub = int(torch.count_nonzero(bits < _FP16_NORMAL_BITS)) - zeros - zero
    finite = int(torch.count_nonzero(bits < _FP16_INF_BITS)) - zeros  # (integer compares: fp16's are slow on CPUs)
    inf = int(torch.count_nonzero(bits == _FP16_INF_BITS))
    below = int(torch.count_nonzero(v.abs() < FP16_MIN_SUBNORMAL)) - zeros
    normal = finite - zero - sub  # counted, not the rest: a NaN is in no bin
    return Fp16CastStats(float(scale), n, zero / n, sub / n, inf / n, below / n, normal / n)


@dataclass
class GradientSample:
    """Real fp32 gradients of a model: its weights' gradients and its blocks' output gradients."""

    weights: torch.Tensor  # (N_w,) every parameter-gradient value of every collected step
    activations: torch.Tensor  # (N_a,) every gradient of a block output, of every collected step
    losses: list  # the loss of each step


def collect_gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches) -> GradientSample:
    """Train one fp32 step per batch and return the weight and block-output gradients."""
    weights, acts, losses = [], [], []
    hooks = []

    def keep_output_grad(module, args, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda g: acts.append(g.detach().flatten().clone()))

    for block in blocks_of(model):
        hooks.append(block.register_forward_hook(keep_output_grad))
    try:
        for batch in batches:
            _, loss = model(*batch)
            loss.backward()
            losses.append(float(loss.detach()))
            weights.append(flat(p.grad for p in model.parameters()))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        for h in hooks:
            h.remove()
    return GradientSample(torch.cat(weights).float(), torch.cat(acts).float(), losses)


def log2_magnitudes(values: torch.Tensor) -> torch.Tensor:
    """Return log2|v| of the nonzero values (for histograms against fp16's 2^-24 and 2^-14)."""
    v = values.detach().flatten().float()
    return v[v != 0].abs().log2()


def lost_update_fraction(weights: torch.Tensor, update: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> float:
    """Return the share of nonzero updates that vanish when the weights are held in `dtype` (w + Δ == w)."""
    w = weights.detach().flatten().to(dtype)
    d = update.detach().flatten()
    mask = d != 0
    if not bool(mask.any()):
        return 0.0
    new = (w.float() + d.float()).to(dtype)  # the update applied to the 16-bit weight, rounded back
    return float((new[mask] == w[mask]).float().mean())


def op_result_dtypes(fn) -> dict[str, set[str]]:
    """Run fn() under a dispatch mode and return {op name: dtype names of its floating-point results} (chapter 03)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from labkit.saved import short_dtype_name

    seen: dict[str, set[str]] = {}

    class Note(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    seen.setdefault(func.overloadpacket.__name__, set()).add(short_dtype_name(t.dtype))
            return out

    with Note():
        fn()
    return seen


def ops_by_dtype(seen: dict[str, set[str]]) -> dict[str, list[str]]:
    """Group op names by the dtypes of their results, e.g. {"bf16": ["addmm", ...], "bf16+fp32": [...]} (chapter 03)."""
    groups: dict[str, list[str]] = {}
    for name in sorted(seen):
        groups.setdefault("+".join(sorted(seen[name])), []).append(name)
    return dict(sorted(groups.items()))


@dataclass(frozen=True)
class CurveGap:
    """How far a 16-bit loss curve ends from fp32's, set beside how far fp32's loss fell (chapter 03)."""

    steps: int  # steps in each curve
    tail: int  # last steps averaged for each final loss (one step's loss is noisy)
    start_loss: float  # fp32's loss at the first step
    final_fp32: float  # mean of fp32's last `tail` losses
    final_other: float  # mean of the other curve's last `tail` losses
    fall: float  # start_loss - final_fp32: how far fp32's loss fell
    gap: float  # |final_other - final_fp32|

    @property
    def rel_diff(self) -> float:
        """Return the gap relative to fp32's final loss."""
        return self.gap / self.final_fp32

    def follows(self, share: float) -> bool:
        """Return whether the loss fell and the gap is within `share` of that fall."""
        return self.fall > 0 and self.gap <= share * self.fall


def curve_gap(fp32_losses, other_losses, tail: int) -> CurveGap:
    """Compare two loss curves of the same steps: final means over the last `tail` steps, and fp32's fall (chapter 03)."""
    if len(fp32_losses) != len(other_losses) or not fp32_losses:
        raise ValueError(f"two curves of the same nonzero length needed, got {len(fp32_losses)} and {len(other_losses)}")
    if not 1 <= tail <= len(fp32_losses):
        raise ValueError(f"tail must be 1..{len(fp32_losses)}, got {tail}")
    end32 = sum(fp32_losses[-tail:]) / tail
    end = sum(other_losses[-tail:]) / tail
    return CurveGap(len(fp32_losses), tail, float(fp32_losses[0]), end32, end, fp32_losses[0] - end32, abs(end - end32))


def forward_loss(model: torch.nn.Module, batch, precision: str = "fp32") -> torch.Tensor:
    """Return the loss of one forward pass of `model` on `batch` under autocast at `precision` (chapter 03)."""
    with autocast(precision, next(model.parameters()).device):
        return model(*batch)[1]


def count_fake_step(step, cfg, dtype: torch.dtype | None, batch_size: int, seq_len: int) -> Work:
    """Count one `step(model, optimizer, batch, dtype)` with Adam on fake tensors: shapes and dtypes (chapter 03)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_model(cfg)  # fake parameters: the same shapes and dtypes as the real model's
        optimizer = make_optimizer("adam", model.parameters())
        create_optimizer_state(optimizer)  # Adam's moments, as after the first step
        batch = tuple(torch.zeros(batch_size, seq_len, dtype=torch.long) for _ in range(2))  # inputs, targets
        return count_work(step, model, optimizer, batch, dtype)


def count_scaled_step(step, cfg, dtype: torch.dtype, batch_size: int, seq_len: int, seed: int = 0,
                      device: torch.device | str = "cpu") -> Work:
    """Count one `step(model, optimizer, batch, dtype, scaler)` with Adam and a GradScaler (chapter 03)."""
    device = torch.device(device)
    model = seeded_model(cfg, seed, device)  # real tensors: the scaler reads its inf check on the host
    optimizer = make_optimizer("adam", model.parameters())
    create_optimizer_state(optimizer)  # Adam's moments, as after the first step
    batch = tuple(torch.zeros(batch_size, seq_len, dtype=torch.long, device=device) for _ in range(2))  # inputs, targets
    return count_work(step, model, optimizer, batch, dtype, torch.amp.GradScaler(device.type))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Return the bytes of an optimizer's state tensors, scalars such as Adam's step left out (chapter 03)."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def params_grads_state_bytes(params, optimizer: torch.optim.Optimizer) -> int:
    """Return the bytes of `params`, of their gradients and of the optimizer's state tensors (chapter 03)."""
    tensors = [t for p in params for t in (p, p.grad) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors) + optimizer_state_bytes(optimizer)
