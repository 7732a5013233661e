"""GPUs to project onto: datasheet rates, an achieved fraction of peak from published runs, and a step's time on them.

`step_time(work, gpu)` turns a step's counted work (labkit.work) into a time on a GPU: the roofline (every unit at its
datasheet peak, a lower bound) and, where a published run gives one, an estimate at that run's achieved fraction of
peak (chapters 00-10, the planner). `measure_cpu` profiles this CPU alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from labkit.cpu import bf16_native
from labkit.hostlink import copy_bandwidth
from labkit.throughput import fastest_s
from labkit.validate import ParameterError, check_choice
from labkit.work import Work

GiB = 2**30
TERA = 10**12
GB = 10**9


@dataclass(frozen=True)
class Efficiency:
    """The share of peak a published run achieved, counted as labkit.work counts (recomputation included)."""

    fraction: float  # the run's counted FLOPs per second over the datasheet peak of its precision
    source: str  # the run (labkit/data/published_runs.json id), its tokens/s and counted FLOPs per token
    check: str  # a different published run the fraction predicts (tests/test_gpus.py): its tokens/s, the prediction


# fms-fsdp's Llama 2 7B (no checkpointing, local batch 2 x 4096, bf16, eager) counts 47.16 GFLOP per token by
# labkit.work (torch's formulas: 6 N and attention's products, its backward recomputing the scores); tokens/s times
# that over the bf16 peak is the fraction. tests/test_gpus.py derives both again from labkit/data/published_runs.json.
A100_EFFICIENCY = Efficiency(0.559, "FMS-7B-A100-noAC-eager: 3,700 tokens/s per A100 x 47.16 GFLOP/token / 312 TFLOP/s",
                             "TT-A100-L2-13B-noAC-eager: 2,162 tokens/s published, 1,963 predicted (-9%)")
H100_EFFICIENCY = Efficiency(0.358, "FMS-7B-H100-noAC-eager: 7,500 tokens/s per H100 x 47.16 GFLOP/token / 989 TFLOP/s",
                             "TT-165-FSDP2-AC-eager: 6,100-6,300 tokens/s published, 6,492 predicted (+3% to +6%)")


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
    efficiency: Efficiency | None = None  # a published run's achieved fraction of peak on this GPU class (None: none
    #   published that we could cite: the roofline bound only)
    gpus_per_node: int = 8  # GPUs one server holds: beyond it, rings cross the network
    node_bytes_per_s: float = 100 / 8 * GB / 8  # network per GPU, one direction (default: one 100 Gb/s NIC per
    #   8-GPU server, a cloud PCIe instance's; an NVLink server's figures below: one InfiniBand NIC per GPU)

    def link_bytes_per_s(self, ranks: int) -> float:
        """Return the bandwidth a ring over `ranks` GPUs runs at, per GPU and direction: device-to-device within a
        server; beyond it each GPU's share of the network, when slower (NCCL's rings cross servers on it)."""
        return self.peer_bytes_per_s if ranks <= self.gpus_per_node else min(self.peer_bytes_per_s,
                                                                           self.node_bytes_per_s)

    @property
    def half(self) -> str:
        """Return the 16-bit format this device computes in: bf16 where it has it, else fp16 (with a GradScaler)."""
        return "bf16" if "bf16" in self.flops_per_s else "fp16"

    def __post_init__(self):
        if "fp32" not in self.flops_per_s or any(v <= 0 for v in self.flops_per_s.values()):
            raise ParameterError(f"flops_per_s must give fp32 and positive rates, got {self.flops_per_s}")
        for name in ("memory_bytes", "memory_bytes_per_s", "host_bytes_per_s", "peer_bytes_per_s",
                     "host_memory_bytes_per_s", "gpus_per_node", "node_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ParameterError(f"{name} must be > 0, got {getattr(self, name)}")


PCIE3 = 16 * GB  # PCIe 3.0 x16, one direction
PCIE4 = 32 * GB  # PCIe 4.0 x16, one direction
PCIE5 = 64 * GB  # PCIe 5.0 x16, one direction

DGX_A100_NIC = 200 / 8 * GB  # NVIDIA DGX A100 user guide: one 200 Gb/s HDR InfiniBand NIC per GPU (8 per server)
DGX_H100_NIC = 400 / 8 * GB  # NVIDIA DGX H100 user guide: one 400 Gb/s NDR InfiniBand NIC per GPU (8 per server)

# Dense (no sparsity) tensor-core figures with fp32 accumulation; fp32 is the non-tensor (no TF32) rate. Memory: what
# CUDA offers a process, as torch reports it (`get_device_properties().total_memory`, the "total capacity" of its
# out-of-memory message), not the datasheet's GB: the driver keeps the rest (ECC, its own reservations), 1-8% of the
# card, more than the planner's reserve could spare. Cited per card; drivers differ by up to ~0.3 GiB.
GPUS = {
    # NVIDIA T4 datasheet: 16 GB GDDR6 (nvidia-smi: 15,360 MiB, ECC on; torch: "a total capacity of 14.75 GiB" on
    # Colab's T4, hpcaitech/Open-Sora#697), 320 GB/s, fp32 8.1 TFLOPS, fp16 tensor 65 TFLOPS; no bf16; PCIe 3.0
    # (a T4 server, AWS g4dn.12xlarge: 4 GPUs, 50 Gb/s)
    "t4": DeviceProfile("t4", round(14.75 * GiB), {"fp32": 8.1 * TERA, "fp16": 65 * TERA}, 320 * GB, PCIE3, PCIE3,
                        gpus_per_node=4, node_bytes_per_s=50 / 8 * GB / 4),
    # NVIDIA L4 datasheet: 24 GB (torch: 22.05 GiB, vllm-project/vllm#20214, vLLM's CI L4), 300 GB/s, fp32 30.3
    # TFLOPS, bf16/fp16 tensor 121 TFLOPS dense (242 sparse); PCIe 4.0
    "l4": DeviceProfile("l4", round(22.05 * GiB), {"fp32": 30.3 * TERA, "bf16": 121 * TERA, "fp16": 121 * TERA},
                        300 * GB, PCIE4, PCIE4),
    # NVIDIA A10 datasheet (AWS's A10G publishes no per-format figures): 24 GB (torch on an AWS g5 A10G: 22.20 GiB,
    # XavierXiao/Dreambooth-Stable-Diffusion#18), 600 GB/s, fp32 31.2 TFLOPS, bf16/fp16 tensor 125 TFLOPS dense
    # (250 sparse); PCIe 4.0
    "a10g": DeviceProfile("a10g", round(22.20 * GiB), {"fp32": 31.2 * TERA, "bf16": 125 * TERA,
                                                       "fp16": 125 * TERA}, 600 * GB, PCIE4, PCIE4),
    # NVIDIA Ada (AD102) whitepaper, RTX 4090: 24 GB (torch: 23.64 GiB, ali-vilab/VGen#104), 1008 GB/s, fp32 82.6
    # TFLOPS, fp16/bf16 tensor with fp32 accumulate 165.2 TFLOPS dense; PCIe 4.0, no NVLink
    "rtx4090": DeviceProfile("rtx4090", round(23.64 * GiB), {"fp32": 82.6 * TERA, "bf16": 165.2 * TERA,
                                                             "fp16": 165.2 * TERA}, 1008 * GB, PCIE4, PCIE4),
    # NVIDIA A100 datasheet (SXM): 40 GB HBM2 (CUDA's deviceQuery on an A100-SXM4-40GB: 42,298,834,944 B,
    # bottlerocket-os/bottlerocket#3873) 1555 GB/s; fp32 19.5 TFLOPS, bf16/fp16 tensor 312 TFLOPS dense;
    # NVLink 600 GB/s (both directions: 300 each way); PCIe 4.0
    "a100-40gb": DeviceProfile("a100-40gb", 42_298_834_944, {"fp32": 19.5 * TERA, "bf16": 312 * TERA,
                                                              "fp16": 312 * TERA}, 1555 * GB, PCIE4, 300 * GB,
                               efficiency=A100_EFFICIENCY, node_bytes_per_s=DGX_A100_NIC),
    # NVIDIA A100 datasheet (SXM): 80 GB HBM2e (deviceQuery on an A100-SXM4-80GB: 85,198,045,184 B, gist gengwg/
    # 3520df2ebf8872e5ee4818367e3a4122; torch reported 79.14 GiB on another, lianqi1008/Control-GIC#6) 2039 GB/s;
    # otherwise as the 40 GB card
    "a100-80gb": DeviceProfile("a100-80gb", 85_198_045_184, {"fp32": 19.5 * TERA, "bf16": 312 * TERA,
                                                              "fp16": 312 * TERA}, 2039 * GB, PCIE4, 300 * GB,
                               efficiency=A100_EFFICIENCY, node_bytes_per_s=DGX_A100_NIC),
    # NVIDIA H100 datasheet (SXM): 80 GB HBM3 (nvidia-smi 81,559 MiB; torch "a total capacity of 79.11 GiB",
    # vllm-project/vllm#27508) 3.35 TB/s; fp32 67 TFLOPS, bf16/fp16 tensor 989 TFLOPS dense
    # (1979 sparse); NVLink 900 GB/s (450 each way); PCIe 5.0
    "h100": DeviceProfile("h100", round(79.11 * GiB), {"fp32": 67 * TERA, "bf16": 989 * TERA, "fp16": 989 * TERA},
                          3350 * GB, PCIE5, 450 * GB, efficiency=H100_EFFICIENCY, node_bytes_per_s=DGX_H100_NIC),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e (nvidia-smi 143,771 MiB; torch 139.8 GiB: the H200 of `make gpu-check`,
    # data/gpu_run_h200.json) 4.8 TB/s; compute and links as the H100 SXM
    "h200": DeviceProfile("h200", round(139.8 * GiB), {"fp32": 67 * TERA, "bf16": 989 * TERA, "fp16": 989 * TERA},
                          4800 * GB, PCIE5, 450 * GB, node_bytes_per_s=DGX_H100_NIC),
}


def measure_cpu(n: int = 1024, repeats: int = 3) -> DeviceProfile:
    """Return this CPU's profile: RAM, matmul FLOP/s (fp32, and bf16) and copy bandwidth, timed by labkit.throughput.

    bf16 on a CPU without bf16 units (labkit.cpu.bf16_native) is timed at n/2: its generic kernels take tens of times
    fp32's time, and no step is timed against that rate there (chapter 09 times its fp32 rows only).
    """
    flops = {}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        size = n if precision == "fp32" or bf16_native() else n // 2
        a = torch.randn(size, size, dtype=dtype)
        flops[precision] = 2 * size**3 / fastest_s(lambda: a @ a, repeats, "cpu")
    src = torch.empty(64 * 2**20, dtype=torch.uint8)
    bandwidth = copy_bandwidth(torch.empty_like(src), src, repeats)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return DeviceProfile("cpu", memory, flops, bandwidth, bandwidth, bandwidth, bandwidth)


CUDA_NAMES = {"t4": ("T4",), "l4": ("L4",), "a10g": ("A10G", "A10"), "rtx4090": ("4090",),
              "a100-40gb": ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"),
              "a100-80gb": ("A100-SXM4-80GB", "A100 80GB", "A100-PCIE-80GB"), "h100": ("H100",), "h200": ("H200",)}


def cuda_profile(device: str | torch.device = "cuda") -> DeviceProfile:
    """Return the profile of the CUDA device a chapter runs on, matched by its name (ParameterError if none matches),
    with the memory this card offers (its `total_memory`: the driver's version and ECC move it)."""
    props = torch.cuda.get_device_properties(torch.device(device))
    name = props.name
    for part, key in sorted(((p, k) for k, parts in CUDA_NAMES.items() for p in parts), key=lambda x: -len(x[0])):
        if part in name:  # the longest first: "A10" is inside "A100-SXM4-80GB"
            return replace(GPUS[key], memory_bytes=props.total_memory)
    raise ParameterError(f"GPU: no profile in labkit.gpus.GPUS matches this CUDA device ({name}); choose one of "
                         f"{tuple(GPUS)} or add its datasheet figures")


def device_profile(name: str) -> DeviceProfile:
    """Return the named GPU's datasheet profile, the CUDA device's for "cuda", or this CPU's measured one for "cpu"."""
    check_choice("gpu", name, (*GPUS, "cuda", "cpu"))
    if name == "cuda":
        return cuda_profile()
    return measure_cpu() if name == "cpu" else GPUS[name]


GPU_AUTO = "t4"  # GPU="auto" without CUDA: the GPU free notebooks (Colab, Kaggle) give
RESERVE_FRACTION = 0.10  # share of a GPU's memory held back for what tensors do not show (CUDA context, NCCL's
#                          buffers, the allocator's cache and fragmentation): the planner's default (chapter 09)


def check_gpu(param: str, value) -> DeviceProfile:
    """Return the profile a chapter's GPU parameter names: "auto" (the CUDA device this runs on, else GPU_AUTO), "cuda"
    or a key of GPUS; a ParameterError names `param` and the choices otherwise (chapters 00-10)."""
    check_choice(param, value, ("auto", "cuda", *GPUS))
    if value == "cuda" and not torch.cuda.is_available():
        raise ParameterError(f"{param}='cuda' but torch sees no CUDA device; use 'auto' or one of {tuple(GPUS)}")
    if value == "auto":
        return cuda_profile() if torch.cuda.is_available() else GPUS[GPU_AUTO]
    return device_profile(value)


# The host's time per operator when PyTorch runs eagerly: each operator is dispatched from Python and its kernel
# launched one after another, and a GPU whose kernels finish sooner waits for the next (the "overhead" regime of
# Horace He, "Making Deep Learning Go Brrrr From First Principles", 2022). No datasheet gives it: this is the
# project's recorded H200 run (data/gpu_run_h200.json: chapter 00's plain step of the running example, 12.6 ms over
# the 630 kernels labkit.work counts in it; torch 2.11.0, a 16-core Xeon host, 2026-11-30, commit c24b2a3). The same
# step timed in the first loan that day took 11.8 ms (18.7 us each) and once 9.76 ms (15.5 us): about 15-20 us on
# that host. A slower host takes longer; CUDA graphs and torch.compile's fused kernels take less.
EAGER_OPERATOR_S = 20.0e-6
GPU_RUN_PATH = Path(__file__).parent / "data" / "gpu_run_h200.json"  # that run's results.json


@dataclass(frozen=True)
class StepTime:
    """A step's time on one GPU from its counted work: the roofline (a bound) and, where published, an estimate."""

    gpu: str  # the profile's name
    compute_s: float  # each precision's FLOPs at the GPU's peak for it (16-bit FLOPs in the GPU's 16-bit format)
    memory_s: float  # the bytes operators read and write at the memory bandwidth
    host_s: float  # the bytes over the host link at its one-way bandwidth
    comm_s: float  # the bytes sent to other GPUs at the peer bandwidth
    fraction: float | None  # the GPU class's achieved fraction of peak (DeviceProfile.efficiency), None: unpublished
    launch_s: float = 0.0  # a GPU's operators one after another at EAGER_OPERATOR_S each: its host's time (0 on a CPU)

    @property
    def launch_bound(self) -> bool:
        """Return whether the host's launches take longer than the GPU's own work: an overhead-bound step."""
        return self.launch_s > self.device_s

    @property
    def with_launches_s(self) -> float:
        """Return the step's time with the host's launches counted: the longer of them and `time_s`."""
        return max(self.launch_s, self.time_s)

    @property
    def bound_s(self) -> float:
        """Return the roofline: every unit at its peak, transfers overlapped with compute; no step runs faster."""
        return max(self.compute_s, self.memory_s, self.host_s, self.comm_s)

    @property
    def time_s(self) -> float:
        """Return the estimate where a published run gives the GPU's achieved share of peak, else the roofline."""
        return self.bound_s if self.fraction is None else self.estimate_s

    @property
    def estimate_s(self) -> float | None:
        """Return compute and memory at the published run's achieved fraction, transfers overlapped (None: no run)."""
        if self.fraction is None:
            return None
        return max(self.device_s, self.host_s, self.comm_s)

    @property
    def device_s(self) -> float:
        """Return the step's own time on the GPU, transfers left out: its FLOPs or its bytes, the larger, at the
        published run's achieved fraction where there is one (chapters 04 and 05 set the copies beside it)."""
        own = max(self.compute_s, self.memory_s)
        return own if self.fraction is None else own / self.fraction

    @property
    def in_line_s(self) -> float:
        """Return the time with the transfers in line, not overlapped: the step's own time, then its copies."""
        return self.device_s + self.host_s + self.comm_s


def step_time(work: Work, gpu: str | DeviceProfile) -> StepTime:
    """Return the StepTime of `work` on `gpu` (a key of GPUS, "cuda" or a DeviceProfile)."""
    device = gpu if isinstance(gpu, DeviceProfile) else device_profile(gpu)
    compute_s = 0.0
    for precision, flops in work.flops.items():
        rate = device.flops_per_s.get(precision)
        if rate is None:  # bf16 FLOPs on a GPU without bf16 (a T4): they run in fp16 there, as half_precision picks
            rate = device.flops_per_s[device.half] if precision in ("bf16", "fp16") else device.flops_per_s["fp32"]
        compute_s += flops / rate
    return StepTime(device.name, compute_s, work.bytes_accessed / device.memory_bytes_per_s,
                    work.host_bytes / device.host_bytes_per_s, work.sent_bytes / device.peer_bytes_per_s,
                    None if device.efficiency is None else device.efficiency.fraction,
                    0.0 if device.name == "cpu" else work.kernels * EAGER_OPERATOR_S)  # a CPU runs what it dispatches
