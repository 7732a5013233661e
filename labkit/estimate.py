"""Estimate a training step's memory without allocating it: the same step on fake tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from labkit.models import GPTConfig, MLPConfig, build_model
from labkit.train import make_optimizer, measure_step
from labkit.validate import check_int


@dataclass
class MemoryEstimate:
    """The estimated peak of one training step and its split by category."""

    peak_bytes: int  # most bytes live at once during a steady-state step
    split: dict  # bytes at the peak: parameters, gradients, optimizer_state, activations
    n_params: int  # parameters of the model
    batch_size: int  # samples per step
    seq_len: int | None  # tokens per sample (GPT) or None (MLP)

    @property
    def bytes_per_param_static(self) -> float:
        """Return (parameters + gradients + optimizer state) bytes per parameter."""
        s = self.split
        return (s["parameters"] + s["gradients"] + s["optimizer_state"]) / self.n_params


def example_batch(cfg: GPTConfig | MLPConfig, batch_size: int, seq_len: int | None = None,
                  device: torch.device | str = "cpu"):
    """Return a batch of the right shapes for the config (values are arbitrary)."""
    if isinstance(cfg, GPTConfig):
        T = cfg.block_size if seq_len is None else seq_len
        x = torch.randint(cfg.vocab_size, (batch_size, T), device=device)
        return x, torch.randint(cfg.vocab_size, (batch_size, T), device=device)
    return (torch.randn(batch_size, cfg.in_features, device=device),
            torch.randint(cfg.classes, (batch_size,), device=device))


def estimate_training_memory(cfg: GPTConfig | MLPConfig, batch_size: int, seq_len: int | None = None,
                             optimizer: str = "adam") -> MemoryEstimate:
    """Estimate the peak bytes of one steady-state training step on fake tensors (nothing allocated)."""
    check_int("batch_size", batch_size, 1)
    if isinstance(cfg, GPTConfig) and seq_len is not None:
        check_int("seq_len", seq_len, 1, cfg.block_size)
    with FakeTensorMode():
        model = build_model(cfg)
        opt = make_optimizer(optimizer, model.parameters())
        batch = example_batch(cfg, batch_size, seq_len)
        for p in model.parameters():  # create the optimizer state without a forward pass
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step = measure_step(model, opt, batch, device="cpu", warmup=False)
    n = sum(p.numel() for p in model.parameters())
    T = (cfg.block_size if seq_len is None else seq_len) if isinstance(cfg, GPTConfig) else None
    return MemoryEstimate(step.peak_bytes, step.split, n, batch_size, T)
