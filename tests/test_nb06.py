"""Notebook 06 under papermill with another seed, depth and micro-batch sweep: the recorded invariants hold."""

from pathlib import Path

import pytest

import labkit

STEM = "06_model_and_pipeline_parallel"


def test_notebook_06_invariants_with_other_parameters(execute_notebook):
    """Another seed, batch and sweep, and four ranks for the memory point: the same verdicts (the check cells pass)."""
    entry = execute_notebook(STEM, SEED=3, N_LAYER=4, BATCH=16, SEQ_LEN=32, ACCUM_STEPS_SWEEP=[2, 4, 8, 16],
                             MEMORY_RANKS=4, TIMED_STEPS=1)
    assert entry["status"] == "ok", entry.get("error")
    m = entry["measurements"]
    for name in ("max_rel_grad_diff_model_parallel", "max_rel_grad_diff_tensor_parallel", "max_rel_grad_diff_pipeline"):
        assert 0 <= m[name] <= 1e-5, (name, m[name])
    assert 0 < m["utilisation_model_parallel"] <= 0.5 + 0.02  # two ranks taking turns
    ex = labkit.running_example(n_layer=4, batch_size=16, seq_len=32)
    peaks = m["peak_bytes_by_rank_model_parallel"]
    assert ex.baseline_peak_bytes > ex.budget_bytes  # one process does not fit...
    assert sorted(peaks) == ["0", "1"] and all(p <= ex.budget_bytes for p in peaks.values())  # ...each rank does
    assert m["fits_in_budget_per_rank"] is True
    assert all(p < ex.baseline_peak_bytes for p in peaks.values())
    assert 0.5 < m["param_bytes_per_rank_ratio_tensor_parallel"] < 1  # embeddings, norms and head stay whole
    # six all-reduces of a (B, T, C) fp32 activation per block: 2 forward, 4 backward (q, k, v, up)
    assert m["comm_bytes_per_step_tensor_parallel"] == 4 * 6 * 16 * 32 * 128 * 4
    theory = {int(k): v for k, v in m["bubble_fraction_theory_by_microbatches"].items()}
    assert theory == pytest.approx({2: 1 / 3, 4: 1 / 5, 8: 1 / 9, 16: 1 / 17})
    measured = m["bubble_fraction_measured_by_microbatches"]
    replayed = m["bubble_fraction_replayed_by_microbatches"]
    for record in (measured, replayed):
        assert sorted(int(k) for k in record["GPipe"]) == [2, 4, 8, 16]
        assert sorted(int(k) for k in record["1F1B"]) == [2, 4, 8, 16]  # 1F1B needs M >= K: every point here
        assert all(0 <= v < 1 for schedule in record.values() for v in schedule.values())
    # the sweep does not start at 1: micro-batches held are still counted (from the fit), K - s for 1F1B; the
    # same at K = 4 (from three points, M = 4, 8, 16: a fit with a residual, not one count repeated)
    for key, k in (("micro_batches_held_by_microbatches", 2), ("micro_batches_held_4_stages", 4)):
        held = {name: {int(mb): v for mb, v in by_m.items()} for name, by_m in m[key].items()}
        assert all(abs(h - (k - s)) <= 0.25 for by_stage in held["1F1B"].values() for s, h in enumerate(by_stage))
        assert all(abs(h - mb) <= 0.25 + 0.02 * mb for mb, by_stage in held["GPipe"].items() for h in by_stage)
    assert sorted(int(mb) for mb in m["micro_batches_held_4_stages"]["1F1B"]) == [4, 8, 16]
    gpipe = {int(k): v for k, v in m["stage_activation_peak_bytes_gpipe_by_microbatches"].items()}
    one_f = {int(k): v for k, v in m["stage_activation_peak_bytes_1f1b_by_microbatches"].items()}
    assert all(a < g for a, g in zip(one_f[16], gpipe[16]))  # 1F1B holds fewer micro-batches than GPipe
    assert all(a16 < a2 for a2, a16 in zip(one_f[2], one_f[16]))  # and fewer bytes as M grows at a fixed batch
    # torch's schedules ran labkit's order and, forwards numbered from 0, their own description
    assert all(o["torch_from_0"] for o in m["schedule_orders_match"].values())


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
