"""labkit.techniques.precision: the autocast step with GradScaler, accumulation and clipping; fp16 range statistics.

Notebook 03 runs in tests/test_nb03.py.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import labkit
from labkit.compare import flat, rel_diff
from labkit.data import MarkovTokens
from labkit.techniques import precision as P
from labkit.validate import ParameterError


def _grads_used(model, step):
    """Run step(model, opt) with Adam; return the gradients the optimizer used (one tensor per step)."""
    opt = labkit.make_optimizer("adam", model.parameters())
    with P.captured_grads(opt) as seen:
        step(model, opt)
    return seen


# -- autocast and precision checks -------------------------------------------------------------------
def test_autocast_dtypes_and_fp32_off():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with P.autocast("bf16", "cpu"):
        assert lin(x).dtype == torch.bfloat16
        assert lin.weight.dtype == torch.float32  # master weights stay fp32
    with P.autocast("fp32", "cpu"):
        assert lin(x).dtype == torch.float32
    with pytest.raises(ValueError, match="precision"):
        P.autocast("int8", "cpu")


def test_fp16_compute_on_cpu_refused(tiny_gpt, tiny_batch):
    with pytest.raises(ValueError, match="fp16 compute on CPU"):
        P.check_precision("fp16", "cpu")
    model = tiny_gpt()
    with pytest.raises(ValueError, match="fp16"):
        P.amp_train_step(model, labkit.make_optimizer("adam", model.parameters()), [tiny_batch(4)], precision="fp16")


# -- amp_train_step ---------------------------------------------------------------------------------
def test_fp32_with_scaler_equals_plain_step_bitwise(tiny_gpt, tiny_batch):
    batch = tiny_batch(4, seed=1)
    a, b = tiny_gpt(), tiny_gpt()
    g_plain = _grads_used(a, lambda m, o: labkit.train_step(m, o, batch))
    g_amp = _grads_used(b, lambda m, o: P.amp_train_step(m, o, [batch], precision="fp32",
                                                         scaler=torch.amp.GradScaler("cpu")))
    assert torch.equal(g_plain[0], g_amp[0])
    assert torch.equal(flat(a), flat(b))


def test_one_batch_steps_and_returns_its_loss(tiny_gpt, tiny_batch):
    model = tiny_gpt()
    opt = labkit.make_optimizer("adam", model.parameters())
    batch = tiny_batch(4, seed=2)
    with torch.no_grad():
        expected = float(model(*batch)[1])
    step = P.amp_train_step(model, opt, [batch], precision="fp32")
    assert step.stepped and step.scale is None and step.grad_norm is None
    assert step.loss == pytest.approx(expected, rel=1e-6)


def test_bf16_step_keeps_fp32_weights_and_grads_close_to_fp32(tiny_gpt, tiny_batch):
    batch = tiny_batch(4, seed=3)
    a, b = tiny_gpt(), tiny_gpt()
    g32 = _grads_used(a, lambda m, o: P.amp_train_step(m, o, [batch], precision="fp32"))[0]
    dtypes = []
    opt = labkit.make_optimizer("adam", b.parameters())
    opt.register_step_pre_hook(lambda *_: dtypes.extend(p.grad.dtype for p in b.parameters()))
    with P.captured_grads(opt) as seen:
        step = P.amp_train_step(b, opt, [batch], precision="bf16")
    assert set(dtypes) == {torch.float32}
    assert all(p.dtype == torch.float32 for p in b.parameters())
    assert torch.nn.functional.cosine_similarity(seen[0], g32, dim=0) > 0.99
    assert math.isfinite(step.loss)


@pytest.mark.parametrize("n_micro", [2, 3])
def test_accumulation_is_token_weighted(n_micro, tiny_gpt, tiny_config):
    data = MarkovTokens(tiny_config.vocab_size, seed=5)
    x, y, _ = data.padded_batch(5, tiny_config.block_size, min_len=1, generator=torch.Generator().manual_seed(5))
    micro = list(zip(torch.tensor_split(x, n_micro), torch.tensor_split(y, n_micro)))
    counts = [int((mb[1] != -100).sum()) for mb in micro]
    assert len(set(counts)) > 1  # uneven token counts: a plain mean of means would be wrong
    g_full = _grads_used(tiny_gpt(), lambda m, o: labkit.train_step(m, o, (x, y)))[0]
    g_acc = _grads_used(tiny_gpt(), lambda m, o: P.amp_train_step(m, o, micro, precision="fp32"))[0]
    assert rel_diff(g_acc, g_full) < 1e-5


def test_update_runs_once_per_optimizer_step(tiny_gpt, tiny_batch):
    x, y = tiny_batch(6, seed=6)
    micro = list(zip(torch.tensor_split(x, 3), torch.tensor_split(y, 3)))
    model = tiny_gpt()
    opt = labkit.make_optimizer("adam", model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)  # doubles at every update
    step = P.amp_train_step(model, opt, micro, precision="fp32", scaler=scaler)
    assert step.stepped and step.scale == 2.0**11


def test_clipping_unscales_first(tiny_gpt, tiny_batch):
    batch = tiny_batch(4, seed=7)
    a, b = tiny_gpt(), tiny_gpt()

    def plain(m, o):
        _, loss = m(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
        o.step()

    g_plain = _grads_used(a, plain)[0]
    result = {}
    g_amp = _grads_used(b, lambda m, o: result.setdefault(
        "step", P.amp_train_step(m, o, [batch], precision="fp32", scaler=torch.amp.GradScaler("cpu"), clip_norm=0.1)))[0]
    assert torch.allclose(g_amp, g_plain, rtol=1e-6, atol=1e-9)
    assert float(g_amp.norm()) == pytest.approx(0.1, rel=1e-4)
    assert result["step"].grad_norm > 0.1  # the true norm, not S times it
    assert result["step"].grad_norm < 1e3


def test_inf_gradients_skip_the_step_and_halve_the_scale(tiny_gpt, tiny_batch):
    model = tiny_gpt()
    before = flat(model)
    opt = labkit.make_optimizer("adam", model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # loss · 2^127 overflows fp32
    with P.captured_grads(opt) as seen:
        step = P.amp_train_step(model, opt, [tiny_batch(4, seed=8)], precision="fp32", scaler=scaler)
    assert not step.stepped and step.scale == 2.0**126
    assert seen == []  # optimizer.step() never ran
    assert torch.equal(flat(model), before)
    assert all(p.grad is None for p in model.parameters())  # zeroed for the next step


def test_empty_micro_batches_refused(tiny_gpt):
    model = tiny_gpt()
    with pytest.raises(ValueError, match="micro-batch"):
        P.amp_train_step(model, labkit.make_optimizer("adam", model.parameters()), [], precision="fp32")


# -- memory helpers ---------------------------------------------------------------------------------
def test_forward_activation_bytes_bf16_between_half_and_fp32_and_fake_equals_real(tiny_gpt, tiny_batch, tiny_config):
    model, batch = tiny_gpt(), tiny_batch(4, seed=9)
    a32 = P.forward_activation_bytes(model, batch, "fp32")
    a16 = P.forward_activation_bytes(model, batch, "bf16")
    assert 0.5 * a32 < a16 < a32
    with FakeTensorMode():
        fm = labkit.GPT(tiny_config)
        fb = labkit.example_batch(tiny_config, 4)
        assert P.forward_activation_bytes(fm, fb, "bf16") == a16
        assert P.forward_activation_bytes(fm, fb, "fp32") == a32


def test_amp_step_fn_fake_peak_equals_real_peak(tiny_gpt, tiny_batch, tiny_config):
    model = tiny_gpt()
    real = labkit.measure_step(model, labkit.make_optimizer("adam", model.parameters()), tiny_batch(4, seed=10),
                               step_fn=P.amp_step_fn("bf16"))
    with FakeTensorMode():
        fm = labkit.GPT(tiny_config)
        fake = labkit.measure_step(fm, labkit.make_optimizer("adam", fm.parameters()), labkit.example_batch(tiny_config, 4),
                                   step_fn=P.amp_step_fn("bf16"), device="cpu")
    assert fake.peak_bytes == real.peak_bytes
    plain = labkit.estimate_training_memory(tiny_config, 4).peak_bytes
    assert real.peak_bytes < plain


# -- fp16 range -------------------------------------------------------------------------------------
def test_fp16_cast_stats_counts():
    v = torch.tensor([0.0, 2.0**-26, 1.5 * 2.0**-25, 2.0**-20, 1.0, 7.0e4, -2.0**-30])
    st = P.fp16_cast_stats(v)
    assert st.nonzero == 6
    assert st.zero_fraction == pytest.approx(2 / 6)  # 2^-26 and -2^-30 flush to 0
    assert st.below_min_subnormal_fraction == pytest.approx(3 / 6)  # 1.5·2^-25 rounds up to 2^-24
    assert st.subnormal_fraction == pytest.approx(2 / 6)  # 1.5·2^-25 -> 2^-24, and 2^-20
    assert st.overflow_fraction == pytest.approx(1 / 6)  # 70000 > 65504
    assert st.normal_fraction == pytest.approx(1 / 6)  # 1.0
    assert list(st.bins) == ["flushed to zero", "subnormal", "normal", "overflow"]
    assert sum(st.bins.values()) == pytest.approx(1.0)  # disjoint: 1.5·2^-25 counts once, as a subnormal
    nan = P.fp16_cast_stats(torch.tensor([1.0, float("nan")]))  # a NaN falls in no bin: the bins fall short of 1
    assert nan.normal_fraction == pytest.approx(1 / 2) and sum(nan.bins.values()) == pytest.approx(1 / 2)
    scaled = P.fp16_cast_stats(v, 2.0**16)
    assert scaled.zero_fraction == 0.0 and scaled.overflow_fraction == pytest.approx(2 / 6)  # 1.0 and 7e4
    assert P.fp16_cast_stats(torch.zeros(3)).nonzero == 0
    with pytest.raises(ValueError, match="scale"):
        P.fp16_cast_stats(v, 0.0)


def test_fp16_cast_stats_are_the_casts_own_comparisons():
    """The counts from fp16's bit patterns are those of comparing the cast values themselves, at every scale a loss
    scaler takes, on values of every kind: ±0, fp32 subnormals, ties at fp16's edges, inf and NaN."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(20_000, generator=g) * torch.exp2(torch.randint(-40, 20, (20_000,), generator=g).float())
    edges = [0.0, -0.0, 1e-45, -2.0**-25, 2.0**-25, 3 * 2.0**-26, 2.0**-14, -65504.0, 65519.0, 65520.0, 7e4,
             float("inf"), float("-inf"), float("nan")]
    v = torch.cat([v, torch.tensor(edges * 3)])
    for scale in (2.0**-12, 1.0, 2.0**16, 2.0**32, 2.0**127):  # 2^127: fp32's largest power of two
        x = v[v != 0] * scale
        h = x.to(torch.float16)
        expected = (int((h == 0).sum()), int(((h != 0) & (h.abs() < P.FP16_MIN_NORMAL)).sum()), int(h.isinf().sum()),
                    int((x.abs() < P.FP16_MIN_SUBNORMAL).sum()),
                    int((h.isfinite() & (h.abs() >= P.FP16_MIN_NORMAL)).sum()))
        st = P.fp16_cast_stats(v, scale)
        assert st.nonzero == x.numel()
        counts = (st.zero_fraction, st.subnormal_fraction, st.overflow_fraction, st.below_min_subnormal_fraction,
                  st.normal_fraction)
        assert tuple(round(c * st.nonzero) for c in counts) == expected, scale
    with pytest.raises(ParameterError, match=r"scale must be a number in \(0\.0, 3\.40"):
        P.fp16_cast_stats(v, 2.0**128)  # beyond fp32: inf in the multiply, and 0 x inf would make the zeros NaN


