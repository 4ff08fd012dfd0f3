"""Ranged reads on Mooncake: only the chunks of an object that hold the asked bytes.

A format version 2 object (``objects.py``: header, chunk table, payload) is read with
Mooncake's get sessions: ``batch_get_session_start`` (replica lookup, once per batch),
``batch_get_into_multi_buffer_ranges`` (per object: the header and table into the header
arena, each chunk span at its own source offset into the destination row or staging),
``batch_get_session_end``. The header, the table and every fetched chunk are checked
before a byte is returned. Anything unusual for one object (a format version 1 object,
a size or transfer error) is left to the whole read (``MooncakeStorage._get_locked``),
which classifies it exactly as ``get`` does; an absent object is a miss at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from mesh_hicache.storage.deadline import Deadline
from mesh_hicache.storage.keys import StorageKey
from mesh_hicache.storage.objects import (
    HEADER_SIZE,
    OBJECT_FORMAT_VERSION,
    ObjectError,
    chunk_bytes_for,
    chunk_spans,
    table_size,
    tensor_bytes,
)

OBJECT_NOT_FOUND = -704


def table_region(t: torch.Tensor, keyed: bool) -> int:
    """Bytes of header + chunk table in front of the payload of row ``t``'s object."""
    chunk = chunk_bytes_for(t.shape, t.element_size())
    return HEADER_SIZE + table_size(t.numel() * t.element_size(), chunk, keyed)


class RangedGets:
    """``get_ranges`` for ``MooncakeStorage`` (a mixin: it uses the backend's arenas,
    store calls and counters, under the backend's lock)."""

    if TYPE_CHECKING:
        _lock: Any
        _headers: Any
        _staging: Any
        _store: Any
        _deadline: Deadline
        codec: Any

        def _call(self, method: str, *args: Any) -> list[int]: ...
        def _raise_if_disconnected(self, codes: Sequence[int]) -> None: ...
        def key_str(self, key: StorageKey) -> str: ...
        def is_registered(self, tensor: torch.Tensor) -> bool: ...
        def _count(self, **deltas: int) -> None: ...
        def _record_corrupt(self, kind: str, key: str, detail: str) -> None: ...
        def _get_locked(
            self,
            names: list[str],
            dst: Sequence[torch.Tensor],
            views: list[memoryview],
            legacy: bool = False,
        ) -> list[bool]: ...

    def get_ranges(
        self,
        keys: Sequence[StorageKey],
        dst: Sequence[torch.Tensor],
        ranges: Sequence[Sequence[tuple[int, int]]],
    ) -> list[bool]:
        if len(keys) != len(dst) or len(keys) != len(ranges):
            raise ValueError(f"get_ranges: {len(keys)} keys, {len(dst)} tensors, {len(ranges)}")
        if not keys:
            return []
        names = [self.key_str(k) for k in keys]
        views = [tensor_bytes(t) for t in dst]
        with self._lock:
            hits = self._ranged_locked(names, dst, views, ranges)
        self._count(gets=len(keys), range_gets=len(keys))
        return hits

    def _ranged_locked(
        self,
        names: list[str],
        dst: Sequence[torch.Tensor],
        views: list[memoryview],
        ranges: Sequence[Sequence[tuple[int, int]]],
    ) -> list[bool]:
        n = len(names)
        keyed = self.codec.keyed
        regions = [table_region(t, keyed) for t in dst]
        chunks = [chunk_bytes_for(t.shape, t.element_size()) for t in dst]
        spans = [chunk_spans(r, v.nbytes, c) for r, v, c in zip(ranges, views, chunks, strict=True)]
        hits = [False] * n
        whole: list[int] = []
        starts = self._call("batch_get_session_start", names)
        self._raise_if_disconnected(starts)
        live = []
        for i, code in enumerate(starts):
            if code == OBJECT_NOT_FOUND:
                self._count(get_misses=1)
            elif code != 0:
                whole.append(i)
            else:
                live.append(i)
        try:
            if live:
                whole += self._fetch(names, dst, views, regions, spans, live, hits)
        finally:
            if live:  # drops the cached replica lookups; its result says nothing more
                ended = [names[i] for i in live]
                self._deadline.run(
                    "batch_get_session_end", self._store.batch_get_session_end, ended
                )
        if whole:
            again = self._get_locked(
                [names[i] for i in whole], [dst[i] for i in whole], [views[i] for i in whole]
            )
            for i, ok in zip(whole, again, strict=True):
                hits[i] = ok
        return hits

    def _fetch(
        self,
        names: list[str],
        dst: Sequence[torch.Tensor],
        views: list[memoryview],
        regions: list[int],
        spans: list[list[tuple[int, int]]],
        live: list[int],
        hits: list[bool],
    ) -> list[int]:
        """One ranged batch over the ``live`` objects; fills ``hits``; returns the
        objects to read whole instead."""
        offsets = {i: sum(regions[j] for j in live[:k]) for k, i in enumerate(live)}
        headers = self._headers.ensure(self._store, sum(regions[i] for i in live))
        staged = [i for i in live if views[i].nbytes and not self.is_registered(dst[i])]
        staging = self._staging.ensure(self._store, sum(views[i].nbytes for i in staged))
        stage_at: dict[int, torch.Tensor] = {}
        at = 0
        for i in staged:
            stage_at[i] = staging[at : at + views[i].nbytes]
            at += views[i].nbytes
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        srcs: list[list[int]] = []
        for i in live:
            base = stage_at[i].data_ptr() if i in stage_at else dst[i].data_ptr()
            ptrs.append([headers.data_ptr() + offsets[i], *(base + a for a, _ in spans[i])])
            sizes.append([regions[i], *(b - a for a, b in spans[i])])
            srcs.append([0, *(regions[i] + a for a, _ in spans[i])])
        results = self._call(
            "batch_get_into_multi_buffer_ranges", [names[i] for i in live], ptrs, sizes, srcs
        )
        self._raise_if_disconnected(results)
        header_bytes = tensor_bytes(headers)
        whole: list[int] = []
        for i, code, want in zip(live, results, sizes, strict=True):
            if code != sum(want):
                whole.append(i)  # a version 1 object, or any error: classify whole
                continue
            head = header_bytes[offsets[i] : offsets[i] + regions[i]]
            payload = tensor_bytes(stage_at[i]) if i in stage_at else views[i]
            try:
                header = self.codec.decode_header(names[i], head[:HEADER_SIZE])
                if header.version != OBJECT_FORMAT_VERSION:
                    whole.append(i)
                    continue
                if header.nbytes != views[i].nbytes:
                    raise ObjectError("length", f"header says {header.nbytes}")
                table = self.codec.decode_table(header, head[HEADER_SIZE:])
                table.check(payload, spans[i])
            except ObjectError as err:
                self._record_corrupt(err.kind, names[i], str(err))
                continue
            if i in stage_at:
                out = views[i]
                for a, b in spans[i]:
                    out[a:b] = payload[a:b]
            hits[i] = True
            self._count(get_hits=1, get_bytes=sum(b - a for a, b in spans[i]))
        return whole
