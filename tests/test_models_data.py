"""Models and synthetic data: deterministic by seed, valid by construction, and learnable."""

from __future__ import annotations

import math

import pytest
import torch

from labkit.data import MarkovTokens, TeacherTask
from labkit.validate import ParameterError
from labkit.models import GPT, MLP, GPTConfig, MLPConfig, build_model


pytestmark = pytest.mark.usefixtures("one_thread")


# -- determinism ---------------------------------------------------------------------------------

def test_markov_tokens_same_seed_same_batches():
    a, b = MarkovTokens(vocab_size=40, seed=7), MarkovTokens(vocab_size=40, seed=7)
    assert torch.equal(a.transition, b.transition)
    for _ in range(3):  # the internal generators advance in step
        (xa, ya), (xb, yb) = a.batch(4, 10), b.batch(4, 10)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    pa, pb = a.padded_batch(5, 9), b.padded_batch(5, 9)
    assert all(torch.equal(u, v) for u, v in zip(pa, pb))


def test_markov_tokens_different_seeds_differ():
    a, b = MarkovTokens(vocab_size=40, seed=0), MarkovTokens(vocab_size=40, seed=1)
    assert not torch.equal(a.transition, b.transition)
    assert not torch.equal(a.batch(4, 16)[0], b.batch(4, 16)[0])
    # Successive batches of one source differ too (the generator advances).
    assert not torch.equal(a.batch(4, 16)[0], a.batch(4, 16)[0])


def test_teacher_task_determinism():
    a, b, c = TeacherTask(seed=3), TeacherTask(seed=3), TeacherTask(seed=4)
    xa, ya = a.batch(32)
    xb, yb = b.batch(32)
    xc, yc = c.batch(32)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, xc)
    assert not torch.equal(a.w1, c.w1)
    assert xa.shape == (32, 32) and xa.dtype == torch.float32
    assert ya.shape == (32,) and ya.dtype == torch.long and 0 <= int(ya.min()) and int(ya.max()) < 10


def test_explicit_generator_overrides_the_internal_one():
    data = MarkovTokens(vocab_size=30, seed=0)
    x1, _ = data.batch(3, 8, torch.Generator().manual_seed(11))
    x2, _ = data.batch(3, 8, torch.Generator().manual_seed(11))
    assert torch.equal(x1, x2)


@pytest.mark.parametrize("cfg", [GPTConfig(n_layer=1, n_embd=32, n_head=4, block_size=8, vocab_size=20),
                                 MLPConfig(in_features=8, hidden=16, depth=2, classes=3)],
                         ids=["gpt", "mlp"])
def test_model_init_is_seeded(cfg):
    def state(seed):
        torch.manual_seed(seed)
        return build_model(cfg).state_dict()

    s0, s0_again, s1 = state(0), state(0), state(1)
    assert s0.keys() == s1.keys()
    assert all(torch.equal(s0[k], s0_again[k]) for k in s0)
    assert any(not torch.equal(s0[k], s1[k]) for k in s0)


@pytest.mark.parametrize("seed", ["0", 1.0, True, -1])
def test_seed_must_be_a_non_negative_int(seed):
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        MarkovTokens(seed=seed)


# -- validity of the data ------------------------------------------------------------------------

def test_markov_targets_are_valid_successors():
    data = MarkovTokens(vocab_size=50, seed=2)
    P = data.transition
    assert torch.allclose(P.sum(1), torch.ones(50))
    assert ((P > 0).sum(1) == 4).all()  # exactly 4 successors per token
    x, y = data.batch(16, 40)
    assert x.shape == y.shape == (16, 40)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert (P[x, y] > 0).all()  # every step follows an edge of the chain
    # Each row's 4 weights lie in [0.1, 1.1]: its entropy is at least that of (1.1, 0.1, 0.1, 0.1)/1.4,
    # 0.75 nats > log 2, and at most log 4 (uniform). The entropy rate averages the rows.
    assert math.log(2) < data.entropy_nats < math.log(4)


def test_padded_batch_masks_exactly_beyond_each_length():
    data = MarkovTokens(vocab_size=30, seed=5)
    T = 12
    x, y, lengths = data.padded_batch(64, T, min_len=3)
    assert x.shape == y.shape == (64, T) and lengths.shape == (64,)
    assert int(lengths.min()) >= 3 and int(lengths.max()) <= T
    assert len(set(lengths.tolist())) > 3  # lengths vary
    for row in range(64):
        n = int(lengths[row])
        assert (y[row, n:] == -100).all() and (x[row, n:] == 0).all()
        assert (y[row, :n] >= 0).all()
        assert (data.transition[x[row, :n], y[row, :n]] > 0).all()
    assert int((y == -100).sum()) == int((T - lengths).sum())
    with pytest.raises(ParameterError, match=r"min_len must be an integer \[1, 5\], got 6"):
        data.padded_batch(2, 5, min_len=6)


@pytest.mark.parametrize("kwargs, message", [({"vocab_size": 1}, r"vocab_size must be an integer >= 2"),
                                             ({"vocab_size": 10.0}, r"vocab_size must be an integer >= 2")])