def test_collect_gradients_shapes_and_steps(tiny_gpt, tiny_batch, tiny_config):
    model = tiny_gpt()
    batches = [tiny_batch(4, seed=12), tiny_batch(4, seed=13)]
    w0 = flat(model)
    opt = labkit.make_optimizer("adam", model.parameters())
    s1 = P.collect_gradients(model, opt, batches)
    n = labkit.count_params(model)
    assert s1.weights.numel() == 2 * n and len(s1.losses) == 2
    assert s1.activations.numel() == 2 * tiny_config.n_layer * 4 * tiny_config.block_size * tiny_config.n_embd
    assert not torch.equal(flat(model), w0)
    assert P.log2_magnitudes(torch.tensor([0.0, 0.25, -4.0])).tolist() == [-2.0, 2.0]


def test_lost_update_fraction():
    w = torch.ones(4)
    assert P.lost_update_fraction(w, torch.full((4,), 1e-4), torch.bfloat16) == 1.0  # below bf16's spacing at 1
    assert P.lost_update_fraction(w, torch.full((4,), 1e-2), torch.bfloat16) == 0.0
    assert P.lost_update_fraction(w, torch.full((4,), 1e-3), torch.float16) == 0.0  # fp16 has finer spacing
    assert P.lost_update_fraction(w, torch.zeros(4)) == 0.0


