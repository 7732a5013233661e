"""labkit.planner.published: the planner's figures beside published runs', each within the issue's targets."""

from __future__ import annotations

import pytest

from labkit.planner import published

pytestmark = pytest.mark.usefixtures("one_thread")


def test_an_error_is_to_the_nearer_end_of_a_published_range():
    check = published.Check("r", "tokens/s per GPU", (100, 120), 130.0, "")
    assert check.error == pytest.approx(130 / 120 - 1) and check.within
    assert published.Check("r", "tokens/s per GPU", (100, 120), 110.0, "").error == 0.0
    assert published.Check("r", "peak active", (10, 10), 9.0, "").error == pytest.approx(-0.1)
    assert published.Check("r", "peak active", (10, 10), 9.0, "").within is False  # 10% off: the target is 5%
    assert published.Check("r", "peak reserved", (10, 10), None, "not modelled").within is None


def test_a_figure_without_a_prediction_says_why_in_the_target_column():
    source = published.Check("FMS-r", "tokens/s per GPU", (3700, 3700), None,
                             "the a100's fraction of peak (0.559) is taken from this run: not a check")
    reserved = published.Check("TT-r", "peak reserved", (31.0, 31.0), None, "not modelled: the allocator's cache")
    no_eff = published.Check("T4-r", "tokens/s per GPU", (900, 900), None, "no published fraction of peak for the t4")
    checked = published.Check("TT-r", "peak active", (22.7, 22.7), 22.5, "the plan's row")
    assert [published.not_a_check(c) for c in (source, reserved, no_eff)] == ["source", "not modelled", "no fraction"]
    table = published.format_validation([source, reserved, checked]).splitlines()
    assert table[2].endswith("  source") and table[3].endswith("  not modelled") and table[4].endswith("±5% yes")
    assert published.NOT_A_CHECK["source"] in table[-1] and published.NOT_A_CHECK["not modelled"] in table[-1]
    assert published.NOT_A_CHECK["no fraction"] not in table[-1]  # the footer explains only the marks shown
    assert "not a check" not in published.format_validation([checked]).splitlines()[-1]
    estimate = published.Check("FMS-7B-H100-noAC-eager", "tokens/s per GPU", (7500, 7500), 7600.0, "from FMS-7B-A100")
    row = published.format_validation([estimate]).splitlines()[2]
    assert " 96 FSDP1 (HSDP) " in row and row.endswith("±25% yes (estimate)")  # the run's GPUs and parallelism,
    #                                                                            as published: no plan name
    tt = published.Check("TT-165-FSDP2-AC-eager", "peak active", (22.7, 22.7), 22.5, "its step")
    planned = published.format_validation([tt]).splitlines()
    assert " 8 fsdp2-reshard " in planned[2], planned  # a planned run: the plan's name for what it ran (resharding)
    assert planned[-1].startswith("GPUs, parallel: a planned run's by the plan's names"), planned[-1]


def test_a_memory_check_on_gpus_larger_than_their_profile_says_so_under_the_table():
    larger = published.Check("TT-L31-8B-FSDP2-SAC-eager", "peak reserved", (82.4, 82.4), 78.9, "its replay")
    footer = published.format_validation([larger]).splitlines()[-1]
    assert ("TT-L31-8B-FSDP2-SAC-eager: their h100s held 95.0 GiB (TT-L31-8B-FSDP2-SAC-eager: assumed, not published "
            "for it), more than the h100 profile's 79.1 GiB") in footer  # the benchmark says 96 GB: the GiB assumed
    measured = published.Check("TT-165-FSDP2-AC-eager", "peak active", (22.7, 22.7), 22.5, "its step")
    assert "assumed" not in published.format_validation([measured]).splitlines()[-1]  # PR #165 printed its GiB
    fms = published.Check("FMS-7B-H100-noAC-eager", "tokens/s per GPU", (7500, 7500), 7600.0, "from FMS-7B-A100")
    assert "more than the" not in published.format_validation([fms]).splitlines()[-1]  # a speed check: no clause


