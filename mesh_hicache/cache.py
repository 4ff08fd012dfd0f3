"""HiCache: the public facade a serving engine calls (DESIGN.md section 1).

Per request, on every rank of the mesh, in the same order (each call is collective)::

    req = cache.match(tokens)               # tree + L3 lookup, agreed; locks the prefix
    cache.load(req)                         # stop the L3 prefetch, start host -> device
    for layer in model_layers:
        req.wait_layer(layer)               # layer-wise readiness of the load
        ...read req.prefix_pages / req.mamba_slot from cache.device...
    prefix = cache.finish_load(req)         # agreed; 0 if the load failed anywhere
    pages = cache.alloc_pages(req, n)       # device pages for the new tokens (may evict)
    slot = cache.alloc_slot(req)            # a device Mamba slot for a checkpoint
    ...write K/V and states into cache.device...
    cache.insert(req, tokens[:n], pages_for_those_tokens, mamba_slot=slot)
    cache.release(req)                      # also for aborted requests

Requests may overlap (several matched and not yet released); the cache never assumes
one at a time. What a request still owns at ``release`` (pages and slots the tree did
not take) is freed there, so aborted requests leak nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from mesh_hicache.config import HiCacheConfig
from mesh_hicache.controller import CacheFull, HiCacheController, Prefetch
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.radix import RadixKey
from mesh_hicache.radix.hashing import page_hashes
from mesh_hicache.radix.node import TreeNode
from mesh_hicache.spec import StateSpec
from mesh_hicache.stats import CacheStats
from mesh_hicache.topology import MeshTopology
from mesh_hicache.transfer import TransferHandle

__all__ = ["CacheFull", "CachedRequest", "HiCache", "PrefixHit"]


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


@dataclass(slots=True)
class _Load:
    handle: TransferHandle | None
    host_nodes: list[TreeNode]
    pages: list[int]
    state_node: TreeNode | None
    slot: int | None
    started: float


@dataclass(slots=True)
class CachedRequest:
    """One request's hold on the cache; mutate only through ``HiCache`` methods."""

    key: RadixKey
    hit: PrefixHit
    prefix_len: int = 0
    """Tokens of the prompt served from the cache (final after ``finish_load``)."""
    prefix_pages: list[int] = field(default_factory=list)
    """Device pages holding tokens ``[0, prefix_len)``, one per page, in order."""
    mamba_slot: int | None = None
    """Device Mamba slot holding the state after ``prefix_len`` tokens (hybrid models)."""
    served: tuple[int, int, int] = (0, 0, 0)
    """After ``finish_load``: tokens of the prefix served from (device, host, storage)."""
    _prefetched: int = 0
    _lock_node: TreeNode | None = None
    _host_node: TreeNode | None = None
    _prefetch: Prefetch | None = None
    _load: _Load | None = None
    _owned_pages: list[int] = field(default_factory=list)
    _owned_slots: list[int] = field(default_factory=list)
    _released: bool = False

    def wait_layer(self, layer_id: int) -> bool:
        """Block until layer ``layer_id``'s part of the load is on device (True if ok)."""
        if self._load is None or self._load.handle is None:
            return True
        return self._load.handle.wait_layer(layer_id)