def test_a_wide_model_on_few_tokens_keeps_more_bytes_in_bf16_than_in_fp32():
    # weight copies (width²) outweigh the activations (tokens × width); the activations alone still shrink
    from labkit.saved import saved_tensor_census

    cfg = labkit.running_example(n_layer=1, n_embd=256, n_head=4, batch_size=2, seq_len=2).config
    torch.manual_seed(0)
    model = labkit.GPT(cfg)
    batch = MarkovTokens(cfg.vocab_size, seed=0).batch(2, 2, torch.Generator().manual_seed(0))
    act32 = P.forward_activation_bytes(model, batch, "fp32")
    act16 = P.forward_activation_bytes(model, batch, "bf16")
    assert act16 / act32 > 1.0  # what notebook 03 records as activation_bytes_ratio_half

    def saved(dtype):
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            census = saved_tensor_census(model, lambda: model(*batch)[1])
        return sum(v for k, v in census.by_dtype_kind().items() if k.endswith("activations"))

    assert 0.5 < saved(torch.bfloat16) / saved(None) < 1.0  # saved_activation_ratio_half


def test_op_result_dtypes_sees_autocast_casts_and_fp32_loss():
    lin = torch.nn.Linear(4, 3)
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        seen = P.op_result_dtypes(lambda: torch.nn.functional.cross_entropy(lin(x), y))
    assert seen["addmm"] == {"bf16"}  # the linear layer runs in 16 bits
    assert "fp32" in seen["nll_loss_forward"] or "fp32" in seen.get("_log_softmax", set())  # the loss in fp32
    with torch.no_grad():
        plain = P.op_result_dtypes(lambda: lin(x))
    assert plain == {"addmm": {"fp32"}, "t": {"fp32"}}  # no autocast: no casts, fp32 results


