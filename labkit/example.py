"""The running example: the model and the memory budget it does not fit, shared by notebooks 00–05."""

from __future__ import annotations

from dataclasses import dataclass, replace

from labkit.estimate import estimate_training_memory
from labkit.models import GPTConfig

BUDGET_FRACTION = 0.75  # the budget's share of the plain fp32 Adam step's peak, rounded down to a MiB (tiny: a KiB)


@dataclass(frozen=True)
class RunningExample:
    """A GPT, a batch and a budget that the plain training step exceeds."""

    config: GPTConfig  # the model
    batch_size: int  # samples per optimizer step
    seq_len: int  # tokens per sample
    budget_bytes: int  # the simulated device's memory
    baseline_peak_bytes: int  # the plain step's peak (fake-tensor estimate; equals the meter's count)


def running_example(n_layer: int = 4, n_embd: int = 128, n_head: int = 4, batch_size: int = 16,
                    seq_len: int = 64, vocab_size: int = 256) -> RunningExample:
    """Return the running example; the budget is BUDGET_FRACTION of its plain Adam step's peak."""
    cfg = replace(GPTConfig(), n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                  block_size=max(seq_len, 1), vocab_size=vocab_size)
    peak = estimate_training_memory(cfg, batch_size, seq_len, optimizer="adam").peak_bytes
    unit = 2**20 if BUDGET_FRACTION * peak >= 4 * 2**20 else 2**10
    budget = int(BUDGET_FRACTION * peak) // unit * unit
    if not 0 < budget < peak:  # a peak under one KiB leaves nothing to budget
        raise ValueError(f"the running example's peak ({peak} B) is too small for a budget in whole KiB below it")
    return RunningExample(cfg, batch_size, seq_len, budget, peak)
