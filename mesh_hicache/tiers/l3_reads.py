"""Prefetch reads of the storage tier: L3 objects into reserved host rows (``l3-read``).

A :class:`Prefetch` job names the pages (chained hashes) to read, the host pages and
slot reserved for them, and per page the mesh to read it from (``l3_sources.py``).
:class:`PrefetchReader` runs it in batches of ``PREFETCH_BATCH_PAGES`` (the unit at
which a prefetch can be stopped): same-mesh pages in one batched ``get`` straight into
the host rows; resharded pages page by page, fetching only the byte ranges of each
other-mesh object that this rank keeps (``StorageBackend.get_ranges``) and assembling
the row (``reshard.assemble``); then the state at the job's end.

Thread story: a job's progress fields are written by the ``l3-read`` thread only and
read by the scheduler only after the job's ``finished`` event. No collectives.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from mesh_hicache.choices import RegionName
from mesh_hicache.layout import RegionLayout
from mesh_hicache.pools.host import HostPools
from mesh_hicache.radix import RadixKey
from mesh_hicache.stats import CacheStats
from mesh_hicache.storage.base import StorageBackend
from mesh_hicache.storage.keys import StorageKey
from mesh_hicache.tiers.l3_sources import SourceFinder
from mesh_hicache.tiers.reshard import SourcePlan, assemble

#: Pages per storage read batch: the unit at which a prefetch can be stopped.
PREFETCH_BATCH_PAGES = 16


@dataclass(slots=True)
class Prefetch:
    """An L3 -> host read in flight for one request (pages reserved in the host pool)."""

    key: RadixKey
    start_page: int
    num_pages: int
    host_pages: list[int]
    host_slot: int | None
    hashes: list[bytes]
    sources: list[SourcePlan | None] = field(default_factory=list)
    """Per page: the writer mesh it is resharded from (None: this mesh's own objects)."""
    state_sources: list[SourcePlan] = field(default_factory=list)
    """Other meshes to read the boundary state from when this mesh has none stored."""
    missing_before: frozenset[int] = frozenset()
    """Pages of the key before ``start_page`` whose windowed K/V the tree lacks."""
    window_rows: list[int | None] = field(default_factory=list)
    """Per page: the host ``kv_window`` row reserved for it (None: none; empty without
    windowed layers)."""
    window_present: list[bool] = field(default_factory=list)
    """Per page: whether its windowed objects are stored and a row is reserved for them
    (empty: this rank holds no windowed layer). Only those are read."""
    state_resharded: bool = False
    resharded_pages: list[bool] = field(default_factory=list)
    """Once finished: per kept page, whether it came from another mesh's objects."""
    started: float = field(default_factory=time.monotonic)
    pages_done: int = 0
    state_ok: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)


