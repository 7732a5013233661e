"""Gradient accumulation: labkit.techniques.accumulation's reference implementation (notebook 01: tests/test_nb01.py)."""

from __future__ import annotations

import pytest
import torch

import labkit
from labkit.compare import grads, max_rel_diff, max_param_diff
from labkit.data import TeacherTask
from labkit.models import count_tokens
from labkit.techniques.accumulation import (accumulate_gradients, accumulation_step, make_accumulation_step, split_batch,
                                 split_sizes)

TOL = 1e-5


def _full_grad(model, batch):
    model.zero_grad(set_to_none=True)
    _, loss = model(*batch)
    loss.backward()
    return grads(model), float(loss.detach())


def _acc_grad(model, batch, micro, normalise="mean"):
    model.zero_grad(set_to_none=True)
    total = accumulate_gradients(model, batch, micro, normalise=normalise)
    return grads(model), float(total)


# -- splitting ---------------------------------------------------------------------------------
def test_split_sizes_even_and_ragged():
    assert split_sizes(16, 4) == [4, 4, 4, 4]
    assert split_sizes(16, 5) == [5, 5, 5, 1]
    assert split_sizes(3, 8) == [3]


def test_split_batch_keeps_rows_in_order():
    x = torch.arange(7)[:, None].repeat(1, 3)
    y = torch.arange(7)
    parts = split_batch((x, y), 3)
    assert [p[0].shape[0] for p in parts] == [3, 3, 1]
    assert torch.equal(torch.cat([p[1] for p in parts]), y)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_bad_micro_batch_size_is_refused(bad):
    with pytest.raises(ValueError, match="micro_batch_size"):
        split_sizes(8, bad)


def test_mismatched_rows_and_bad_mode_are_refused(tiny_gpt):
    model = tiny_gpt()
    x = torch.zeros(4, 16, dtype=torch.long)
    with pytest.raises(ValueError, match="first dimension"):
        accumulate_gradients(model, (x, x[:3]), 2)
    with pytest.raises(ValueError, match="normalise must be one of"):
        accumulate_gradients(model, (x, x), 2, normalise="sum")
    with pytest.raises(ValueError, match="normalise must be one of"):
        make_accumulation_step(2, normalise="median")


# -- gradient equality ---------------------------------------------------------------------------
@pytest.mark.parametrize("micro", [1, 2, 3, 5, 9])
def test_mean_equals_full_batch_gpt_even_and_ragged(micro, tiny_gpt, tiny_batch):
    model = tiny_gpt(1)
    batch = tiny_batch(10, seed=2)
    g_full, loss_full = _full_grad(model, batch)
    g_acc, loss_acc = _acc_grad(model, batch, micro)
    assert max_rel_diff(g_acc, g_full) <= TOL
    assert loss_acc == pytest.approx(loss_full, rel=1e-5)


@pytest.mark.parametrize("micro", [2, 3, 7])
def test_mean_equals_full_batch_mlp(micro):
    torch.manual_seed(0)
    model = labkit.MLP(labkit.MLPConfig(hidden=64, depth=2))
    batch = TeacherTask(seed=4).batch(16, torch.Generator().manual_seed(5))
    g_full, _ = _full_grad(model, batch)
    g_acc, _ = _acc_grad(model, batch, micro)
    assert max_rel_diff(g_acc, g_full) <= TOL


@pytest.mark.parametrize("micro", [3, 4])
def test_tokens_equals_full_batch_with_padding_and_naive_does_not(micro, tiny_gpt, tiny_batch):
    model = tiny_gpt(2)
    batch = tiny_batch(10, seed=3, padded=True)
    counts = [count_tokens(y) for _, y in split_batch(batch, micro)]
    assert len(set(counts)) > 1  # micro-batches hold different numbers of real tokens
    g_full, loss_full = _full_grad(model, batch)
    g_tok, loss_tok = _acc_grad(model, batch, micro, "tokens")
    g_naive, _ = _acc_grad(model, batch, micro, "naive")
    g_rows, _ = _acc_grad(model, batch, micro, "mean")
    assert max_rel_diff(g_tok, g_full) <= TOL
    assert loss_tok == pytest.approx(loss_full, rel=1e-5)
    assert max_rel_diff(g_naive, g_full) > 1e-3
    assert max_rel_diff(g_rows, g_full) > 1e-3


