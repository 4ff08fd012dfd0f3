"""L3 storage: key schema, backend interface, backends and degraded-mode guard."""

from __future__ import annotations

from mesh_hicache.storage.base import StorageBackend, StorageStats
from mesh_hicache.storage.factory import STORAGE_KINDS, make_storage, open_storage
from mesh_hicache.storage.file import FileStorage
from mesh_hicache.storage.guard import GuardedStorage
from mesh_hicache.storage.keys import REGIONS, KeyNamespace, StorageKey

__all__ = [
    "REGIONS",
    "STORAGE_KINDS",
    "FileStorage",
    "GuardedStorage",
    "KeyNamespace",
    "StorageBackend",
    "StorageKey",
    "StorageStats",
    "make_storage",
    "open_storage",
]
