"""The file backend's size cap: one recency order shared by processes, LRU eviction.

Every hit and every ``put`` of a present object stamps the file's atime (mtime stays the
write time), so all processes that share a root share one recency order. A process
rescans the tree when its own estimate passes the cap or after writing ``max_bytes / 8``
since its last scan, then evicts the least recently used objects down to
``low_watermark * max_bytes``. With several writers the cap is therefore approximate
(bounded overshoot). Thread-safe.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from mesh_hicache.storage.file_tree import evict_oldest, scan_tree
from mesh_hicache.storage.safe_dir import DirCache


class RecencyCap:
    """Recency stamps and the size cap of one ``FileStorage`` (``max_bytes`` None: no cap,
    stamps only for new files). ``clock`` gives wall-clock ns (shared by processes)."""

    def __init__(
        self,
        max_bytes: int | None,
        low_watermark: float,
        stale_tmp_ns: int,
        clock: Callable[[], int],
    ) -> None:
        self.max_bytes = max_bytes
        self._low_watermark = low_watermark
        self._stale_tmp_ns = stale_tmp_ns
        self._clock = clock
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()  # one rescan/eviction at a time
        self._last_stamp_ns = 0
        self._scanned_bytes = 0
        self._written_since_scan = 0

    def stamp(self) -> int:
        """A wall-clock ns stamp, strictly increasing within this process."""
        with self._lock:
            self._last_stamp_ns = max(self._clock(), self._last_stamp_ns + 1)
            return self._last_stamp_ns

    def touch(self, fd: int, name: str | None, mtime_ns: int) -> None:
        """Mark an object used: set its atime, keep its mtime (no-op without a cap).
        ``name`` None: ``fd`` is the object itself, else its directory."""
        if self.max_bytes is None:
            return
        times = (self.stamp(), mtime_ns)
        try:
            if name is None:
                os.utime(fd, ns=times)
            else:
                os.utime(name, ns=times, dir_fd=fd, follow_symlinks=False)
        except OSError:
            pass  # evicted by another process meanwhile, or not ours to stamp

    def wrote(self, nbytes: int) -> None:
        """Count ``nbytes`` (header included) newly written by this process."""
        with self._lock:
            self._written_since_scan += nbytes

    def scan(self, root_fd: int) -> tuple[list[tuple[int, str, int]], int]:
        """All objects as ``(atime_ns, relative path, size)`` and their total size; removes
        stale temp files (``file_tree.scan_tree``)."""
        return scan_tree(root_fd, self._stale_tmp_ns, self._clock())

    def enforce(self, root_fd: int, dirs: Callable[[], DirCache], *, force: bool) -> int:
        """Rescan and evict when due (always with ``force``); returns the objects evicted.
        A rescan already running in another thread is not waited for unless ``force``."""
        cap = self.max_bytes
        assert cap is not None
        with self._lock:
            estimate = self._scanned_bytes + self._written_since_scan
            due = force or estimate > cap or self._written_since_scan * 8 > cap
        if not due or not self._scan_lock.acquire(blocking=force):
            return 0
        evicted = 0
        try:
            objects, total = self.scan(root_fd)
            if total > cap:
                objects.sort()
                with dirs() as d:
                    total, evicted = evict_oldest(d, objects, total, int(cap * self._low_watermark))
            with self._lock:
                self._scanned_bytes = total
                self._written_since_scan = 0
        finally:
            self._scan_lock.release()
        return evicted
