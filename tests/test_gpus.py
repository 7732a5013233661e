"""labkit.gpus: a step's counted work as a time on a GPU, and each achieved fraction of peak against published runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import labkit
from labkit import gpus
from labkit.planner.published import flops_per_token, published_runs
from labkit.validate import ParameterError
from labkit.work import Work

pytestmark = pytest.mark.usefixtures("one_thread")
RUNS = {r["id"]: r for r in published_runs()}
WORK = Work({"fp32": 3e12, "bf16": 4e12}, 5e9, 1000, 2e9, 9e9)


def test_each_precision_runs_at_its_own_rate_and_bf16_runs_as_fp16_on_a_t4():
    t4, a100 = gpus.step_time(WORK, "t4"), gpus.step_time(WORK, "a100-80gb")
    assert t4.compute_s == pytest.approx(3e12 / 8.1e12 + 4e12 / 65e12)  # the T4 has no bf16: its fp16 tensor cores
    assert a100.compute_s == pytest.approx(3e12 / 19.5e12 + 4e12 / 312e12)
    assert a100.memory_s == pytest.approx(5e9 / 2039e9) and a100.host_s == pytest.approx(2e9 / 32e9)
    assert a100.comm_s == pytest.approx(9e9 / 300e9)
    assert gpus.GPUS["t4"].half == "fp16" and gpus.GPUS["a100-80gb"].half == "bf16"


def test_the_bound_overlaps_everything_and_the_estimate_divides_compute_by_the_published_fraction():
    a100 = gpus.step_time(WORK, "a100-80gb")
    assert a100.bound_s == max(a100.compute_s, a100.memory_s, a100.host_s, a100.comm_s) == a100.compute_s
    assert a100.estimate_s == pytest.approx(a100.compute_s / 0.559) and a100.estimate_s > a100.bound_s
    host_bound = gpus.step_time(dataclasses.replace(WORK, host_bytes=1e12), "a100-80gb")
    assert host_bound.bound_s == host_bound.estimate_s == host_bound.host_s  # the link, not compute, sets the pace
    t4 = gpus.step_time(WORK, "t4")
    assert t4.fraction is None and t4.estimate_s is None  # no published run on a T4 to take a fraction from
    assert t4.device_s == max(t4.compute_s, t4.memory_s) and a100.device_s == a100.estimate_s  # no transfer bound it
    assert t4.in_line_s == t4.device_s + t4.host_s + t4.comm_s > t4.bound_s  # in line: the copies add


def test_a_cuda_device_is_matched_to_its_profile_by_name(monkeypatch):
    for name, key in (("Tesla T4", "t4"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA H100 80GB HBM3", "h100"),
                      ("NVIDIA L4", "l4"), ("NVIDIA GeForce RTX 4090", "rtx4090")):
        offered = gpus.GPUS[key].memory_bytes - 2**20  # another driver's total_memory for the same card
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device, name=name: type("P", (), {"name": name, "total_memory": offered}))
        found = gpus.cuda_profile()
        assert found.name == key and found.memory_bytes == offered  # the card's own total, not the profile's
        assert found.memory_bytes_per_s == gpus.GPUS[key].memory_bytes_per_s  # its datasheet rates otherwise
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("P", (), {"name": "Quadro K600", "total_memory": 2**30}))
    with pytest.raises(ParameterError, match="GPU: no profile .* matches this CUDA device \\(Quadro K600\\)"):
        gpus.cuda_profile()


@pytest.mark.parametrize("gpu", ["a100-80gb", "h100"])
def test_each_efficiency_is_its_source_runs_and_predicts_another_run_within_25_percent(gpu):
    """The fraction: the source run's tokens/s x counted FLOPs per token over the bf16 peak. Its check: a different
    published run's tokens/s, predicted as fraction x peak / that run's counted FLOPs per token."""
    profile = gpus.GPUS[gpu]
    source = next(r for r in RUNS.values() if r["use"] == f"efficiency source: {gpu.split('-')[0]}")
    check = next(r for r in RUNS.values() if r["use"].startswith(f"efficiency check: {gpu.split('-')[0]}"))
    assert source["id"] in profile.efficiency.source and check["id"] in profile.efficiency.check
    peak = profile.flops_per_s["bf16"]
    fraction = source["tokens_per_s_per_gpu"] * flops_per_token(source) / peak
    assert profile.efficiency.fraction == pytest.approx(fraction, abs=0.0005)
    predicted = profile.efficiency.fraction * peak / flops_per_token(check)
    lo, hi = (check["tokens_per_s_per_gpu"],) * 2 if isinstance(check["tokens_per_s_per_gpu"], int) else \
        check["tokens_per_s_per_gpu"]
    error = min(abs(predicted / lo - 1), abs(predicted / hi - 1))
    assert error <= 0.25, (check["id"], predicted, lo, hi)
    assert f"{predicted:,.0f} predicted" in profile.efficiency.check  # the docstring's figure is this one


def test_the_launch_time_per_operator_is_the_recorded_gpu_runs():
    """EAGER_OPERATOR_S is chapter 00's plain step on the recorded H200 over the kernels labkit.work counts in that
    step (counted here: the same operators as the run's record), to 0.1 µs."""
    import json

    from labkit.work import count_work

    run = json.loads(gpus.GPU_RUN_PATH.read_text())
    assert "H200" in run["hardware"] and run["torch"].startswith("2.11")
    m = run["notebooks"]["00_where_the_memory_goes"]["measurements"]
    ex = labkit.running_example()  # chapter 00's defaults, its plain step after a warm-up, as the run counted it
    model = labkit.seeded_model(ex.config, 0, "cpu")
    opt = labkit.make_optimizer("adam", model.parameters())
    batch = labkit.estimate.example_batch(ex.config, ex.batch_size, ex.seq_len)
    labkit.train_step(model, opt, batch)
    kernels = count_work(labkit.train_step, model, opt, batch).kernels
    assert kernels == m["work_plain"]["kernels"]
    assert gpus.EAGER_OPERATOR_S == pytest.approx(m["step_s"] / kernels, abs=0.05e-6)


def test_a_step_of_many_small_kernels_is_launch_bound_and_a_large_one_is_not():
    from labkit.costs import cost_table

    small = Work(flops={"fp32": 5 * 10**9}, bytes_accessed=5 * 10**8, kernels=700)  # the running example, about
    large = dataclasses.replace(small, flops={"fp32": 5 * 10**13})  # the same kernels, 10,000 x the FLOPs
    t = gpus.step_time(small, "a100-80gb")
    assert t.launch_s == pytest.approx(700 * gpus.EAGER_OPERATOR_S) and t.launch_bound
    assert not gpus.step_time(large, "a100-80gb").launch_bound
    assert t.time_s == gpus.step_time(dataclasses.replace(small, kernels=0), "a100-80gb").time_s  # left out of it
    table = cost_table({"small": small, "large": large}, "t4")
    assert "1 of 2 settings takes longer to launch than to run on the t4" in table
    assert "host time per operator (labkit.gpus.EAGER_OPERATOR_S: chapter 00's step timed on an H200" in table
    rows = {line.split()[0]: line.split() for line in cost_table({"small": small, "large": large}, "t4", "small")
            .splitlines()[2:4]}  # x base by the work alone, then w/ launch: each step the longer of the two
    on_t4 = gpus.step_time(small, "t4"), gpus.step_time(large, "t4")
    assert float(rows["large"][-2]) == pytest.approx(on_t4[1].time_s / on_t4[0].time_s, rel=0.01)
    assert float(rows["large"][-1]) == pytest.approx(on_t4[1].time_s / on_t4[0].launch_s, rel=0.01)
    assert rows["small"][-2:] == ["1.00", "1.00"] and float(rows["large"][-1]) < float(rows["large"][-2])
    assert gpus.step_time(small, gpus.measure_cpu(n=64, repeats=1)).launch_s == 0  # a CPU runs what it dispatches


def test_the_cost_table_shows_host_and_peer_bytes_only_where_a_setting_moves_some():
    from labkit.costs import cost_table

    plain = Work(flops={"fp32": 10**9}, bytes_accessed=10**8, kernels=100)
    offload = dataclasses.replace(plain, host_bytes=3 * 2**20)
    sharded = dataclasses.replace(plain, sent_bytes=5 * 2**20)
    for works, host, sent in (({"plain": plain}, False, False), ({"plain": plain, "offload": offload}, True, False),
                              ({"plain": plain, "sharded": sharded}, False, True),
                              ({"offload": offload, "sharded": sharded}, True, True)):
        lines = cost_table(works, "t4", baseline=next(iter(works))).splitlines()
        head, legend = lines[1].split(), lines[2 + len(works)]
        assert ("host" in head, "sent" in head) == (host, sent)
        assert all(len(line.split()) == 9 + host + sent for line in lines[2:2 + len(works)])  # a value per column
        assert ("MiB host: over PCIe" in legend, "MiB sent: to other GPUs" in legend) == (host, sent)
        unmoved = " or ".join(["copies over PCIe"] * (not host) + ["sends to other GPUs"] * (not sent))
        assert (f"no setting here {unmoved};" in legend) == (not (host and sent)), legend
    rows = {line.split()[0]: line.split() for line in cost_table({"plain": plain, "offload": offload}, "t4").splitlines()}
    assert rows["offload"][5] == "3.0" and rows["plain"][5] == "0.0"  # the column under "MiB host"


def test_the_readme_quotes_the_recorded_gpu_run_as_recorded():
    import json
    from pathlib import Path

    from labkit.costs import work_from_record

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    m = json.loads(gpus.GPU_RUN_PATH.read_text())["notebooks"]["00_where_the_memory_goes"]["measurements"]
    bound_s = gpus.step_time(work_from_record(m["work_plain"]), "h200").bound_s
    quoted = (f"{m['step_s'] * 1e3:.1f} ms for the running example's plain step, {m['step_s'] / bound_s:.0f} times its "
              f"roofline ({bound_s * 1e3:.3f} ms), or {gpus.EAGER_OPERATOR_S * 1e6:.1f} µs for each of the\n"
              f"{m['work_plain']['kernels']} kernels it launches")
    assert quoted in readme
