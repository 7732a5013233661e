"""Devices to plan for: a table of GPU datasheet figures, and this CPU measured."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from labkit.throughput import copy_bandwidth, fastest_s
from labkit.validate import ParameterError, check_choice

GiB = 2**30
TERA = 10**12
GB = 10**9


@dataclass(frozen=True)
class DeviceProfile:
    """One device's memory and rates: what a plan's memory verdict and roofline step time read."""

    name: str  # the table's key
    memory_bytes: int  # device memory
    flops_per_s: dict  # peak dense FLOP/s by precision ("fp32", "bf16", "fp16"); a precision the device lacks is absent
    memory_bytes_per_s: float  # device memory (HBM/GDDR/DRAM) bandwidth
    host_bytes_per_s: float  # host link, one direction (PCIe)
    peer_bytes_per_s: float  # device-to-device, one direction (NVLink, else PCIe)
    host_memory_bytes_per_s: float = 100 * GB  # the host's memory bandwidth (an optimizer step on the host): an
    #   assumed round figure for a GPU server's DRAM, not a datasheet's (one socket of 8-channel DDR4-3200 peaks at
    #   204.8 GB/s; a CPU Adam reaches a fraction of it); give your own with dataclasses.replace

    def __post_init__(self):
        if "fp32" not in self.flops_per_s or any(v <= 0 for v in self.flops_per_s.values()):
            raise ParameterError(f"flops_per_s must give fp32 and positive rates, got {self.flops_per_s}")
        for name in ("memory_bytes", "memory_bytes_per_s", "host_bytes_per_s", "peer_bytes_per_s",
                     "host_memory_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ParameterError(f"{name} must be > 0, got {getattr(self, name)}")


PCIE3 = 16 * GB  # PCIe 3.0 x16, one direction
PCIE4 = 32 * GB  # PCIe 4.0 x16, one direction
PCIE5 = 64 * GB  # PCIe 5.0 x16, one direction

# Dense (no sparsity) tensor-core figures with fp32 accumulation; fp32 is the non-tensor (no TF32) rate.
GPUS = {
    # NVIDIA T4 datasheet: 16 GB GDDR6 (15,360 MiB usable: nvidia-smi's total, ECC on), 320 GB/s, fp32 8.1 TFLOPS,
    # fp16 tensor 65 TFLOPS; no bf16; PCIe 3.0
    "t4": DeviceProfile("t4", 15360 * 2**20, {"fp32": 8.1 * TERA, "fp16": 65 * TERA}, 320 * GB, PCIE3, PCIE3),
    # NVIDIA L4 datasheet: 24 GB, 300 GB/s, fp32 30.3 TFLOPS, bf16/fp16 tensor 121 TFLOPS dense (242 sparse); PCIe 4.0
    "l4": DeviceProfile("l4", 24 * GiB, {"fp32": 30.3 * TERA, "bf16": 121 * TERA, "fp16": 121 * TERA},
                        300 * GB, PCIE4, PCIE4),
    # NVIDIA A10 datasheet (AWS's A10G publishes no per-format figures): 24 GB, 600 GB/s, fp32 31.2 TFLOPS,
    # bf16/fp16 tensor 125 TFLOPS dense (250 sparse); PCIe 4.0
    "a10g": DeviceProfile("a10g", 24 * GiB, {"fp32": 31.2 * TERA, "bf16": 125 * TERA, "fp16": 125 * TERA},
                          600 * GB, PCIE4, PCIE4),
    # NVIDIA Ada (AD102) whitepaper, RTX 4090: 24 GB, 1008 GB/s, fp32 82.6 TFLOPS, fp16/bf16 tensor with fp32
    # accumulate 165.2 TFLOPS dense; PCIe 4.0, no NVLink
    "rtx4090": DeviceProfile("rtx4090", 24 * GiB, {"fp32": 82.6 * TERA, "bf16": 165.2 * TERA, "fp16": 165.2 * TERA},
                             1008 * GB, PCIE4, PCIE4),
    # NVIDIA A100 datasheet (SXM): 40 GB HBM2 1555 GB/s; fp32 19.5 TFLOPS, bf16/fp16 tensor 312 TFLOPS dense;
    # NVLink 600 GB/s (both directions: 300 each way); PCIe 4.0
    "a100-40gb": DeviceProfile("a100-40gb", 40 * GiB, {"fp32": 19.5 * TERA, "bf16": 312 * TERA, "fp16": 312 * TERA},
                               1555 * GB, PCIE4, 300 * GB),
    # NVIDIA A100 datasheet (SXM): 80 GB HBM2e 2039 GB/s; otherwise as the 40 GB card
    "a100-80gb": DeviceProfile("a100-80gb", 80 * GiB, {"fp32": 19.5 * TERA, "bf16": 312 * TERA, "fp16": 312 * TERA},
                               2039 * GB, PCIE4, 300 * GB),
    # NVIDIA H100 datasheet (SXM): 80 GB HBM3 3.35 TB/s; fp32 67 TFLOPS, bf16/fp16 tensor 989 TFLOPS dense
    # (1979 sparse); NVLink 900 GB/s (450 each way); PCIe 5.0
    "h100": DeviceProfile("h100", 80 * GiB, {"fp32": 67 * TERA, "bf16": 989 * TERA, "fp16": 989 * TERA},
                          3350 * GB, PCIE5, 450 * GB),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e 4.8 TB/s; compute and links as the H100 SXM
    "h200": DeviceProfile("h200", 141 * GB, {"fp32": 67 * TERA, "bf16": 989 * TERA, "fp16": 989 * TERA},
                          4800 * GB, PCIE5, 450 * GB),
}


def measure_cpu(n: int = 1024, repeats: int = 3) -> DeviceProfile:
    """Return this CPU's profile: RAM, matmul FLOP/s (fp32, and bf16) and copy bandwidth, timed by labkit.throughput."""
    flops = {}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(n, n, dtype=dtype)
        flops[precision] = 2 * n**3 / fastest_s(lambda: a @ a, repeats, "cpu")
    src = torch.empty(64 * 2**20, dtype=torch.uint8)
    bandwidth = copy_bandwidth(torch.empty_like(src), src, repeats)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return DeviceProfile("cpu", memory, flops, bandwidth, bandwidth, bandwidth, bandwidth)


def device_profile(name: str) -> DeviceProfile:
    """Return the named GPU's datasheet profile, or this CPU's measured one for "cpu"."""
    check_choice("gpu", name, (*GPUS, "cpu"))
    return measure_cpu() if name == "cpu" else GPUS[name]
