"""The GPUs hosted notebooks give: bf16 or fp16 + GradScaler by compute capability, ranks on GPUs or on the CPU.

No GPU here: torch.cuda is faked by monkeypatching (device count, capability, name), as tests/test_device.py
fakes it for the CUDA meter. The cards are the ones Colab and Kaggle hand out.
"""

from __future__ import annotations

import ast
import json
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from labkit import device as lkdevice
from labkit.dist.launch import RankPlacement, rank_placement
from labkit.validate import ParameterError


def fake_gpus(monkeypatch, count: int, capability=(7, 5), name="Tesla T4"):
    """Make torch see `count` GPUs of one kind (never used for compute: only asked about)."""
    props = types.SimpleNamespace(name=name, major=capability[0], minor=capability[1], total_memory=15 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(lkdevice, "_announced", set())
    monkeypatch.setattr(sys.modules["labkit.dist.launch"], "_ANNOUNCED", set())


@pytest.mark.parametrize("name, capability, want", [
    ("Tesla T4", (7, 5), "fp16"),  # Colab's and Kaggle's free GPU
    ("Tesla P100-PCIE-16GB", (6, 0), "fp16"),  # Kaggle's other one
    ("Tesla V100-SXM2-16GB", (7, 0), "fp16"),
    ("NVIDIA L4", (8, 9), "bf16"),
    ("NVIDIA A100-SXM4-40GB", (8, 0), "bf16"),
    ("NVIDIA H100 80GB HBM3", (9, 0), "bf16"),
])
def test_half_precision_follows_the_compute_capability(monkeypatch, name, capability, want):
    fake_gpus(monkeypatch, 1, capability, name)
    choice = lkdevice.half_precision("cuda")
    assert choice.precision == want
    assert choice.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[want]
    assert choice.needs_scaler == (want == "fp16")
    assert name in choice.reason and f"{capability[0]}.{capability[1]}" in choice.reason
    if want == "fp16":
        assert "GradScaler" in choice.reason and "no bf16" in choice.reason
        assert isinstance(choice.scaler("cuda:0"), torch.amp.GradScaler)
    else:
        assert choice.scaler("cuda") is None


def test_a_t4_is_fp16_although_torch_calls_bf16_supported(monkeypatch):
    """torch.cuda.is_bf16_supported() is True on a T4 (emulation): the choice asks for native bf16."""
    fake_gpus(monkeypatch, 1, (7, 5))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # a T4 makes bf16 tensors
    assert torch.cuda.is_bf16_supported() is True
    assert torch.cuda.is_bf16_supported(including_emulation=False) is False
    assert lkdevice.half_precision("cuda").precision == "fp16"


def test_a_cpu_always_gets_bf16_and_never_a_scaler():
    choice = lkdevice.half_precision("cpu")
    assert (choice.precision, choice.dtype, choice.needs_scaler) == ("bf16", torch.bfloat16, False)
    assert "no fp16 compute on a CPU" in choice.reason and choice.scaler("cpu") is None


def test_rank_placement_without_gpus_is_gloo_on_the_cpu(monkeypatch, capsys):
    fake_gpus(monkeypatch, 0)
    p = rank_placement(2)
    assert (p.device, p.backend) == ("cpu", "gloo") and "no GPU" in p.reason
    assert capsys.readouterr().out == ""  # nothing to explain on a CPU machine


def test_one_gpu_and_two_ranks_run_on_the_cpu_and_say_why_once(monkeypatch, capsys):
    fake_gpus(monkeypatch, 1)  # Colab's single T4
    p = rank_placement(2)
    assert (p.device, p.backend) == ("cpu", "gloo")
    assert "NCCL needs one GPU per rank" in p.reason
    again = rank_placement(2)
    out = capsys.readouterr().out
    assert again == p and out.count("\n") == 1 and "NCCL needs one GPU per rank" in out  # said once per process
    with pytest.raises(ParameterError, match="device='cuda' needs one GPU per rank: nproc=2 ranks, 1 GPUs"):
        rank_placement(2, device="cuda")
    assert rank_placement(1) == RankPlacement("cuda", "nccl", "1 ranks on 1 GPUs: one GPU per rank, nccl")


def test_two_gpus_run_two_ranks_on_nccl_and_four_on_the_cpu(monkeypatch):
    fake_gpus(monkeypatch, 2)  # Kaggle's T4 x2
    p = rank_placement(2)
    assert (p.device, p.backend) == ("cuda", "nccl")
    assert rank_placement(2, backend="gloo").backend == "gloo"  # gloo also runs on GPUs
    assert rank_placement(4).device == "cpu"  # the four-rank memory point of 06 and 07
    assert rank_placement(4, device="cpu").reason.endswith("as asked (2 GPUs visible)")
    with pytest.raises(ParameterError, match="backend='nccl' needs CUDA devices"):
        rank_placement(4, backend="nccl")
    with pytest.raises(ParameterError, match="backend must be one of"):
        rank_placement(2, backend="mpi")


def test_launch_places_its_ranks_with_rank_placement(monkeypatch, tmp_path, capsys):
    """labkit.dist.launch on a one-GPU machine: "auto" runs both ranks on the CPU over gloo and says why."""
    from labkit.dist import launch

    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent("""
        import torch.distributed as dist
        import labkit.dist as ld

        def main():
            return {"device": str(ld.device()), "backend": dist.get_backend()}

        if __name__ == "__main__":
            ld.run(main)
    """))
    fake_gpus(monkeypatch, 1)
    results = launch(script, 2, echo=False, timeout_s=120)
    assert [r.value for r in results] == [{"device": "cpu", "backend": "gloo"}] * 2
    assert "NCCL needs one GPU per rank" in capsys.readouterr().out
    with pytest.raises(ParameterError, match="needs one GPU per rank"):
        launch(script, 2, device="cuda")


