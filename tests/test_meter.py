"""MemoryMeter counts live tensor bytes exactly: views, frees, categories, phases, budget, host tier.

Every expected byte count is derived from shapes: float32 is 4 B per element, so
torch.empty(1000) holds 4000 B; a stack of n nn.Linear(d, d) holds P = n·(d² + d) parameters.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import labkit
from labkit.meter import _RESIZE, MemoryMeter, OutOfMemory, active_meter, try_fit

F32 = 4  # bytes per float32 element


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True, scope="module")
def second_process():
    """Start the second-process measurement at once, so it overlaps the other tests; collected at the end."""
    code = MEASURE + "\nimport json\nprint(json.dumps(measure()))\n"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


class Stack(nn.Module):
    """n nn.Linear(d, d) layers with tanh between them; forward returns (out, mse loss) like labkit's models."""

    def __init__(self, d: int, n: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x, (x - y).pow(2).mean()


def stack_params(d: int, n: int) -> int:
    """Parameters of Stack(d, n): each Linear has a d×d weight and a d bias."""
    return n * (d * d + d)


def stack_param_tensors(n: int) -> int:
    """Parameter tensors of Stack(d, n): a weight and a bias per layer (Adam keeps one `step` per tensor)."""
    return 2 * n


def adam_state_bytes(d: int, n: int) -> int:
    """Adam: exp_avg and exp_avg_sq (4 B each per parameter) and a 0-dim float32 `step` per tensor.

    torch/optim/adam.py `_init_group`: without capturable/fused, state["step"] is
    torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"): one float32 scalar, 4 B, on the CPU
    (which, on a CPU meter, is the device).
    """
    return 2 * F32 * stack_params(d, n) + F32 * stack_param_tensors(n)


def _batch(d: int, rows: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)


# -- exact counts of plain tensors -------------------------------------------------------------

def test_known_tensor_sizes():
    with MemoryMeter(device="cpu") as m:
        a = torch.empty(1000)
        assert m.current_bytes == 1000 * F32
        b = torch.zeros(10, 20, dtype=torch.float64)
        assert m.current_bytes == 1000 * F32 + 200 * 8
        c = torch.ones(7, dtype=torch.int8)
        assert m.current_bytes == 1000 * F32 + 200 * 8 + 7
        assert m.peak_bytes == m.current_bytes
        del a, b, c


def test_views_add_nothing():
    with MemoryMeter(device="cpu") as m:
        a = torch.empty(1000)
        views = [a[10:20], a.view(10, 100), a.view(10, 100).transpose(0, 1), a[:1].expand(50), a.reshape(100, 10)]
        assert m.current_bytes == 1000 * F32
        # A copy is a new storage: 100 elements.
        c = a[:100].clone()
        assert m.current_bytes == 1100 * F32
        del views, c


def test_bytes_leave_with_the_storage():
    with MemoryMeter(device="cpu") as m:
        a = torch.empty(1000)
        v = a[500:]
        t = a.view(10, 100).t()
        del a
        assert m.current_bytes == 4000, "views keep the storage alive"
        del v
        assert m.current_bytes == 4000
        del t  # the last view: the storage dies
        assert m.current_bytes == 0
        assert m.peak_bytes == 4000


def test_peak_versus_current():
    with MemoryMeter(device="cpu") as m:
        a = torch.empty(1000)  # 4000
        b = torch.empty(2000)  # 8000 -> 12000 live
        del b
        c = torch.empty(500)  # 2000 -> 6000 live
        assert m.current_bytes == 6000
        assert m.peak_bytes == 12000
        assert m.peak_split()["activations"] == 12000
        assert m.current_split()["activations"] == 6000
        del a, c
    assert m.current_bytes == 0


def test_resized_storage_is_recounted():
    with MemoryMeter(device="cpu") as m:
        a = torch.empty(1000)
        a.resize_(2000)
        assert m.current_bytes == 8000
        assert m.peak_bytes == 8000
        del a
        assert m.current_bytes == 0


def test_resize_after_the_peak_keeps_the_peak_split():
    """The peak (a: 4000 B + b: 12000 B) must still split to 16000 B after a later resize of a."""
    with MemoryMeter(device="cpu") as m:
        a = torch.empty(1000)
        b = torch.empty(3000)
        del b
        a.resize_(2000)
        assert (m.current_bytes, m.peak_bytes) == (8000, 16000)
        split = m.peak_split()
        assert split["activations"] == 16000
        assert sum(split.values()) == m.peak_bytes
        del a
        assert m.current_bytes == 0


# -- categories of a model and its optimizer ----------------------------------------------------

def test_categories_by_hand_with_adam():
    d, n = 32, 3
    P = stack_params(d, n)
    torch.manual_seed(0)
    model = Stack(d, n)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    x, y = _batch(d)
    with MemoryMeter(device="cpu") as m:
        m.track(model, opt, x, y)
        assert m.current_split() == {"parameters": F32 * P, "gradients": 0, "optimizer_state": 0,
                                     "activations": 2 * 8 * d * F32}
        _, loss = model(x, y)
        loss.backward()
        after_backward = m.current_split()
        opt.step()
        after_step = m.current_split()
        opt.zero_grad(set_to_none=True)
        after_zero = m.current_split()
        del loss
    assert after_backward["parameters"] == F32 * P
    assert after_backward["gradients"] == F32 * P  # every parameter has its .grad here
    assert after_backward["optimizer_state"] == 0  # Adam creates its state in the first step
    assert after_step["optimizer_state"] == adam_state_bytes(d, n)
    assert after_step["gradients"] == F32 * P
    assert after_zero["gradients"] == 0
    assert after_zero["optimizer_state"] == adam_state_bytes(d, n)
    split = m.peak_split()
    assert sum(split.values()) == m.peak_bytes
    assert split["parameters"] == F32 * P


@pytest.mark.parametrize("name, state_per_param", [("adam", 2 * F32), ("sgd", 0), ("momentum", F32)])
def test_measure_step_peak_split(name, state_per_param):
    d, n = 32, 3
    P = stack_params(d, n)
    torch.manual_seed(0)
    model = Stack(d, n)
    opt = labkit.make_optimizer(name, model.parameters())
    step = labkit.measure_step(model, opt, _batch(d))
    steps = F32 * stack_param_tensors(n) if name == "adam" else 0  # SGD keeps no step counter
    assert step.split["parameters"] == F32 * P
    assert step.split["optimizer_state"] == state_per_param * P + steps
    assert sum(step.split.values()) == step.peak_bytes == step.meter.peak_bytes
    # The static part is at least parameters + optimizer state; activations make the rest.
    assert step.peak_bytes > F32 * P + state_per_param * P


# -- timeline ------------------------------------------------------------------------------------

def test_timeline_phases_in_order_and_peak():
    d, n = 32, 3
    torch.manual_seed(0)
    model = Stack(d, n)
    opt = labkit.make_optimizer("adam", model.parameters())
    step = labkit.measure_step(model, opt, _batch(d))
    points = step.meter.timeline
    phases = [p.phase for p in points]
    assert set(phases) <= set(labkit.PHASES)
    idx = {ph: [i for i, p in enumerate(phases) if p == ph] for ph in ("forward", "backward", "optimizer")}
    assert all(idx.values()), {k: len(v) for k, v in idx.items()}
    assert max(idx["forward"]) < min(idx["backward"]), "a point labelled forward after backward began"
    assert max(idx["backward"]) < min(idx["optimizer"])
    # zero_grad frees the gradients after the optimizer: those points are "other".
    assert phases[-1] == "other"
    assert max(p.bytes for p in points) == step.peak_bytes
    assert [p.seq for p in points] == sorted(p.seq for p in points)


def test_timeline_points_follow_current_bytes():
    with MemoryMeter(device="cpu") as m:
        seen = []
        a = torch.empty(100)
        seen.append((m.timeline[-1].bytes, m.current_bytes))
        b = torch.empty(300)
        seen.append((m.timeline[-1].bytes, m.current_bytes))
        del a
        seen.append((m.timeline[-1].bytes, m.current_bytes))
        del b
        seen.append((m.timeline[-1].bytes, m.current_bytes))
        with m.phase("optimizer"):
            c = torch.empty(10)
        labelled = m.timeline[-1].phase
        del c
    assert seen == [(400, 400), (1600, 1600), (1200, 1200), (0, 0)]
    assert labelled == "optimizer"
    assert [p.bytes for p in m.timeline] == [400, 1600, 1200, 0, 40, 0]
    with pytest.raises(ValueError, match="phase"):
        with MemoryMeter(device="cpu") as m2:
            with m2.phase("thinking"):
                pass


# -- budget --------------------------------------------------------------------------------------

def test_budget_refuses_with_byte_counts():
    with MemoryMeter(device="cpu", budget_bytes=10_000) as m:
        a = torch.empty(1000)  # 4000 B
        with pytest.raises(OutOfMemory) as info:
            torch.empty(2000)  # 8000 B more: 12000 > 10000
        err = info.value
        assert isinstance(err, torch.OutOfMemoryError)
        assert (err.requested_bytes, err.in_use_bytes, err.budget_bytes) == (8000, 4000, 10_000)
        for text in ("8000 B requested", "4000 B in use", "10000 B budget"):
            assert text in str(err)
        assert m.current_bytes == 4000  # the refused tensor was never counted
        b = torch.empty(1500)  # 6000 B: exactly at the budget is allowed
        assert m.current_bytes == 10_000
        del a, b


def _forward_backward(model, x, y):
    _, loss = model(x, y)
    loss.backward()


def test_budget_inside_backward_keeps_type_and_releases():
    d, n = 32, 3
    torch.manual_seed(0)
    model = Stack(d, n)
    x, y = _batch(d, rows=64)
    with MemoryMeter(device="cpu") as probe:  # where the budget must sit: above forward, below the peak
        probe.track(model, x, y)
        _, loss = model(x, y)
        after_forward = probe.current_bytes
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    assert probe.peak_bytes > after_forward

    with MemoryMeter(device="cpu", budget_bytes=after_forward) as m:
        m.track(model, x, y)
        live = m.current_bytes
        with pytest.raises(OutOfMemory) as info:
            _forward_backward(model, x, y)
        assert info.type is OutOfMemory
        assert info.value.budget_bytes == after_forward
        del info  # the traceback holds the frames that hold the activations
        model.zero_grad(set_to_none=True)  # gradients finished before the refusal
        gc.collect()
        assert m.current_bytes == live
        # Work under the budget still runs: a forward on a quarter of the batch.
        with torch.no_grad():
            out, _ = model(x[:16], y[:16])
        assert out.shape == (16, d)
        del out


def test_try_fit_releases_the_step():
    refs = []

    def step(n_big):
        h = torch.empty(1000)  # 4000 B, an "activation" of the step
        refs.append(weakref.ref(h))
        big = torch.empty(n_big)
        return h.sum() + big.sum()

    with MemoryMeter(device="cpu", budget_bytes=100_000) as m:
        ok = try_fit(step, 10)
        assert ok.fits and ok.error is None and torch.is_tensor(ok.value)
        res = try_fit(step, 1_000_000)  # 4 MB > 100 kB
        assert not res.fits and res.value is None
        assert isinstance(res.error, OutOfMemory)
        assert res.error.requested_bytes == 4_000_000
        assert res.error.__traceback__ is None
        assert refs[-1]() is None, "the failed step's tensors must be gone"
        assert m.current_bytes == ok.value.untyped_storage().nbytes()  # only the first result is live

        # Control: a kept exception (with its traceback) keeps the step's tensors alive.
        try:
            step(1_000_000)
        except OutOfMemory as e:
            kept = e
        assert refs[-1]() is not None
        kept.__traceback__ = None
        del kept
        gc.collect()
        assert refs[-1]() is None


def test_try_fit_keeps_the_allocators_own_error():
    message = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB "
               "of which 1.06 GiB is free.")

    def allocator_oom():
        raise torch.OutOfMemoryError(message)

    res = try_fit(allocator_oom)
    assert not res.fits and res.value is None
    assert type(res.error) is torch.OutOfMemoryError  # not dressed up as a budget refusal with made-up figures
    assert str(res.error) == message
    assert res.error.__traceback__ is None  # its frames would hold the step's tensors


