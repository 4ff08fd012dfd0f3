"""The ``file`` backend: one file per object under a root directory (the embedded default).

Layout: ``<root>/<key string>`` (``v1/<ns digest>/<region>/<page hash>/<slice tag>``),
each file a 64-byte header (``keys.py``) followed by the payload.

- Writes are atomic: a temp file (``.tmp-*``, never a valid key name) in the target
  directory, then ``os.replace``. Readers see a whole object or none; a crashed writer
  leaves only a temp file, which readers ignore and cleanup removes after an hour.
- Keys cannot escape the root: the key string is re-checked against the grammar and the
  resolved path must lie under the resolved root (symlinks included).
- Several processes may share a root (different ranks write different keys; the same
  key written twice holds the same bytes, and the last rename wins).
- Size cap (``max_bytes``, header bytes included): LRU by access time. Every hit and
  every ``put`` of a present object stamps the file's atime (mtime stays the write
  time), so all processes share one recency order. A process rescans the tree when its
  own estimate passes the cap or after writing ``max_bytes / 8`` since its last scan,
  then evicts the least recently used objects down to ``low_watermark * max_bytes``.
  With several writers the cap is therefore approximate (bounded overshoot).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from mesh_hicache.storage.base import StorageBackend, check_batch
from mesh_hicache.storage.keys import (
    HEADER_SIZE,
    KEY_PATTERN,
    ObjectError,
    StorageKey,
    check_key_str,
    check_payload,
    decode_header,
    encode_header,
    tensor_bytes,
)

logger = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-"
_STALE_TMP_NS = 3600 * 10**9
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def _clock_ns() -> int:
    """Wall-clock ns for recency stamps (shared by processes); tests replace it."""
    return time.time_ns()


def _write_payload(f: BinaryIO, payload: memoryview) -> None:
    """Write all of ``payload``; module-level so tests can interrupt a write midway."""
    f.write(payload)


class FileStorage(StorageBackend):
    """Objects as files under ``root``; see the module docstring for the guarantees.

    ``root`` is created if missing. ``max_bytes`` (None = unbounded) caps the bytes of
    all objects under the root; an object larger than the cap is dropped (``put`` ->
    False). ``fsync`` makes each write durable before its rename (off by default: the
    checksum already turns a torn file after a crash into a miss).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        max_bytes: int | None = None,
        *,
        fsync: bool = False,
        low_watermark: float = 0.9,
    ) -> None:
        super().__init__()
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
            raise ValueError(
                f"FileStorage max_bytes must be a positive int or None, got {max_bytes!r}"
            )
        if not 0.0 < low_watermark <= 1.0:
            raise ValueError(f"FileStorage low_watermark must be in (0, 1], got {low_watermark!r}")
        self._root = Path(root).resolve()
        self._root.mkdir(parents=True, exist_ok=True)
        self._max_bytes = max_bytes
        self._fsync = fsync
        self._low_watermark = low_watermark
        self._lock = threading.Lock()  # guards the accounting and the stamp clock
        self._scan_lock = threading.Lock()  # one rescan/eviction at a time
        self._last_stamp_ns = 0
        self._scanned_bytes = 0
        self._written_since_scan = 0
        self._warned_full = False
        self._tmp_names = (
            f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count()
        )
        if max_bytes is not None:
            self._enforce_cap(force=True)

    @property
    def root(self) -> Path:
        """The resolved root directory."""
        return self._root

    def object_path(self, key: StorageKey) -> Path:
        """The file of ``key``; ValueError if the key string is malformed or would escape."""
        key_str = check_key_str(key.to_str())
        path = (self._root / key_str).resolve()
        if path == self._root or not path.is_relative_to(self._root):
            raise ValueError(f"storage key {key_str!r} resolves outside the root {self._root}")
        return path

    # -- interface -------------------------------------------------------------------------

    def exists(self, keys: Sequence[StorageKey]) -> int:
        for i, key in enumerate(keys):
            if not self.object_path(key).is_file():
                return i
        return len(keys)

    def get(self, keys: Sequence[StorageKey], dst: Sequence[torch.Tensor]) -> list[bool]:
        check_batch(keys, dst, "FileStorage.get")
        hits = [self._get_one(key, out) for key, out in zip(keys, dst, strict=True)]
        self._count(gets=len(hits))
        return hits

    def put(self, keys: Sequence[StorageKey], src: Sequence[torch.Tensor]) -> list[bool]:
        check_batch(keys, src, "FileStorage.put")
        return [self._put_one(key, data) for key, data in zip(keys, src, strict=True)]

    # -- one object ------------------------------------------------------------------------

    def _get_one(self, key: StorageKey, dst: torch.Tensor) -> bool:
        path = self.object_path(key)
        key_str = key.to_str()
        view = tensor_bytes(dst)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            self._count(get_misses=1)
            return False
        with f:
            try:
                nbytes, checksum = decode_header(key_str, f.read(HEADER_SIZE))
                if nbytes != view.nbytes:
                    raise ObjectError(
                        "length", f"object holds {nbytes} bytes, destination {view.nbytes}"
                    )
                got = _read_into(f, view)
                if got != nbytes:
                    raise ObjectError("short", f"payload of {got} bytes, header says {nbytes}")
                if f.read(1):
                    raise ObjectError("length", "trailing bytes after the payload")
                check_payload(view, nbytes, checksum)
            except ObjectError as err:
                self._record_corrupt(err.kind, key_str, str(err))
                self._remove_bad(path)
                return False
            mtime_ns = os.fstat(f.fileno()).st_mtime_ns
        self._touch(path, mtime_ns)
        self._count(get_hits=1, get_bytes=view.nbytes)
        return True

    def _put_one(self, key: StorageKey, src: torch.Tensor) -> bool:
        path = self.object_path(key)
        key_str = key.to_str()
        view = tensor_bytes(src)
        size = HEADER_SIZE + view.nbytes
        if self._max_bytes is not None and size > self._max_bytes:
            self._drop(f"object of {size} bytes exceeds max_bytes={self._max_bytes}")
            return False
        try:
            st = path.stat()
        except FileNotFoundError:
            pass
        else:
            self._touch(path, st.st_mtime_ns)
            self._count(already_present=1)
            return True
        header = encode_header(key_str, view)
        try:
            self._write_atomic(path, header, view)
        except OSError as err:
            if err.errno in _FULL_ERRNOS:
                self._drop(f"{err.strerror} while writing {key_str}")
                return False
            raise
        self._count(puts=1, put_bytes=view.nbytes)
        if self._max_bytes is not None:
            with self._lock:
                self._written_since_scan += size
            self._enforce_cap(force=False)
        return True

    def _write_atomic(self, path: Path, header: bytes, payload: memoryview) -> None:
        tmp = path.parent / next(self._tmp_names)
        for attempt in range(3):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                f = open(tmp, "xb")
                break
            except FileNotFoundError:
                # Another process's eviction removed the (empty) directory in between.
                if attempt == 2:
                    raise
        try:
            try:
                f.write(header)
                _write_payload(f, payload)
                f.flush()
                if self._fsync:
                    os.fsync(f.fileno())
            finally:
                f.close()
            stamp = self._stamp()
            os.utime(tmp, ns=(stamp, stamp))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    # -- recency, cleanup ------------------------------------------------------------------

    def _stamp(self) -> int:
        """A wall-clock ns stamp, strictly increasing within this process."""
        with self._lock:
            self._last_stamp_ns = max(_clock_ns(), self._last_stamp_ns + 1)
            return self._last_stamp_ns

    def _touch(self, path: Path, mtime_ns: int) -> None:
        """Mark an object used (LRU): set its atime, keep its mtime."""
        if self._max_bytes is None:
            return
        try:
            os.utime(path, ns=(self._stamp(), mtime_ns))
        except FileNotFoundError:
            pass  # evicted by another process meanwhile

    def _remove_bad(self, path: Path) -> None:
        # Remove so that the next put can store a good copy (puts never rewrite).
        try:
            path.unlink()
        except FileNotFoundError:
            pass

    def _drop(self, why: str) -> None:
        self._count(dropped=1)
        with self._lock:
            first, self._warned_full = not self._warned_full, True
        if first:
            logger.warning("FileStorage(%s): put dropped: %s (counted in stats)", self._root, why)

    def _enforce_cap(self, *, force: bool) -> None:
        cap = self._max_bytes
        assert cap is not None
        with self._lock:
            estimate = self._scanned_bytes + self._written_since_scan
            due = force or estimate > cap or self._written_since_scan * 8 > cap
        if not due or not self._scan_lock.acquire(blocking=force):
            return
        try:
            objects, total = self._scan()
            if total > cap:
                objects.sort()
                target = int(cap * self._low_watermark)
                for _atime, path, size in objects:
                    if total <= target:
                        break
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass  # another process evicted it first
                    else:
                        self._count(evicted=1)
                        _rmdir_if_empty(os.path.dirname(path))
                    total -= size
            with self._lock:
                self._scanned_bytes = total
                self._written_since_scan = 0
        finally:
            self._scan_lock.release()

    def _scan(self) -> tuple[list[tuple[int, str, int]], int]:
        """All objects as ``(atime_ns, path, size)`` and their total size; drops stale temps."""
        objects: list[tuple[int, str, int]] = []
        total = 0
        now = time.time_ns()
        root = str(self._root)
        for dirpath, _dirnames, filenames in os.walk(root):
            for name in filenames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                if name.startswith(_TMP_PREFIX):
                    if now - st.st_mtime_ns > _STALE_TMP_NS:
                        Path(path).unlink(missing_ok=True)
                    continue
                if not KEY_PATTERN.fullmatch(os.path.relpath(path, root)):
                    continue  # not ours: never count or evict foreign files
                objects.append((st.st_atime_ns, path, st.st_size))
                total += st.st_size
        return objects, total


def _read_into(f: BinaryIO, view: memoryview) -> int:
    """Fill ``view`` from ``f``; returns the bytes read (less than ``view.nbytes`` at EOF)."""
    done = 0
    while done < view.nbytes:
        n = f.readinto(view[done:])  # type: ignore[attr-defined]
        if not n:
            break
        done += n
    return done


def _rmdir_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # not empty (or already gone): keep it
