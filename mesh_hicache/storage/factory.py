"""``make_storage``: build an L3 backend by name; ``open_storage``: the same, guarded."""

from __future__ import annotations

import inspect
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


def backend_class(kind: str) -> type[StorageBackend]:
    """The backend class ``make_storage(kind)`` builds (ValueError for an unknown kind)."""
    if kind == StorageKind.FILE:
        from mesh_hicache.storage.file import FileStorage

        return FileStorage
    if kind == StorageKind.MOONCAKE:
        from mesh_hicache.storage.mooncake import MooncakeStorage

        return MooncakeStorage
    raise ValueError(f"unknown storage kind {kind!r}; choose one of {STORAGE_KINDS}")


def check_options(kind: str, options: dict[str, Any]) -> None:
    """``ValueError`` naming the option when ``options`` cannot be the keyword arguments
    of ``kind``'s backend: an unknown (e.g. misspelt) option, or a required one missing."""
    params = inspect.signature(backend_class(kind)).parameters
    accepted = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"storage={kind!r}: unknown storage option(s) {unknown}; "
            f"accepted: {accepted} (and retry_interval_s)"
        )
    missing = [n for n in accepted if params[n].default is params[n].empty and n not in options]
    if missing:
        raise ValueError(
            f"storage={kind!r} needs storage option(s) {missing} (e.g. storage_options="
            f"{{{missing[0]!r}: ...}})"
        )


def open_storage(
    kind: str, *, retry_interval_s: float = 30.0, lazy: bool = False, **options: Any
) -> GuardedStorage:
    """``make_storage`` behind a ``GuardedStorage``: a store that worked and then fails
    degrades (misses) and is retried every ``retry_interval_s``.

    Fails fast: the kind, the options (unknown or missing, ``check_options``) and a
    ``secret`` / ``secret_file`` (unreadable or too short: a bad secret must not look
    like an outage) are checked at once, and the backend is built now; a backend that
    cannot be built (a root that cannot be created, an unreachable Mooncake master)
    raises ``ValueError`` naming the kind and the cause. ``lazy=True``: build the backend
    on first use instead, so a store unreachable at start-up degrades like a later outage.
    """
    if kind not in STORAGE_KINDS:
        raise ValueError(f"unknown storage kind {kind!r}; choose one of {STORAGE_KINDS}")
    check_options(kind, options)
    if "secret" in options or "secret_file" in options:
        secret = load_secret(options.pop("secret", None), options.pop("secret_file", None))
        options["secret"] = secret
    if lazy:
        return GuardedStorage(
            connect=lambda: make_storage(kind, **options), retry_interval_s=retry_interval_s
        )
    try:
        backend = make_storage(kind, **options)
    except Exception as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(
            f"storage={kind!r} with options {sorted(options)} could not be opened: "
            f"{type(err).__name__}: {first}"
        ) from err
    return GuardedStorage(backend, retry_interval_s=retry_interval_s)
