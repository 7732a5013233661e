"""labkit.work: the counted work of a linear layer, attention and a block against hand counts; host and peer bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import labkit
from labkit.models import Block, GPTConfig
from labkit.techniques import hosttier
from labkit.train import create_optimizer_state
from labkit.work import Work, WorkCounter, count_work

pytestmark = pytest.mark.usefixtures("one_thread")
B, IN, OUT = 4, 8, 16  # rows, input and output features of the linear layer
F32, BF16 = 4, 2  # bytes per element


def test_a_linear_layers_forward_is_one_matmul_of_2_b_in_out_flops_reading_and_writing_each_tensor_once():
    layer = torch.nn.Linear(IN, OUT)
    x = torch.randn(B, IN)
    work = count_work(layer, x)
    assert work.flops == {"fp32": 2 * B * IN * OUT}
    assert work.kernels == 1  # addmm (the weight's transpose is a view: no kernel, no bytes)
    assert work.bytes_accessed == F32 * (OUT + B * IN + IN * OUT + B * OUT)  # bias, x, weight read; output written
    assert work.host_bytes == 0 and work.sent_bytes == 0


def test_flops_are_torchs_formulas_through_torchs_own_wrapper_for_every_operator_reached():
    """WorkCounter calls torch's formulas with the shapes it takes itself, not through torch's pytree wrapper: the
    same FLOPs as the wrapped formula, call by call, for matmuls, convolutions and the CPU's fused attention."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from labkit import work

    class Calls(TorchDispatchMode):  # every operator call a formula counts, with its output
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in work.FORMULAS:
                self.calls.append((func, args, kwargs or {}, out))
            return out

    conv, q = torch.nn.Conv2d(3, 4, 3), torch.randn(1, 2, 8, 4, requires_grad=True)
    with Calls() as seen:
        torch.nn.Linear(IN, OUT)(torch.randn(B, IN, requires_grad=True)).sum().backward()
        torch.bmm(torch.randn(2, 3, 4), torch.randn(2, 4, 5))
        torch.baddbmm(torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5))
        conv(torch.randn(2, 3, 8, 8, requires_grad=True)).sum().backward()
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    reached = {func.overloadpacket.__name__ for func, *_ in seen.calls}
    assert reached == {"addmm", "mm", "bmm", "baddbmm", "convolution", "convolution_backward",
                       "_scaled_dot_product_flash_attention_for_cpu",
                       "_scaled_dot_product_flash_attention_for_cpu_backward"}
    assert all(func.overloadpacket in work._SHAPED for func, *_ in seen.calls)  # each takes the direct call
    for func, args, kwargs, out in seen.calls:  # each takes the shapes taken here, not torch's wrapper
        assert all(work._shapes(x) is not work._OTHER for x in (args, out, tuple(kwargs.values()))), func
        wrapped = work.FORMULAS[func.overloadpacket](*args, **kwargs, out_val=out)
        assert work._flops(func, args, kwargs, out) == wrapped > 0, func


def test_forward_and_backward_of_a_linear_layer_is_three_times_its_matmul():
    """dW = dY^T x and dx = dY W: two more matmuls of the same size (the '6 N' FLOPs per token of training)."""
    layer = torch.nn.Linear(IN, OUT)
    x = torch.randn(B, IN, requires_grad=True)
    assert count_work(lambda: layer(x).sum().backward()).flops == {"fp32": 3 * 2 * B * IN * OUT}


