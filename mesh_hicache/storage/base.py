"""The L3 storage interface every backend implements (docs/DESIGN.md section 8).

Contract, shared by all backends:

- Keys are ``StorageKey`` objects (``keys.py``); a backend stores one object per key,
  in the object format of ``keys.py`` (header with key digest, length and checksum,
  then the payload), under the name ``key_str`` gives (re-checked with
  ``check_key_str``; derived with the secret when one is set).
- Every backend takes ``secret`` / ``secret_file`` (see ``load_secret``) and encodes and
  checks objects with ``self.codec``: with a secret, objects carry a keyed MAC and an
  object that does not verify under this secret is a miss (kind "mac"/"unsealed").
- Tensors passed to ``get``/``put`` are contiguous CPU tensors of any dtype, typically
  one host-pool row (one page or slot of one region of one shard). Only their bytes
  matter: ``dst.nbytes`` must equal the stored payload length.
- A miss is never an exception: a missing, corrupt, short or foreign object makes
  ``get`` return False for that key (counted in ``stats``; one warning per kind of
  corruption). Wrong data is never returned.
- Transport failures (store unreachable, I/O errors other than "full") may raise;
  ``GuardedStorage`` (``guard.py``) turns them (and any other exception a backend
  raises) into misses, drops and degraded mode.
- Calls are synchronous and may block on I/O: run them off the scheduling thread.
  Implementations are safe to call from several threads; stats are updated under a lock.
"""

from __future__ import annotations

import abc
import dataclasses
import errno
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mesh_hicache.storage.keys import ObjectCodec, StorageKey, check_key_str

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StorageStats:
    """Counters of one backend. ``StorageBackend.stats`` returns a snapshot copy."""

    puts: int = 0
    """Objects newly written."""
    put_bytes: int = 0
    """Payload bytes newly written."""
    already_present: int = 0
    """``put`` calls answered True without writing because the object existed."""
    gets: int = 0
    """Objects requested through ``get``."""
    get_hits: int = 0
    """Objects read and verified into their destination."""
    get_bytes: int = 0
    """Payload bytes of the hits (for ranged reads: the chunks actually read)."""
    range_gets: int = 0
    """Objects among ``gets`` asked through ``get_ranges`` (a byte-range read)."""
    get_misses: int = 0
    """Objects not returned: absent, corrupt, or skipped while degraded."""
    corrupt: int = 0
    """Objects that failed a check (a subset of ``get_misses``)."""
    corrupt_by_kind: dict[str, int] = field(default_factory=dict)
    """``corrupt`` split by ``ObjectError.kind`` ("short", "checksum", "foreign", ...)."""
    dropped: int = 0
    """``put`` calls answered False: the store was full or the object too large."""
    evicted: int = 0
    """Objects removed by the backend's own capacity management (LRU)."""
    errors: int = 0
    """Calls that raised (any exception; counted by ``GuardedStorage``)."""
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    """``errors`` split by exception type name (``"OSError"``, ``"ValueError"``, ...)."""
    write_errors: int = 0
    """``put`` calls among ``errors`` (backups lost to a raising backend)."""
    skipped: int = 0
    """Calls answered as a miss/False without touching the backend while degraded."""
    unreadable: int = 0
    """Objects that exist but could not be opened or read (permission, I/O error): each
    a miss of that object alone (a subset of ``get_misses``); the tier stays up."""
    unreadable_by_kind: dict[str, int] = field(default_factory=dict)
    """``unreadable`` split by errno name (``"EACCES"``, ``"EIO"``, ...)."""
    unsafe: int = 0
    """Entries refused without being read or written: a symlink or a non-regular file
    where an object or directory should be (file backend). Each is a miss or a drop."""

    def snapshot(self) -> StorageStats:
        """A deep copy (the kind dicts included)."""
        return dataclasses.replace(
            self,
            corrupt_by_kind=dict(self.corrupt_by_kind),
            unreadable_by_kind=dict(self.unreadable_by_kind),
            errors_by_kind=dict(self.errors_by_kind),
        )


