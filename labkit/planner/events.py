"""A step's allocations at full depth from its allocations at two small depths, one block apart, exact.

A transformer's blocks are identical, so a fake step of `n` blocks allocates, block by block, what a step of `n + 1`
allocates, one block's allocations more in every pass over the blocks. `deeper` checks that two traced steps (their
allocations and frees tagged with the micro-batch, phase and block running: labkit.planner.plan._tagged_events) repeat
so, every allocation and free of one block the same as the next one's, and writes out the events of the full depth:
what the caching allocator's replay (labkit.planner.allocator.replay) takes, as a full-depth fake step gives them
(tests/test_allocator.py). Where they do not repeat so, it returns None and the caller runs the full depth.

A free names the allocation it ends by where that was made: the segment (a run of events with one tag), counted from
its block (relative to the freeing block, or from the first block or the last), the segment's occurrence and the
allocation's index in it, each counted from the start or from the end; every way that holds at both depths and in
every block is kept, and the full depth is written with the first of them.
"""

from __future__ import annotations

import itertools


def _position(pos, depth: int, apart: tuple):
    """Return how `pos` repeats: ("block",) for a repeated block, else pos itself, "last" for the last block when it
    stands apart (apart: (first blocks apart, the last apart))."""
    if not isinstance(pos, int):
        return pos
    if apart[1] and pos == depth - 1:
        return "last"
    return pos if pos < apart[0] else ("block",)


def _segments(events: list, depth: int) -> list | None:
    """Return [(micro, phase, pos, occurrence, tokens)]: `events` [(key, nbytes, stream, (micro, phase, pos))] cut where
    the tag changes, each allocation a token (nbytes, stream), each free ("free", micro, phase, ways): the ways to name
    where its allocation was made (module docstring); None where a free names no allocation."""
    out, seen, names, prev, j, frees = [], {}, {}, None, 0, []
    for key, nbytes, stream, tag in events:
        if tag != prev:
            seen[tag] = seen.get(tag, -1) + 1
            out.append((*tag, seen[tag], []))
            prev, j = tag, 0
        micro, phase, pos, r, tokens = out[-1]
        if nbytes is not None:
            names[key] = (micro, phase, pos, r, j)
            tokens.append((nbytes, stream))
            j += 1
            continue
        if key not in names:
            return None
        frees.append((tokens, len(tokens), pos, names.pop(key)))
        tokens.append(None)
    made = {(m, ph, p, r): sum(t is not None and t[0] != "free" for t in tokens) for m, ph, p, r, tokens in out}
    for tokens, i, pos, (am, aph, apos, ar, aj) in frees:
        if isinstance(pos, int) and isinstance(apos, int):
            wheres = (("rel", apos - pos),)
        elif isinstance(apos, int):
            wheres = (("start", apos), ("end", apos - depth))
        else:
            wheres = (("abs", apos),)
        occurrences = (("s", ar), ("e", seen[am, aph, apos] - ar))
        indices = (("s", aj), ("e", made[am, aph, apos, ar] - 1 - aj))
        tokens[i] = ("free", am, aph, frozenset(itertools.product(wheres, occurrences, indices)))
    return out


def _meet(a: list, b: list) -> list | None:
    """Return tokens `a` and `b` met: allocations equal, each free's ways those both hold; None where they differ."""
    if len(a) != len(b):
        return None
    out = []
    for x, y in zip(a, b):
        if x[0] != "free" or y[0] != "free":
            if x != y:
                return None
            out.append(x)
            continue
        ways = x[3] & y[3]
        if x[:3] != y[:3] or not ways:
            return None
        out.append((*x[:3], ways))
    return out


