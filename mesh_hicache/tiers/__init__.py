"""The tiers of one rank, one concern per module (wired by ``mesh_hicache.controller``).

Import order inside the package (no module imports one after it): ``alloc`` (agreed
allocation and eviction) -> ``lease`` (tree protections) -> ``l3`` (storage keys, writes,
existence, prefetch) -> ``backup`` (backup queue, write policy) -> ``load`` (host ->
device) -> ``requests`` (one request's steps). Each module's docstring states its thread
story and its agreements.
"""

from mesh_hicache.tiers.alloc import CacheFull, EvictHooks, HostReservation, TierAllocator
from mesh_hicache.tiers.backup import BackupQueue
from mesh_hicache.tiers.l3 import PREFETCH_BATCH_PAGES, Prefetch, PrefetchRules, StorageTier
from mesh_hicache.tiers.lease import Lease
from mesh_hicache.tiers.load import Loader, PendingLoad
from mesh_hicache.tiers.requests import (
    PrefixHit,
    RequestFlow,
    RequestLease,
    ServedTokens,
)
from mesh_hicache.tiers.window_rule import WindowRule

__all__ = [
    "PREFETCH_BATCH_PAGES",
    "BackupQueue",
    "CacheFull",
    "EvictHooks",
    "HostReservation",
    "Lease",
    "Loader",
    "PendingLoad",
    "Prefetch",
    "PrefetchRules",
    "PrefixHit",
    "RequestFlow",
    "RequestLease",
    "ServedTokens",
    "StorageTier",
    "TierAllocator",
    "WindowRule",
]