def test_a_grouped_query_attention_run_is_built_with_its_key_value_heads():
    run = dict(published.published_runs()[0], id="gqa")
    run["model"] = dict(run["model"], kv_heads=8)
    cfg = published.run_config(run)
    assert (cfg.n_head, cfg.n_kv_head, cfg.kv_width) == (32, 8, 1024)
    assert published.run_config(published.published_runs()[0]).n_kv_head is None  # as many as heads: multi-head


def test_a_runs_flops_count_its_checkpointings_recomputation_with_or_without_the_plans_arguments():
    """flops_per_token reads the plan's checkpointing, else the run's own description (Llama 3.1 8B: op level)."""
    runs = {r["id"]: r for r in published.published_runs()}
    for run in runs.values():
        if "plan" in run:
            assert published._checkpointing(run) == run["plan"]["checkpointing"]
    assert published._checkpointing(runs["TT-L31-8B-FSDP2-SAC-eager"]) == "op"
    assert published._checkpointing(runs["FMS-7B-H100-noAC-eager"]) == "none"
    with pytest.raises(ValueError, match="every 2nd layer"):
        published._checkpointing(dict(runs["FMS-7B-H100-noAC-eager"], checkpointing="every 2nd layer"))


def test_op_level_flops_recompute_every_second_matmul_and_keep_the_attention_as_on_the_runs_gpu():
    """A small Llama run (the 8B's grouped-query layout, 3 blocks) counted as torchtitan's op-level policy runs it on an
    H100: per token, op level adds the forward of every second matmul of a block (wk, wo, w3) over no checkpointing,
    and no attention: CUDA's flash output is kept (this CPU's flash kernel, not in the save list, would add 4 T C)."""
    run = {r["id"]: r for r in published.published_runs()}["TT-L31-8B-FSDP2-SAC-eager"]
    C, T, kv, F, L = 64, 16, 32, 160, 3  # width, tokens, key/value width (2 of 4 heads), SwiGLU hidden, blocks
    small = dict(run, seq_len=T, model=dict(run["model"], layers=L, hidden=C, heads=4, kv_heads=2, ffn_hidden=F,
                                            vocab=128))
    per_token = {kind: published.flops_per_token(dict(small, plan=dict(run["plan"], checkpointing=kind)))
                 for kind in ("none", "op")}
    assert per_token["op"] - per_token["none"] == L * (2 * C * kv + 2 * C * C + 2 * C * F)


