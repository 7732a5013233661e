"""CUDA invariants (marked `cuda`: skipped, with the reason, where torch sees no CUDA device).

`make gpu-check`'s rows at a size that runs in seconds (it runs them itself at GPT-2 small and leaves
`test_gpu_check_rows_hold` out of its `tests` row), plus gradients that must not change when a step moves
tensors between host and device.
"""

from __future__ import annotations

import copy

import pytest
import torch

from labkit.compare import max_rel_diff
from labkit.device import as_device, resolve_device
from labkit.meter import MemoryMeter
from labkit.models import GPT, GPTConfig
from labkit.techniques.l2l import L2LTrainer
from labkit.techniques.offload import OffloadHooks
from labkit.tools import gpucheck

pytestmark = pytest.mark.cuda


@pytest.fixture
def setup():
    cfg = GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=256, vocab_size=1024, attn="sdpa")
    return gpucheck.Setup(as_device("cuda"), cfg, batch=4, seq_len=256, steps=3, train_steps=30)


def test_auto_and_cuda_resolve_to_an_indexed_device():
    assert resolve_device("auto") == torch.device("cuda", torch.cuda.current_device())
    assert resolve_device("cuda").index is not None


@pytest.mark.parametrize("check", ["meter", "budget", "offload", "precision", "roofline", "plan"])
def test_gpu_check_rows_hold(setup, check):
    row = getattr(gpucheck, f"check_{check}")(setup)
    assert row.ok, (row.measured, row.note, row.figures)


def test_budgeted_meter_on_auto_device_and_the_next_one():
    with MemoryMeter("cuda", budget_bytes=2**30) as meter:
        torch.ones(1024, device="cuda")
    with MemoryMeter("cuda") as again:
        torch.ones(1024, device="cuda")
    assert meter.peak_bytes == again.peak_bytes == 4096
    assert meter.cuda_max_allocated_bytes is not None


def _grads(model):
    return {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("prefetch", [False, True])
def test_offload_on_cuda_offloads_and_keeps_gradients(setup, prefetch):
    model, batch = setup.model(), setup.data()
    ref = copy.deepcopy(model)
    _, loss = ref(*batch)
    loss.backward()
    hooks = OffloadHooks(model, prefetch=prefetch).track_layers(model.blocks)
    with hooks:
        _, loss = model(*batch)
    loss.backward()
    assert hooks.stats()["offloaded"] > 0
    assert max_rel_diff(_grads(model), _grads(ref)) < 1e-5


def test_l2l_prefetch_keeps_gradients_and_survives_a_failing_step(setup):
    base = setup.model().cpu()
    batch = setup.data()
    a = L2LTrainer(copy.deepcopy(base), "cuda", prefetch=True)
    b = L2LTrainer(copy.deepcopy(base), "cuda", prefetch=False)
    la, lb = a.step(batch), b.step(batch)
    assert abs(float(la) - float(lb)) < 1e-5
    assert max_rel_diff(dict(a.model.named_parameters()), dict(b.model.named_parameters())) < 1e-5
    bad = (batch[0], batch[1][:, :-1])  # wrong target shape: the head's loss raises mid-step
    with pytest.raises(Exception):
        a.step(bad)
    torch.cuda.synchronize()
    a.step(batch)  # the trainer and the allocator are usable after the failure


@pytest.fixture
def one_rank_on_the_gpu():
    """A process group of one rank (NCCL, in this process) on this GPU, and its device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dev = as_device("cuda")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(), device_id=dev)
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


def test_fsdp2_cpu_offload_keeps_shards_and_adam_state_on_the_host(one_rank_on_the_gpu, tiny_gpt, tiny_batch):
    """Notebook 07's CPUOffloadPolicy point: shards, gradients and Adam's state live on the host, the device
    peak drops by at least Adam's moments, and the gradients equal a plain step's."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    dev = as_device("cuda")
    batch = tuple(t.to(dev) for t in tiny_batch(8))
    plain = tiny_gpt().to(dev)
    _, loss = plain(*batch)
    loss.backward()
    want = _grads(plain)
    n_params = sum(p.numel() for p in plain.parameters())

    def run(offload):
        model = tiny_gpt().to(dev)
        kwargs = {"mesh": one_rank_on_the_gpu, "reshard_after_forward": True}
        if offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
        _, loss = model(*batch)
        loss.backward()
        grads = {n: p.grad.to_local().detach().float().cpu() for n, p in model.named_parameters()}  # one rank: whole
        grad_devices = {p.grad.to_local().device.type for p in model.parameters()}
        opt.step()  # Adam's state exists from here on
        opt.zero_grad(set_to_none=True)
        with MemoryMeter(dev, timeline=False) as meter:
            meter.track(model, opt, *batch)
            _, loss = model(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model, opt, grads, grad_devices, meter

    model, opt, grads, grad_devices, off = run(offload=True)
    assert max_rel_diff(grads, want) < 1e-5
    assert grad_devices == {"cpu"}
    assert all(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in model.parameters())
    moments = [t.to_local() if isinstance(t, DTensor) else t
               for state in opt.state.values() for k, t in state.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(t.device.type == "cpu" for t in moments)
    _, _, grads_on, grad_devices_on, on = run(offload=False)
    assert max_rel_diff(grads_on, want) < 1e-5 and grad_devices_on == {"cuda"}
    assert on.peak_bytes - off.peak_bytes >= 8 * n_params  # at least Adam's two fp32 moments left the device
    assert off.host_peak_bytes >= 12 * n_params > n_params > on.host_peak_bytes  # shards and moments on the host
