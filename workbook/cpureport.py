"""The line every timing of the repository is printed with: this CPU's model, vector level, bf16 units, and what a
bf16 matmul costs against fp32 on one thread (`make bench`, `make run`, the suite's header)."""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from labkit.cpu import DISPATCH_ENV, bf16_flags, bf16_native, cpu_flags, cpuinfo, one_thread


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


FP32_REPEATS = 9  # a few ms each: the median of 9 moved by 1% over a dozen reports here where that of 3 moved by 10%
#                   (AMD EPYC Zen 4, 2 cores, AVX2 variables); the speed lines of `make bench` and `make test` read it
_REPORT: list = []  # this process's report, measured once


def cpu_report(fresh: bool = False) -> CpuReport:
    """Return this CPU's report, its matmuls timed once per process (again with `fresh`)."""
    if _REPORT and not fresh:
        return _REPORT[0]
    info, flags = cpuinfo(), cpu_flags()
    report = CpuReport(
        model=info.get("model name") or platform.processor() or platform.machine(),
        cores=os.cpu_count() or 1,
        capability=torch.backends.cpu.get_cpu_capability(),
        bf16_flags=bf16_flags(),
        dispatch_env={k: os.environ[k] for k in DISPATCH_ENV if k in os.environ},
        fp32_matmul_s=matmul_s(torch.float32, repeats=FP32_REPEATS),
        bf16_matmul_s=matmul_s(torch.bfloat16),
        bf16_native=bf16_native(flags),
    )
    _REPORT[:] = [report]
    return report