class HiCache:
    """A hierarchical prefix cache for one rank of a mesh. Construction is collective."""

    def __init__(self, topology: MeshTopology, spec: StateSpec, config: HiCacheConfig) -> None:
        self.config = config
        self.spec = spec
        self.ctl = HiCacheController(topology, spec, config)
        self.tree = self.ctl.tree
        self._stats = self.ctl.stats
        self._open: dict[int, CachedRequest] = {}

    @property
    def device(self) -> DevicePools:
        """The L1 pools: ``k(layer)``, ``v(layer)``, ``conv(layer)``, ``ssm(layer)``."""
        return self.ctl.device

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    # -- per request ------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], namespace: str = "") -> CachedRequest:
        """Look ``tokens`` up in every tier; lock the usable prefix; start an L3 prefetch.

        Collective. The result's ``hit`` is what was found; nothing is on device beyond
        ``hit.device_tokens`` until ``load``/``finish_load``.
        """
        ctl = self.ctl
        ctl.step()
        key = RadixKey(tokens, namespace)  # validated once, in bulk (radix/hashing.py)
        m = self.tree.match_prefix(key)
        if self.config.write_policy == "write_through_selective" and ctl.host is not None:
            ctl.backup_nodes([n for n in m.nodes if n.hit_count >= 2])
        self.tree.lock(m.last_node)
        self.tree.protect_host(m.last_node)
        storage_tokens = 0
        prefetch = None
        if ctl.storage is not None:
            # The chain continues from the last page L1/L2 holds: hash only the rest.
            start = m.usable_len // self.page_size
            rest = key.tokens[start * self.page_size :]
            hashes = page_hashes(rest, self.page_size, namespace, m.last_node.last_hash)
            pages = ctl.query_storage(hashes)
            tokens_l3 = pages * self.page_size
            if tokens_l3 and tokens_l3 >= self.config.prefetch_threshold:
                prefetch = ctl.start_prefetch(key, start, hashes[:pages])
                storage_tokens = tokens_l3 if prefetch is not None else 0
            elif tokens_l3:
                self._stats.record_prefetch(self.config.prefetch_policy, "below_threshold")
        hit = PrefixHit(m.device_len, m.host_len, storage_tokens, m.raw_kv_len)
        req = CachedRequest(key, hit, _lock_node=m.last_node, _host_node=m.last_node)
        req._prefetch = prefetch
        self._open[id(req)] = req
        return req

    def load(self, req: CachedRequest) -> None:
        """Finish the L3 prefetch (its stop policy) and start host -> device loading.

        Collective. Afterwards ``req.prefix_len``/``prefix_pages``/``mamba_slot`` describe
        the prefix being loaded; use ``req.wait_layer`` and then ``finish_load``.
        """
        ctl = self.ctl
        if req._prefetch is not None:
            job, req._prefetch = req._prefetch, None
            req._prefetched = ctl.finish_prefetch(job)
        # Again (the prefetch or other requests may have changed the tree), uncounted.
        m = self.tree.match_prefix(req.key, touch=False)
        self._relock(req, m.last_node, host=True)
        host_nodes = [n for n in m.nodes if n.device_indices is None]
        state_node = None
        if self.spec.has_mamba and m.mamba_on_device is None and m.mamba_on_host is not None:
            state_node = m.last_node
        try:
            handle, pages, slot = ctl.start_load(host_nodes, state_node)
        except CacheFull:
            req.prefix_len, req.prefix_pages, req.mamba_slot = 0, [], None
            req._load = _Load(None, [], [], None, None, time.monotonic())
            return
        req._load = _Load(handle, host_nodes, pages, state_node, slot, time.monotonic())
        req.prefix_len = m.usable_len
        req.prefix_pages = list(m.device_indices) + pages
        req.mamba_slot = m.mamba_on_device if m.mamba_on_device is not None else slot

    def finish_load(self, req: CachedRequest) -> int:
        """Wait for the load, agree that it succeeded everywhere, return ``prefix_len``.

        Collective. On failure anywhere the prefix is 0 on every rank (recompute).
        """
        load = req._load
        assert load is not None, "finish_load before load"
        req._load = None
        ok = self.ctl.finish_load(
            load.handle, load.host_nodes, load.pages, load.state_node, load.slot
        )
        stats = self._stats
        if not ok:
            req.prefix_len, req.prefix_pages, req.mamba_slot = 0, [], None
        else:
            stats.seconds_host_to_device += time.monotonic() - load.started if load.pages else 0.0
        loaded = sum(n.num_tokens for n in load.host_nodes) if ok else 0
        storage = min(req._prefetched, loaded)
        req.served = (req.prefix_len - loaded, loaded - storage, storage)
        stats.requests += 1
        stats.prompt_tokens += len(req.key.tokens)
        stats.hit_tokens_device += req.served[0]
        stats.hit_tokens_host += req.served[1]
        stats.hit_tokens_storage += req.served[2]
        stats.raw_kv_hit_tokens += req.hit.raw_kv_tokens
        if req.prefix_len and self.spec.has_mamba:
            if load.slot is not None:
                stats.mamba_hits_host += 1
            else:
                stats.mamba_hits_device += 1
        return req.prefix_len

    def alloc_pages(self, req: CachedRequest, n: int) -> list[int]:
        """``n`` device pages for ``req`` (evicting unlocked cache as needed). Collective;
        ``CacheFull`` on every rank when even eviction cannot make room."""
        pages = self.ctl.alloc_device_pages(n)
        req._owned_pages.extend(pages)
        return pages

    def alloc_slot(self, req: CachedRequest) -> int:
        """A device Mamba slot for a checkpoint of ``req``. Collective; may raise CacheFull."""
        slot = self.ctl.alloc_device_slot()
        req._owned_slots.append(slot)
        return slot

    def insert(
        self,
        req: CachedRequest,
        tokens: Sequence[int],
        pages: Sequence[int],
        mamba_slot: int | None = None,
    ) -> int:
        """Insert ``tokens`` (whole pages; the request's prompt, or prompt plus output).

        ``pages``: the device page of each page of ``tokens`` (prefix pages included);
        ``mamba_slot``: the device slot holding the state after exactly ``len(tokens)``
        tokens. Pages and slot the tree already had are freed if ``req`` owns them.
        Applies the write policy. Returns the pages that were already cached. Collective.
        """
        ps = self.page_size
        if not tokens or len(tokens) % ps:
            raise ValueError(
                f"insert of {len(tokens)} tokens: must be a positive multiple of page_size={ps}"
            )
        if len(pages) != len(tokens) // ps:
            raise ValueError(f"{len(pages)} pages given for {len(tokens) // ps} whole pages")
        key = RadixKey(tokens, req.key.namespace)
        result = self.tree.insert(key, device_indices=list(pages), mamba_device_slot=mamba_slot)
        # Pages the tree took now belong to it; owned pages it did not take duplicate
        # pages it already had, so they go back to the allocator.
        owned = set(req._owned_pages)
        duplicates = {p for p in result.unused_device_indices if p in owned}
        self.ctl.device.page_allocator.free(sorted(duplicates))
        done = set(pages)
        req._owned_pages = [p for p in req._owned_pages if p not in done]
        if mamba_slot is not None and mamba_slot in req._owned_slots:
            req._owned_slots.remove(mamba_slot)
            if not result.mamba_device_taken:
                self.ctl.device.slot_allocator.free([mamba_slot])
        self._relock(req, result.node, host=False)
        if self.config.write_policy == "write_through":
            self.ctl.backup_path(result.node)
        return result.num_existing_pages

    def release(self, req: CachedRequest) -> None:
        """Finish ``req`` (done or aborted): unlock, cancel what is in flight, free what it
        still owns. Collective. Idempotent."""
        if req._released:
            return
        req._released = True
        ctl = self.ctl
        if req._prefetch is not None:
            ctl.cancel_prefetch(req._prefetch)
            req._prefetch = None
        if req._load is not None:
            self.finish_load(req)
        if req._lock_node is not None:
            self.tree.unlock(req._lock_node)
        if req._host_node is not None:
            self.tree.release_host(req._host_node)
        ctl.device.page_allocator.free(req._owned_pages)
        ctl.device.slot_allocator.free(req._owned_slots)
        req._owned_pages, req._owned_slots = [], []
        self._open.pop(id(req), None)
        ctl.step()

    def _relock(self, req: CachedRequest, node: TreeNode, host: bool) -> None:
        self.tree.lock(node)
        if req._lock_node is not None:
            self.tree.unlock(req._lock_node)
        req._lock_node = node
        if host:
            self.tree.protect_host(node)
            if req._host_node is not None:
                self.tree.release_host(req._host_node)
            req._host_node = node

    # -- background work, lifecycle ---------------------------------------------------------

    def step(self) -> None:
        """Consume finished backups and storage writes (agreed). Collective."""
        self.ctl.step()

    def flush(self) -> None:
        """Wait until every backup and storage write finished on every rank. Collective."""
        self.ctl.flush()

    def close(self) -> None:
        """Release open requests, flush, stop the worker threads. Collective."""
        for req in list(self._open.values()):
            self.release(req)
        self.ctl.close()

    def stats(self) -> CacheStats:
        """A snapshot of this rank's counters (storage degraded flag included)."""
        return self.ctl.stats_snapshot()

    def digest(self) -> str:
        """A hash of the tree and its tier state; equal on every rank (tests compare it)."""
        return self.tree.digest()

    def check_integrity(self) -> None:
        """Tree invariants and exact pool accounting; ``RuntimeError`` on a violation."""
        held_pages = [p for r in self._open.values() for p in r._owned_pages]
        held_slots = [s for r in self._open.values() for s in r._owned_slots]
        self.ctl.check_integrity(held_pages, held_slots)
