"""Degraded mode: a failing L3 backend turns into misses, never into failed requests.

``GuardedStorage`` wraps any backend. Any exception a backend raises (an I/O error, a
lost connection, but also a ``ValueError``, ``KeyError`` or ``AssertionError`` from a
buggy or confused backend) marks it degraded; it is counted in ``stats.errors`` and
``stats.errors_by_kind`` (``put`` failures also in ``stats.write_errors``, so backups
lost on a background write thread are visible) and logged as one warning per exception
type for the guard's lifetime (later ones at debug level, so a store that keeps failing
the same way does not log on every retry). While degraded, calls answer at once as
misses (``exists`` -> 0, ``get`` / ``put`` -> all False) without touching the backend,
except one real call every ``retry_interval_s``: if that succeeds the backend is used
again (one info log). The cache keeps serving from L1 + L2.

Caller bugs are still raised, checked here before the backend is called: keys that
are not ``StorageKey`` objects, batches of unequal lengths, non-CPU or non-contiguous
tensors (ValueError/TypeError).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from mesh_hicache.storage.base import StorageBackend, StorageStats, check_batch
from mesh_hicache.storage.keys import StorageKey, tensor_bytes

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class GuardedStorage(StorageBackend):
    """A backend wrapper that degrades instead of raising.

    Give either ``backend`` or ``connect`` (a zero-argument factory, called lazily and
    retried like any call, so a store that is unreachable at start-up also degrades
    instead of failing the constructor). ``clock`` is injectable for tests. Input
    errors (ValueError/TypeError: non-key keys, mismatched batch lengths, bad tensors)
    are the caller's bug, checked before the backend is called, and raised; everything
    the backend raises is an outage (see the module docstring).
    """

    def __init__(
        self,
        backend: StorageBackend | None = None,
        *,
        connect: Callable[[], StorageBackend] | None = None,
        retry_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if (backend is None) == (connect is None):
            raise ValueError("GuardedStorage needs exactly one of backend= or connect=")
        if not retry_interval_s >= 0:
            raise ValueError(f"retry_interval_s must be >= 0, got {retry_interval_s!r}")
        self._backend = backend
        self._connect = connect
        self._retry_interval_s = float(retry_interval_s)
        self._clock = clock
        self._state_lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._degraded = False
        self._failed_at = 0.0
        self._buffers: list[torch.Tensor] = []
        self._registered = 0  # how many of _buffers the current backend has seen
        self._warned_errors: set[str] = set()

    @property
    def degraded(self) -> bool:
        """True while the backend is considered down (calls answer as misses)."""
        return self._degraded

    @property
    def backend(self) -> StorageBackend | None:
        """The wrapped backend (None while a lazy ``connect`` has not succeeded)."""
        return self._backend

    # -- interface -------------------------------------------------------------------------

    def register_buffer(self, buffer: torch.Tensor) -> None:
        # Remembered, so a backend that connects or recovers later still sees them.
        self._buffers.append(buffer)
        self._call(lambda b: None, None, "register_buffer")

    def exists(self, keys: Sequence[StorageKey]) -> int:
        _check_keys(keys, "GuardedStorage.exists")
        if not keys:
            return 0
        n, live = self._call(lambda b: b.exists(keys), 0, "exists")
        if live and not (isinstance(n, int) and 0 <= n <= len(keys)):
            self._on_failure(ValueError(f"exists() answered {n!r} for {len(keys)} keys"), False)
            return 0
        return n

    def exists_each(self, keys: Sequence[StorageKey]) -> list[bool]:
        _check_keys(keys, "GuardedStorage.exists_each")
        if not keys:
            return []
        miss = [False] * len(keys)
        flags, live = self._call(lambda b: b.exists_each(keys), miss, "exists")
        if live and not _is_flags(flags, len(keys)):
            self._on_failure(ValueError(f"exists_each() answered {flags!r}"), False)
            return miss
        return [bool(f) for f in flags]

    def get(self, keys: Sequence[StorageKey], dst: Sequence[torch.Tensor]) -> list[bool]:
        _check_io(keys, dst, "GuardedStorage.get")
        if not keys:
            return []
        hits, live = self._call(lambda b: b.get(keys, dst), [False] * len(keys), "get")
        if live and not _is_flags(hits, len(keys)):
            self._on_failure(ValueError(f"get() answered {hits!r} for {len(keys)} keys"), False)
            hits, live = [False] * len(keys), False
        if not live:
            self._count(gets=len(keys), get_misses=len(keys))
        return [bool(h) for h in hits]

    def get_ranges(
        self,
        keys: Sequence[StorageKey],
        dst: Sequence[torch.Tensor],
        ranges: Sequence[Sequence[tuple[int, int]]],
    ) -> list[bool]:
        _check_io(keys, dst, "GuardedStorage.get_ranges")
        if len(ranges) != len(keys):
            raise ValueError(f"get_ranges: {len(keys)} keys but {len(ranges)} range lists")
        if not keys:
            return []
        miss = [False] * len(keys)
        hits, live = self._call(lambda b: b.get_ranges(keys, dst, ranges), miss, "get")
        if live and not _is_flags(hits, len(keys)):
            self._on_failure(ValueError(f"get_ranges() answered {hits!r}"), False)
            hits, live = miss, False
        if not live:
            self._count(gets=len(keys), get_misses=len(keys))
        return [bool(h) for h in hits]

    def put(self, keys: Sequence[StorageKey], src: Sequence[torch.Tensor]) -> list[bool]:
        _check_io(keys, src, "GuardedStorage.put")
        if not keys:
            return []
        flags, live = self._call(lambda b: b.put(keys, src), [False] * len(keys), "put")
        if live and not _is_flags(flags, len(keys)):
            self._on_failure(ValueError(f"put() answered {flags!r} for {len(keys)} keys"), True)
            return [False] * len(keys)
        return [bool(f) for f in flags]

    def close(self) -> None:
        backend, self._backend = self._backend, None
        self._connect = None
        if backend is None:
            return
        try:
            backend.close()
        except Exception as err:  # closing a dead store must not fail shutdown
            logger.warning("storage backend %s failed to close: %r", type(backend).__name__, err)

    @property
    def stats(self) -> StorageStats:
        """The backend's counters, plus this guard's ``errors``/``skipped``/misses."""
        own = super().stats
        inner = StorageStats()
        if self._backend is not None:
            try:
                inner = self._backend.stats
            except Exception:  # a dead backend may not answer; report what we know
                pass
        by_kind = dict(inner.errors_by_kind)
        for kind, n in own.errors_by_kind.items():
            by_kind[kind] = by_kind.get(kind, 0) + n
        return dataclasses.replace(
            inner,
            errors=inner.errors + own.errors,
            errors_by_kind=by_kind,
            write_errors=inner.write_errors + own.write_errors,
            skipped=inner.skipped + own.skipped,
            get_misses=inner.get_misses + own.get_misses,
            gets=inner.gets + own.gets,
            corrupt_by_kind=dict(inner.corrupt_by_kind),
            unreadable_by_kind=dict(inner.unreadable_by_kind),
        )

    # -- the guard -------------------------------------------------------------------------

    def _call(self, fn: Callable[[StorageBackend], _T], miss: _T, op: str) -> tuple[_T, bool]:
        """``(fn(backend), True)``, or ``(miss, False)`` when degraded or on failure."""
        with self._state_lock:
            retrying = self._degraded
            if retrying and self._clock() - self._failed_at < self._retry_interval_s:
                self._count(skipped=1)
                return miss, False
        try:
            backend = self._ensure_backend()
            result = fn(backend)
        except Exception as err:
            self._on_failure(err, op == "put")
            return miss, False
        if retrying:
            with self._state_lock:
                recovered, self._degraded = self._degraded, False
            if recovered:
                logger.info("storage backend %s is back; L3 re-enabled", type(backend).__name__)
        return result, True

    def _ensure_backend(self) -> StorageBackend:
        with self._connect_lock:
            if self._backend is None:
                if self._connect is None:
                    raise RuntimeError("GuardedStorage is closed")
                self._backend = self._connect()
                self._registered = 0
            while self._registered < len(self._buffers):
                self._backend.register_buffer(self._buffers[self._registered])
                self._registered += 1
            return self._backend

    def _on_failure(self, err: Exception, write: bool) -> None:
        kind = type(err).__name__
        with self._stats_lock:
            self._stats.errors += 1
            self._stats.write_errors += int(write)
            self._stats.errors_by_kind[kind] = self._stats.errors_by_kind.get(kind, 0) + 1
            first = kind not in self._warned_errors
            self._warned_errors.add(kind)
        if first:  # warned before degraded is seen, so a watcher of both finds the reason
            logger.warning(
                "storage backend failed (%r)%s; L3 disabled, serving from device and host "
                "only, retrying every %.0f s; further %s failures are only counted in stats",
                err,
                " on a write, the backup is dropped" if write else "",
                self._retry_interval_s,
                kind,
            )
        else:
            logger.debug("storage backend failing: %r", err)
        with self._state_lock:
            self._degraded = True
            self._failed_at = self._clock()


def _check_keys(keys: Sequence[StorageKey], what: str) -> None:
    for key in keys:
        if not isinstance(key, StorageKey):
            raise TypeError(f"{what}: keys must be StorageKey objects, got {key!r}")


def _check_io(keys: Sequence[StorageKey], tensors: Sequence[torch.Tensor], what: str) -> None:
    check_batch(keys, tensors, what)
    _check_keys(keys, what)
    for t in tensors:
        tensor_bytes(t)  # TypeError/ValueError: not a CPU, contiguous tensor


def _is_flags(flags: object, n: int) -> bool:
    return isinstance(flags, list) and len(flags) == n
