"""What a GPU's memory holds beside the caching allocator's reserved bytes: the CUDA context and NCCL's buffers.

Neither passes through torch's caching allocator, so `torch.cuda.memory_reserved()` counts neither; `nvidia-smi` (and
`torch.cuda.mem_get_info`) counts both. Each is modelled as a range from the figures cited below (one measured on an
H200 here): a plan's "used" is its replayed reserved peak plus this range (chapter 09, `make plan --reserved`).

Assumed: one training process per GPU, one NCCL communicator (data parallelism's process group: no HSDP, tensor or
context parallel groups), NCCL 2.22 or later with its defaults (rings, trees and NVLS connected when first used; no
NCCL_* settings), GPUs of one NVLink server. Past one server, or between PCIe GPUs, NCCL's buffers are not modelled.

Sources (read for this module; the arithmetic is in the comments):
- the context: pytorch/pytorch PR #86509 (lazy module loading, torch's default since 1.13: 287,047,680 B after one
  small tensor, before cuBLAS or attention kernels load); NVIDIA/nccl#1685 (8 x H100: 1.06 GB per GPU used outside
  torch after NCCL's start-up, before any all-to-all). With lazy loading the context grows as kernels first run
  (CUDA Programming Guide, "Lazy Loading"). nccl#1685's figure, the lowest published for a process with NCCL started,
  is the low end of such a process's context; it does not say whether that process had connected its rings already
  (if it had, the low end counts their fewest channels' buffers twice: it leans high). vLLM reports 1.79 GiB outside
  torch for one H100 serving a model (vllm PR #10511): an inference server's libraries, higher still.
- NCCL: its source (`src/transport/p2p.cc`, `src/include/device.h`, `src/transport/nvls.cc`, NCCL 2.22 on) and
  nccl#1685's measured buffers (10,485,760 and 2,097,152 B per channel).
- Measured here (`make gpu-check`'s session, 2026-12-04; one H200, torch 2.11.0+cu130, NCCL 2.28.9): `mem_get_info`'s
  used minus `memory_reserved()` was 618.8 MiB after one small tensor, 766.8 MiB after three bf16 steps of GPT-2 small
  (inside the context's range), and 1,324.8 MiB after NCCL started (`init_process_group` with `device_id`) and three
  FSDP2 steps on one rank: NCCL's start-up alone, before any connection to a peer, took 558 MiB there, and the whole
  stood above nccl#1685's 1.06 GB. A process with a process group is given that figure as its context's high end. With
  one rank NCCL connects no peer, so that figure holds none of the connection buffers modelled below: they add to it.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20

CONTEXT_BYTES = (287_047_680, 1_060_000_000)  # the CUDA context: at start-up with lazy loading (PR #86509), and
#   the 8 x H100 figure that holds it after NCCL's start-up (nccl#1685): the context grows as kernels load
NCCL_PROCESS_BYTES = round(1324.8 * MiB)  # a process's context once NCCL has started, no peers connected yet: measured
#   to 0.1 MiB on one H200 (the module's docstring); the high end of the context of every process with a process group
P2P_CHANNEL_BYTES = 12 * MiB  # one ring channel's connection: a 10 MiB receive buffer (LL 512 KiB + LL128 4,915,200 B
#   + SIMPLE 4 MiB, rounded up to CUDA_IPC_MIN, 2 MiB) and a 2 MiB send buffer (p2p.cc; measured in nccl#1685)
RING_CHANNELS = (24, 32)  # ring channels NCCL opens between NVLink GPUs: no table published; 8 x H100 ring logs show
#   channel indices to 22 (nccl#1259); 32 is an upper guess (nccl#1685 saw 32 point-to-point channels per pair of
#   GPUs in an all-to-all, not a ring)
NVLINK_GPUS = ("a100-40gb", "a100-80gb", "h100", "h200")  # labkit.gpus profiles of NVLink (SXM) servers
NVLS_GPUS = ("h100", "h200")  # NVSwitch servers whose GPUs support multicast: NCCL's NVLS algorithm is on by default
NVLS_CHANNEL_BYTES = 2 * MiB  # per NVLS channel and head: 2 x buffSize, buffSize = 128 KiB chunks x NCCL_STEPS 8
NVLS_CHANNELS = 16  # NVLS_NCHANNELS_SM90 (nvls.cc, NCCL >= 2.22; NCCL 2.18-2.21 gave each channel a 4 MiB buffer
#   and more: 3x to 6x these bytes, and vllm#9699 measured 2.25 GiB per H200)


@dataclass(frozen=True)
class NonTensorBytes:
    """The bytes a GPU holds outside the caching allocator for one training process: each a (low, high) range."""

    context: tuple  # the CUDA context (driver, loaded kernels)
    nccl: tuple  # NCCL's connection buffers for the one process group data parallelism uses (0 on one GPU)

    @property
    def total(self) -> tuple:
        """Return the (low, high) sum."""
        return self.context[0] + self.nccl[0], self.context[1] + self.nccl[1]


def non_tensor_bytes(gpu: str, ranks: int, parallel: str, gpus_per_node: int = 8) -> NonTensorBytes | None:
    """Return what `ranks` GPUs named `gpu` each hold outside the caching allocator under `parallel` (a plan's
    parallelism); None where NCCL's buffers are not modelled (past one server, or between PCIe GPUs)."""
    if ranks == 1 or parallel == "single":
        return NonTensorBytes(CONTEXT_BYTES, (0, 0))
    if ranks > gpus_per_node or gpu not in NVLINK_GPUS:
        return None
    context = (CONTEXT_BYTES[1], max(CONTEXT_BYTES[1], NCCL_PROCESS_BYTES))  # measured with NCCL started: 8 x H100
    #   (nccl#1685) and our one H200 rank
    ring = tuple(c * P2P_CHANNEL_BYTES for c in RING_CHANNELS)  # one connection per channel, each way of the ring
    high = 2 * ring[1]  # a tree's connections too, the same again: small all-reduces take it (DDP's buckets,
    #                     gradient clipping's norm, a logged loss)
    if gpu in NVLS_GPUS:  # NVLS buffers: one set per head, a head per GPU of the server (allocated when first used)
        high += ranks * NVLS_CHANNELS * NVLS_CHANNEL_BYTES
    return NonTensorBytes(context, (ring[0], high))
