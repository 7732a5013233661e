"""The running example: the model and the memory budget it does not fit, shared by notebooks 00–05."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from labkit.estimate import estimate_training_memory
from labkit.models import GPTConfig
from labkit.validate import check_int

BUDGET_FRACTION = 0.75  # the budget's share of the plain fp32 Adam step's peak, rounded down to a MiB (tiny: a KiB)


@dataclass(frozen=True)
class RunningExample:
    """A GPT, a batch and a budget that the plain training step exceeds (peak and budget: counted on first use)."""

    config: GPTConfig  # the model
    batch_size: int  # samples per optimizer step
    seq_len: int  # tokens per sample

    @functools.cached_property
    def baseline_peak_bytes(self) -> int:
        """Return the plain fp32 Adam step's peak (a fake-tensor estimate; equals the meter's count)."""
        return estimate_training_memory(self.config, self.batch_size, self.seq_len, optimizer="adam").peak_bytes

    @functools.cached_property
    def budget_bytes(self) -> int:
        """Return the simulated device's memory: BUDGET_FRACTION of the plain step's peak, in whole MiB (tiny: KiB)."""
        peak = self.baseline_peak_bytes
        unit = 2**20 if BUDGET_FRACTION * peak >= 4 * 2**20 else 2**10
        budget = int(BUDGET_FRACTION * peak) // unit * unit
        if not 0 < budget < peak:  # a peak under one KiB leaves nothing to budget
            raise ValueError(f"the running example's peak ({peak} B) is too small for a budget in whole KiB below it")
        return budget


def running_example(n_layer: int = 4, n_embd: int = 128, n_head: int = 4, batch_size: int = 16,
                    seq_len: int = 64, vocab_size: int = 256, budget_bytes: int | None = None) -> RunningExample:
    """Return the running example; its budget is `budget_bytes`, or None: BUDGET_FRACTION of its plain step's peak.

    The peak (one step on fake tensors) is counted when first asked for: a rank that only builds the model skips it.
    """
    cfg = replace(GPTConfig(), n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                  block_size=max(seq_len, 1), vocab_size=vocab_size)
    ex = RunningExample(cfg, batch_size, seq_len)
    if budget_bytes is not None:
        check_int("budget_bytes", budget_bytes, 1)
        ex.__dict__["budget_bytes"] = budget_bytes  # (cached_property's slot: the budget given, not computed)
    return ex
