"""``make_storage``: build an L3 backend by name; ``open_storage``: the same, guarded."""

from __future__ import annotations

from typing import Any

from mesh_hicache.choices import StorageKind
from mesh_hicache.storage.base import StorageBackend, load_secret
from mesh_hicache.storage.guard import GuardedStorage

STORAGE_KINDS: tuple[str, ...] = StorageKind.backends()
"""Names ``make_storage`` accepts (the ``StorageKind`` values that name a backend)."""


def make_storage(kind: str, **options: Any) -> StorageBackend:
    """A new backend of ``kind`` built with ``options`` (the backend's keyword arguments).

    ``"file"``: ``FileStorage(root, max_bytes=None, ...)``. ``"mooncake"``:
    ``MooncakeStorage(**options)``, imported only when asked for (optional dependency).
    Unknown kinds raise ValueError naming the choices; construction errors propagate
    (use ``open_storage`` to degrade instead).
    """
    if kind == StorageKind.FILE:
        from mesh_hicache.storage.file import FileStorage

        return FileStorage(**options)
    if kind == StorageKind.MOONCAKE:
        from mesh_hicache.storage.mooncake import MooncakeStorage

        return MooncakeStorage(**options)
    raise ValueError(f"unknown storage kind {kind!r}; choose one of {STORAGE_KINDS}")


def open_storage(kind: str, *, retry_interval_s: float = 30.0, **options: Any) -> GuardedStorage:
    """``make_storage`` behind a ``GuardedStorage``: failures (at construction too) degrade.

    The kind and a ``secret`` / ``secret_file`` option are checked at once (ValueError
    for an unknown kind or an unreadable or too short secret: a bad secret must not look
    like an outage); the backend itself is built on first use, so an unreachable store
    logs one warning and reads as misses.
    """
    if kind not in STORAGE_KINDS:
        raise ValueError(f"unknown storage kind {kind!r}; choose one of {STORAGE_KINDS}")
    if "secret" in options or "secret_file" in options:
        secret = load_secret(options.pop("secret", None), options.pop("secret_file", None))
        options["secret"] = secret
    return GuardedStorage(
        connect=lambda: make_storage(kind, **options), retry_interval_s=retry_interval_s
    )
