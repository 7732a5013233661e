"""labkit.sharded: chapter 07's instruments, on one in-process gloo rank and on made-up rank results."""

import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from labkit import sharded
from labkit.dist.rank import DEVICE_ENV
from labkit.meter import MemoryMeter


@pytest.fixture
def one_rank(monkeypatch):
    """A process group of one CPU rank (gloo), torn down after the test."""
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def _ddp_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3, foreach=False)
    return model, ddp, opt


def test_watch_ddp_buckets_hands_over_the_flat_buckets_and_makes_the_all_reduce_countable(one_rank):
    from labkit.work import WorkCounter

    model, ddp, opt = _ddp_step()
    buckets = sharded.watch_ddp_buckets(ddp)
    with WorkCounter() as counter:
        ddp(torch.randn(4, 8)).sum().backward()
    n_params = sum(p.numel() for p in model.parameters())
    assert sum(b.numel() for b in buckets.values()) == n_params  # one flat copy of every gradient
    assert counter.bytes.get("all_reduce") == 4 * n_params  # from Python: the counter sees it


def test_measured_step_splits_the_step_and_reads_the_states_at_rest(one_rank):
    model, ddp, opt = _ddp_step()
    buckets = sharded.watch_ddp_buckets(ddp)
    x = torch.randn(4, 8)
    for _ in range(2):  # warm-up: Adam's state exists, DDP's buckets are rebuilt
        ddp(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    result = {}
    with sharded.measured_step("probe", result, ddp, opt, x, buckets=buckets) as probe:
        ddp(x).sum().backward()
        opt.step()
        probe.at_rest()
        opt.zero_grad(set_to_none=True)
    n_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert result["fits"] is True
    assert result["states"]["parameters"] == n_bytes and result["states"]["gradients"] == n_bytes
    n_tensors = len(list(model.parameters()))
    assert result["states"]["optimizer_state"] == 2 * n_bytes + 4 * n_tensors  # Adam's two moments and step counters
    assert "activations" not in result["states"] and "other" in result["states"]
    assert result["peak"]["other"] == n_bytes  # DDP's buckets, counted apart from the activations
    assert result["comm_bytes"] == {"all_reduce": n_bytes} and result["wire_bytes"] == 0  # one rank sends nothing
    assert result["peak_phase"] in ("forward", "backward", "optimizer")


def test_at_rest_waits_until_a_collectives_buffer_the_step_let_go_of_is_released(one_rank):
    # gloo's worker thread drops a finished collective's tensors a moment after it returns: here a timer does
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held = []
    result = {}
    with sharded.measured_step("late", result, model, opt) as probe:
        sent, kept = torch.ones(1000), torch.ones(500)  # 4,000 B handed to an all-reduce; 2,000 B to nothing
        dist.all_reduce(sent)
        held.append(sent)
        del sent
        threading.Timer(0.3, held.clear).start()
        t0 = time.perf_counter()
        probe.at_rest()
        waited_s = time.perf_counter() - t0
    assert waited_s >= 0.25 and not held
    assert result["states"]["other"] == 2000  # the buffer released, the tensor no collective had still counted
    assert result["unsettled_bytes"] == 0
    with MemoryMeter("cpu") as meter:  # one a library never lets go of: counted after the timeout, and said
        stuck = torch.ones(1000)
        dist.all_reduce(stuck)
        assert meter.settle(timeout_s=0.05) == 4000
        assert meter.current_split()["activations"] == 4000
        t0 = time.perf_counter()
        assert meter.settle(keep=[stuck], timeout_s=60) == 0  # kept on purpose (DDP's buckets): no wait
        assert time.perf_counter() - t0 < 5


def test_at_rest_waits_for_a_buffer_a_communication_library_made_on_its_own_thread(one_rank):
    # gloo's reduce-scatter all-reduces into a buffer its worker thread allocates, copies the result out of it in
    # Work.wait (where the meter first sees it) and frees it on that thread a moment later: here a thread does all three
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held, result = [], {}
    with sharded.measured_step("foreign", result, model, opt) as probe:
        sent = torch.ones(10)
        dist.all_reduce(sent)  # a collective first: what comes after may be the library's
        worker = threading.Thread(target=lambda: held.append(torch.ones(1000)))  # 4,000 B the meter did not see made
        worker.start()
        worker.join()
        sent.copy_(held[0][:10])  # first seen here, as an input
        del sent
        threading.Timer(0.3, held.clear).start()
        t0 = time.perf_counter()
        probe.at_rest()
        waited_s = time.perf_counter() - t0
    assert 0.25 <= waited_s < 5 and not held
    assert result["states"]["other"] == 0 and result["unsettled_bytes"] == 0  # the buffer released, then read


def test_measured_step_reports_a_budget_refusal_instead_of_raising(one_rank):
    model, ddp, opt = _ddp_step()
    result = {"kept": 1}
    with sharded.measured_step("tight", result, ddp, opt, budget_bytes=64) as probe:
        ddp(torch.randn(64, 8)).sum().backward()
        probe.at_rest()
    assert result["kept"] == 1 and result["fits"] is False
    refused = result["refused"]
    assert refused["budget_bytes"] == 64 and refused["in_use_bytes"] + refused["requested_bytes"] > 64


def test_measured_step_asks_for_the_states_at_rest(one_rank):
    model, ddp, opt = _ddp_step()
    with pytest.raises(RuntimeError, match="at_rest"):
        with sharded.measured_step("forgot", {}, ddp, opt):
            ddp(torch.randn(2, 8)).sum().backward()


def test_label_gathered_parameters_counts_a_units_parameters_as_parameters_under_an_open_meter():
    layer = nn.Linear(4, 4)
    sharded.label_gathered_parameters([layer])
    fresh = nn.Parameter(torch.zeros(4, 4))  # created in the meter's window: unlabelled it would count as activations
    with MemoryMeter("cpu", timeline=False) as meter:
        layer.weight = nn.Parameter(torch.ones(4, 4))
        layer(torch.randn(1, 4))
        split = meter.current_split()
    assert split["parameters"] >= 4 * 16 and fresh.numel() == 16


def test_full_tensor_and_grad_diffs_on_plain_tensors():
    t = torch.arange(6.0)
    assert sharded.full_tensor(t) is t  # not a DTensor: itself
    model = nn.Linear(3, 2)
    model(torch.randn(5, 3)).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert sharded.grad_diffs(model, ref) == {"max_rel_grad_diff": 0.0, "rel_grad_diff": 0.0}
    ref["weight"] = ref["weight"] * 2
    diffs = sharded.grad_diffs(model, ref)
    assert diffs["max_rel_grad_diff"] == pytest.approx(0.5) and 0 < diffs["rel_grad_diff"] <= 0.5


def _rank_value(psi, n, stages, bucket_bytes=None, activations=1000):
    """A made-up rank result that holds each point to its formula exactly."""
    from labkit.techniques.zero import model_state_bytes_per_param

    value = {}
    for point, stage in stages.items():
        want = model_state_bytes_per_param(sharded.held_to_formula(point, stage), n)
        states = {k: want[k] * psi for k in sharded.STATE_KINDS} | {"other": 0}
        other = 4 * psi if point == "DDP" and bucket_bytes is None else (bucket_bytes or 0) * (point == "DDP")
        value[point] = {"states": states, "peak": {k: states[k] for k in sharded.STATE_KINDS}
                        | {"activations": activations, "other": other}}
    return value


STAGES = {"DDP": 0, "ZeRO-1": 1, "FSDP2 no-reshard": 2, "FSDP2 ZeRO-3": 3}


def test_formula_errors_and_failures_hold_fsdp2_no_reshard_to_stage_3():
    psi, n = 1000, 4
    value = _rank_value(psi, n, STAGES)
    errors = sharded.formula_errors([value, value], psi, n, STAGES)
    assert all(e == 0 for errs in errors.values() for e in errs.values())
    assert sharded.total_errors(value, psi, n, STAGES)["FSDP2 no-reshard"] > 0.05  # the paper's stage 2 keeps 4 B whole
    assert sharded.formula_failures([value], psi, n, STAGES, block_bytes=100, root_bytes=10) == []
    assert sharded.held_to_formula("FSDP2 no-reshard", 2) == 3 and sharded.held_to_formula("ZeRO-1", 1) == 1


def test_formula_failures_name_each_broken_invariant():
    psi, n = 1000, 2
    value = _rank_value(psi, n, STAGES, bucket_bytes=2 * psi)
    value["ZeRO-1"]["states"]["optimizer_state"] *= 2  # not sharded after all
    value["FSDP2 ZeRO-3"]["peak"]["activations"] += 500  # more than a block and the root above DDP's
    failures = sharded.formula_failures([value], psi, n, STAGES, block_bytes=100, root_bytes=10)
    assert any("ZeRO-1's optimizer_state is 100.0% off stage 1's formula" in f for f in failures)
    assert any("DDP's buckets hold 2.00 B/param" in f for f in failures)
    assert any("FSDP2 ZeRO-3's activations differ from DDP's by 500 B" in f for f in failures)


def test_sent_by_collective_applies_the_ring_factors():
    out = sharded.sent_by_collective({"all_gather": 100, "all_reduce": 100}, {"all_gather": 2, "all_reduce": 1}, 4)
    assert out["all_gather"] == {"calls": 2, "input_bytes": 100, "sent_bytes": 300}  # its shard to 3 others
    assert out["all_reduce"]["sent_bytes"] == 150
    assert out["broadcast"] == {"calls": 0, "input_bytes": 0, "sent_bytes": 0}
    assert sharded.per_param({"parameters": 8}, 4) == {"parameters": 2.0}


def test_print_state_table_shows_each_point_beside_its_formula(capsys):
    psi, n = 1000, 2
    sharded.print_state_table(_rank_value(psi, n, STAGES), psi, n, STAGES)
    out = capsys.readouterr().out
    assert "N = 2 ranks" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("FSDP2 no-reshard"))
    assert "2.00 (2.00)" in line  # parameters sharded at rest, held to stage 3's 4/N


