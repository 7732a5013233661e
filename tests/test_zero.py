"""labkit.techniques.zero: ZeRO's per-rank formulas, its communication volumes, and DeepSpeed configs that DeepSpeed accepts."""

from __future__ import annotations

import pytest

from labkit.techniques import zero
from labkit.validate import ParameterError


def _total(stage, n, **kinds):
    return sum(zero.model_state_bytes_per_param(stage, n, **kinds).values())


@pytest.mark.parametrize("stage, want", [(0, (4, 4, 8)), (1, (4, 4, 2)), (2, (4, 1, 2)), (3, (1, 1, 2))])
def test_fp32_adam_per_rank_on_four_ranks(stage, want):
    got = zero.model_state_bytes_per_param(stage, 4)
    assert (got["parameters"], got["gradients"], got["optimizer_state"]) == want


def test_the_papers_figure_1():
    """7.5B parameters of mixed-precision Adam on 64 ranks: 120, 31.4, 16.6, 1.9 GB (Rajbhandari et al., Fig. 1)."""
    gb = {s: round(7.5e9 * _total(s, 64, **zero.MIXED_ADAM) / 1e9, 1) for s in zero.STAGES}
    assert gb == {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


def test_one_rank_keeps_everything_and_stages_only_shrink():
    for s in zero.STAGES:
        assert _total(s, 1) == 16
    for n in (2, 8, 512):
        totals = [_total(s, n) for s in zero.STAGES]
        assert totals == sorted(totals, reverse=True) and totals[0] == 16
        assert _total(3, n) == pytest.approx(16 / n)


def test_communication_and_ring_factor():
    assert [zero.comm_elements_per_param(s) for s in zero.STAGES] == [2, 2, 2, 3]
    assert zero.ring_factor(1) == 0 and zero.ring_factor(4) == 0.75


@pytest.mark.parametrize("call, name", [
    (lambda: zero.model_state_bytes_per_param(4, 2), "stage"),
    (lambda: zero.model_state_bytes_per_param(1, 0), "world_size"),
    (lambda: zero.ring_factor(0), "world_size"),
    (lambda: zero.deepspeed_config(2, 0), "micro_batch"),
    (lambda: zero.deepspeed_config(2, 4, precision="fp8"), "precision"),
    (lambda: zero.deepspeed_config(3, 4, param_persistence_threshold=-1), "param_persistence_threshold"),
])
def test_bad_input_names_the_parameter(call, name):
    with pytest.raises((ParameterError, ValueError), match=name):
        call()


def test_offload_needs_a_stage_that_shards_it():
    with pytest.raises(ValueError, match="offload_params needs stage 3"):
        zero.deepspeed_config(2, 4, offload_params=True)
    with pytest.raises(ValueError, match="offload_optimizer needs a ZeRO stage"):
        zero.deepspeed_config(0, 4, offload_optimizer=True)


def test_config_batch_arithmetic_and_sections():
    cfg = zero.deepspeed_config(3, 4, world_size=8, precision="bf16", offload_optimizer=True,
                                offload_params=True, activation_checkpointing=True)
    assert cfg["train_batch_size"] == 4 * 8
    assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                        "offload_param": {"device": "cpu", "pin_memory": True}}
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert "gradient_checkpointing" not in cfg and "activation_checkpointing" in cfg
    assert "activation_checkpointing" not in zero.deepspeed_config(1, 4)


