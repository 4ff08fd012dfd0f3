"""The ``file`` backend: one file per object under a root directory (the embedded default).

Layout: ``<root>/<key string>`` (``v1/<ns digest>/<region>/<page hash>/<slice tag>``),
each file an object of format version 2 (``objects.py``): a 64-byte header, a chunk
table, then the payload, so that ``get_ranges`` reads and verifies only the chunks holding
the asked byte ranges (``pread`` at offsets on the open descriptor, ``file_read.py``).
Chunks are whole last-dim vectors of the row written (``objects.chunk_bytes_for``).

- Writes are atomic: a temp file (``.tmp-*``, never a valid key name) in the target
  directory, then a rename. Readers see a whole object or none. A crashed writer leaves
  only a temp file, which readers ignore; every open of a root removes temp files of
  ours whose writer process is gone (same host, boot and pid namespace) or that are
  older than ``stale_tmp_s`` (``file_tree.py``; other programs' files are never touched).
- One object never disables the tier: an object a reader cannot check is a miss left in
  place, a damaged one a miss that is removed (``objects.REMOVABLE_KINDS``), one that
  cannot be opened or read a miss counted in ``stats.unreadable``.
- Keys cannot escape the root, even while someone else rewrites the tree: the key string
  is re-checked against the grammar, the root is held open as a directory descriptor,
  and every key is resolved from it one component at a time with ``O_NOFOLLOW``
  (``safe_dir.py``). A symlink, or anything but a directory / regular file, on the way to
  an object is refused: a miss (or a dropped write) plus one warning per kind, counted in
  ``stats.unsafe``; it is never followed and never removed.
- Several processes may share a root (different ranks write different keys; the same
  key written twice holds the same bytes, and the last rename wins).
- A read-only or full store drops writes (one warning per reason) and keeps serving reads.
- Size cap (``max_bytes``, header and table bytes included): LRU by access time shared
  by every process on the root (``file_cap.py``).
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
from mesh_hicache.storage.file_cap import RecencyCap
from mesh_hicache.storage.file_read import GAP_BYTES, read_ranges, read_whole
from mesh_hicache.storage.file_tree import scan_tree, temp_names
from mesh_hicache.storage.keys import StorageKey
from mesh_hicache.storage.objects import (
    HEADER_SIZE,
    REMOVABLE_KINDS,
    ObjectError,
    chunk_bytes_for,
    table_size,
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


def _now_ns() -> int:
    return _clock_ns()  # looked up at call time, so a replaced _clock_ns takes effect


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
    ``read_gap_bytes``: a ranged read also reads (and checks) gaps shorter than this
    between the chunks it needs (``file_read.GAP_BYTES``; 0: only those chunks).
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
        read_gap_bytes: int = GAP_BYTES,
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
        if isinstance(read_gap_bytes, bool) or not isinstance(read_gap_bytes, int):
            raise TypeError(f"FileStorage read_gap_bytes must be an int, got {read_gap_bytes!r}")
        if read_gap_bytes < 0:
            raise ValueError(f"FileStorage read_gap_bytes must be >= 0, got {read_gap_bytes}")
        self._read_gap = read_gap_bytes
        if not str(root):
            raise ValueError("FileStorage root must not be empty")
        self._root = Path(root).resolve()
        self._root_str = str(self._root)  # error messages (built only on errors)
        self._max_bytes = max_bytes
        self._fsync = fsync
        self._cap = RecencyCap(max_bytes, low_watermark, int(stale_tmp_s * 1e9), _now_ns)
        self._lock = threading.Lock()  # guards the root fd, the temp names, the warnings
        self._warned_drops: set[str] = set()
        self._retired_fds: list[int] = []  # old root fds: other threads may still use them
        self._root_fd = -1
        self._open_root()
        self._tmp_names = temp_names()
        if max_bytes is not None:
            self._enforce_cap(force=True)
        else:
            scan_tree(self._root_fd, int(stale_tmp_s * 1e9))  # removes stale temp files

    @property
    def root(self) -> Path:
        """The resolved root directory."""
        return self._root

    def object_path(self, key: StorageKey) -> Path:
        """Where the file of ``key`` lives (for inspection; this backend never opens it by
        path). ValueError if the key string is malformed."""
        return self._root / self.key_str(key)

    # -- interface -------------------------------------------------------------------------

    def exists(self, keys: Sequence[StorageKey]) -> int:
        with self._dirs() as dirs:
            for i, key in enumerate(keys):
                if not self._exists_one(dirs, key):
                    return i
        return len(keys)

    def exists_each(self, keys: Sequence[StorageKey]) -> list[bool]:
        with self._dirs() as dirs:
            return [self._exists_one(dirs, key) for key in keys]

    def _exists_one(self, dirs: DirCache, key: StorageKey) -> bool:
        dir_parts, name = _split(self.key_str(key))
        try:
            d = dirs.get(dir_parts, create=False)
            if d is None:
                return False
            mode = os.stat(name, dir_fd=d, follow_symlinks=False).st_mode
            if not stat.S_ISREG(mode):
                raise UnsafeEntry(entry_kind(mode), str(self.object_path(key)))
        except FileNotFoundError:
            return False
        except UnsafeEntry as bad:
            self._record_unsafe(bad.kind, bad.where, miss=False)
            return False
        return True

    def get(self, keys: Sequence[StorageKey], dst: Sequence[torch.Tensor]) -> list[bool]:
        check_batch(keys, dst, "FileStorage.get")
        with self._dirs() as dirs:
            hits = [self._get_one(dirs, key, out, None) for key, out in zip(keys, dst, strict=True)]
        self._count(gets=len(hits))
        return hits

    def get_ranges(
        self,
        keys: Sequence[StorageKey],
        dst: Sequence[torch.Tensor],
        ranges: Sequence[Sequence[tuple[int, int]]],
    ) -> list[bool]:
        check_batch(keys, dst, "FileStorage.get_ranges")
        assert len(ranges) == len(keys), (len(ranges), len(keys))
        with self._dirs() as dirs:
            hits = [
                self._get_one(dirs, key, out, want)
                for key, out, want in zip(keys, dst, ranges, strict=True)
            ]
        self._count(gets=len(hits), range_gets=len(hits))
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

    def _get_one(
        self,
        dirs: DirCache,
        key: StorageKey,
        dst: torch.Tensor,
        ranges: Sequence[tuple[int, int]] | None,
    ) -> bool:
        """Read one object (``ranges`` None: whole) into ``dst``; False on a miss."""
        key_str = self.key_str(key)
        view = tensor_bytes(dst)
        dir_parts, name = _split(key_str)
        try:
            d = dirs.get(dir_parts, create=False)
            if d is None:
                raise FileNotFoundError(key_str)
            try:
                fd = os.open(name, FILE_READ_FLAGS, dir_fd=d)
            except FileNotFoundError:
                raise
            except OSError as err:
                bad = refused(err, d, name, os.path.join(self._root_str, key_str))
                if bad is not None:
                    raise bad from None
                self._record_unreadable(err, key_str)  # this object only: a miss
                return False
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise UnsafeEntry(entry_kind(st.st_mode), os.path.join(self._root_str, key_str))
        except FileNotFoundError:
            self._count(get_misses=1)
            return False
        except UnsafeEntry as bad:
            self._record_unsafe(bad.kind, bad.where, miss=True)
            return False
        try:
            if ranges is None:
                got = read_whole(fd, st.st_size, self.codec, key_str, view)
            else:
                got = read_ranges(fd, st.st_size, self.codec, key_str, view, ranges, self._read_gap)
        except ObjectError as err:
            os.close(fd)
            self._record_corrupt(err.kind, key_str, str(err))
            if err.kind in REMOVABLE_KINDS:
                self._remove_bad(d, name, st)
            return False
        except OSError as err:  # EIO and the like on this object's bytes: a miss
            os.close(fd)
            self._record_unreadable(err, key_str)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._cap.touch(fd, None, st.st_mtime_ns)
        os.close(fd)
        self._count(get_hits=1, get_bytes=got)
        return True

    def _put_one(self, dirs: DirCache, key: StorageKey, src: torch.Tensor) -> bool:
        key_str = self.key_str(key)
        view = tensor_bytes(src)
        chunk = self._chunk_bytes(src)
        size = HEADER_SIZE + view.nbytes
        size += 0 if chunk is None else table_size(view.nbytes, chunk, self.codec.keyed)
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
                self._cap.touch(d, name, st.st_mtime_ns)
                self._count(already_present=1)
                return True
            if chunk is None:
                header, table = self.codec.encode_header(key_str, view), b""
            else:
                header, table = self.codec.encode_chunked(key_str, view, chunk)
            self._write_atomic(dirs, dir_parts, name, header, view, table)
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
            self._cap.wrote(size)
            self._enforce_cap(force=False)
        return True

    def _chunk_bytes(self, src: torch.Tensor) -> int | None:
        """The chunk size of ``src``'s table (None: a format version 1 object, no table;
        ``scripts/bench_storage.py``'s version 1 writer returns None)."""
        return chunk_bytes_for(src.shape, src.element_size())

    def _write_atomic(
        self,
        dirs: DirCache,
        dir_parts: tuple[str, ...],
        name: str,
        header: bytes,
        payload: memoryview,
        table: bytes,
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
                f.write(table)
                _write_payload(f, payload)
                f.flush()
                if self._fsync:
                    os.fsync(fd)
                stamp = self._cap.stamp()
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
        with self._lock:
            root_fd = self._root_fd
        self._count(evicted=self._cap.enforce(root_fd, self._dirs, force=force))
