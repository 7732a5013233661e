"""labkit.hostlink's copy benchmarks: bandwidth of a copy, and a pinned copy overlapping compute (CUDA)."""

from __future__ import annotations

import pytest
import torch

import labkit
from labkit.hostlink import CopyOverlap, copy_bandwidth, copy_compute_overlap, host_to_device_bandwidth


def test_copy_bandwidth_copies_and_returns_bytes_per_second():
    src = torch.arange(2**16, dtype=torch.float32)
    dst = torch.zeros_like(src)
    bw = copy_bandwidth(dst, src, repeats=2)
    assert torch.equal(dst, src)  # the timed call really copied
    assert 0 < bw < float("inf")
    with pytest.raises(ValueError, match="same shape"):
        copy_bandwidth(torch.empty(3), torch.empty(4))
    with pytest.raises(ValueError, match="empty"):
        copy_bandwidth(torch.empty(0), torch.empty(0))
    with pytest.raises(labkit.ParameterError, match="repeats"):
        copy_bandwidth(dst, src, repeats=0)


def test_hidden_fraction_is_the_hidden_share_of_the_shorter_task():
    def hidden(copy_s, compute_s, overlapped_s):
        return CopyOverlap(nbytes=8, matmuls=1, copy_s=copy_s, compute_s=compute_s, serial_s=copy_s + compute_s,
                           overlapped_s=overlapped_s, issue_s=1e-5, pageable_issue_s=2.0).hidden_fraction

    assert hidden(2.0, 3.0, 5.0) == 0.0  # one after the other
    assert hidden(2.0, 3.0, 3.0) == 1.0  # the shorter fully hidden
    assert hidden(2.0, 3.0, 4.0) == pytest.approx(0.5)
    assert hidden(2.0, 3.0, 5.5) == 0.0 and hidden(2.0, 3.0, 2.5) == 1.0  # noise: clipped


def test_cuda_copy_measurements_check_arguments_first_and_refuse_a_cpu_device():
    with pytest.raises(labkit.ParameterError, match="nbytes"):
        copy_compute_overlap("cpu", nbytes=0)
    for fn in (copy_compute_overlap, host_to_device_bandwidth):
        with pytest.raises(ValueError, match="needs a CUDA device"):
            fn("cpu", nbytes=4096)
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="torch sees no CUDA device"):
                fn("cuda", nbytes=4096)


@pytest.mark.cuda
def test_pinned_and_pageable_host_to_device_copies_are_measured():
    for pinned in (True, False):
        assert 0 < host_to_device_bandwidth("cuda", nbytes=16 * 2**20, pinned=pinned) < float("inf")


@pytest.mark.cuda
def test_a_pinned_non_blocking_copy_returns_at_once_and_overlaps_compute_on_a_side_stream():
    o = copy_compute_overlap("cuda", nbytes=64 * 2**20)
    assert o.matmuls >= 1 and o.nbytes == 64 * 2**20
    assert o.issue_s < o.copy_s / 2, o  # the call only enqueued the copy
    assert o.pageable_issue_s > o.issue_s, o  # from pageable memory the call waits for the staging copy
    assert o.overlapped_s < o.serial_s, o  # the side stream overlaps what one stream runs in order
    assert o.hidden_fraction > 0, o


def test_the_moved_copy_benchmarks_still_import_from_throughput_with_a_warning():
    import labkit.hostlink
    import labkit.throughput
    for name in ("copy_bandwidth", "CopyOverlap", "host_to_device_bandwidth", "copy_compute_overlap"):
        with pytest.warns(DeprecationWarning, match=f"labkit.throughput.{name} moved to labkit.hostlink.{name}"):
            assert getattr(labkit.throughput, name) is getattr(labkit.hostlink, name)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        labkit.throughput.nothing

