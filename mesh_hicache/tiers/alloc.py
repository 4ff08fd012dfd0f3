"""Agreed allocation and eviction across the tiers (docs/DESIGN.md section 7).

Owns every free and allocate call on the device (L1) and host (L2) pool allocators, and
the eviction that makes room: the tree picks victims, this module returns what they freed
to the allocators and counts it. With sliding-window layers it also maps each host page
that keeps its windowed K/V to its window row (``bind_windows``, ``window_row``) and
frees the row with the page.

Thread story: the scheduler thread only (allocators and the tree are not thread-safe).

Agreements: an allocation is reserve -> agree -> commit or abort. Each rank evicts and
reserves locally (deterministic: the same tree evicts the same victims everywhere), then
``all_true`` over the mesh decides; a rank that reserved frees its reservation when
another failed. When the first try fails while backups or storage writes are in flight
(their nodes are locked or host-protected, so eviction skipped them), every rank drains
that work and tries once more: 1 agreement, or 2 plus the drain's. ``CacheFull`` is
then raised on every rank together. Freeing needs no agreement: every rank frees the
same indices because it made the same decisions.

Fit before evict: a request for more than an EMPTY tier holds (pages or slots beyond the
fixed pool's capacity; blocks beyond the arena's) raises ``CacheFull`` (device) or
answers None (host) at once, evicting nothing: the answer depends only on replicated
sizes, so every rank takes it without an agreement.

Arenas (a byte budget per tier, ``pools/arena.py``): pages and states share the blocks,
so making room for either may evict either. One victim at a time, from the queue whose
head the policy ranks lower (``RadixTree.eviction_head``: its priorities compare across
queues; ties go to KV), until the request fits or nothing is evictable. The same tree
gives the same victims on every rank.

Hooks: eviction needs the write policy's write-back callback and a way to wait for work
in flight; both live in tiers above (``backup``), so they are passed in as
:class:`EvictHooks`, never imported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from mesh_hicache.consensus import Consensus
from mesh_hicache.pools.allocator import PageAllocator
from mesh_hicache.pools.arena import ArenaIds
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools
from mesh_hicache.radix import EvictResult, RadixTree, TreeNode
from mesh_hicache.radix.eviction import EvictTarget
from mesh_hicache.stats import CacheStats

#: The allocator interface both pool kinds offer (fixed pool or one id space of an arena).
Allocator = PageAllocator | ArenaIds

#: An eviction queue of a shared arena and the call that evicts for ``n`` of its items
#: (returns how many items of any kind it freed).
Queue = tuple[EvictTarget, Callable[[int], int]]


class CacheFull(RuntimeError):
    """Not enough device pages or slots even after eviction (agreed on every rank)."""


@dataclass(frozen=True, slots=True)
class EvictHooks:
    """What eviction needs from the tiers above it (wired by the controller)."""

    write_back: Callable[[], Callable[[TreeNode], None] | None]
    """The ``before_evict`` callback for device victims without a host copy, or None when
    the write policy is not write-back (asked at each eviction)."""
    in_flight: Callable[[], bool]
    """Whether backups or storage writes still hold nodes (same answer on every rank)."""
    drain: Callable[[], None]
    """Wait for all of them on every rank and consume them (collective)."""


class HostReservation(NamedTuple):
    """Host pages, Mamba slots and window rows reserved on every rank."""

    pages: list[int]
    slots: list[int]
    windows: list[int]
    """Rows of the host ``kv_window`` region (its own id space, ``HostPools.window_allocator``)."""


class TierAllocator:
    """Device and host allocation with agreed eviction; see the module docstring."""

    def __init__(
        self,
        device: DevicePools,
        host: HostPools | None,
        tree: RadixTree,
        agree: Consensus,
        stats: CacheStats,
        hooks: EvictHooks,
    ) -> None:
        self._device = device
        self._host = host
        self._tree = tree
        self._agree = agree
        self._stats = stats
        self._hooks = hooks
        self._window_of: dict[int, int] = {}
        """Host page -> its ``kv_window`` row, for host pages that hold their windowed K/V
        (sliding-window layers keep a page's windowed K/V on host only where a resume
        needs it). Freed with the page."""

    @property
    def device_pages(self) -> int:
        """Size of the device page id space (equal on every rank); ids are ``range`` of it."""
        return self._device.num_pages

    @property
    def device_slots(self) -> int:
        """Size of the device Mamba slot id space (equal on every rank)."""
        return self._device.num_slots

    @property
    def max_device_pages(self) -> int:
        """Pages an empty device tier holds: more is never cached (fit before evict)."""
        return self._device.max_pages

    # -- allocation (collective) ------------------------------------------------------------

    def alloc_device_pages(self, n: int) -> list[int]:
        """``n`` device pages, evicting as needed; ``CacheFull`` on every rank if impossible
        (at once, evicting nothing, when ``n`` exceeds an empty tier)."""
        dev = self._device
        if n > dev.max_pages:
            raise CacheFull(f"{n} device pages exceed an empty device tier ({dev.max_pages})")
        return self._alloc(dev.page_allocator, n, self._device_evictor(True), "device pages")

    def alloc_device_slot(self) -> int:
        """One device Mamba slot, evicting as needed; may raise ``CacheFull``."""
        dev = self._device
        if dev.max_slots < 1:
            raise CacheFull(f"a state exceeds an empty device tier ({dev.max_slots} slots)")
        return self._alloc(dev.slot_allocator, 1, self._device_evictor(False), "slots")[0]

    def try_alloc_host(self, pages: int, slots: int, windows: int = 0) -> HostReservation | None:
        """Host pages, slots and ``kv_window`` rows (evicting host copies as needed), or
        None on every rank (at once, evicting nothing, when they exceed an empty host
        tier). The counts must be equal on every rank (they come from replicated state)."""
        host = self._host
        assert host is not None
        if not self._fits_empty_host(host, pages, slots, windows):
            return None
        got: list[list[int]] = []
        kinds = (
            (host.page_allocator, pages, "host pages"),
            (host.slot_allocator, slots, "host slots"),
            (host.window_allocator, windows, "host window rows"),
        )
        for allocator, n, what in kinds:
            try:
                got.append(self._alloc(allocator, n, self._host_evictor(allocator), what))
            except CacheFull:
                for (taken, _, _), ids in zip(kinds, got, strict=False):
                    taken.free(ids)
                return None
        return HostReservation(*got)

    # -- host window rows (local: every rank binds and frees the same ones) -----------------

    def bind_windows(self, host_pages: Sequence[int], rows: Sequence[int]) -> None:
        """Record that ``host_pages[i]`` keeps its windowed K/V in ``kv_window`` row
        ``rows[i]`` (reserved by ``try_alloc_host``); freed with the page."""
        for page, row in zip(host_pages, rows, strict=True):
            assert page not in self._window_of, f"host page {page} already has window row"
            self._window_of[page] = row

    def window_row(self, host_page: int) -> int | None:
        """The ``kv_window`` row of ``host_page``, or None when the page lacks its
        windowed K/V on host."""
        return self._window_of.get(host_page)

    def drop_windows(self, host_pages: Sequence[int]) -> None:
        """Free the window rows of ``host_pages`` (the pages stay)."""
        assert self._host is not None
        rows = [self._window_of.pop(p) for p in host_pages if p in self._window_of]
        self._host.window_allocator.free(rows)

    def check_windows(self) -> None:
        """``RuntimeError`` unless the window rows in use are exactly those of the host
        pages the tree records as holding their windowed K/V, one row each (call with
        no backup or prefetch in flight)."""
        host = self._host
        if host is None:
            return
        want: set[int] = set()
        if self._tree.windows:
            for node in self._tree.iter_nodes():
                gaps = node.host_window_missing
                pages = node.host_indices or ()
                want.update(p for i, p in enumerate(pages) if i not in gaps)
        if set(self._window_of) != want:
            extra, lost = sorted(set(self._window_of) - want), sorted(want - set(self._window_of))
            raise RuntimeError(f"host window rows: bound without the tree {extra}, lacking {lost}")
        rows = sorted(self._window_of.values())
        ids = host.window_allocator
        used = [i for i in range(ids.capacity) if not ids.is_free(i)]
        if rows != used:
            raise RuntimeError(f"host window rows in use {used} != bound {rows} (leak or reuse)")

    # -- freeing (local: every rank frees the same indices) -------------------------------

    def free_device(self, pages: Sequence[int] = (), slots: Sequence[int] = ()) -> None:
        """Return device pages and Mamba slots that the tree did not take."""
        self._device.page_allocator.free(pages)
        self._device.slot_allocator.free(slots)

    def free_host(
        self, pages: Sequence[int] = (), slots: Sequence[int] = (), windows: Sequence[int] = ()
    ) -> None:
        """Return host pages (with their window rows), Mamba slots and unbound window rows
        that the tree did not take."""
        host = self._host
        if host is None:
            assert not pages and not slots and not windows
            return
        host.page_allocator.free(pages)
        host.slot_allocator.free(slots)
        host.window_allocator.free(windows)
        if self._window_of:
            self.drop_windows(pages)

    def reclaim(self, result: EvictResult) -> None:
        """Return everything an eviction freed to its allocators and count it."""
        self.free_device(result.device_pages, result.mamba_device_slots)
        self.free_host(result.host_pages, result.mamba_host_slots)
        self._stats.record_eviction(
            len(result.device_pages),
            len(result.host_pages),
            len(result.mamba_device_slots),
            len(result.mamba_host_slots),
        )

    # -- internals --------------------------------------------------------------------------

    def _alloc(
        self,
        allocator: Allocator,
        n: int,
        evict: Callable[[int], None],
        what: str,
    ) -> list[int]:
        if n == 0:
            return []
        got = self._try_alloc(allocator, n, evict)
        ok = self._agree.all_true(got is not None)
        if not ok and self._hooks.in_flight():
            # Nodes of in-flight backups / storage writes stay locked or host-protected
            # until consumed, so eviction skipped them: wait for them and retry rather
            # than fail. Their queues are consumed by agreement, so this branch is taken
            # on every rank or on none.
            if got is not None:
                allocator.free(got)
            self._hooks.drain()
            got = self._try_alloc(allocator, n, evict)
            ok = self._agree.all_true(got is not None)
        if not ok:
            if got is not None:
                allocator.free(got)
            raise CacheFull(f"cannot allocate {n} {what} on every rank")
        assert got is not None
        return got

    @staticmethod
    def _try_alloc(allocator: Allocator, n: int, evict: Callable[[int], None]) -> list[int] | None:
        if not allocator.can_allocate(n):
            # Deterministic: the same tree evicts the same victims on every rank.
            evict(n)
        return allocator.allocate(n) if allocator.can_allocate(n) else None

    @staticmethod
    def _fits_empty_host(host: HostPools, pages: int, slots: int, windows: int) -> bool:
        if host.arena is None:
            return (
                pages <= host.num_pages
                and slots <= host.num_slots
                and windows <= host.num_window_pages
            )
        p = host.arena.plan
        blocks = pages * p.blocks_per_page + slots * p.blocks_per_slot
        return blocks + windows * p.blocks_per_window <= p.num_blocks

    def _device_evictor(self, pages: bool) -> Callable[[int], None]:
        """What makes room for ``n`` device pages (or slots); called with ``n``."""
        queues = (
            (EvictTarget.DEVICE_KV, self._evict_device_pages),
            (EvictTarget.MAMBA_DEVICE, self._evict_device_slots),
        )
        return self._evictor(self._device, pages, queues)

    def _host_evictor(self, allocator: Allocator) -> Callable[[int], None]:
        """What makes room for ``n`` items of one of the host pool's allocators."""
        host = self._host
        assert host is not None
        queues = (
            (EvictTarget.HOST_KV, self._evict_host_pages),
            (EvictTarget.MAMBA_HOST, self._evict_host_slots),
        )
        if host.arena is not None:
            return lambda n: self._evict_shared(allocator, n, queues)
        if allocator is host.window_allocator:
            # Window rows go with some host pages, not one per page: evict host copies one
            # victim at a time until enough rows are free.
            return lambda n: self._evict_shared(allocator, n, queues[:1])
        return self._evictor(host, allocator is host.page_allocator, queues)

    def _evictor(
        self, pools: DevicePools | HostPools, pages: bool, queues: tuple[Queue, Queue]
    ) -> Callable[[int], None]:
        """A fixed pool evicts its own kind only (``queues[0]`` for pages, ``[1]`` for
        slots); an arena evicts either kind (``_evict_shared``)."""
        ids = pools.page_allocator if pages else pools.slot_allocator
        if pools.arena is None:
            own = queues[0 if pages else 1][1]

            def shortfall(n: int) -> None:
                own(n - ids.num_free)

            return shortfall
        return lambda n: self._evict_shared(ids, n, queues)

    def _evict_shared(self, ids: Allocator, n: int, queues: tuple[Queue, ...]) -> None:
        """Evict one victim at a time, from the queue whose head ranks lower (ties: the
        first, KV), until ``n`` items of ``ids`` fit or no queue can free anything."""
        live = list(queues)
        while live and not ids.can_allocate(n):
            heads = [(self._tree.eviction_head(target), q) for q, (target, _) in enumerate(live)]
            ranked = [(head[:-2], q) for head, q in heads if head is not None]
            if not ranked:
                return
            pick = min(ranked)[1]
            if live[pick][1](1) == 0:
                del live[pick]  # nothing freeable behind that head: stop asking it

    def _evict_device_pages(self, n: int) -> int:
        """Evict device KV for ``n`` pages; returns how many pages and slots it freed."""
        result = self._tree.evict_device(n, before_evict=self._hooks.write_back())
        self.reclaim(result)
        return len(result.device_pages) + len(result.mamba_device_slots)

    def _evict_device_slots(self, n: int) -> int:
        result = self._tree.evict_mamba_device(n, before_evict=self._hooks.write_back())
        self.reclaim(result)
        return len(result.device_pages) + len(result.mamba_device_slots)

    def _evict_host_pages(self, n: int) -> int:
        result = self._tree.evict_host(n)
        self.reclaim(result)
        return len(result.host_pages) + len(result.mamba_host_slots)

    def _evict_host_slots(self, n: int) -> int:
        result = self._tree.evict_mamba_host(n)
        self.reclaim(result)
        return len(result.host_pages) + len(result.mamba_host_slots)
