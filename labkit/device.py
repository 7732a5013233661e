"""Pick the compute device and describe the hardware in one line."""

from __future__ import annotations

import platform

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")

_announced: set[str] = set()  # accelerators "auto" has already said it passes over, once per process


def as_device(device: str | torch.device) -> torch.device:
    """Return `device` as a torch.device, a CUDA device always with its index ("cuda" -> "cuda:<current>").

    `torch.device("cuda")` has no index, so it compares unequal to a tensor's `cuda:0` and
    `torch.cuda.set_per_process_memory_fraction` refuses it; every labkit object that keeps a device
    keeps it in this form.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_device(name: str | torch.device = "auto", param: str = "device") -> torch.device:
    """Return the torch device for "auto" | "cpu" | "cuda[:i]" (auto: CUDA, else CPU); errors name `param`.

    "auto" passes over other accelerators (Apple's mps, Intel's xpu) with a printed reason: the
    chapters measure memory on CPU and CUDA only, so choosing one would mean refusing it later.
    """
    if not isinstance(name, (str, torch.device)):
        raise TypeError(f"{param} must be one of {DEVICE_CHOICES}, got {name!r}")
    name = str(name)
    kind = name.split(":")[0]
    if kind not in DEVICE_CHOICES:
        raise ValueError(f"{param} must be one of {DEVICE_CHOICES}, got {name!r}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{param}={name!r} but torch sees no CUDA device; use 'auto' or 'cpu'")
        dev = as_device(name)
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"{param}={name!r} but torch sees {torch.cuda.device_count()} CUDA device(s) "
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
            # never pick a device the chapters then refuse: their memory figures come from labkit's meter
            # and, on a GPU, from the CUDA allocator; other accelerators (Apple's mps, xpu) are not measured
            print(f"{param}='auto': torch found a {other.type!r} accelerator, which labkit does not measure "
                  f"(its chapters support {DEVICE_CHOICES[1:]}); running on cpu instead")
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