def test_gpu_check_from_a_cell_and_outside_the_repository(monkeypatch, tmp_path, capsys, one_thread):
    from labkit import results
    from labkit.tools import gpucheck

    monkeypatch.setattr(results, "checkout_root", lambda: None)
    monkeypatch.delenv(results.BUILD_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert gpucheck.main(["--rehearse-on-cpu", "--skip", "offload", "--skip", "l2l", "--skip", "checkpoint"]) == 0
    report = (tmp_path / "build" / "gpu-check.json").read_text()  # build/ of the working directory
    assert '"chosen"' in report and "chapters use bf16" in capsys.readouterr().out


CHAPTER_03 = Path(__file__).resolve().parents[1] / "notebooks" / "03_mixed_precision.ipynb"


def _chapter_03_code() -> list[str]:
    """Return chapter 03's code cells, in order."""
    return ["".join(c["source"]) for c in json.loads(CHAPTER_03.read_text())["cells"] if c["cell_type"] == "code"]


def _chapter_03_appendix_code() -> list[str]:
    """Return chapter 03's code cells from its first appendix on, in order."""
    cells = json.loads(CHAPTER_03.read_text())["cells"]
    start = next(i for i, c in enumerate(cells)
                 if c["cell_type"] == "markdown" and "".join(c["source"]).startswith("## Appendix"))
    return ["".join(c["source"]) for c in cells[start:] if c["cell_type"] == "code"]


def _chapter_03_statements(marker: str, *names: str) -> str:
    """Return the top-level statements of the chapter-03 cell holding `marker` that assign or define `names`."""
    (cell,) = [c for c in _chapter_03_code() if marker in c]
    tree = ast.parse(cell)
    keep = [stmt for stmt in tree.body
            if any(isinstance(node, ast.Name) and node.id in names for node in ast.walk(stmt)
                   if isinstance(stmt, (ast.Assign, ast.If)))
            or isinstance(stmt, ast.FunctionDef) and stmt.name in names]
    assert keep, (marker, names)
    return "\n".join(ast.get_source_segment(cell, stmt) for stmt in keep)


def test_chapter_03_trains_in_the_format_of_its_device(monkeypatch, capsys):
    """Chapter 03's choice, run on a faked T4: fp16 with a GradScaler, and the cell says why."""
    import labkit

    cell = next(c for c in _chapter_03_code() if "half_precision(device)" in c)
    lines = cell.splitlines()
    choice = "\n".join(lines[:next(i for i, ln in enumerate(lines) if ln.startswith("AUTOCAST_DTYPE")) + 1])
    fake_gpus(monkeypatch, 1, (7, 5), "Tesla T4")
    namespace = {"labkit": labkit, "torch": torch, "half_precision": labkit.device.half_precision,
                 "device": torch.device("cuda", 0)}
    exec(compile(choice, "<03 cell>", "exec"), namespace)
    assert namespace["AUTOCAST_DTYPE"] == torch.float16 and namespace["half"].needs_scaler
    assert capsys.readouterr().out.startswith("16-bit training on this device: Tesla T4 (compute capability 7.5) has no bf16")
    namespace["device"] = torch.device("cpu")
    exec(compile(choice, "<03 cell>", "exec"), namespace)
    assert namespace["AUTOCAST_DTYPE"] == torch.bfloat16


def test_chapter_03_measures_in_the_chosen_format_only():
    """From the choice to the panel, and in the appendices, no measured call names bf16 itself: each takes `half`
    (fp16 on a T4).

    bf16 may be named where it is the subject, not the compute format: the per-format tables (dict keys), the
    cost of storing weights in bf16 (lost updates), the CPU's bf16 instructions, and the panel's offer on a
    CPU (which always trains in bf16).
    """
    cells = _chapter_03_code()
    first = next(i for i, c in enumerate(cells) if "half_precision(device)" in c)
    last = next(i for i, c in enumerate(cells) if "control_panel(" in c)
    subject = ("lost_update_fraction", "cpu_bf16_features", "control_panel(")
    cells = cells[first:last + 1] + _chapter_03_appendix_code()  # the main text's measurements, then the appendices'
    named = []
    for i in range(len(cells)):
        if any(s in cells[i] for s in subject):
            continue
        tree = ast.parse(cells[i])
        tables = {id(n) for d in ast.walk(tree) if isinstance(d, ast.Dict) for kv in (*d.keys, *d.values)
                  if kv is not None  # ({**other}: its key is None)
                  for n in ast.walk(kv)}  # a table of every format ({"bf16": torch.bfloat16, ...}) names them all
        for node in ast.walk(tree):
            if id(node) in tables:
                continue
            literal = isinstance(node, ast.Constant) and node.value == "bf16"
            attr = isinstance(node, ast.Attribute) and node.attr == "bfloat16" and (
                isinstance(node.value, ast.Name) and node.value.id == "torch")
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "bfloat16"
            if literal or attr or call:
                named.append(f"code cell {i}, line {node.lineno}: {ast.get_source_segment(cells[i], node)}")
    assert named == [], named
    # every measured section reaches the choice: the step check, memory, speed, the sweep, the loss curves
    for marker in ("def grads_of", "def step_peak", "def run_precision", "sweep_precisions =", "def train_curve",
                   "saved_tensor_census(", "try_fit(", "products = {"):
        (cell,) = [c for c in cells if marker in c]
        assert "half." in cell, f"the cell of {marker!r} does not take its format from `half`"


@pytest.mark.parametrize("gpu, capability, on_cuda, swept", [
    ("Tesla T4", (7, 5), True, ["fp16"]),  # no bf16 arithmetic: fp16 only (bf16 would be torch's emulation)
    ("NVIDIA A100-SXM4-40GB", (8, 0), True, ["bf16", "fp16"]),  # both in hardware
    (None, None, False, ["bf16"]),  # a CPU: never fp16
])
def test_chapter_03_sweeps_the_formats_its_device_computes(monkeypatch, gpu, capability, on_cuda, swept):
    if gpu:
        fake_gpus(monkeypatch, 1, capability, gpu)
    half = lkdevice.half_precision(torch.device("cuda", 0) if on_cuda else torch.device("cpu"))
    namespace = {"half": half, "ON_CUDA": on_cuda}
    exec(_chapter_03_statements("sweep_precisions =", "sweep_precisions"), namespace)
    assert namespace["sweep_precisions"] == swept


@pytest.mark.parametrize("gpu, capability", [("Tesla T4", (7, 5)), ("NVIDIA L4", (8, 9))])
def test_chapter_03_fp16_section_on_a_gpu(monkeypatch, capsys, gpu, capability):
    """Section 3.5 on a faked GPU (nothing computed): before Ampere it records the chosen fp16's figures, from Ampere
    on it trains and times fp16 beside bf16."""
    import labkit

    fake_gpus(monkeypatch, 1, capability, gpu)
    half = lkdevice.half_precision(torch.device("cuda", 0))
    ran, recorded = [], {}
    measured = {"throughput_ratio": 2.5, "activation_ratio": 0.6, "reliable": True}

    def train_curve(precision):
        ran.append(("train_curve", precision))
        return [5.0, 4.0], 1

    def run_precision(n_embd, batch_size, precision):
        ran.append(("run_precision", precision))
        return measured

    monkeypatch.setattr(labkit, "record", lambda name, value: recorded.__setitem__(name, value))
    namespace = {"labkit": labkit, "half": half, "ON_CUDA": True, "device": torch.device("cuda", 0), "rex": measured,
                 "skipped_steps": {"fp16": 3} if half.precision == "fp16" else {}, "curves": {}, "CURVE_STEPS": 20,
                 "N_EMBD": 128, "BATCH": 16, "train_curve": train_curve, "run_precision": run_precision,
                 "final_rel_diff": lambda p: 0.01}
    exec(_chapter_03_statements("fp16 compute needs CUDA", "ON_CUDA"), namespace)
    if half.precision == "fp16":  # a T4: sections 2.3-3.4 measured fp16 already
        assert ran == [] and recorded["fp16_skipped_steps"] == 3
        assert capsys.readouterr().out.startswith("Tesla T4 (compute capability 7.5) has no bf16 arithmetic")
    else:
        assert ran == [("train_curve", "fp16"), ("run_precision", "fp16")] and recorded["fp16_skipped_steps"] == 1
    assert recorded["throughput_ratio_fp16"] == 2.5 and recorded["activation_bytes_ratio_fp16"] == 0.6


def test_chapter_07_ranks_gather_in_the_format_of_their_device(monkeypatch, tmp_path):
    """Chapter 07's rank script on a faked T4: its 16-bit point gathers in fp16 and steps with a GradScaler."""
    import importlib.util
    from pathlib import Path

    import nbformat

    from labkit.tools.writefiles import written_files

    nb = nbformat.read(Path(__file__).resolve().parents[1] / "notebooks" / "07_sharded_data_parallel.ipynb", as_version=4)
    (name, text), = [f for f in written_files(nb) if f[0].endswith("_ranks.py")]
    assert "half_precision(device)" in text  # the choice is visible in the notebook's own code
    script = tmp_path / name
    script.write_text(text)
    spec = importlib.util.spec_from_file_location("nb07_ranks_formats", script)
    ranks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ranks)
    for gpu, capability, want in (("Tesla T4", (7, 5), "fp16"), ("Tesla V100-SXM2-16GB", (7, 0), "fp16"),
                                  ("NVIDIA A100-SXM4-40GB", (8, 0), "bf16"), ("NVIDIA L4", (8, 9), "bf16")):
        fake_gpus(monkeypatch, 2, capability, gpu)  # Kaggle's two T4s: one per rank (no CUDA step is run)
        half, policy, scaler = ranks.half_format(torch.device("cuda", 0))
        assert half.precision == want and gpu in half.reason, (gpu, half)
        assert policy.param_dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[want]
        assert policy.reduce_dtype == torch.float32  # the ranks' gradients are summed in fp32 either way
        if want == "fp16":
            assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
        else:
            assert scaler is None
    monkeypatch.undo()  # a CPU rank (gloo): bf16 and no scaler, whatever GPUs the machine has
    half, policy, scaler = ranks.half_format(torch.device("cpu"))
    assert (half.precision, policy.param_dtype, scaler) == ("bf16", torch.bfloat16, None)


