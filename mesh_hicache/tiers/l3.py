"""The storage tier (L3): keys, elected writes, the existence query and prefetch.

Keys: one object per (region, chained page hash) for paged regions and per (region,
hash of the boundary's last page) for Mamba state regions, each naming this rank's
global slice (docs/DESIGN.md section 8). Only the elected writer of a region writes it.

Reshard on read: past what this mesh stored itself, pages (and states) are read from the
other writer meshes recorded under the namespace (``discovery.py``, ``reshard.py``); the
hit is agreed like a same-mesh one (each rank counts what it can assemble).

Thread story: two threads of its own, one FIFO each, so a prefetch never queues behind
backups: ``l3-write`` runs the puts that :meth:`StorageTier.write` submits (the backup
queue consumes their futures), ``l3-read`` runs prefetch reads. Neither issues a
collective. A prefetch job's progress fields are written by ``l3-read`` only and read
by the scheduler only after the job's ``finished`` event. The backend is used from
both threads and the scheduler (existence); backends are thread-safe. Stats are
recorded under their lock.

Agreements (scheduler thread, always the same count on every rank): :meth:`query` 1 or 2
(MIN over the hit, then whether the state at its end exists); :meth:`match` adds the host
reservation's (``alloc``) when it starts a prefetch; :meth:`finish_prefetch` 1 or 2
(MIN over what arrived, then whether the state at the kept boundary was read);
:meth:`cancel_prefetch` none (every rank abandons the same request).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from mesh_hicache.choices import PrefetchPolicy
from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import RegionLayout, StateLayout
from mesh_hicache.pools.host import HostPools
from mesh_hicache.radix import RadixKey, RadixTree, TreeNode
from mesh_hicache.stats import CacheStats
from mesh_hicache.storage.base import StorageBackend
from mesh_hicache.storage.keys import KeyNamespace, StorageKey
from mesh_hicache.tiers.alloc import TierAllocator
from mesh_hicache.tiers.discovery import LayoutRegistry
from mesh_hicache.tiers.reshard import MeshLayoutId, ObjectRead, SourcePlan, assemble, plan_source

logger = logging.getLogger(__name__)

#: Pages per storage read batch: the unit at which a prefetch can be stopped.
PREFETCH_BATCH_PAGES = 16


@dataclass(frozen=True, slots=True)
class PrefetchRules:
    """When to prefetch and when to stop (from ``HiCacheConfig``)."""

    threshold: int
    """Prefetch only when the agreed L3 hit is at least this many tokens."""
    policy: PrefetchPolicy
    timeout_base_s: float
    timeout_per_1k_s: float


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
    state_resharded: bool = False
    started: float = field(default_factory=time.monotonic)
    pages_done: int = 0
    state_ok: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)


class StorageTier:
    """L3 for one rank; see the module docstring. ``close`` stops its threads."""

    def __init__(
        self,
        backend: StorageBackend,
        namespace: KeyNamespace,
        layout: StateLayout,
        host: HostPools,
        tree: RadixTree,
        alloc: TierAllocator,
        agree: Consensus,
        stats: CacheStats,
        rules: PrefetchRules,
    ) -> None:
        self.backend = backend
        self.namespace = namespace
        self._layout = layout
        self._host = host
        self._tree = tree
        self._alloc = alloc
        self._agree = agree
        self._stats = stats
        self._rules = rules
        self._page_size = layout.spec.page_size
        self._has_mamba = layout.spec.has_mamba
        self._paged = layout.held_regions(paged=True)
        self._slotted = layout.held_regions(paged=False)
        for region in layout.held_regions():
            backend.register_buffer(host.local(region.name))
        self._own = MeshLayoutId.of(layout)
        self._registry = LayoutRegistry(backend, namespace)
        if layout.coords == (0, 0, 0):
            self._registry.register(self._own)
        else:
            self._registry.refresh(force=True)
        self._plans: dict[MeshLayoutId, SourcePlan | None] = {}
        self._last_sources: list[SourcePlan | None] = []
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l3-write")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l3-read")
        self._write_error_kinds: set[str] = set()  # logged once each (l3-write thread only)
        self._closed = False

    def key(self, region: RegionLayout, page_hash: bytes) -> StorageKey:
        """The key of ``region``'s object for ``page_hash`` (this rank's global slice)."""
        return StorageKey(self.namespace, region.name.value, page_hash, region.global_slice)

    # -- writes (l3-write thread) ---------------------------------------------------------

    def write(self, nodes: Sequence[TreeNode]) -> Future[int]:
        """Start writing what this rank is the elected writer of for ``nodes`` (their
        host pages and host states). The host rows must stay valid until the future is
        done (the caller keeps the nodes host-protected). Resolves to the bytes written."""
        keys: list[StorageKey] = []
        rows: list[torch.Tensor] = []
        for n in nodes:
            for region in self._paged:
                if not region.is_writer or n.host_indices is None:
                    continue
                for h, page in zip(n.hashes, n.host_indices, strict=True):
                    keys.append(self.key(region, h))
                    rows.append(self._host.row(region.name, page))
            if n.mamba_host_slot is not None and n.last_hash is not None:
                for region in self._slotted:
                    if region.is_writer:
                        keys.append(self.key(region, n.last_hash))
                        rows.append(self._host.row(region.name, n.mamba_host_slot))
        return self._writer.submit(self._put, keys, rows)

    def _put(self, keys: list[StorageKey], rows: list[torch.Tensor]) -> int:
        if not keys:
            return 0
        try:
            flags = self.backend.put(keys, rows)
        except Exception as err:  # nobody reads the future's error: count and log it here
            self._stats.record_write_error()
            kind = type(err).__name__
            if kind not in self._write_error_kinds:
                self._write_error_kinds.add(kind)
                logger.warning(
                    "L3 write of %d objects failed on the write thread (%s: %s); they are not "
                    "stored, counted in storage_write_errors, further %s errors not logged",
                    len(keys),
                    kind,
                    err,
                    kind,
                )
            return 0
        written = sum(r.numel() * r.element_size() for r, ok in zip(rows, flags, strict=True) if ok)
        self._stats.record_put(sum(flags), len(flags) - sum(flags), written)
        return written

    # -- existence (scheduler thread) -----------------------------------------------------

    def query(self, hashes: Sequence[bytes]) -> int:
        """How many of the pages ``hashes`` (chained page hashes beyond what L1/L2 hold)
        every rank can read from L3, ending at a Mamba state when the model has one.
        Agreed (1 or 2 collectives, always the same count)."""
        local = self._local_hit(hashes) if hashes else 0
        pages = self._agree.min(local)
        if pages and self._has_mamba:
            if not self._agree.all_true(self._state_exists(hashes[pages - 1])):
                pages = 0
        return pages

    def _local_hit(self, hashes: Sequence[bytes]) -> int:
        """Pages this rank can read; records each page's source in ``_last_sources``."""
        n = self._run_length(None, hashes)
        sources: list[SourcePlan | None] = [None] * n
        if n < len(hashes):
            # Other meshes only past what this mesh stored itself (the fast path).
            candidates = [None, *self._other_sources()]
            while n < len(hashes) and len(candidates) > 1:
                runs = [(self._run_length(c, hashes[n:]), i) for i, c in enumerate(candidates)]
                best, i = max(runs, key=lambda r: (r[0], -r[1]))
                if not best:
                    break
                sources += [candidates[i]] * best
                n += best
        if self._has_mamba:
            while n > 0 and not self._state_exists(hashes[n - 1]):
                n -= 1
        self._last_sources = sources[:n]
        return n

    def _other_sources(self) -> list[SourcePlan]:
        """Plans for the other writer meshes recorded under the namespace (cached)."""
        out: list[SourcePlan] = []
        for mid in self._registry.refresh():
            if mid == self._own:
                continue
            if mid not in self._plans:
                self._plans[mid] = plan_source(self._layout, mid)
            plan = self._plans[mid]
            if plan is not None and not plan.same_keys:
                out.append(plan)
        return out

    def _source_key(self, region: str, read: ObjectRead, page_hash: bytes) -> StorageKey:
        return StorageKey(self.namespace, region, page_hash, read.slice)

    def _run_length(self, source: SourcePlan | None, hashes: Sequence[bytes]) -> int:
        """Leading pages of ``hashes`` whose paged objects exist for ``source``."""
        n = len(hashes)
        for region in self._paged:
            if source is None:
                n = min(n, self.backend.exists([self.key(region, h) for h in hashes[:n]]))
                continue
            for read in source.region(region.name).reads:
                keys = [self._source_key(region.name.value, read, h) for h in hashes[:n]]
                n = min(n, self.backend.exists(keys))
        return n

    def _state_exists(self, page_hash: bytes) -> bool:
        """Whether some mesh (this one first) stored every state region at ``page_hash``."""
        if all(self.backend.exists_one(self.key(r, page_hash)) for r in self._slotted):
            return True
        return any(self._state_exists_in(src, page_hash) for src in self._other_sources())

    def _state_exists_in(self, source: SourcePlan, page_hash: bytes) -> bool:
        return all(
            self.backend.exists_one(self._source_key(r.name.value, read, page_hash))
            for r in self._slotted
            for read in source.region(r.name).reads
        )

    # -- prefetch -------------------------------------------------------------------------

    def match(self, key: RadixKey, start_page: int, parent_hash: bytes | None) -> Prefetch | None:
        """Look up the pages of ``key`` from ``start_page`` on (the chain continues from
        ``parent_hash``, the last page L1/L2 hold) and start prefetching them when the
        agreed hit reaches the threshold. None (on every rank) when nothing is fetched."""
        ps = self._page_size
        hashes = key.page_hashes(ps, parent_hash, start_page)
        pages = self.query(hashes)
        if pages and pages * ps >= self._rules.threshold:
            return self._start(key, start_page, hashes[:pages])
        if pages:
            self._stats.record_prefetch(self._rules.policy, "below_threshold")
        return None

    def _start(self, key: RadixKey, start_page: int, hashes: Sequence[bytes]) -> Prefetch | None:
        """Reserve host pages and a slot (agreed) and start reading the KV pages
        ``hashes`` in the background, then the state at their end."""
        got = self._alloc.try_alloc_host(len(hashes), 1 if self._has_mamba else 0)
        if got is None:
            self._stats.record_skip("prefetch")
            return None
        slot = got.slots[0] if got.slots else None
        job = Prefetch(key, start_page, len(hashes), got.pages, slot, list(hashes))
        try:
            job.sources = self._last_sources[: len(hashes)]
            assert len(job.sources) == len(hashes)
            if self._has_mamba:
                job.state_sources = self._other_sources()
            self._reader.submit(self._run, job)
        except BaseException:
            self._free(job, 0)  # nothing is in flight: the reservation goes back at once
            raise
        return job

    def _run(self, job: Prefetch) -> None:
        try:
            for lo in range(0, job.num_pages, PREFETCH_BATCH_PAGES):
                if job.cancel.is_set():
                    return
                hi = min(lo + PREFETCH_BATCH_PAGES, job.num_pages)
                job.pages_done = lo + self._read_pages(job, lo, hi)
                if job.pages_done < hi:
                    return
            job.state_ok = self._read_state(job, job.num_pages)
        finally:
            job.finished.set()

    def _read_pages(self, job: Prefetch, lo: int, hi: int) -> int:
        """Read pages ``[lo, hi)`` of every paged region; returns how many leading pages
        arrived whole (all regions)."""
        if any(job.sources[lo:hi]):
            return self._read_resharded(job, lo, hi)
        keys: list[StorageKey] = []
        rows: list[torch.Tensor] = []
        for region in self._paged:
            for i in range(lo, hi):
                keys.append(self.key(region, job.hashes[i]))
                rows.append(self._host.row(region.name, job.host_pages[i]))
        if not keys:
            return hi - lo
        flags = self.backend.get(keys, rows)
        self._count_read(rows, flags)
        n = hi - lo
        whole = [all(flags[r * n + i] for r in range(len(self._paged))) for i in range(n)]
        return whole.index(False) if False in whole else n

    def _read_resharded(self, job: Prefetch, lo: int, hi: int) -> int:
        """Like the same-mesh read, but page by page from each page's source mesh:
        fetch every object that intersects this rank's row and assemble the row."""
        whole = []
        for i in range(lo, hi):
            src = job.sources[i]
            ok = True
            for region in self._paged:
                row = self._host.row(region.name, job.host_pages[i])
                ok = self._read_row(src, region, job.hashes[i], row) and ok
            whole.append(ok)
        return whole.index(False) if False in whole else hi - lo

    def _read_row(
        self, source: SourcePlan | None, region: RegionLayout, page_hash: bytes, row: torch.Tensor
    ) -> bool:
        """Read ``region``'s row for ``page_hash`` from ``source``'s objects into ``row``."""
        if source is None:
            flags = self.backend.get([self.key(region, page_hash)], [row])
            self._count_read([row], flags)
            return all(flags)
        plan = source.region(region.name)
        keys = [self._source_key(region.name.value, r, page_hash) for r in plan.reads]
        bufs = [row if r.direct else torch.empty(r.shape, dtype=plan.dtype) for r in plan.reads]
        flags = self.backend.get(keys, bufs)
        self._count_read(bufs, flags)
        if not all(flags):
            return False
        for read, buf in zip(plan.reads, bufs, strict=True):
            if not read.direct:
                assemble(read, buf, row)
        return True

    def _read_state(self, job: Prefetch, pages: int) -> bool:
        """Read the state stored at the end of page ``pages`` into the job's host slot:
        this mesh's objects first, then (for a resharding job) the other meshes'."""
        if job.host_slot is None:
            return True
        keys = [self.key(r, job.hashes[pages - 1]) for r in self._slotted]
        rows = [self._host.row(r.name, job.host_slot) for r in self._slotted]
        flags = self.backend.get(keys, rows) if keys else []
        self._count_read(rows, flags)
        if all(flags):
            return True
        for src in job.state_sources:
            h = job.hashes[pages - 1]
            if all(
                [self._read_row(src, r, h, row) for r, row in zip(self._slotted, rows, strict=True)]
            ):
                job.state_resharded = True
                return True
        return False

    def _count_read(self, rows: list[torch.Tensor], flags: list[bool]) -> None:
        nbytes = sum(r.numel() * r.element_size() for r, ok in zip(rows, flags, strict=True) if ok)
        self._stats.record_get(len(flags) - sum(flags), nbytes)

    def cancel_prefetch(self, job: Prefetch) -> None:
        """Abandon a prefetch (its request was aborted): stop it and free its reservation."""
        job.cancel.set()
        job.finished.wait()
        self._free(job, 0)
        self._stats.record_prefetch(self._rules.policy, "aborted")

    def _free(self, job: Prefetch, keep_pages: int) -> None:
        """Free the reserved pages past ``keep_pages``, and the slot when none is kept."""
        slots = [job.host_slot] if job.host_slot is not None and keep_pages == 0 else []
        self._alloc.free_host(job.host_pages[keep_pages:], slots)

    def finish_prefetch(self, job: Prefetch) -> int:
        """Apply the stop policy, agree on what arrived and insert it host-only.

        The kept prefix ends at the deepest page boundary that every rank has the KV up
        to and a state at (docs/DESIGN.md section 5): a prefetch that got KV but no state
        there is cut back to a shallower stored state, or to nothing. Returns the tokens
        now on host beyond the job's start. Collective (1 or 2 agreements).
        """
        rules = self._rules
        if rules.policy is PrefetchPolicy.WAIT_COMPLETE:
            job.finished.wait()
        elif rules.policy is PrefetchPolicy.TIMEOUT:
            tokens = job.num_pages * self._page_size
            budget = rules.timeout_base_s + rules.timeout_per_1k_s * tokens / 1000
            job.finished.wait(max(0.0, budget - (time.monotonic() - job.started)))
        job.cancel.set()
        job.finished.wait()  # at most one batch more: the pages must not change under us
        complete = job.pages_done == job.num_pages and job.state_ok
        local = job.num_pages if complete else self._deepest_state(job, job.pages_done)
        pages = self._agree.min(local)
        if pages:
            ok = complete if pages == job.num_pages else self._read_state(job, pages)
            if not self._agree.all_true(ok):
                pages = 0
        outcome = "completed" if pages == job.num_pages else "partial" if pages else "aborted"
        self._stats.record_prefetch(rules.policy, outcome)
        self._free(job, pages)
        if not pages:
            return 0
        resharded = pages if job.state_resharded else sum(map(bool, job.sources[:pages]))
        if resharded:
            self._stats.record_reshard(resharded * self._page_size)
        end = (job.start_page + pages) * self._page_size
        result = self._tree.insert(
            job.key.prefix(end),
            host_indices=job.host_pages[:pages],
            host_first_page=job.start_page,
            mamba_host_slot=job.host_slot,
        )
        slot = job.host_slot
        unused = [slot] if slot is not None and not result.mamba_host_taken else []
        self._alloc.free_host(result.unused_host_indices, unused)
        return pages * self._page_size

    def _deepest_state(self, job: Prefetch, pages: int) -> int:
        """Deepest boundary within the first ``pages`` read pages that has a stored state."""
        if not self._has_mamba:
            return pages
        while pages > 0 and not self._state_exists(job.hashes[pages - 1]):
            pages -= 1
        return pages

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop both threads (after their queued work) and close the backend; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self.backend.close()