def load_secret(
    secret: bytes | str | None = None, secret_file: str | os.PathLike[str] | None = None
) -> bytes | None:
    """The storage secret from ``secret`` (bytes or str) or the contents of ``secret_file``.

    Surrounding whitespace of a file (a trailing newline) is dropped. None when neither
    is given; ValueError when both are, when the file cannot be read, or when the secret
    is shorter than ``keys.MIN_SECRET_BYTES`` (checked by ``ObjectCodec``).
    """
    if secret is not None and secret_file is not None:
        raise ValueError("give a storage secret or a secret_file, not both")
    if secret_file is not None:
        if not str(secret_file):
            raise ValueError("storage secret_file must not be empty")
        try:
            with open(secret_file, "rb") as f:
                secret = f.read().strip()
        except OSError as err:
            raise ValueError(f"cannot read storage secret_file {secret_file!r}: {err}") from err
        if not secret:
            raise ValueError(f"storage secret_file {secret_file!r} is empty")
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    ObjectCodec(secret)  # validates type and length
    return secret


class StorageBackend(abc.ABC):
    """A batched key -> bytes object store (the L3 tier).

    Subclasses implement ``exists``, ``get``, ``put`` and usually ``close``; the
    single-key helpers and the stats bookkeeping come from this class.
    """

    def __init__(self, *, secret: bytes | None = None) -> None:
        self._stats = StorageStats()
        self._stats_lock = threading.Lock()
        self._warned_kinds: set[str] = set()
        self.codec = ObjectCodec(secret)
        """How this backend seals and checks objects (a MAC when a secret is set)."""

    # -- the interface ----------------------------------------------------------------------

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Announce a whole contiguous CPU buffer (a host-pool region) once, up front.

        Zero-copy backends (Mooncake) register the memory so later ``get``/``put`` on
        rows inside it move bytes directly; other backends ignore it (the default).
        Does not mutate ``buffer``.
        """
        del buffer

    @abc.abstractmethod
    def exists(self, keys: Sequence[StorageKey]) -> int:
        """Length of the consecutive prefix of ``keys`` whose objects exist.

        ``keys[0]`` missing -> 0; all present -> ``len(keys)``. Existence is not
        verification: a later ``get`` may still find an object corrupt (a miss).
        """

    def exists_each(self, keys: Sequence[StorageKey]) -> list[bool]:
        """One existence flag per key, in ONE backend round trip where the store batches
        (the default asks ``exists`` key by key). Existence is not verification."""
        return [self.exists([k]) == 1 for k in keys]

    @abc.abstractmethod
    def get(self, keys: Sequence[StorageKey], dst: Sequence[torch.Tensor]) -> list[bool]:
        """Read the object of ``keys[i]`` into ``dst[i]``; returns one hit flag per key.

        ``dst[i]``: contiguous CPU tensor, any dtype, ``nbytes`` equal to the payload.
        Mutates ``dst[i]``; on a miss (absent, corrupt, short, foreign or wrong-sized
        object) the flag is False and the content of ``dst[i]`` is unspecified. Never
        raises for a miss; may raise on transport failure.
        """

    def get_ranges(
        self,
        keys: Sequence[StorageKey],
        dst: Sequence[torch.Tensor],
        ranges: Sequence[Sequence[tuple[int, int]]],
    ) -> list[bool]:
        """Like ``get``, but only the payload byte ranges ``ranges[i]`` (``(offset,
        length)`` pairs) of object ``i`` must arrive, at the same offsets of ``dst[i]``
        (whose ``nbytes`` is still the whole payload's; bytes outside the ranges are
        unspecified). Every returned byte is verified as in ``get``. Backends whose
        objects carry a chunk table read only the chunks holding the ranges; the
        default reads whole objects.
        """
        del ranges
        return self.get(keys, dst)

    @abc.abstractmethod
    def put(self, keys: Sequence[StorageKey], src: Sequence[torch.Tensor]) -> list[bool]:
        """Store the bytes of ``src[i]`` under ``keys[i]``; returns one flag per key.

        True when stored or already present (an existing object is not rewritten);
        False when dropped (store full, object too large, conflict). Does not mutate
        ``src``; may raise on transport failure.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release connections and handles. Further calls are undefined."""

    # -- derived helpers -------------------------------------------------------------------

    def key_str(self, key: StorageKey) -> str:
        """The checked name this backend stores ``key`` under: ``key.to_str()``, with the
        namespace and page hash replaced by digests keyed with the storage secret when
        one is set (``StorageKey.to_str``), so each secret is a trust domain of its own."""
        return check_key_str(key.to_str(self.codec.name_key))

    def exists_one(self, key: StorageKey) -> bool:
        """True if the object of ``key`` exists (see ``exists``)."""
        return self.exists([key]) == 1

    def get_one(self, key: StorageKey, dst: torch.Tensor) -> bool:
        """Read one object into ``dst`` (see ``get``); False on a miss."""
        return self.get([key], [dst])[0]

    def put_one(self, key: StorageKey, src: torch.Tensor) -> bool:
        """Store one object (see ``put``); False when dropped."""
        return self.put([key], [src])[0]

    @property
    def stats(self) -> StorageStats:
        """A snapshot of this backend's counters."""
        with self._stats_lock:
            return self._stats.snapshot()

    # -- for implementations ---------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        """Add ``deltas`` to the named counters of ``StorageStats``."""
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _record_corrupt(self, kind: str, key: str, detail: str) -> None:
        """Count a corrupt object as a miss; log a warning the first time per kind."""
        with self._stats_lock:
            self._stats.corrupt += 1
            self._stats.get_misses += 1
            self._stats.corrupt_by_kind[kind] = self._stats.corrupt_by_kind.get(kind, 0) + 1
            first = kind not in self._warned_kinds
            self._warned_kinds.add(kind)
        if first:
            logger.warning(
                "%s: %s object treated as a miss (%s) for key %s; further %r objects are "
                "only counted in stats",
                type(self).__name__,
                kind,
                detail,
                key,
                kind,
            )

    def _record_unreadable(self, err: OSError, key: str) -> None:
        """Count an object that exists but cannot be read as a miss of it alone; warn the
        first time per errno."""
        kind = errno.errorcode.get(err.errno or 0, type(err).__name__)
        with self._stats_lock:
            self._stats.unreadable += 1
            self._stats.get_misses += 1
            by_kind = self._stats.unreadable_by_kind
            by_kind[kind] = by_kind.get(kind, 0) + 1
            first = f"unreadable:{kind}" not in self._warned_kinds
            self._warned_kinds.add(f"unreadable:{kind}")
        if first:
            logger.warning(
                "%s: object %s cannot be read (%s) and is treated as a miss; further %s "
                "objects are only counted in stats",
                type(self).__name__,
                key,
                err,
                kind,
            )

    def _record_unsafe(self, kind: str, where: str, *, miss: bool) -> None:
        """Count a refused entry (symlink, non-regular file); warn the first time per kind."""
        with self._stats_lock:
            self._stats.unsafe += 1
            if miss:
                self._stats.get_misses += 1
            first = f"unsafe:{kind}" not in self._warned_kinds
            self._warned_kinds.add(f"unsafe:{kind}")
        if first:
            logger.warning(
                "%s: refused %s at %s (not followed, not removed); treated as a miss or a "
                "dropped write, further ones are only counted in stats",
                type(self).__name__,
                kind,
                where,
            )


def check_batch(keys: Sequence[StorageKey], tensors: Sequence[torch.Tensor], what: str) -> None:
    """Raise ValueError unless ``keys`` and ``tensors`` have equal lengths."""
    if len(keys) != len(tensors):
        raise ValueError(f"{what}: {len(keys)} keys but {len(tensors)} tensors")
