"""The plain training step that every chapter starts from, and its measured memory."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from labkit.meter import MemoryMeter
from labkit.models import GPTConfig, MLPConfig, build_model

OPTIMIZERS = ("sgd", "momentum", "adam")
ADAM_IMPLS = ("for-loop", "foreach", "fused")  # torch.optim.Adam(foreach=False), (foreach=True), (fused=True): one
#             tensor at a time, every tensor per operation (CUDA's default), one kernel per update (torchtitan's "fused")


def make_optimizer(name: str, params, lr: float = 1e-3, implementation: str = "for-loop") -> torch.optim.Optimizer:
    """Return SGD ("sgd"), SGD with momentum 0.9 ("momentum") or Adam ("adam", one of ADAM_IMPLS) over `params`."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        if implementation not in ADAM_IMPLS:
            raise ValueError(f"implementation must be one of {ADAM_IMPLS}, got {implementation!r}")
        return torch.optim.Adam(params, lr=lr, foreach=implementation == "foreach",
                                fused=True if implementation == "fused" else None)
    raise ValueError(f"optimizer name must be one of {OPTIMIZERS}, got {name!r}")


def seeded_model(config: GPTConfig | MLPConfig, seed: int, device: torch.device | str = "cpu") -> torch.nn.Module:
    """Return the model `config` describes, built right after torch.manual_seed(seed), on `device`."""
    torch.manual_seed(seed)
    return build_model(config).to(device)


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state tensors a first step leaves (Adam's step count stays 0), without a forward; leave no gradient.

    Adam (and AdamW): as its own step does (`_init_group` over zero gradients), no update run (it changes no byte; fake
    steps ran 15-25% faster without it). Any other optimizer: one foreach update of zero gradients."""
    foreach = [group.get("foreach") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    try:
        if isinstance(optimizer, torch.optim.Adam):
            for group in optimizer.param_groups:
                optimizer._init_group(group, [], [], [], [], [], [])
        else:
            for group in optimizer.param_groups:
                group["foreach"] = group.get("foreach") or "foreach" in group
            optimizer.step()
    finally:
        for group, f in zip(optimizer.param_groups, foreach):
            group["foreach"] = f
    optimizer.zero_grad(set_to_none=True)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch, forward_context=None) -> torch.Tensor:
    """Run forward (inside `forward_context`, e.g. saved-tensor hooks), backward and the optimizer step on one batch;
    return the detached loss."""
    with forward_context or contextlib.nullcontext():
        _, loss = model(*batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@dataclass
class StepMemory:
    """Memory of one training step, measured by a MemoryMeter."""

    peak_bytes: int  # most device bytes live at once during the step
    split: dict  # bytes at the peak by category (parameters, gradients, optimizer_state, activations)
    meter: MemoryMeter  # the meter itself (timeline, allocator figures on CUDA)


def measure_step(model, optimizer, batch, step_fn=train_step, budget_bytes: int | None = None,
                 device: torch.device | str | None = None, warmup: bool = True) -> StepMemory:
    """Measure one training step's memory; a warm-up step first creates the optimizer state."""
    if warmup:
        step_fn(model, optimizer, batch)
    if device is None:
        device = next(model.parameters()).device
    with MemoryMeter(device=device, budget_bytes=budget_bytes) as meter:
        meter.track(model, optimizer, *[t for t in batch if isinstance(t, torch.Tensor)])
        step_fn(model, optimizer, batch)
    return StepMemory(meter.peak_bytes, meter.peak_split(), meter)
