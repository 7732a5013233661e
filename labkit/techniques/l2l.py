"""Layer-to-layer (L2L) training (Pudipeddi et al. 2020): model and Adam state on the host, one stage on the device.

Chapter 05: a tested reference (labkit.techniques).
"""

from __future__ import annotations

import contextlib
from collections import namedtuple
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn
from torch.func import functional_call

from labkit.device import as_device
from labkit.meter import MemoryMeter, active_meter
from labkit.models import token_weights
from labkit.stages import split_stages, stage_name
from labkit.techniques.hosttier import host_tier, mark_host_state, pin, to_device, to_host
from labkit.validate import check_int

__all__ = ["L2LTrainer", "measure_l2l_step"]


def _label(t: torch.Tensor, category: str) -> torch.Tensor:
    """Tell the active meter which category a device tensor belongs to (for its peak split); return `t`."""
    meter = active_meter()
    if meter is not None:
        meter.label(t, category)
    return t


_Fetch = namedtuple("_Fetch", "weights ready")  # one stage's weights on their way, the event of their arrival (CUDA)


class L2LTrainer:
    """Train a model layer to layer: host master copy + host Adam; one stage at a time on the device."""

    def __init__(self, model: nn.Module, device: torch.device | str, lr: float = 1e-3,
                 prefetch: bool | None = None):
        """`model` becomes the host master copy (moved to CPU, pinned on CUDA); prefetch: None = on CUDA.

        On a CPU, prefetch issues the same copies in the same order, synchronously: two stages' weights held at once,
        what CUDA's prefetch holds (fake steps that predict a GPU's peak use it); it overlaps nothing there."""
        self.device = as_device(device)
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            raise ValueError("L2L recomputes each layer's forward in backward, so BatchNorm running statistics "
                             "would update twice (pytorch #96136); use a model without BatchNorm")
        if any(t.device.type != "cpu" for t in list(model.parameters()) + list(model.buffers())):
            model = model.to("cpu")  # (only when needed: fake tensors, for estimates, cannot be swapped in place)
        self.model = model
        if self.device.type == "cuda":  # pinned pages: asynchronous copies that overlap compute
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                t.data = pin(t.data)
        self.stages = split_stages(self.model)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr, foreach=False)
        if prefetch is None:
            prefetch = self.device.type == "cuda"
        self.prefetch = bool(prefetch)
        self._copy_stream = torch.cuda.Stream(self.device) if prefetch and self.device.type == "cuda" else None
        self._dropout = [any(isinstance(m, nn.Dropout) and m.p > 0 for m in s.modules()) for s in self.stages]
        self.moved_bytes = {"host_to_device": 0, "device_to_host": 0}  # by the last step
        self.stage_names = [stage_name(i, s) for i, s in enumerate(self.stages)]
        self.peak_stage: tuple[str, str] | None = None  # (phase, stage) whose visit set the meter's peak

    def attach(self, meter: MemoryMeter) -> MemoryMeter:
        """Count the host master copy and optimizer state as host bytes in `meter`."""
        return mark_host_state(meter, self.model, self.optimizer)

    def _fetch(self, i: int) -> _Fetch:
        """Start copying stage i's weights to the device (on the side stream when prefetching)."""
        named = dict(self.stages[i].named_parameters())
        named.update(self.stages[i].named_buffers())
        weights = {}  # allocated on the compute stream; copied on the side stream when prefetching
        try:
            for name, t in named.items():
                weights[name] = _label(to_device(t, self.device, stream=self._copy_stream), "parameters")
                self.moved_bytes["host_to_device"] += t.nbytes
        except BaseException:  # the tensors copied so far are freed now: wait for their copies first
            if self._copy_stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            raise
        if self._copy_stream is None:
            return _Fetch(weights, None)
        ready = torch.cuda.Event()
        ready.record(self._copy_stream)
        return _Fetch(weights, ready)

    def _weights(self, order: Sequence[int]) -> Iterator[dict]:
        """Yield each visited stage's device weights; with prefetch, the next visit's copy overlaps this one."""
        if not self.prefetch:
            for i in order:
                yield self._fetch(i).weights
            return
        queued: list[_Fetch] = []  # copies issued on the side stream that the compute stream has not waited for
        try:
            queued.append(self._fetch(order[0]))
            for k in range(len(order)):
                if k + 1 < len(order):
                    queued.append(self._fetch(order[k + 1]))  # issued now: it overlaps visit k's compute
                current = queued.pop(0)
                self._wait(current.ready)
                weights = current.weights
                del current
                yield weights
                del weights
        finally:
            # an exception or close() frees the queued weights on the compute stream, whose next allocations
            # may reuse their memory: the compute stream must not run past the copies still writing into it
            for fetch in queued:
                self._wait(fetch.ready)

    def _wait(self, ready) -> None:
        """Make the compute stream wait for a copy's event (CUDA); a CPU's copies are already done."""
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def _to_device(self, h: torch.Tensor) -> torch.Tensor:
        """Copy a host boundary tensor (activation or its gradient) to the device, counting the bytes."""
        self.moved_bytes["host_to_device"] += h.nbytes
        return to_device(h, self.device)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Copy a device boundary tensor to the host, counting the bytes."""
        self.moved_bytes["device_to_host"] += t.nbytes
        return to_host(t)

    def _rng_state(self):
        """Return the CPU and (CUDA) device RNG states, kept on the host tier."""
        with host_tier():
            cpu = torch.get_rng_state()
            cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return cpu, cuda

    @contextlib.contextmanager
    def _replay_rng(self, state):
        """Run the block with the RNG states of `state` (None: as it is), restoring the current ones after."""
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

    def step(self, batch, micro_batches: int = 1) -> torch.Tensor:
        """Run one L2L step on (inputs, targets), each visit over `micro_batches` micro-batches; return the loss."""
        inputs, targets = batch
        k = check_int("micro_batches", micro_batches, 1, inputs.shape[0])
        n = len(self.stages)
        self.moved_bytes = {"host_to_device": 0, "device_to_host": 0}
        order = list(range(n)) + list(range(n - 2, -1, -1))  # forward visits, head, backward visits
        weights = self._weights(order)
        try:
            host_grads, loss = self._run(weights, list(zip(inputs.tensor_split(k), targets.tensor_split(k))))
        finally:
            weights.close()  # on every exit: the compute stream waits for any weight copy still queued

        # 4. gradients land on the host; the optimizer steps there
        meter = active_meter()
        with meter.phase("optimizer") if meter is not None else contextlib.nullcontext():
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

    @staticmethod
    def _walk(visit: int, k: int) -> range:
        """Return a visit's order of the k micro-batches: every other visit backwards, starting where the last ended."""
        return range(k) if visit % 2 == 0 else range(k - 1, -1, -1)

    def _run(self, weights: Iterator[dict], mbs: list) -> tuple[list, torch.Tensor]:
        """Run the forward and backward visits over the micro-batches `mbs`; return (host_grads, loss).

        One function of 90-odd lines on purpose (the issue 38 rule's exception): its three phases share the carry
        and the host stashes, and each `del` is where a tensor's bytes leave the device; split into functions, those
        lifetimes would hide in arguments and return values, and the meter's peak would move.
        """
        n, k = len(self.stages), len(mbs)
        meter = active_meter()
        phase = meter.phase if meter is not None else (lambda _: contextlib.nullcontext())
        self.peak_stage = None
        peak_seen = [meter.peak_bytes if meter is not None else 0]

        def note_peak(phase_name: str, i: int):
            """Remember the visit during which the meter's device peak last rose."""
            if meter is not None and meter.peak_bytes > peak_seen[0]:
                peak_seen[0] = meter.peak_bytes
                self.peak_stage = (phase_name, self.stage_names[i])

        # 1. forward without a graph, one visit per stage, each over all k micro-batches; the input of
        #    every stage that backward recomputes (1 .. n-2) waits on the host, one tensor per micro-batch
        stash = [[None] * k for _ in range(n)]  # stash[i][j]: host copy of stage i's input for micro-batch j
        rng = [[None] * k for _ in range(n)]
        carry = None  # (j, tensor): micro-batch j's output of the last visit, still on the device
        with phase("forward"), torch.no_grad():
            for i in range(n - 1):
                w = next(weights)
                walk = self._walk(i, k)
                for j in walk:
                    if i == 0:
                        x = mbs[j][0]
                    else:
                        x = carry[1] if carry and carry[0] == j else self._to_device(stash[i][j])
                    carry = None
                    rng[i][j] = self._rng_state() if self._dropout[i] else None
                    h = functional_call(self.stages[i], w, (x,))  # (b, T, C)
                    del x
                    if i + 1 < n - 1 or j != walk[-1]:  # recomputed from in backward, or read back next visit
                        stash[i + 1][j] = self._to_host(h)
                    if j == walk[-1]:
                        carry = (j, h)  # the next visit starts with it
                    del h
                    note_peak("forward", i)
                del w

        # 2. the last stage: forward and backward at once, micro-batch by micro-batch
        host_grads: list = []  # (host parameter, host gradient) pairs, added up after the backward
        grads = [None] * k  # grads[j]: host copy of the gradient w.r.t. micro-batch j's input of the last visit
        scales = [None] if k == 1 else token_weights(t for _, t in mbs)  # each one's share of the real targets
        losses = []
        with phase("backward"):
            w = self._trainable(n - 1, next(weights))
            walk = self._walk(n - 1, k)
            for j in walk:
                x = carry[1] if carry and carry[0] == j else self._to_device(stash[n - 1][j])
                carry, stash[n - 1][j] = None, None
                x = x.detach().requires_grad_(True)
                if scales[j] == 0:  # no real target: the loss is 0 and does not depend on x
                    losses.append(torch.zeros((), device=x.device))
                    grad_x = torch.zeros_like(x)
                else:
                    loss = functional_call(self.stages[-1], w, (x, mbs[j][1]))
                    loss = loss if scales[j] is None else loss * scales[j]  # mean over the batch's real targets
                    grad_x = self._backward(n - 1, loss, None, x, w)
                    losses.append(loss.detach())  # the graph's leaves would keep the head's device weights alive
                    del loss
                del x
                carry = self._pass_on(j, walk, grad_x, grads)
                del grad_x
                note_peak("backward", n - 1)
            self._send_grads(n - 1, w, host_grads)
            del w

            # 3. backward, last block to first stage: recompute each micro-batch, then its gradients; the
            #    weight gradients add up on the device over the k micro-batches and go to the host once
            for i in range(n - 2, -1, -1):
                w = self._trainable(i, next(weights))
                walk = self._walk(2 * n - 2 - i, k)  # visits: forward 0 .. n-2, head n-1, then these
                grads_in = [None] * k
                for j in walk:
                    x = mbs[j][0] if i == 0 else self._to_device(stash[i][j])
                    stash[i][j] = None  # the host copy is no longer needed
                    g = carry[1] if carry and carry[0] == j else self._to_device(grads[j])
                    carry, grads[j] = None, None
                    if i > 0 and x.is_floating_point():
                        x.requires_grad_(True)
                    with self._replay_rng(rng[i][j]):
                        out = functional_call(self.stages[i], w, (x,))
                    grad_x = self._backward(i, out, g, x, w)
                    del x, out, g
                    if grad_x is not None:
                        carry = self._pass_on(j, walk, grad_x, grads_in)
                    del grad_x
                    note_peak("backward", i)
                grads = grads_in
                self._send_grads(i, w, host_grads)
                del w
        return host_grads, losses[0] if k == 1 else torch.stack(losses).sum()

    def _pass_on(self, j: int, walk: range, grad_x: torch.Tensor, grads: list):
        """Keep the visit's last input gradient on the device (return it as the carry); send the others to the host."""
        if j == walk[-1]:
            return (j, grad_x)
        grads[j] = self._to_host(grad_x)
        return None

    def _trainable(self, i: int, w: dict) -> dict:
        """Make the device copies of stage i's trainable parameters require grad; return `w`."""
        for name, p in self.stages[i].named_parameters():
            if p.requires_grad:
                w[name].requires_grad_(True)
        return w

    def _backward(self, i: int, out, grad_out, x, w: dict):
        """Back-propagate through stage i, adding into the device weights' .grad; return x's gradient (or None)."""
        trainable = [w[name] for name, p in self.stages[i].named_parameters() if p.requires_grad]
        torch.autograd.backward(out, grad_out, inputs=[x, *trainable] if x.requires_grad else trainable)
        for t in trainable:
            if t.grad is not None:
                _label(t.grad, "gradients")
        return x.grad if x.requires_grad else None

    def _send_grads(self, i: int, w: dict, host_grads: list):
        """Queue stage i's weight gradients (summed over the micro-batches) to the host, paired with their params."""
        for name, p in self.stages[i].named_parameters():
            g = w[name].grad if p.requires_grad else None
            if g is not None:  # an unused weight gets no gradient, as in plain autograd
                host_grads.append((p, self._to_host(g)))


def measure_l2l_step(trainer: L2LTrainer, batch, budget_bytes: int | None = None,
                     timeline: bool = True, micro_batches: int = 1) -> MemoryMeter:
    """Run one L2L step under a MemoryMeter (budget on device bytes) and return the meter."""
    with MemoryMeter(device=trainer.device, budget_bytes=budget_bytes, timeline=timeline) as meter:
        trainer.attach(meter)
        meter.track(*[t for t in batch if isinstance(t, torch.Tensor)])
        trainer.step(batch, micro_batches=micro_batches)
    return meter