def test_markov_tokens_rejects_bad_shapes_naming_the_argument(kwargs, message):
    with pytest.raises(ParameterError, match=message):
        MarkovTokens(**kwargs)


# -- learning ------------------------------------------------------------------------------------

def test_gpt_learns_markov_tokens():
    """100 Adam steps (lr 3e-3, batch 16×32) take a 2-layer GPT below the midpoint of log V and the entropy.

    Measured on 2 CPU cores: the held-out loss is about 1.5 nats after 100 steps (midpoint 2.37, entropy
    1.27, log V = 3.47); the training loss is below the midpoint by step 50 for seeds 0, 1 and 2.
    """
    V = 32
    data = MarkovTokens(vocab_size=V, seed=0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=32, vocab_size=V))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    held_out = data.batch(64, 32, torch.Generator().manual_seed(1234))

    def loss_on(batch):
        with torch.no_grad():
            return float(model(*batch)[1])

    start = loss_on(held_out)
    for _ in range(100):
        _, loss = model(*data.batch(16, 32))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    end = loss_on(held_out)
    midpoint = (math.log(V) + data.entropy_nats) / 2
    print(f"held-out loss {start:.3f} -> {end:.3f}; midpoint {midpoint:.3f}, entropy {data.entropy_nats:.3f}")
    assert abs(start - math.log(V)) < 0.2  # an untrained model guesses about uniformly
    assert end < midpoint
    assert end > data.entropy_nats - 0.05  # no model beats the chain's entropy rate (up to sampling noise)


def test_mlp_learns_the_teacher():
    task = TeacherTask(in_features=32, classes=10, seed=0)
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_features=32, hidden=64, depth=2, classes=10))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x_test, y_test = task.batch(1000, torch.Generator().manual_seed(99))

    def accuracy():
        with torch.no_grad():
            return float((model(x_test)[0].argmax(1) == y_test).float().mean())

    before = accuracy()
    for _ in range(150):
        _, loss = model(*task.batch(64))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    after = accuracy()
    majority = float(torch.bincount(y_test, minlength=10).max()) / len(y_test)
    print(f"accuracy {before:.3f} -> {after:.3f}; majority class {majority:.3f}")
    assert after > max(0.5, majority + 0.2)
    assert after > before + 0.2


# -- configuration checks ------------------------------------------------------------------------

def test_gpt_config_rejects_indivisible_width():
    with pytest.raises(ValueError, match="n_embd") as info:
        GPTConfig(n_embd=130, n_head=4)
    assert "n_head" in str(info.value) and "130" in str(info.value)


@pytest.mark.parametrize("field, value", [("mlp", "relu"), ("norm", "batch"), ("pos", "alibi"), ("attn", "flash-3"),
                                          ("n_layer", 0), ("vocab_size", 2.5), ("n_head", True),
                                          ("dropout", 1.0)])
def test_gpt_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**{field: value})


@pytest.mark.parametrize("n_head, n_kv_head", [(6, 0), (4, 3), (6, 8)])
def test_gpt_config_rejects_key_value_heads_that_do_not_divide_the_heads(n_head, n_kv_head):
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_embd=24, n_head=n_head, n_kv_head=n_kv_head)


