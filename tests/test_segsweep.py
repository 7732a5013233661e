"""labkit.segsweep: the segment sweep's runner measures what a plain step measures at s = 1 and less at s = n, counts
recomputation and the update; its curves and figures draw what they are given. Notebook 02 runs in tests/test_nb02.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import labkit
from labkit import gpus
from labkit.plots import new_figure
from labkit.segsweep import (SegmentSweep, SweepCurves, SweepPoint, draw_against_plain, draw_segment_sweep,
                             launch_clause)
from labkit.techniques.checkpointing import segment_sizes
from labkit.throughput import PairedRatio
from labkit.work import Work, count_work

N_LAYER, N_EMBD, BATCH, SEQ_LEN = 4, 32, 2, 16


def _forward(model, idx, targets, layout, segments):
    """Return (logits, loss): balanced segments checkpointed, all but the last ("all": every block)."""
    n = len(model.blocks)
    sizes = segment_sizes(n, segments) if layout == "balanced" else [1] * n
    h, start = model.embed(idx), 0
    for j, size in enumerate(sizes):
        seg = model.blocks[start:start + size]
        last_plain = j == len(sizes) - 1 and layout == "balanced"
        h = seg(h) if last_plain else checkpoint(seg, h, use_reentrant=False)
        start += size
    logits = model.logits(h)
    return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.fixture
def sweep(tiny_config):
    config = lambda n_layer, n_embd: dataclasses.replace(tiny_config, n_layer=n_layer, n_embd=n_embd)  # noqa: E731
    return SegmentSweep(_forward, config, "t4", "cpu", SEQ_LEN, N_LAYER, N_EMBD, BATCH, timed_steps=3, seed=0)


def test_run_measures_the_plain_step_at_s_1_and_fewer_activations_with_checkpointing(sweep):
    plain, every = sweep.run("balanced", 1), sweep.run("all", N_LAYER)
    model, opt, data, update = sweep.warm(N_LAYER, N_EMBD, BATCH)
    opt.zero_grad(set_to_none=False)
    direct = labkit.measure_step(model, opt, data, warmup=False,
                                 step_fn=lambda m, o, b: sweep.step(m, o, b, update=False))
    assert plain.peak_bytes == direct.peak_bytes and plain.activation_bytes == direct.split["activations"]
    for point in (plain, every):  # metered and counted in one run: the work a run of its own counts
        opt.zero_grad(set_to_none=False)
        alone = count_work(sweep.step, model, opt, data, point.layout, point.segments, update=False)
        assert point.work == alone + update and point.flops == alone.total_flops
    assert every.activation_bytes < plain.activation_bytes
    assert plain.flops < every.flops <= 4 / 3 * plain.flops  # recomputation: at most one more forward
    assert plain.work.total_flops == plain.flops + update.total_flops  # the Adam update, counted once
    assert plain.gpu == gpus.step_time(plain.work, "t4") and plain.gpu.time_s > 0
    assert plain.time is None and every.time is None  # timed on CUDA only


def test_run_keeps_one_warm_model_per_shape_and_refuses_bad_arguments(sweep):
    first = sweep.warm(N_LAYER, N_EMBD, BATCH)
    assert sweep.warm(N_LAYER, N_EMBD, BATCH)[0] is first[0]
    other = sweep.run("balanced", 2, n_layer=2, batch_size=1)
    assert other.segments == 2 and len(sweep.warm(2, N_EMBD, 1)[0].blocks) == 2
    assert sweep.warm(N_LAYER, N_EMBD, BATCH)[0] is not first[0]  # one model alive at a time: rebuilt
    with pytest.raises(labkit.ParameterError, match="layout"):
        sweep.run("diagonal", 1)
    with pytest.raises(labkit.ParameterError, match="segments"):
        sweep.run("balanced", N_LAYER + 1)


def _point(segments, act, flops, time_s, measured=None):
    work = Work(flops={"fp32": flops}, bytes_accessed=10**6, kernels=10)
    step = dataclasses.replace(gpus.step_time(work, "t4"), compute_s=time_s, memory_s=0.0, host_s=0.0, comm_s=0.0,
                               fraction=None)  # the roofline: time_s is compute_s
    return SweepPoint("balanced", segments, act + 100, {"activations": act}, flops, work, step, measured)


def test_curves_take_each_ratio_against_the_plain_point():
    plain, two = _point(1, 800, 300, 1.0), _point(2, 400, 360, 1.25, PairedRatio(1.3, (1.3,)))
    c = SweepCurves(2, "t4")
    for p in (plain, two):
        c.add(p, plain)
    assert c.s == [1, 2] and c.balanced_bytes == [800, 400]
    assert c.flop_ratio == [1.0, 1.2] and c.gpu_ratio == pytest.approx([1.0, 1.25])
    assert c.measured == [None, two.time]


def _launched(point, launch_s):
    return dataclasses.replace(point, gpu=dataclasses.replace(point.gpu, launch_s=launch_s))


def test_launch_clause_states_the_with_launches_ratio_only_when_a_step_is_launch_bound():
    plain, two = _point(1, 800, 300, 1.0), _point(2, 400, 360, 1.25)
    assert launch_clause(plain.gpu, two.gpu) == ""  # launches 176 µs against 1 s of work
    # launches of 2 s and 2.2 s outrun the work: the ratio of the longer of each, 2.2 / 2.0
    assert launch_clause(_launched(plain, 2.0).gpu, _launched(two, 2.2).gpu) == "; × 1.10 counting the host's launches"
    assert launch_clause(plain.gpu, _launched(two, 2.5).gpu) == "; × 2.50 counting the host's launches"


def test_curves_track_the_with_launches_ratio_and_the_figure_draws_it_when_launch_bound():
    plain, two = _launched(_point(1, 800, 300, 1.0), 2.0), _launched(_point(2, 400, 360, 1.25), 2.2)
    c = SweepCurves(2, "t4")
    for p in (plain, two):
        c.add(p, plain)
    assert c.launch_bound and c.launch_ratio == pytest.approx([1.0, 1.1])
    fig, axes = new_figure(ncols=2)
    draw_segment_sweep(fig, axes, c)
    assert "(× 1.10–1.10 counting launches)" in axes[1].get_title()
    assert "the same, launches counted" in [t.get_text() for t in axes[1].get_legend().get_texts()]
    c2 = SweepCurves(2, "t4")
    c2.add(_point(1, 800, 300, 1.0), _point(1, 800, 300, 1.0))
    assert not c2.launch_bound


def test_draw_segment_sweep_titles_the_minimum_and_draws_each_curve_given():
    points = [_point(s, b, 300, 1.0) for s, b in ((1, 8 * 2**20), (2, 2 * 2**20), (3, 4 * 2**20))]
    c = SweepCurves(3, "t4")
    for p in points:
        c.add(p, points[0])
    fig, axes = new_figure(ncols=2)
    draw_segment_sweep(fig, axes, c)
    assert "lowest at s = 2 (25% of s = 1)" in axes[0].get_title()
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["balanced segments", "√n"]
    c.torch_bytes, c.chen_bytes, c.flop_model = [8 * 2**20], [8 * 2**20, 3 * 2**20, 3 * 2**20], [1.0, 1.1, 1.2]
    fig, axes = new_figure(ncols=2)
    draw_segment_sweep(fig, axes, c)
    labels = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert labels == ["balanced segments", "checkpoint_sequential", "Chen's model", "√n"]
    assert list(axes[0].get_lines()[1].get_xdata()) == [1]  # the torch curve only as far as it is measured
    assert list(axes[0].get_lines()[0].get_ydata()) == [8.0, 2.0, 4.0]  # MiB
    assert any("one block's count" in t.get_text() for t in axes[1].get_legend().get_texts())


def test_draw_against_plain_bars_each_step_time_in_ms():
    plain, other = _point(1, 800, 300, 0.002), _point(4, 200, 360, 0.003)
    fig, axes = new_figure(ncols=2)
    draw_against_plain(axes, plain, other, "balanced s=4", "t4", title="a title")
    assert [round(b.get_height(), 6) for b in axes[1].patches] == [2.0, 3.0]
    assert "× 1.50" in axes[1].get_title() and axes[0].get_title() == "a title"
