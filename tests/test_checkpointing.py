"""labkit.techniques.checkpointing: segment layouts, checkpointed stacks equal to the plain model, memory and FLOPs.

Notebook 02 runs in tests/test_nb02.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint_sequential

from labkit.compare import max_grad_diff
from labkit.models import MLP, MLPConfig
from labkit.techniques.checkpointing import (CheckpointedSequential, backward_moments_bytes, checkpoint_blocks, op_level_policy,
                                  predicted_activation_bytes, segment_sizes, torch_segment_sizes)
from labkit.train import make_optimizer, measure_step, train_step
from labkit.validate import ParameterError
from labkit.work import count_work

N_LAYER = 6  # the tiny GPT made 6 blocks deep (4 heads): enough blocks to checkpoint in segments


@pytest.fixture
def deep_gpt(tiny_gpt):
    """Return make(seed=0, **overrides): the tiny GPT with N_LAYER blocks and 4 heads."""
    return lambda seed=0, **overrides: tiny_gpt(seed, **{"n_layer": N_LAYER, "n_head": 4, **overrides})


def _backward(model, batch):
    _, loss = model(*batch)
    loss.backward()
    return loss.detach()


# -- layouts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 5, 16, 17])
def test_segment_sizes_cover_the_stack_evenly_larger_first(n):
    for s in range(1, n + 1):
        sizes = segment_sizes(n, s)
        assert len(sizes) == s and sum(sizes) == n
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)


def test_torch_segment_sizes_put_the_remainder_last():
    assert torch_segment_sizes(16, 9) == [1] * 8 + [8]
    assert torch_segment_sizes(16, 4) == [4, 4, 4, 4] == segment_sizes(16, 4)
    assert torch_segment_sizes(10, 3) == [3, 3, 4]
    assert all(sum(torch_segment_sizes(16, s)) == 16 for s in range(1, 17))


def test_torch_segment_sizes_match_checkpoint_sequential():
    """Count each block's forward calls under checkpoint_sequential: recomputed blocks run twice."""
    n, s = 7, 3
    calls = [0] * n
    blocks = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])
    for i, b in enumerate(blocks):
        b.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    x = torch.randn(2, 4, requires_grad=True)
    checkpoint_sequential(blocks, s, x, use_reentrant=False).sum().backward()
    sizes = torch_segment_sizes(n, s)
    expected = [2] * sum(sizes[:-1]) + [1] * sizes[-1]
    assert calls == expected


@pytest.mark.parametrize("bad", [(0, 1), (4, 0), (4, 5), (4, 1.5), (True, 1)])
def test_segment_sizes_reject_bad_input(bad):
    with pytest.raises(ValueError):
        segment_sizes(*bad)


# -- correctness -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [dict(segments=1), dict(segments=2), dict(segments=4),
                                    dict(segments=6, checkpoint_last=True),
                                    dict(segments=6, checkpoint_last=True, selective=True),
                                    dict(segments=6, checkpoint_last=True, op_level=True),
                                    dict(segments=3, selective=True),
                                    dict(segments=6, checkpoint_last=True, every=2)])
def test_checkpointed_gpt_gives_the_plain_gradients(kwargs, deep_gpt, tiny_batch):
    batch = tiny_batch(3, seed=1)
    plain = deep_gpt()
    loss_plain = _backward(plain, batch)
    ckpt = checkpoint_blocks(deep_gpt(), **kwargs)
    assert isinstance(ckpt.blocks, CheckpointedSequential)
    loss_ckpt = _backward(ckpt, batch)
    assert torch.equal(loss_plain, loss_ckpt)
    assert max_grad_diff(plain, ckpt) <= 1e-6


def test_checkpoint_blocks_keeps_modules_and_state_dict_keys(deep_gpt):
    model = deep_gpt()
    keys, blocks = list(model.state_dict()), list(model.blocks)
    checkpoint_blocks(model, 3)
    assert isinstance(model.blocks, CheckpointedSequential) and model.blocks.sizes == [2, 2, 2]
    assert list(model.state_dict()) == keys and all(a is b for a, b in zip(model.blocks, blocks))
    head = model.blocks[:2]
    assert type(head) is nn.Sequential and list(head) == blocks[:2] and model.blocks[-1] is blocks[-1]


def test_checkpoint_blocks_works_on_an_mlp_and_rejects_other_models():
    torch.manual_seed(0)
    mlp = MLP(MLPConfig(in_features=8, hidden=16, depth=5))
    ref = copy.deepcopy(mlp)
    x, y = torch.randn(6, 8), torch.randint(10, (6,))
    _backward(ref, (x, y))
    _backward(checkpoint_blocks(mlp, 2), (x, y))  # x does not require grad: fine with non-reentrant
    assert max_grad_diff(ref, mlp) <= 1e-6
    with pytest.raises(TypeError, match="blocks"):
        checkpoint_blocks(nn.Linear(2, 2), 1)