def test_ops_by_dtype_groups_and_sorts():
    groups = P.ops_by_dtype({"mm": {"bf16"}, "add": {"fp32"}, "_to_copy": {"fp32", "bf16"}, "addmm": {"bf16"}})
    assert groups == {"bf16": ["addmm", "mm"], "bf16+fp32": ["_to_copy"], "fp32": ["add"]}


def test_curve_gap_measures_final_means_and_fall():
    g = P.curve_gap([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.2, 2.2], tail=2)
    assert (g.final_fp32, g.start_loss, g.fall) == (2.5, 5.0, 2.5)
    assert g.gap == pytest.approx(0.2) and g.rel_diff == pytest.approx(0.08)
    assert g.follows(0.10) and not g.follows(0.05)
    assert not P.curve_gap([2.0, 3.0], [2.0, 3.0], tail=1).follows(0.5)  # the loss rose: nothing to follow
    with pytest.raises(ValueError):
        P.curve_gap([1.0, 2.0], [1.0], tail=1)
    with pytest.raises(ValueError):
        P.curve_gap([1.0, 2.0], [1.0, 2.0], tail=3)


def test_forward_loss_runs_under_the_named_autocast(tiny_gpt, tiny_batch):
    model, batch = tiny_gpt(), tiny_batch(4)
    plain = P.forward_loss(model, batch, "fp32")
    with torch.no_grad():
        assert torch.equal(plain.detach(), model(*batch)[1])  # fp32: autocast off, the model's own loss
    half = P.forward_loss(model, batch, "bf16")
    assert half.dtype == torch.float32 and half.requires_grad  # the loss runs in fp32 and keeps its graph
    half_v, plain_v = half.item(), plain.item()  # (float() of a tensor with a graph warns)
    assert 0 < abs(half_v - plain_v) < 0.05 * plain_v  # 16-bit matmuls: close, not equal
    with pytest.raises(ParameterError):
        P.forward_loss(model, batch, "fp8")


