"""Layer-to-layer (L2L) training: the model and its optimizer live on the host; one layer at a time visits the device.

Pudipeddi et al. 2020 (arXiv 2002.05645). The master parameters, their gradients and the Adam
state stay in host memory (the "eager parameter server"; ZeRO-Offload, Ren et al. 2021, also steps
the optimizer on the host). One step:

1. forward: for each stage (embedding, each block; not the head) copy its weights to the device, run it
   without an autograd graph, free the weights, and keep only the stage's output, the boundary
   activation, in host memory;
2. the last stage (final norm, head, loss) runs forward and backward at once on the device;
3. backward, last block to embedding: copy the stage's weights and its input boundary activation back
   to the device, recompute its forward with a graph, compute the gradients of its weights and of its
   input, send the weight gradients to the host (adding them up for a weight used twice, like a
   tied embedding and head), and pass the input gradient to the stage before;
4. the optimizer steps on the host master parameters (plain `torch.optim.Adam`: same math as plain
   training).

The device holds one stage's weights, its gradients and one stage's activations at a time, so its
peak does not grow with depth. On CUDA the host tensors are pinned and the next stage's weights are
copied on a side stream while the current stage computes (`prefetch`).

CPU-only machines: the "device" and the "host" are the same RAM. The host tier is then an
*accounted pool* (`labkit.hosttier`): tensors allocated inside `host_tier()` (or passed to
`MemoryMeter.mark_host`) are counted as host bytes by the active `MemoryMeter`, exempt from its
budget; device working copies are real, separate allocations (`hosttier.to_device`), never the host
tensor itself, so the meter's device count is exactly what a GPU would hold. The code is the same on both.

    trainer = L2LTrainer(model, device)            # model: the host master copy (stays on CPU)
    loss = trainer.step((idx, targets))            # batch on the device
    with MemoryMeter(device, budget_bytes=...) as m:
        trainer.attach(m); trainer.step(batch)     # m.peak_bytes: device; m.host_peak_bytes: host
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn
from torch.func import functional_call

from labkit.hosttier import host_state_tensors, host_tier, mark_host_state, to_device, to_host
from labkit.meter import MemoryMeter, active_meter
from labkit.models import split_stages, stage_name

__all__ = ["L2LTrainer", "measure_l2l_step"]


def _label(t: torch.Tensor, category: str) -> torch.Tensor:
    """Tell the active meter which category a device tensor belongs to (for its peak split); return `t`."""
    meter = active_meter()
    if meter is not None:
        meter.label(t, category)
    return t


def _has_dropout(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())


# -- the trainer -----------------------------------------------------------------------------------
class _Fetch:
    """One stage's weights on their way to the device, and the event that marks their arrival (CUDA)."""

    __slots__ = ("weights", "ready")

    def __init__(self, weights: dict, ready):
        self.weights, self.ready = weights, ready


