"""labkit.planner.plan: fake-tensor peaks against the meter, the fast path against full-depth runs, bad input, the command."""

import dataclasses
import json
import math
import os
import time
import types

import pytest
import torch

from labkit import estimate, gpus
from labkit.estimate import SHARED_DIR_ENV, estimate_training_memory, example_batch
from labkit.example import running_example
from labkit.gpus import GPUS, DeviceProfile, device_profile
from labkit.models import GPT, GPTConfig, build_model
from labkit.planner import plan as P
from labkit.techniques.precision import amp_train_step
from labkit.train import ADAM_IMPLS, make_optimizer, measure_step
from labkit.validate import ParameterError

SMALL = GPTConfig(n_layer=6, n_embd=64, n_head=4, block_size=32, vocab_size=128)
DEEP = GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=64, vocab_size=512, mlp_hidden=64, attn="sdpa")
DEEP_LLAMA = dataclasses.replace(P.PRESETS["llama3-8b"], n_layer=4, n_embd=32, n_head=4, n_kv_head=2, mlp_hidden=64,
                                 vocab_size=512, block_size=64)  # Llama 3's shape: grouped-query attention
SHARDED_DEEP = P.SHARDED_DEPTHS[1] + 1  # the fewest blocks past FSDP2's fast depths: its fits' runs extrapolated
#   (the unsharded tests take 4 blocks, past FAST_DEPTHS, with FULL_MAX_LAYERS set to 3: each full-depth reference
#   is a fake step of that many blocks, the suite's costliest work)


def _fitted(spec, step) -> bool:
    """Tell whether `step` took the fast depth (an exact fit of small runs), not its fallback to a full-depth run."""
    return P._FITS.get((spec.key, dataclasses.replace(step, micro_batch=0, adam_impl=P.ADAM_IMPLS[0]))) is not None


def cpu_profile(memory_bytes: int) -> DeviceProfile:
    """Return a CPU-like profile with fixed rates (no timing in tests)."""
    return DeviceProfile("cpu", memory_bytes, {"fp32": 1e11, "bf16": 1e11}, 1e10, 1e10, 1e10)


def test_cpu_peaks_match_the_meter_within_one_percent():
    ex = running_example()
    cfg = ex.config
    p = P.plan(cfg, cpu_profile(ex.budget_bytes), 1, ex.seq_len, ex.batch_size, reserve_fraction=0.0,
               precisions=("fp32",), offload=(False,), optimizers=("device",),  # (offload, host: the test after next)
               checkpointing=P.CHECKPOINTING)  # ("full" too: a plan takes it when asked)
    combos = {(r.combination.micro_batch, r.combination.checkpointing) for r in p.rows}
    assert {c for _, c in combos} == set(P.CHECKPOINTING) and {m for m, _ in combos} == {1, 2, 4, 8, 16}
    # real steps at 4 and 16 rows: the planner runs 1, 2 and 8 as it runs 4 (two micro-batches, the rest of the
    # batch's rows held) and 16 as one micro-batch; a real step of 1 row runs 16 micro-batches for no other path
    _check_against_the_meter([r for r in p.rows if r.combination.micro_batch in (4, 16)], ex)
    assert any(r.fits for r in p.rows) and not all(r.fits for r in p.rows)  # the budget decides


def test_bf16_peaks_match_the_meter_within_one_percent():
    """bf16 rows against real bf16 steps, on a smaller example: most CPUs run bf16 on generic kernels, tens of times
    slower than fp32 (the bytes do not depend on the size: every row, every checkpointing choice)."""
    ex = running_example(n_layer=2, batch_size=4, seq_len=32)
    p = P.plan(ex.config, cpu_profile(ex.budget_bytes), 1, ex.seq_len, ex.batch_size, reserve_fraction=0.0,
               precisions=("bf16",), offload=(False,), optimizers=("device",), checkpointing=P.CHECKPOINTING)
    combos = {(r.combination.micro_batch, r.combination.checkpointing, r.combination.precision) for r in p.rows}
    assert combos == {(m, c, "bf16") for m in (1, 2, 4) for c in P.CHECKPOINTING}
    _check_against_the_meter(p.rows, ex)


def test_layer_level_rows_match_the_meter_and_recompute_their_blocks_share(monkeypatch):
    """layer<k>, torchtitan's layer-level selective checkpointing (every k-th block whole): its rows within 1% of real
    steps; its recomputed FLOPs are its blocks' share of full checkpointing's (blocks 2 and 4 of 4 for layer2, 3 for
    layer3), its peak between full's and none's."""
    ex = running_example(batch_size=4, seq_len=32)  # 4 blocks
    p = P.plan(ex.config, cpu_profile(ex.budget_bytes), 1, ex.seq_len, ex.batch_size, reserve_fraction=0.0,
               precisions=("fp32", "bf16"), offload=(False,), optimizers=("device",), micro_batches=(4,),
               checkpointing=("none", "full", "layer2", "layer3"), workers=1)
    rows = {(r.combination.checkpointing, r.combination.precision): r for r in p.rows}
    _check_against_the_meter([rows["layer2", "fp32"], rows["layer3", "fp32"], rows["layer2", "bf16"]], ex)
    for precision in ("fp32", "bf16"):
        none, full, two, three = (rows[c, precision] for c in ("none", "full", "layer2", "layer3"))
        assert two.flops - none.flops == (full.flops - none.flops) * 2 // 4 > 0
        assert three.flops - none.flops == (full.flops - none.flops) // 4
        assert full.peak_bytes < two.peak_bytes < none.peak_bytes and two.peak_bytes <= three.peak_bytes


def test_layer_level_fast_depth_equals_a_full_depth_run(monkeypatch):
    """layer<k> at the fast depth: two small runs k blocks apart, holding whole groups of k blocks (one recomputed, k - 1
    kept) past those standing apart, the last block recomputed or kept as at full depth; byte for byte the full depth,
    with accumulation and FSDP2 (its first two and last blocks apart)."""
    monkeypatch.setattr(P, "FULL_MAX_LAYERS", 3)  # take the fast path on a small model
    monkeypatch.setattr(P, "_FITS", {})  # (each fit made here)
    for n_layer, checkpointing, precision, shard, micro_batch, runs in (
            (6, "layer2", "fp32", None, 3, ((2, 4), (0, False), 2)),  # (the last block recomputed; a line in rows)
            (10, "layer3", "bf16", None, 1, ((4, 7), (1, False), 3)),  # (the last kept: its group's place, the first apart)
            (9, "layer2", P.MIXED_POLICY, (2, True), 1, ((5, 7), (2, True), 2))):
        spec = P.gpt_spec(dataclasses.replace(DEEP_LLAMA, n_layer=n_layer))
        step = P.Step(micro_batch, 2, 16, checkpointing, precision, shard=shard)
        assert P._fast(spec, step, "fast") and P._fit_depths(spec, step)[0] == runs
        fast = P._extrapolated(spec, step, "fast")
        assert P._FITS[spec.key, dataclasses.replace(step, micro_batch=0)] is not None  # no fallback
        assert fast == P._extrapolated(spec, step, "full")
    deep = P.gpt_spec(dataclasses.replace(DEEP_LLAMA, n_layer=13))  # layer10: the small runs would take 13 and 23 blocks
    assert P._fit_depths(deep, P.Step(1, 2, 16, "layer10", "fp32"))[0][0] == (13, 23)
    assert not P._fast(deep, P.Step(1, 2, 16, "layer10", "fp32"), "fast")  # (its one full-depth run instead)


def test_a_gpu_plan_takes_cuda_autocasts_dtypes():
    """A GPU's bf16 rows: the peaks of real CPU steps run with CUDA autocast's dtypes (CudaAutocastOps, checked op by
    op against an H200 in test_autocast_ops); a CPU's own rows keep its autocast's."""
    from labkit.autocast_ops import CudaAutocastOps

    ex = running_example(n_layer=1, batch_size=8)  # its activations, not Adam's update, make the peak
    gpu = dataclasses.replace(cpu_profile(ex.budget_bytes), name="cuda")
    kwargs = {"precisions": ("bf16",), "offload": (False,), "optimizers": ("device",), "reserve_fraction": 0.0,
              "checkpointing": ("none", "every"), "micro_batches": (ex.batch_size,), "workers": 1}
    on_gpu, on_cpu = (P.plan(ex.config, profile, 1, ex.seq_len, ex.batch_size, **kwargs).rows
                      for profile in (gpu, cpu_profile(ex.budget_bytes)))
    for g, c in zip(on_gpu, on_cpu):
        model, opt, step_fn = P.combination_step(ex.config, g.combination, 0)
        with CudaAutocastOps():
            measured = measure_step(model, opt, example_batch(ex.config, ex.batch_size, ex.seq_len), step_fn,
                                    warmup=False)
        assert g.peak_bytes == measured.peak_bytes != c.peak_bytes, g.combination


def _check_against_the_meter(rows, ex):
    """Run every row's combination for real (plan.combination_step) under the meter: peak within 1%, same verdict."""
    errors = []
    for r in rows:
        c = r.combination
        model, opt, step_fn = P.combination_step(ex.config, c, 0)
        batch = example_batch(ex.config, ex.batch_size, ex.seq_len)
        measured = measure_step(model, opt, batch, step_fn, warmup=False)  # (combination_step made the state)
        errors.append((abs(r.peak_bytes - measured.peak_bytes) / measured.peak_bytes, c))
        near_budget = abs(measured.peak_bytes - ex.budget_bytes) < 0.01 * ex.budget_bytes
        assert r.fits == (measured.peak_bytes <= ex.budget_bytes) or near_budget
    worst = max(errors, key=lambda e: e[0])
    print(f"largest error {worst[0]:.4%} at {worst[1]}")
    assert worst[0] <= 0.01, f"predicted peak off by {worst[0]:.2%} at {worst[1]}"


def test_offload_and_host_optimizer_rows_match_the_meter():
    """Activation offload (hooks on the fake step) and Adam on the host (arithmetic on it): the meter's host tier."""
    ex = running_example(n_layer=1, batch_size=4, seq_len=32)
    p = P.plan(ex.config, cpu_profile(ex.budget_bytes), 1, ex.seq_len, ex.batch_size, checkpointing=("none", "every"),
               reserve_fraction=0.0)
    rows = {dataclasses.astuple(r.combination): r for r in p.rows}
    new = [r for r in p.rows if r.combination.offload or r.combination.optimizer == "host"]
    assert {(r.combination.offload, r.combination.optimizer) for r in new} == {(True, "device"), (False, "host"),
                                                                               (True, "host")}
    assert all(r.combination.checkpointing == "none" for r in new if r.combination.offload)
    for r in new:  # each lowers the device peak below its plain row's, and pays for it over the host link
        c = r.combination
        plain = rows[dataclasses.astuple(dataclasses.replace(c, offload=False, optimizer="device"))]
        assert r.peak_bytes < plain.peak_bytes and r.host_s > 0 and r.step_s == r.compute_s + r.host_s
        assert c.optimizer == "device" or r.split["optimizer_state"] == 0
    _check_against_the_meter(new, ex)