def test_step_outcome_returns_the_gradients_used_the_weights_after_and_their_dtypes(tiny_gpt, tiny_batch):
    model, batch = tiny_gpt(), tiny_batch(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = flat(model)
    grads, after, dtypes = P.step_outcome(model, opt, lambda m, o: P.amp_train_step(m, o, [batch], precision="bf16"))
    assert torch.equal(after, flat(model)) and torch.allclose(after, before - 0.5 * grads)  # SGD: w - lr·g
    assert dtypes == [torch.float32] * len(list(model.parameters()))  # fp32 parameters get fp32 gradients
    assert not opt._optimizer_step_pre_hooks  # the dtype hook is removed


def _autocast_step(model, optimizer, batch, dtype, scaler=None):
    """Notebook 03's step: forward under autocast at `dtype` (None: fp32), backward (scaled with a scaler), one step."""
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):  # None: fp32
        _, loss = model(*batch)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)


def test_count_scaled_step_adds_the_scalers_kernels_and_no_flops(tiny_config):
    from labkit.train import create_optimizer_state
    from labkit.work import count_work

    scaled = P.count_scaled_step(_autocast_step, tiny_config, torch.bfloat16, 2, 8, seed=0)
    model = labkit.seeded_model(tiny_config, 0)
    opt = labkit.make_optimizer("adam", model.parameters())
    create_optimizer_state(opt)
    batch = tuple(torch.zeros(2, 8, dtype=torch.long) for _ in range(2))
    plain = count_work(_autocast_step, model, opt, batch, torch.bfloat16)
    assert scaled.flops == plain.flops and scaled.flops.get("bf16", 0) > 0  # the same matmuls, in bf16
    assert scaled.kernels > plain.kernels  # scale, unscale_ with its inf check, update
    assert scaled.bytes_accessed > plain.bytes_accessed


def test_optimizer_state_bytes_counts_adams_moments_not_its_step():
    lin = torch.nn.Linear(4, 3)  # 15 parameters
    opt = labkit.make_optimizer("adam", lin.parameters())
    assert P.optimizer_state_bytes(opt) == 0  # no state before the first step
    lin(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert P.optimizer_state_bytes(opt) == 15 * 2 * 4  # exp_avg and exp_avg_sq in fp32; the scalar step left out


def test_params_grads_state_bytes_counts_each_tensor_once_by_its_dtype():
    lin = torch.nn.Linear(4, 3).to(torch.bfloat16)  # 15 parameters, 2 bytes each
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)  # no state
    assert P.params_grads_state_bytes(lin.parameters(), opt) == 15 * 2  # no gradients yet
    lin(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    master = [torch.zeros(5, requires_grad=True)]  # fp32, without a gradient
    assert P.params_grads_state_bytes([*lin.parameters(), *master], opt) == 15 * 2 * 2 + 5 * 4


def test_count_fake_step_counts_what_the_real_step_counts(tiny_config):
    from labkit.train import create_optimizer_state
    from labkit.work import count_work

    model = labkit.seeded_model(tiny_config, 0)
    opt = labkit.make_optimizer("adam", model.parameters())
    create_optimizer_state(opt)
    batch = tuple(torch.zeros(2, 8, dtype=torch.long) for _ in range(2))
    fake32 = P.count_fake_step(_autocast_step, tiny_config, None, 2, 8)
    assert fake32 == count_work(_autocast_step, model, opt, batch, None)  # operator for operator
    fake16 = P.count_fake_step(_autocast_step, tiny_config, torch.bfloat16, 2, 8)
    assert fake16.total_flops == fake32.total_flops and fake16.flops.get("fp32", 0) == 0  # every FLOP moved to bf16


def test_a_micro_batch_that_fails_without_gradient_sync_leaves_the_model_syncing(tiny_gpt, tiny_batch):
    """grad_sync="last" turns FSDP2's reduce-scatter off before all but the last micro-batch; a micro-batch that raises
    (an OOM) turns it back on, as FSDP2 leaves a model by default."""
    calls = []

    model = tiny_gpt()

    class Failing(type(model)):  # FSDP2's switch, recorded; the second micro-batch's forward fails
        def set_requires_gradient_sync(self, on):
            calls.append(on)

        def forward(self, *batch):
            if len(calls) > 1:
                raise torch.OutOfMemoryError("the second micro-batch")
            return super().forward(*batch)
    model.__class__ = Failing
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(torch.OutOfMemoryError):
        P.amp_train_step(model, opt, [tiny_batch(2)] * 3, precision="fp32", grad_sync="last")
    assert calls == [False, False, True]  # off for the first two, on again after the failure