@pytest.mark.parametrize("bad", [0, -5, -0.5, True, "1GB", [1], float("inf"), float("nan")])
def test_budget_bytes_validation(bad):
    with pytest.raises(labkit.ParameterError, match="budget_bytes must be None or a positive number of bytes"):
        MemoryMeter(device="cpu", budget_bytes=bad)


def test_budget_float_is_rounded_down():
    assert MemoryMeter(device="cpu", budget_bytes=1000.9).budget_bytes == 1000


# -- host tier -----------------------------------------------------------------------------------

def test_host_tier_counts_apart_and_ignores_the_budget():
    with MemoryMeter(device="cpu", budget_bytes=1000) as m:
        with m.host_tier():
            h = torch.empty(1000)  # 4000 B on the host: over the 1000 B budget, but the host is exempt
        assert (m.current_bytes, m.host_current_bytes) == (0, 4000)
        d = torch.empty(100)  # 400 B on the device
        assert (m.current_bytes, m.host_current_bytes) == (400, 4000)
        del h
        assert (m.current_bytes, m.host_current_bytes, m.host_peak_bytes) == (400, 0, 4000)
        del d
    assert m.peak_bytes == 400


def test_mark_host_moves_bytes():
    with MemoryMeter(device="cpu") as m:
        a = torch.empty(1000)
        b = torch.empty(500)
        assert (m.current_bytes, m.host_current_bytes) == (6000, 0)
        assert m.mark_host(a) is a
        assert (m.current_bytes, m.host_current_bytes) == (2000, 4000)
        m.mark_host(a)  # already on the host: nothing changes
        assert (m.current_bytes, m.host_current_bytes) == (2000, 4000)
        fresh = torch.ones(3)  # seen by the meter now, then moved
        m.mark_host(fresh)
        assert (m.current_bytes, m.host_current_bytes) == (2000, 4012)
        # The peak (both on the device) still splits to its bytes.
        assert m.peak_bytes == 6000
        assert sum(m.peak_split().values()) == 6000
        del a
        assert (m.current_bytes, m.host_current_bytes) == (2000, 12)
        del b, fresh


