"""labkit.planner.overheads: the bytes outside the caching allocator, against NCCL's and torch's documented figures."""

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
