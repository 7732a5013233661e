"""Measure compiled code where the meter (a dispatch mode) cannot look: the allocator's peak, the matmul FLOPs."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit.device import synchronize
from labkit.validate import check_choice

BACKENDS = ("inductor", "aot_eager_decomp_partition")
"""Backends this module knows: inductor (generated kernels), aot_eager_decomp_partition (inductor's
decompositions and partitioner, eager kernels: no C++ or Triton compiler needed)."""


def compile_unavailable_reason(device: torch.device | str, backend: str = "inductor") -> str | None:
    """Return why torch.compile with `backend` cannot run on `device` here, or None when it can."""
    check_choice("backend", backend, BACKENDS)
    device = torch.device(device)
    try:
        torch._dynamo.eval_frame.check_if_dynamo_supported()
    except Exception as e:  # e.g. a Python version Dynamo does not support yet
        return f"torch.compile is not supported here: {e}"
    if backend != "inductor":
        return None
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        return None if has_triton() else "inductor on CUDA generates Triton kernels, and Triton is not installed"
    if device.type != "cpu":
        return f"this notebook measures inductor on CPU and CUDA only, not {device.type}"
    from torch._inductor.cpp_builder import get_cpp_compiler
    try:
        get_cpp_compiler()
    except Exception as e:  # no g++/clang++ on the PATH
        return f"inductor on CPU compiles C++ and found no compiler: {type(e).__name__}: {e}"
    return None


@dataclass(frozen=True)
class AllocationPeak:
    """Bytes allocated while a function ran, relative to what was allocated before it."""

    peak_bytes: int  # most bytes allocated at once above the start, kernel-internal scratch included
    end_bytes: int  # bytes still allocated at the end above the start (negative: it freed older tensors)
    tensor_peak_bytes: int | None  # CPU: the peak without scratch freed inside the operator that made it
    method: str  # how it was measured


def allocation_peak(fn: Callable[[], object], device: torch.device | str) -> AllocationPeak:
    """Run fn() once and return the peak of allocated bytes above the start (CPU: profiler, CUDA: allocator)."""
    device = torch.device(device)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return AllocationPeak(torch.cuda.max_memory_allocated(device) - start,
                              torch.cuda.memory_allocated(device) - start, None,
                              "torch.cuda.max_memory_allocated")
    if device.type != "cpu":
        raise ValueError(f"allocation_peak measures CPU and CUDA, not {device.type}")
    with _cpu_profiler(profile_memory=True) as prof:
        fn()
    events = _allocation_events(prof)
    return AllocationPeak(_running_peak(events), sum(e[1] for e in events), _running_peak(_without_scratch(events)),
                          "torch.profiler allocation events")


MATMUL_OP_NAMES = ("aten::mm", "aten::addmm", "aten::bmm")
"""Profiler event names whose FLOPs `matmul_flops` adds up (the matmuls labkit.work counts in these models)."""


def matmul_flops(fn: Callable[[], object]) -> int:
    """Run fn() once under the profiler and return the FLOPs of its matmuls (2·m·n·k each), compiled code included."""
    with _cpu_profiler(with_flops=True) as prof:
        fn()
    return int(sum(e.flops for e in prof.events() if e.name in MATMUL_OP_NAMES))


def _cpu_profiler(**kwargs):
    """Return a torch.profiler.profile over CPU activity; sets KINETO_LOG_LEVEL=6 (silent) unless it is set."""
    from torch.profiler import ProfilerActivity, profile
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    return profile(activities=[ProfilerActivity.CPU], **kwargs)


def _top_op(event):
    """Return the outermost aten operator event around `event` (None outside any operator)."""
    top = None
    while event is not None:
        if event.name.startswith("aten::"):
            top = event
        event = event.parent
    return top


def _allocation_events(prof) -> list[tuple[int, int, int, int | None]]:
    """Return (time ns, signed bytes, address, id of the outermost operator) per CPU allocation/free, in time order."""
    from torch._C._profiler import _EventType

    out = []
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # depth first, children in order: the tree's own order where two events share a timestamp
        event = stack.pop()
        stack.extend(reversed(event.children))
        if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":  # not CUDA's
            alloc = event.typed[1]
            top = _top_op(event.parent)
            out.append((event.start_time_ns, int(alloc.alloc_size), int(alloc.ptr), None if top is None else top.id))
    out.sort(key=lambda e: e[0])  # stable: events at one timestamp keep the tree's order
    return out


def _without_scratch(events):
    """Drop each allocation freed inside the same outermost operator that made it, and its free."""
    open_at: dict[int, int] = {}  # address -> index of its live allocation
    scratch: set[int] = set()
    for i, (_, nbytes, ptr, top) in enumerate(events):
        if nbytes > 0:
            open_at[ptr] = i
        elif ptr in open_at:
            j = open_at.pop(ptr)
            if top is not None and events[j][3] == top:
                scratch.update((i, j))
    return [e for i, e in enumerate(events) if i not in scratch]


def _running_peak(events) -> int:
    """Return the largest running sum of signed bytes (0 if it never rises above the start)."""
    cur = peak = 0
    for _, nbytes, _, _ in events:
        cur += nbytes
        peak = max(peak, cur)
    return peak
