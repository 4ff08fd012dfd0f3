"""Requests: one request's path through the tiers, and the lock protocol it follows.

Per request, on every rank, in the same order: :meth:`RequestFlow.match` (lock and
host-protect the usable prefix, maybe start an L3 prefetch), :meth:`~RequestFlow.load`
(finish the prefetch, re-match, start the host -> device load), :meth:`~RequestFlow.finish_load`,
``alloc_pages``/``alloc_slot``, :meth:`~RequestFlow.insert` (the lock moves to the
inserted node; the host protection stays where the prefix was loaded from) and
:meth:`~RequestFlow.release` (drops both, cancels what is in flight, frees what the
request still owns). Everything a request holds is in its :class:`RequestLease`.

Thread story: the scheduler thread only. Agreements: those of the tiers it calls, in
call order (each call is collective); no agreement of its own.

Misuse is refused before anything changes (``ValueError``/``TypeError``): a call on a
released request or on a request of another cache, ``insert`` pages or a slot that are
not the request's own, allocated, distinct and in range. Every such check reads only
replicated state (the request's lease, the tree, pool capacities), never anything
rank-local, so on a mesh it gives the same answer on every rank: either every rank
raises or none does, and no rank is left waiting in a collective alone. ``match`` takes
its protections last and drops them again if anything after them raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from mesh_hicache.pools.device import DevicePools
from mesh_hicache.radix import RadixKey, RadixTree, Tier, TreeNode
from mesh_hicache.stats import CacheStats
from mesh_hicache.tiers.alloc import CacheFull, TierAllocator
from mesh_hicache.tiers.backup import BackupQueue
from mesh_hicache.tiers.l3 import Prefetch, StorageTier
from mesh_hicache.tiers.lease import Lease
from mesh_hicache.tiers.load import Loader, PendingLoad


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Tokens of a prompt found per tier at match time (agreed on every rank)."""

    device_tokens: int
    host_tokens: int
    storage_tokens: int
    """Tokens being prefetched from L3 (0 when below the prefetch threshold)."""
    raw_kv_tokens: int
    """KV matched in L1/L2 before the Mamba rule cut it back to a state boundary."""

    @property
    def total(self) -> int:
        return self.device_tokens + self.host_tokens + self.storage_tokens


class ServedTokens(NamedTuple):
    """Tokens of a served prefix by the tier they came from (sums to ``prefix_len``)."""

    device: int
    host: int
    storage: int
    """Prefetched from L3 (then loaded through L2)."""


class RequestLease(Lease):
    """Everything one request holds: its protections in the tree, the device pages and
    slots it allocated and the tree did not take yet, and its prefetch and load in flight.
    Mutated only by :class:`RequestFlow`; callers read it through ``CachedRequest``."""

    __slots__ = (
        "finished_load",
        "hit",
        "key",
        "known_pages",
        "load",
        "mamba_slot",
        "owned_pages",
        "owned_slots",
        "owner",
        "prefetch",
        "prefetched",
        "prefetched_resharded",
        "prefix_len",
        "prefix_pages",
        "released",
        "served",
    )

    def __init__(self, tree: RadixTree, key: RadixKey, owner: object) -> None:
        super().__init__(tree)
        self.owner = owner
        """The ``RequestFlow`` (one per cache) that opened this request."""
        self.key = key
        self.hit = PrefixHit(0, 0, 0, 0)
        self.prefix_len = 0
        self.prefix_pages: list[int] = []
        self.mamba_slot: int | None = None
        self.served = ServedTokens(0, 0, 0)
        self.prefetch: Prefetch | None = None
        self.prefetched = 0
        """Tokens the prefetch put on host (counted as served from storage)."""
        self.prefetched_resharded: list[bool] = []
        """Per prefetched page: assembled from another mesh's objects (reshard on read)."""
        self.load: PendingLoad | None = None
        self.finished_load = False
        self.owned_pages: list[int] = []
        self.owned_slots: list[int] = []
        self.known_pages: set[int] = set()
        """Every device page this request was served or allocated (it may name them again
        in a later insert where the tree already holds a page)."""
        self.released = False

    def wait_layer(self, layer_id: int) -> bool:
        return self.load.wait_layer(layer_id) if self.load is not None else True