def test_every_published_figure_the_planner_models_is_within_its_target():
    """The 7B FSDP2 runs' peak active memory from the plan's step at full depth (what its fast depth gives: below), the
    reserved peak from that step's allocations replayed through the caching allocator's rules, tokens/s from a
    fraction of peak taken from another run; each run a fraction comes from is marked, not counted as a check."""
    checks = published.validation()
    print(published.format_validation(checks))
    by = {(c.run, c.figure): c for c in checks}
    active = by["TT-165-FSDP2-AC-eager", "peak active"]
    assert active.published == (22.73, 22.73) and abs(active.error) <= 0.05
    assert "8 × fsdp2-reshard, micro-batch 8 × 1, flash attention, full checkpointing, bf16-mp, foreach Adam" in active.basis
    sac = by["TT-165-FSDP2-SAC-eager", "peak active"]  # torchtitan's op-level selective checkpointing
    assert sac.published == (49.54, 49.54) and abs(sac.error) <= 0.05 and ", op checkpointing," in sac.basis
    for run in ("TT-165-FSDP2-AC-eager", "TT-165-FSDP2-SAC-eager"):  # FSDP2's streams each a pool of the replay
        reserved = by[run, "peak reserved"]
        assert abs(reserved.error) <= 0.10 and "a pool of its own" in reserved.basis
        assert reserved.predicted > by[run, "peak active"].predicted
    l3 = by["TT-L31-8B-FSDP2-SAC-eager", "peak reserved"]  # Llama 3.1 8B (grouped-query attention), replayed under
    assert l3.published == (82.4, 82.4) and abs(l3.error) <= 0.10  # expandable segments, as torchtitan's launcher set
    assert "rules with expandable_segments:True" in l3.basis and "8 × fsdp2-reshard, micro-batch 2 × 1" in l3.basis
    assert "logits freed before backward" in l3.basis and "nightly 1963fc8" in l3.basis
    for run in ("TT-165-FSDP2-AC-eager", "TT-165-FSDP2-SAC-eager"):  # (no launcher setting: the default rules)
        assert "default rules" in by[run, "peak reserved"].basis and "March 2024" in by[run, "peak reserved"].basis
    assert ("TT-L31-8B-FSDP2-SAC-eager", "peak active") not in by  # (the benchmark prints the reserved peak only)
    checked = [c for c in checks if c.predicted is not None]
    assert {c.figure for c in checked} == {"peak active", "peak reserved", "tokens/s per GPU"} and len(checked) == 9
    assert all(c.within for c in checked), published.format_validation(checks)
    for run in ("TT-165-FSDP2-AC-eager", "TT-L31-8B-FSDP2-SAC-eager"):  # 95 GiB H100s, priced as the 80 GB SXM
        tt = by[run, "tokens/s per GPU"]
        assert "the run's GPUs hold 95 GiB, another model than the h100 profile's 79.1 GiB" in tt.basis
    assert "another model" not in by["TT-A100-L2-13B-noAC-eager", "tokens/s per GPU"].basis
    sources = [c for c in checks if "taken from this run" in c.basis]
    assert {c.run for c in sources} == {"FMS-7B-A100-noAC-eager", "FMS-7B-H100-noAC-eager"}
    for c in checked:
        if c.figure == "tokens/s per GPU":  # never checked on the run its fraction came from
            assert c.run not in {s.run for s in sources} and "from FMS-7B-" in c.basis


def test_the_plans_fast_depth_gives_the_validated_peak():
    # the validation runs the step at full depth; `make plan` and chapter 09's rows reach it by arithmetic
    from dataclasses import replace

    from labkit.planner.plan import PRESETS, plan
    run = next(r for r in published.published_runs() if r["id"] == "TT-165-FSDP2-AC-eager")
    a = run["plan"]
    model = replace(PRESETS[a["model"]], logits_fp32=a["logits_fp32"], attn=a["attention"])
    p = plan(model, a["gpu"], a["gpus"], a["seq_len"], a["batch"], precisions=(a["precision"],),
             checkpointing=(a["checkpointing"],), offload=(False,), optimizers=("device",), adam_impls=(a["adam_impl"],),
             keep_logits=a["keep_logits"], parallels=(a["parallel"],), micro_batches=(a["micro_batch"],), workers=1)
    (row,) = p.rows
    check = next(c for c in published.memory_checks([run]) if c.figure == "peak active")
    assert row.peak_bytes / published.GiB == check.predicted


def test_every_runs_step_replays_in_one_call(monkeypatch):
    """The runs' steps (two models: TT-165's Llama 2 shape twice, Llama 3.1 8B) go to `replayed` together, so that
    the plan's workers share them; each check gets its own run's figures, the reserved peak by its allocator's rules."""
    from labkit.planner import plan as P
    calls = []

    def fake_replayed(runs):
        calls.append([(m.n_kv_head, c.checkpointing, seq_len) for m, c, seq_len in runs])
        return [(i * 2**30, (i + 10) * 2**30, 0, (i + 20) * 2**30) for i, _ in enumerate(runs, 1)]
    monkeypatch.setattr(P, "replayed", fake_replayed)
    runs = [r for r in published.published_runs() if "plan" in r and "memory" in r]
    checks = published.memory_checks(runs)
    assert calls == [[(None, "full", 2048), (None, "op", 2048), (8, "op", 8192)]]
    by = {(c.run, c.figure): c.predicted for c in checks}
    assert by["TT-165-FSDP2-AC-eager", "peak active"] == 1 and by["TT-165-FSDP2-SAC-eager", "peak reserved"] == 12
    assert by["TT-L31-8B-FSDP2-SAC-eager", "peak reserved"] == 23  # (expandable segments' figure)