class L2LTrainer:
    """Train a model layer to layer: host master copy + host Adam; one stage at a time on the device."""

    def __init__(self, model: nn.Module, device: torch.device | str, lr: float = 1e-3,
                 prefetch: bool | None = None):
        """`model` becomes the host master copy (moved to CPU, pinned on CUDA); prefetch: None = on CUDA."""
        self.device = torch.device(device)
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            raise ValueError("L2L recomputes each layer's forward in backward, so BatchNorm running statistics "
                             "would update twice (pytorch #96136); use a model without BatchNorm")
        if any(t.device.type != "cpu" for t in list(model.parameters()) + list(model.buffers())):
            model = model.to("cpu")  # (only when needed: fake tensors, for estimates, cannot be swapped in place)
        self.model = model
        if self.device.type == "cuda":  # pinned pages: asynchronous copies that overlap compute
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                t.data = t.data.pin_memory()
        self.stages = split_stages(self.model)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr, foreach=False)
        if prefetch is None:
            prefetch = self.device.type == "cuda"
        if prefetch and self.device.type != "cuda":
            raise ValueError("prefetch needs a CUDA device (a side stream copies the next layer's weights)")
        self.prefetch = prefetch
        self._copy_stream = torch.cuda.Stream(self.device) if prefetch else None
        self._dropout = [_has_dropout(s) for s in self.stages]
        self.moved_bytes = {"host_to_device": 0, "device_to_host": 0}  # by the last step
        self.stage_names = [stage_name(i, s) for i, s in enumerate(self.stages)]
        self.peak_stage: tuple[str, str] | None = None  # (phase, stage) whose visit set the meter's peak

    # -- host tensors --------------------------------------------------------------------------------
    def host_tensors(self) -> Iterator[torch.Tensor]:
        """Yield every host-resident tensor: parameters, buffers, gradients and optimizer state."""
        return host_state_tensors(self.model, self.optimizer)

    def attach(self, meter: MemoryMeter) -> MemoryMeter:
        """Count the host master copy and optimizer state as host bytes in `meter`."""
        return mark_host_state(meter, self.model, self.optimizer)

    # -- moving weights ------------------------------------------------------------------------------
    def _fetch(self, i: int) -> _Fetch:
        """Start copying stage i's weights to the device (on the side stream when prefetching)."""
        named = dict(self.stages[i].named_parameters())
        named.update(self.stages[i].named_buffers())
        self.moved_bytes["host_to_device"] += sum(t.nbytes for t in named.values())
        # allocated on the compute stream; copied on the side stream when prefetching
        weights = {n: _label(to_device(t, self.device, stream=self._copy_stream), "parameters")
                   for n, t in named.items()}
        if self._copy_stream is None:
            return _Fetch(weights, None)
        ready = torch.cuda.Event()
        ready.record(self._copy_stream)
        return _Fetch(weights, ready)

    def _weights(self, order: Sequence[int]) -> Iterator[dict]:
        """Yield each visited stage's device weights; with prefetch, the next visit's copy overlaps this one."""
        if self._copy_stream is None:
            for i in order:
                yield self._fetch(i).weights
            return
        pending = self._fetch(order[0])
        for k in range(len(order)):
            current = pending
            pending = self._fetch(order[k + 1]) if k + 1 < len(order) else None
            torch.cuda.current_stream(self.device).wait_event(current.ready)
            weights = current.weights
            del current
            yield weights
            del weights

    # -- RNG (dropout masks must repeat in the recomputation) -----------------------------------------
    def _rng_state(self):
        with host_tier():
            cpu = torch.get_rng_state()
            cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return cpu, cuda

    @contextlib.contextmanager
    def _replay_rng(self, state):
        if state is None:
            yield
            return
        cpu, cuda = state
        devices = [self.device] if cuda is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type if cuda is not None else "cuda"):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.device)
            yield

    # -- one step --------------------------------------------------------------------------------------
    def step(self, batch) -> torch.Tensor:
        """Run one L2L training step on `batch` = (inputs, targets) on the device; return the detached loss."""
        inputs, targets = batch
        n = len(self.stages)
        self.moved_bytes = {"host_to_device": 0, "device_to_host": 0}
        order = list(range(n)) + list(range(n - 2, -1, -1))  # forward visits, head, backward visits
        weights = self._weights(order)
        meter = active_meter()
        phase = meter.phase if meter is not None else (lambda _: contextlib.nullcontext())
        self.peak_stage = None
        peak_seen = [meter.peak_bytes if meter is not None else 0]

        def note_peak(phase_name: str, i: int):
            """Remember the visit during which the meter's device peak last rose."""
            if meter is not None and meter.peak_bytes > peak_seen[0]:
                peak_seen[0] = meter.peak_bytes
                self.peak_stage = (phase_name, self.stage_names[i])

        # 1. forward without a graph; keep each stage's input (a boundary activation) on the host
        boundary: list = [inputs]  # boundary[i]: input of stage i (stage 0's is the batch itself)
        rng: list = []
        h = inputs
        with phase("forward"), torch.no_grad():
            for i in range(n - 1):
                w = next(weights)
                rng.append(self._rng_state() if self._dropout[i] else None)
                h = functional_call(self.stages[i], w, (h,))  # (B, T, C)
                del w
                if i + 1 < n - 1:
                    boundary.append(to_host(h))
                    self.moved_bytes["device_to_host"] += h.nbytes
                note_peak("forward", i)

        # 2. the last stage: forward and backward at once
        host_grads: list = []  # (host parameter, host gradient) pairs, added up after the backward
        with phase("backward"):
            w = self._trainable(n - 1, next(weights))
            x = h.detach().requires_grad_(True)
            del h
            loss = functional_call(self.stages[-1], w, (x, targets))
            grad_h = self._backward(n - 1, loss, None, x, w, host_grads)
            loss = loss.detach()  # its graph's leaf nodes would keep the head's device weights alive
            del w, x
            note_peak("backward", n - 1)

            # 3. backward, last block to first stage: recompute each stage, then its gradients
            for i in range(n - 2, -1, -1):
                w = self._trainable(i, next(weights))
                x = boundary[i] if i == 0 else to_device(boundary[i], self.device)
                if i > 0:
                    self.moved_bytes["host_to_device"] += x.nbytes
                boundary[i] = None  # the host copy is no longer needed
                if i > 0 and x.is_floating_point():
                    x.requires_grad_(True)
                with self._replay_rng(rng[i]):
                    out = functional_call(self.stages[i], w, (x,))
                grad_h = self._backward(i, out, grad_h, x, w, host_grads)
                del w, out, x
                note_peak("backward", i)
        del weights

        # 4. gradients land on the host; the optimizer steps there
        with phase("optimizer"):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the asynchronous gradient copies have arrived
            with host_tier():
                while host_grads:
                    p, g = host_grads.pop()
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.add_(g)  # a weight used by two stages (tied embedding and head)
                    del p, g
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _trainable(self, i: int, w: dict) -> dict:
        """Make the device copies of stage i's trainable parameters require grad; return `w`."""
        for name, p in self.stages[i].named_parameters():
            if p.requires_grad:
                w[name].requires_grad_(True)
        return w

    def _backward(self, i: int, out, grad_out, x, w: dict, host_grads: list):
        """Back-propagate through stage i; queue its weight gradients to the host; return the input gradient."""
        params = [(name, p) for name, p in self.stages[i].named_parameters() if p.requires_grad]
        wrt = [w[name] for name, _ in params]
        if x.requires_grad:
            wrt = [x] + wrt
        grads = list(torch.autograd.grad(out, wrt, grad_out, allow_unused=True))
        grad_x = grads.pop(0) if x.requires_grad else None
        for (_, p), g in zip(params, grads):
            if g is not None:  # an unused weight gets no gradient, as in plain autograd
                host_grads.append((p, to_host(_label(g, "gradients"))))
                self.moved_bytes["device_to_host"] += g.nbytes
        return grad_x

# -- measurements ------------------------------------------------------------------------------------
def measure_l2l_step(trainer: L2LTrainer, batch, budget_bytes: int | None = None,
                     timeline: bool = True) -> MemoryMeter:
    """Run one L2L step under a MemoryMeter (budget on device bytes) and return the meter."""
    with MemoryMeter(device=trainer.device, budget_bytes=budget_bytes, timeline=timeline) as meter:
        trainer.attach(meter)
        meter.track(*[t for t in batch if isinstance(t, torch.Tensor)])
        trainer.step(batch)
    return meter
