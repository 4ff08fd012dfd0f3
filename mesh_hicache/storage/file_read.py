"""Reading one object of the file backend from its open descriptor: whole or ranged.

Both read with ``os.preadv`` at explicit offsets (no file position, no Python buffering)
straight into the destination's bytes and raise ``ObjectError`` on any check that fails
(``objects.py`` has the format); the caller turns that into a miss.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from mesh_hicache.storage.objects import (
    HEADER_SIZE,
    PLAIN_FORMAT_VERSION,
    ChunkTable,
    ObjectCodec,
    ObjectError,
    ObjectHeader,
    check_object_size,
)

GAP_BYTES = 4096
"""Default ``gap`` of ``read_ranges``: gaps shorter than this between the chunks a ranged
read needs are read (and checked) along. The kernel reads whole 4 KiB pages from the disk
anyway, and one ``preadv`` per span costs more than copying a page (a tp 1 -> 2 reader of
256-byte heads would otherwise issue one call per head)."""


def _head_and_table(
    fd: int, codec: ObjectCodec, key: str, view: memoryview, size: int
) -> tuple[ObjectHeader, ChunkTable | None, int]:
    """The checked header, the checked chunk table (None for format version 1) and the
    payload's offset in the file, from one ``pread`` of everything before the payload."""
    check_object_size(size, view.nbytes)
    start = max(size - view.nbytes, HEADER_SIZE)
    data = os.pread(fd, start, 0)
    header = codec.decode_header(key, data[:HEADER_SIZE])
    if header.nbytes != view.nbytes:
        raise ObjectError(
            "length", f"object holds {header.nbytes} bytes, destination {view.nbytes}"
        )
    if size < HEADER_SIZE + header.nbytes:
        raise ObjectError("short", f"file of {size} bytes, header says {header.nbytes}")
    if header.version == PLAIN_FORMAT_VERSION:
        if size != HEADER_SIZE + header.nbytes:
            raise ObjectError("length", "trailing bytes after the payload")
        return header, None, HEADER_SIZE
    return header, codec.decode_table(header, data[HEADER_SIZE:]), start


def _pread_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            raise ObjectError("short", f"payload ends {view.nbytes - done} bytes early")
        done += n


def read_whole(fd: int, size: int, codec: ObjectCodec, key: str, view: memoryview) -> int:
    """Read and check the whole object open as ``fd`` (``size`` bytes on disk): header,
    (format version 2) the chunk table and the payload into ``view``, in one ``preadv``;
    returns the payload bytes read."""
    check_object_size(size, view.nbytes)
    extra = size - HEADER_SIZE - view.nbytes
    head, table = bytearray(HEADER_SIZE), bytearray(max(extra, 0))
    got = os.preadv(fd, [head, table, view], 0)
    header = codec.decode_header(key, head[: min(got, HEADER_SIZE)])
    if header.nbytes != view.nbytes:
        raise ObjectError(
            "length", f"object holds {header.nbytes} bytes, destination {view.nbytes}"
        )
    if extra < 0 or got < size:
        raise ObjectError("short", f"object of {got} bytes, header says {header.nbytes}")
    checked = None
    if header.version == PLAIN_FORMAT_VERSION:
        if extra:
            raise ObjectError("length", "trailing bytes after the payload")
    else:
        checked = codec.decode_table(header, table)
    codec.check_payload(header, view, checked)
    return header.nbytes


def read_ranges(
    fd: int,
    size: int,
    codec: ObjectCodec,
    key: str,
    view: memoryview,
    ranges: Sequence[tuple[int, int]],
    gap: int = GAP_BYTES,
) -> int:
    """Read the chunks holding the payload byte ``ranges`` (``(offset, length)``) into
    the same offsets of ``view`` (the payload's size) and check them against the chunk
    table; returns the payload bytes read. Gaps under ``gap`` bytes between them are read
    (and checked) along; other bytes of ``view`` are left as they were. A format version 1
    object is read whole."""
    header, table, start = _head_and_table(fd, codec, key, view, size)
    spans = [(0, header.nbytes)] if table is None else table.spans(ranges, gap)
    if spans == [(0, header.nbytes)]:  # everything: one read, the whole object's check
        _pread_exact(fd, view, start)
        codec.check_payload(header, view, table)
        return header.nbytes
    assert table is not None
    for a, b in spans:
        _pread_exact(fd, view[a:b], start + a)
    table.check(view, spans)
    return sum(b - a for a, b in spans)
