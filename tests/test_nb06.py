"""Notebook 06 under papermill with another seed and sequence length: the recorded invariants hold."""

from pathlib import Path

import pytest

import labkit
from labkit.costs import work_from_record
from labkit.gpus import step_time

STEM = "06_model_and_tensor_parallel"


def test_notebook_06_invariants_with_other_parameters(execute_notebook):
    """Another seed and sequence length: the same verdicts (the check cells pass)."""
    entry = execute_notebook(STEM, SEED=3, N_LAYER=4, BATCH=16, SEQ_LEN=32, GPU="t4")
    assert entry["status"] == "ok", entry.get("error")
    m = entry["measurements"]
    for name in ("max_rel_grad_diff_model_parallel", "max_rel_grad_diff_tensor_parallel"):
        assert 0 <= m[name] <= 1e-5, (name, m[name])
    assert 0 < m["utilisation_model_parallel"] <= 0.5 + 0.02  # two ranks taking turns
    ex = labkit.running_example(n_layer=4, batch_size=16, seq_len=32)
    peaks = m["peak_bytes_by_rank_model_parallel"]
    assert ex.baseline_peak_bytes > ex.budget_bytes  # one process does not fit...
    assert sorted(peaks) == ["0", "1"] and all(p <= ex.budget_bytes for p in peaks.values())  # ...each rank does
    assert m["fits_in_budget_per_rank"] is True
    assert all(p < ex.baseline_peak_bytes for p in peaks.values())
    assert m["sent_bytes_by_rank_model_parallel"] == {"0": 16 * 32 * 128 * 4, "1": 16 * 32 * 128 * 4}
    assert 0.5 < m["param_bytes_per_rank_ratio_tensor_parallel"] < 1  # embeddings, norms and head stay whole
    # six all-reduces of a (B, T, C) fp32 activation per block: 2 forward, 4 backward (q, k, v, up)
    assert m["comm_bytes_per_step_tensor_parallel"] == 4 * 6 * 16 * 32 * 128 * 4
    tp_peaks = m["peak_bytes_by_rank_tensor_parallel"]  # heads and hidden units split: every rank fits
    assert sorted(tp_peaks) == ["0", "1"] and all(p <= ex.budget_bytes for p in tp_peaks.values())
    assert all(p < ex.baseline_peak_bytes for p in tp_peaks.values())
    # each rank counted its metered step (labkit.work), the one process its own: model parallelism's ranks share one
    # process's FLOPs out, a tensor-parallel rank computes a little over half of them (its shards: WorkCounter counts a DTensor's operators on them)
    work = {name: work_from_record(w) for name, w in m["work_by_setting"].items()}
    mp, tp = ([work[f"{name}, rank {r}"] for r in range(2)] for name in ("model parallel", "tensor parallel"))
    one = work["one process"]
    assert sum(w.total_flops for w in mp) == one.total_flops
    # the ranks take turns in forward and backward, then update side by side: the slower update counts once
    ups = [work_from_record(m["update_work_by_rank_model_parallel"][str(r)]) for r in range(2)]
    slower = max(ups, key=lambda w: step_time(w, m["gpu"]).with_launches_s)
    in_turn = work["model parallel, ranks in turn"]
    assert in_turn.kernels == mp[0].kernels + mp[1].kernels - sum(u.kernels for u in ups) + slower.kernels
    assert in_turn.total_flops == one.total_flops - sum(u.total_flops for u in ups) + slower.total_flops
    assert all(0.5 * one.total_flops < w.total_flops < 0.6 * one.total_flops for w in tp)
    assert one.sent_bytes == 0 and all(w.sent_bytes > 0 for w in mp + tp)
    tied = ex.config.vocab_size * 128 * 4  # the embedding/head weight, all-reduced between the two ranks
    assert all(w.sent_bytes == 16 * 32 * 128 * 4 + tied for w in mp)  # and one (B, T, C) boundary each way
    assert all(w.sent_bytes == 4 * 6 * 16 * 32 * 128 * 4 for w in tp)  # all-reduced: 2(K - 1)/K = 1x at K = 2
    # the wire bytes chapter 10 reads: the shapes' figures, equal to what the counters saw
    assert m["wire_bytes_by_rank_model_parallel"] == {str(r): w.sent_bytes for r, w in enumerate(mp)}
    assert m["wire_bytes_per_rank_tensor_parallel"] == tp[0].sent_bytes
    assert all(w.kernels > 0 and w.bytes_accessed > 0 and set(w.flops) == {"fp32"} for w in work.values())
    # the projection: the T4's roofline of each counted step, positive
    assert m["gpu"] == "t4"
    t4 = {name: step_time(w, "t4").time_s for name, w in work.items()}
    assert m["gpu_step_s_by_setting"] == pytest.approx(t4) and all(s > 0 for s in t4.values())


def test_the_model_parallel_script_keeps_its_reference_on_the_batchs_device(monkeypatch, tmp_path):
    """The rank script moves its one-process reference to the rank's device, where the batch is.

    A stand-in for a GPU: the meta device (fake CUDA autograd aborts on CPU-only builds, and a
    reference left on the CPU fails on meta as it would on cuda:rank: "Tensor on device cpu is not
    on the expected device meta"). One rank, in this process; gradients are not compared (meta has
    no values).
    """
    import importlib.util

    import nbformat
    import torch
    import torch.distributed as dist

    import labkit.dist as ld
    from labkit.tools.writefiles import written_files

    nb = nbformat.read(Path(__file__).resolve().parents[1] / "notebooks" / f"{STEM}.ipynb", as_version=4)
    path = tmp_path / "mp_ranks.py"
    path.write_text(dict(written_files(nb))["06_model_parallel_ranks.py"])
    spec = importlib.util.spec_from_file_location("mp_ranks", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(ld, "device", lambda: torch.device("meta"))
    compared = []
    monkeypatch.setattr(script, "max_rel_diff", lambda a, b: compared.append(
        {t.device.type for t in (*a.values(), *b.values())}) or 0.0)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        out = script.main(seed=0, n_layer=2, n_head=2, batch=4, seq_len=8)
    finally:
        dist.destroy_process_group()
    assert compared == [{"meta"}]  # the pieces' gradients and the reference's, on one device
    assert out["param_bytes"] > 0 and out["comm_bytes"] == {}  # one rank: nothing to send
