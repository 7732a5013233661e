"""This CPU: its model, vector level and bf16 units, and what a 16-bit matmul costs on it against fp32.

Chapter 03 teaches why a 16-bit matmul is fast only where the hardware has 16-bit units; a chapter asks `bf16_native()`
before it times 16-bit compute on a CPU. (The line every timing of the repository is printed with, `make bench`'s and
`make run`'s: workbook.cpureport.)
"""

from __future__ import annotations

import contextlib
import os

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # /proc/cpuinfo: x86 AVX-512-BF16, x86 AMX, Arm's BF16 extension
DISPATCH_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")  # what torch may dispatch to
# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) at or above the first with bf16 instructions (AVX-512-BF16): capping oneDNN
# below them sends its bf16 matmuls to generic kernels, as on a CPU without the units
BF16_ISAS = ("ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512",
             "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")


def cpuinfo(path: str = "/proc/cpuinfo") -> dict:
    """Return the first processor's fields of /proc/cpuinfo ({} where unreadable)."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


@contextlib.contextmanager
def one_thread():
    """Run the block on one intra-op thread (a rate per thread; fake tensors, which 2 threads only slow), then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def cpu_flags() -> set:
    """Return this CPU's feature flags (/proc/cpuinfo's "flags" or "Features"; empty where unreadable)."""
    info = cpuinfo()
    return set((info.get("flags") or info.get("Features") or "").split())


def bf16_flags() -> tuple:
    """Return this CPU's bf16 flags (BF16_CPU_FLAGS found in /proc/cpuinfo; () where none or unreadable)."""
    flags = cpu_flags()
    return tuple(f for f in BF16_CPU_FLAGS if f in flags)


def bf16_native(flags=None, capability: str | None = None, env=None) -> bool:
    """Return whether torch computes bf16 on this CPU's 16-bit units: bf16 flags, and on x86 a dispatch that uses them
    (torch's vector level AVX512, oneDNN not capped below AVX-512-BF16). Nothing is timed: on a CPU without the units
    a chapter counts bf16 work instead of timing it (chapters 03, 08, 09)."""
    flags = cpu_flags() if flags is None else set(flags)
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    env = os.environ if env is None else env
    if "bf16" in flags:  # Arm's BF16 extension
        return True
    if not flags & {"avx512_bf16", "amx_bf16"}:
        return False
    return capability == "AVX512" and env.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in BF16_ISAS


def no_bf16_words(flags=None, capability: str | None = None, env=None) -> str:
    """Return why torch computes no bf16 on 16-bit units here, in the chapters' words (where bf16_native is False):
    the CPU has none, or torch's kernels do not use those it has, naming the DISPATCH_ENV variables that cap them
    (chapters 03, 08 and 09)."""
    found = [f for f in BF16_CPU_FLAGS if f in (cpu_flags() if flags is None else set(flags))]
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    env = os.environ if env is None else env
    if not found:
        return "this CPU has no bf16 units"
    capped = " ".join(f"{k}={env[k]}" for k in DISPATCH_ENV if k in env)
    return (f"torch's kernels here ({capability}{', set by ' + capped if capped else ''}) use none of this CPU's bf16 "
            f"units ({', '.join(found)})")
