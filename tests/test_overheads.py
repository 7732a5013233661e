"""labkit.planner.overheads: the bytes outside the caching allocator, against NCCL's and torch's documented figures."""

import pytest

from labkit.planner import overheads as O

MiB = 2**20


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def test_a_ring_channel_holds_nccls_three_protocol_buffers_rounded_to_its_ipc_granularity():
    # NCCL's src/include/device.h: NCCL_STEPS 8; LL: 8 lines per thread x 512 threads x 16-byte lines; LL128: 120
    # elements per thread x 640 threads x 8 bytes; SIMPLE: 1 << 22. p2p.cc rounds each side up to CUDA_IPC_MIN (2 MiB)
    ll, ll128, simple = 8 * 512 * 8 * 16, 120 * 640 * 8 * 8, 1 << 22
    recv_mem = send_mem = 4096  # sizeof(ncclRecvMem) / sizeof(ncclSendMem): a few KiB of flags and FIFO, under 2 MiB
    recv, send = _align(recv_mem + ll + ll128 + simple, 2 * MiB), _align(send_mem, 2 * MiB)
    assert (recv, send) == (10_485_760, 2_097_152)  # the two buffer sizes nccl#1685 measured on 8 x H100
    assert O.P2P_CHANNEL_BYTES == recv + send


def test_one_gpu_holds_the_context_only():
    for parallel in ("single", "ddp", "fsdp2"):
        one = O.non_tensor_bytes("h100", 1, parallel)
        assert one.nccl == (0, 0) and one.total == O.CONTEXT_BYTES


def test_nccls_buffers_grow_with_channels_a_tree_and_nvls_heads():
    lo, hi = (c * O.P2P_CHANNEL_BYTES for c in O.RING_CHANNELS)
    nvls = 8 * 16 * 2 * (128 * 1024 * 8)  # nvls.cc (NCCL >= 2.22): heads x channels x 2 x (chunk x NCCL_STEPS)
    assert nvls == 256 * MiB
    assert O.non_tensor_bytes("h100", 8, "fsdp2").nccl == (lo, 2 * hi + nvls)  # rings, a tree, NVLS on NVSwitch
    assert O.non_tensor_bytes("a100-80gb", 8, "fsdp2-reshard").nccl == (lo, 2 * hi)  # no multicast before Hopper
    assert O.non_tensor_bytes("a100-80gb", 8, "ddp").nccl == (lo, 2 * hi)
    assert O.non_tensor_bytes("h200", 4, "zero1").nccl == (lo, 2 * hi + nvls // 2)  # a head per GPU
    assert O.non_tensor_bytes("h100", 16, "fsdp2") is None  # across servers: the network's buffers, not modelled
    assert O.non_tensor_bytes("l4", 2, "ddp") is None  # PCIe GPUs: other transports, not modelled
    assert O.non_tensor_bytes("l4", 1, "single").total == O.CONTEXT_BYTES


def test_a_process_with_a_process_group_is_given_nccls_start_up_measured_on_an_h200():
    many = O.non_tensor_bytes("a100-80gb", 2, "ddp")
    assert many.context == (O.CONTEXT_BYTES[1], O.NCCL_PROCESS_BYTES) and O.NCCL_PROCESS_BYTES > O.CONTEXT_BYTES[1]
    assert many.total == (O.CONTEXT_BYTES[1] + 24 * O.P2P_CHANNEL_BYTES, O.NCCL_PROCESS_BYTES + 2 * 32 * O.P2P_CHANNEL_BYTES)
    assert many.total[0] > O.non_tensor_bytes("a100-80gb", 1, "single").total[1]  # with NCCL, more than one GPU alone at either end


OUTSIDE_THE_ALLOCATOR = """
import torch, torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from labkit.models import GPT, GPTConfig

def outside():  # what the GPU holds beyond the caching allocator's reserve
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()

half = torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16  # (a T4: fp16)

def warm(model, opt, cfg, amp):
    for _ in range(3):
        idx = torch.randint(0, cfg.vocab_size, (4, 1024), device="cuda")  # (B, T): gpu-check's batch
        with torch.autocast("cuda", half, enabled=amp):
            model(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

cfg = GPTConfig(n_layer=12, n_embd=768, n_head=12, block_size=1024, vocab_size=50304, attn="sdpa")  # GPT-2 small
model = GPT(cfg).cuda()
warm(model, torch.optim.AdamW(model.parameters(), fused=True), cfg, amp=True)
single = outside()
del model
torch.cuda.empty_cache()
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
model = GPT(cfg).cuda()
policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
for block in model.blocks:
    fully_shard(block, mp_policy=policy)
fully_shard(model, mp_policy=policy)
warm(model, torch.optim.AdamW(model.parameters(), foreach=True), cfg, amp=False)
print(single, outside())
dist.destroy_process_group()
"""


@pytest.mark.cuda
def test_what_a_gpu_holds_outside_the_allocator_is_within_the_modelled_high_ends():
    # a process of its own: CUDA's context and NCCL's start-up are per process
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", OUTSIDE_THE_ALLOCATOR], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    single, with_nccl = map(int, out.stdout.split()[-2:])
    assert 0 < single <= O.non_tensor_bytes("h100", 1, "single").context[1], single / MiB
    assert single < with_nccl <= O.non_tensor_bytes("h100", 2, "fsdp2").context[1], with_nccl / MiB
