"""Notebook 00 under papermill: other parameters, and bad ones that fail before any work."""

import pytest

STEM = "00_where_the_memory_goes"
SMALL = dict(N_LAYER=2, WIDTH=64, HEADS=2, BATCH=8, SEQ_LEN=32, VOCAB=128, BATCH_SWEEP=[2, 4, 8],
             SEQ_SWEEP=[8, 16, 32], ESTIMATE_SEQ=64, TIMED_STEPS=2)


def test_notebook_00_invariants_with_other_parameters(execute_notebook):
    entry = execute_notebook(STEM, SEED=3, **SMALL)
    assert entry["status"] == "ok", entry.get("error")
    m = entry["measurements"]
    assert m["fits_in_budget"] is False
    assert m["budget_bytes"] < m["baseline_peak_bytes"] == m["measured_peak_bytes"]
    assert m["bytes_per_param_sgd"] == 8
    assert m["bytes_per_param_momentum"] == 12
    assert 16 <= m["bytes_per_param_adam_fp32"] < 16.01
    by_batch = {int(k): v for k, v in m["activation_bytes_by_batch"].items()}
    assert by_batch[8] > by_batch[4] > by_batch[2]
    # the per-sample slope is the measured increment per extra sample
    assert m["activation_bytes_per_sample"] == pytest.approx((by_batch[8] - by_batch[2]) / 6, rel=0.02)
    assert m["estimate_rel_diff"] <= 0.01
    assert m["estimate_7b_adam_fp32_bytes"] > 16 * m["estimate_7b_params"]
    assert m["meter_overhead_ratio"] > 0
    assert m["largest_fitting_batch"] < 8


def test_notebook_00_generous_budget_fits(execute_notebook):
    entry = execute_notebook(STEM, BUDGET_MIB=512, **SMALL)
    assert entry["status"] == "ok", entry.get("error")
    assert entry["measurements"]["fits_in_budget"] is True


@pytest.mark.parametrize("params, names", [
    (dict(BATCH=0), ["BATCH", "[1, 4096]"]),
    (dict(DEVICE="tpu"), ["DEVICE", "'auto', 'cpu', 'cuda'"]),
    (dict(BUDGET_MIB=-5), ["BUDGET_MIB", "positive"]),
    (dict(WIDTH=100, HEADS=3), ["WIDTH", "HEADS", "divisible"]),
])
def test_notebook_00_rejects_bad_parameters_before_work(execute_notebook, params, names):
    entry = execute_notebook(STEM, **params)
    assert entry["status"] == "failed"
    for name in names:
        assert name in entry["error"], entry["error"]
    assert entry["measurements"] == {}  # nothing was measured before the error