@pytest.mark.parametrize("attn, fused", [("manual", True), ("sdpa", False)])
def test_grouped_query_attention_is_multi_head_attention_with_each_key_value_head_repeated(attn, fused):
    """A GQA model computes what an MHA model computes whose k and v weights hold each GQA head's rows once per query
    head of its group (head i reads key/value head i // (H / H_kv), as torchtitan's repeat_kv): same loss, and the
    GQA k/v gradients are the sums of the MHA copies'; the parameter count is the shapes'."""
    base = dict(n_layer=2, n_embd=32, n_head=8, block_size=16, vocab_size=50, attn=attn, fused_qkv=fused, pos="rope",
                norm="rms", mlp="swiglu", bias=False)
    gqa_cfg, mha_cfg = GPTConfig(**base, n_kv_head=2), GPTConfig(**base)
    torch.manual_seed(0)
    gqa, mha = GPT(gqa_cfg), GPT(mha_cfg)
    assert gqa_cfg.n_params() == sum(p.numel() for p in gqa.parameters()) < mha_cfg.n_params()
    D, rep = 32 // 8, 8 // 2

    def repeated(w):  # (H_kv * D, C) -> (H * D, C): each head's D rows, rep times in a row
        return w.view(2, D, -1).repeat_interleave(rep, dim=0).reshape(8 * D, -1)
    with torch.no_grad():
        for name, p in mha.named_parameters():
            g = dict(gqa.named_parameters())[name]
            if fused and name.endswith("qkv.weight"):
                q, k, v = g.split((32, 8, 8))
                p.copy_(torch.cat((q, repeated(k), repeated(v))))
            elif name.endswith((".k.weight", ".v.weight")):
                p.copy_(repeated(g))
            else:
                p.copy_(g)
    idx = torch.randint(50, (3, 16))
    losses = [m(idx, idx)[1] for m in (gqa, mha)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for loss in losses:
        loss.backward()
    k_name = "blocks.0.attn.qkv.weight" if fused else "blocks.0.attn.k.weight"
    g_gqa, g_mha = dict(gqa.named_parameters())[k_name].grad, dict(mha.named_parameters())[k_name].grad
    if fused:
        g_gqa, g_mha = g_gqa[32:40], g_mha[32:64]
    torch.testing.assert_close(g_gqa, g_mha.view(2, rep, D, -1).sum(1).reshape(8, -1), rtol=1e-5, atol=1e-6)


def test_rope_needs_even_head_width():
    with pytest.raises(ValueError, match="rope"):
        GPTConfig(n_embd=12, n_head=4, pos="rope")  # head width 3


@pytest.mark.parametrize("field", ["in_features", "hidden", "depth", "classes"])
def test_mlp_config_rejects_bad_fields(field):
    with pytest.raises(ValueError, match=field):
        MLPConfig(**{field: 0})


def test_build_model_rejects_other_configs():
    with pytest.raises(TypeError, match="GPTConfig"):
        build_model({"n_layer": 2})


def test_gpt_shapes_and_sequence_limit():
    cfg = GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8, vocab_size=11)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(11, (3, 8))
    logits, loss = model(idx)
    assert logits.shape == (3, 8, 11) and loss is None
    assert model.head.weight is model.tok_emb.weight  # tied by default
    with pytest.raises(ValueError, match="block_size"):
        model(torch.randint(11, (1, 9)))
    # ignore_index: a batch whose targets are all -100 but one gives that one position's loss.
    targets = torch.full((3, 8), -100)
    targets[1, 4] = 5
    _, loss = model(idx, targets)
    expected = torch.nn.functional.cross_entropy(logits[1, 4][None], torch.tensor([5]))
    assert torch.allclose(loss, expected)


# -- stages ---------------------------------------------------------------------------------------

def test_split_stages_run_the_gpt_and_share_its_parameters(tiny_gpt, tiny_batch):
    from labkit.stages import EmbedStage, GPTHeadStage, split_stages, stage_name

    model = tiny_gpt(11, n_layer=3)
    x, y = tiny_batch(2)
    stages = split_stages(model)
    assert [stage_name(i, s) for i, s in enumerate(stages)] == ["embedding", "block 1", "block 2", "block 3", "head"]
    assert isinstance(stages[0], EmbedStage) and isinstance(stages[-1], GPTHeadStage)
    assert stages[-1].head.weight is stages[0].tok_emb.weight is model.tok_emb.weight  # the tied weight, twice
    h = x
    for stage in stages[:-1]:
        h = stage(h)  # (B, T, C)
    assert torch.equal(stages[-1](h, y), model(x, y)[1])  # the same loss as the whole model


def test_split_stages_of_an_mlp_and_errors():
    from labkit.stages import MLPHeadStage, split_stages, stage_name

    torch.manual_seed(0)
    mlp = MLP(MLPConfig(depth=2))
    stages = split_stages(mlp)
    assert [stage_name(i, s) for i, s in enumerate(stages)] == ["layer 0", "layer 1", "head"]
    assert isinstance(stages[-1], MLPHeadStage)
    with pytest.raises(TypeError, match="GPT and MLP"):
        split_stages(torch.nn.Linear(2, 2))


# -- the step's shared rules: whose tokens count, where the blocks are --------------------------------------
def test_token_weights_are_each_micro_batchs_share_of_the_real_targets():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from labkit.models import IGNORE_INDEX, token_weights

    a = torch.tensor([[1, 2, IGNORE_INDEX]])  # 2 real targets
    b = torch.tensor([[3, IGNORE_INDEX, IGNORE_INDEX], [4, 5, 6]])  # 4 real targets
    assert token_weights([a, b]) == [2 / 6, 4 / 6]
    with pytest.raises(ValueError, match="no real targets"):
        token_weights([torch.full((2, 3), IGNORE_INDEX)])
    with FakeTensorMode():  # no values to count: weighed by size
        assert token_weights([torch.zeros(1, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)]) == [1 / 3, 2 / 3]


def test_blocks_of_finds_a_gpts_blocks_and_an_mlps_layers_and_names_what_is_missing():
    from labkit.models import blocks_name, blocks_of

    gpt, mlp = GPT(GPTConfig(n_layer=3, n_embd=16, n_head=2, block_size=8, vocab_size=32)), MLP(MLPConfig(depth=2))
    assert blocks_name(gpt) == "blocks" and blocks_of(gpt) is gpt.blocks and len(blocks_of(gpt)) == 3
    assert blocks_name(mlp) == "layers" and blocks_of(mlp) is mlp.layers and len(blocks_of(mlp)) == 2
    with pytest.raises(TypeError, match="Linear has no nn.Sequential `blocks`"):
        blocks_of(torch.nn.Linear(2, 2))