@pytest.mark.parametrize("cfg", [DEEP, DEEP_LLAMA], ids=["gpt2-style", "llama-style"])
def test_fast_depth_equals_a_full_depth_run(cfg, monkeypatch):
    """Accumulation, every checkpointing choice but sqrt(n), both precisions: fast peaks and splits, byte for byte."""
    monkeypatch.setattr(P, "FULL_MAX_LAYERS", 3)  # take the fast path on a small model
    spec = P.gpt_spec(cfg)
    for checkpointing in ("none", "every", "full", "selective", "op"):
        for precision in ("fp32", "bf16"):
            # 3 rows: beyond the fit's rows (1 and 2) and beyond its depths, both extrapolations at once
            fast = P._extrapolated(spec, P.Step(3, 2, 16, checkpointing, precision), "fast")
            assert P._FITS[repr(cfg), P.Step(0, 2, 16, checkpointing, precision)] is not None  # no fallback
            assert fast == P._extrapolated(spec, P.Step(3, 2, 16, checkpointing, precision), "full")


def test_one_micro_batch_size_takes_its_own_two_runs_and_the_same_row(monkeypatch):
    """A plan asking one micro-batch size fits it from two small runs of that size (the line takes six, of 1, 2 and 3
    rows): the same row as the line's and as a full-depth run's."""
    monkeypatch.setattr(P, "FULL_MAX_LAYERS", 3)  # take the fast path on a small model
    monkeypatch.setattr(estimate, "_REMEMBERED", {})  # (every fake step of this test run here, counted below)
    monkeypatch.delenv(SHARED_DIR_ENV, raising=False)
    monkeypatch.setattr(P, "_FITS", {})
    monkeypatch.setattr(P, "_PLANNED", {})
    traced, real = [], P._count_fake_run
    monkeypatch.setattr(P, "_count_fake_run", lambda spec, step, n_layer, trace, whole, *a: (
        traced.append(step.micro_batch) if trace and not whole else None) or real(spec, step, n_layer, trace, whole, *a))
    kw = dict(reserve_fraction=0.0, precisions=("fp32",), checkpointing=("every",), offload=(False,),
              optimizers=("device",), workers=1)
    (one,) = P.plan(DEEP, cpu_profile(1 << 40), 1, 16, 8, micro_batches=(4,), **kw).rows
    assert traced == [4, 4]  # its own size at the two depths
    P._PLANNED.clear()
    line = {r.combination.micro_batch: r for r in P.plan(DEEP, cpu_profile(1 << 40), 1, 16, 8, micro_batches=(2, 4),
                                                          **kw).rows}
    assert sorted(traced[2:]) == [1, 1, 2, 2, 3, 3] or sorted(traced[2:]) == [1, 1, 2, 2]  # the line's runs
    assert (one.peak_bytes, one.split, one.step_s) == (line[4].peak_bytes, line[4].split, line[4].step_s)
    full = P._extrapolated(P.gpt_spec(DEEP), P.Step(4, 2, 16, "every", "fp32"), "full")
    assert (one.peak_bytes, one.split) == full[:2]


@pytest.mark.parametrize("micro_batch", [3, 8])
def test_rows_are_a_line_through_small_micro_batches(micro_batch, monkeypatch):
    """Peaks at 3 and 8 rows from runs with 1 and 2 (or 2 and 3) rows equal real runs at those rows."""
    monkeypatch.setattr(P, "FULL_MAX_LAYERS", 3)
    for cfg, checkpointing, precision in ((DEEP_LLAMA, "none", "bf16"), (DEEP, "every", "fp32")):
        spec = P.gpt_spec(cfg)
        fast = P._extrapolated(spec, P.Step(micro_batch, 2, 16, checkpointing, precision), "fast")
        assert fast == P._extrapolated(spec, P.Step(micro_batch, 2, 16, checkpointing, precision), "full")


def test_deep_models_leave_out_what_only_full_depth_gives(monkeypatch):
    monkeypatch.setattr(P, "FULL_MAX_LAYERS", 3)
    p = P.plan(DEEP_LLAMA, "h100", 4, 16, 4, precisions=("fp32",), checkpointing=("none", "sqrt"))
    assert {"checkpointing sqrt", "fsdp2 below the largest rank count"} <= set(p.left_out)
    assert {r.combination.checkpointing for r in p.rows} == {"none"}
    fsdp = [r for r in p.rows if r.combination.parallel.startswith("fsdp2")]  # full-depth sharded steps, 4 ranks only
    assert {r.combination.parallel for r in p.rows} == {"single", "ddp", "zero1", "fsdp2", "fsdp2-reshard"}
    assert {r.combination.ranks for r in fsdp} == {4} and len(fsdp) == 2


def test_meter_tags_events_and_splits_every_point():
    from labkit.meter import CATEGORIES, MemoryMeter
    model = torch.nn.Linear(8, 8)
    with MemoryMeter("cpu", every_record=True) as meter:
        meter.track(model)
        meter.tag = "forward"
        y = model(torch.randn(4, 8))
        meter.tag = "backward"
        y.sum().backward()
    points, splits = meter.timeline, meter.timeline_splits()
    assert len(points) == len(splits) and {p.tag for p in points} == {None, "forward", "backward"}
    assert all(sum(s) == p.bytes for p, s in zip(points, splits))
    peak = max(range(len(points)), key=lambda k: points[k].bytes)
    assert dict(zip(CATEGORIES, splits[peak])) == meter.peak_split()
    with pytest.raises(RuntimeError, match="every_record"):
        MemoryMeter("cpu").timeline_splits()


def test_data_parallel_rows_are_exact_arithmetic():
    p = P.plan(SMALL, "a100-80gb", gpus=2, seq_len=16, batch=4, checkpointing=("none",), precisions=("fp32",),
               offload=(False,))
    rows = {(r.combination.ranks, r.combination.parallel, r.combination.micro_batch): r for r in p.rows
            if r.combination.optimizer == "device"}
    single, ddp, zero1 = rows[2, "single"] if (2, "single") in rows else None, rows[2, "ddp", 2], rows[2, "zero1", 2]
    assert single is None
    adam = ddp.split["optimizer_state"]
    assert adam >= 2 * 4 * SMALL.n_params()  # Adam's two fp32 moments (and a step counter per parameter)
    assert ddp.peak_bytes - zero1.peak_bytes == adam - adam // 2 == adam - zero1.split["optimizer_state"]
    assert ddp.comm_s > 0 and rows[1, "single", 4].comm_s == 0
    assert p.fastest is not None and p.fastest in p.pareto
    assert all(a.step_s <= b.step_s and a.peak_bytes > b.peak_bytes for a, b in zip(p.pareto, p.pareto[1:]))


def test_fp16_rows_exist_only_where_the_gpu_has_them():
    t4 = P.plan(SMALL, "t4", 1, 16, 2, checkpointing=("none",))
    assert {r.combination.precision for r in t4.rows} == {"fp32", "fp16"}
    with pytest.raises(ParameterError, match="precision 'bf16'.*t4"):
        P.plan(SMALL, "t4", 1, 16, 2, precisions=("bf16",))


@pytest.mark.parametrize("kwargs, field", [
    ({"model": "gpt-17"}, "model"), ({"gpu": "v100"}, "gpu"), ({"gpus": 3, "batch": 8}, "batch"),
    ({"seq_len": 2048, "model": "gpt2"}, "seq_len"), ({"gpus": 0}, "gpus"),
    ({"checkpointing": ("layer1",)}, r"k of layer<k> \(every k-th block; 1 is full\) must be an integer \[2, 6\]"),
    ({"checkpointing": ("layer7",)}, r"layer7: k of layer<k>"),
    ({"checkpointing": ("layers",)}, r"checkpointing must be one of .* or layer<k> \(every k-th block, 2 <= k <= 6\)"),
])
def test_bad_input_names_the_field(kwargs, field):
    args = {"model": SMALL, "gpu": "a100-80gb", "gpus": 1, "seq_len": 16, "batch": 8, **kwargs}
    with pytest.raises(ParameterError, match=field):
        P.plan(**args)


def test_memory_of_zero_is_refused():
    with pytest.raises(ParameterError, match="memory_bytes"):
        DeviceProfile("mine", 0, {"fp32": 1e12}, 1e9, 1e9, 1e9)


def test_a_callable_model_runs_at_full_depth():
    def build(rows, seq_len):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        return _WithLoss(model), (torch.randn(rows, 8), torch.randint(2, (rows,)))
    p = P.plan(P.callable_spec(build, "mlp"), "l4", 1, 1, 4)
    assert {r.combination.checkpointing for r in p.rows} == {"none"} and p.rows
    assert p.n_params == 8 * 16 + 16 + 16 * 2 + 2
    with pytest.raises(ParameterError, match="checkpointing"):
        P.plan(P.callable_spec(build, "mlp"), "l4", 1, 1, 4, checkpointing=("every",))


class _ValueDependent(torch.nn.Module):
    """A classifier whose step reads a tensor's value ("item") or keeps the rows a mask selects ("mask")."""

    def __init__(self, mode):
        super().__init__()
        self.linear, self.mode = torch.nn.Linear(8, 2), mode

    def forward(self, x, y):
        h = self.linear(x)
        if self.mode == "item":
            h = h * float(h.sum().item() > 0)
        else:
            keep = h.sum(1) > 0
            h, y = h[keep], y[keep]
        return h, torch.nn.functional.cross_entropy(h, y)


@pytest.mark.parametrize("mode, operation", [("item", "_local_scalar_dense"), ("mask", "nonzero")])
def test_a_model_the_fake_step_cannot_run_names_the_operation(mode, operation):
    spec = P.callable_spec(lambda rows, seq_len: (_ValueDependent(mode), (torch.randn(rows, 8),
                                                                          torch.randint(2, (rows,)))), "value-reader")
    with pytest.raises(ParameterError, match=f"model: value-reader cannot run on fake tensors.*{operation}"):
        P.plan(spec, "l4", 1, 1, 4)


