"""Agreed allocation and eviction across the tiers (docs/DESIGN.md section 7).

Owns every free and allocate call on the device (L1) and host (L2) pool allocators, and
the eviction that makes room: the tree picks victims, this module returns what they freed
to the allocators and counts it.

Thread story: the scheduler thread only (allocators and the tree are not thread-safe).

Agreements: an allocation is reserve -> agree -> commit or abort. Each rank evicts and
reserves locally (deterministic: the same tree evicts the same victims everywhere), then
``all_true`` over the mesh decides; a rank that reserved frees its reservation when
another failed. When the first try fails while backups or storage writes are in flight
(their nodes are locked or host-protected, so eviction skipped them), every rank drains
that work and tries once more: 1 agreement, or 2 plus the drain's. ``CacheFull`` is
then raised on every rank together. Freeing needs no agreement: every rank frees the
same indices because it made the same decisions.

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
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools
from mesh_hicache.radix import EvictResult, RadixTree, TreeNode
from mesh_hicache.stats import CacheStats


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
    """Host pages and Mamba slots reserved on every rank."""

    pages: list[int]
    slots: list[int]


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

    @property
    def device_pages(self) -> int:
        """Capacity of the device page pool (equal on every rank)."""
        return self._device.num_pages

    @property
    def device_slots(self) -> int:
        """Capacity of the device Mamba slot pool (equal on every rank)."""
        return self._device.num_slots

    # -- allocation (collective) ------------------------------------------------------------

    def alloc_device_pages(self, n: int) -> list[int]:
        """``n`` device pages, evicting as needed; ``CacheFull`` on every rank if impossible."""
        return self._alloc(self._device.page_allocator, n, self._evict_device_pages, "device pages")

    def alloc_device_slot(self) -> int:
        """One device Mamba slot, evicting device states as needed; may raise ``CacheFull``."""
        return self._alloc(self._device.slot_allocator, 1, self._evict_device_slots, "slots")[0]

    def try_alloc_host(self, pages: int, slots: int) -> HostReservation | None:
        """Host pages and slots (evicting host copies as needed), or None on every rank."""
        host = self._host
        assert host is not None
        try:
            got_pages = self._alloc(
                host.page_allocator, pages, self._evict_host_pages, "host pages"
            )
        except CacheFull:
            return None
        try:
            got_slots = self._alloc(
                host.slot_allocator, slots, self._evict_host_slots, "host slots"
            )
        except CacheFull:
            host.page_allocator.free(got_pages)
            return None
        return HostReservation(got_pages, got_slots)

    # -- freeing (local: every rank frees the same indices) -------------------------------

    def free_device(self, pages: Sequence[int] = (), slots: Sequence[int] = ()) -> None:
        """Return device pages and Mamba slots that the tree did not take."""
        self._device.page_allocator.free(pages)
        self._device.slot_allocator.free(slots)

    def free_host(self, pages: Sequence[int] = (), slots: Sequence[int] = ()) -> None:
        """Return host pages and Mamba slots that the tree did not take."""
        host = self._host
        if host is None:
            assert not pages and not slots
            return
        host.page_allocator.free(pages)
        host.slot_allocator.free(slots)

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
        allocator: PageAllocator,
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
    def _try_alloc(
        allocator: PageAllocator, n: int, evict: Callable[[int], None]
    ) -> list[int] | None:
        if allocator.num_free < n:
            # Deterministic: the same tree evicts the same victims on every rank.
            evict(n - allocator.num_free)
        return allocator.allocate(n) if allocator.can_allocate(n) else None

    def _evict_device_pages(self, n: int) -> None:
        self.reclaim(self._tree.evict_device(n, before_evict=self._hooks.write_back()))

    def _evict_device_slots(self, n: int) -> None:
        self.reclaim(self._tree.evict_mamba_device(n, before_evict=self._hooks.write_back()))

    def _evict_host_pages(self, n: int) -> None:
        self.reclaim(self._tree.evict_host(n))

    def _evict_host_slots(self, n: int) -> None:
        self.reclaim(self._tree.evict_mamba_host(n))