# -- lifecycle -----------------------------------------------------------------------------------

def test_meter_is_single_use_and_not_nested():
    m = MemoryMeter(device="cpu")
    with m:
        assert active_meter() is m
        with pytest.raises(RuntimeError, match="already active"):
            with MemoryMeter(device="cpu"):
                pass
        a = torch.empty(10)  # the outer meter still counts
        assert m.current_bytes == 40
        del a
    assert active_meter() is None
    with pytest.raises(RuntimeError, match="one `with`"):
        with m:
            pass
    with MemoryMeter(device="cpu") as again:  # a fresh one works after both refusals
        b = torch.empty(10)
        assert again.current_bytes == 40
        del b


def test_track_rejects_other_objects():
    with MemoryMeter(device="cpu") as m:
        with pytest.raises(TypeError, match="track"):
            m.track("not a module")


MEASURE = """
import torch, torch.nn as nn
from labkit.meter import MemoryMeter

def measure():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for _ in range(2):  # the second step has Adam's state
        with MemoryMeter(device="cpu") as m:
            m.track(model, opt, x, y)
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
    return m.peak_bytes, m.peak_split()
"""


def _measure():
    ns: dict = {}
    exec(MEASURE, ns)
    return ns["measure"]()


def test_meters_repeat_exactly():
    first = _measure()
    # P = 16·32 + 32 + 32·4 + 4 = 676 parameters, 4 tensors.
    assert first[1]["parameters"] == F32 * 676
    assert first[1]["optimizer_state"] == 2 * F32 * 676 + F32 * 4
    assert all(_measure() == first for _ in range(19))


