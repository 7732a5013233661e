"""Estimate a training step's memory without allocating it: the same step on fake tensors (notebooks 00, 07, 08).

One process, or one rank of DDP, ZeRO-1 (corrections of the one-process step) or FSDP2 (ZeRO-2/3, run on a fake group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from labkit.cpu import one_thread
from labkit.meter import MemoryMeter
from labkit.models import GPTConfig, MLPConfig, blocks_of, build_model
from labkit.train import create_optimizer_state, make_optimizer
from labkit.validate import check_int


@dataclass
class MemoryEstimate:
    """The estimated peak of one training step and its split by category."""

    peak_bytes: int  # most bytes live at once during a steady-state step (of one rank)
    split: dict  # bytes at the peak: parameters, gradients, optimizer_state, activations
    n_params: int  # parameters of the model
    batch_size: int  # samples per step (per rank)
    seq_len: int | None  # tokens per sample (GPT) or None (MLP)
    world_size: int = 1  # data-parallel ranks
    zero_stage: int | None = None  # None: one process (world_size 1) or DDP
    states: dict | None = None  # bytes right after the optimizer step: the model states at rest by category, and
    #                             under "other" what the step still holds (batch, logits, loss, DDP's buckets)

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


SHARED_DIR_ENV = "LABKIT_FAKE_STEPS_DIR"  # a folder where a run's processes share fake steps (the suite sets one)
_REMEMBERED: dict = {}  # key -> a fake step's figures, pickled (a sweep or a study asks for the same step again and
#                         again; each caller gets its own copy: a pickle round trip, 10x faster than copy.deepcopy)


def remembered(key: tuple, count):
    """Return `count()`'s figures for `key`: from this process's memo, from the folder SHARED_DIR_ENV names, or counted.

    `key` names the step whole by its repr (plain values and dataclasses). Counted figures are kept in the memo and,
    when SHARED_DIR_ENV is set, written there for this run's other processes (kernels, ranks, workers).
    """
    if key in _REMEMBERED:
        return pickle.loads(_REMEMBERED[key])
    name, folder = repr(key), os.environ.get(SHARED_DIR_ENV)
    path = os.path.join(folder, hashlib.sha256(name.encode()).hexdigest() + ".pkl") if folder else None
    value = None
    if path is not None and os.path.exists(path):
        with open(path, "rb") as f:
            stored_name, value = pickle.load(f)
        value = value if stored_name == name else None  # (a hash shared by two keys: count this one)
    if value is None:
        value = count()
        if path is not None:
            with open(f"{path}.{os.getpid()}", "wb") as f:
                pickle.dump((name, value), f)
            os.replace(f"{path}.{os.getpid()}", path)  # a reader sees the whole file or none
    _REMEMBERED[key] = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    return value


_KEYED_FIELDS = {"dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset", "storage_bytes",
                 "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference", "is_sparse", "is_coalesced",
                 "dense_dim", "sparse_dim"}  # torch's TensorMetadata fields the lean key covers (memory_format: by the
#                                             shape and strides; the last five: only dense, unquantized tensors keyed)
_STRIDED = torch.strided
_PLAIN = {bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format}  # keyed as they are
_LEAN = object()  # marks a fake tensor keyed the lean way: no key of torch's own format equals one of these


class LeanFakeTensorMode(FakeTensorMode):
    """FakeTensorMode whose operator cache keys a dense fake tensor by the fields that decide an operator's output,
    read directly (torch's key builds a TensorMetadata per tensor: 36% of a 4-block fake step, 2026-11-29); anything
    else by torch's own code. Use `fake_mode()`: FakeTensorMode where torch's metadata has a field this key lacks.
    """

    def _prep_args_for_hash(self, result, args, state, *rest):
        if isinstance(args, dict):
            return super()._prep_args_for_hash(result, args, state, *rest)
        if isinstance(args, (list, tuple)):
            result.append(type(args))
            result.append(len(args))
        for arg in args:
            if type(arg) is FakeTensor and arg.fake_mode is self and arg.constant is None and arg.layout is _STRIDED \
                    and not arg.is_quantized and not arg._has_symbolic_sizes_strides:
                result.extend((_LEAN, arg.dtype, arg.shape, arg.stride(), arg.fake_device, arg.storage_offset(),
                               arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_inference(), arg.is_conj(),
                               arg.is_neg()))
            elif arg is None or type(arg) in _PLAIN:
                result.append(type(arg))
                result.append(arg)
            elif type(arg) in (list, tuple):
                self._prep_args_for_hash(result, arg, state, *rest)
            else:  # torch's own key for the rest (and its reasons to bypass the cache)
                super()._prep_args_for_hash(result, (arg,), state, *rest)


def fake_mode(**kwargs) -> FakeTensorMode:
    """Return a LeanFakeTensorMode(**kwargs), or a FakeTensorMode where this torch's TensorMetadata has fields the
    lean key does not cover (another torch version: the same figures, torch's slower key)."""
    try:
        from torch._subclasses.fake_tensor import TensorMetadata
        fields = {f.name for f in dataclasses.fields(TensorMetadata)}
    except (ImportError, TypeError):
        fields = None
    lean = fields is not None and fields <= _KEYED_FIELDS and hasattr(FakeTensorMode, "_prep_args_for_hash")
    return (LeanFakeTensorMode if lean else FakeTensorMode)(**kwargs)


def fake_step(build, trace: bool = False, mode=fake_mode, meter_class=MemoryMeter) -> tuple:
    """Meter one step of `build()` on fake tensors (in `mode(...)`, by a `meter_class`); return its peak, split, n.

    `build()` returns (model, attach, run): `attach(meter)` tracks the step's tensors, `run()` runs one step. With
    `trace`, a fifth item: (phase, tag, bytes by category) at every timeline event. Wrap it in `remembered` to count
    each step once.
    """
    # one thread: fake operators compute nothing, and a second thread only adds overhead (1.4x slower with 2)
    with one_thread(), mode(allow_non_fake_inputs=True):  # (FSDP2's meta shards enter as non-fake inputs)
        model, attach, run = build()
        with meter_class("cpu", timeline=trace, every_record=trace) as meter:
            attach(meter)
            kept = run()  # what the step returns (the last logits and loss) is held when its bytes are counted
            states = meter.current_split()
            del kept
        n = sum(p.numel() for p in model.parameters())  # DTensor.numel(): the global count
    out = (meter.peak_bytes, meter.peak_split(), states, n)
    if trace:
        out += ([(pt.phase, pt.tag, split) for pt, split in zip(meter.timeline, meter.timeline_splits())],)
    return out


def estimate_training_memory(cfg: GPTConfig | MLPConfig, batch_size: int, seq_len: int | None = None,
                             optimizer: str = "adam", world_size: int = 1,
                             zero_stage: int | None = None) -> MemoryEstimate:
    """Estimate the peak bytes of one steady-state training step (of one rank) on fake tensors, nothing allocated."""
    check_int("batch_size", batch_size, 1)
    if isinstance(cfg, GPTConfig) and seq_len is not None:
        check_int("seq_len", seq_len, 1, cfg.block_size)
    check_int("world_size", world_size, 1)
    if zero_stage is not None:
        check_int("zero_stage", zero_stage, 0, 3)
        if world_size == 1:
            raise ValueError("zero_stage needs world_size > 1: one process has nothing to shard")
    T = (cfg.block_size if seq_len is None else seq_len) if isinstance(cfg, GPTConfig) else None
    if zero_stage in (2, 3):  # rank 0 of FSDP2 on a fake group, sharded on meta tensors (cheap only there)
        with torch.device("meta"):
            model = build_model(cfg)
        with fake_sharded(model, blocks_of(model), world_size, zero_stage == 3):  # to_empty: FSDP2's meta init
            peak, split, states, n = fake_step(lambda: _plain_step(model.to_empty(device="cpu"), optimizer, cfg,
                                                                   batch_size, seq_len))
    else:
        peak, split, states, n = remembered(
            ("model", repr(cfg), batch_size, seq_len, optimizer),
            lambda: fake_step(lambda: _plain_step(build_model(cfg), optimizer, cfg, batch_size, seq_len)))
    states["other"] = states.pop("activations")  # at rest: no activations, the batch and the last logits
    if world_size > 1 and zero_stage not in (2, 3):
        peak, split, states = data_parallel_rank(peak, split, states, world_size, zero_stage)
    return MemoryEstimate(peak, split, n, batch_size, T, world_size, zero_stage if world_size > 1 else None, states)


def data_parallel_rank(peak: int, split: dict, states: dict, world_size: int, zero_stage: int | None):
    """Return (peak, split, states) of one DDP rank (zero_stage None or 0) or ZeRO-1 rank from the one-process step's:
    DDP's gradient buckets added (as many bytes as the gradients), ZeRO-1 keeping Adam's state of 1/N of the
    parameters. `states`: the model states at rest by category, what else the step holds under "other"."""
    split, states = dict(split), dict(states)
    buckets = states["gradients"]
    peak, split["activations"], states["other"] = (peak + buckets, split["activations"] + buckets,
                                                   states["other"] + buckets)
    if zero_stage == 1:  # ZeroRedundancyOptimizer: each rank keeps the state of 1/N of the parameters
        kept = states["optimizer_state"] // world_size
        peak -= states["optimizer_state"] - kept
        split["optimizer_state"] -= states["optimizer_state"] - kept
        states["optimizer_state"] = kept
    return peak, split, states


def _plain_step(model, optimizer: str, cfg, batch_size: int, seq_len: int | None):
    """Return fake_step's (model, attach, run) of the plain step, the optimizer state created without a forward."""
    opt = make_optimizer(optimizer, model.parameters())
    batch = example_batch(cfg, batch_size, seq_len)
    create_optimizer_state(opt)  # (FSDP2 too: its peak is the same byte for byte as after a whole first step)

    def run():
        logits, loss = model(*batch)
        loss.backward()
        opt.step()
        return logits, loss
    return model, lambda meter: meter.track(model, opt, *batch), run


@contextlib.contextmanager
def fake_sharded(model: torch.nn.Module, blocks, world_size: int, reshard: bool, mp_policy=None):
    """Shard a meta-built `model` with FSDP2 (each of `blocks`, then the whole; under `mp_policy`, a
    MixedPrecisionPolicy, if given) over a fake group of `world_size`, this process its rank 0 while the block runs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    check_int("world_size", world_size, 2)
    if dist.is_initialized():
        raise RuntimeError("estimating a sharded step needs a process without a process group (it makes a fake one)")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (world_size,))  # outside fake mode: the mesh reads real rank lists
        policy = {} if mp_policy is None else {"mp_policy": mp_policy}
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **policy)
        yield model
    finally:
        dist.destroy_process_group()