def test_tokens_with_an_all_padding_micro_batch(tiny_gpt, tiny_batch):
    model = tiny_gpt(3)
    x, y = tiny_batch(6, seed=4, padded=True)
    y[2:4] = -100  # the second micro-batch of 2 rows holds no real token
    g_full, _ = _full_grad(model, (x, y))
    g_tok, _ = _acc_grad(model, (x, y), 2, "tokens")
    assert max_rel_diff(g_tok, g_full) <= TOL
    with pytest.raises(ValueError, match="no real tokens"):
        accumulate_gradients(model, (x, torch.full_like(y, -100)), 2, normalise="tokens")


def test_naive_is_exact_only_when_micro_batches_are_alike(tiny_gpt, tiny_batch):
    model = tiny_gpt(4)
    batch = tiny_batch(8, seed=5)
    g_full, _ = _full_grad(model, batch)
    assert max_rel_diff(_acc_grad(model, batch, 4, "naive")[0], g_full) <= TOL  # even, no padding
    assert max_rel_diff(_acc_grad(model, batch, 3, "naive")[0], g_full) > 1e-3  # ragged 3, 3, 2


def test_accumulate_adds_to_existing_gradients(tiny_gpt, tiny_batch):
    model = tiny_gpt(5)
    batch = tiny_batch(6, seed=6, padded=True)
    g_full, _ = _full_grad(model, batch)
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, batch, 4, normalise="tokens")
    accumulate_gradients(model, batch, 4, normalise="tokens")
    twice = {k: v / 2 for k, v in grads(model).items()}
    assert max_rel_diff(twice, g_full) <= TOL


# -- the optimizer step ----------------------------------------------------------------------------
def test_accumulation_step_equals_plain_step(tiny_gpt, tiny_batch):
    batch = tiny_batch(9, seed=7, padded=True)
    ref, acc = tiny_gpt(6), tiny_gpt(6)
    opt_ref = labkit.make_optimizer("momentum", ref.parameters(), lr=0.1)
    opt_acc = labkit.make_optimizer("momentum", acc.parameters(), lr=0.1)
    for _ in range(3):
        loss_ref = labkit.train_step(ref, opt_ref, batch)
        loss_acc = accumulation_step(acc, opt_acc, batch, 4, normalise="tokens")
        assert float(loss_acc) == pytest.approx(float(loss_ref), rel=1e-5)
    assert max_param_diff(acc, ref, relative=True) <= TOL
    assert all(p.grad is None for p in acc.parameters())  # gradients released after the step


# -- memory ----------------------------------------------------------------------------------------
def test_peak_falls_with_k_at_constant_batch_and_is_flat_at_constant_micro_batch(tiny_gpt, tiny_batch):
    def peak(micro, rows):
        model = tiny_gpt(0, block_size=32)
        opt = labkit.make_optimizer("adam", model.parameters())
        batch = tiny_batch(rows, 32)
        return labkit.measure_step(model, opt, batch, step_fn=make_accumulation_step(micro)).peak_bytes

    p1, p2, p4, p8 = (peak(16 // k, 16) for k in (1, 2, 4, 8))
    assert p1 > p2 > p4 > p8
    flat = [peak(4, 4 * k) for k in (2, 3, 5)]
    assert (max(flat) - min(flat)) / min(flat) < 0.01


def test_a_sweep_of_accumulation_steps_is_checked_before_any_work():
    from labkit.techniques.accumulation import check_accum_steps
    from labkit.validate import ParameterError
    assert check_accum_steps("KS", [1, 2, 4, 8], batch=16) == [1, 2, 4, 8]
    assert check_accum_steps("KS", [1, 3, 6], batch=12) == [1, 3, 6]
    with pytest.raises(ParameterError, match=r"KS must be a sweep starting at 1"):
        check_accum_steps("KS", [2, 4])
    with pytest.raises(ParameterError, match=r"KS contains k=5, which BATCH=16 cannot realise: .* Realisable k for "
                                             r"BATCH=16: \[1, 2, 3, 4, 6, 8, 16\]"):
        check_accum_steps("KS", [1, 5], batch=16)  # micro-batches of 4 rows: 4 of them
    with pytest.raises(ParameterError, match=r"KS\[1\]"):
        check_accum_steps("KS", [1, 32], batch=16)
    assert check_accum_steps("KS", [1, 32]) == [1, 32]  # no batch: up to 64