def test_meter_in_a_second_process(second_process):
    stdout, stderr = second_process.communicate(timeout=120)
    assert second_process.returncode == 0, stderr
    peak, split = json.loads(stdout.strip().splitlines()[-1])
    assert (peak, split) == _measure()


def test_fake_tensors_give_the_real_peak():
    def run():
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
        opt = torch.optim.Adam(model.parameters(), foreach=False)
        x, y = torch.randn(32, 16), torch.randint(5, (32,))
        for _ in range(2):
            with MemoryMeter(device="cpu") as m:
                m.track(model, opt, x, y)
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del loss
        return m.peak_bytes, m.peak_split()

    real = run()
    with FakeTensorMode():
        fake = run()
    assert fake == real
    P = 16 * 64 + 64 + 64 * 64 + 64 + 64 * 5 + 5
    assert real[1]["parameters"] == F32 * P


def test_format_bytes():
    assert labkit.format_bytes(512) == "512 B"
    assert labkit.format_bytes(1536) == "1.50 KiB"
    assert labkit.format_bytes(3 * 2**20) == "3.00 MiB"
    assert labkit.format_bytes(2**50) == "1024.00 TiB"


def test_the_meter_costs_at_most_1_3_times_the_dispatch_floor():
    """A running-example step inside the meter takes at most 1.3× the same step inside a mode that only forwards.

    Timed in interleaved rounds (medians) by this process's CPU time: under a loaded suite a step's wall time holds
    the time other processes took the core (1.41-1.71× in one run of `make test`, 2026-12-04); a noisy machine gets
    up to three measurements, as principle 8 asks: a real regression fails all three.
    """
    import statistics
    import time

    from labkit.meter import DispatchFloor

    ex = labkit.running_example()
    torch.manual_seed(0)
    model = labkit.GPT(ex.config)
    opt = labkit.make_optimizer("adam", model.parameters())
    batch = labkit.example_batch(ex.config, ex.batch_size, ex.seq_len)

    def floor():
        with DispatchFloor():
            labkit.train_step(model, opt, batch)

    def metered():
        with MemoryMeter("cpu") as meter:
            meter.track(model, opt, *batch)
            labkit.train_step(model, opt, batch)

    def on_cpu(fn, cpu_s: list):
        def run():
            t0 = time.process_time()
            fn()
            cpu_s.append(time.process_time() - t0)
        return run

    ratios = []
    for _ in range(3):
        cpu_s = {"floor": [], "meter": []}  # (each list's first: the warm-up step)
        labkit.measure_throughputs({name: on_cpu(fn, cpu_s[name]) for name, fn in (("floor", floor), ("meter", metered))},
                                   samples_per_step=ex.batch_size, steps=7)
        ratios.append(statistics.median(cpu_s["meter"][1:]) / statistics.median(cpu_s["floor"][1:]))
        if ratios[-1] <= 1.3:
            break
    assert min(ratios) <= 1.3, ratios


