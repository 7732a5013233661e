"""labkit.gpus: a step's counted work as a time on a GPU, and each achieved fraction of peak against published runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from labkit import gpus
from labkit.checkpointing import checkpoint_blocks
from labkit.models import GPTConfig, build_model
from labkit.validate import ParameterError
from labkit.work import Work, count_work

pytestmark = pytest.mark.usefixtures("one_thread")
RUNS = {r["id"]: r for r in json.loads((Path(__file__).parent / "data" / "published_runs.json").read_text())["rows"]}
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
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, name=name: type("P", (), {"name": name}))
        assert gpus.cuda_profile().name == key
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"name": "Quadro K600"}))
    with pytest.raises(ParameterError, match="GPU: no profile .* matches this CUDA device \\(Quadro K600\\)"):
        gpus.cuda_profile()


def counted_flops_per_token(row: dict) -> float:
    """Return labkit.work's FLOPs per token of a published run's step: a bf16 step of one row of seq_len tokens on fake
    tensors at depths 1 and 2, each further block adding the same (the optimizer's elementwise ops count none)."""
    m = row["model"]
    assert m["kv_heads"] == m["heads"], "labkit's GPT has multi-head attention only"
    cfg = GPTConfig(n_layer=1, n_embd=m["hidden"], n_head=m["heads"], block_size=row["seq_len"], vocab_size=m["vocab"],
                    bias=False, mlp="swiglu", mlp_hidden=m["ffn_hidden"], norm="rms", pos="rope", attn="sdpa",
                    fused_qkv=False, tie_weights=m["tied"])
    flops = []
    for depth in (1, 2):
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = build_model(dataclasses.replace(cfg, n_layer=depth))
            if row["checkpointing"].startswith("full"):
                checkpoint_blocks(model, segments=depth)
            x = torch.randint(m["vocab"], (1, row["seq_len"]))

            def step():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    _, loss = model(x, x)
                loss.backward()
            flops.append(count_work(step).total_flops)
    return (flops[0] + (flops[1] - flops[0]) * (m["layers"] - 1)) / row["seq_len"]


@pytest.mark.parametrize("gpu", ["a100-80gb", "h100"])
def test_each_efficiency_is_its_source_runs_and_predicts_another_run_within_25_percent(gpu):
    """The fraction: the source run's tokens/s x counted FLOPs per token over the bf16 peak. Its check: a different
    published run's tokens/s, predicted as fraction x peak / that run's counted FLOPs per token."""
    profile = gpus.GPUS[gpu]
    source = next(r for r in RUNS.values() if r["use"] == f"efficiency source: {gpu.split('-')[0]}")
    check = next(r for r in RUNS.values() if r["use"].startswith(f"efficiency check: {gpu.split('-')[0]}"))
    assert source["id"] in profile.efficiency.source and check["id"] in profile.efficiency.check
    peak = profile.flops_per_s["bf16"]
    fraction = source["tokens_per_s_per_gpu"] * counted_flops_per_token(source) / peak
    assert profile.efficiency.fraction == pytest.approx(fraction, abs=0.0005)
    predicted = profile.efficiency.fraction * peak / counted_flops_per_token(check)
    lo, hi = (check["tokens_per_s_per_gpu"],) * 2 if isinstance(check["tokens_per_s_per_gpu"], int) else \
        check["tokens_per_s_per_gpu"]
    error = min(abs(predicted / lo - 1), abs(predicted / hi - 1))
    assert error <= 0.25, (check["id"], predicted, lo, hi)
    assert f"{predicted:,.0f} predicted" in profile.efficiency.check  # the docstring's figure is this one
