"""Pick the compute device and describe the hardware in one line."""

from __future__ import annotations

import platform

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(name: str | torch.device = "auto", param: str = "device") -> torch.device:
    """Return the torch device for "auto" | "cpu" | "cuda" (auto: CUDA, other accelerator, CPU); errors name `param`."""
    if not isinstance(name, (str, torch.device)):
        raise TypeError(f"{param} must be one of {DEVICE_CHOICES}, got {name!r}")
    name = str(name)
    kind = name.split(":")[0]
    if kind not in DEVICE_CHOICES:
        raise ValueError(f"{param} must be one of {DEVICE_CHOICES}, got {name!r}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{param}={name!r} but torch sees no CUDA device; use 'auto' or 'cpu'")
        return torch.device(name)
    if kind == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator()
    return torch.device("cpu")


def device_memory_bytes(device: torch.device) -> int | None:
    """Return the device's total memory in bytes (None where torch cannot tell, e.g. CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


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