def test_checkpointed_dropout_gives_the_plain_gradients(deep_gpt, tiny_batch):
    batch = tiny_batch(3, seed=1)
    grads = {}
    for name in ("plain", "kept"):
        model = deep_gpt(n_layer=3, dropout=0.2)
        if name == "kept":
            checkpoint_blocks(model, 3, checkpoint_last=True)
        torch.manual_seed(5)
        _backward(model, batch)
        grads[name] = model
    assert max_grad_diff(grads["plain"], grads["kept"]) <= 1e-6


def test_batchnorm_counts_the_batch_twice_under_checkpointing():
    torch.manual_seed(0)
    mlp = MLP(MLPConfig(in_features=8, hidden=16, depth=2, batchnorm=True))
    checkpoint_blocks(mlp, 2, checkpoint_last=True)
    _backward(mlp, (torch.randn(6, 8), torch.randint(10, (6,))))
    assert int(mlp.layers[0][1].num_batches_tracked) == 2  # pytorch/pytorch#96136


# -- memory and FLOPs ------------------------------------------------------------------------------
def _peak(model, batch):
    opt = make_optimizer("adam", model.parameters())
    return measure_step(model, opt, batch, step_fn=train_step)


def test_checkpointing_lowers_the_peak_and_one_segment_is_the_plain_step(deep_gpt, tiny_batch):
    batch = tiny_batch(8, seed=1)
    plain = _peak(deep_gpt(), batch)
    one = _peak(checkpoint_blocks(deep_gpt(), 1), batch)
    assert one.peak_bytes == plain.peak_bytes
    peaks = {s: _peak(checkpoint_blocks(deep_gpt(), s), batch).peak_bytes for s in (2, 3, 6)}
    assert all(p < plain.peak_bytes for p in peaks.values())
    every = _peak(checkpoint_blocks(deep_gpt(), 6, checkpoint_last=True), batch)
    assert every.split["activations"] < plain.split["activations"] / 2


def test_selective_checkpointing_sits_between_plain_and_full(deep_gpt, tiny_batch):
    batch = tiny_batch(8, seed=1)
    acts = {}
    for name, kwargs in (("plain", None), ("full", dict(checkpoint_last=True)),
                         ("selective", dict(checkpoint_last=True, selective=True))):
        model = deep_gpt() if kwargs is None else checkpoint_blocks(deep_gpt(), N_LAYER, **kwargs)
        acts[name] = _peak(model, batch).split["activations"]
    assert acts["full"] < acts["selective"] < acts["plain"]


