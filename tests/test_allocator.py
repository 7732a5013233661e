"""labkit.planner.allocator: the CUDA caching allocator's documented rules, one by one, and (on CUDA) its reserved bytes."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from labkit import estimate
from labkit.gpus import device_profile
from labkit.meter import MemoryMeter
from labkit.models import GPTConfig
from labkit.planner import overheads
from labkit.planner import plan as P
from labkit.planner.allocator import CachingAllocator, cpu_stream_tags, meter_events, replay, round_size, segment_size
from labkit.validate import ParameterError

MiB = 2**20


def test_requests_round_to_512_bytes_and_segments_follow_get_allocation_size():
    assert [round_size(n) for n in (0, 1, 512, 513, 4096)] == [512, 512, 512, 1024, 4096]
    assert segment_size(1 * MiB) == 2 * MiB  # the small pool's 2 MiB segments
    assert segment_size(1 * MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB  # 1-10 MiB: a 20 MiB segment
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 512) == 12 * MiB  # rounded to 2 MiB


def test_small_requests_are_packed_into_2_mib_segments():
    a = CachingAllocator()
    for _ in range(4096):  # 4,096 x 512 B fill one 2 MiB segment
        a.malloc(512)
    assert (a.segments, a.reserved_bytes) == (1, 2 * MiB)
    a.malloc(100)  # the 4,097th takes a new one
    assert (a.segments, a.reserved_bytes, a.allocated_bytes) == (2, 4 * MiB, 4097 * 512)


def test_mid_sized_requests_share_a_20_mib_segment_and_a_fifth_takes_another():
    a = CachingAllocator()
    blocks = [a.malloc(5 * MiB) for _ in range(4)]
    assert a.segments == 1 and [b.address for b in blocks] == [0, 5 * MiB, 10 * MiB, 15 * MiB]  # the front each time
    a.malloc(5 * MiB)
    assert (a.segments, a.reserved_bytes) == (2, 40 * MiB)


def test_a_large_block_is_split_only_when_more_than_1_mib_would_remain():
    a = CachingAllocator()
    a.free(a.malloc(12 * MiB))
    whole = a.malloc(11 * MiB)  # 1 MiB would remain: handed out whole, and counted whole
    assert whole.size == 12 * MiB and a.allocated_bytes == 12 * MiB and a.segments == 1
    a.free(whole)
    part = a.malloc(10 * MiB)  # 2 MiB remain: split
    assert part.size == 10 * MiB and a.allocated_bytes == 10 * MiB and a.segments == 1


def test_the_best_fit_is_the_smallest_free_block_that_holds_the_request():
    a = CachingAllocator()
    big, small = a.malloc(30 * MiB), a.malloc(14 * MiB)
    a.free(big)
    a.free(small)
    assert a.malloc(13 * MiB).address == small.address and a.segments == 2


def test_a_freed_block_merges_with_its_free_neighbours():
    a = CachingAllocator()
    x, y, z = (a.malloc(5 * MiB) for _ in range(3))
    a.free(x)
    a.free(y)
    assert [size for size, *_ in a.free_blocks[(0, False)]] == [5 * MiB, 10 * MiB]  # z's tail; x and y one block
    assert a.malloc(9 * MiB).address == x.address and a.segments == 1


def test_a_tensor_kept_between_two_frees_fragments_the_segment():
    a = CachingAllocator()
    first = a.malloc(100 * MiB)
    a.free(first)
    kept = a.malloc(10 * MiB)  # carved from the front of the freed 100 MiB
    a.malloc(100 * MiB)  # 90 MiB remain free there: the next 100 MiB needs a segment of its own
    assert kept.address == 0 and a.reserved_bytes == 200 * MiB and a.allocated_bytes == 110 * MiB


def test_a_block_freed_on_one_stream_serves_only_that_stream():
    a = CachingAllocator()
    a.free(a.malloc(50 * MiB, stream="side"))
    a.malloc(50 * MiB)  # the default stream
    assert a.segments == 2
    a.malloc(50 * MiB, stream="side")
    assert a.segments == 2


def test_past_the_device_memory_the_cache_is_released_and_the_request_retried():
    a = CachingAllocator(capacity_bytes=100 * MiB)
    a.free(a.malloc(60 * MiB))
    a.malloc(60 * MiB + 512)  # does not fit the cached 60 MiB: its segment is released, then the retry succeeds
    assert (a.retries, a.reserved_bytes, a.peak_reserved_bytes) == (1, 62 * MiB, 62 * MiB)
    with pytest.raises(MemoryError, match="cannot reserve"):
        a.malloc(60 * MiB)


# expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): one growing segment per pool and stream


def test_expandable_segments_grow_by_2_mib_pages_in_the_small_pool_and_20_mib_in_the_large():
    a = CachingAllocator(expandable_segments=True)
    for _ in range(4096):
        a.malloc(512)
    assert (a.segments, a.reserved_bytes) == (1, 2 * MiB)
    a.malloc(100)  # one page more, in the same segment
    assert (a.segments, a.reserved_bytes, a.allocated_bytes) == (1, 4 * MiB, 4097 * 512)
    blocks = [a.malloc(5 * MiB) for _ in range(5)]  # the large pool: a segment of its own, one 20 MiB page for four
    assert [b.address - blocks[0].address for b in blocks] == [0, 5 * MiB, 10 * MiB, 15 * MiB, 20 * MiB]
    assert (a.segments, a.reserved_bytes) == (2, 4 * MiB + 40 * MiB)


def test_expandable_segments_map_only_the_pages_a_free_tail_lacks():
    a = CachingAllocator(expandable_segments=True)
    first = a.malloc(100 * MiB)
    a.free(first)
    kept = a.malloc(10 * MiB)  # the front of the freed 100 MiB
    big = a.malloc(100 * MiB)  # 90 MiB free at the end: one page (20 MiB) more, where the default rules take 100 MiB
    assert (kept.address, big.address - first.address) == (first.address, 10 * MiB)
    assert (a.reserved_bytes, a.allocated_bytes) == (120 * MiB, 110 * MiB)
    default = CachingAllocator()
    default.free(default.malloc(100 * MiB))
    default.malloc(10 * MiB)
    default.malloc(100 * MiB)
    assert default.reserved_bytes == 200 * MiB


def test_expandable_segments_split_any_remainder_of_512_bytes_in_the_large_pool_too():
    a = CachingAllocator(expandable_segments=True)
    a.free(a.malloc(12 * MiB))
    block = a.malloc(11 * MiB)  # the default rules hand out the whole 12 MiB
    assert block.size == 11 * MiB and a.allocated_bytes == 11 * MiB


def test_expandable_best_fit_passes_a_block_that_could_grow_for_a_larger_one_that_cannot():
    a = CachingAllocator(expandable_segments=True)
    first = a.malloc(30 * MiB)  # two pages: 10 MiB free after it
    a.malloc(10 * MiB)  # takes those 10 MiB
    last = a.malloc(5 * MiB)  # a third page: 15 MiB free at the end, before the unmapped addresses
    a.free(first)  # 30 MiB free inside
    assert a.malloc(12 * MiB).address == first.address  # not the 15 MiB at the end (get_free_block's expandable_size)
    assert a.reserved_bytes == 60 * MiB
    a.free(last)  # 18 MiB free inside, 20 MiB at the end
    a.release_cache()  # the whole pages inside free blocks are unmapped: the last page only
    assert a.reserved_bytes == 40 * MiB and [h.address - first.address for h in a.unmapped[(0, False)]] == [40 * MiB]


def test_expandable_segments_past_the_device_memory_unmap_free_pages_and_retry():
    a = CachingAllocator(capacity_bytes=100 * MiB, expandable_segments=True)
    held = a.malloc(50 * MiB)  # three pages
    a.malloc(30 * MiB)  # 10 MiB free at the end, a page more: 80 MiB mapped
    a.free(held)
    a.malloc(60 * MiB)  # 60 MiB more would pass 100: the two whole pages inside the freed 50 MiB are unmapped
    assert (a.retries, a.reserved_bytes) == (1, 100 * MiB)
    with pytest.raises(MemoryError, match="cannot map"):
        a.malloc(20 * MiB)


def test_replay_frees_by_key_and_takes_no_block_for_zero_bytes():
    a = replay([("x", 5 * MiB, 0), ("e", 0, 0), ("x", None, 0), ("e", None, 0), ("y", 3 * MiB, 0)])
    assert (a.allocated_bytes, a.reserved_bytes) == (3 * MiB, 20 * MiB)
    with pytest.raises(ValueError, match="allocated twice"):
        replay([("x", 1, 0), ("x", 1, 0)])


def test_a_meters_events_add_up_to_its_peak_and_carry_their_stream():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    with MemoryMeter("cpu", every_record=True) as meter:
        meter.track(model, x)
        model(x).square().sum().backward()
        meter.stream = "side"
        side = torch.empty(1000)
    events = meter_events(meter)
    live, now, peak = {}, 0, 0
    for key, nbytes, _ in events:
        now += -live.pop(key) if nbytes is None else live.setdefault(key, nbytes)
        peak = max(peak, now)
    assert peak == meter.peak_bytes > 0 and now == meter.current_bytes
    assert events[-1] == (events[-1][0], side.untyped_storage().nbytes(), "side")
    assert {stream for *_, stream in events[:-1]} == {0}
    with pytest.raises(ValueError, match="every_record"):
        meter_events(MemoryMeter("cpu"))


def test_what_a_selected_stream_allocates_is_tagged_with_it():
    original = torch.cpu.stream
    with MemoryMeter("cpu", every_record=True) as meter, cpu_stream_tags(meter):
        kept = [torch.empty(100)]
        side = torch.cpu.Stream()
        with torch.cpu.stream(side):
            kept.append(torch.empty(200))
            with torch.cpu.stream(torch.cpu.Stream()):
                kept.append(torch.empty(300))
            kept.append(torch.empty(400))
        with torch.cpu.stream(side):
            kept.append(torch.empty(500))
        kept.append(torch.empty(600))
    assert [s for _, n, s in meter_events(meter) if n] == [0, 1, 2, 1, 1, 0]
    assert torch.cpu.stream is original


# a small Llama-style model, its own shape (the plan's memo keys steps by model: a shape no other test plans)
SMALL = GPTConfig(n_layer=3, n_embd=40, n_head=4, block_size=24, vocab_size=88, bias=False, mlp="swiglu",
                  mlp_hidden=96, norm="rms", pos="rope", attn="sdpa", fused_qkv=False, tie_weights=False)


def test_fsdp2s_side_streams_are_pools_of_their_own_in_the_replay(monkeypatch):
    seen = []
    monkeypatch.setattr(P, "replay", lambda events, **rules: seen.append(events) or replay(events, **rules))
    monkeypatch.setattr(P, "_PLANNED", {})  # (each step run here, not taken from another test's memo)
    monkeypatch.setattr(estimate, "_REMEMBERED", {})
    sharded = P.Combination(2, "fsdp2-reshard", 2, 1, "none", P.MIXED_POLICY, adam_impl="foreach")
    ((peak, reserved, allocated, reserved_expandable),) = P.replayed([(SMALL, sharded, 24)], workers=1)
    streams = {s for *_, s in seen[-1]}
    assert 0 in streams and len(streams) >= 3, streams  # FSDP2's all-gather copy-in and reduce-scatter streams
    again = replay(seen[-1])
    assert (reserved, allocated) == (again.peak_reserved_bytes, again.peak_allocated_bytes)
    assert reserved_expandable == replay(seen[-1], expandable_segments=True).peak_reserved_bytes >= allocated
    assert reserved >= allocated >= peak  # (rounded up to 512 B and whole blocks: allocated >= requested)
    assert reserved > replay([(k, n, 0) for k, n, _ in seen[-1]]).peak_reserved_bytes  # one pool: fewer segments
    single = P.Combination(1, "single", 4, 1, "every", "bf16", adam_impl="foreach")
    P.replayed([(SMALL, single, 24)], workers=1)
    assert {s for *_, s in seen[-1]} == {0}
    with pytest.raises(ParameterError, match="ddp, Adam on the device, 1 micro-batches"):
        P.replayed([(SMALL, P.Combination(2, "ddp", 2, 1, "none", "fp32"), 24)])


def _canonical(events: list) -> list:
    """Return events [(key, nbytes or None, stream)] without their keys: an allocation (nbytes, stream), a free the
    index of the allocation it ends."""
    index, out = {}, []
    for key, nbytes, stream in events:
        if nbytes is None:
            out.append(("free", index.pop(key)))
        else:
            index[key] = len(out)
            out.append((nbytes, stream))
    return out


DEEPER = dataclasses.replace(SMALL, n_layer=P.SHARDED_DEPTHS[1] + 1)  # past FSDP2's small depths (and the others')


@pytest.mark.parametrize("comb", [P.Combination(2, "fsdp2-reshard", 1, 2, "full", P.MIXED_POLICY, adam_impl="foreach"),
                                  P.Combination(2, "fsdp2", 2, 1, "op", "fp32", adam_impl="for-loop"),
                                  P.Combination(1, "single", 1, 2, "none", "bf16", adam_impl="fused"),
                                  P.Combination(1, "single", 2, 1, "every", "fp32", adam_impl="foreach")],
                         ids=["fsdp2-reshard-full-foreach-accum", "fsdp2-op-for-loop", "single-none-fused-accum",
                              "single-every-foreach"])
def test_a_full_depths_allocations_written_from_two_small_depths_are_its_fake_steps(comb, monkeypatch):
    """labkit.planner.events.deeper: the allocations and frees of two small depths, written out to the full depth,
    are the full-depth fake step's, event for event; a replay takes them, not a full-depth step, and gives its figures."""
    from labkit.planner.events import deeper, peak_bytes
    monkeypatch.setattr(P, "FULL_MAX_LAYERS", 3)  # the fast path on a small model
    monkeypatch.setattr(estimate, "_REMEMBERED", {})
    monkeypatch.delenv(estimate.SHARED_DIR_ENV, raising=False)
    spec, step = P.model_spec(DEEPER), P.combination_fake_step(comb, 24)
    depths = P.SHARDED_DEPTHS if step.shard else P.REPLAY_DEPTHS
    small, big = (P._fake_run(spec, step, d, reserved="tagged")[2]["events"] for d in depths)
    full = [e[:3] for e in P._fake_run(spec, step, DEEPER.n_layer, reserved="tagged")[2]["events"]]
    written = deeper(small, big, depths, DEEPER.n_layer)
    assert written is not None and _canonical(written) == _canonical(full)
    default, grown = replay(full), replay(full, expandable_segments=True)
    assert P._replay(spec, step) == (peak_bytes(full), default.peak_reserved_bytes, default.peak_allocated_bytes,
                                     grown.peak_reserved_bytes)
    assert not any(k[2] == DEEPER.n_layer and k[6] is True for k in estimate._REMEMBERED)  # (no full-depth replay)
    # a block that allocates otherwise than the others: not repeated, so not written out
    at = next(i for i, (_, n, _, tag) in enumerate(big) if n and tag[2] == depths[1] // 2 and tag[1] == "backward")
    odd = big[:at] + [(*big[at][:1], big[at][1] + 512, *big[at][2:])] + big[at + 1:]
    assert deeper(small, odd, depths, DEEPER.n_layer) is None


def test_adam_on_the_local_shards_allocates_what_it_does_on_dtensors(monkeypatch):
    import contextlib

    combs = [P.Combination(2, "fsdp2", 2, 1, "full", P.MIXED_POLICY, adam_impl=impl) for impl in P.ADAM_IMPLS]
    on_shards = P.replayed([(SMALL, c, 24) for c in combs], workers=1)
    monkeypatch.setattr(P, "_local_adam", contextlib.nullcontext)  # DTensor's own foreach and fused operators
    monkeypatch.setattr(P, "_PLANNED", {})
    monkeypatch.setattr(estimate, "_REMEMBERED", {})
    assert P.replayed([(SMALL, c, 24) for c in combs], workers=1) == on_shards


def test_replays_shared_among_worker_processes_give_the_same_figures(monkeypatch):
    # two models' steps in one call: both processes take steps of either (one per process here)
    runs = [(SMALL, P.Combination(2, "fsdp2-reshard", 2, 1, "none", "bf16"), 24),
            (dataclasses.replace(SMALL, n_layer=2), P.Combination(2, "fsdp2-reshard", 2, 1, "full", "bf16"), 24)]
    here = [P.replayed([run], workers=1)[0] for run in runs]
    assert here[0] != here[1]
    monkeypatch.setattr(P, "_PLANNED", {})
    monkeypatch.setattr(estimate, "_REMEMBERED", {})
    monkeypatch.setattr(P, "MIN_GROUPS_PER_WORKER", 99)  # (a replay is worth a worker whatever the others' rule)
    started = []
    real = P.ChildProcesses.start_forked
    monkeypatch.setattr(P.ChildProcesses, "start_forked",
                        lambda self, *a, **k: started.append(a) or real(self, *a, **k))
    assert P.replayed(runs, workers=2) == here
    assert len(started) == 1  # one worker process beside this one


def test_a_plan_replays_its_front_rows_at_full_depth():
    p = P.plan(SMALL, "a100-80gb", 2, 24, 4, precisions=("bf16", P.MIXED_POLICY), checkpointing=("none", "full"),
               offload=(False,), optimizers=("device",), parallels=("single", "ddp", "fsdp2-reshard"),
               reserved=True, workers=1)
    replayed = [r for r in p.rows if r.reserved_bytes is not None]
    assert replayed and all(r in p.pareto for r in replayed)
    assert all(r.combination.parallel != "ddp" and r.combination.accum_steps <= 2 for r in replayed)
    for r in replayed:
        assert P.replayed([(SMALL, r.combination, 24)], workers=1)[0][:2] == (r.peak_bytes, r.reserved_bytes)
    table = P.format_plan(p)
    assert "reserved" in table.splitlines()[3] and "reserved: the caching allocator's reserved peak" in table
    for r in replayed:  # what nvidia-smi would show: the replay's reserve, the CUDA context and NCCL's buffers
        outside = overheads.non_tensor_bytes("a100-80gb", r.combination.ranks, r.combination.parallel)
        assert r.used_bytes == (r.reserved_bytes + outside.total[0], r.reserved_bytes + outside.total[1])
        assert r.fits and r.fits_by == "replay"
    assert {r.fits_by for r in p.rows if id(r) not in map(id, replayed)} <= {"tensors", "reserve"}
    assert "used (what nvidia-smi would show) = reserved + " in table
    assert "no row left the front once replayed" in table
    assert "reserved" not in P.format_plan(P.plan(SMALL, "a100-80gb", 1, 24, 4, precisions=("bf16",),
                                                  checkpointing=("none",), offload=(False,), workers=1)).splitlines()[3]
    # the same plan under expandable segments' rules: each front row's reserved peak is that replay's (no step more)
    grow = P.plan(SMALL, "a100-80gb", 2, 24, 4, precisions=("bf16", P.MIXED_POLICY), checkpointing=("none", "full"),
                  offload=(False,), optimizers=("device",), parallels=("single", "ddp", "fsdp2-reshard"),
                  reserved=True, expandable_segments=True, workers=1)
    for r in (r for r in grow.rows if r.reserved_bytes is not None):
        assert P.replayed([(SMALL, r.combination, 24)], workers=1)[0][3] == r.reserved_bytes
    assert "rules with expandable_segments:True" in P.format_plan(grow)
    assert "rules with expandable_segments:True" not in table
    with pytest.raises(ParameterError, match="expandable_segments: the rules of a reserved peak"):
        P.plan(SMALL, "a100-80gb", 1, 24, 4, expandable_segments=True)
    with pytest.raises(ParameterError, match="reserved: the CUDA caching allocator's reserved peak, a GPU's"):
        P.plan(SMALL, dataclasses.replace(device_profile("t4"), name="cpu"), 1, 24, 4, reserved=True)


def test_a_reserved_plans_verdict_is_the_replay_and_a_refused_row_leaves_the_front():
    kwargs = dict(precisions=("bf16", P.MIXED_POLICY), checkpointing=("none", "full"), offload=(False,),
                  optimizers=("device",), parallels=("single", "fsdp2-reshard"), reserved=True, workers=1)
    roomy = P.plan(SMALL, "a100-80gb", 2, 24, 4, **kwargs)
    best = roomy.fastest
    assert best.fits_by == "replay" and best.reserved_bytes > best.peak_bytes  # (whole segments: room to refuse it)
    # a GPU that holds what that row would show used, but not with the replay's margin on its reserve
    outside = best.used_bytes[1] - best.reserved_bytes
    tight = dataclasses.replace(device_profile("a100-80gb"), memory_bytes=best.used_bytes[1] + best.reserved_bytes // 20)
    assert best.reserved_bytes * (1 + P.REPLAY_MARGIN) + outside > tight.memory_bytes
    p = P.plan(SMALL, tight, 2, 24, 4, **kwargs)
    again = next(r for r in p.rows if r.combination == best.combination)
    assert best.peak_bytes + outside <= tight.memory_bytes  # its tensors fit ...
    assert (again.fits, again.fits_by, again.reserved_bytes) == (False, "replay", best.reserved_bytes)  # ... not it
    assert p.fastest is not None and p.fastest.combination != best.combination
    assert all(r.fits_by in ("replay", "reserve") for r in p.pareto)  # every row of the new front was replayed ...
    front_before = {r.combination for r in roomy.pareto}
    assert any(r.fits_by == "replay" and r.combination not in front_before for r in p.pareto)  # ... in a later round
    for r in p.pareto:
        if r.fits_by == "replay":
            assert r.reserved_bytes * (1 + P.REPLAY_MARGIN) + (r.used_bytes[1] - r.reserved_bytes) <= tight.memory_bytes
    table = P.format_plan(p)
    refused = [r for r in p.rows if r.fits_by == "replay" and not r.fits]
    assert f"left the front once replayed (the fastest: {P.combination_words(min(refused, key=lambda r: r.step_s).combination)}" \
        in table, table
    assert "yes*" not in table.split("fits: ")[0]  # (the front: every row replayed, or judged by the reserve)
    everything = P.format_plan(roomy, all_rows=True)  # off the front, not replayed: by their tensors only
    assert any(r.fits_by == "tensors" for r in roomy.rows) and "yes*" in everything.split("fits: ")[0]
    assert "yes*/no*: not replayed (off the front)" in everything


def test_a_reserved_plan_past_nccls_model_judges_the_replay_against_the_budget():
    # two PCIe GPUs: NCCL's buffers are not modelled there (labkit.planner.overheads), the reserve stands for them
    p = P.plan(SMALL, "l4", 2, 24, 4, precisions=(P.MIXED_POLICY,), checkpointing=("none",), offload=(False,),
               optimizers=("device",), parallels=("fsdp2-reshard",), micro_batches=(2,), reserved=True, workers=1)
    (row,) = p.pareto
    assert row.fits_by == "replayed reserve" and row.used_bytes is None
    assert row.fits == (row.reserved_bytes * (1 + P.REPLAY_MARGIN) <= p.budget_bytes)
    assert "not modelled (NCCL's buffers past one server or between PCIe GPUs)" in P.format_plan(p)


RANDOM_EVENTS = """
import random
MiB = 2**20


def random_events(n, seed):
    rng, live, events = random.Random(seed), [], []
    for i in range(n):
        if live and rng.random() < 0.45:
            events.append((live.pop(rng.randrange(len(live))), None, 0))
        else:
            nbytes = rng.choice([rng.randrange(1, 4096), rng.randrange(1, 2 * MiB), rng.randrange(MiB, 12 * MiB),
                                 rng.randrange(10 * MiB, 64 * MiB)])
            events.append((i, nbytes, 0))
            live.append(i)
    return events
"""

ON_CUDA = RANDOM_EVENTS + """
import os
import torch
from labkit.planner.allocator import replay
expandable = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
for seed in range(3):
    events = random_events(400, seed)
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == 0
    torch.cuda.reset_peak_memory_stats()
    live = {}
    for key, nbytes, _ in events:
        if nbytes is None:
            del live[key]
        else:
            live[key] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    cuda = torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    del live
    a = replay(events, expandable_segments=expandable)
    print(seed, expandable, cuda, (a.reserved_bytes, a.peak_reserved_bytes, a.peak_allocated_bytes))
    assert cuda == (a.reserved_bytes, a.peak_reserved_bytes, a.peak_allocated_bytes), seed
"""


def test_the_random_sequence_fragments_and_reuses():
    # the sequence the CUDA test replays exercises every rule: both pools, splits, merges, new segments
    scope = {}
    exec(RANDOM_EVENTS, scope)
    a = replay(scope["random_events"](400, 0))
    assert a.segments > 5 and a.peak_reserved_bytes > a.peak_allocated_bytes > 0
    assert {small for _, small in a.free_blocks} == {True, False}
    grown = replay(scope["random_events"](400, 0), expandable_segments=True)  # pages mapped, both pools: fewer holes
    assert grown.segments == 2 and a.peak_reserved_bytes > grown.peak_reserved_bytes > grown.peak_allocated_bytes


@pytest.mark.cuda
@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_the_replay_reserves_what_cudas_allocator_reserves(conf):
    # a process of its own: the comparison needs an allocator that holds nothing else, configured before CUDA starts
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
    out = subprocess.run([sys.executable, "-c", ON_CUDA], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