def test_persistence_threshold_is_written_for_stage_3_only():
    """0 shards every tensor; None leaves DeepSpeed's default (tensors of up to 1e5 elements kept whole)."""
    cfg = zero.deepspeed_config(3, 4, param_persistence_threshold=0)
    assert cfg["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0}
    assert "stage3_param_persistence_threshold" not in zero.deepspeed_config(3, 4)["zero_optimization"]
    with pytest.raises(ValueError, match="param_persistence_threshold needs stage 3"):
        zero.deepspeed_config(2, 4, param_persistence_threshold=0)


SETTINGS = [dict(stage=s, micro_batch=8) for s in zero.STAGES] + [
    dict(stage=3, micro_batch=8, precision="bf16", offload_optimizer=True, offload_params=True,
         activation_checkpointing=True),
    dict(stage=2, micro_batch=2, precision="fp16", offload_optimizer=True),
    dict(stage=3, micro_batch=8, param_persistence_threshold=0),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_deepspeed_accepts_every_generated_config(settings):
    """DeepSpeed's own config parser reads each config back to the same settings (one process: world size 1)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (make setup installs it)")
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = zero.deepspeed_config(**settings)
    parsed = DeepSpeedConfig(cfg)  # checks the batch arithmetic and every section's keys and values
    assert parsed.zero_optimization_stage == settings["stage"]
    assert parsed.train_micro_batch_size_per_gpu == settings["micro_batch"]
    assert parsed.gradient_accumulation_steps == 1
    assert parsed.bfloat16_config.enabled == (settings.get("precision") == "bf16")
    assert parsed.float16_config.enabled == (settings.get("precision") == "fp16")
    offload = parsed.zero_config.offload_optimizer
    assert (offload is not None and offload.device == "cpu") == settings.get("offload_optimizer", False)
    offload = parsed.zero_config.offload_param
    assert (offload is not None and offload.device == "cpu") == settings.get("offload_params", False)
    if "param_persistence_threshold" in settings:
        assert parsed.zero_config.param_persistence_threshold == settings["param_persistence_threshold"]
    else:  # DeepSpeed's default: every tensor of up to 1e5 elements kept whole on every rank
        assert parsed.zero_config.param_persistence_threshold == 100_000


def test_deepspeed_sections_refuse_unknown_keys_but_the_top_level_does_not():
    """The seeds' `"gradient_checkpointing": true` is refused inside a section and silently ignored at the top."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (make setup installs it)")
    from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    cfg = zero.deepspeed_config(3, 8, world_size=2, precision="bf16", offload_optimizer=True, offload_params=True,
                                activation_checkpointing=True)
    DeepSpeedZeroConfig(**cfg["zero_optimization"])  # the multi-rank config's sections, checked one by one
    DeepSpeedBF16Config(**cfg["bf16"])
    assert set(cfg["activation_checkpointing"]) <= set(ACT_CHKPT_DEFAULT)
    with pytest.raises(Exception, match="(?i)extra"):
        DeepSpeedZeroConfig(stage=3, gradient_checkpointing=True)
    ignored = DeepSpeedConfig(zero.deepspeed_config(3, 8) | {"gradient_checkpointing": True})
    assert ignored.zero_optimization_stage == 3  # accepted: the key does nothing, and nothing says so


def test_cheapest_fit_takes_the_fitting_point_that_sends_least_and_pays_nothing_else():
    peaks = {"DDP": 30, "no-reshard": 25, "ZeRO-3": 20, "ZeRO-3 bf16": 12, "ZeRO-3 + checkpointing": 11}
    sent = {"DDP": 2, "no-reshard": 2, "ZeRO-3": 3, "ZeRO-3 bf16": 2, "ZeRO-3 + checkpointing": 3}
    costs = {"ZeRO-3 bf16": "precision", "ZeRO-3 + checkpointing": "recomputation"}
    assert zero.cheapest_fit(peaks, sent, 32, costs) == (list(peaks), "no-reshard")  # equal bytes: the lower peak
    assert zero.cheapest_fit(peaks, sent, 32, {})[1] == "ZeRO-3 bf16"
    even = {**peaks, "no-reshard": 30}  # equal bytes and peaks: the shorter step, else the first listed
    assert zero.cheapest_fit(even, sent, 32, costs)[1] == "DDP"
    assert zero.cheapest_fit(even, sent, 32, costs, step_s={"DDP": 2.0, "no-reshard": 1.0})[1] == "no-reshard"
    assert zero.cheapest_fit(even, sent, 32, costs, step_s={"no-reshard": 1.0})[1] == "no-reshard"  # none: last
    assert zero.cheapest_fit(peaks, sent, 22, costs)[1] == "ZeRO-3"  # sends more, but pays nothing else
    assert zero.cheapest_fit(peaks, sent, 15, costs) == (["ZeRO-3 bf16", "ZeRO-3 + checkpointing"], "ZeRO-3 bf16")
    assert zero.cheapest_fit(peaks, {**sent, "ZeRO-3 bf16": 4}, 15, costs)[1] == "ZeRO-3 + checkpointing"
    assert zero.cheapest_fit(peaks, sent, 10, {}) == ([], None)
    with pytest.raises(ValueError, match="sent_bytes"):
        zero.cheapest_fit(peaks, {"DDP": 2}, 32, {})
    with pytest.raises(ValueError, match="budget_bytes"):
        zero.cheapest_fit(peaks, sent, None, {})


def test_describe_fit_follows_the_numbers_not_their_order():
    """The use-when sentence of chapter 07 changes when the measured figures change places."""
    MiB = 2**20
    peaks = {"A": 12 * MiB, "B": 11 * MiB, "C": 30 * MiB}
    sent = {"A": 2 * MiB, "B": 3 * MiB, "C": 2 * MiB}
    said = zero.describe_fit(peaks, sent, 16 * MiB, costs={"A": "precision"})
    assert said == ("2 of 3 points fit 16.00 MiB; of those that pay nothing besides bytes, B sends the fewest "
                    "(3.00 MiB per step, peak 11.00 MiB); also fits: A (pays in precision)")
    both = zero.describe_fit(peaks, sent, 16 * MiB, costs={"A": "precision", "B": "recomputation"})
    assert both.startswith("2 of 3 points fit 16.00 MiB; each paying something besides bytes; A (pays in precision) "
                           "sends the fewest (2.00 MiB per step")
    swapped = zero.describe_fit(peaks, {**sent, "A": 3 * MiB, "B": 2 * MiB}, 16 * MiB,
                                costs={"A": "precision", "B": "recomputation"})
    assert "B (pays in recomputation) sends the fewest (2.00 MiB per step" in swapped and swapped != both
    start = "3 of 3 points fit 40.00 MiB; of those that pay nothing besides bytes, "
    said = zero.describe_fit(peaks, sent, 40 * MiB, {})  # A and C send as much: A's lower peak tells them apart
    assert said.startswith(start + "A sends the fewest (2.00 MiB per step, peak 12.00 MiB), as C does; it has a lower "
                           "peak than C's; also fits: B")
    assert zero.describe_fit({**peaks, "A": 31 * MiB}, sent, 40 * MiB, {}).startswith(start + "C sends the fewest")
    same = {**peaks, "C": 12 * MiB}  # the same bytes and peak: the step, else a tie said as one
    assert zero.describe_fit(same, sent, 40 * MiB, {}).startswith(
        start + "A sends the fewest (2.00 MiB per step, peak 12.00 MiB), as C does; a tie with C in peak too: the first "
        "listed; also fit")
    faster = zero.describe_fit(same, sent, 40 * MiB, {}, step_s={"A": 2.0, "C": 1.0}, step_label="step on the t4")
    assert faster.startswith(start + "C sends the fewest (2.00 MiB per step, peak 12.00 MiB), as A does; it has a step "
                             "on the t4 ×0.50 of A's; also fit")
    assert "a tie with C in peak and step too" in zero.describe_fit(same, sent, 40 * MiB, {},
                                                                     step_s={"A": 1.0, "C": 1.005})  # within STEP_TIE
    assert zero.describe_fit(peaks, sent, 10 * MiB, {}) == ("no point fits 10.00 MiB: the lowest peak, B's 11.00 MiB, "
                                                        "is 1.00 MiB over")
