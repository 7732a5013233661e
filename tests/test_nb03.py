"""Notebook 03 under papermill with other parameters: the recorded invariants hold."""

import pytest
import torch

import labkit
import labkit.costs
import labkit.gpus
from labkit.cpu import bf16_native

STEM = "03_mixed_precision"


def test_notebook_invariants_hold_for_other_parameters(execute_notebook):
    entry = execute_notebook(STEM, SEED=3, N_LAYER=2, N_EMBD=64, N_HEAD=2, BATCH=6, SEQ_LEN=32,
                             N_EMBD_SWEEP=[16, 32], SWEEP_BATCH=2, CURVE_STEPS=10, CURVE_N_EMBD=32, CURVE_BATCH=4,
                             GRAD_STEPS=2, ACCUM_STEPS=4, LOSS_SCALE=1024.0)
    assert entry["status"] == "ok", entry.get("error")
    m = entry["measurements"]
    ex = labkit.running_example(n_layer=2, n_embd=64, n_head=2, batch_size=6, seq_len=32)
    assert m["budget_bytes"] == ex.budget_bytes and m["peak_bytes_fp32"] == ex.baseline_peak_bytes
    assert 0.5 < m["activation_bytes_ratio_half"] < 1.0
    assert m["peak_bytes_half"] < m["peak_bytes_fp32"]
    assert 0 < m["weight_copy_bytes_per_param"] < 2  # 2 bytes per matmul weight; embeddings and norms have none
    assert 0 <= m["bf16_lost_update_fraction"] <= 1
    # a 2^10 loss scale lifts gradients out of fp16's subnormal range and out of the range below 2^-24
    assert m["fp16_subnormal_fraction_scaled"] < m["fp16_subnormal_fraction_unscaled"]
    assert m["fp16_underflow_fraction_scaled"] < m["fp16_underflow_fraction_unscaled"]
    assert m["fits_in_budget"] == (m["peak_bytes_half"] <= m["budget_bytes"])  # the verdict for a GPU
    assert m["fits_in_budget_this_autocast"] == (m["peak_bytes_half_this_autocast"] <= m["budget_bytes"])
    if not torch.cuda.is_available():  # the recorded 16-bit peak is the step with CUDA autocast's dtypes, this CPU's aside
        assert m["peak_bytes_half"] == _fake_half_peak(ex, cuda_ops=True) != m["peak_bytes_half_this_autocast"]
        assert m["peak_bytes_half_this_autocast"] == _fake_half_peak(ex, cuda_ops=False)
    timed = torch.cuda.is_available() or bf16_native()  # 16-bit steps are timed only where 16-bit units run them
    assert ("throughput_ratio_half" in m) == timed
    if timed:
        assert m["throughput_ratio_half"] > 0 and isinstance(m["throughput_ratio_half_reliable"], bool)
    w32, w16 = (labkit.costs.work_from_record(m[k]) for k in ("work_fp32", "work_half"))
    assert w16.total_flops == w32.total_flops == w32.flops["fp32"] and "fp32" not in w16.flops
    assert m["gpu"] == "t4" or torch.cuda.is_available()  # GPU="auto" without CUDA: a T4
    assert m["gpu_step_time_ratio_half"] == 1 / m["gpu_speedup_half"] and m["gpu_speedup_half"] > 1  # bytes halve
    scaled = labkit.costs.work_from_record(m["work_fp16_scaled"])  # the 16-bit step a T4 runs: it has no bf16 units
    assert scaled.kernels > w16.kernels  # fp16 + GradScaler: the scaler's unscale_, inf check, update
    w16_gpu = scaled if labkit.gpus.device_profile(m["gpu"]).half == "fp16" else w16  # the 16-bit step the GPU runs
    on_gpu = [labkit.gpus.step_time(w, m["gpu"]) for w in (w32, w16_gpu)]  # the companion counts the host's launches
    assert m["gpu_speedup_half"] == pytest.approx(on_gpu[0].time_s / on_gpu[1].time_s)
    assert m["gpu_step_time_ratio_half_launches"] == pytest.approx(on_gpu[1].with_launches_s / on_gpu[0].with_launches_s)
    assert m["gpu_speedup_half_with_launches"] == pytest.approx(1 / m["gpu_step_time_ratio_half_launches"])
    assert sorted(int(w) for w in m["gpu_speedup_half_by_width"]) == [16, 32]
    assert m["final_loss_rel_diff_half"] < 0.05
    assert 0 <= m["fp16_underflow_fraction_scaled"] <= m["fp16_underflow_fraction_unscaled"] < 1
    for which in ("unscaled", "scaled"):  # only values below 2^-24 can be flushed to zero
        assert m[f"fp16_flushed_to_zero_fraction_{which}"] <= m[f"fp16_underflow_fraction_{which}"]
    assert 0.5 < m["saved_activation_ratio_half"] < 1.0
    assert [r["width"] for r in m["sweep_half"]] == [16, 32]
    assert m["half_precision"] == "bf16"  # a CPU trains in bf16: every *_half figure above is bf16's


def _fake_half_peak(ex, cuda_ops: bool) -> int:
    """Return the bf16 autocast step's peak of running example `ex` on fake tensors, with CUDA autocast's dtypes or
    this CPU's."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    from labkit.autocast_ops import CudaAutocastOps
    from labkit.techniques.precision import amp_step_fn

    with CudaAutocastOps() if cuda_ops else contextlib.nullcontext(), FakeTensorMode():
        model = labkit.GPT(ex.config)
        opt = labkit.make_optimizer("adam", model.parameters())
        batch = labkit.example_batch(ex.config, ex.batch_size, ex.seq_len)
        return labkit.measure_step(model, opt, batch, step_fn=amp_step_fn("bf16", None), device="cpu").peak_bytes
