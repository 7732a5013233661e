"""labkit.timeline: the peak's phase, the forward's rise and the time-weighted mean, read off hand-made timelines."""

from types import SimpleNamespace

import pytest

from labkit.meter import TimelinePoint
from labkit.timeline import forward_rise_bytes, mean_bytes, peak_phase


def meter(*points):
    """A stand-in for a MemoryMeter: (t_s, bytes, phase) points."""
    return SimpleNamespace(timeline=[TimelinePoint(i, t, b, ph) for i, (t, b, ph) in enumerate(points)])


def test_the_timeline_says_where_the_step_peaks_and_what_its_forward_adds():
    m = meter((0.0, 100, "setup"), (1.0, 150, "forward"), (2.0, 180, "forward"), (3.0, 240, "backward"),
              (4.0, 240, "optimizer"), (5.0, 120, "optimizer"))
    assert peak_phase(m) == "backward"  # the first point at the peak
    assert forward_rise_bytes(m) == 80  # 180 at most in forward, 100 just before it
    # each point held until the next: 100, 150, 180, 240, 240 for a second each, over 5 s
    assert mean_bytes(m) == pytest.approx((100 + 150 + 180 + 240 + 240) / 5)
    assert forward_rise_bytes(meter((0.0, 50, "forward"), (1.0, 70, "forward"))) == 20  # forward from the start
    assert mean_bytes(meter((0.0, 64, "forward"))) == 64.0  # one point: no time to average over
