"""L3 storage: key schema, backend interface, backends and degraded-mode guard."""

from __future__ import annotations

from mesh_hicache.storage.base import StorageBackend, StorageStats
from mesh_hicache.storage.keys import REGIONS, KeyNamespace, StorageKey

__all__ = ["REGIONS", "KeyNamespace", "StorageBackend", "StorageKey", "StorageStats"]
