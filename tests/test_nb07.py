"""Notebook 07 under papermill with another seed and four ranks: the recorded invariants hold; its rank
script reports a budget refusal as a result ("does not fit"), not a crash."""

from pathlib import Path

import nbformat
import pytest

import labkit
import labkit.dist as ld
from labkit.dist.launch import rank_placement
from labkit.dist.rank import DEVICE_ENV
from labkit.techniques import zero
from labkit.tools.writefiles import written_files

STEM = "07_sharded_data_parallel"
POINTS = {"DDP": 0, "ZeRO-1": 1, "FSDP2 no-reshard": 2, "FSDP2 ZeRO-3": 3}
STATE_KINDS = ("parameters", "gradients", "optimizer_state")


def rank_script(tmp_path):
    """Write the notebook's rank script (its %%writefile cell) into tmp_path and import it as a module."""
    import importlib.util

    nb = nbformat.read(Path(__file__).resolve().parents[1] / "notebooks" / f"{STEM}.ipynb", as_version=4)
    (name, text), = [f for f in written_files(nb) if f[0].endswith("_ranks.py")]
    script = tmp_path / name
    script.write_text(text)
    spec = importlib.util.spec_from_file_location(f"nb07_ranks_{tmp_path.name}", script)
    ranks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ranks)
    return ranks


def test_notebook_07_invariants_with_another_seed_on_four_ranks(execute_notebook):
    n = 4
    entry = execute_notebook(STEM, SEED=3, N_RANKS=n, MEMORY_RANKS=0, ESTIMATE_RANKS=[8])
    assert entry["status"] == "ok", entry.get("error")
    m = entry["measurements"]
    assert 0 <= m["max_rel_grad_diff_ddp"] <= 1e-5
    assert 0 <= m["max_rel_grad_diff_fsdp"] <= 1e-5
    per_param = m["bytes_per_param_per_rank_by_stage"]
    assert list(per_param) == [str(n)]  # MEMORY_RANKS=0: the four-rank point is the measured one
    peak = m["peak_bytes_per_param_per_rank_by_stage"][str(n)]
    for point, stage in POINTS.items():
        got = per_param[str(n)][point]
        assert set(got) == {*STATE_KINDS, "other"}  # at rest: no activations, the rest is "other"
        want = zero.model_state_bytes_per_param(3 if stage == 2 else stage, n)  # FSDP2: see the notebook
        for kind in STATE_KINDS:
            assert got[kind] == pytest.approx(want[kind], rel=0.05), (point, kind)
            assert m["zero_formula_rel_error_by_category"][str(n)][point][kind] <= 0.05, (point, kind)  # every rank
        assert set(peak[point]) == {*STATE_KINDS, "activations", "other"}
    assert m["zero_formula_rel_error_by_stage"][str(n)]["FSDP2 no-reshard"] > 0.05  # the paper's stage 2 keeps whole parameters
    assert per_param[str(n)]["DDP"]["other"] - per_param[str(n)]["FSDP2 ZeRO-3"]["other"] == pytest.approx(4)  # buckets
    assert peak["DDP"]["other"] == 4 and peak["DDP"]["activations"] == peak["ZeRO-1"]["activations"]
    assert peak["FSDP2 no-reshard"]["parameters"] > peak["FSDP2 ZeRO-3"]["parameters"]  # gathered from forward to backward
    psi = labkit.running_example().config.n_params()
    ring = zero.ring_factor(n)
    comm = m["comm_bytes_per_step_by_stage"]
    for point, elements in (("DDP", 2), ("DDP bucket view", 2), ("ZeRO-1", 3), ("FSDP2 no-reshard", 2), ("FSDP2 ZeRO-3", 3)):
        assert comm[point] == pytest.approx(elements * psi * 4 * ring, rel=0.01), point
    by_kind = m["comm_bytes_by_collective_by_stage"]
    assert by_kind["DDP"]["all_reduce"]["input_bytes"] == 4 * psi and by_kind["DDP"]["reduce_scatter"]["calls"] == 0
    assert by_kind["FSDP2 ZeRO-3"]["all_gather"]["sent_bytes"] == pytest.approx(2 * 4 * psi * ring, rel=0.01)
    assert by_kind["FSDP2 ZeRO-3"]["reduce_scatter"]["sent_bytes"] == pytest.approx(4 * psi * ring, rel=0.01)
    for point, kinds in by_kind.items():
        assert sum(k["sent_bytes"] for k in kinds.values()) == pytest.approx(comm[point]), point
    # each rank counted its step's work as it ran: sharding changes no FLOPs, checkpointing recomputes, 16 bits
    # compute in 16 bits; the projection sends what the counter counted
    work = m["work_by_point"]
    flops = {p: sum(w["flops"].values()) for p, w in work.items()}
    assert all(flops[p] == pytest.approx(flops["DDP"], rel=1e-3) for p in POINTS) and flops["DDP"] > 0
    assert flops["FSDP2 ZeRO-3 + checkpointing"] > 1.1 * flops["FSDP2 ZeRO-3"]
    assert set(work[f"FSDP2 ZeRO-3 {m['half_precision']}"]["flops"]) >= {m["half_precision"]}
    assert all(w["sent_bytes"] == comm[p] for p, w in work.items() if p in comm)
    assert set(m["gpu_step_s_by_point"]) == set(work) and all(s > 0 for s in m["gpu_step_s_by_point"].values())
    # the budget verdict, checked against the recorded per-rank peaks and budget
    peaks, budget = m["checkpointing_peak_bytes_per_rank"], m["rank_budget_bytes"]
    assert len(peaks) == n and budget == labkit.running_example().budget_bytes // n
    assert m["fits_in_budget_per_rank"] is True
    assert all(p is not None and 0 < p <= budget for p in peaks)
    assert all(0 <= e <= 0.02 for e in m["estimate_rel_error_by_stage"].values())
    by_stage = m["estimate_7b_per_rank_bytes_by_ranks"]["8"]
    assert by_stage["0"] > by_stage["1"] > by_stage["3"] > 0
    ranks_on = rank_placement(n).device  # the CPU here; a GPU per rank would run their format
    assert m["half_precision"] == labkit.device.half_precision(ranks_on).precision  # bf16, fp16 before Ampere
    assert m["half_all_gather_ratio"] == 0.5  # 2-byte values either way
    # every point judged against both budgets; the checkpointing point fits 1/N, plain DDP does not
    verdicts = m["fits_whole_and_1_over_n_budget_by_point"]
    assert m["bucket_view_bytes_per_param_saved_at_rest"] == pytest.approx(4)  # gradient_as_bucket_view: no second copy
    assert verdicts["FSDP2 ZeRO-3 + checkpointing"][f"1/{n} of it"] is True
    assert verdicts["DDP"][f"1/{n} of it"] is False
    assert m["use_when"]["part_budget"] in verdicts and verdicts[m["use_when"]["part_budget"]][f"1/{n} of it"]
    if verdicts["DDP"]["whole budget"]:  # of the points that fit and pay nothing else, the fewest bytes, then the peak
        free = [p for p, v in verdicts.items() if v["whole budget"] and p not in m["pays_by_point"]]
        chosen, peak = m["use_when"]["whole_budget"], m["peak_bytes_per_param_per_rank_by_stage"][str(n)]
        assert chosen in free and comm[chosen] == min(comm[p] for p in free)
        rivals = [p for p in free if p in peak and comm[p] == comm[chosen]]
        assert chosen not in peak or sum(peak[chosen].values()) == min(sum(peak[p].values()) for p in rivals)
    # DeepSpeed's estimates beside the formulas, the difference explained per row (where DeepSpeed is installed)
    for row in m["deepspeed_bytes_per_param"]:
        assert row["deepspeed"] - row["mixed"] == pytest.approx(row["explained"], abs=1e-8), row