class _WithLoss(torch.nn.Module):
    """A classifier called as model(x, y) -> (logits, loss)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        logits = self.net(x)
        return logits, torch.nn.functional.cross_entropy(logits, y)


def test_sqrt_at_two_blocks_reuses_the_fake_step_without_checkpointing():
    """round(sqrt(2)) = 1 segment, the last, kept whole: the step without checkpointing, run once for both rows."""
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=128)
    p = P.plan(cfg, "h100", 1, 16, 2, precisions=("fp32",), checkpointing=("none", "sqrt"), offload=(False,),
               optimizers=("device",))
    rows = {(r.combination.micro_batch, r.combination.checkpointing): r for r in p.rows}
    assert p.fake_steps == 2 and len(rows) == 4  # micro-batches 1 and 2, each run once
    spec = P.gpt_spec(cfg)
    for mb in (1, 2):
        none, sqrt = rows[mb, "none"], rows[mb, "sqrt"]
        assert (sqrt.peak_bytes, sqrt.split, sqrt.flops, sqrt.bytes_accessed) == \
            (none.peak_bytes, none.split, none.flops, none.bytes_accessed)
        # and the sqrt step itself, run: the same figures
        assert P._extrapolated(spec, P.Step(mb, 2 // mb, 16, "sqrt", "fp32"), "full") == \
            P._extrapolated(spec, P.Step(mb, 2 // mb, 16, "none", "fp32"), "full")


def test_another_size_and_budget_give_the_same_verdicts():
    small = P.plan(SMALL, cpu_profile(10**12), 1, 16, 4, checkpointing=("none", "every"), precisions=("fp32",))
    cut = sorted(r.peak_bytes for r in small.rows)[len(small.rows) // 2]
    tight = P.plan(SMALL, cpu_profile(cut), 1, 16, 4, checkpointing=("none", "every"), precisions=("fp32",),
                   reserve_fraction=0.0)
    assert [r.fits for r in tight.rows] == [r.peak_bytes <= cut for r in small.rows]
    assert all(r.fits for r in small.rows)
    # the tables' "#": a row's place on the Pareto front (chapter 09's figure numbers its points by it), else blank
    assert len(tight.pareto) > 1
    front_table = P.format_plan(tight).split("\n")[4:4 + len(tight.pareto)]
    assert [line.split()[0] for line in front_table] == [str(i) for i in range(1, len(tight.pareto) + 1)]
    every_row = P.format_plan(tight, all_rows=True).split("\n")[4:4 + len(tight.rows)]
    numbered = {i: r for i, r in enumerate(tight.rows) if every_row[i][:3].strip()}
    assert [int(every_row[i][:3]) for i in numbered] == [tight.pareto.index(r) + 1 for r in numbered.values()]
    assert set(map(id, numbered.values())) == set(map(id, tight.pareto))


def test_transformers_config_plans_when_installed():
    transformers = pytest.importorskip("transformers", reason="transformers (optional extra) is not installed")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=128)
    p = P.plan(cfg, "a100-80gb", 1, 16, 2)
    assert p.rows and p.n_params > 0


def test_a_transformers_model_takes_the_fast_depth_exactly(monkeypatch):
    """A transformers Llama's decoder layers are tagged like labkit blocks: fast equals full depth, byte for byte."""
    transformers = pytest.importorskip("transformers", reason="transformers (optional extra) is not installed")
    monkeypatch.setattr(P, "FULL_MAX_LAYERS", 3)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=128)  # grouped-query attention
    spec = P.hf_spec(cfg)
    for precision, checkpointing in (("fp32", "none"), ("bf16", "none"), ("fp32", "every")):
        # beyond the fit's rows and depths
        fast = P._extrapolated(spec, P.Step(3, 2, 16, checkpointing, precision), "fast")
        assert P._FITS[spec.key, P.Step(0, 2, 16, checkpointing, precision)] is not None  # no full-depth fallback
        assert fast == P._extrapolated(spec, P.Step(3, 2, 16, checkpointing, precision), "full")


def test_a_transformers_model_checkpointed_by_its_own_switch_matches_the_meter():
    """checkpointing "full" of a transformers model is its gradient checkpointing: the meter agrees within 1%."""
    transformers = pytest.importorskip("transformers", reason="transformers (optional extra) is not installed")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=128)
    spec = P.hf_spec(cfg)
    peaks = {}
    for checkpointing in ("none", "full"):
        torch.manual_seed(0)
        model, batch = spec.build(None, 4, 16)
        P._checkpoint(model, checkpointing)
        opt = make_optimizer("adam", model.parameters())
        measured = measure_step(model, opt, batch, lambda m, o, b: P.plan_step(m, o, b, P.Step(2))).peak_bytes
        peaks[checkpointing] = P._extrapolated(spec, P.Step(2, 2, 16, checkpointing, "fp32"), "full")[0]
        assert abs(peaks[checkpointing] - measured) <= 0.01 * measured, (checkpointing, peaks[checkpointing], measured)
    assert peaks["full"] < peaks["none"]
    p = P.plan(cfg, "a100-80gb", 1, 16, 2, offload=(False,), optimizers=("device",))
    assert {r.combination.checkpointing for r in p.rows} == {"none", "full"}
    others = [c for c in P.CHECKPOINTING if c not in ("none", "full")]  # (every, sqrt, selective, op)
    assert "checkpointing " + " and ".join(others) in p.left_out and len(others) == 4
    with pytest.raises(ParameterError, match="selective"):
        P.plan(cfg, "a100-80gb", 1, 16, 2, checkpointing=("selective",))
    with pytest.raises(ParameterError, match=r"one of \('none', 'full'\), got 'layer2'"):  # (no blocks of labkit's)
        P.plan(cfg, "a100-80gb", 1, 16, 2, checkpointing=("layer2",))


def test_every_preset_has_its_published_models_parameter_count():
    # the counts of the published weights (Hugging Face's checkpoints: GPT-2's four, TinyLlama 1.1B, Llama 2 7B, 13B
    # and 70B, Meta Llama 3 8B): each preset's shape, grouped-query attention included, gives its model's exact count
    published = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
                 "gpt2-xl": 1_557_611_200, "llama-1b": 1_100_048_384, "llama-7b": 6_738_415_616,
                 "llama-13b": 13_015_864_320, "llama-70b": 68_976_648_192, "llama3-8b": 8_030_261_248}
    assert {name: cfg.n_params() for name, cfg in P.PRESETS.items()} == published
    assert (P.PRESETS["llama-1b"].n_kv_head, P.PRESETS["llama-70b"].n_kv_head, P.PRESETS["llama3-8b"].n_kv_head) == (4, 8, 8)


def test_gpu_table_is_complete():
    assert set(GPUS) == {"t4", "l4", "a10g", "rtx4090", "a100-40gb", "a100-80gb", "h100", "h200"}
    assert "bf16" not in GPUS["t4"].flops_per_s and all("bf16" in g.flops_per_s for k, g in GPUS.items() if k != "t4")


