"""estimate_training_memory runs the step on fake tensors: it must equal the real meter's count.

Parameter counts are checked against built models and against published figures.
"""

from __future__ import annotations

import resource
import time
from dataclasses import replace

import pytest
import torch

from labkit.estimate import estimate_training_memory, example_batch
from labkit.models import GPT2_124M, LLAMA_7B, MLPConfig, build_model, count_params
from labkit.train import make_optimizer, measure_step

F32 = 4


pytestmark = pytest.mark.usefixtures("one_thread")


LLAMA_LIKE = dict(n_head=4, bias=False, mlp="swiglu", norm="rms", pos="rope", attn="sdpa", tie_weights=False)


def _real_step(cfg, batch_size, seq_len, optimizer="adam"):
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = make_optimizer(optimizer, model.parameters())
    return measure_step(model, opt, example_batch(cfg, batch_size, seq_len))


@pytest.mark.parametrize("cfg, batch_size, seq_len, optimizer", [
    ({}, 4, 16, "adam"),
    (LLAMA_LIKE, 3, 12, "adam"),
    (dict(LLAMA_LIKE, n_kv_head=2, fused_qkv=False), 3, 12, "adam"),  # grouped-query attention (Llama 3)
    ({}, 2, 8, "momentum"),
    (MLPConfig(in_features=16, hidden=32, depth=3, classes=5), 8, None, "adam"),
    (MLPConfig(in_features=16, hidden=32, depth=2, classes=5, batchnorm=True), 8, None, "sgd"),
], ids=["gpt", "llama-like", "llama-gqa", "gpt-momentum", "mlp", "mlp-batchnorm-sgd"])
def test_estimate_equals_the_measured_step(cfg, batch_size, seq_len, optimizer, tiny_config):
    if isinstance(cfg, dict):  # the tiny GPT, with these fields overridden
        cfg = replace(tiny_config, **cfg)
    est = estimate_training_memory(cfg, batch_size, seq_len, optimizer=optimizer)
    real = _real_step(cfg, batch_size, seq_len, optimizer)
    print(f"estimate {est.peak_bytes} B, measured {real.peak_bytes} B")
    assert est.split == real.split  # the same step on fake tensors: exact, category by category
    assert est.peak_bytes == real.peak_bytes
    model_params = count_params(build_model(cfg))
    assert est.n_params == model_params
    assert est.batch_size == batch_size
    assert est.seq_len == (None if isinstance(cfg, MLPConfig) else seq_len)


def test_estimate_split_by_hand_for_an_mlp():
    """MLP 16 -> 32 -> 32 -> 5 with Adam: parameters and Adam state follow from the shapes."""
    cfg = MLPConfig(in_features=16, hidden=32, depth=2, classes=5)
    P = (16 * 32 + 32) + (32 * 32 + 32) + (32 * 5 + 5)
    tensors = 6  # a weight and a bias per Linear
    est = estimate_training_memory(cfg, 8)
    assert est.n_params == P
    assert est.split["parameters"] == F32 * P
    assert est.split["optimizer_state"] == 2 * F32 * P + F32 * tensors
    assert sum(est.split.values()) == est.peak_bytes
    # Activations grow with the batch, the static part does not.
    big = estimate_training_memory(cfg, 64)
    assert big.split["parameters"] == est.split["parameters"]
    assert big.split["optimizer_state"] == est.split["optimizer_state"]
    assert big.peak_bytes > est.peak_bytes


