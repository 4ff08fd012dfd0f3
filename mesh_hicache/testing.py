"""The one testing hook: access to what ``HiCache`` hides. Not a public API.

Tests inspect and perturb internals the facade deliberately keeps private (tree nodes,
pool allocators, the transfer engine, the storage backend, in-flight prefetches) through
:func:`internals`, and nowhere else. Nothing here is stable; code that serves requests
must use ``HiCache`` only.
"""

from __future__ import annotations

from mesh_hicache.cache import CachedRequest, HiCache
from mesh_hicache.choices import WritePolicy
from mesh_hicache.controller import HiCacheController
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools.host import HostPools
from mesh_hicache.radix import RadixTree
from mesh_hicache.storage.base import StorageBackend
from mesh_hicache.storage.keys import KeyNamespace
from mesh_hicache.tiers import Prefetch, RequestLease, TierAllocator
from mesh_hicache.transfer import TransferEngine


class CacheInternals:
    """Views into one ``HiCache`` for tests (see the module docstring)."""

    __slots__ = ("controller",)

    def __init__(self, cache: HiCache) -> None:
        self.controller: HiCacheController = cache._ctl

    @property
    def tree(self) -> RadixTree:
        return self.controller.tree

    @property
    def layout(self) -> StateLayout:
        return self.controller.layout

    @property
    def host(self) -> HostPools | None:
        return self.controller.host

    @property
    def engine(self) -> TransferEngine | None:
        return self.controller.engine

    @property
    def allocator(self) -> TierAllocator:
        return self.controller.alloc

    @property
    def storage(self) -> StorageBackend | None:
        """The L3 backend as the cache holds it (a ``GuardedStorage``), None without L3."""
        return self.controller.l3.backend if self.controller.l3 is not None else None

    @property
    def namespace(self) -> KeyNamespace:
        return self.controller.namespace

    @property
    def num_open(self) -> int:
        """Requests matched and not yet released."""
        return len(self.controller.requests.open_leases)

    def lease(self, req: CachedRequest) -> RequestLease:
        return req._lease

    def prefetch(self, req: CachedRequest) -> Prefetch | None:
        """The L3 prefetch in flight for ``req`` (None once ``load`` took it)."""
        return req._lease.prefetch

    def set_write_policy(self, policy: WritePolicy | str) -> None:
        """Switch the write policy between requests (same call on every rank)."""
        self.controller.backups.policy = WritePolicy.parse(policy, "write_policy")


def internals(cache: HiCache) -> CacheInternals:
    """The internals of ``cache``, for tests only."""
    return CacheInternals(cache)
