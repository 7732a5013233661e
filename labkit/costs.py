"""A technique's cost per optimizer step: its counted work (labkit.work) beside its time on a GPU (labkit.gpus).

Every chapter prints its settings' costs with `cost_table` (chapter 00 introduces it) and records each setting's work
with `work_record`; chapter 10 reads the records back (`work_from_record`) and projects them onto the GPU it is asked
about. The counts are the same on every machine; a time is the roofline's (a bound) or, where a published run gives
the GPU class's achieved fraction of peak, an estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from labkit.gpus import EAGER_OPERATOR_S, DeviceProfile, device_profile, step_time
from labkit.work import Work


def work_record(work: Work) -> dict:
    """Return `work` as JSON-able data for labkit.record."""
    return dataclasses.asdict(work)


def work_from_record(record: dict) -> Work:
    """Return the Work a `work_record` dict holds."""
    return Work(**record)


def cost_table(works: Mapping[str, Work], gpu: str | DeviceProfile, baseline: str | None = None) -> str:
    """Return one line per setting: FLOPs by precision, bytes, kernels, host and peer bytes, its time on `gpu`.

    The time is the estimate where the GPU has a published efficiency, else the roofline bound; `baseline` (a key
    of `works`) adds each time over that setting's, by the work alone and with the host's launches counted. A host
    or peer column that would hold only zeros is left out, and the legend says none moves those bytes.
    """
    device = gpu if isinstance(gpu, DeviceProfile) else device_profile(gpu)
    times = {name: step_time(w, device) for name, w in works.items()}
    estimate = device.efficiency is not None
    seconds = {name: t.time_s for name, t in times.items()}
    width = max(len("setting"), *(len(str(name)) for name in works))
    half = device.half
    host, sent = (any(getattr(w, f) for w in works.values()) for f in ("host_bytes", "sent_bytes"))
    head = (f"{'setting':<{width}} {'GFLOP fp32':>10} {'GFLOP ' + half:>10} {'GB moved':>9} {'kernels':>8}"
            + (f" {'MiB host':>8}" if host else "") + (f" {'MiB sent':>8}" if sent else "")
            + f" {('estimate' if estimate else 'bound') + ' (ms)':>13} {'launch (ms)':>11}"
            + (f" {'x base':>7} {'x base w/ launch':>16}" if baseline is not None else ""))
    lines = [f"counted per optimizer step; time on the {device.name}: "
             + (f"an estimate at {device.efficiency.fraction:.1%} of peak ({device.efficiency.source.split(':')[0]})"
                if estimate else "the roofline, a bound (no published run gives this GPU's share of peak)"), head]
    for name, w in works.items():
        sixteen = sum(n for p, n in w.flops.items() if p != "fp32")
        line = (f"{str(name):<{width}} {w.flops.get('fp32', 0) / 1e9:>10.3f} {sixteen / 1e9:>10.3f} "
                f"{w.bytes_accessed / 1e9:>9.3f} {w.kernels:>8,.0f}" + (f" {w.host_bytes / 2**20:>8.1f}" if host else "")
                + (f" {w.sent_bytes / 2**20:>8.1f}" if sent else "")
                + f" {seconds[name] * 1e3:>13.3f} {times[name].launch_s * 1e3:>11.3f}")
        if baseline is not None:
            line += (f" {seconds[name] / seconds[baseline]:>7.2f}"
                     f" {times[name].with_launches_s / times[baseline].with_launches_s:>16.2f}")
        lines.append(line)
    moved = ["MiB host: over PCIe"] * host + ["MiB sent: to other GPUs"] * sent  # the columns shown, and the others:
    unmoved = ["copies over PCIe"] * (not host) + ["sends to other GPUs"] * (not sent)
    moved += ["no setting here " + " or ".join(unmoved)] if unmoved else []
    lines.append("GB moved: operators' reads and writes; kernels: operators, collectives and host copies run; "
                 + "; ".join(moved)
                 + (f"; 16-bit runs as {half} on the {device.name}" if half != "bf16" else "")
                 + (f"; x base: time over {baseline}'s by the work alone, w/ launch: each the longer of its "
                    "launches and its work" if baseline is not None else ""))
    bound_by_launches = [name for name, t in times.items() if t.launch_bound]
    lines.append(f"launch: kernels × {EAGER_OPERATOR_S * 1e6:.1f} µs, eager PyTorch's host time per operator "
                 "(labkit.gpus.EAGER_OPERATOR_S: chapter 00's step timed on an H200 ÷ its kernels), outside the "
                 + ("estimate" if estimate else "bound")
                 + f"; {len(bound_by_launches)} of {len(times)} settings "
                 f"{'takes' if len(bound_by_launches) == 1 else 'take'} longer to launch than to run on the {device.name}"
                 + (" (at an H200 host's launch rate: the host sets their pace)" if bound_by_launches else ""))
    return "\n".join(lines)