def test_storage_resize_outside_any_operator_is_counted():
    """FSDP2 frees a gathered parameter with `storage.resize_(0)` (no operator): the meter must see it."""
    with MemoryMeter(device="cpu") as m:
        a = torch.empty(1000)
        a.untyped_storage().resize_(0)
        assert m.current_bytes == 0
        a.untyped_storage().resize_(2000 * F32)
        assert (m.current_bytes, m.peak_bytes) == (8000, 8000)
        del a
        assert m.current_bytes == 0
    b = torch.empty(10)
    b.untyped_storage().resize_(0)  # with no meter open the storage method is torch's own again
    assert torch.UntypedStorage.resize_ is _RESIZE


class _GatherAndFree(torch.autograd.Function):
    """What FSDP2 does to a ZeRO-3 parameter around backward: grow its storage back, use it, free it again."""

    @staticmethod
    def forward(ctx, x, gathered):
        ctx.gathered = gathered
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        st = ctx.gathered.untyped_storage()
        st.resize_(1000 * F32)  # the backward's all-gather re-allocates the parameter: 4000 B
        out = grad * 2  # 400 B while it is gathered
        st.resize_(0)  # and frees it
        return out, None


def _backward_on_another_thread(meter, loss):
    """Run loss.backward() on a new thread that, like autograd's device threads, has the caller's dispatch modes.

    The autograd engine restores the caller's thread-local state (its dispatch-mode stack) on the
    device thread that runs a CUDA backward; Python's threading.local does not travel with it.
    """
    import threading
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    errors = []

    def worker():
        _push_mode(meter)
        try:
            loss.backward()
        except BaseException as e:  # noqa: BLE001 - reported in the test's thread
            errors.append(e)
        finally:
            _pop_mode()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def test_a_resize_in_a_backward_on_another_thread_is_counted():
    """A CUDA backward runs on autograd's device thread: the meter's resize_ accounting must find the meter there."""
    with MemoryMeter(device="cpu") as m:
        gathered = torch.empty(1000)
        gathered.untyped_storage().resize_(0)  # a ZeRO-3 parameter, freed after forward
        x = torch.ones(100, requires_grad=True)  # 400 B
        y = _GatherAndFree.apply(x, gathered)  # 400 B
        loss = y.sum()
        before = m.current_bytes
        _backward_on_another_thread(m, loss)
        # at the peak: x, y, the regathered 4000 B and at least the 400 B gradient being computed
        assert m.peak_bytes >= before + 1000 * F32 + 100 * F32, (m.peak_bytes, before)
        assert gathered.untyped_storage().nbytes() == 0
        del gathered
    assert m.current_bytes == x.nbytes + x.grad.nbytes + y.nbytes + loss.nbytes  # the gathered copy is freed again


