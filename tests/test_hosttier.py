"""labkit.techniques.hosttier: host buffers (pinned, memory, disk), the one pair of copies, and their accounting on the meter."""

from __future__ import annotations

import os

import pytest
import torch

import labkit
from labkit.techniques.hosttier import HostPool, dense_stride, host_tier, mark_host_state, pin, to_device, to_host

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_copies_go_into_separate_buffers_with_the_same_strides(kind):
    pool = HostPool("cpu", kind=kind)
    t = torch.randn(6, 5).t()  # non-contiguous, dense
    h = to_host(t, pool)
    assert h.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert h.stride() == t.stride() == dense_stride(t)
    assert torch.equal(h, t)
    x = to_device(h, CPU, pool)
    assert torch.equal(x, t) and x.stride() == t.stride()
    assert x.untyped_storage().data_ptr() != h.untyped_storage().data_ptr()
    assert pool.bytes_to_host == pool.bytes_to_device == t.numel() * 4
    assert pool.live_buffers == 1 and pool.live_bytes == t.numel() * 4
    del h
    assert pool.live_buffers == 0 and pool.live_bytes == 0
    assert pool.peak_bytes == t.numel() * 4
    pool.close()


def test_a_non_dense_tensor_comes_back_contiguous():
    t = torch.randn(8, 8)[:, ::2]  # strided with gaps: not dense
    assert dense_stride(t) == (4, 1)
    h = to_host(t)
    assert h.stride() == (4, 1) and torch.equal(h, t)


def test_copies_are_real_and_counted_on_their_tier():
    t = torch.randn(64, 64)
    with labkit.MemoryMeter(CPU) as meter:
        meter.mark_host(t)
        d = to_device(t, CPU)
        assert d.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        assert torch.equal(d, t)
        assert meter.current_bytes == t.nbytes and meter.host_current_bytes == t.nbytes
        h = to_host(d)
        assert meter.host_current_bytes == 2 * t.nbytes and meter.current_bytes == t.nbytes
        with host_tier():
            extra = torch.empty(10)
        assert meter.host_current_bytes == 2 * t.nbytes + extra.nbytes
    assert torch.equal(h, t)
    with host_tier():  # no meter: a no-op context
        torch.empty(1)


def test_pool_buffers_count_on_the_meter_host_tier_not_the_device():
    pool = HostPool("cpu")
    t = torch.randn(1024)
    with labkit.MemoryMeter("cpu", budget_bytes=4096) as meter:  # t fills the budget: no room for a device copy
        meter.track(t)
        h = to_host(t, pool)
        assert meter.host_current_bytes == 4096 and meter.current_bytes == 4096
        del h
        assert meter.host_current_bytes == 0
    assert meter.host_peak_bytes == 4096 and meter.peak_bytes == 4096


def test_disk_pool_deletes_each_file_with_its_buffer_and_the_folder_on_close():
    pool = HostPool("cpu", kind="disk")
    a = to_host(torch.randn(100), pool)
    b = to_host(torch.randn(7, 3), pool)
    assert len(pool.files()) == 2
    folder = pool.spill_dir
    assert folder is not None and os.path.isdir(folder)
    del a
    assert len(pool.files()) == 1
    del b
    assert pool.files() == []
    pool.close()
    assert not os.path.exists(folder) and pool.spill_dir is None


def test_host_pool_rejects_bad_kinds():
    with pytest.raises(ValueError, match="kind"):
        HostPool("cpu", kind="nvme")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pinned"):
            HostPool("cpu", kind="pinned")
    assert HostPool("cpu").kind == "memory" and not HostPool("cpu").pinned


def test_pin_refuses_a_device_tensor_and_a_machine_without_cuda():
    with pytest.raises(ValueError, match="needs a CPU tensor"):
        pin(torch.empty(4, device="meta"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin needs CUDA"):
            pin(torch.ones(4))


@pytest.mark.cuda
def test_pin_copies_into_page_locked_memory_counted_on_the_host_tier():
    t = torch.arange(1024, dtype=torch.float32)
    with labkit.MemoryMeter("cuda") as meter:
        meter.track(t)
        host_before = meter.host_current_bytes
        p = pin(t)
        assert p.is_pinned() and not t.is_pinned() and torch.equal(p, t)
        assert p.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()  # a copy
        assert meter.host_current_bytes - host_before == t.nbytes and meter.current_bytes == 0
    assert pin(p).untyped_storage().data_ptr() == p.untyped_storage().data_ptr()  # pinned already: no copy


def test_mark_host_state_moves_model_and_state_to_the_host_count(tiny_gpt, tiny_batch):
    model = tiny_gpt(10)
    opt = labkit.make_optimizer("adam", model.parameters())
    labkit.train_step(model, opt, tiny_batch(2, 8))
    n_params = labkit.count_params(model)
    with labkit.MemoryMeter(CPU) as meter:
        mark_host_state(meter, model, opt)
        assert meter.current_bytes == 0
        # weights + Adam's two moments + its 4-byte step counter per parameter tensor (grads were set to None)
        n_tensors = len(list(model.parameters()))
        assert meter.host_current_bytes == 12 * n_params + 4 * n_tensors
