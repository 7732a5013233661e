"""Notebook 06b under papermill with another seed, sequence length and micro-batch sweep: the recorded invariants hold."""

import pytest

import labkit
from labkit.costs import work_from_record
from labkit.gpus import step_time
from labkit.pipelinerun import describe_bubble

STEM = "06b_pipeline_parallel"


def test_notebook_06b_invariants_with_other_parameters(execute_notebook):
    """Another seed and sweep, and four ranks for the memory point: the same verdicts (the check cells pass)."""
    entry = execute_notebook(STEM, SEED=3, N_LAYER=4, BATCH=16, SEQ_LEN=32, ACCUM_STEPS_SWEEP=[2, 4, 8, 16],
                             MEMORY_RANKS=4, TIMED_STEPS=1, GPU="t4")
    assert entry["status"] == "ok", entry.get("error")
    m = entry["measurements"]
    assert 0 <= m["max_rel_grad_diff_pipeline"] <= 1e-5
    theory = {int(k): v for k, v in m["bubble_fraction_theory_by_microbatches"].items()}
    assert theory == pytest.approx({2: 1 / 3, 4: 1 / 5, 8: 1 / 9, 16: 1 / 17})
    measured = m["bubble_fraction_measured_by_microbatches"]
    replayed = m["bubble_fraction_replayed_by_microbatches"]
    for record in (measured, replayed):
        assert sorted(int(k) for k in record["GPipe"]) == [2, 4, 8, 16]
        assert sorted(int(k) for k in record["1F1B"]) == [2, 4, 8, 16]  # 1F1B needs M >= K: every point here
        assert all(0 <= v < 1 for schedule in record.values() for v in schedule.values())
    for name, by_m in measured.items():  # the verdict chapter 10 repeats: one timed step each, the medians' own trend
        ms = sorted(int(k) for k in by_m)
        ys = [by_m[str(k)] for k in ms]
        assert m["bubble_trend_by_schedule"][name].startswith(
            describe_bubble(ms, ys, [(y, y) for y in ys]).split(", then rises")[0]), name
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
    # each stage counted its metered step and the Adam update (labkit.work), at the sweep's fewest and most M: more
    # micro-batches launch more kernels for the same FLOPs, and send the same bytes (one activation forward, its
    # gradient back, and the tied embedding/head weight all-reduced between the two ends)
    work = {name: work_from_record(w) for name, w in m["work_by_stage"].items()}
    assert sorted(work) == ["stage 0, M=16", "stage 0, M=2", "stage 1, M=16", "stage 1, M=2"]
    vocab = labkit.running_example(n_layer=4, batch_size=16, seq_len=32).config.vocab_size
    for s in range(2):
        few, many = work[f"stage {s}, M=2"], work[f"stage {s}, M=16"]
        assert few.flops == many.flops and few.total_flops > 0
        assert few.sent_bytes == many.sent_bytes == 16 * 32 * 128 * 4 + vocab * 128 * 4
        assert many.kernels > 2 * few.kernels
    # the projection: the T4's roofline of each counted step (GPU="t4"), positive
    t4 = {name: step_time(w, "t4").time_s for name, w in work.items()}
    assert m["gpu_step_s_by_stage"] == pytest.approx(t4) and all(s > 0 for s in t4.values())
    # a step with its bubble: each stage's row less its update x (M + K - 1)/M, then the update, the slowest stage's;
    # by the work alone and with launches
    steps, updates = m["gpu_pipeline_step_s"], {n: work_from_record(w) for n, w in m["update_work_by_stage"].items()}
    for mb in (2, 16):
        for launches in (False, True):
            def t(w):
                return step_time(w, "t4").with_launches_s if launches else step_time(w, "t4").time_s
            rows = [(t(work[f"stage {s}, M={mb}"]), t(updates[f"stage {s}, M={mb}"])) for s in range(2)]
            assert 0 < rows[0][1] < rows[0][0]  # the update is part of the row
            want = max((row - up) * (mb + 1) / mb + up for row, up in rows)
            assert steps[f"M={mb}" + (" with launches" if launches else "")] == pytest.approx(want)
    assert steps["M=16 with launches"] > steps["M=2 with launches"]  # at this size each micro-batch's launches cost
    # the metered activation peaks against c_s + (h A_s + t_s)/M with the counts built in (h = M, K - s)
    assert 0 <= m["held_model_max_rel_error"] <= 0.05