def test_plots_draw_the_budgets_and_the_buckets():
    peaks = {"DDP": {"parameters": 4 << 20, "gradients": 0, "optimizer_state": 8 << 20, "activations": 4 << 20,
                     "other": 4 << 20},
             "FSDP2 ZeRO-3": {"parameters": 2 << 20, "gradients": 0, "optimizer_state": 4 << 20, "activations": 4 << 20,
                              "other": 0}}
    fig, ax = sharded.plot_rank_peaks(peaks, budget_bytes=16 << 20, n=2)  # DDP 20 MiB, ZeRO-3 10 MiB
    assert "1 of 2 points fit one device's budget, 0 fit 1/2 of it" in ax.get_title()
    labels = ax.get_legend_handles_labels()[1]
    assert {"DDP's buckets", "one device's budget", "1/2 of it"} <= set(labels)
    view = {"DDP bucket view": {**peaks["DDP"], "gradients": 4 << 20, "other": 0}}  # the buckets, counted as gradients
    fig, ax = sharded.plot_rank_peaks(view, budget_bytes=16 << 20, n=2, bucket_views=("DDP bucket view",))
    bars = {c.get_label(): c for c in ax.containers}
    assert bars["DDP's buckets"][0].get_height() == 4  # MiB: drawn as the buckets, on top
    assert "gradients" not in ax.get_legend_handles_labels()[1]
    value = {"peak": peaks["DDP"], "states": {"parameters": 4, "gradients": 4, "optimizer_state": 8, "other": 2}}
    fig, ax = sharded.plot_rank_memory("one rank", value, budget_bytes=8 << 20)
    assert ax.get_title() == "one rank" and "budget" in ax.get_legend_handles_labels()[1]


def test_activations_by_phase_splits_the_peak_by_where_each_storage_was_allocated():
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    x = torch.randn(32, 8)
    with MemoryMeter("cpu") as meter:
        meter.track(model)
        kept = torch.zeros(1000)  # live through the peak, allocated before any forward: "other"
        out = model(x)
        out.pow(2).sum().backward()
    split = sharded.activations_by_phase(meter)
    assert sum(split.values()) == meter.peak_split()["activations"]
    assert split["forward"] >= 32 * 64 * 4  # the ReLU's output, kept for backward
    assert split.get("other", 0) >= kept.nbytes
    without = sharded.activations_by_phase(meter, exclude=[kept])
    assert sum(split.values()) - sum(without.values()) == kept.nbytes
