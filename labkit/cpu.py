"""This CPU: its model, vector level and bf16 units, and what a 16-bit matmul costs on it against fp32.

Chapter 03 teaches why a 16-bit matmul is fast only where the hardware has 16-bit units; a chapter asks `bf16_native()`
before it times 16-bit compute on a CPU, and every timing this workbook reports (`make bench`, `make run`) starts with
`CpuReport.line()`.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # /proc/cpuinfo: x86 AVX-512-BF16, x86 AMX, Arm's BF16 extension
DISPATCH_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")  # what torch may dispatch to
# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) at or above the first with bf16 instructions (AVX-512-BF16): capping oneDNN
# below them sends its bf16 matmuls to generic kernels, as on a CPU without the units
BF16_ISAS = ("ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512",
             "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")


def _cpuinfo(path: str = "/proc/cpuinfo") -> dict:
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


def matmul_s(dtype: torch.dtype, n: int = 512, repeats: int = 3) -> float:
    """Return the median seconds of one n x n `dtype` matmul on one thread, after a warm-up."""
    with one_thread():
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
        a @ b
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def _flags() -> set:
    """Return this CPU's feature flags (/proc/cpuinfo's "flags" or "Features"; empty where unreadable)."""
    info = _cpuinfo()
    return set((info.get("flags") or info.get("Features") or "").split())


def bf16_flags() -> tuple:
    """Return this CPU's bf16 flags (BF16_CPU_FLAGS found in /proc/cpuinfo; () where none or unreadable)."""
    flags = _flags()
    return tuple(f for f in BF16_CPU_FLAGS if f in flags)


def bf16_native(flags=None, capability: str | None = None, env=None) -> bool:
    """Return whether torch computes bf16 on this CPU's 16-bit units: bf16 flags, and on x86 a dispatch that uses them
    (torch's vector level AVX512, oneDNN not capped below AVX-512-BF16). Nothing is timed: on a CPU without the units
    a chapter counts bf16 work instead of timing it (chapters 03, 08, 09)."""
    flags = _flags() if flags is None else set(flags)
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
    found = [f for f in BF16_CPU_FLAGS if f in (_flags() if flags is None else set(flags))]
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    env = os.environ if env is None else env
    if not found:
        return "this CPU has no bf16 units"
    capped = " ".join(f"{k}={env[k]}" for k in DISPATCH_ENV if k in env)
    return (f"torch's kernels here ({capability}{', set by ' + capped if capped else ''}) use none of this CPU's bf16 "
            f"units ({', '.join(found)})")


@dataclass(frozen=True)
class CpuReport:
    """What this CPU is and what a bf16 matmul costs on it (one thread)."""

    model: str  # /proc/cpuinfo's model name (or platform.processor())
    cores: int  # logical CPUs the OS reports
    capability: str  # the vector level torch's CPU kernels use (torch.backends.cpu.get_cpu_capability())
    bf16_flags: tuple  # /proc/cpuinfo's bf16 flags (BF16_CPU_FLAGS found); () where none or unreadable
    dispatch_env: dict  # DISPATCH_ENV variables that are set: they make torch dispatch as on a smaller CPU
    fp32_matmul_s: float  # one 512 x 512 fp32 matmul, median
    bf16_matmul_s: float  # the same in bf16
    bf16_native: bool  # bf16 on 16-bit units (labkit.cpu.bf16_native: the flags and torch's dispatch, not the timing)

    @property
    def bf16_ratio(self) -> float:
        """Return a bf16 matmul's time over fp32's (above 1: bf16 is slower here)."""
        return self.bf16_matmul_s / self.fp32_matmul_s

    def line(self) -> str:
        """Return the report as the one line every timing is printed with."""
        env = " ".join(f"{k}={v}" for k, v in self.dispatch_env.items())
        return (f"CPU: {self.model}, {self.cores} cores, torch capability {self.capability}"
                f"{', bf16 flags ' + '/'.join(self.bf16_flags) if self.bf16_flags else ', no bf16 flags'}"
                f"{' (' + env + ')' if env else ''}; 512x512 matmul on 1 thread: fp32 "
                f"{self.fp32_matmul_s * 1e3:.2f} ms, bf16 {self.bf16_matmul_s * 1e3:.2f} ms "
                f"(bf16/fp32 = {self.bf16_ratio:.1f}x: {'native' if self.bf16_native else 'no native'} bf16)")


_REPORT: list = []  # this process's report, measured once


def cpu_report(fresh: bool = False) -> CpuReport:
    """Return this CPU's report, its matmuls timed once per process (again with `fresh`)."""
    if _REPORT and not fresh:
        return _REPORT[0]
    info, flags = _cpuinfo(), _flags()
    report = CpuReport(
        model=info.get("model name") or platform.processor() or platform.machine(),
        cores=os.cpu_count() or 1,
        capability=torch.backends.cpu.get_cpu_capability(),
        bf16_flags=bf16_flags(),
        dispatch_env={k: os.environ[k] for k in DISPATCH_ENV if k in os.environ},
        fp32_matmul_s=matmul_s(torch.float32),
        bf16_matmul_s=matmul_s(torch.bfloat16),
        bf16_native=bf16_native(flags),
    )
    _REPORT[:] = [report]
    return report
