"""The storage tier (L3): keys, elected writes, the existence query and prefetch.

Keys: one object per (region, chained page hash) for paged regions and per (region,
hash of the boundary's last page) for Mamba state regions, each naming this rank's
global slice (docs/DESIGN.md section 8). Only the elected writer of a region writes it.
Windowed layers' pages (``kv_window``) are written and required only where a resume
needs them (``window_rule.py``).

Reshard on read: past what this mesh stored itself, pages (and states) are read from the
other writer meshes recorded under the namespace (``l3_sources.py`` finds them, at one
extra batched lookup for a miss; ``l3_reads.py`` reads only the byte ranges this rank
keeps); the hit is agreed like a same-mesh one (each rank counts what it can assemble).

Thread story: two threads of its own, one FIFO each, so a prefetch never queues behind
backups: ``l3-write`` runs the puts that :meth:`StorageTier.write` submits (the backup
queue consumes their futures), ``l3-read`` runs prefetch reads. Neither issues a
collective. A prefetch job's progress fields are written by ``l3-read`` only and read
by the scheduler only after the job's ``finished`` event. The backend is used from
both threads and the scheduler (existence); backends are thread-safe. Stats are
recorded under their lock.

Agreements (scheduler thread, always the same count on every rank): :meth:`query` 1 or 2
(MIN over the hit, then whether the state and the windowed pages at its end exist);
:meth:`match` adds the host reservation's (``alloc``) when it starts a prefetch;
:meth:`finish_prefetch` 1 or 2 (MIN over what arrived, then whether the state and the
windowed pages at the kept boundary were read);
:meth:`cancel_prefetch` none (every rank abandons the same request).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mesh_hicache.choices import PrefetchPolicy, RegionName
from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import RegionLayout, StateLayout
from mesh_hicache.pools.host import HostPools
from mesh_hicache.radix import RadixKey, RadixTree, TreeNode
from mesh_hicache.stats import CacheStats
from mesh_hicache.storage.base import StorageBackend
from mesh_hicache.storage.keys import KeyNamespace, StorageKey
from mesh_hicache.tiers.alloc import TierAllocator
from mesh_hicache.tiers.l3_reads import PREFETCH_BATCH_PAGES, Prefetch, PrefetchReader
from mesh_hicache.tiers.l3_sources import SourceFinder
from mesh_hicache.tiers.reshard import SourcePlan
from mesh_hicache.tiers.window_rule import WindowRule

__all__ = ["PREFETCH_BATCH_PAGES", "InFlight", "Prefetch", "PrefetchRules", "StorageTier"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InFlight:
    """Host pages and slots whose device -> host copies have not finished."""

    pages: Container[int] = frozenset()
    slots: Container[int] = frozenset()


@dataclass(frozen=True, slots=True)
class PrefetchRules:
    """When to prefetch and when to stop (from ``HiCacheConfig``)."""

    threshold: int
    """Prefetch only when the agreed L3 hit is at least this many tokens."""
    policy: PrefetchPolicy
    timeout_base_s: float
    timeout_per_1k_s: float


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
        window: WindowRule | None = None,
    ) -> None:
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
        self._window = window
        self._paged = layout.held_regions(paged=True)
        self._slotted = layout.held_regions(paged=False)
        for buffer in host.buffers():  # contiguous: the region tensors, or one arena
            backend.register_buffer(buffer)
        self._sources = SourceFinder(backend, namespace, layout)
        self._prefetch = PrefetchReader(self._sources, host, stats)
        self._last_sources: list[SourcePlan | None] = []
        self._last_window: list[bool] | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l3-write")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l3-read")
        self._write_error_kinds: set[str] = set()  # logged once each (l3-write thread only)
        self._closed = False

    @property
    def backend(self) -> StorageBackend:
        """The storage backend (writes, existence and reads all go through it)."""
        return self._sources.backend

    @backend.setter
    def backend(self, backend: StorageBackend) -> None:
        self._sources.backend = backend

    def key(self, region: RegionLayout, page_hash: bytes) -> StorageKey:
        """The key of ``region``'s object for ``page_hash`` (this rank's global slice)."""
        return self._sources.key(region, page_hash)

    # -- writes (l3-write thread) ---------------------------------------------------------

    def write(self, nodes: Sequence[TreeNode], copying: InFlight | None = None) -> Future[int]:
        """Start writing what this rank is the elected writer of for ``nodes`` (their
        host pages and host states), and the windowed pages a resume at each node's start
        needs from its ancestors' host copies (``WindowRule.start_pages``; stored unless
        present). Rows in ``copying`` (device -> host copies not finished) are skipped:
        they may hold anything, and a stored object is never replaced. The host rows must
        stay valid until the future is done (the caller keeps the nodes' paths
        host-protected). Resolves to the bytes written."""
        busy = copying or InFlight()
        keys: list[StorageKey] = []
        rows: list[torch.Tensor] = []
        unless_present: dict[StorageKey, torch.Tensor] = {}
        for n in nodes:
            for region in self._paged:
                if not region.is_writer or n.host_indices is None:
                    continue
                window = region.name is RegionName.KV_WINDOW
                for i, page in enumerate(n.host_indices):
                    held = self._alloc.window_row(page) if window else page
                    if held is not None and page not in busy.pages:
                        keys.append(self.key(region, n.hashes[i]))
                        rows.append(self._host.row(region.name, held))
                if window:  # the ancestors' pages a resume at the node's start needs
                    assert self._window is not None
                    for owner, i in self._window.start_pages(n):
                        if owner.host_indices is None or owner.host_indices[i] in busy.pages:
                            continue
                        held = self._alloc.window_row(owner.host_indices[i])
                        if held is not None:
                            key = self.key(region, owner.hashes[i])
                            unless_present[key] = self._host.row(region.name, held)
            slot = n.mamba_host_slot
            if slot is not None and n.last_hash is not None and slot not in busy.slots:
                for region in self._slotted:
                    if region.is_writer:
                        keys.append(self.key(region, n.last_hash))
                        rows.append(self._host.row(region.name, slot))
        for key in keys:
            unless_present.pop(key, None)
        return self._writer.submit(self._put, keys, rows, unless_present)

    def _put(
        self,
        keys: list[StorageKey],
        rows: list[torch.Tensor],
        unless_present: dict[StorageKey, torch.Tensor],
    ) -> int:
        try:
            if unless_present:
                maybe = list(unless_present)
                for key, there in zip(maybe, self.backend.exists_each(maybe), strict=True):
                    if not there:
                        keys.append(key)
                        rows.append(unless_present[key])
            if not keys:
                return 0
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

    def query(
        self, hashes: Sequence[bytes], start_page: int = 0, missing: frozenset[int] = frozenset()
    ) -> int:
        """How many of the pages ``hashes`` (chained page hashes beyond what L1/L2 hold,
        the first one page ``start_page`` of the key) every rank can read from L3, ending
        at a Mamba state when the model has one and where the windowed pages a resume
        needs are present (in L3, or in the tree unless in ``missing``, absolute page
        indices). Agreed (1 or 2 collectives, always the same count)."""
        local = self._local_hit(hashes, start_page, missing) if hashes else 0
        pages = self._agree.min(local)
        if pages and (self._has_mamba or self._window is not None):
            ok = not self._has_mamba or self._state_exists(hashes[pages - 1])
            ok = ok and self._window_ok(start_page, pages, self._last_window, missing)
            if not self._agree.all_true(ok):
                pages = 0
        return pages

    def _local_hit(self, hashes: Sequence[bytes], start_page: int, missing: frozenset[int]) -> int:
        """Pages this rank can read; records each page's source in ``_last_sources`` and
        its windowed pages' presence in ``_last_window``."""
        n, sources = self._sources.local_hit(hashes)
        present = self._sources.window_present(hashes[:n], sources)
        if self._window is not None and present is not None:
            if not self._window_ok(start_page, n, present, missing, whole=True):
                self._sources.window_elsewhere(hashes[:n], sources, present)
        n = self._deepest(hashes, start_page, n, present, missing)
        self._last_sources = sources[:n]
        self._last_window = present[:n] if present is not None else None
        return n

    def _deepest(
        self,
        hashes: Sequence[bytes],
        start_page: int,
        pages: int,
        present: list[bool] | None,
        missing: frozenset[int],
    ) -> int:
        """The deepest boundary within ``pages`` past ``start_page`` (``hashes``: theirs)
        that has a stored state (with Mamba) and its windowed pages (with windows)."""
        if self._window is not None and present is not None:
            pages = self._window.limit(start_page, pages, present.__getitem__)
        while pages > 0 and not (
            self._window_ok(start_page, pages, present, missing)
            and (not self._has_mamba or self._state_exists(hashes[pages - 1]))
        ):
            pages -= 1
        return pages

    def _window_ok(
        self,
        start_page: int,
        pages: int,
        present: list[bool] | None,
        missing: frozenset[int],
        *,
        whole: bool = False,
    ) -> bool:
        """Whether a resume ``pages`` past ``start_page`` finds its windowed pages
        (``present``: per L3 page; None: this rank holds no windowed layer); ``whole``:
        and every checkpoint before it finds its pages (``WindowRule.limit``)."""
        rule = self._window
        if rule is None or present is None:
            return True
        if whole and rule.limit(start_page, pages, present.__getitem__) < pages:
            return False
        return rule.resumes(start_page, pages, present.__getitem__, missing)

    def _state_exists(self, page_hash: bytes) -> bool:
        return self._sources.state_exists(page_hash)

    # -- prefetch -------------------------------------------------------------------------

    def match(
        self,
        key: RadixKey,
        start_page: int,
        parent_hash: bytes | None,
        missing: frozenset[int] = frozenset(),
    ) -> Prefetch | None:
        """Look up the pages of ``key`` from ``start_page`` on (the chain continues from
        ``parent_hash``, the last page L1/L2 hold; ``missing``: pages before it without
        windowed K/V) and start prefetching them when the agreed hit reaches the
        threshold. None (on every rank) when nothing is fetched."""
        ps = self._page_size
        hashes = key.page_hashes(ps, parent_hash, start_page)
        pages = self.query(hashes, start_page, missing)
        if pages and pages * ps >= self._rules.threshold:
            return self._start(key, start_page, hashes[:pages], missing)
        if pages:
            self._stats.record_prefetch(self._rules.policy, "below_threshold")
        return None

    def _start(
        self, key: RadixKey, start_page: int, hashes: Sequence[bytes], missing: frozenset[int]
    ) -> Prefetch | None:
        """Reserve host pages and a slot (agreed) and start reading the KV pages
        ``hashes`` in the background, then the state at their end."""
        n = len(hashes)
        # Window rows for the pages the hit's end and its checkpoints need: the same
        # count on every rank (agreed values only); a shorter end keeps only those too.
        kept = sorted(self._window.kept(start_page, n)) if self._window is not None else []
        got = self._alloc.try_alloc_host(n, 1 if self._has_mamba else 0, len(kept))
        if got is None:
            self._stats.record_skip("prefetch")
            return None
        slot = got.slots[0] if got.slots else None
        job = Prefetch(key, start_page, n, got.pages, slot, list(hashes))
        job.missing_before = missing
        if kept:
            job.window_rows = [None] * n
            for p, row in zip(kept, got.windows, strict=True):
                job.window_rows[p - start_page] = row
            self._alloc.bind_windows([got.pages[p - start_page] for p in kept], got.windows)
        if self._last_window is not None:
            rows = job.window_rows
            job.window_present = [
                ok and rows[i] is not None for i, ok in enumerate(self._last_window[:n])
            ]
        try:
            job.sources = self._last_sources[: len(hashes)]
            assert len(job.sources) == len(hashes)
            if self._has_mamba:
                job.state_sources = self._sources.other_sources()
            self._reader.submit(self._prefetch.run, job)
        except BaseException:
            self._free(job, 0)  # nothing is in flight: the reservation goes back at once
            raise
        return job

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
        present = job.window_present or None
        if complete:
            local = job.num_pages
        else:
            start, missing = job.start_page, job.missing_before
            local = self._deepest(job.hashes, start, job.pages_done, present, missing)
        pages = self._agree.min(local)
        if pages:
            ok = complete if pages == job.num_pages else self._prefetch.read_state(job, pages)
            ok = ok and self._window_ok(job.start_page, pages, present, job.missing_before)
            if not self._agree.all_true(ok):
                pages = 0
        outcome = "completed" if pages == job.num_pages else "partial" if pages else "aborted"
        self._stats.record_prefetch(rules.policy, outcome)
        self._free(job, pages)
        if not pages:
            return 0
        # Counted when a request is served from these pages (not here: a prefetch can
        # put more on host than the request then loads).
        if job.state_resharded:
            job.resharded_pages = [True] * pages
        else:
            job.resharded_pages = [bool(s) for s in job.sources[:pages]]
        end = (job.start_page + pages) * self._page_size
        gaps = self._window.kept_missing(job.start_page, pages) if self._window else ()
        self._alloc.drop_windows([job.host_pages[p - job.start_page] for p in gaps])
        result = self._tree.insert(
            job.key.prefix(end),
            host_indices=job.host_pages[:pages],
            host_first_page=job.start_page,
            mamba_host_slot=job.host_slot,
            window_missing=gaps,
        )
        slot = job.host_slot
        unused = [slot] if slot is not None and not result.mamba_host_taken else []
        self._alloc.free_host(result.unused_host_indices, unused)
        return pages * self._page_size

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
