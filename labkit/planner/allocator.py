"""Replay a step's allocations through the CUDA caching allocator's rules: the reserved bytes its tensors need.

A training step's tensors are exact on fake tensors (labkit.meter); what `torch.cuda.max_memory_reserved` reports is
more: the caching allocator keeps freed blocks in its segments for reuse and asks CUDA for a new segment when no cached
block fits. `CachingAllocator` follows its default rules (c10/cuda/CUDACachingAllocator.cpp, no PYTORCH_CUDA_ALLOC_CONF;
the constants below are that file's): requests rounded up to 512 B; requests of at most 1 MiB served from 2 MiB
segments (the small pool), those under 10 MiB from 20 MiB segments, larger ones from a segment of their size rounded up
to 2 MiB; the best fit among the free blocks of the same pool and stream (the smallest, then the lowest address); a
block split when what remains is at least 512 B (small pool) or more than 1 MiB (large pool), the front handed out;
a freed block merged with its free neighbours in its segment; segments kept, never returned, until a request would
pass the device's memory (then every wholly free segment is released and the request retried).

With `expandable_segments=True` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, torchtitan's launcher's setting) it
follows that option's rules instead (the same file, Note [Expandable Segments]): each pool of each stream is one segment
of virtual addresses that grows by mapping pages, 2 MiB in the small pool and 20 MiB in the large one; a request no
free block holds maps the pages it lacks at the lowest unmapped addresses with room (the segment's end, until a release
unmaps pages inside it; a free block just before them counted in); any remainder of at least 512 B is split off in both
pools; the best fit moves on from the smallest block that holds the request to the next larger one while that one's
size plus the unmapped pages just after it is smaller (get_free_block's expandable_size); a freed block merges with
its free mapped neighbours, and nothing is unmapped until the cache is released (then the whole pages inside free
blocks). The reserved bytes are the pages mapped.

Not modelled: `max_split_size_mb`, `roundup_power2_divisions`, `large_segment_size_mb`, garbage collection, CUDA
graphs' pools, an expandable segment's limited addresses (1.125 x the GPU's memory: a new segment past them), and the
frees a stream's pending work delays (record_stream): a block is reusable once its tensor dies.
"""

from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass, field

import torch

MIN_BLOCK_BYTES = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_BYTES = 1 << 20  # kSmallSize: the largest request served from the small pool
SMALL_SEGMENT_BYTES = 2 << 20  # kSmallBuffer: the small pool's segments
LARGE_SEGMENT_BYTES = 20 << 20  # kLargeBuffer: the segment for a request between 1 and 10 MiB
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc: from here on a segment is the request rounded to ROUND_LARGE_BYTES
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge


