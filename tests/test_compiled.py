"""labkit.compiled: the allocator's peak and the profiler's matmul FLOPs, checked against the meter and the
FLOP counter on eager code; why they are needed (Dynamo does not compile under a dispatch mode); which
backends can run here.

No test here compiles with inductor (a C++ compile takes seconds): tests/test_nb02.py runs notebook 02 with
COMPILE="inductor", and tests/test_checkpointing.py and notebook 02's defaults on a CPU run the partitioner-only
backend.
"""

from __future__ import annotations

import copy

import pytest
import torch

from labkit.compiled import BACKENDS, allocation_peak, compile_unavailable_reason, matmul_flops
from labkit.work import count_work
from labkit.meter import MemoryMeter


def _meter_peak(fn, *track) -> int:
    """Return the meter's peak above its start while fn() runs."""
    with MemoryMeter() as meter:
        meter.track(*track)
        start = meter.current_bytes
        fn()
    return meter.peak_bytes - start


@pytest.fixture
def block_run(tiny_gpt):
    """Return (module, run): one transformer block of the tiny GPT and a forward + backward of it."""
    block = tiny_gpt().blocks[0]
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)  # (B, T, C)

    def run():
        block(x).sum().backward()
    run()  # gradients exist from here on, so every measured run does the same work
    return block, x, run


# -- the allocator's count ---------------------------------------------------------------------------
def test_allocation_peak_sees_what_a_function_allocates_and_keeps():
    kept = []
    n = 1000

    def make_and_keep():
        kept.append(torch.empty(n, dtype=torch.float32))
        tmp = torch.empty(2 * n, dtype=torch.float32)  # freed when the function returns
        del tmp

    peak = allocation_peak(make_and_keep, "cpu")
    assert peak.end_bytes == 4 * n
    assert peak.peak_bytes == 4 * n + 8 * n  # both were alive at once
    assert peak.tensor_peak_bytes == peak.peak_bytes  # no operator freed its own scratch
    assert "profiler" in peak.method


def test_allocation_peak_without_scratch_is_the_meters_peak_on_eager_code(block_run, tiny_gpt, tiny_batch):
    block, x, run = block_run
    peak = allocation_peak(run, "cpu")
    # the block divides by a Python float: one 8-byte wrapped number lives outside any operator
    assert abs(peak.tensor_peak_bytes - _meter_peak(run, block, x)) <= 64
    assert peak.peak_bytes >= peak.tensor_peak_bytes

    model, batch = tiny_gpt(), tiny_batch(3)
    step = lambda: model(*batch)[1].backward()  # noqa: E731
    step()
    assert abs(allocation_peak(step, "cpu").tensor_peak_bytes - _meter_peak(step, model, *batch)) <= 64


def test_allocation_peak_refuses_other_devices():
    with pytest.raises(ValueError, match="meta"):
        allocation_peak(lambda: None, "meta")


@pytest.mark.cuda
def test_allocation_peak_on_cuda_reads_the_allocator():
    kept = []
    peak = allocation_peak(lambda: kept.append(torch.empty(1 << 20, device="cuda")), "cuda")
    assert peak.end_bytes >= 4 << 20 and peak.peak_bytes >= peak.end_bytes and peak.tensor_peak_bytes is None


# -- FLOPs ------------------------------------------------------------------------------------------
def test_matmul_flops_equal_the_flop_counter_on_eager_code(block_run, tiny_gpt, tiny_batch):
    _, _, run = block_run
    assert matmul_flops(run) == count_work(run).total_flops > 0
    model, batch = tiny_gpt(), tiny_batch(3)
    step = lambda: model(*batch)[1].backward()  # noqa: E731
    assert matmul_flops(step) == count_work(step).total_flops > 0


# -- compiled code ----------------------------------------------------------------------------------
def test_dynamo_runs_eagerly_under_a_dispatch_mode_so_the_meter_cannot_see_compiled_code():
    graphs, compiled_calls = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def call(*args):
            compiled_calls.append(1)
            return gm.forward(*args)
        return call

    def f(x):
        return (x * 2).sin()

    x = torch.randn(8)
    torch._dynamo.reset()
    fn = torch.compile(f, backend=backend)
    fn(x)
    assert len(graphs) == len(compiled_calls) == 1
    with MemoryMeter():
        fn(x)
    assert len(compiled_calls) == 1  # the compiled graph exists, yet under the meter the eager code ran

    torch._dynamo.reset()
    graphs.clear()
    fn = torch.compile(f, backend=backend)
    with MemoryMeter():
        fn(x)  # a first call under a dispatch mode marks the code as not to compile...
    fn(x)
    assert graphs == []  # ...for good: outside the meter it still runs eagerly, until a reset
    torch._dynamo.reset()


def test_the_partitioners_budget_is_seen_by_the_census_and_the_flop_count(tiny_gpt):
    """Budget 0 saves only the MLP's input and recomputes its up projection, as checkpoint(mlp) does."""
    import torch._functorch.config as functorch_config
    from torch.utils.checkpoint import checkpoint

    from labkit.saved import saved_tensor_census

    mlp = tiny_gpt().blocks[0].mlp
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)  # (B, T, C)
    run = lambda m: (lambda: m(x).sum().backward())  # noqa: E731
    eager_flops = count_work(run(mlp)).total_flops
    ckpt_flops = count_work(lambda: checkpoint(mlp, x, use_reentrant=False).sum().backward()).total_flops
    saved = {}
    for budget in (1.0, 0.0):
        torch._dynamo.reset()
        compiled = torch.compile(copy.deepcopy(mlp), backend="aot_eager_decomp_partition")
        with functorch_config.patch(activation_memory_budget=budget):
            run(compiled)()
        saved[budget] = saved_tensor_census(compiled, lambda: compiled(x)).where(kind="activation").storage_nbytes
        extra = matmul_flops(run(compiled)) - eager_flops
        assert extra == (0 if budget == 1.0 else ckpt_flops - eager_flops)
    torch._dynamo.reset()
    assert saved[0.0] == x.nbytes < saved[1.0]
    assert ckpt_flops - eager_flops == 2 * x.numel() * mlp.up.out_features  # the up projection, once more


# -- availability -----------------------------------------------------------------------------------
def test_compile_unavailable_reason_names_what_is_missing(monkeypatch):
    with pytest.raises(ValueError, match="backend"):
        compile_unavailable_reason("cpu", "tvm")
    assert compile_unavailable_reason("cpu", "aot_eager_decomp_partition") is None
    import torch._inductor.config as inductor_config
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("no-such-c++-compiler",))
    reason = compile_unavailable_reason("cpu", "inductor")
    assert reason is not None and "C++" in reason
    assert set(BACKENDS) == {"inductor", "aot_eager_decomp_partition"}
