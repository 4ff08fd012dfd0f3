"""The ``file`` backend: one file per object under a root directory (the embedded default).

Layout: ``<root>/<key string>`` (``v1/<ns digest>/<region>/<page hash>/<slice tag>``),
each file a 64-byte header (``keys.py``) followed by the payload.

- Writes are atomic: a temp file (``.tmp-*``, never a valid key name) in the target
  directory, then a rename. Readers see a whole object or none. A crashed writer leaves
  only a temp file, which readers ignore; every open of a root removes temp files whose
  writer process is gone (same host) or that are older than ``stale_tmp_s``.
- Keys cannot escape the root, even while someone else rewrites the tree: the key string
  is re-checked against the grammar, the root is held open as a directory descriptor,
  and every key is resolved from it one component at a time with ``O_NOFOLLOW``
  (``safe_dir.py``). A symlink, or anything but a directory / regular file, on the way to
  an object is refused: a miss (or a dropped write) plus one warning per kind, counted in
  ``stats.unsafe``; it is never followed and never removed.
- Several processes may share a root (different ranks write different keys; the same
  key written twice holds the same bytes, and the last rename wins).
- A read-only or full store drops writes (one warning per reason) and keeps serving reads.
- Size cap (``max_bytes``, header bytes included): LRU by access time. Every hit and
  every ``put`` of a present object stamps the file's atime (mtime stays the write
  time), so all processes share one recency order. A process rescans the tree when its
  own estimate passes the cap or after writing ``max_bytes / 8`` since its last scan,
  then evicts the least recently used objects down to ``low_watermark * max_bytes``.
  With several writers the cap is therefore approximate (bounded overshoot).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from mesh_hicache.storage.base import StorageBackend, check_batch, load_secret
from mesh_hicache.storage.file_tree import evict_oldest, scan_tree, temp_names
from mesh_hicache.storage.keys import (
    HEADER_SIZE,
    ObjectError,
    StorageKey,
    check_key_str,
    tensor_bytes,
)
from mesh_hicache.storage.safe_dir import (
    FILE_CREATE_FLAGS,
    FILE_READ_FLAGS,
    DirCache,
    UnsafeEntry,
    entry_kind,
    refused,
)

logger = logging.getLogger(__name__)

_DROP_ERRNOS = {
    errno.ENOSPC: "store full",
    errno.EDQUOT: "quota exceeded",
    errno.EROFS: "read-only store",
    errno.EACCES: "no write permission",
    errno.EPERM: "no write permission",
}


def _clock_ns() -> int:
    """Wall-clock ns for recency stamps (shared by processes); tests replace it."""
    return time.time_ns()


def _write_payload(f: BinaryIO, payload: memoryview) -> None:
    """Write all of ``payload``; module-level so tests can interrupt a write midway."""
    f.write(payload)


def _split(key_str: str) -> tuple[tuple[str, ...], str]:
    parts = key_str.split("/")
    return tuple(parts[:-1]), parts[-1]


class FileStorage(StorageBackend):
    """Objects as files under ``root``; see the module docstring for the guarantees.

    ``root`` (non-empty) is created if missing. ``max_bytes`` (None = unbounded) caps the
    bytes of all objects under the root; an object larger than the cap is dropped
    (``put`` -> False). ``fsync`` makes each write durable before its rename (off by
    default: the checksum already turns a torn file after a crash into a miss).
    ``stale_tmp_s``: age after which any temp file counts as abandoned. ``secret`` /
    ``secret_file``: seal objects with a keyed MAC (``base.load_secret``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        max_bytes: int | None = None,
        *,
        fsync: bool = False,
        low_watermark: float = 0.9,
        stale_tmp_s: float = 3600.0,
        secret: bytes | str | None = None,
        secret_file: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(secret=load_secret(secret, secret_file))
        if max_bytes is not None and (
            isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0
        ):
            raise ValueError(
                f"FileStorage max_bytes must be a positive int or None, got {max_bytes!r}"
            )
        if not 0.0 < low_watermark <= 1.0:
            raise ValueError(f"FileStorage low_watermark must be in (0, 1], got {low_watermark!r}")
        if not stale_tmp_s > 0:
            raise ValueError(f"FileStorage stale_tmp_s must be > 0, got {stale_tmp_s!r}")
        if not str(root):
            raise ValueError("FileStorage root must not be empty")
        self._root = Path(root).resolve()
        self._max_bytes = max_bytes
        self._fsync = fsync
        self._low_watermark = low_watermark
        self._stale_tmp_ns = int(stale_tmp_s * 1e9)
        self._lock = threading.Lock()  # guards the accounting, the stamp clock, the root fd
        self._scan_lock = threading.Lock()  # one rescan/eviction at a time
        self._last_stamp_ns = 0
        self._scanned_bytes = 0
        self._written_since_scan = 0
        self._warned_drops: set[str] = set()
        self._retired_fds: list[int] = []  # old root fds: other threads may still use them
        self._root_fd = -1
        self._open_root()
        self._tmp_names = temp_names()
        if max_bytes is not None:
            self._enforce_cap(force=True)
        else:
            self._scan()  # removes stale temp files

    @property
    def root(self) -> Path:
        """The resolved root directory."""
        return self._root

    def object_path(self, key: StorageKey) -> Path:
        """Where the file of ``key`` lives (for inspection; this backend never opens it by
        path). ValueError if the key string is malformed."""
        return self._root / check_key_str(key.to_str())

    # -- interface -------------------------------------------------------------------------

    def exists(self, keys: Sequence[StorageKey]) -> int:
        with self._dirs() as dirs:
            for i, key in enumerate(keys):
                dir_parts, name = _split(check_key_str(key.to_str()))
                try:
                    d = dirs.get(dir_parts, create=False)
                    if d is None:
                        return i
                    mode = os.stat(name, dir_fd=d, follow_symlinks=False).st_mode
                    if not stat.S_ISREG(mode):
                        raise UnsafeEntry(entry_kind(mode), str(self.object_path(key)))
                except FileNotFoundError:
                    return i
                except UnsafeEntry as bad:
                    self._record_unsafe(bad.kind, bad.where, miss=False)
                    return i
        return len(keys)

    def get(self, keys: Sequence[StorageKey], dst: Sequence[torch.Tensor]) -> list[bool]:
        check_batch(keys, dst, "FileStorage.get")
        with self._dirs() as dirs:
            hits = [self._get_one(dirs, key, out) for key, out in zip(keys, dst, strict=True)]
        self._count(gets=len(hits))
        return hits

    def put(self, keys: Sequence[StorageKey], src: Sequence[torch.Tensor]) -> list[bool]:
        check_batch(keys, src, "FileStorage.put")
        flags = []
        dirs = self._dirs()
        try:
            for key, data in zip(keys, src, strict=True):
                try:
                    flags.append(self._put_one(dirs, key, data))
                except FileNotFoundError as err:
                    dirs.close()  # a directory on the way was removed: start over
                    dirs = self._dirs()  # (this reopens the root if it was removed)
                    try:
                        flags.append(self._put_one(dirs, key, data))
                    except FileNotFoundError:
                        self._drop("directory removed meanwhile", str(err))
                        flags.append(False)
        finally:
            dirs.close()
        return flags

    def close(self) -> None:
        with self._lock:
            fds, self._retired_fds = [self._root_fd, *self._retired_fds], []
            self._root_fd = -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    # -- one object ------------------------------------------------------------------------

    def _get_one(self, dirs: DirCache, key: StorageKey, dst: torch.Tensor) -> bool:
        key_str = check_key_str(key.to_str())
        view = tensor_bytes(dst)
        dir_parts, name = _split(key_str)
        where = str(self.object_path(key))
        try:
            d = dirs.get(dir_parts, create=False)
            if d is None:
                raise FileNotFoundError(where)
            try:
                fd = os.open(name, FILE_READ_FLAGS, dir_fd=d)
            except OSError as err:
                bad = refused(err, d, name, where)
                if bad is not None:
                    raise bad from None
                raise
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise UnsafeEntry(entry_kind(st.st_mode), where)
        except FileNotFoundError:
            self._count(get_misses=1)
            return False
        except UnsafeEntry as bad:
            self._record_unsafe(bad.kind, bad.where, miss=True)
            return False
        with open(fd, "rb") as f:
            try:
                header = self.codec.decode_header(key_str, f.read(HEADER_SIZE))
                if header.nbytes != view.nbytes:
                    raise ObjectError(
                        "length", f"object holds {header.nbytes} bytes, destination {view.nbytes}"
                    )
                got = _read_into(f, view)
                if got != header.nbytes:
                    raise ObjectError(
                        "short", f"payload of {got} bytes, header says {header.nbytes}"
                    )
                if f.read(1):
                    raise ObjectError("length", "trailing bytes after the payload")
                self.codec.check_payload(header, view)
            except ObjectError as err:
                self._record_corrupt(err.kind, key_str, str(err))
                self._remove_bad(d, name, st)
                return False
            self._touch(fd, None, st.st_mtime_ns)
        self._count(get_hits=1, get_bytes=view.nbytes)
        return True

    def _put_one(self, dirs: DirCache, key: StorageKey, src: torch.Tensor) -> bool:
        key_str = check_key_str(key.to_str())
        view = tensor_bytes(src)
        size = HEADER_SIZE + view.nbytes
        if self._max_bytes is not None and size > self._max_bytes:
            self._drop("too large", f"object of {size} bytes exceeds max_bytes={self._max_bytes}")
            return False
        dir_parts, name = _split(key_str)
        where = str(self.object_path(key))
        try:
            d = dirs.get(dir_parts, create=True)
            assert d is not None
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                if not stat.S_ISREG(st.st_mode):
                    raise UnsafeEntry(entry_kind(st.st_mode), where)
                self._touch(d, name, st.st_mtime_ns)
                self._count(already_present=1)
                return True
            self._write_atomic(dirs, dir_parts, name, self.codec.encode_header(key_str, view), view)
        except UnsafeEntry as bad:
            self._record_unsafe(bad.kind, bad.where, miss=False)
            self._count(dropped=1)
            return False
        except OSError as err:
            reason = _DROP_ERRNOS.get(err.errno or 0)
            if reason is None:
                raise
            self._drop(reason, f"{err.strerror} while writing {key_str}")
            return False
        self._count(puts=1, put_bytes=view.nbytes)
        if self._max_bytes is not None:
            with self._lock:
                self._written_since_scan += size
            self._enforce_cap(force=False)
        return True

    def _write_atomic(
        self,
        dirs: DirCache,
        dir_parts: tuple[str, ...],
        name: str,
        header: bytes,
        payload: memoryview,
    ) -> None:
        with self._lock:  # a generator must not run in two threads at once
            tmp = next(self._tmp_names)
        for attempt in range(3):
            d = dirs.get(dir_parts, create=True)
            assert d is not None
            try:
                fd = os.open(tmp, FILE_CREATE_FLAGS, 0o644, dir_fd=d)
                break
            except FileNotFoundError:
                # Another process's eviction removed the (empty) directory in between.
                dirs.forget(dir_parts)
                if attempt == 2:
                    raise
        try:
            with open(fd, "wb") as f:
                f.write(header)
                _write_payload(f, payload)
                f.flush()
                if self._fsync:
                    os.fsync(fd)
                stamp = self._stamp()
                os.utime(fd, ns=(stamp, stamp))
            os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=d)
            except OSError:
                pass
            raise

    # -- root ------------------------------------------------------------------------------

    def _open_root(self) -> None:
        self._root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        with self._lock:
            if self._root_fd >= 0:
                self._retired_fds.append(self._root_fd)
            self._root_fd = fd

    def _reopen_root_if_gone(self) -> bool:
        """Reopen (recreating) the root if its directory was removed; True if it was."""
        with self._lock:
            fd = self._root_fd
        if fd < 0:
            raise RuntimeError("FileStorage is closed")
        if os.fstat(fd).st_nlink > 0:
            return False
        self._open_root()
        return True

    def _dirs(self) -> DirCache:
        self._reopen_root_if_gone()
        with self._lock:
            return DirCache(self._root_fd, str(self._root))

    # -- recency, cleanup ------------------------------------------------------------------

    def _stamp(self) -> int:
        """A wall-clock ns stamp, strictly increasing within this process."""
        with self._lock:
            self._last_stamp_ns = max(_clock_ns(), self._last_stamp_ns + 1)
            return self._last_stamp_ns

    def _touch(self, fd: int, name: str | None, mtime_ns: int) -> None:
        """Mark an object used (LRU): set its atime, keep its mtime. ``name`` None: ``fd``
        is the object itself, else its directory."""
        if self._max_bytes is None:
            return
        times = (self._stamp(), mtime_ns)
        try:
            if name is None:
                os.utime(fd, ns=times)
            else:
                os.utime(name, ns=times, dir_fd=fd, follow_symlinks=False)
        except OSError:
            pass  # evicted by another process meanwhile, or not ours to stamp

    def _remove_bad(self, dir_fd: int, name: str, bad: os.stat_result) -> None:
        # Remove so that the next put can store a good copy (puts never rewrite), but only
        # the very file that failed: a good copy renamed in meanwhile stays.
        try:
            now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (bad.st_dev, bad.st_ino):
                os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass

    def _drop(self, reason: str, detail: str) -> None:
        self._count(dropped=1)
        with self._lock:
            first = reason not in self._warned_drops
            self._warned_drops.add(reason)
        if first:
            logger.warning(
                "FileStorage(%s): put dropped (%s): %s; further drops for this reason are "
                "only counted in stats",
                self._root,
                reason,
                detail,
            )

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
                total = self._evict(objects, total, int(cap * self._low_watermark))
            with self._lock:
                self._scanned_bytes = total
                self._written_since_scan = 0
        finally:
            self._scan_lock.release()

    def _evict(self, objects: list[tuple[int, str, int]], total: int, target: int) -> int:
        """Remove the oldest of ``objects`` until ``total`` <= ``target``; the new total."""
        with self._dirs() as dirs:
            total, evicted = evict_oldest(dirs, objects, total, target)
        self._count(evicted=evicted)
        return total

    def _scan(self) -> tuple[list[tuple[int, str, int]], int]:
        """All objects as ``(atime_ns, relative path, size)`` and their total size; removes
        stale temp files (``file_tree.scan_tree``)."""
        with self._lock:
            root_fd = self._root_fd
        return scan_tree(root_fd, self._stale_tmp_ns)


def _read_into(f: BinaryIO, view: memoryview) -> int:
    """Fill ``view`` from ``f``; returns the bytes read (less than ``view.nbytes`` at EOF)."""
    done = 0
    while done < view.nbytes:
        n = f.readinto(view[done:])  # type: ignore[attr-defined]
        if not n:
            break
        done += n
    return done