class RequestFlow:
    """The per-request operations of the cache; see the module docstring."""

    def __init__(
        self,
        tree: RadixTree,
        alloc: TierAllocator,
        backups: BackupQueue,
        loader: Loader,
        l3: StorageTier | None,
        stats: CacheStats,
        device: DevicePools,
    ) -> None:
        self._device = device
        self._tree = tree
        self._alloc = alloc
        self._backups = backups
        self._loader = loader
        self._l3 = l3
        self._stats = stats
        self._page_size = tree.page_size
        self._has_mamba = tree.has_mamba
        self._open: dict[int, RequestLease] = {}

    @property
    def open_leases(self) -> list[RequestLease]:
        """Leases of requests matched and not yet released."""
        return list(self._open.values())

    def match(self, key: RadixKey) -> RequestLease:
        """Look ``key`` up in every tier; hold the usable prefix; maybe start a prefetch."""
        self._backups.step()
        m = self._tree.match_prefix(key)
        self._backups.on_match(m.nodes)
        lease = RequestLease(self._tree, key, self)
        lease.hold(m.last_node)
        try:
            if self._l3 is not None:
                start = m.usable_len // self._page_size
                parent = m.last_node.last_hash
                lease.prefetch = self._l3.match(key, start, parent, m.window_missing)
        except BaseException:
            lease.release()  # never leave the prefix pinned
            raise
        storage = lease.prefetch.num_pages * self._page_size if lease.prefetch else 0
        lease.hit = PrefixHit(m.device_len, m.host_len, storage, m.raw_kv_len)
        self._open[id(lease)] = lease
        return lease

    def check_open(self, lease: RequestLease) -> None:
        """``ValueError`` unless ``lease`` is an open request of this cache (replicated
        state only: the same answer on every rank)."""
        if lease.owner is not self:
            raise ValueError(f"{lease.key!r}: the request belongs to another cache")
        if lease.released:
            raise ValueError(f"{lease.key!r}: the request was released")

    def load(self, lease: RequestLease) -> None:
        """Finish the prefetch (its stop policy) and start loading the prefix to device."""
        self.check_open(lease)
        if lease.load is not None or lease.finished_load:
            raise RuntimeError("load(req) called twice")
        if lease.prefetch is not None:
            assert self._l3 is not None
            job, lease.prefetch = lease.prefetch, None
            lease.prefetched = self._l3.finish_prefetch(job)
            lease.prefetched_resharded = job.resharded_pages
        # Again (the prefetch or other requests may have changed the tree), uncounted.
        m = self._tree.match_prefix(lease.key, touch=False)
        lease.move(m.last_node, host=True)
        state_node = None
        if self._has_mamba and m.mamba_on_device is None and m.mamba_on_host is not None:
            state_node = m.last_node
        try:
            load = self._loader.start(m.nodes, state_node)
        except CacheFull:
            lease.prefix_len, lease.prefix_pages, lease.mamba_slot = 0, [], None
            lease.load = PendingLoad(None)
            return
        lease.load = load
        lease.prefix_len = m.usable_len
        lease.prefix_pages = list(load.prefix_pages)
        lease.known_pages.update(lease.prefix_pages)
        lease.mamba_slot = m.mamba_on_device if m.mamba_on_device is not None else load.prefix_slot

    def finish_load(self, lease: RequestLease) -> int:
        """Wait for the load, agree on its success, count the request; the prefix length.

        ``RuntimeError`` before ``load`` or when called twice (not an assert: a caller's
        mistake must not pass silently under ``python -O``); ``ValueError`` on a released
        request or one of another cache.
        """
        self.check_open(lease)
        return self._finish_load(lease)

    def _finish_load(self, lease: RequestLease) -> int:
        load = lease.load
        if load is None:
            when = "twice" if lease.finished_load else "before load(req)"
            raise RuntimeError(f"finish_load(req) called {when}")
        lease.load = None
        lease.finished_load = True
        ok = self._loader.finish(load)
        if not ok:
            lease.prefix_len, lease.prefix_pages, lease.mamba_slot = 0, [], None
        loaded = load.num_tokens if ok else 0
        storage = min(lease.prefetched, loaded)
        lease.served = ServedTokens(lease.prefix_len - loaded, loaded - storage, storage)
        resharded = sum(lease.prefetched_resharded[: storage // self._page_size])
        if resharded:  # of the tokens served from storage, those resharded
            self._stats.record_reshard(resharded * self._page_size)
        mamba_hit = None
        if lease.prefix_len and self._has_mamba:
            mamba_hit = "host" if load.prefix_slot is not None else "device"
        self._stats.record_request(len(lease.key), lease.served, lease.hit.raw_kv_tokens, mamba_hit)
        return lease.prefix_len

    def alloc_pages(self, lease: RequestLease, n: int) -> list[int]:
        """``n`` device pages owned by ``lease`` until inserted. May raise ``CacheFull``.
        ``n``: an int >= 0 (``TypeError``/``ValueError`` otherwise, nothing allocated)."""
        self.check_open(lease)
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"alloc_pages: n must be an int, got {n!r}")
        if n < 0:
            raise ValueError(f"alloc_pages: n must be >= 0, got {n}")
        pages = self._alloc.alloc_device_pages(n)
        lease.owned_pages.extend(pages)
        lease.known_pages.update(pages)
        return pages

    def alloc_slot(self, lease: RequestLease) -> int:
        """A device Mamba slot owned by ``lease`` until inserted. May raise ``CacheFull``."""
        self.check_open(lease)
        slot = self._alloc.alloc_device_slot()
        lease.owned_slots.append(slot)
        return slot

    def insert(
        self,
        lease: RequestLease,
        key: RadixKey,
        pages: Sequence[int],
        mamba_slot: int | None,
    ) -> int:
        """Insert ``key`` with its device ``pages`` (and state slot); apply the write
        policy. Pages and slot the tree already had are freed if ``lease`` owns them.
        Returns the pages that were already cached.

        Checked before anything changes (``ValueError``/``TypeError``, tree and pools
        untouched): every page is an int in range, the pages are distinct, a page the tree
        will take is allocated to ``lease`` and not inserted yet, a page where the tree
        already holds one is the request's own (served, allocated, or the tree's page
        there); ``mamba_slot`` is allocated to ``lease`` (or is the slot the tree already
        holds at the key's end)."""
        self.check_open(lease)
        # A node on the key's path whose load is in flight gets its device copy from that
        # load, never a second one from this insert: finish the load first.
        if self._loader.in_flight:
            self._loader.settle(self._tree.kv_path(key))
        pages = self._check_pages(lease, key, pages)
        self._check_slot(lease, key, mamba_slot)
        result = self._tree.insert(key, device_indices=list(pages), mamba_device_slot=mamba_slot)
        # Pages the tree took now belong to it; owned pages it did not take duplicate
        # pages it already had, so they go back to the allocator.
        owned = set(lease.owned_pages)
        duplicates = {p for p in result.unused_device_indices if p in owned}
        if duplicates and self._tree.windows:
            self._fill_windows(key, pages, duplicates)
        self._alloc.free_device(pages=sorted(duplicates))
        done = set(pages)
        lease.owned_pages = [p for p in lease.owned_pages if p not in done]
        if mamba_slot is not None and mamba_slot in lease.owned_slots:
            lease.owned_slots.remove(mamba_slot)
            if not result.mamba_device_taken:
                self._alloc.free_device(slots=[mamba_slot])
        lease.move(result.node, host=False)
        self._backups.on_insert(result.node)
        return result.num_existing_pages

    def _fill_windows(self, key: RadixKey, pages: Sequence[int], computed: set[int]) -> None:
        """The request computed pages the tree already holds on device, some of them
        without their windowed K/V (a copy loaded from host or L3 keeps only the pages a
        boundary needs): copy the request's windowed K/V there, so later hits may end
        anywhere on them. No resume reads those rows before, so nobody reads them while
        they are written. Replicated decisions only (the tree and the request's pages)."""
        src: list[int] = []
        dst: list[int] = []
        at = 0
        for node in self._tree.kv_path(key):
            gaps, dev = node.window_missing, node.device_indices
            if gaps and dev is not None:
                fill = sorted(i for i in gaps if at + i < len(pages) and pages[at + i] in computed)
                if fill:
                    src.extend(pages[at + i] for i in fill)
                    dst.extend(dev[i] for i in fill)
                    self._tree.fill_window(node, Tier.DEVICE, fill)
            at += node.num_pages
        self._device.copy_window_pages(src, dst)

    def _check_pages(self, lease: RequestLease, key: RadixKey, pages: Sequence[int]) -> list[int]:
        out: list[int] = []
        for p in pages:
            if isinstance(p, bool) or not hasattr(type(p), "__index__"):
                raise TypeError(f"insert: pages must be ints, got {p!r}")
            out.append(p.__index__())  # type: ignore[attr-defined]
        capacity = self._alloc.device_pages
        bad = [p for p in out if not 0 <= p < capacity]
        if bad:
            raise ValueError(f"insert: pages {bad[:5]} not in range({capacity}) device pages")
        if len(set(out)) != len(out):
            dup = sorted({p for p in out if out.count(p) > 1})
            raise ValueError(f"insert: pages {dup[:5]} given more than once")
        cached = self._tree.cached_device_pages(key)
        owned = set(lease.owned_pages)
        for i, p in enumerate(out):
            if i >= len(cached) and p not in owned:
                raise ValueError(
                    f"insert: page {p} (position {i}) is not allocated to this request "
                    "(alloc_pages) or was inserted already"
                )
            if i < len(cached) and p != cached[i] and p not in lease.known_pages:
                raise ValueError(f"insert: page {p} (position {i}) is not this request's")
        return out

    def _check_slot(self, lease: RequestLease, key: RadixKey, slot: int | None) -> None:
        if slot is None:
            return
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise TypeError(f"insert: mamba_slot must be an int or None, got {slot!r}")
        if slot in lease.owned_slots:
            return
        node: TreeNode | None = self._tree.node_at(key)
        if node is None or node.mamba_device_slot != slot:
            raise ValueError(
                f"insert: mamba_slot {slot} is not allocated to this request (alloc_slot)"
            )

    def release(self, lease: RequestLease) -> None:
        """Finish the request (done or aborted): cancel what is in flight, drop its
        protections, free what it still owns. Idempotent for this cache's requests;
        ``ValueError`` (nothing changed) for a request of another cache."""
        if lease.owner is not self:
            raise ValueError(f"{lease.key!r}: the request belongs to another cache")
        if lease.released:
            return
        lease.released = True
        if lease.prefetch is not None:
            assert self._l3 is not None
            self._l3.cancel_prefetch(lease.prefetch)
            lease.prefetch = None
        if lease.load is not None:
            self._finish_load(lease)
        lease.release()
        self._alloc.free_device(lease.owned_pages, lease.owned_slots)
        lease.owned_pages, lease.owned_slots = [], []
        self._open.pop(id(lease), None)
        self._backups.step()
