"""Notebook 02 under papermill with another seed and sizes: the recorded invariants hold; a bad backend refused."""

import math

import pytest

import labkit
import labkit.costs
from labkit.compiled import compile_unavailable_reason

STEM = "02_activation_checkpointing"


def test_notebook_invariants_hold_for_other_seeds_and_sizes(execute_notebook):
    n = 9
    # section 8b with inductor: on a CPU the defaults (nbval, the runner) run the partitioner-only backend
    entry = execute_notebook(STEM, SEED=3, BATCH=5, SEQ_LEN=32, SWEEP_N_LAYER=n, SWEEP_N_EMBD=32, SWEEP_BATCH=3,
                             TIMED_STEPS=1, COMPILE="inductor")
    assert entry["status"] == "ok", entry.get("error")
    m = entry["measurements"]
    assert m["max_grad_diff"] <= 1e-5
    acts = {int(k): v for k, v in m["peak_activation_bytes_by_segments"].items()}
    assert sorted(acts) == list(range(1, n + 1))
    assert m["best_segments"] == min(acts, key=lambda s: (acts[s], s))
    assert m["sqrt_n"] == pytest.approx(math.sqrt(n))
    assert all(acts[s] < acts[1] for s in acts if s > 1)
    assert m["best_segments"] >= math.floor(m["sqrt_n"])
    torch_acts = {int(k): v for k, v in m["peak_activation_bytes_by_segments_torch"].items()}
    assert all(torch_acts[s] >= acts[s] for s in acts)
    assert m["fits_in_budget"] == (m["peak_bytes_checkpointed"] <= m["budget_bytes"])
    assert 1.0 < m["flop_ratio_full_checkpoint"] <= 4 / 3
    assert m["flop_ratio_selective"] == 1.0
    gpu = {int(k): v for k, v in m["gpu_step_time_ratio_by_segments"].items()}  # counted work on the GPU
    assert gpu[1] == 1.0 and all(v >= 1.0 for v in gpu.values())  # recomputation never costs less than the plain step
    assert m["gpu_step_time_ratio_full_checkpoint"] >= 1.0 and m["gpu_step_time_ratio_selective"] >= 1.0
    plain, every = (labkit.costs.work_from_record(m[k]) for k in ("work_plain", "work_every_block"))
    assert plain.total_flops < every.total_flops <= 4 / 3 * plain.total_flops  # the running example, every block
    assert m["peak_activation_bytes_full_checkpoint"] < m["peak_activation_bytes_selective_linear"] \
        < m["peak_activation_bytes_selective"] < acts[1]
    assert m["dropout_grad_diff_rng_preserved"] <= 1e-5 < m["dropout_grad_diff_rng_not_preserved"]
    assert m["batchnorm_batches_tracked_checkpointed"] == 2
    saved = {float(k): v for k, v in m["compile_saved_bytes_by_budget"].items()}
    assert saved[0.0] == 5 * 32 * 128 * 4  # the MLP's (B, T, C) fp32 input: the running example is 128 wide
    assert saved[0.0] <= saved[0.5] <= saved[1.0]
    assert m["compile_flop_ratio_by_budget"]["1.0"] == 1.0 < m["compile_flop_ratio_by_budget"]["0.0"]
    if compile_unavailable_reason("cpu", "inductor") is None:  # a C++ compiler here: 8b compiled with inductor
        assert m["compile_backend"] == "inductor"
        assert m["compile_saved_bytes_ratio"] == 1.0 and m["compile_grad_rel_diff"] <= 1e-4
        assert m["compile_peak_bytes_ratio"] > 0
    else:  # 8b printed why it skipped, and recorded nothing
        assert "compile_backend" not in m
    assert "compile_step_time_ratio" not in m  # timed on CUDA only: a CPU's kernels say nothing about a GPU's


def test_notebook_refuses_an_unknown_compile_backend(validate_parameters):
    error = validate_parameters(STEM, COMPILE="tvm")
    assert isinstance(error, labkit.ParameterError), error
    assert "COMPILE" in str(error) and "'aot_eager_decomp_partition'" in str(error)
