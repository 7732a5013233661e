"""CUDA device handling that a CPU-only machine can reach: torch.cuda's bookkeeping calls are replaced
by a fake that records them.

Each test failed before its fix (issue 13: "cuda" without an index, the allocator cap, the
active-meter slot, "auto" picking mps).
"""

from __future__ import annotations

import types

import pytest
import torch

import labkit.device as device_mod
from labkit.device import as_device, resolve_device
from labkit.meter import MemoryMeter, OutOfMemory, active_meter


class FakeCuda:
    """Record the torch.cuda calls labkit makes; refuse an index-less device as torch does."""

    def __init__(self, monkeypatch, allocated_bytes: int = 3 * 2**20, reserved_bytes: int = 20 * 2**20):
        self.calls: list[tuple] = []
        self.allocated_bytes, self.reserved_bytes = allocated_bytes, reserved_bytes
        cuda = torch.cuda
        for name, fn in {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "synchronize": self._call("synchronize"),
            "reset_peak_memory_stats": self._call("reset_peak_memory_stats"),
            "set_per_process_memory_fraction": self._fraction,
            "memory_allocated": self._call("memory_allocated", lambda: self.allocated_bytes),
            "max_memory_allocated": self._call("max_memory_allocated", lambda: self.allocated_bytes),
            "memory_reserved": self._call("memory_reserved", lambda: self.reserved_bytes),
            "get_device_properties": lambda d=None: types.SimpleNamespace(total_memory=80 * 2**30, name="fake"),
            "Stream": lambda *a, **k: types.SimpleNamespace(),
        }.items():
            monkeypatch.setattr(cuda, name, fn)

    def _call(self, name, result=lambda: None):
        def fn(device=None):
            self.calls.append((name, device))
            return result()
        return fn

    def _fraction(self, fraction, device=None):
        if isinstance(device, torch.device) and device.index is None:  # what torch.cuda does
            raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")
        self.calls.append(("set_per_process_memory_fraction", fraction, device))


@pytest.fixture
def fake_cuda(monkeypatch):
    return FakeCuda(monkeypatch)


def test_cuda_devices_carry_an_index(fake_cuda):
    assert as_device("cuda") == torch.device("cuda", 0)
    assert as_device(torch.device("cuda")) == torch.device("cuda", 0)
    assert as_device("cuda:0") == torch.device("cuda", 0)
    assert as_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"DEVICE='cuda:3'.*1 CUDA device"):
        resolve_device("cuda:3", "DEVICE")


def test_meter_with_a_budget_on_auto_cuda_enters_and_leaves_the_allocator_alone(fake_cuda):
    with MemoryMeter(device="cuda", budget_bytes=64 * 2**20) as meter:
        assert active_meter() is meter
    assert meter.device == torch.device("cuda", 0)
    assert active_meter() is None
    assert not [c for c in fake_cuda.calls if c[0] == "set_per_process_memory_fraction"], fake_cuda.calls
    assert meter.cuda_max_allocated_bytes == fake_cuda.allocated_bytes
    assert meter.cuda_reserved_bytes == fake_cuda.reserved_bytes
    with MemoryMeter(device="cuda") as again:  # the next meter in the same thread is welcome
        pass
    assert again.device == torch.device("cuda", 0)


def test_budget_refusal_on_cuda_carries_the_allocator_figures(fake_cuda):
    meter = MemoryMeter(device="cuda", budget_bytes=1024)
    err = meter._refusal(4096, 512)
    assert isinstance(err, OutOfMemory) and isinstance(err, torch.OutOfMemoryError)
    assert (err.cuda_allocated_bytes, err.cuda_reserved_bytes) == (fake_cuda.allocated_bytes, fake_cuda.reserved_bytes)
    assert "CUDA allocator: 3.00 MiB allocated, 20.00 MiB reserved" in str(err)
    import pickle
    back = pickle.loads(pickle.dumps(err))
    assert back.cuda_reserved_bytes == fake_cuda.reserved_bytes and str(back) == str(err)


def test_failed_enter_leaves_no_active_meter(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    def broken_enter(self):
        raise RuntimeError("mode stack refused")

    with monkeypatch.context() as m:
        m.setattr(TorchDispatchMode, "__enter__", broken_enter)
        with pytest.raises(RuntimeError, match="mode stack refused"):
            with MemoryMeter(device="cpu"):
                pass
    assert active_meter() is None
    assert torch.UntypedStorage.resize_ is __import__("labkit.meter", fromlist=["_RESIZE"])._RESIZE
    with MemoryMeter(device="cpu") as meter:  # not "another MemoryMeter is already active"
        torch.ones(256)
    assert meter.peak_bytes == 1024


def test_auto_never_picks_a_device_the_chapters_refuse(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mps = types.SimpleNamespace(is_available=lambda: True, current_accelerator=lambda: torch.device("mps"))
    monkeypatch.setattr(torch, "accelerator", mps)
    monkeypatch.setattr(device_mod, "_announced", set())
    assert resolve_device("auto", "DEVICE") == torch.device("cpu")
    out = capsys.readouterr().out
    assert "DEVICE='auto'" in out and "'mps'" in out and "cpu" in out
    assert resolve_device("auto", "DEVICE") == torch.device("cpu")
    assert capsys.readouterr().out == ""  # said once per process
    with pytest.raises(ValueError, match="DEVICE must be one of"):
        resolve_device("mps", "DEVICE")
