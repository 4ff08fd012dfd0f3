"""The file backend's tree walk: object inventory for the LRU cap, stale temp removal.

Only what is ours is ever counted, evicted or removed: objects whose relative path
matches the key grammar (``KEY_PATTERN``) and whose header starts with our magic, and
temp files named ``.tmp-<owner tag>-<pid>-<random>-<n>`` inside a key directory
(``KEY_DIR_PATTERN``). A root shared with other programs keeps their files, even ones
named ``.tmp-*``. A temp file is abandoned, and removed by the next walk, when it is
older than the bound or its writer is gone; the writer is looked up by pid only when
its owner tag is this process's (same host, boot and pid namespace), since a pid means
nothing in another container sharing the root. Recency stamps from the future (a
clock that jumped, a planted file) are not this backend's record: such an object
counts as the oldest. Walks go by directory descriptor (``os.fwalk`` from the root's
descriptor), never follow symlinks, and only ever touch regular files.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import re
import socket
import stat
import time
import uuid
from collections.abc import Iterator

from mesh_hicache.storage.keys import KEY_DIR_PATTERN, KEY_PATTERN
from mesh_hicache.storage.objects import OBJECT_MAGIC
from mesh_hicache.storage.safe_dir import FILE_READ_FLAGS, DirCache, UnsafeEntry

TMP_PREFIX = ".tmp-"
_TMP_NAME = re.compile(r"\.tmp-([0-9a-f]{8})-(\d+)-[0-9a-f]{8}-\d+")
FUTURE_SLACK_NS = 60 * 10**9
"""Recency stamps more than this ahead of the wall clock are not ours (counted oldest)."""


def temp_names() -> Iterator[str]:
    """Fresh temp file names for this process (unique across hosts and processes)."""
    host, pid, tag = _host_tag(), os.getpid(), uuid.uuid4().hex[:8]
    return (f"{TMP_PREFIX}{host}-{pid}-{tag}-{i}" for i in itertools.count())


@functools.cache
def _host_tag() -> str:
    """8 hex chars naming where this process's pids mean something: the host, its boot
    and this pid namespace (two containers sharing a root see different tags)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass  # not Linux: the host name alone
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=4).hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def is_stale_tmp(name: str, mtime_ns: int, now_ns: int, stale_ns: int) -> bool:
    """True if the temp file ``name`` (of ours, last written at ``mtime_ns``) is
    abandoned: older than ``stale_ns``, or written by a process of this host, boot and
    pid namespace that is gone. Temps of this process may belong to a write in flight
    and only age out, and so do other owners' (their pids are not ours to test)."""
    if now_ns - mtime_ns > stale_ns:
        return True
    m = _TMP_NAME.fullmatch(name)
    if m is None or m.group(1) != _host_tag():
        return False
    pid = int(m.group(2))
    return pid != os.getpid() and not _pid_alive(pid)


def _is_object(dir_fd: int, name: str) -> bool:
    """True if the file ``name`` starts with our object magic (a file that only took a
    name of ours is not ours to evict)."""
    try:
        fd = os.open(name, FILE_READ_FLAGS, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        return os.pread(fd, len(OBJECT_MAGIC), 0) == OBJECT_MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)


def scan_tree(
    root_fd: int, stale_ns: int, now_ns: int | None = None
) -> tuple[list[tuple[int, str, int]], int]:
    """Objects under ``root_fd`` as ``(atime_ns, relative path, size)`` and their total
    size (an atime past ``now_ns``, the stamps' clock, by more than ``FUTURE_SLACK_NS``
    reads as 0); removes abandoned temp files on the way (see ``is_stale_tmp``)."""
    objects: list[tuple[int, str, int]] = []
    total = 0
    now = time.time_ns() if now_ns is None else now_ns
    for dirpath, _dirnames, filenames, dir_fd in os.fwalk(".", dir_fd=root_fd):
        for name in filenames:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # never count, evict or remove what is not a plain file
            reldir = os.path.normpath(dirpath)
            if _TMP_NAME.fullmatch(name) and KEY_DIR_PATTERN.fullmatch(reldir):
                if is_stale_tmp(name, st.st_mtime_ns, now, stale_ns):
                    try:
                        os.unlink(name, dir_fd=dir_fd)
                    except OSError:
                        pass  # gone already, or a read-only store
                continue
            rel = os.path.join(reldir, name)
            if not KEY_PATTERN.fullmatch(rel):
                continue  # not ours: never count or evict foreign files
            atime = st.st_atime_ns if st.st_atime_ns <= now + FUTURE_SLACK_NS else 0
            objects.append((atime, rel, st.st_size))
            total += st.st_size
    return objects, total


def evict_oldest(
    dirs: DirCache, objects: list[tuple[int, str, int]], total: int, target: int
) -> tuple[int, int]:
    """Unlink objects (sorted oldest first, as from ``scan_tree``) through ``dirs`` until
    ``total`` <= ``target``, removing page directories left empty. Returns the new total
    and how many objects this call removed (another process may have removed some first).
    """
    evicted = 0
    for _atime, rel, size in objects:
        if total <= target:
            break
        parts = rel.split("/")
        dir_parts, name = tuple(parts[:-1]), parts[-1]
        try:
            d = dirs.get(dir_parts, create=False)
            if d is not None and _is_object(d, name):
                os.unlink(name, dir_fd=d)
                evicted += 1
                parent = dirs.get(dir_parts[:-1], create=False)
                if parent is not None:
                    os.rmdir(dir_parts[-1], dir_fd=parent)
                    dirs.forget(dir_parts)
        except (OSError, UnsafeEntry):
            pass  # evicted by another process first, or the directory is not empty
        total -= size
    return total, evicted