def test_the_active_meter_is_found_through_the_dispatch_modes_on_another_thread():
    import threading
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    seen = []
    with MemoryMeter(device="cpu") as m:
        def worker():
            seen.append(active_meter())  # a plain new thread: no meter
            _push_mode(m)
            try:
                seen.append(active_meter())
            finally:
                _pop_mode()
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen == [None, m]


def test_peak_bytes_of_counts_only_what_was_live_at_the_peak():
    with MemoryMeter(device="cpu") as m:
        a = torch.empty(1000)  # 4000 B, live at the peak
        b = torch.empty(500)  # 2000 B, live at the peak
        peak = torch.empty(250)  # 1000 B: the peak is here
        del peak
        c = torch.empty(100)  # 400 B, after the peak
        assert m.peak_bytes_of(a, a[:10], b) == 6000  # a storage counts once, however many views
        assert m.peak_bytes_of(c) == 0
        assert m.peak_bytes_of(torch.zeros(0)) == 0


@pytest.fixture
def fake_world_of_4():
    """A fake process group of 4 ranks in this process (nothing is sent), for DTensors with real local shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()


def test_sharded_tensors_count_their_local_shard(fake_world_of_4):
    """A DTensor's wrapper has the global size; the meter counts the shard this rank holds."""
    from torch.distributed.tensor import DTensor, Shard

    with MemoryMeter(device="cpu") as m:
        weight = torch.nn.Parameter(DTensor.from_local(torch.randn(10, 8), fake_world_of_4, [Shard(0)]))
        assert weight.shape == (40, 8) and m.current_bytes == 10 * 8 * F32
        module = torch.nn.ParameterList([weight])  # the meter holds tracked modules weakly: keep it alive
        m.track(module)
        weight.grad = DTensor.from_local(torch.ones(10, 8), fake_world_of_4, [Shard(0)])
        split = m.current_split()
        assert (split["parameters"], split["gradients"]) == (320, 320)
        del weight, module
        assert m.current_bytes == 0


def test_adam_state_of_fsdp2_shards_counts_its_local_shard(fake_world_of_4):
    """FSDP2 on a fake group of 4: Adam's moments are DTensors like the parameters; each counts at its local shard."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = torch.nn.Linear(16, 8, bias=False)  # 128 weights: a 2 x 16 shard on each of 4 ranks
    fully_shard(model, mesh=fake_world_of_4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    model.weight.grad = DTensor.from_local(torch.ones(2, 16), fake_world_of_4, model.weight.placements)
    opt.step()  # the state exists from here on: exp_avg and exp_avg_sq as DTensors, step a plain scalar
    state = opt.state[model.weight]
    assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].shape == (8, 16)
    with MemoryMeter(device="cpu") as m:
        m.track(model, opt)
        split = m.current_split()
    assert split["parameters"] == split["gradients"] == 2 * 16 * F32  # the local shard, not the global 8 x 16
    assert split["optimizer_state"] == 2 * (2 * 16 * F32) + F32  # two local moment shards and the step counter


@pytest.mark.cuda
def test_a_cuda_backward_on_autograds_device_thread_counts_the_resize():
    """On CUDA the backward runs on autograd's device thread: the resize there is counted, as the allocator saw it."""
    with MemoryMeter(device="cuda") as m:
        gathered = torch.empty(1000, device="cuda")
        gathered.untyped_storage().resize_(0)
        x = torch.ones(100, device="cuda", requires_grad=True)
        loss = _GatherAndFree.apply(x, gathered).sum()
        before = m.current_bytes
        loss.backward()
        assert m.peak_bytes >= before + 1000 * F32 + 100 * F32, (m.peak_bytes, before)
    assert m.cuda_max_allocated_bytes >= m.peak_bytes  # the allocator rounds up; it never holds less


def test_a_fake_tensors_device_is_answered_as_fake_tensor_mode_answers_it():
    """labkit's dispatch modes answer prim.device for a fake tensor themselves (two thirds of a fake step's
    dispatches), with FakeTensorMode's answer; any other operator or tensor goes on down the stack."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from labkit.meter import fake_device
    with FakeTensorMode():
        t = torch.empty(3)
    assert fake_device(torch.ops.prim.device.default, (t,)) == t.device == torch.device("cpu")
    assert fake_device(torch.ops.aten.add.Tensor, (t, t)) is None
    assert fake_device(torch.ops.prim.device.default, (torch.empty(1),)) is None  # a real tensor: not answered here
