"""Notebook 05 under papermill with another seed and depths: the recorded invariants hold."""

import pytest

import labkit
import labkit.costs
from labkit.data import MarkovTokens
from labkit.techniques.l2l import L2LTrainer
from labkit.work import count_work

STEM = "05_layer_to_layer"


def test_notebook_runs_with_other_seed_and_depths(execute_notebook):
    entry = execute_notebook(STEM, SEED=3, N_LAYER=3, BATCH=6, EQUAL_STEPS=2, N_LAYER_SWEEP=[1, 3, 6],
                             SWEEP_N_EMBD=32, SWEEP_SEQ_LEN=16, SWEEP_BATCH=3, TIMED_STEPS=1, MICRO_BATCH=2,
                             ACCUM_STEPS_SWEEP=[1, 3])
    assert entry["status"] == "ok", entry.get("error")
    m = entry["measurements"]
    l2l, plain = m["device_peak_bytes_by_layers_l2l"], m["device_peak_bytes_by_layers_baseline"]
    assert list(l2l) == ["1", "3", "6"] and list(plain) == ["1", "3", "6"]
    assert m["l2l_depth_ratio"] <= 1.1
    assert m["l2l_depth_ratio"] == pytest.approx(l2l["6"] / l2l["1"])
    assert plain["1"] < plain["3"] < plain["6"]
    assert m["max_param_diff_after_steps"] <= 1e-5
    assert m["fits_in_budget"] is True
    assert m["step_time_ratio_l2l"] > 0
    plain, l2l_work = (labkit.costs.work_from_record(m[k]) for k in ("work_plain", "work_l2l"))
    assert l2l_work.total_flops == pytest.approx(m["flop_ratio_l2l"] * plain.total_flops)
    assert l2l_work.host_bytes > 0 == plain.host_bytes  # the weights, gradients and boundaries over the host link
    ex = labkit.running_example(n_layer=3, batch_size=6)  # the steady step, as chapter 08 counts its L2L setting:
    trainer = L2LTrainer(labkit.seeded_model(ex.config, 3), "cpu")  # after a first step has made Adam's state
    batch = MarkovTokens(vocab_size=ex.config.vocab_size, seed=3).batch(6, ex.seq_len)
    trainer.step(batch)
    assert l2l_work.kernels == count_work(trainer.step, batch).kernels
    assert 1 <= m["gpu_step_time_ratio_l2l"] <= m["gpu_step_time_ratio_l2l_serial"]
    assert 1.0 < m["flop_ratio_l2l"] <= 4 / 3 + 1e-9
    weights = m["l2l_weight_bytes_moved_per_sample_by_micro_batches"]
    assert list(m["l2l_bytes_moved_per_sample_by_micro_batches"]) == ["1", "3"]
    assert weights["1"] == pytest.approx(3 * weights["3"])  # once per visit: 1/k per sample
    assert m["l2l_micro_batched_max_rel_grad_diff"] <= 1e-5
    assert m["l2l_one_micro_batch_peak_bytes_by_micro_batches"]["3"] > m["l2l_device_peak_bytes_by_micro_batches"]["3"]
