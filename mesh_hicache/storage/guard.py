"""Degraded mode: a failing L3 backend turns into misses, never into failed requests.

``GuardedStorage`` wraps any backend. The first exception marks it degraded and logs
one warning; from then on calls answer at once as misses (``exists`` -> 0, ``get`` /
``put`` -> all False) without touching the backend, except one real call every
``retry_interval_s``: if that succeeds the backend is used again (one info log), if it
fails the guard stays degraded silently. The cache keeps serving from L1 + L2.
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
from mesh_hicache.storage.keys import StorageKey

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class GuardedStorage(StorageBackend):
    """A backend wrapper that degrades instead of raising.

    Give either ``backend`` or ``connect`` (a zero-argument factory, called lazily and
    retried like any call, so a store that is unreachable at start-up also degrades
    instead of failing the constructor). ``clock`` is injectable for tests. Input
    errors (ValueError/TypeError: malformed keys, mismatched batch lengths, bad
    tensors) are the caller's bug and are re-raised, not treated as an outage.
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
        self._call(lambda b: None, None)

    def exists(self, keys: Sequence[StorageKey]) -> int:
        if not keys:
            return 0
        return self._call(lambda b: b.exists(keys), 0)[0]

    def get(self, keys: Sequence[StorageKey], dst: Sequence[torch.Tensor]) -> list[bool]:
        check_batch(keys, dst, "GuardedStorage.get")
        if not keys:
            return []
        hits, live = self._call(lambda b: b.get(keys, dst), [False] * len(keys))
        if not live:
            self._count(gets=len(keys), get_misses=len(keys))
        return hits

    def put(self, keys: Sequence[StorageKey], src: Sequence[torch.Tensor]) -> list[bool]:
        check_batch(keys, src, "GuardedStorage.put")
        if not keys:
            return []
        return self._call(lambda b: b.put(keys, src), [False] * len(keys))[0]

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
        return dataclasses.replace(
            inner,
            errors=inner.errors + own.errors,
            skipped=inner.skipped + own.skipped,
            get_misses=inner.get_misses + own.get_misses,
            gets=inner.gets + own.gets,
            corrupt_by_kind=dict(inner.corrupt_by_kind),
        )

    # -- the guard -------------------------------------------------------------------------

    def _call(self, fn: Callable[[StorageBackend], _T], miss: _T) -> tuple[_T, bool]:
        """``(fn(backend), True)``, or ``(miss, False)`` when degraded or on failure."""
        with self._state_lock:
            retrying = self._degraded
            if retrying and self._clock() - self._failed_at < self._retry_interval_s:
                self._count(skipped=1)
                return miss, False
        try:
            backend = self._ensure_backend()
            result = fn(backend)
        except (ValueError, TypeError):
            raise
        except Exception as err:
            self._on_failure(err, retrying)
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

    def _on_failure(self, err: Exception, retrying: bool) -> None:
        self._count(errors=1)
        with self._state_lock:
            self._degraded = True
            self._failed_at = self._clock()
        if retrying:
            logger.debug("storage backend still failing: %r", err)
        else:
            logger.warning(
                "storage backend failed (%r); L3 disabled, serving from device and host "
                "only, retrying every %.0f s",
                err,
                self._retry_interval_s,
            )