def test_command_prints_the_table_and_json(monkeypatch, capsys):
    monkeypatch.setitem(P.PRESETS, "tiny", dataclasses.replace(SMALL, n_layer=1))
    monkeypatch.setenv(P.PLAN_WORKERS_ENV, "1")  # (a worker process would not know this test's preset)
    assert P.main(["--model", "tiny", "--gpu", "h100", "--gpus", "1", "--seq-len", "16", "--batch", "2"]) == 0
    text = capsys.readouterr().out
    assert "fastest that fits: ranks" in text and "left out:" in text
    fastest = next(line for line in text.splitlines() if line.startswith("fastest that fits: "))
    assert "adam_impl" in fastest and "grad_sync" not in fastest and "reduce_dtype" not in fastest  # FSDP2's knobs
    P.main(["--model", "tiny", "--gpu", "h100", "--seq-len", "16", "--batch", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["fastest"]["fits"] and len(data["rows"]) > 0 and data["fastest"]["reserved_bytes"] is None
    P.main(["--model", "tiny", "--gpu", "h100", "--seq-len", "16", "--batch", "2", "--reserved"])
    text = capsys.readouterr().out
    assert " reserved, " in text.split("fastest that fits:")[1] and "reserved: the caching allocator's" in text
    P.main(["--model", "tiny", "--gpu", "h100", "--seq-len", "16", "--batch", "2", "--reserved", "--expandable-segments"])
    assert "rules with expandable_segments:True" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # (the rules of a reserved peak: without one, named)
        P.main(["--model", "tiny", "--gpu", "h100", "--seq-len", "16", "--batch", "2", "--expandable-segments"])
    assert "expandable_segments: the rules of a reserved peak" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (layer<k>: passed on to plan, which knows the model's blocks)
        P.main(["--model", "tiny", "--gpu", "h100", "--seq-len", "16", "--batch", "2", "--checkpointing", "layer2"])
    assert "checkpointing layer2: k of layer<k>" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        P.main(["--help"])
    assert "layer<k>, e.g. layer2: torchtitan's layer-level selective" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        P.main(["--model", "tiny", "--gpu", "h100", "--gpus", "3", "--seq-len", "16", "--batch", "4"])
    assert "batch (4) must be divisible by gpus (3)" in capsys.readouterr().err
    nothing = P.plan(dataclasses.replace(SMALL, n_layer=2), cpu_profile(1000), 1, 16, 2, checkpointing=("none",))
    assert nothing.fastest is None and "nothing fits; the smallest peaks:" in P.format_plan(nothing)


def test_make_plan_passes_the_settings():
    from pathlib import Path
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    recipe = makefile.split("\nplan:", 1)[1].split("\n\n", 1)[0]
    for part in ("-m labkit.planner ", "--model $(MODEL)", "--gpu $(GPU)", "--gpus $(GPUS)", "--seq-len $(SEQ_LEN)",
                 "--batch $(BATCH)"):
        assert part in recipe, part


def test_fsdp2_rows_run_the_sharded_step_with_autocast_and_checkpointing():
    from labkit.estimate import estimate_training_memory
    cfg = dataclasses.replace(SMALL, n_layer=2)
    p = P.plan(cfg, "h100", gpus=2, seq_len=16, batch=2, checkpointing=("none", "every"), offload=(False,),
               optimizers=("device",), precisions=("fp32", "bf16", "fp16"))  # (asked: autocast under FSDP2 too)
    fsdp = {(c.parallel, c.checkpointing, c.precision): r for r in p.rows
            if (c := r.combination).parallel.startswith("fsdp2")}
    assert set(fsdp) == {(k, ck, pr) for k in ("fsdp2", "fsdp2-reshard") for ck in ("none", "every")
                         for pr in ("fp32", "bf16", "fp16")}
    plain = fsdp["fsdp2-reshard", "none", "fp32"]
    assert plain.peak_bytes == estimate_training_memory(cfg, 1, 16, "adam", 2, 3).peak_bytes  # estimate's own step
    for (kind, ck, pr), r in fsdp.items():
        assert fsdp["fsdp2-reshard", ck, pr].peak_bytes <= fsdp["fsdp2", ck, pr].peak_bytes
        assert ck == "none" or r.peak_bytes < fsdp[kind, "none", pr].peak_bytes  # checkpointing helps sharded too
        assert r.split["optimizer_state"] < estimate_training_memory(cfg, 1, 16).split["optimizer_state"]  # sharded
    ddp = next(r for r in p.rows if r.combination.parallel == "ddp" and r.combination.precision == "fp32"
               and r.combination.checkpointing == "none")
    assert plain.peak_bytes < ddp.peak_bytes and plain.comm_s > ddp.comm_s


def test_sharded_fast_depth_equals_a_full_depth_run(monkeypatch):
    """FSDP2 at the fast depth (first two and last blocks apart), with accumulation: byte for byte the full depth."""
    monkeypatch.setattr(P, "FULL_MAX_LAYERS", 3)
    spec = P.gpt_spec(dataclasses.replace(DEEP_LLAMA, n_layer=SHARDED_DEEP))
    for checkpointing, precision, shard, micro_batch in (("none", "bf16", (2, True), 3), ("every", "fp32", (2, False), 1),
                                                         ("full", P.MIXED_POLICY, (2, True), 3)):
        fast = P._extrapolated(spec, P.Step(micro_batch, 2, 16, checkpointing, precision, shard=shard), "fast")
        assert P._FITS[spec.key, P.Step(0, 2, 16, checkpointing, precision, shard=shard)] is not None  # no fallback
        assert fast == P._extrapolated(spec, P.Step(micro_batch, 2, 16, checkpointing, precision, shard=shard), "full")


def test_offload_fast_depth_equals_a_full_depth_run(monkeypatch):
    monkeypatch.setattr(P, "FULL_MAX_LAYERS", 3)
    spec = P.gpt_spec(DEEP)
    for precision, micro_batch in (("bf16", 3), ("fp32", 1)):
        fast = P._extrapolated(spec, P.Step(micro_batch, 2, 16, "none", precision, offload=True), "fast")
        assert P._FITS[spec.key, P.Step(0, 2, 16, "none", precision, True, None)] is not None
        assert fast == P._extrapolated(spec, P.Step(micro_batch, 2, 16, "none", precision, offload=True), "full")
        assert fast[5][2] > 0  # bytes offloaded, to the host and back


def test_fsdp2_rows_of_a_transformers_config():
    transformers = pytest.importorskip("transformers", reason="transformers (optional extra) is not installed")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    p = P.plan(cfg, "a100-80gb", 2, 16, 2, offload=(False,), optimizers=("device",))
    fsdp = {(r.combination.parallel, r.combination.precision): r for r in p.rows
            if r.combination.parallel.startswith("fsdp2")}
    assert set(fsdp) == {(k, pr) for k in ("fsdp2", "fsdp2-reshard") for pr in ("fp32", P.MIXED_POLICY)}  # (default)
    single = next(r for r in p.rows if r.combination.ranks == 1 and r.combination.precision == "fp32"
                  and r.combination.accum_steps == 1)
    assert fsdp["fsdp2-reshard", "fp32"].split["parameters"] < single.split["parameters"]  # sharded weights
    assert "fsdp2 of a model not a GPTConfig" not in p.left_out


def test_bad_offload_and_optimizer_choices_are_refused():
    with pytest.raises(ParameterError, match="offload"):
        P.plan(SMALL, "h100", 1, 16, 2, offload=("yes",))
    with pytest.raises(ParameterError, match="optimizers"):
        P.plan(SMALL, "h100", 1, 16, 2, optimizers=("cpu",))


def test_roofline_counts_recomputation_and_the_bytes_it_moves():
    """Checkpointing never makes a step faster: more FLOPs and more bytes accessed, the same micro-batch and precision."""
    p = P.plan(SMALL, "t4", gpus=1, seq_len=32, batch=2, reserve_fraction=0.0, offload=(False,), optimizers=("device",),
               checkpointing=("none", "every", "selective"))  # the choices asserted below
    rows = {(r.combination.micro_batch, r.combination.checkpointing, r.combination.precision): r for r in p.rows}
    for (mb, ckpt, prec), r in rows.items():
        plain = rows[mb, "none", prec]
        if ckpt in ("every", "selective"):  # (selective recomputes no matmul: the FLOPs counted are the same)
            assert r.flops >= plain.flops and r.bytes_accessed > plain.bytes_accessed and r.step_s > plain.step_s
            assert ckpt == "selective" or r.flops > plain.flops
        assert r.step_s == r.compute_s + r.comm_s and r.comm_s == 0 and r.bytes_accessed > 0
    assert rows[2, "none", "fp16"].step_s < rows[2, "none", "fp32"].step_s  # 2-byte tensors move half the bytes


def test_fake_steps_shared_among_worker_processes_give_the_same_plan(monkeypatch):
    """Two worker processes (this one, and a child forked from the fork server, which never ran a fake step; the fast depth past
    FULL_MAX_LAYERS, accumulation, FSDP2): every row as in this process, in the same order (the work of 2 accumulated
    micro-batches is counted apart from 1's); the child runs the model as the GPU does (SDPA's "sdpa" as CUDA's flash
    kernel), as this process does."""
    cfg = dataclasses.replace(DEEP_LLAMA, n_layer=P.FULL_MAX_LAYERS + 1, attn="sdpa")
    monkeypatch.setattr(P, "MIN_GROUPS_PER_WORKER", 1)  # 4 groups: shared among the 2 workers all the same
    monkeypatch.delenv(SHARED_DIR_ENV, raising=False)  # (the session's shared fake steps would make both plans one)
    kwargs = dict(gpu="h100", gpus=2, seq_len=16, batch=2, precisions=("bf16",), checkpointing=("every",),
                  offload=(False,))
    P._PLANNED.clear()
    children = []
    monkeypatch.setattr(P.ChildProcesses, "start_forked", lambda self, *a, start=P.ChildProcesses.start_forked, **k:
                        children.append(start(self, *a, **k)) or children[-1])
    run_claimed = P._run_claimed

    def after_the_child_claims(spec, groups, depth, claims, bar):  # this process claims nothing before the child
        deadline = time.monotonic() + 120
        while not os.listdir(claims) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.listdir(claims), "the child claimed no group within 120 s"
        return run_claimed(spec, groups, depth, claims, bar)
    monkeypatch.setattr(P, "_run_claimed", after_the_child_claims)
    bars = []  # the progress bar counts the groups every process has run
    monkeypatch.setattr(P, "progress", lambda *a, bar=P.progress, **k: bars.append(bar(*a, **k)) or bars[-1])
    shared = P.plan(cfg, workers=2, **kwargs)
    assert len(children) == 1 and children[0].returncode == 0  # this process and one child ran the fake steps
    assert len(bars) == 1 and bars[0].n == bars[0].total == 4
    P._PLANNED.clear()
    here = P.plan(cfg, workers=1, **kwargs)
    assert len(here.rows) >= 8 and here.fake_steps == shared.fake_steps
    assert [dataclasses.asdict(r) for r in shared.rows] == [dataclasses.asdict(r) for r in here.rows]


def test_a_worker_that_would_run_another_model_stops_the_plan(monkeypatch):
    """A worker process rebuilds each job's model and refuses one that is not the model its ModelSpec describes (a
    GPU plan's fake steps run the model as the GPU runs it: "sdpa" as CUDA's flash kernel)."""
    monkeypatch.setattr(P, "MIN_GROUPS_PER_WORKER", 1)
    monkeypatch.delenv(SHARED_DIR_ENV, raising=False)
    cfg = dataclasses.replace(DEEP_LLAMA, n_layer=1, attn="sdpa")
    spec = P.model_spec(dataclasses.replace(cfg, attn="flash"))
    steps = [P.Step(1, 1, 16, "none", "fp32"), P.Step(1, 1, 16, "full", "fp32")]
    with pytest.raises(RuntimeError, match=r"exit code 1:[\s\S]*a plan worker rebuilt .* where the plan runs"):
        P._fake_steps_of([(cfg, spec, steps)], "fast", 2)


def test_plan_workers_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(P.PLAN_WORKERS_ENV, "3")
    assert P.plan_workers() == 3
    monkeypatch.setenv(P.PLAN_WORKERS_ENV, "many")
    with pytest.raises(ParameterError, match="LABKIT_PLAN_WORKERS must be a whole number from 1 to 64, got 'many'"):
        P.plan_workers()
    monkeypatch.delenv(P.PLAN_WORKERS_ENV)
    assert 1 <= P.plan_workers() <= 4


def test_the_deep_estimate_from_shallow_runs_is_the_full_depth_estimate(monkeypatch):
    """labkit.planner.plan.deep_estimate (chapter 07's deep models): two shallow runs and arithmetic, the same bytes."""
    monkeypatch.setattr(P, "FULL_MAX_LAYERS", 3)  # take the fast path on a small model
    cfg = GPTConfig(n_layer=SHARDED_DEEP, n_embd=64, n_head=2, vocab_size=512, block_size=64)
    for n, stage in ((1, None), (4, 0), (4, 1), (4, 2), (16, 3)):
        full = estimate_training_memory(cfg, 1, 64, world_size=n, zero_stage=stage)
        fast = P.deep_estimate(cfg, 1, 64, n, stage)
        assert (fast.peak_bytes, fast.split, fast.n_params, fast.zero_stage) == \
            (full.peak_bytes, full.split, full.n_params, full.zero_stage), (n, stage)
        assert {k: v for k, v in fast.states.items() if k != "other"} == {k: v for k, v in full.states.items()
                                                                          if k != "other"}
        assert fast.states["other"] - full.states["other"] == 4  # the planner's step keeps its loss sum: one fp32
    with pytest.raises(ValueError, match="zero_stage"):
        P.deep_estimate(cfg, 1, 64, 1, 3)
    # many at once (chapter 07's table): the same estimates, two models' fake steps shared with a worker process
    other = dataclasses.replace(cfg, n_embd=32)
    requests = [(cfg, 1, 64, 4, 0), (cfg, 1, 64, 16, 3), (other, 1, 64, 8, 3), (other, 1, 64, 1, None)]
    one_by_one = [P.deep_estimate(*r) for r in requests]
    monkeypatch.setattr(P, "_PLANNED", {})  # (nothing remembered: the worker and this process run them)
    monkeypatch.setattr(estimate, "_REMEMBERED", {})
    monkeypatch.setattr(P, "MIN_GROUPS_PER_WORKER", 1)
    started = []
    real = P.ChildProcesses.start_forked
    monkeypatch.setattr(P.ChildProcesses, "start_forked", lambda self, *a, **k: started.append(a) or real(self, *a, **k))
    shared = P.deep_estimates(requests, workers=2)
    assert len(started) == 1 and [(e.peak_bytes, e.split, e.states) for e in shared] == \
        [(e.peak_bytes, e.split, e.states) for e in one_by_one]
    with pytest.raises(ValueError, match="zero_stage"):  # every request checked before any work
        P.deep_estimates([(cfg, 1, 64, 4, 0), (cfg, 1, 64, 1, 3)])


def test_each_adam_implementation_matches_the_meter():
    """foreach and fused Adam (no fake step more: the for-loop step's run, each update's rise added) against real steps
    of each implementation under the meter, where the update's allocations decide the peak (one row, small batch)."""
    ex = running_example(n_layer=2, batch_size=2, seq_len=16)
    p = P.plan(ex.config, cpu_profile(ex.budget_bytes), 1, ex.seq_len, ex.batch_size, reserve_fraction=0.0,
               precisions=("fp32",), checkpointing=("none", "every"), offload=(False,), optimizers=("device",),
               adam_impls=ADAM_IMPLS, workers=1)
    assert {r.combination.adam_impl for r in p.rows} == set(ADAM_IMPLS)
    assert p.fake_steps == len({(r.combination.micro_batch, r.combination.checkpointing) for r in p.rows})
    _check_against_the_meter(p.rows, ex)
    peaks = {(r.combination.micro_batch, r.combination.checkpointing, r.combination.adam_impl): r.peak_bytes
             for r in p.rows}
    assert any(peaks[k[:2] + ("foreach",)] > peaks[k[:2] + ("fused",)] for k in peaks)  # the knob changes a peak


def test_adam_updates_allocate_what_torchs_code_says(monkeypatch):
    """The rise of each implementation, from torch.optim.adam's code (the same Python on CUDA as here): for-loop, one
    parameter at a time, sqrt and division of its exp_avg_sq while the previous parameter's `denom` is still bound
    (P[i-1] + 2 P[i]); foreach, one list of sqrt(exp_avg_sq) over all parameters; fused, none."""
    spec = P.gpt_spec(DEEP)
    model, _ = spec.build(None, 1, 1)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]  # Adam's order: the parameters'
    loop = max(prev + 2 * size for prev, size in zip([0] + sizes, sizes))
    assert P._rise(spec, None, "for-loop", DEEP.n_layer) == loop
    assert P._rise(spec, None, "foreach", DEEP.n_layer) == sum(sizes)
    assert P._rise(spec, None, "fused", DEEP.n_layer) == 0
    # specs alike in their parameters share one rise, measured on the plainest forward: each one's own step agrees
    assert spec.plain is not None and spec.plain.key == repr(dataclasses.replace(DEEP, attn="manual"))
    assert spec.plain.plain is None  # (the plainest forward is its own)
    variants = [dataclasses.replace(DEEP, attn=attn, logits_fp32=fp32, dropout=dropout)
                for attn, fp32, dropout in (("sdpa", False, 0.0), ("manual", True, 0.0), ("flash", True, 0.1))]
    for cfg in variants:
        monkeypatch.setattr(P, "_RISE", {})
        shared = {(impl, pure): P._rise(P.gpt_spec(cfg), None, impl, DEEP.n_layer, pure)
                  for impl in ("for-loop", "foreach") for pure in (False, True)}
        assert {key[0] for key in P._RISE} == {spec.plain.key}, cfg  # measured on the plain spec only
        own = dataclasses.replace(P.gpt_spec(cfg), plain=None)
        for (impl, pure), rise in shared.items():
            assert P._rise(own, None, impl, DEEP.n_layer, pure) == rise, (cfg, impl, pure)


def test_adam_implementations_at_the_fast_depth_are_their_full_depth_steps(monkeypatch):
    """Past FULL_MAX_LAYERS (fast: fits shared by every implementation, the rise a line in depth) and below it (the
    for-loop step's run and the rise): the same figures as the implementation's own step at full depth, FSDP2 too."""
    monkeypatch.setattr(P, "FULL_MAX_LAYERS", 3)  # take the fast path on small models
    deep, sharded = (P.gpt_spec(dataclasses.replace(DEEP_LLAMA, n_layer=n)) for n in (4, SHARDED_DEEP))
    shallow = P.gpt_spec(dataclasses.replace(DEEP, n_layer=3))
    for spec, shard in ((deep, None), (sharded, (2, True)), (shallow, None)):
        for impl in ("foreach", "fused"):
            step = P.Step(2, 2, 16, "every" if shard is None else "none", "fp32", shard=shard, adam_impl=impl)
            assert P._extrapolated(spec, step, "fast") == P._extrapolated(spec, step, "full"), (spec.name, shard, impl)
            assert spec is shallow or _fitted(spec, step)  # the fast path, not its full-depth fallback



FSDP2_RANKS = '''
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
import labkit.dist as ld
from labkit.estimate import example_batch
from labkit.models import GPTConfig, build_model
import labkit.planner.plan as P
from labkit.sharded import label_accumulated_gradients
from labkit.train import make_optimizer

def main(config="", reshard=True, precision=P.MIXED_POLICY, rows=2, grad_sync="every", reduce="fp32"):
    cfg = eval(config, {"GPTConfig": GPTConfig})  # one rank: FSDP2 as the Step says, a warm-up step, a metered step
    torch.manual_seed(0)
    model = build_model(cfg)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[reduce]
    policy = MixedPrecisionPolicy(torch.bfloat16, dtype) if precision == P.MIXED_POLICY else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    label_accumulated_gradients(model)
    opt = make_optimizer("adam", model.parameters())
    batch = example_batch(cfg, rows, 16)
    step = P.Step(2, rows // 2, 16, precision=precision, grad_sync=grad_sync, reduce_dtype=reduce)
    P.plan_step(model, opt, batch, step)
    with ld.meter("step") as meter:
        meter.track(model, opt, *batch)
        P.plan_step(model, opt, batch, step)

if __name__ == "__main__":
    ld.run(main)
'''


@pytest.mark.parametrize("reshard", [True, False])
def test_mixed_policy_rows_are_what_two_real_ranks_measure(reshard, tmp_path):
    """FSDP2's MixedPrecisionPolicy (bf16 gathered parameters and compute, fp32 reduce-scatter) on the fake step
    against two gloo ranks running it, and below autocast's row over fp32 gathered weights.

    What gloo adds and NCCL does not: its reduce-scatter all-reduces a copy of the fp32 input (seen here: the root
    group's, embeddings and head, at the end of backward, every other event of the two steps alike). A rank's peak
    is the prediction or higher by at most the largest group's reduce-scatter input.
    """
    import labkit.dist as ld
    from labkit.models import build_model

    script = tmp_path / "mixed_ranks.py"
    script.write_text(FSDP2_RANKS)
    runs = ld.launch(script, 2, params={"config": repr(DEEP_LLAMA), "reshard": reshard}, echo=False, device="cpu")
    spec = P.gpt_spec(DEEP_LLAMA)
    predicted = P._extrapolated(spec, P.Step(2, 1, 16, "none", P.MIXED_POLICY, shard=(2, reshard)), "full")[0]
    model = build_model(DEEP_LLAMA)
    in_blocks = {id(p) for p in model.blocks.parameters()}
    groups = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    groups.append(sum(p.numel() for p in model.parameters() if id(p) not in in_blocks))  # the root's
    gloo_copy = max(groups) * 4  # fp32
    for r in runs:
        measured = r.meters["step"]["peak_bytes"]
        assert predicted <= measured <= predicted + gloo_copy, (predicted, measured, gloo_copy)
    autocast = P._extrapolated(spec, P.Step(2, 1, 16, "none", "bf16", shard=(2, reshard)), "full")[0]
    assert predicted < autocast


@pytest.mark.parametrize("precision, reduce, grad_sync", [("fp32", "fp32", "last"), (P.MIXED_POLICY, "fp32", "last"),
                                                         (P.MIXED_POLICY, "bf16", "last"),
                                                         (P.MIXED_POLICY, "bf16", "every")])
def test_gradient_sync_and_reduce_dtype_are_what_two_real_ranks_measure(precision, reduce, grad_sync, tmp_path):
    """FSDP2's set_requires_gradient_sync(False) before the first of two micro-batches, and MixedPrecisionPolicy's
    reduce_dtype: the fake step's peak against two gloo ranks running it (within gloo's copy of a group's fp32
    reduce-scatter input, as above) and its gradients at the peak to the byte. After the last micro-batch only, the
    whole unsharded gradients are held at the peak in the reduce dtype (4 B a parameter in fp32, 2 in bf16)."""
    import labkit.dist as ld
    from labkit.models import build_model

    script = tmp_path / "sync_ranks.py"
    script.write_text(FSDP2_RANKS)
    runs = ld.launch(script, 2, params={"config": repr(DEEP_LLAMA), "precision": precision, "rows": 4,
                                        "grad_sync": grad_sync, "reduce": reduce}, echo=False, device="cpu")
    spec = P.gpt_spec(DEEP_LLAMA)
    step = P.Step(2, 2, 16, "none", precision, shard=(2, True), grad_sync=grad_sync, reduce_dtype=reduce)
    predicted = P._extrapolated(spec, step, "full")
    every = P._extrapolated(spec, P.Step(2, 2, 16, "none", precision, shard=(2, True)), "full")
    model = build_model(DEEP_LLAMA)
    n = sum(p.numel() for p in model.parameters())
    in_blocks = {id(p) for p in model.blocks.parameters()}
    groups = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    groups.append(sum(p.numel() for p in model.parameters() if id(p) not in in_blocks))
    for r in runs:
        measured = r.meters["step"]["peak_bytes"]
        assert predicted[0] <= measured <= predicted[0] + max(groups) * 4, (predicted[0], measured)
        assert r.meters["step"]["peak_split"]["gradients"] == predicted[1]["gradients"]
    if grad_sync == "last":  # the whole gradients in the reduce dtype, none sharded yet
        assert predicted[1]["gradients"] == (4 if reduce == "fp32" else 2) * n
    if (grad_sync, reduce) == ("last", "fp32"):
        assert every[1]["gradients"] == 4 * n // 2 and predicted[0] - every[0] == 4 * n - 4 * n // 2


def test_a_plan_reduces_fsdp2s_gradients_after_the_last_micro_batch_when_asked(monkeypatch, capsys):
    """grad_sync="last": FSDP2 rows of two or more micro-batches hold the whole unsharded gradients (their fake step
    takes the fast depth exactly) and send one reduce-scatter a step instead of one a micro-batch; a row of one
    micro-batch, and every unsharded row, is the same row as by default; the title, the command and a bad value say so."""
    with monkeypatch.context() as m:
        m.setattr(P, "FULL_MAX_LAYERS", 3)  # take the fast path on a small model
        spec = P.gpt_spec(dataclasses.replace(DEEP_LLAMA, n_layer=SHARDED_DEEP))
        step = P.Step(2, 2, 16, "every", P.MIXED_POLICY, shard=(2, True), grad_sync="last")
        assert P._extrapolated(spec, step, "fast") == P._extrapolated(spec, step, "full") and _fitted(spec, step)
    kwargs = dict(checkpointing=("none",), offload=(False,), optimizers=("device",), micro_batches=[2, 4], workers=1)
    every, last = (P.plan(DEEP_LLAMA, "h100", 2, 16, 8, grad_syncs=(g,), **kwargs) for g in ("every", "last"))
    n, whole = every.n_params, 4 * every.n_params  # fp32 reduce-scatters, either precision
    rows = {(r.combination.parallel, r.combination.precision, r.combination.micro_batch): r for r in every.rows}
    for r in last.rows:
        c = r.combination
        e = rows[c.parallel, c.precision, c.micro_batch]
        if c.parallel.startswith("fsdp2") and c.accum_steps > 1:
            assert c.grad_sync == "last" and r.peak_bytes - e.peak_bytes == 4 * n - 4 * n // 2
            ring = (c.ranks - 1) / c.ranks
            assert r.comm_s == pytest.approx(e.comm_s - (c.accum_steps - 1) * ring * whole / h100_link(c.ranks))
        else:
            assert c.grad_sync == "every" and (r.peak_bytes, r.comm_s) == (e.peak_bytes, e.comm_s)
    assert any(r.combination.grad_sync == "last" for r in last.rows)
    assert "set_requires_gradient_sync" in P.format_plan(last) and "set_requires_gradient_sync" not in \
        P.format_plan(every)
    both = P.plan(DEEP_LLAMA, "h100", 2, 16, 8, grad_syncs=("every", "last"), **kwargs)  # a row each, where they differ
    assert sorted((r.combination for r in both.rows), key=repr) == sorted(
        {r.combination for r in every.rows + last.rows}, key=repr)
    assert "last, fp32" in P.format_plan(both, all_rows=True)
    with pytest.raises(ParameterError, match="grad_syncs"):
        P.plan(DEEP_LLAMA, "h100", 2, 16, 8, grad_syncs=("never",), **kwargs)
    with pytest.raises(ParameterError, match="grad_sync"):  # one process: no FSDP2 reduce-scatter to put off
        amp_train_step(build_model(DEEP_LLAMA), torch.optim.SGD(build_model(DEEP_LLAMA).parameters(), lr=0.1),
                       [example_batch(DEEP_LLAMA, 1, 16)], precision="fp32", grad_sync="last")
    assert _given_by_command(monkeypatch, every, "--grad-sync", "last", "grad_syncs") == [["last"], ["every"]]
    with pytest.raises(SystemExit):
        P.main(["--grad-sync", "never"])
    assert "grad-sync" in capsys.readouterr().err


def test_a_plan_reduce_scatters_mixed_precision_rows_in_bf16_when_asked(monkeypatch):
    """reduce_dtype="bf16": MixedPrecisionPolicy's rows send their reduce-scatters in half the bytes (fake steps of
    their own: the peak is the step's, checked against two ranks above); fp32 rows are the same rows; the title, the
    command and a bad value say so."""
    kwargs = dict(precisions=("fp32", P.MIXED_POLICY), checkpointing=("none",), offload=(False,), optimizers=("device",),
                  micro_batches=[2], parallels=("fsdp2", "fsdp2-reshard"), workers=1)
    fp32, bf16 = (P.plan(DEEP_LLAMA, "h100", 2, 16, 8, reduce_dtypes=(d,), **kwargs) for d in P.REDUCE_DTYPES)
    whole = 4 * fp32.n_params  # an fp32 reduce-scatter's bytes
    assert len(fp32.rows) == len(bf16.rows) == 4
    for a, b in zip(fp32.rows, bf16.rows):
        assert a.combination == dataclasses.replace(b.combination, reduce_dtype="fp32")
        c = b.combination
        if c.precision == P.MIXED_POLICY:
            ring = (c.ranks - 1) / c.ranks
            assert c.reduce_dtype == "bf16" and c.accum_steps == 2
            assert b.comm_s == pytest.approx(a.comm_s - c.accum_steps * ring * whole / 2 / h100_link(c.ranks))
        else:
            assert (c.reduce_dtype, b.peak_bytes, b.comm_s) == ("fp32", a.peak_bytes, a.comm_s)
    assert "every, bf16" in P.format_plan(bf16, all_rows=True) and "grads" not in P.format_plan(fp32, all_rows=True)
    with pytest.raises(ParameterError, match="reduce_dtypes"):
        P.plan(DEEP_LLAMA, "h100", 2, 16, 8, reduce_dtypes=("fp16",), **kwargs)
    assert _given_by_command(monkeypatch, fp32, "--reduce-dtype", "bf16", "reduce_dtypes") == [["bf16"], ["fp32"]]


def _given_by_command(monkeypatch, planned, flag: str, value: str, field: str) -> list:
    """Return what the command hands plan() as `field` with `flag value` and without the flag (plan() answers with
    `planned`)."""
    asked = []
    with monkeypatch.context() as m:
        m.setattr(P, "plan", lambda *a, **k: asked.append(k) or planned)
        m.setattr(P, "format_plan", lambda *a, **k: "")
        P.main(["--model", "llama-7b", "--gpus", "8", flag, value])
        P.main(["--model", "llama-7b", "--gpus", "8"])
    return [k[field] for k in asked]


def h100_link(ranks: int) -> float:
    """Return the H100 profile's ring bandwidth among `ranks` GPUs, bytes/s."""
    return device_profile("h100").link_bytes_per_s(ranks)


def test_mixed_policy_rows_at_the_fast_depth_and_in_the_plan(monkeypatch):
    """The policy's fake steps take the fast depth exactly; plan() gives them FSDP2 rows only, at the bf16 rate, and
    says why the other rows run autocast."""
    with monkeypatch.context() as m:
        m.setattr(P, "FULL_MAX_LAYERS", 3)  # take the fast path on a small model
        spec = P.gpt_spec(dataclasses.replace(DEEP_LLAMA, n_layer=SHARDED_DEEP))
        step = P.Step(2, 2, 16, "every", P.MIXED_POLICY, shard=(2, True))
        assert P._extrapolated(spec, step, "fast") == P._extrapolated(spec, step, "full") and _fitted(spec, step)
    p = P.plan(DEEP_LLAMA, "h100", 2, 16, 2, precisions=("fp32", "bf16", P.MIXED_POLICY), checkpointing=("none",),
               offload=(False,), workers=1)
    mixed = [r for r in p.rows if r.combination.precision == P.MIXED_POLICY]
    assert mixed and {r.combination.parallel for r in mixed} == {"fsdp2", "fsdp2-reshard"}
    bf16 = {(r.combination.parallel, r.combination.micro_batch): r for r in p.rows if r.combination.precision == "bf16"}
    assert all(r.peak_bytes < bf16[r.combination.parallel, r.combination.micro_batch].peak_bytes for r in mixed)
    assert f"{P.MIXED_POLICY} without fsdp2" in p.left_out and P.MIXED_POLICY in P.format_plan(p, all_rows=True)
    with pytest.raises(ParameterError, match="precision"):
        P.plan(DEEP_LLAMA, "h100", 2, 16, 2, precisions=("bf17",))


def test_logits_upcast_to_fp32_is_planned_as_measured():
    """GPTConfig.logits_fp32 (torchtitan's Llama upcasts its logits before the loss): under bf16 autocast the step
    holds fp32 logits where it held bf16 ones; the plan's rows against real steps under the meter, and never below the
    rows without the upcast."""
    ex = running_example(n_layer=2, batch_size=2, seq_len=16)
    up = types.SimpleNamespace(config=dataclasses.replace(ex.config, logits_fp32=True), batch_size=ex.batch_size,
                               seq_len=ex.seq_len, budget_bytes=ex.budget_bytes)
    kwargs = dict(reserve_fraction=0.0, precisions=("bf16",), checkpointing=("none", "every"), offload=(False,),
                  optimizers=("device",), workers=1)
    p = P.plan(up.config, cpu_profile(ex.budget_bytes), 1, ex.seq_len, ex.batch_size, **kwargs)
    assert p.model == "GPTConfig, fp32 logits"
    _check_against_the_meter([r for r in p.rows if r.combination.micro_batch == 2], up)
    plain = P.plan(ex.config, cpu_profile(ex.budget_bytes), 1, ex.seq_len, ex.batch_size, **kwargs)
    pairs = list(zip(p.rows, plain.rows))
    assert all(a.combination == b.combination and a.peak_bytes >= b.peak_bytes for a, b in pairs)
    assert any(a.peak_bytes > b.peak_bytes for a, b in pairs)  # where the loss's moment is the peak
    assert P.model_spec(dataclasses.replace(P.PRESETS["llama-7b"], logits_fp32=True)).name == "llama-7b, fp32 logits"


def test_the_command_plans_a_variant_of_a_gpu_by_its_memory(capsys):
    """--gpu-memory: --gpu's rates with the memory given (87.5 GiB of an h100's), said above the table; rows judged by
    that memory; a GPU outside the table, or a size not above 0, refused before any work."""
    args = ["--model", "gpt2", "--gpu", "h100", "--seq-len", "4", "--batch", "2", "--precision", "fp32", "--all"]
    assert P.main(args + ["--gpu-memory", "87.5"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("h100's rates and links with 87.50 GiB of memory each (--gpu-memory; the h100 profile's: "
                     "79.11 GiB)"), first
    plans = {}
    for memory in (None, "87.5", "1"):
        assert P.main(args + ["--json"] + ([] if memory is None else ["--gpu-memory", memory])) == 0
        plans[memory] = json.loads(capsys.readouterr().out)
    nvl, tiny = plans["87.5"], plans["1"]
    assert nvl["memory_bytes"] == 87.5 * 2**30 and tiny["memory_bytes"] == 2**30
    assert plans[None]["memory_bytes"] == GPUS["h100"].memory_bytes
    same = [(r["combination"], r["peak_bytes"], r["step_s"]) for r in plans[None]["rows"]]
    assert same == [(r["combination"], r["peak_bytes"], r["step_s"]) for r in nvl["rows"]]  # the h100's rates
    assert all(r["fits"] for r in nvl["rows"]) and not any(r["fits"] for r in tiny["rows"])  # 124 M x 16 B > 1 GiB
    for bad, says in ((["--gpu", "cpu", "--gpu-memory", "8"], "--gpu-memory: replaces the memory of a GPU of "
                                                               "labkit.gpus.GPUS"),
                      (["--gpu-memory", "0"], "--gpu-memory must be a size in GiB above 0 (e.g. 87.5), got 0")):
        with pytest.raises(SystemExit):
            P.main(bad)
        assert says in capsys.readouterr().err


def test_the_command_shares_its_fake_steps_with_a_worker():
    """`python -m labkit.planner.plan` with a worker process: the Steps it hands the worker unpickle there (they are
    labkit.planner.plan's, not __main__'s, which a worker does not have: make plan failed so once)."""
    import subprocess
    import sys

    env = {**os.environ, P.PLAN_WORKERS_ENV: "2"}
    out = subprocess.run([sys.executable, "-m", "labkit.planner", "--model", "gpt2", "--gpu", "a100-80gb", "--seq-len", "4",
                          "--batch", "2", "--precision", "fp32"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    groups = len(P._groups(P.model_spec("gpt2"), [P.Step(mb, 2 // mb, 4, c, "fp32", o) for mb in (1, 2)
                                                  for c in P.CHECKPOINTING for o in ((False, True) if c == "none"
                                                                                      else (False,))], "fast"))
    assert groups >= P.MIN_GROUPS_PER_WORKER * 2  # so that the plan did share them
    assert "10 run on fake tensors" in out.stdout and "fastest that fits:" in out.stdout


def test_logits_freed_before_backward_are_planned_as_measured(monkeypatch):
    """keep_logits=False (torchtitan's step deletes its logits before backward): rows against real steps under the
    meter, never above the rows that hold them and below where the logits were part of the peak; the fast depth
    exactly; the command's flag."""
    ex = running_example(n_layer=2, batch_size=2, seq_len=16)
    kwargs = dict(reserve_fraction=0.0, precisions=("fp32",), checkpointing=("none", "every"), offload=(False,),
                  optimizers=("device",), workers=1)
    freed = P.plan(ex.config, cpu_profile(ex.budget_bytes), 1, ex.seq_len, ex.batch_size, keep_logits=False, **kwargs)
    assert all(not r.combination.keep_logits for r in freed.rows)
    _check_against_the_meter(freed.rows, ex)
    held = P.plan(ex.config, cpu_profile(ex.budget_bytes), 1, ex.seq_len, ex.batch_size, **kwargs)
    pairs = list(zip(freed.rows, held.rows))
    assert all(a.peak_bytes <= b.peak_bytes for a, b in pairs) and any(a.peak_bytes < b.peak_bytes for a, b in pairs)
    assert "the logits freed before backward" in P.format_plan(freed) and "freed" not in P.format_plan(held)
    with monkeypatch.context() as m:
        m.setattr(P, "FULL_MAX_LAYERS", 3)  # take the fast path on a small model
        spec = P.gpt_spec(dataclasses.replace(DEEP_LLAMA, n_layer=4))
        step = P.Step(2, 2, 16, "every", "fp32", keep_logits=False)
        assert P._extrapolated(spec, step, "fast") == P._extrapolated(spec, step, "full") and _fitted(spec, step)


def test_parallels_limit_the_rows_and_the_fake_steps_to_those_named():
    kwargs = dict(gpu="h100", gpus=2, seq_len=16, batch=2, precisions=("fp32",), checkpointing=("none",),
                  offload=(False,), optimizers=("device",))
    whole = P.plan(SMALL, **kwargs)
    only = P.plan(SMALL, parallels=("fsdp2-reshard",), **kwargs)
    assert {r.combination.parallel for r in only.rows} == {"fsdp2-reshard"} and only.fake_steps < whole.fake_steps
    same = {(r.combination.micro_batch, r.peak_bytes) for r in whole.rows if r.combination.parallel == "fsdp2-reshard"}
    assert {(r.combination.micro_batch, r.peak_bytes) for r in only.rows} == same
    ddp = P.plan(SMALL, parallels=("ddp",), **kwargs)
    assert {(r.combination.parallel, r.combination.ranks) for r in ddp.rows} == {("ddp", 2)}
    for bad in ((), ("fsdp3",)):
        with pytest.raises(ParameterError, match="parallels"):
            P.plan(SMALL, parallels=bad, **kwargs)
    one = P.plan(SMALL, parallels=("fsdp2-reshard",), micro_batches=(1,), **kwargs)
    assert [(r.combination.micro_batch, r.peak_bytes) for r in one.rows] == [x for x in same if x[0] == 1]
    with pytest.raises(ParameterError, match="micro_batches: none of \\[2\\] divides"):
        P.plan(SMALL, parallels=("fsdp2-reshard",), micro_batches=(2,), **kwargs)
    with pytest.raises(ParameterError, match="parallels: none of \\('fsdp2',\\) runs on 1 GPU"):
        P.plan(SMALL, **{**kwargs, "gpus": 1}, parallels=("fsdp2",))


def test_communication_runs_at_the_network_beyond_a_server_and_bf16_mp_gathers_half_the_bytes():
    """comm_s: parameter-sized ring passes over the ring's link, by formula (the bytes and the rates written out);
    an FSDP2 row under MixedPrecisionPolicy gathers bf16 (2 B per parameter) and reduce-scatters fp32 (4 B)."""
    h100 = gpus.GPUS["h100"]
    assert h100.link_bytes_per_s(8) == 450e9 and h100.link_bytes_per_s(16) == 400 / 8 * 1e9  # NVLink, then NDR
    assert gpus.GPUS["t4"].link_bytes_per_s(4) == gpus.GPUS["t4"].peer_bytes_per_s > gpus.GPUS["t4"].link_bytes_per_s(8)
    p = P.Plan("m", "h100", 16, 16, 16, 10**6, 10**12, 0.0)
    n = 10**9
    work = (1e12, 1e12, 1e9, 0)

    def comm(ranks, parallel, precision):
        comb = P.Combination(ranks, parallel, 1, 1, "none", precision)
        return P._row(p, h100, "bf16", comb, 1, {}, work, 4 * n // ranks, 8 * n // ranks, 4 * n).comm_s
    assert comm(8, "ddp", "bf16") == pytest.approx(2 * 7 / 8 * 4 * n / 450e9)
    assert comm(16, "ddp", "bf16") == pytest.approx(2 * 15 / 16 * 4 * n / 50e9)
    assert comm(8, "fsdp2-reshard", "bf16") == pytest.approx(3 * 7 / 8 * 4 * n / 450e9)
    assert comm(8, "fsdp2-reshard", P.MIXED_POLICY) == pytest.approx((2 * 2 + 4) * 7 / 8 * n / 450e9)
    row = P._row(p, h100, "bf16", P.Combination(16, "fsdp2", 1, 1, "none", "bf16"), 1, {}, work, n, n, 4 * n)
    assert row.overlapped_s == max(row.compute_s, row.comm_s) < row.step_s == row.compute_s + row.comm_s


def test_pure_bf16_rows_match_the_meter_and_hold_half_the_states():
    """bf16-pure (torchtune's default: bf16 weights, gradients and Adam state, no autocast) against real steps under
    the meter, every checkpointing choice and Adam's implementations; its weights and Adam's state half fp32's."""
    ex = running_example(n_layer=2, batch_size=4, seq_len=32)
    kwargs = dict(reserve_fraction=0.0, offload=(False,), optimizers=("device",), checkpointing=P.CHECKPOINTING)
    p = P.plan(ex.config, cpu_profile(ex.budget_bytes), 1, ex.seq_len, ex.batch_size,
               precisions=(P.PURE_BF16, "fp32"), adam_impls=ADAM_IMPLS, **kwargs)
    pure = [r for r in p.rows if r.combination.precision == P.PURE_BF16]
    assert {(r.combination.checkpointing, r.combination.adam_impl) for r in pure} == {
        (c, a) for c in P.CHECKPOINTING for a in ADAM_IMPLS}
    _check_against_the_meter([r for r in pure if r.combination.micro_batch in (2, 4)], ex)
    fp32 = {dataclasses.replace(r.combination, precision=P.PURE_BF16): r for r in p.rows
            if r.combination.precision == "fp32"}
    with torch.device("meta"):
        tensors = len(list(GPT(ex.config).parameters()))
    for r in pure:
        twin = fp32[r.combination]
        assert 2 * r.split["parameters"] == twin.split["parameters"]
        # Adam's two moments in bf16, its step counter an fp32 scalar per parameter tensor either way
        assert 2 * r.split["optimizer_state"] - twin.split["optimizer_state"] == 4 * tensors


def test_pure_bf16_at_the_fast_depth_and_sharded_equals_a_full_depth_run(monkeypatch):
    monkeypatch.setattr(P, "FULL_MAX_LAYERS", 3)
    spec = P.gpt_spec(dataclasses.replace(DEEP_LLAMA, n_layer=SHARDED_DEEP))
    for step in (P.Step(3, 2, 16, "full", P.PURE_BF16, adam_impl="foreach"),
                 P.Step(3, 2, 16, "none", P.PURE_BF16, shard=(2, True), adam_impl="foreach")):
        assert P._extrapolated(spec, step, "fast") == P._extrapolated(spec, step, "full")


def test_fsdp2s_default_16_bits_are_its_mixed_precision_policy():
    """By default (torchtitan's) FSDP2's 16-bit rows are MixedPrecisionPolicy, the others' autocast; asked for, autocast
    runs under FSDP2 too; a GPU without bf16 keeps fp16 autocast everywhere."""
    cfg = dataclasses.replace(DEEP_LLAMA, n_layer=2)
    kwargs = dict(offload=(False,), optimizers=("device",), checkpointing=("none",), workers=1)
    p = P.plan(cfg, "a100-80gb", 2, 16, 2, **kwargs)
    by = {}
    for r in p.rows:
        by.setdefault(r.combination.parallel.startswith("fsdp2"), set()).add(r.combination.precision)
    assert by == {True: {"fp32", P.MIXED_POLICY}, False: {"fp32", "bf16", "fp16"}}
    assert "autocast (bf16) with fsdp2" in p.left_out and f"{P.MIXED_POLICY} without fsdp2" in p.left_out
    asked = P.plan(cfg, "a100-80gb", 2, 16, 2, precisions=("fp32", "bf16"), **kwargs)
    assert {r.combination.precision for r in asked.rows if r.combination.parallel == "fsdp2"} == {"fp32", "bf16"}
    assert "autocast (bf16) with fsdp2" not in asked.left_out
    t4 = P.plan(cfg, "t4", 2, 16, 2, **kwargs)
    assert {r.combination.precision for r in t4.rows if r.combination.parallel == "fsdp2"} == {"fp32", "fp16"}
    for gpus, parallels in ((1, ("single", "fsdp2")), (2, ("single", "ddp"))):  # no FSDP2 row: no policy to name
        alone = P.plan(cfg, "a100-80gb", gpus, 16, 2, parallels=parallels, **kwargs)
        assert P.MIXED_POLICY not in {r.combination.precision for r in alone.rows} and not {
            "autocast (bf16) with fsdp2", f"{P.MIXED_POLICY} without fsdp2"} & set(alone.left_out)


def test_a_gpu_plan_defaults_to_torchtitans_stack_and_a_cpu_plan_to_the_chapters(monkeypatch, capsys):
    # a GPU plan: fused Adam, torchtitan's full and op beside none and sqrt, SDPA as CUDA picks it (flash in 16 bits,
    # memory-efficient in fp32: the tensors it saves and the op-level list's names), not this CPU's flash kernel, and
    # a Llama preset in torchtitan's loop: its logits upcast to fp32 in the loss and freed before backward
    cfg = dataclasses.replace(DEEP_LLAMA, n_layer=2)
    monkeypatch.setitem(P.PRESETS, "tiny-llama", cfg)
    gpu = P.plan("tiny-llama", "h100", 1, 16, 2, precisions=("fp32", "bf16"), offload=(False,), optimizers=("device",))
    assert gpu.model == "tiny-llama, fp32 logits, flash attention"
    t4 = P.plan("tiny-llama", "t4", 1, 16, 2, precisions=("fp16",), checkpointing=("none",), offload=(False,),
                optimizers=("device",))  # before Ampere SDPA runs the memory-efficient kernel: flash does not run
    assert t4.model == "tiny-llama, fp32 logits, efficient attention"
    with pytest.raises(ParameterError, match="attention: CUDA's flash kernel runs on Ampere"):
        P.plan(dataclasses.replace(cfg, attn="flash"), "t4", 1, 16, 2, precisions=("fp16",))
    assert {r.combination.keep_logits for r in gpu.rows} == {False}
    assert {r.combination.adam_impl for r in gpu.rows} == {P.GPU_ADAM_IMPL} == {"fused"}
    assert {r.combination.checkpointing for r in gpu.rows} == set(P.GPU_CHECKPOINTING) == {"none", "full", "sqrt", "op"}
    flash = P.plan(dataclasses.replace(cfg, attn="flash", logits_fp32=True), "h100", 1, 16, 2, keep_logits=False,
                   precisions=("fp32", "bf16"), offload=(False,), optimizers=("device",))
    assert [(r.combination, r.peak_bytes, r.flops) for r in gpu.rows] == \
        [(r.combination, r.peak_bytes, r.flops) for r in flash.rows]
    cpu_kernel = P.plan(cfg, cpu_profile(1 << 40), 1, 16, 2, precisions=("bf16",), checkpointing=("op",),
                        offload=(False,), optimizers=("device",))
    op_flash = next(r for r in flash.rows if (r.combination.checkpointing, r.combination.precision) == ("op", "bf16"))
    assert cpu_kernel.rows[0].flops > op_flash.flops  # the CPU's kernel is not on op-level's list: recomputed
    # a CPU plan: the chapters' for-loop Adam and checkpointing choices, the model as written
    cpu = P.plan("tiny-llama", cpu_profile(1 << 40), 1, 16, 2, precisions=("fp32",), offload=(False,),
                 optimizers=("device",))
    assert {r.combination.keep_logits for r in cpu.rows} == {True}
    assert cpu.model == "tiny-llama" and {r.combination.adam_impl for r in cpu.rows} == {"for-loop"}
    assert {r.combination.checkpointing for r in cpu.rows} == set(P.PLAN_CHECKPOINTING)
    # a GPT-2 preset on a GPU runs nanoGPT's loop (logits held, as computed); the command's flags set either way
    assert {r.combination.keep_logits for r in P.plan(SMALL, "h100", 1, 16, 2, checkpointing=("none",)).rows} == {True}
    monkeypatch.setitem(P.PRESETS, "tiny-llama", dataclasses.replace(cfg, n_layer=1))
    monkeypatch.setenv(P.PLAN_WORKERS_ENV, "1")
    P.main(["--model", "tiny-llama", "--gpu", "h100", "--seq-len", "16", "--batch", "2", "--checkpointing", "none",
            "--precision", "bf16", "--no-logits-fp32", "--no-free-logits", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "tiny-llama, flash attention" and {r["combination"]["keep_logits"] for r in out["rows"]} == {True}


def test_the_fastest_row_is_also_given_at_a_published_runs_share_of_peak():
    p = P.plan(SMALL, "h100", 2, 16, 4, checkpointing=("none",), precisions=("bf16",), parallels=("ddp",),
               offload=(False,), optimizers=("device",))
    best, eff = p.fastest, GPUS["h100"].efficiency
    own_s = best.compute_s / eff.fraction
    line = next(line for line in P.format_plan(p).splitlines() if line.startswith("at a published run's share"))
    assert f"({eff.fraction:.1%}, FMS-7B-H100-noAC-eager" in line
    tokens_per_s = p.batch * p.seq_len / (own_s + best.comm_s)
    assert f"{(own_s + best.comm_s) * 1e3:,.0f} ms/step, {tokens_per_s:,.0f} tokens/s ({tokens_per_s / 2:,.0f} per GPU" \
        in line
    assert f"hidden {max(own_s, best.comm_s) * 1e3:,.0f} ms" in line
    assert own_s > best.compute_s  # the estimate is slower than the bound
    cpu = P.plan(SMALL, cpu_profile(1 << 40), 1, 16, 2, checkpointing=("none",), precisions=("fp32",))
    assert "at a published run's share" not in P.format_plan(cpu)  # no published share for a CPU


def test_fsdp2_rows_judged_by_the_reserve_alone_say_what_published_runs_kept():
    from labkit.planner import runs
    from labkit.planner.overheads import non_tensor_bytes
    gaps = runs.fsdp2_gaps()
    widest = max(g for gs in gaps.values() for g in gs)
    assert 0.10 < widest < 0.5 and set(gaps) == {"h100"}  # the published FSDP2 runs with both peaks: H100s
    kwargs = dict(checkpointing=("none",), parallels=("fsdp2",), offload=(False,), optimizers=("device",))
    p = P.plan(dataclasses.replace(SMALL, n_layer=2), "h100", 2, 16, 2, **kwargs)
    line = next(line for line in P.format_plan(p).splitlines() if line.startswith("fits, FSDP2 rows"))
    table = P.format_plan(p).splitlines()  # several ranks: a column of the step with the communication hidden
    header = next(t for t in table if t.split()[:2] == ["#", "ranks"])
    hidden = header.split().index("hidden") - 1  # ("step (ms)" and "comm (ms)" before it: two words each)
    first = table[table.index(header) + 1].split()
    assert first[hidden] == f"{p.pareto[0].overlapped_s * 1e3:,.2f}"
    assert first[hidden - 1] == f"{p.pareto[0].comm_s * 1e3:,.2f}"
    assert p.pareto[0].comm_s > 0 and p.pareto[0].overlapped_s < p.pareto[0].step_s  # (this small model: 0.00 ms each)
    single = P.plan(dataclasses.replace(SMALL, n_layer=2), "h100", 1, 16, 2, checkpointing=("none",))
    assert "hidden (ms)" not in P.format_plan(single)  # nothing sent between GPUs: no such column
    h100_gib = GPUS["h100"].memory_bytes / 2**30  # (79.1: what torch reports on an 80 GB H100)
    assert " and ".join(f"{g * h100_gib:.1f} GiB ({g:.1%} of the h100 profile's {h100_gib:.1f} GiB)"
                        for g in gaps["h100"]) in line
    outside_b = non_tensor_bytes("h100", 2, "fsdp2-reshard").total[1]  # the CUDA context and NCCL's buffers, high end
    need = widest + outside_b / GPUS["h100"].memory_bytes  # as chapter 09's Appendix C adds them
    assert f"on the h100's {h100_gib:.1f} GiB, plan FSDP2 with --reserve {math.ceil(need * 100) / 100} or more (that " \
           f"gap with the CUDA context and NCCL's buffers, {outside_b / 2**30:.2f} GiB at most" in line
    t4 = P.plan(dataclasses.replace(SMALL, n_layer=2), "t4", 2, 16, 2, **kwargs)  # the same bytes of a smaller GPU
    line = next(line for line in P.format_plan(t4).splitlines() if line.startswith("fits, FSDP2 rows"))
    share = widest * GPUS["h100"].memory_bytes / GPUS["t4"].memory_bytes  # (NCCL not modelled between PCIe GPUs)
    assert f"on the t4's {GPUS['t4'].memory_bytes / 2**30:.1f} GiB, plan FSDP2 with --reserve " \
           f"{math.ceil(share * 100) / 100} or more (that gap alone; the CUDA context and NCCL's buffers come on " \
           "top" in line
    tight = P.plan(dataclasses.replace(SMALL, n_layer=2), "h100", 2, 16, 2, reserve_fraction=widest + 0.001, **kwargs)
    assert "fits, FSDP2 rows" in P.format_plan(tight)  # the published gap alone covered: the context and NCCL not
    roomy = P.plan(dataclasses.replace(SMALL, n_layer=2), "h100", 2, 16, 2, reserve_fraction=need + 0.001, **kwargs)
    assert "fits, FSDP2 rows" not in P.format_plan(roomy)  # a reserve above both: nothing to say
    ddp = P.plan(dataclasses.replace(SMALL, n_layer=2), "h100", 2, 16, 2, checkpointing=("none",), parallels=("ddp",))
    assert "fits, FSDP2 rows" not in P.format_plan(ddp)