def test_under_bf16_autocast_the_matmul_counts_as_bf16_and_the_casts_as_kernels_and_bytes():
    layer = torch.nn.Linear(IN, OUT)
    x = torch.randn(B, IN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        work = count_work(layer, x)
    assert work.flops == {"bf16": 2 * B * IN * OUT}
    assert work.kernels == 4  # three casts (bias, x, weight) and the matmul
    casts = (F32 + BF16) * (OUT + B * IN + IN * OUT)  # each cast reads fp32 and writes bf16
    assert work.bytes_accessed == casts + BF16 * (OUT + B * IN + IN * OUT + B * OUT)


@pytest.mark.parametrize("b, h, s, d", [(2, 4, 16, 8), (1, 2, 32, 16)])
def test_attention_counts_its_two_products_forward_and_five_backward(b, h, s, d):
    """QK^T and PV forward (4 b h s^2 d); backward recomputes QK^T, then dV, dP, dQ, dK (torch's formula: 10 b h s^2 d).

    On a CPU, SDPA runs `_scaled_dot_product_flash_attention_for_cpu`, which torch's registry leaves out.
    """
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    forward = count_work(F.scaled_dot_product_attention, q, k, v, is_causal=True)
    assert forward.flops == {"fp32": 4 * b * h * s * s * d}
    whole = count_work(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
    assert whole.flops == {"fp32": (4 + 10) * b * h * s * s * d}
    manual = count_work(lambda: (q @ k.transpose(-2, -1)).softmax(-1) @ v)  # the same products written out
    assert manual.flops == forward.flops


@pytest.mark.parametrize("b, h, s, d", [(2, 4, 16, 8), (1, 2, 32, 16)])
def test_attention_moves_its_inputs_outputs_and_scores_each_once(b, h, s, d):
    """Fused (SDPA on a CPU): reads Q, K, V, writes the output and its fp32 logsumexp (b h s), never the s x s scores.
    Written out: QK^T writes the scores, softmax reads and writes them, PV reads them: matmul's reshapes of its
    bmm outputs (_unsafe_view) are views, no kernel and no bytes."""
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    fused = count_work(F.scaled_dot_product_attention, q, k, v, is_causal=True)
    assert fused.bytes_accessed == F32 * (4 * b * h * s * d + b * h * s) and fused.kernels == 1
    manual = count_work(lambda: (q @ k.transpose(-2, -1)).softmax(-1) @ v)
    assert manual.bytes_accessed == F32 * (4 * b * h * s * d + 4 * b * h * s * s) and manual.kernels == 3


def test_a_blocks_forward_reads_each_weight_once_and_moves_38_n_c_activation_elements():
    """A GPT-2 block (fused attention) on N = B T tokens of width C, H heads, element by element read + written:
    norms 2 (2NC + 2C + 2N: x, weight, bias in; y, mean, rstd out); qkv 3C + NC + 3C^2 + 3NC; attention 4NC + NH;
    proj C + 2NC + C^2; residual adds 2 x 3NC; MLP up 4C + 5NC + 4C^2, GELU 8NC, down C + 5NC + 4C^2.
    Together 38 NC + 12 C^2 (every weight once) + 13 C (biases, norms) + 4N + NH, in ten kernels."""
    Bt, T, C, H = 2, 16, 32, 4
    N = Bt * T
    block = Block(GPTConfig(n_layer=1, n_embd=C, n_head=H, block_size=T, attn="sdpa"))
    work = count_work(block, torch.randn(Bt, T, C))
    assert work.bytes_accessed == F32 * (38 * N * C + 12 * C * C + 13 * C + 4 * N + N * H)
    assert work.kernels == 10


def test_in_place_operators_count_what_they_write_once():
    """copy_ reads its source and writes its destination (not read); a foreach update reads and writes its list
    though it returns nothing; fused Adam reads and writes parameters and both moments, reads the gradients."""
    a, b = torch.randn(64), torch.randn(64)
    assert count_work(a.copy_, b).bytes_accessed == 2 * F32 * 64
    xs, ys = [torch.randn(64) for _ in range(3)], [torch.randn(64) for _ in range(3)]
    assert count_work(torch._foreach_add_, xs, ys).bytes_accessed == 3 * 3 * F32 * 64  # x read, y read, x written
    params = [torch.randn(64, requires_grad=True) for _ in range(2)]
    opt = torch.optim.Adam(params, fused=True)
    create_optimizer_state(opt)  # (it leaves no gradient)
    for p in params:
        p.grad = torch.randn(64)
    work = count_work(opt.step)  # the step counts' foreach add, then one _fused_adam_ (its profiler markers: none)
    steps = 2 * F32  # the step counts, one fp32 scalar tensor per parameter: read and written by the add, read by Adam
    assert work.bytes_accessed == 2 * (2 * 3 + 1) * F32 * 64 + 3 * steps and work.kernels == 2


@pytest.mark.parametrize("attn, backward_attention", [("manual", 2 * 4), ("sdpa", 10)])
def test_a_blocks_work_is_24_b_t_c2_plus_4_b_t2_c_forward_and_three_times_the_matmuls_with_backward(
        attn, backward_attention):
    """qkv 6 B T C^2, proj 2, MLP up and down 8 each; attention's QK^T and PV 2 B T^2 C each. Elementwise ops,
    norms and softmax have no formula in torch's counter: they count bytes and kernels, no FLOPs."""
    Bt, T, C = 2, 16, 32
    cfg = GPTConfig(n_layer=1, n_embd=C, n_head=4, block_size=T, attn=attn)
    block = Block(cfg)
    x = torch.randn(Bt, T, C, requires_grad=True)
    forward = count_work(block, x)
    assert forward.flops == {"fp32": 24 * Bt * T * C * C + 4 * Bt * T * T * C}
    whole = count_work(lambda: block(x).sum().backward())
    assert whole.flops == {"fp32": 3 * 24 * Bt * T * C * C + (4 + backward_attention) * Bt * T * T * C}
    assert whole.kernels > forward.kernels >= 10 and whole.bytes_accessed > 2 * forward.bytes_accessed  # 10: the sdpa block


def test_copies_over_the_host_link_count_as_host_bytes_not_as_device_traffic():
    t = torch.randn(64, 32)
    with WorkCounter() as counter:
        h = hosttier.to_host(t)
        back = hosttier.to_device(h, "cpu")
    work = counter.work()
    assert work.host_bytes == 2 * t.numel() * F32 and torch.equal(back, t)
    assert work.bytes_accessed == 0 and work.kernels == 2  # each copy is one launch (a cudaMemcpyAsync)
    with WorkCounter() as outer, WorkCounter() as inner:  # nested counters both see it
        hosttier.to_host(t)
    assert outer.work().host_bytes == inner.work().host_bytes == t.numel() * F32
    assert outer.work().kernels == inner.work().kernels == 1


def test_a_host_copy_is_a_kernel_only_while_the_counter_counts_kernels():
    """The planner stops counting bytes and kernels at the optimizer step: a copy there adds host bytes only."""
    t = torch.randn(8, 4)
    with WorkCounter() as counter:
        counter.counting_bytes = False
        hosttier.to_host(t)
    assert counter.work().kernels == 0 and counter.work().host_bytes == t.numel() * F32
    with WorkCounter() as counter:
        y = t * 2  # one operator
        hosttier.to_device(hosttier.to_host(y), "cpu")
    assert counter.work().kernels == 3 and counter.counting_bytes  # the multiply and two copies; counting resumes


def test_work_adds_and_scales_by_micro_batches():
    a = Work({"fp32": 10}, 100, 2, 8, 4.0)
    b = Work({"fp32": 1, "bf16": 6}, 50, 1, 0, 0.0)
    assert a + b == Work({"fp32": 11, "bf16": 6}, 150, 3, 8, 4.0)
    assert 3 * b == b * 3 == Work({"fp32": 3, "bf16": 18}, 150, 3, 0, 0.0)
    assert (a + b).total_flops == 17
    assert dataclasses.replace(a, flops={}).total_flops == 0


def test_a_step_on_fake_tensors_counts_what_the_same_step_counts_on_real_ones():
    """Fake tensors ask for metadata through the dispatcher (prim.device): no data moves, nothing is counted."""
    ex = labkit.running_example(n_layer=2, batch_size=4, seq_len=16)

    def step(model, optimizer, batch):
        _, loss = model(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def built():
        torch.manual_seed(0)
        model = labkit.build_model(ex.config)
        optimizer = labkit.make_optimizer("adam", model.parameters())
        create_optimizer_state(optimizer)
        return model, optimizer, tuple(torch.zeros(4, 16, dtype=torch.long) for _ in range(2))

    real = count_work(step, *built())
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = count_work(step, *built())
    assert fake == real and real.kernels > 0 and real.bytes_accessed > 0


def test_a_dtensors_operators_count_on_this_ranks_shard_and_its_collectives():
    """Rank 0 of 2 (a fake group in this process) holding half of each matrix: an elementwise op on a sharded DTensor
    reads and writes this rank's half, not the global tensor; a matmul of a row-sharded by a replicated matrix
    computes this rank's rows; redistributing to replicated is an all-gather of this rank's shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        a = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])  # this rank: rows 0-3
        w = distribute_tensor(torch.randn(4, 6), mesh, [Replicate()])
        assert count_work(torch.mul, a, 2.0).bytes_accessed == 2 * F32 * 4 * 4  # its (4, 4) read and written
        assert count_work(torch.matmul, a, w).flops == {"fp32": 2 * 4 * 4 * 6}  # its 4 rows
        with WorkCounter(world_size=2) as counter:
            a.redistribute(mesh, [Replicate()])
        assert counter.bytes == {"all_gather": F32 * 4 * 4}  # the shard it hands over
    finally:
        dist.destroy_process_group()