class PrefetchReader:
    """Reads prefetch jobs for one rank's storage tier (see the module docstring)."""

    def __init__(self, finder: SourceFinder, host: HostPools, stats: CacheStats) -> None:
        self._finder = finder
        self._host = host
        self._stats = stats
        layout_regions = host.layout.held_regions()
        self._paged = tuple(r for r in layout_regions if r.paged)
        self._slotted = tuple(r for r in layout_regions if not r.paged)

    @property
    def _backend(self) -> StorageBackend:
        return self._finder.backend  # one backend for the tier: swapping it swaps reads too

    def run(self, job: Prefetch) -> None:
        """Read the job's pages batch by batch, then its state; sets ``job.finished``."""
        try:
            for lo in range(0, job.num_pages, PREFETCH_BATCH_PAGES):
                if job.cancel.is_set():
                    return
                hi = min(lo + PREFETCH_BATCH_PAGES, job.num_pages)
                job.pages_done = lo + self._read_pages(job, lo, hi)
                if job.pages_done < hi:
                    return
            job.state_ok = self.read_state(job, job.num_pages)
        finally:
            job.finished.set()

    def _read_pages(self, job: Prefetch, lo: int, hi: int) -> int:
        """Read pages ``[lo, hi)`` of every paged region; returns how many leading pages
        arrived whole (all regions)."""
        if any(job.sources[lo:hi]):
            return self._read_resharded(job, lo, hi)
        keys: list[StorageKey] = []
        rows: list[torch.Tensor] = []
        pages: list[int] = []
        for region in self._paged:
            for i in range(lo, hi):
                row = self._row(job, region, i)
                if row is None:
                    continue
                keys.append(self._finder.key(region, job.hashes[i]))
                rows.append(row)
                pages.append(i)
        if not keys:
            return hi - lo
        flags = self._backend.get(keys, rows)
        self._count_read([r.nbytes for r in rows], flags)
        whole = [True] * (hi - lo)
        for i, ok in zip(pages, flags, strict=True):
            whole[i - lo] = whole[i - lo] and ok
        return whole.index(False) if False in whole else hi - lo

    def _row(self, job: Prefetch, region: RegionLayout, page: int) -> torch.Tensor | None:
        """The host row page ``page`` of the job reads ``region`` into; None for a
        windowed page that is not read (not stored, or not needed: no row reserved)."""
        if region.name is not RegionName.KV_WINDOW:
            return self._host.row(region.name, job.host_pages[page])
        row = job.window_rows[page] if job.window_present[page] else None
        return None if row is None else self._host.row(region.name, row)

    def _read_resharded(self, job: Prefetch, lo: int, hi: int) -> int:
        """Like the same-mesh read, but page by page from each page's source mesh."""
        whole = []
        for i in range(lo, hi):
            src = job.sources[i]
            ok = True
            for region in self._paged:
                row = self._row(job, region, i)
                if row is not None:
                    ok = self._read_row(src, region, job.hashes[i], row) and ok
            whole.append(ok)
        return whole.index(False) if False in whole else hi - lo

    def _read_row(
        self, source: SourcePlan | None, region: RegionLayout, page_hash: bytes, row: torch.Tensor
    ) -> bool:
        """Read ``region``'s row for ``page_hash`` from ``source``'s objects into ``row``:
        only the byte ranges of each object that the row keeps."""
        if source is None:
            flags = self._backend.get([self._finder.key(region, page_hash)], [row])
            self._count_read([row.nbytes], flags)
            return all(flags)
        plan = source.region(region.name)
        item = plan.dtype.itemsize
        keys = [self._finder.source_key(region.name.value, r, page_hash) for r in plan.reads]
        bufs = [row if r.direct else torch.empty(r.shape, dtype=plan.dtype) for r in plan.reads]
        if all(r.whole(item) for r in plan.reads):
            flags = self._backend.get(keys, bufs)
        else:
            flags = self._backend.get_ranges(keys, bufs, [r.ranges for r in plan.reads])
        self._count_read([r.bytes_read(item) for r in plan.reads], flags)
        if not all(flags):
            return False
        for read, buf in zip(plan.reads, bufs, strict=True):
            if not read.direct:
                assemble(read, buf, row)
        return True

    def read_state(self, job: Prefetch, pages: int) -> bool:
        """Read the state stored at the end of page ``pages`` into the job's host slot:
        this mesh's objects first, then (for a resharding job) the other meshes'."""
        if job.host_slot is None:
            return True
        h = job.hashes[pages - 1]
        keys = [self._finder.key(r, h) for r in self._slotted]
        rows = [self._host.row(r.name, job.host_slot) for r in self._slotted]
        flags = self._backend.get(keys, rows) if keys else []
        self._count_read([r.nbytes for r in rows], flags)
        if all(flags):
            return True
        for src in job.state_sources:
            if all(
                [self._read_row(src, r, h, row) for r, row in zip(self._slotted, rows, strict=True)]
            ):
                job.state_resharded = True
                return True
        return False

    def _count_read(self, nbytes: list[int], flags: list[bool]) -> None:
        got = sum(n for n, ok in zip(nbytes, flags, strict=True) if ok)
        self._stats.record_get(len(flags) - sum(flags), got)
