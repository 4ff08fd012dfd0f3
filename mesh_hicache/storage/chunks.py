"""Chunk geometry of format version 2 objects: the chunk size a writer uses for a row
and the chunk-aligned spans a ranged read fetches and verifies (``objects.py`` has the
format; these are pure functions of sizes and ranges)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import numpy as np

MIN_CHUNK_BYTES = 64
"""Smallest chunk of the table: bounds its size to 1/16 (CRC) or 1/8 (MAC) of the payload."""


def chunk_bytes_for(shape: Sequence[int], itemsize: int) -> int:
    """The chunk size a writer uses for a row of ``shape``: whole last-dim vectors (one
    head's ``D``, one token's key, ...), as few as reach ``MIN_CHUNK_BYTES``. Readers
    slice rows along outer dims, so their byte ranges start and end on such vectors."""
    last = (shape[-1] if shape else 1) * itemsize
    last = max(last, 1)
    return last * -(-MIN_CHUNK_BYTES // last)


def chunk_spans(
    ranges: Sequence[tuple[int, int]], nbytes: int, chunk_bytes: int, gap: int = 0
) -> list[tuple[int, int]]:
    """Merged ``[start, stop)`` spans on chunk bounds of a ``nbytes`` payload that cover
    ``ranges`` (``(offset, length)`` pairs): what a ranged read fetches and verifies.
    Spans closer than ``gap`` bytes are merged too (the gap is then read along). One numpy
    pass for many ranges (a reader of one head in a KV page row has one per token and
    layer). ValueError for a range outside the payload."""
    c = chunk_bytes
    if len(ranges) > 16:
        # A reader sends the same ranges for every page of a region: computed once.
        try:
            return list(_spans_np_cached(tuple(ranges), nbytes, c, gap))
        except TypeError:  # unhashable pairs (lists): not cached
            return _spans_np(ranges, nbytes, c, gap)
    out: list[tuple[int, int]] = []
    for off, length in sorted(ranges):
        if off < 0 or length < 0 or off + length > nbytes:
            raise ValueError(f"range ({off}, {length}) outside a {nbytes}-byte payload")
        if not length:
            continue
        lo, hi = off // c * c, min(-(-(off + length) // c) * c, nbytes)
        if out and lo - out[-1][1] < max(gap, 1):
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


@functools.lru_cache(maxsize=256)
def _spans_np_cached(
    ranges: tuple[tuple[int, int], ...], nbytes: int, c: int, gap: int
) -> tuple[tuple[int, int], ...]:
    return tuple(_spans_np(ranges, nbytes, c, gap))


def _spans_np(
    ranges: Sequence[tuple[int, int]], nbytes: int, c: int, gap: int
) -> list[tuple[int, int]]:
    """``chunk_spans`` of many ranges in one numpy pass (same result as its loop)."""
    flat = itertools.chain.from_iterable(ranges)  # ~2x faster than np.asarray
    r = np.fromiter(flat, dtype=np.int64, count=2 * len(ranges)).reshape(-1, 2)
    off, length = r[:, 0], r[:, 1]
    bad = (off < 0) | (length < 0) | (off + length > nbytes)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"range {tuple(r[i].tolist())} outside a {nbytes}-byte payload")
    r = r[length > 0]
    if not len(r):
        return []
    r = r[np.argsort(r[:, 0], kind="stable")]
    a = r[:, 0] // c * c
    b = np.minimum(-(-(r[:, 0] + r[:, 1]) // c) * c, nbytes)
    reach = np.maximum.accumulate(b)
    new = np.ones(len(a), dtype=bool)
    new[1:] = a[1:] - reach[:-1] >= max(gap, 1)
    starts = np.flatnonzero(new)
    stops = np.append(starts[1:], len(a)) - 1
    return list(zip(a[starts].tolist(), reach[stops].tolist(), strict=True))