def test_fsdp2_ranks_skip_together_when_one_overflows(tmp_path):
    """Why chapter 07 steps fp16 with torch.amp.GradScaler (half.scaler), not FSDP1's ShardedGradScaler.

    FSDP2's gradients are DTensors; the scaler's unscale op on them takes the max of "found inf" over the
    mesh, so an overflow in one rank's shard makes every rank skip the step and back off the scale: the
    ranks' weights never diverge. Run on the CPU with fp32 gradients (no fp16 compute on a CPU).
    """
    from labkit.dist import launch

    script = tmp_path / "overflow.py"
    script.write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn
        from torch.distributed.fsdp import fully_shard
        import labkit.dist as ld

        def main():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
            before = [p.to_local().clone() for p in model.parameters()]
            scaler.scale(model(torch.randn(4, 8)).sum()).backward()
            if ld.rank() == 0:  # only rank 0's shard overflows
                next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            return {"scale": scaler.get_scale(), "stepped": any(not torch.equal(b, p.to_local())
                                                                for b, p in zip(before, model.parameters()))}

        if __name__ == "__main__":
            ld.run(main)
    """))
    results = launch(script, 2, device="cpu", echo=False, timeout_s=120)
    assert [r.value for r in results] == [{"scale": 128.0, "stepped": False}] * 2