def _shape(segments: list, depth: int, apart: tuple) -> list | None:
    """Return the segments as ("segment", micro, phase, position, occurrence, tokens), each pass over the repeated
    blocks as one ("blocks", micro, phase, order, occurrence, tokens) (order 1: first to last, -1: back, 0: one block),
    its tokens met over its blocks; None where a pass is not every block once, in order, alike."""
    n = depth - apart[0] - apart[1]
    out, i = [], 0
    while i < len(segments):
        micro, phase, pos, r, tokens = segments[i]
        kind = _position(pos, depth, apart)
        if kind != ("block",):
            out.append(("segment", micro, phase, kind, r, tokens))
            i += 1
            continue
        run = segments[i:i + n]
        order = [s[2] for s in run]
        first = list(range(apart[0], apart[0] + n))
        if len(run) < n or order not in (first, first[::-1]) or any((s[0], s[1], s[3]) != (micro, phase, r)
                                                                     for s in run):
            return None
        for s in run[1:]:
            tokens = _meet(tokens, s[4])
            if tokens is None:
                return None
        out.append(("blocks", micro, phase, 0 if n == 1 else 1 if order == first else -1, r, tokens))
        i += n
    return out


def _template(small: list, big: list) -> list | None:
    """Return the big depth's shape, its tokens met with the small depth's, where both shapes match part by part."""
    if len(small) != len(big):
        return None
    out = []
    for a, b in zip(small, big):
        if a[:3] != b[:3] or a[4] != b[4] or a[3] != b[3] and not (a[0] == "blocks" and a[3] == 0):
            return None
        tokens = _meet(a[5], b[5])
        if tokens is None:
            return None
        out.append((*b[:5], tokens))
    return out


def _write(template: list, n_layer: int, apart: tuple) -> list:
    """Return the events [(key, nbytes or None, stream)] of `template` at `n_layer` blocks (keys: where each block
    was allocated, at that depth)."""
    n = n_layer - apart[0] - apart[1]
    segments = []  # (micro, phase, position, occurrence, tokens) at the full depth, in order
    for kind, micro, phase, where, r, tokens in template:
        if kind == "blocks":
            positions = range(apart[0], apart[0] + n)
            segments.extend((micro, phase, p, r, tokens) for p in (positions if where != -1 else reversed(positions)))
        else:
            segments.append((micro, phase, n_layer - 1 if where == "last" else where, r, tokens))
    seen, made = {}, {}
    for micro, phase, pos, r, tokens in segments:
        seen[micro, phase, pos] = seen.get((micro, phase, pos), 0) + 1
        made[micro, phase, pos, r] = sum(t[0] != "free" for t in tokens)
    out = []
    for micro, phase, pos, r, tokens in segments:
        j = 0
        for token in tokens:
            if token[0] != "free":
                out.append(((micro, phase, pos, r, j), *token))
                j += 1
                continue
            _, am, aph, ways = token
            (how, at), (oc, ar), (ic, aj) = min(ways, key=repr)  # (any way both depths hold: the first, by name)
            apos = pos + at if how == "rel" else n_layer + at if how == "end" else at
            ar = ar if oc == "s" else seen[am, aph, apos] - 1 - ar
            aj = aj if ic == "s" else made[am, aph, apos, ar] - 1 - aj
            out.append(((am, aph, apos, ar, aj), None, None))
    return out


def deeper(small: list, big: list, depths: tuple, n_layer: int) -> list | None:
    """Return the allocations and frees [(key, nbytes or None, stream)] of the step at `n_layer` blocks, in order, from
    its tagged events at `depths` (d, d + 1) blocks, [(key, nbytes or None, stream, (micro, phase, position))]; None
    where they do not repeat block by block (the first blocks and the last tried apart, as FSDP2's prefetch sets them).
    """
    d0, d1 = depths
    segs = [_segments(events, d) for events, d in ((small, d0), (big, d1))]
    if None in segs:
        return None
    for apart in ((0, False), (0, True), (1, True), (2, True)):
        if d1 - sum(apart) < 2 or n_layer - sum(apart) < 1:  # (two blocks alike at the larger depth, at the least)
            continue
        shapes = [_shape(s, d, apart) for s, d in zip(segs, depths)]
        template = None if None in shapes else _template(*shapes)
        if template is not None:
            return _write(template, n_layer, apart)
    return None


def peak_bytes(events: list) -> int:
    """Return the most bytes `events` [(key, nbytes or None, stream)] hold at once."""
    held, now, peak = {}, 0, 0
    for key, nbytes, _ in events:
        if nbytes is None:
            now -= held.pop(key)
        else:
            held[key] = nbytes
            now += nbytes
            peak = max(peak, now)
    return peak
