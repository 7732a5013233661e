"""Read a meter's timeline: the phase a step peaks in, what its forward adds, its bytes averaged over time (chapters 00
and 04)."""

from __future__ import annotations


def peak_phase(meter) -> str:
    """Return the phase ("forward", "backward", "optimizer", ...) of the timeline's first point at its peak."""
    return max(meter.timeline, key=lambda p: p.bytes).phase


def forward_rise_bytes(meter) -> int:
    """Return the device bytes the forward pass adds: its highest point less the bytes just before it started."""
    points = meter.timeline
    first = next(i for i, p in enumerate(points) if p.phase == "forward")
    forward = [p.bytes for p in points if p.phase == "forward"]
    return max(forward) - (points[first - 1].bytes if first else forward[0])


def mean_bytes(meter) -> float:
    """Return the device bytes averaged over the timeline's time (each point held until the next)."""
    points = meter.timeline
    span_s = points[-1].t_s - points[0].t_s
    if span_s <= 0:
        return float(points[-1].bytes)
    return sum(a.bytes * (b.t_s - a.t_s) for a, b in zip(points, points[1:])) / span_s
