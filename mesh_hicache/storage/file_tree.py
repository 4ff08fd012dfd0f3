"""The file backend's tree walk: object inventory for the LRU cap, stale temp removal.

Temp files are named ``.tmp-<host tag>-<pid>-<random>-<n>`` (never a valid key name).
One is abandoned, and removed by the next walk, when it is older than the bound or its
writer process (on this host, by pid) is gone. Walks go by directory descriptor
(``os.fwalk`` from the root's descriptor), never follow symlinks, and only ever count,
evict or remove regular files.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import socket
import stat
import time
import uuid
from collections.abc import Iterator

from mesh_hicache.storage.keys import KEY_PATTERN
from mesh_hicache.storage.safe_dir import DirCache, UnsafeEntry

TMP_PREFIX = ".tmp-"


def temp_names() -> Iterator[str]:
    """Fresh temp file names for this process (unique across hosts and processes)."""
    host, pid, tag = _host_tag(), os.getpid(), uuid.uuid4().hex[:8]
    return (f"{TMP_PREFIX}{host}-{pid}-{tag}-{i}" for i in itertools.count())


def _host_tag() -> str:
    """8 hex chars naming this host in temp file names (pids are per host)."""
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def is_stale_tmp(name: str, mtime_ns: int, now_ns: int, stale_ns: int) -> bool:
    """True if the temp file ``name`` (last written at ``mtime_ns``) is abandoned: older
    than ``stale_ns``, or its writer on this host is gone. Temps of this process may
    belong to a write in flight and only age out."""
    if now_ns - mtime_ns > stale_ns:
        return True
    fields = name[len(TMP_PREFIX) :].split("-")
    if len(fields) != 4 or fields[0] != _host_tag() or not fields[1].isdigit():
        return False
    pid = int(fields[1])
    return pid != os.getpid() and not _pid_alive(pid)


def scan_tree(root_fd: int, stale_ns: int) -> tuple[list[tuple[int, str, int]], int]:
    """Objects under ``root_fd`` as ``(atime_ns, relative path, size)`` and their total
    size; removes abandoned temp files on the way (see ``is_stale_tmp``)."""
    objects: list[tuple[int, str, int]] = []
    total = 0
    now = time.time_ns()
    for dirpath, _dirnames, filenames, dir_fd in os.fwalk(".", dir_fd=root_fd):
        for name in filenames:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # never count, evict or remove what is not a plain file
            if name.startswith(TMP_PREFIX):
                if is_stale_tmp(name, st.st_mtime_ns, now, stale_ns):
                    try:
                        os.unlink(name, dir_fd=dir_fd)
                    except OSError:
                        pass  # gone already, or a read-only store
                continue
            rel = os.path.normpath(os.path.join(dirpath, name))
            if not KEY_PATTERN.fullmatch(rel):
                continue  # not ours: never count or evict foreign files
            objects.append((st.st_atime_ns, rel, st.st_size))
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
            if d is not None:
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
