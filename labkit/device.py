"""Pick the compute device and describe the hardware in one line."""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

from labkit.validate import ParameterError

DEVICE_CHOICES = ("auto", "cpu", "cuda")
BF16_MIN_CAPABILITY = (8, 0)  # NVIDIA GPUs compute bf16 natively from Ampere (compute capability 8.0) on

_announced: set[str] = set()  # accelerators "auto" has already said it passes over, once per process


def as_device(device: str | torch.device) -> torch.device:
    """Return `device` as a torch.device, a CUDA device always with its index ("cuda" -> "cuda:<current>")."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_device(name: str | torch.device = "auto", param: str = "device") -> torch.device:
    """Return the torch device for "auto" | "cpu" | "cuda[:i]" (auto: CUDA, else CPU, saying so over mps/xpu); raise
    ParameterError naming `param` (a notebook's "DEVICE") for any other value."""
    if not isinstance(name, (str, torch.device)):
        raise ParameterError(f"{param} must be one of {DEVICE_CHOICES}, got {name!r}")
    name = str(name)
    kind = name.split(":")[0]
    if kind not in DEVICE_CHOICES:
        raise ParameterError(f"{param} must be one of {DEVICE_CHOICES}, got {name!r}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ParameterError(f"{param}={name!r} but torch sees no CUDA device; use 'auto' or 'cpu'")
        dev = as_device(name)
        if dev.index >= torch.cuda.device_count():
            raise ParameterError(f"{param}={name!r} but torch sees {torch.cuda.device_count()} CUDA device(s) "
                                 f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
        return dev
    if kind == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return as_device("cuda")
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        other = acc.current_accelerator()
        if other is not None and other.type not in ("cpu", "cuda") and other.type not in _announced:
            _announced.add(other.type)
            print(f"{param}='auto': torch found a {other.type!r} accelerator, which labkit does not measure "
                  f"(its chapters support {DEVICE_CHOICES[1:]}); running on cpu instead")
    return torch.device("cpu")


def hardware_report(device: str | torch.device = "auto") -> str:
    """Describe the device, its memory and the torch version in one line."""
    dev = resolve_device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        what = f"cuda: {props.name}, {props.total_memory / 2**30:.1f} GiB"
    elif dev.type == "cpu":
        import os
        what = f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
        try:
            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            what += f", {pages / 2**30:.1f} GiB RAM"
        except (ValueError, OSError, AttributeError):
            pass
    else:
        what = f"{dev.type}"
    return f"{what}; torch {torch.__version__}"


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta"):
        acc = getattr(torch, "accelerator", None)
        if acc is not None:
            acc.synchronize(device)


@dataclass(frozen=True)
class HalfPrecision:
    """The 16-bit format a device trains in, and why."""

    precision: str  # "bf16" | "fp16": the name labkit.techniques.precision and the chapters use
    dtype: torch.dtype  # torch.bfloat16 | torch.float16: autocast's dtype
    needs_scaler: bool  # fp16 only: a GradScaler keeps small gradients from flushing to zero
    reason: str  # one line: the device and why this format

    def scaler(self, device: str | torch.device, init_scale: float = 2.0**16):
        """Return a fresh GradScaler for `device` (first scale `init_scale`) when this format needs one, else None."""
        return torch.amp.GradScaler(torch.device(device).type, init_scale=init_scale) if self.needs_scaler else None


def half_precision(device: str | torch.device) -> HalfPrecision:
    """Return bf16 where `device` computes it natively (CPU, CUDA >= 8.0, ROCm), else fp16 with a GradScaler."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return HalfPrecision("bf16", torch.bfloat16, False,
                             f"{dev.type}: bf16 (the workbook runs no fp16 compute on a CPU)")
    props = torch.cuda.get_device_properties(as_device(dev))
    if torch.version.hip:
        return HalfPrecision("bf16", torch.bfloat16, False, f"{props.name} (ROCm): bf16 in hardware")
    capability = (props.major, props.minor)
    if capability >= BF16_MIN_CAPABILITY:
        return HalfPrecision("bf16", torch.bfloat16, False,
                             f"{props.name} (compute capability {props.major}.{props.minor}): bf16 in hardware, "
                             "no loss scaling needed")
    need = ".".join(map(str, BF16_MIN_CAPABILITY))
    return HalfPrecision("fp16", torch.float16, True,
                         f"{props.name} (compute capability {props.major}.{props.minor}) has no bf16 arithmetic "
                         f"(it needs {need}, Ampere; torch would emulate it, slowly): fp16 with a GradScaler instead")