def test_rank_script_reports_a_budget_refusal_as_does_not_fit(tmp_path, monkeypatch):
    """A rank over its budget returns fits=False with the refused allocation instead of raising (one rank, in process)."""
    import torch.distributed as dist

    ranks = rank_script(tmp_path)
    monkeypatch.setenv(DEVICE_ENV, "cpu")  # this rank computes on the CPU, as a launched one would here
    budget = 256 * 1024
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        results = ranks.main(n_layer=1, n_head=2, batch=2, seq_len=8, points=[], mixed_precision=False,
                             checkpoint_budget_bytes=budget)
    finally:
        dist.destroy_process_group()
    (point, value), = results.items()
    assert point == "FSDP2 ZeRO-3 + checkpointing" and value["fits"] is False
    refused = value["refused"]
    assert refused["budget_bytes"] == budget and refused["in_use_bytes"] + refused["requested_bytes"] > budget
    assert value["max_rel_grad_diff"] <= 1e-5  # the unbudgeted first step ran and was right


def test_rank_script_steps_the_16_bit_point_with_a_grad_scaler_where_the_format_needs_one(tmp_path, monkeypatch):
    """The fp16 path of the rank script (scale, unscale, step, update) on one CPU rank, in process.

    A CPU never computes in fp16: the stand-in keeps bf16's dtype and asks for a scaler, as fp16 does on a
    T4, so the point is named and stepped as the fp16 one (tests/test_gpu_choices.py fakes the T4 itself).
    """
    import dataclasses

    import torch.distributed as dist

    ranks = rank_script(tmp_path)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    stand_in = dataclasses.replace(labkit.device.half_precision("cpu"), precision="fp16", needs_scaler=True)
    monkeypatch.setattr(ranks, "half_precision", lambda device: stand_in)  # the script imports the name
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        results = ranks.main(n_layer=1, n_head=2, batch=2, seq_len=8, points=[], mixed_precision=True)
    finally:
        dist.destroy_process_group()
    (point, value), = results.items()
    assert point == "FSDP2 ZeRO-3 fp16" and value["precision"] == "fp16" and value["fits"]
    assert value["loss_scale"] == 2.0 ** 16  # GradScaler's initial scale: no step overflowed, none was skipped
    assert value["rel_grad_diff"] < 0.05  # unscaled before the comparison (scaled, it would be about 2**16)
    assert value["states"]["optimizer_state"] > 0  # the warm-up step was taken: Adam's state exists