@pytest.mark.parametrize("overrides", [
    {},
    {"mlp": "swiglu"},
    {"norm": "rms"},
    {"pos": "rope"},
    {"tie_weights": False},
    {"bias": False},
    {"bias": False, "norm": "layer", "tie_weights": False},
    {"mlp": "swiglu", "norm": "rms", "pos": "rope", "tie_weights": False, "bias": False},
    {"mlp": "swiglu", "bias": True, "tie_weights": False, "mlp_hidden": 40},
    {"n_kv_head": 2}, {"n_kv_head": 1, "fused_qkv": False, "bias": False},  # grouped-query attention
    {"n_layer": 3, "n_embd": 48, "n_head": 3, "block_size": 20, "vocab_size": 97},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_n_params_equals_the_built_model(overrides, tiny_config):
    cfg = replace(tiny_config, **{"n_head": 4, "vocab_size": 50, **overrides})
    with torch.device("meta"):  # shapes only
        model = build_model(cfg)
    assert cfg.n_params() == count_params(model)


def test_gpt2_124m_parameter_count():
    """GPT-2 small has 124,439,808 parameters (tied head, learned positions).

    L=12, C=768, V=50257, T=1024, MLP hidden 4C:
      block = attention (4C² + 4C) + MLP (8C² + 5C) + two LayerNorms (4C) = 12C² + 13C = 7,087,872
      12 blocks = 85,054,464; final LayerNorm 2C = 1,536; tokens V·C = 38,597,376; positions T·C = 786,432
      total = 124,439,808 (nanoGPT prints 123.65M: the same less the 786,432 position weights).
    """
    C, L, V, T = 768, 12, 50257, 1024
    by_formula = L * (12 * C * C + 13 * C) + 2 * C + V * C + T * C
    assert by_formula == 124_439_808
    assert GPT2_124M.n_params() == 124_439_808
    with torch.device("meta"):
        assert count_params(build_model(GPT2_124M)) == 124_439_808


def test_llama_7b_estimate():
    """LLaMA-7B shape: 6,738,415,616 parameters (32 blocks of 4C² attention + 3·C·11008 SwiGLU + 2C norms,
    a final norm, untied 32000×4096 embedding and head)."""
    C, L, V, H = 4096, 32, 32000, 11008
    assert L * (4 * C * C + 3 * C * H + 2 * C) + C + 2 * V * C == 6_738_415_616 == LLAMA_7B.n_params()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    est = estimate_training_memory(LLAMA_7B, 1, 256)
    elapsed = time.perf_counter() - t0
    rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    print(f"7B estimate in {elapsed:.1f} s: {est.peak_bytes / 2**30:.1f} GiB, "
          f"{est.bytes_per_param_static:.6f} static B/param")
    assert elapsed < 60
    assert est.peak_bytes > 100 * 2**30  # ~100 GiB estimated...
    assert rss_growth < 2**30  # ...while this process grew by less than 1 GiB: fake tensors allocate nothing
    assert est.n_params == LLAMA_7B.n_params()
    assert est.split["parameters"] == F32 * LLAMA_7B.n_params()
    assert est.bytes_per_param_static == pytest.approx(16, rel=1e-3)  # 4 weights + 4 grads + 8 Adam
    assert est.seq_len == 256 and est.batch_size == 1
    assert sum(est.split.values()) == est.peak_bytes


@pytest.mark.parametrize("batch_size", [0, -1, 1.5, True, "8"])
def test_bad_batch_size(batch_size, tiny_config):
    with pytest.raises(ValueError, match="batch_size"):
        estimate_training_memory(tiny_config, batch_size, 8)


@pytest.mark.parametrize("seq_len", [0, -3, 17])
def test_bad_seq_len(seq_len, tiny_config):
    assert tiny_config.block_size == 16  # 17 is one past the block
    with pytest.raises(ValueError, match="seq_len"):
        estimate_training_memory(tiny_config, 2, seq_len)


def test_example_batch_shapes(tiny_config):
    x, y = example_batch(tiny_config, 3, 5)
    assert x.shape == y.shape == (3, 5) and x.dtype == torch.long
    assert int(x.max()) < tiny_config.vocab_size
    x, y = example_batch(tiny_config, 2)  # seq_len None: the whole block
    assert x.shape == (2, tiny_config.block_size)
    cfg = MLPConfig(in_features=7, classes=3)
    x, y = example_batch(cfg, 4)
    assert x.shape == (4, 7) and y.shape == (4,) and int(y.max()) < 3


# -- one rank of data parallelism: world size and ZeRO stage ------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sharded_estimate_states_follow_zero(stage, tiny_config):
    """At rest each rank holds ZeRO's fp32-Adam bytes per parameter (FSDP2 keeps parameters sharded at stage 2)."""
    from labkit.techniques import zero
    n = 4
    est = estimate_training_memory(tiny_config, 2, 16, world_size=n, zero_stage=stage)
    want = zero.model_state_bytes_per_param(3 if stage == 2 else stage, n)
    for category, per_param in want.items():
        got = est.states[category] / est.n_params
        assert got == pytest.approx(per_param, rel=0.02), (category, got, per_param)  # Adam's step counters, padding
    B, T, V = 2, 16, tiny_config.vocab_size
    step_left = 2 * B * T * 8 + B * T * V * F32 + F32  # the batch, the logits and the loss, alive after the update
    buckets = est.states["gradients"] if stage < 2 else 0  # DDP's buckets: one more copy of the gradients
    assert est.states["other"] == step_left + buckets  # at rest: "other", never activations
    assert set(est.states) == {"parameters", "gradients", "optimizer_state", "other"}
    assert (est.world_size, est.zero_stage) == (n, stage)


def test_sharded_estimate_peaks_fall_with_the_stage(tiny_config):
    one = estimate_training_memory(tiny_config, 2, 16)
    peaks = {s: estimate_training_memory(tiny_config, 2, 16, world_size=4, zero_stage=s).peak_bytes for s in range(4)}
    print(one.peak_bytes, peaks)
    assert peaks[0] == one.peak_bytes + one.split["parameters"]  # DDP: the one-process step plus buckets (= grads)
    assert peaks[0] - peaks[1] == one.split["optimizer_state"] - one.split["optimizer_state"] // 4
    assert peaks[1] > peaks[2] >= peaks[3]


def test_sharded_estimate_refuses_what_it_cannot_do(tiny_config):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with pytest.raises(ValueError, match="zero_stage needs world_size > 1"):
        estimate_training_memory(tiny_config, 2, 16, zero_stage=3)
    with pytest.raises(ValueError, match="zero_stage"):
        estimate_training_memory(tiny_config, 2, 16, world_size=2, zero_stage=4)
    with pytest.raises(ValueError, match="world_size"):
        estimate_training_memory(tiny_config, 2, 16, world_size=0)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with pytest.raises(RuntimeError, match="without a process group"):
            estimate_training_memory(tiny_config, 2, 16, world_size=2, zero_stage=3)
    finally:
        dist.destroy_process_group()
    estimate_training_memory(tiny_config, 2, 16, world_size=2, zero_stage=3)
    assert not dist.is_initialized(), "the estimate must take its fake process group down"


RANKS = '''
import torch
from torch.distributed.fsdp import fully_shard
import labkit, labkit.dist as ld
from labkit.estimate import example_batch
from labkit.models import GPTConfig, build_model
from labkit.train import make_optimizer, train_step

def main(config="", stage=3):  # one rank: FSDP2 at ZeRO stage 2 or 3, a warm-up step, a metered step
    cfg = eval(config, {"GPTConfig": GPTConfig})
    torch.manual_seed(0)
    model = build_model(cfg)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=stage == 3)
    fully_shard(model, reshard_after_forward=stage == 3)
    opt = make_optimizer("adam", model.parameters())
    batch = example_batch(cfg, 2, 16)
    train_step(model, opt, batch)
    with ld.meter("step") as meter:
        meter.track(model, opt, *batch)
        train_step(model, opt, batch)

if __name__ == "__main__":
    ld.run(main)
'''


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_estimate_equals_two_real_ranks(stage, tiny_config, tmp_path):
    """FSDP2 on fake tensors and a fake process group predicts what two gloo ranks measure.

    One thing the ranks do that the estimate cannot: gloo's worker thread holds each reduce-scatter
    input until it lets go of the finished work. On a busy CPU that can come after FSDP2 dropped the
    buffer (measured: 1 rank in 3 at stage 2 for this tiny model, whose backward takes a few ms per
    block; never for notebook 07's model). A rank's peak is then higher by at most one block's buffer.
    """
    import labkit.dist as ld

    script = tmp_path / "fsdp_ranks.py"
    script.write_text(RANKS)
    runs = ld.launch(script, 2, params={"config": repr(tiny_config), "stage": stage}, echo=False, device="cpu")
    est = estimate_training_memory(tiny_config, 2, 16, world_size=2, zero_stage=stage)
    block_bytes = sum(p.numel() for p in build_model(tiny_config).blocks[0].parameters()) * F32
    for r in runs:
        measured = r.meters["step"]
        print(est.peak_bytes, est.split, measured["peak_bytes"], measured["peak_split"])
        assert est.peak_bytes <= measured["peak_bytes"] <= est.peak_bytes + block_bytes
        if measured["peak_bytes"] == est.peak_bytes:  # (a late release also moves the peak to another moment)
            assert measured["peak_split"] == est.split


# -- remembered: each fake step counted once per run ----------------------------------------------------------------

def test_remembered_counts_a_step_once_and_shares_it_through_the_runs_folder(tmp_path, monkeypatch):
    from labkit import estimate as E
    monkeypatch.setattr(E, "_REMEMBERED", {})
    monkeypatch.delenv(E.SHARED_DIR_ENV, raising=False)
    counted = []

    def count():
        counted.append(1)
        return {"peak": 5, "split": {"parameters": 3}}
    first = E.remembered(("test", 1), count)
    first["split"]["parameters"] = -1  # a caller's change stays its own
    assert E.remembered(("test", 1), count) == {"peak": 5, "split": {"parameters": 3}} and len(counted) == 1
    assert list(tmp_path.iterdir()) == []  # no folder named: nothing written anywhere

    monkeypatch.setenv(E.SHARED_DIR_ENV, str(tmp_path))
    E.remembered(("test", 2), count)
    assert len(counted) == 2 and len(list(tmp_path.glob("*.pkl"))) == 1 and not list(tmp_path.glob("*.pkl.*"))
    monkeypatch.setattr(E, "_REMEMBERED", {})  # another process of the run: its memo empty, the folder shared
    assert E.remembered(("test", 2), count) == {"peak": 5, "split": {"parameters": 3}} and len(counted) == 2

    path = next(tmp_path.glob("*.pkl"))  # a file whose key is another (two keys, one hash): counted, not read
    path.write_bytes(__import__("pickle").dumps(("('test', 3)", "not this step's")))
    monkeypatch.setattr(E, "_REMEMBERED", {})
    assert E.remembered(("test", 2), count)["peak"] == 5 and len(counted) == 3


def test_a_plan_run_read_from_the_shared_folder_is_the_one_counted(tmp_path, monkeypatch):
    """The planner's fake run (peak, split, states with the optimizer's moment, work) comes back whole from the
    folder in a process that never counted it."""
    from labkit import estimate as E
    from labkit.planner import plan as P
    monkeypatch.setenv(E.SHARED_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(E, "_REMEMBERED", {})
    monkeypatch.setattr(P, "_FLOPS", {})
    spec = P.gpt_spec(replace(GPT2_124M, n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16))
    step = P.Step(2, 1, 8, "none", "bf16")
    counted = P._fake_run(spec, step, 1)
    monkeypatch.setattr(E, "_REMEMBERED", {})
    monkeypatch.setattr(P, "_FLOPS", {})
    monkeypatch.setattr(P, "_count_fake_run", lambda *a: pytest.fail("counted again"))
    assert P._fake_run(spec, step, 1) == counted and counted[2]["at_optimizer"] and counted[4][1] > 0
    assert P._FLOPS[(spec.key, 1, step)] == counted[4]


def test_the_lean_fake_mode_gives_the_plain_modes_figures_and_keys_what_decides_an_output(monkeypatch):
    """LeanFakeTensorMode (fake_step's mode on this torch) keys a fake tensor by its metadata read directly: every
    planner figure as FakeTensorMode's (autocast, checkpointing, pure bf16, FSDP2, foreach Adam), strides told apart,
    and a torch whose TensorMetadata has a field it does not cover gets FakeTensorMode itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from labkit import estimate
    from labkit.planner import plan as P
    assert type(estimate.fake_mode()) is estimate.LeanFakeTensorMode
    with estimate.fake_mode():  # a transposed input after a contiguous one of the same shape: its own cache entry
        assert (torch.empty(8, 4) * 1).stride() == (4, 1)
        assert (torch.empty(4, 8).t() * 1).stride() == (1, 8)  # (a key without strides: (4, 1), the entry above's)
    cfg = replace(P.PRESETS["llama-7b"], n_layer=2, n_embd=32, n_head=2, mlp_hidden=64, vocab_size=256)
    spec = P.gpt_spec(cfg)
    steps = [P.Step(2, 2, 8, "every", "bf16"), P.Step(1, 1, 8, "selective", "bf16-pure", adam_impl="foreach"),
             P.Step(1, 2, 8, "none", "bf16-mp", shard=(2, True))]
    lean = [P._count_fake_run(spec, step, 2, False, True)[:5] for step in steps]
    monkeypatch.setattr(estimate, "fake_mode", lambda **kw: FakeTensorMode(**kw))
    assert lean == [P._count_fake_run(spec, step, 2, False, True)[:5] for step in steps]
    monkeypatch.undo()
    monkeypatch.setattr(estimate, "_KEYED_FIELDS", estimate._KEYED_FIELDS - {"is_neg"})  # a field not covered
    assert type(estimate.fake_mode()) is FakeTensorMode


def test_the_fast_fake_mode_makes_the_outputs_torch_makes_and_the_same_figures(monkeypatch):
    """labkit.fastfake (the planner's and the search's mode) makes a cached output as FakeTensor() does: the same
    attributes, a view on its input's storage, every planner figure as FakeTensorMode's; a torch whose new fake
    tensors carry another value gets the lean mode instead."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from labkit import estimate, fastfake
    from labkit.planner import plan as P
    made = []
    monkeypatch.setattr(fastfake.LeanFakeTensorMode, "_get_output_tensor_from_cache_entry",
                        lambda *a: made.append(a) or FakeTensorMode._get_output_tensor_from_cache_entry(*a))
    with fastfake.fast_fake_mode() as mode:
        assert type(mode) is fastfake.direct_dispatch(fastfake.FastFakeTensorMode)  # (torch's wrapper left out)
        assert type(mode).__torch_dispatch__ is FakeTensorMode.__torch_dispatch__.__wrapped__  # (what torch wraps)
        x = torch.empty(4, 8)
        first, again = x * 2, x * 2  # (the second from the cache: made here)
        view, view_again = x.t(), x.t()
        assert type(again) is FakeTensor and again.fake_mode is mode and again.device == torch.device("cpu")
        assert vars(again).keys() == vars(first).keys() and again.stride() == (8, 1) and view_again.stride() == (1, 8)
        assert view_again.untyped_storage()._cdata == x.untyped_storage()._cdata
        assert x.add_(1) is x and x.add_(1) is x  # (in place, from the cache: the input itself, by torch's code)
        bypassed = FakeTensorMode.cache_bypasses["unsafe view"]
        unsafe = [torch.ops.aten._unsafe_view(x, (8, 4)) for _ in range(2)]  # (torch's mode runs each anew)
        assert FakeTensorMode.cache_bypasses["unsafe view"] == bypassed  # cached, as a view
        assert unsafe[1].shape == (8, 4) and unsafe[1].stride() == (4, 1)
        assert unsafe[1].untyped_storage()._cdata == x.untyped_storage()._cdata  # an alias, as torch's mode makes it
    assert len(made) == 1  # only the in-place hit went to torch's code
    monkeypatch.undo()
    cfg = replace(P.PRESETS["llama-7b"], n_layer=2, n_embd=32, n_head=2, mlp_hidden=64, vocab_size=256)
    spec = P.gpt_spec(cfg)
    steps = [P.Step(2, 2, 8, "every", "bf16"), P.Step(1, 1, 8, "selective", "bf16-pure", adam_impl="foreach"),
             P.Step(1, 2, 8, "none", "bf16-mp", shard=(2, True)), P.Step(1, 1, 8, "none", "fp32", offload=True)]
    fast = [P._count_fake_run(spec, step, 2, False, True)[:5] for step in steps]
    monkeypatch.setattr(P, "fast_fake_mode", lambda **kw: FakeTensorMode(**kw))
    assert fast == [P._count_fake_run(spec, step, 2, False, True)[:5] for step in steps]
    monkeypatch.undo()
    from torch._subclasses.fake_impls import op_implementations_dict
    monkeypatch.setitem(op_implementations_dict, torch.ops.aten._unsafe_view.default, lambda *a: None)
    assert not fastfake.fast_fake_mode().views_unsafe  # (a torch computing the two apart: each by its own code)
    monkeypatch.undo()
    assert fastfake.fast_fake_mode().views_unsafe  # (this torch: one function for both)
    real = FakeTensor.__new__
    monkeypatch.setattr(FakeTensor, "__new__", lambda *a, **k: setattr(t := real(*a, **k), "constant", 0) or t)
    assert type(fastfake.fast_fake_mode()) is estimate.LeanFakeTensorMode  # (a value it would not set)


def test_direct_dispatch_modes_leave_out_torchs_wrapper_and_give_the_same_figures(monkeypatch):
    """fastfake.direct_dispatch (the fake steps' meter and work counter): __torch_dispatch__ called as written, not
    through the wrapper torch puts around every dispatch mode's; a fake step's bytes and counted work as with the
    wrapped classes (autocast with checkpointing, FSDP2)."""
    from labkit import fastfake
    from labkit.meter import MemoryMeter
    from labkit.planner import plan as P
    from labkit.work import WorkCounter
    for mode_class in (MemoryMeter, WorkCounter):
        direct = fastfake.direct_dispatch(mode_class)
        assert issubclass(direct, mode_class) and direct is fastfake.direct_dispatch(mode_class)
        assert hasattr(mode_class.__torch_dispatch__, "__wrapped__")  # (torch's wrapper, on the class itself)
        assert not hasattr(direct.__torch_dispatch__, "__wrapped__")
    cfg = replace(P.PRESETS["llama-7b"], n_layer=2, n_embd=32, n_head=2, mlp_hidden=64, vocab_size=256)
    spec = P.gpt_spec(cfg)
    steps = [P.Step(2, 2, 8, "every", "bf16"), P.Step(1, 2, 8, "none", "bf16-mp", shard=(2, True))]
    monkeypatch.setattr(P, "_FLOPS", {})  # (each step's work counted in both rounds)
    direct = [P._count_fake_run(spec, step, 2, False, True)[:5] for step in steps]
    monkeypatch.setattr(P, "direct_dispatch", lambda mode_class: mode_class)
    monkeypatch.setattr(P, "_FLOPS", {})
    assert direct == [P._count_fake_run(spec, step, 2, False, True)[:5] for step in steps]
    assert all(figures[4][0] + figures[4][1] > 0 for figures in direct)  # (work counted: FLOPs, fp32 and 16-bit)