@pytest.mark.parametrize("every", [2, 3, 4])
def test_layer_level_checkpoints_torchtitans_blocks_and_recomputes_those_alone(every, deep_gpt, tiny_batch):
    """every=k: the k-th, 2k-th, ... block (counted from 1, torchtitan's `_count % ac_freq == 0`) runs twice, once more
    in backward; the others once. Its recomputed FLOPs are those blocks' share of full checkpointing's; its saved
    activations lie between full's and plain's."""
    batch = tiny_batch(3, seed=1)
    model = checkpoint_blocks(deep_gpt(), N_LAYER, checkpoint_last=True, every=every)
    calls = [0] * N_LAYER
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    _backward(model, batch)
    assert calls == [2 if (i + 1) % every == 0 else 1 for i in range(N_LAYER)]
    flops = {name: count_work(_backward, model, batch).total_flops for name, model in (
        ("plain", deep_gpt()), ("full", checkpoint_blocks(deep_gpt(), N_LAYER, checkpoint_last=True)),
        ("layer", checkpoint_blocks(deep_gpt(), N_LAYER, checkpoint_last=True, every=every)))}
    assert flops["layer"] - flops["plain"] == (flops["full"] - flops["plain"]) * (N_LAYER // every) // N_LAYER
    acts = {name: _peak(model, tiny_batch(8, seed=1)).split["activations"] for name, model in (
        ("plain", deep_gpt()), ("full", checkpoint_blocks(deep_gpt(), N_LAYER, checkpoint_last=True)),
        ("layer", checkpoint_blocks(deep_gpt(), N_LAYER, checkpoint_last=True, every=every)))}
    assert acts["full"] < acts["layer"] < acts["plain"]


@pytest.mark.parametrize("kwargs", [dict(segments=3, checkpoint_last=True, every=2), dict(segments=6, every=2),
                                    dict(segments=6, checkpoint_last=True, every=2, selective=True),
                                    dict(segments=6, checkpoint_last=True, every=7)])
def test_layer_level_checkpointing_refuses_what_it_does_not_take(kwargs, deep_gpt):
    with pytest.raises(ParameterError, match="every"):
        checkpoint_blocks(deep_gpt(), **kwargs)


def test_flops_within_one_extra_forward_and_selective_recomputes_no_matmul(deep_gpt, tiny_batch):
    batch = tiny_batch(3, seed=1)
    flops = {}
    for name, kwargs in (("plain", None), ("full", dict(checkpoint_last=True)),
                         ("selective", dict(checkpoint_last=True, selective=True))):
        model = deep_gpt() if kwargs is None else checkpoint_blocks(deep_gpt(), N_LAYER, **kwargs)
        flops[name] = count_work(_backward, model, batch).total_flops
    assert flops["selective"] == flops["plain"]
    assert 1.0 < flops["full"] / flops["plain"] <= 4 / 3


def test_op_level_policy_keeps_every_other_matmul_and_the_attention_kernels_output():
    """torchtitan's op-level policy, decision by decision, on a llama block: of its seven matmuls (q, k, v, the output
    projection, the MLP's three) the first, third, fifth and seventh are kept; CUDA's flash kernel's output is kept;
    the norms, RoPE and SwiGLU's products are recomputed."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from labkit.models import Block, GPTConfig
    cfg = GPTConfig(n_layer=1, n_embd=64, n_head=4, block_size=16, bias=False, mlp="swiglu", norm="rms", pos="rope",
                    attn="flash", fused_qkv=False, tie_weights=False)
    decisions = []
    policy = op_level_policy()

    def recorded(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        decisions.append((ctx.is_recompute, op, decision))
        return decision
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # a bf16 block (CUDA's flash kernel takes 16-bit inputs)
    try:
        with FakeTensorMode():
            block = Block(cfg)
            x = torch.randn(2, 16, 64, requires_grad=True)
            y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                                  context_fn=lambda: create_selective_checkpoint_contexts(recorded))
            y.sum().backward()
    finally:
        torch.set_default_dtype(before)
    save = CheckpointPolicy.MUST_SAVE
    mms = [d for r, op, d in decisions if not r and op == torch.ops.aten.mm.default]  # (forward's)
    assert mms == [save, CheckpointPolicy.PREFER_RECOMPUTE] * 3 + [save], mms
    flash = [d for r, op, d in decisions if op == torch.ops.aten._scaled_dot_product_flash_attention.default]
    assert flash and set(flash) == {save}
    others = {op for r, op, d in decisions if d == save} - {torch.ops.aten.mm.default,
                                                             torch.ops.aten._scaled_dot_product_flash_attention.default}
    assert not others, others  # nothing else kept in this block


def _op_level_kept(attn: str) -> set:
    """Return the ops whose outputs op_level_policy keeps in one bf16 llama block's checkpointed forward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from labkit.models import Block, GPTConfig
    cfg = GPTConfig(n_layer=1, n_embd=64, n_head=4, block_size=16, bias=False, mlp="swiglu", norm="rms", pos="rope",
                    attn=attn, fused_qkv=False, tie_weights=False)
    kept, policy = set(), op_level_policy()

    def recorded(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            kept.add(op)
        return decision
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with FakeTensorMode():
            x = torch.randn(2, 16, 64, requires_grad=True)
            torch.utils.checkpoint.checkpoint(Block(cfg), x, use_reentrant=False, context_fn=lambda:
                                              create_selective_checkpoint_contexts(recorded)).sum().backward()
    finally:
        torch.set_default_dtype(before)
    return kept


def test_the_benchmarks_december_2024_save_list_keeps_the_same_with_the_flash_kernel_not_with_attention_written_out():
    # chapter 09, Appendix D: the plan's op-level policy is torchtitan's later one; its Llama 3.1 8B benchmark ran the
    # earlier save list. With the flash kernel a block keeps only ops of that list; written out, the later policy also
    # keeps the scores' bmm outputs (T x T), which the earlier list recomputes
    from labkit.techniques.checkpointing import torchtitan_2024_save_list
    earlier = torchtitan_2024_save_list()
    flash = _op_level_kept("flash")
    assert flash and flash <= earlier, flash - earlier
    written_out = _op_level_kept("manual")
    assert torch.ops.aten.bmm.default in written_out - earlier, written_out


def test_predicted_activation_bytes_follows_chen():
    n = 16
    plain = predicted_activation_bytes(n, 1, block_bytes=10, boundary_bytes=1, rest_bytes=5)
    assert plain == 5 + n * 10
    equal = {s: predicted_activation_bytes(n, s, 1, 1) for s in range(1, n + 1)}
    assert equal[round(math.sqrt(n))] == min(equal.values())  # a = b: the minimum includes Chen's √n
    heavy = {s: predicted_activation_bytes(n, s, 25, 1) for s in range(1, n + 1)}
    assert min(heavy, key=heavy.get) == n  # a ≫ b: one block per segment


def test_backward_moments_bytes_split_chens_sum_into_the_backwards_two_moments():
    at_start, in_rebuild = backward_moments_bytes([2, 2, 2], block_bytes=10, boundary_bytes=1, rest_bytes=5)
    assert (at_start, in_rebuild) == (5 + 2 * 1 + 2 * 10, 1 * 1 + 2 * 10)
    assert backward_moments_bytes([3], 10, 1, 5) == (35, 0)  # one segment: nothing is rebuilt
    for n, s, a, b, rest in ((16, 4, 7, 2, 30), (9, 2, 5, 5, 0), (12, 5, 20, 1, 3)):
        start, rebuild = backward_moments_bytes(segment_sizes(n, s), a, b, rest)
        # Chen's model adds `rest` to every segment's moment: its peak is the larger moment with rest added to both
        assert predicted_activation_bytes(n, s, a, b, rest) == max(start, rebuild + rest)