def round_size(nbytes: int) -> int:
    """Return the bytes the allocator hands out for a request of `nbytes` (round_size: a multiple of 512, at least
    one)."""
    return MIN_BLOCK_BYTES * max(1, -(-nbytes // MIN_BLOCK_BYTES))


def segment_size(nbytes: int) -> int:
    """Return the segment a rounded request of `nbytes` makes the allocator reserve (get_allocation_size)."""
    if nbytes <= SMALL_BYTES:
        return SMALL_SEGMENT_BYTES
    if nbytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return ROUND_LARGE_BYTES * -(-nbytes // ROUND_LARGE_BYTES)


@dataclass(eq=False)
class Block:
    """A piece of one segment: handed out to a tensor, or free in its pool."""

    address: int  # its first byte (segments lie one after another in a made-up address space)
    size: int  # bytes
    pool: tuple  # (stream, small?): where it is cached when free
    allocated: bool = False
    mapped: bool = True  # False: unmapped addresses of an expandable segment (taking no memory)
    prev: Block | None = field(default=None, repr=False)  # the block just before it in its segment
    next: Block | None = field(default=None, repr=False)  # the block just after it


class CachingAllocator:
    """The CUDA caching allocator's segments and counters for a sequence of mallocs and frees (see the module)."""

    def __init__(self, capacity_bytes: int | None = None, expandable_segments: bool = False):
        self.capacity_bytes = capacity_bytes  # the device's memory: a segment past it releases the cache (None: none)
        self.expandable_segments = expandable_segments  # the option's rules (see the module)
        self.unmapped: dict[tuple, list] = {}  # pool -> its expandable segment's unmapped blocks, by address
        self._base: dict[tuple, int] = {}  # pool -> its expandable segment's first address (pages count from it)
        self.free_blocks: dict[tuple, list] = {}  # pool -> sorted [(size, address, id)] of its free blocks
        self._blocks: dict[int, Block] = {}  # id -> a free block
        self._top = 0  # the next segment's address
        self.allocated_bytes = self.peak_allocated_bytes = 0  # blocks handed out (rounded sizes, whole blocks)
        self.reserved_bytes = self.peak_reserved_bytes = 0  # segments
        self.segments = 0  # segments reserved now
        self.retries = 0  # times the cache was released to make room (num_alloc_retries)

    def malloc(self, nbytes: int, stream: object = 0) -> Block:
        """Hand out a block for `nbytes` on `stream`; MemoryError where the device lacks room even with the cache
        freed."""
        size = round_size(nbytes)
        pool = (stream, size <= SMALL_BYTES)
        block = self._best_fit(pool, size) or (self._expand(pool, size) if self.expandable_segments
                                               else self._new_segment(pool, size))
        remaining = block.size - size
        if remaining >= MIN_BLOCK_BYTES if pool[1] or self.expandable_segments else remaining > SMALL_BYTES:
            # should_split: the front handed out
            rest = Block(block.address + size, remaining, pool, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._cache(rest)
        block.allocated = True
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return block

    def free(self, block: Block) -> None:
        """Return `block` to its pool, merged with its free neighbours."""
        block.allocated = False
        self.allocated_bytes -= block.size
        self._merge(block)
        self._cache(block)

    def _merge(self, block: Block) -> None:
        """Merge `block` with its neighbours that are free and mapped as it is (taken out of their list)."""
        for side in (block.prev, block.next):
            if side is not None and not side.allocated and side.mapped == block.mapped:
                self._uncache(side)
                if side is block.prev:
                    block.address, block.prev = side.address, side.prev
                    if side.prev is not None:
                        side.prev.next = block
                else:
                    block.next = side.next
                    if side.next is not None:
                        side.next.prev = block
                block.size += side.size

    def _best_fit(self, pool: tuple, size: int) -> Block | None:
        free = self.free_blocks.get(pool, [])
        i = bisect.bisect_left(free, (size, -1, -1))
        if i == len(free):
            return None
        if self.expandable_segments:  # past a block that could grow, to the next larger one that could not as much
            while i + 1 < len(free) and self._reach(free[i + 1][2]) < self._reach(free[i][2]):
                i += 1
        block = self._blocks.pop(free.pop(i)[2])
        return block

    def _reach(self, block_id: int) -> int:
        """Return a free block's size with the unmapped block just after it (expandable_size)."""
        block = self._blocks[block_id]
        return block.size + (block.next.size if block.next is not None and not block.next.mapped else 0)

    def _expand(self, pool: tuple, size: int) -> Block:
        """Map the pages `size` bytes lack in the pool's expandable segment; return the free block that then holds
        them, out of its list (try_allocate_expandable_block; past the device's memory: the cache released and the
        request retried)."""
        for attempt in range(2):
            try:
                return self._mapped_for(pool, size)
            except _NoRoom:
                if attempt:
                    raise MemoryError(f"the allocator cannot map the pages {size} B need: {self.reserved_bytes} B "
                                      f"mapped, {self.allocated_bytes} B allocated, device {self.capacity_bytes} B")
                self.release_cache()
                self.retries += 1

    def _mapped_for(self, pool: tuple, size: int) -> Block:
        if pool not in self._base:  # the pool's first request: a segment of addresses, none mapped
            self._base[pool], self._top = self._top, self._top + (1 << 60)
            self.unmapped[pool] = [Block(self._base[pool], 1 << 60, pool, mapped=False)]
            self.segments += 1
        for hole in self.unmapped[pool]:  # the lowest unmapped block with room (find_expandable_block)
            block = hole.prev if hole.prev is not None and not hole.prev.allocated else hole
            room, b = 0, block
            while b is not None and not b.allocated and room < size:
                room, b = room + b.size, b.next
            if room >= size:
                break
        if not block.mapped:
            block = self._map(block, min(block.size, size))
        while block.size < size:
            block = self._map(block.next, min(size - block.size, block.next.size))
        self._uncache(block)
        return block

    def _map(self, hole: Block, nbytes: int) -> Block:
        """Map the whole pages that cover `nbytes` at the start of an unmapped block; return the free block they make,
        merged with its free neighbours (map_block)."""
        page = SMALL_SEGMENT_BYTES if hole.pool[1] else LARGE_SEGMENT_BYTES
        nbytes = min(hole.size, page * -(-nbytes // page))
        if self.capacity_bytes is not None and self.reserved_bytes + nbytes > self.capacity_bytes:
            raise _NoRoom
        block = Block(hole.address, nbytes, hole.pool, prev=hole.prev, next=hole)
        if hole.prev is not None:
            hole.prev.next = block
        hole.address, hole.size, hole.prev = hole.address + nbytes, hole.size - nbytes, block
        if hole.size == 0:
            self._uncache(hole)
            block.next = hole.next
            if hole.next is not None:
                hole.next.prev = block
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self._merge(block)
        self._cache(block)
        return block

    def _new_segment(self, pool: tuple, size: int) -> Block:
        nbytes = segment_size(size)
        if self.capacity_bytes is not None and self.reserved_bytes + nbytes > self.capacity_bytes:
            self.release_cache()  # release_cached_blocks, then the retry
            self.retries += 1
            if self.reserved_bytes + nbytes > self.capacity_bytes:
                raise MemoryError(f"the allocator cannot reserve {nbytes} B more: {self.reserved_bytes} B reserved, "
                                  f"{self.allocated_bytes} B allocated, device {self.capacity_bytes} B")
        block = Block(self._top, nbytes, pool)
        self._top += nbytes
        self.reserved_bytes += nbytes
        self.segments += 1
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return block

    def release_cache(self) -> None:
        """Return every wholly free segment to the device (torch.cuda.empty_cache); expandable segments: unmap the whole
        pages inside every free block."""
        if self.expandable_segments:
            for block in list(self._blocks.values()):
                self._unmap(block)
            return
        for block in [b for b in self._blocks.values() if b.prev is None and b.next is None]:
            self._uncache(block)
            self.reserved_bytes -= block.size
            self.segments -= 1

    def _unmap(self, block: Block) -> None:
        """Unmap the whole pages inside a free block of an expandable segment (unmap_block): its edges stay free."""
        page, base = SMALL_SEGMENT_BYTES if block.pool[1] else LARGE_SEGMENT_BYTES, self._base[block.pool]
        lo = base + page * -(-(block.address - base) // page)
        hi = base + page * ((block.address + block.size - base) // page)
        if hi <= lo:
            return
        self._uncache(block)
        pieces = [Block(a, b - a, block.pool, mapped=a != lo) for a, b in  # the middle one unmapped
                  ((block.address, lo), (lo, hi), (hi, block.address + block.size)) if b > a]
        for before, after in zip([block.prev, *pieces], [*pieces, block.next]):
            if before is not None:
                before.next = after
            if after is not None:
                after.prev = before
        self.reserved_bytes -= hi - lo
        for piece in pieces:
            if not piece.mapped:
                self._merge(piece)
            self._cache(piece)

    def _cache(self, block: Block) -> None:
        if not block.mapped:
            bisect.insort(self.unmapped[block.pool], block, key=lambda b: b.address)
            return
        self._blocks[id(block)] = block
        bisect.insort(self.free_blocks.setdefault(block.pool, []), (block.size, block.address, id(block)))

    def _uncache(self, block: Block) -> None:
        if not block.mapped:
            self.unmapped[block.pool].remove(block)
            return
        free = self.free_blocks[block.pool]
        del free[bisect.bisect_left(free, (block.size, block.address, id(block)))]
        del self._blocks[id(block)]


class _NoRoom(Exception):
    """Mapping a page would pass the device's memory."""


@contextlib.contextmanager
def cpu_stream_tags(meter):
    """Tag what `meter` sees with the stream torch.cpu.stream(s) selects around it (0: the stream current on entry).

    FSDP2 on a CPU fake step enters its all-gather copy-in, all-gather, reduce-scatter and all-reduce streams as it
    would on CUDA (torch.cpu's streams only select, they run nothing); on CUDA each is a pool of its own: a block freed
    on one is never handed out on another.
    """
    original, names = torch.cpu.stream, {id(torch.cpu.current_stream()): 0}

    @contextlib.contextmanager
    def tagged(stream):
        before = meter.stream
        if stream is not None:
            meter.stream = names.setdefault(id(stream), len(names))
        try:
            with original(stream):
                yield
        finally:
            meter.stream = before
    torch.cpu.stream = tagged
    try:
        yield
    finally:
        torch.cpu.stream = original


def meter_events(meter) -> list[tuple]:
    """Return a meter's device allocations and frees in order, [(key, nbytes, stream)] with nbytes None for a free:
    what `replay` takes (the meter made with every_record=True, so that it keeps every storage's record)."""
    if not meter.every_record:
        raise ValueError("meter_events needs a MemoryMeter(every_record=True)")
    events = []
    for r in meter._history:
        if not r.host:
            events.append((r.alloc_seq, id(r), r.nbytes, r.stream))
            if r.free_seq is not None:
                events.append((r.free_seq, id(r), None, r.stream))
    return [e[1:] for e in sorted(events, key=lambda e: e[0])]


def replay(events, capacity_bytes: int | None = None, expandable_segments: bool = False) -> CachingAllocator:
    """Replay `events` [(key, nbytes, stream)] (nbytes: allocate for key; None: free key's block); return the
    allocator (its default rules, or expandable segments').

    A request of 0 bytes takes no block (CUDA's allocator returns a null pointer); keys never freed stay allocated.
    """
    allocator, live = CachingAllocator(capacity_bytes, expandable_segments), {}
    for key, nbytes, stream in events:
        if nbytes is None:
            block = live.pop(key)
            if block is not None:
                allocator.free(block)
        else:
            if key in live:
                raise ValueError(f"replay: {key!r} allocated twice without a free")
            live[key] = allocator.malloc(nbytes, stream) if nbytes else None
    return allocator
