"""Paths under an open root directory, resolved one component at a time without symlinks.

Every directory is opened relative to its parent's descriptor with ``O_NOFOLLOW |
O_DIRECTORY`` and every file operation takes a ``dir_fd``, so swapping a directory for a
symlink at any moment cannot redirect a read, a write or an unlink outside the root: the
open of the symlink fails (``UnsafeEntry``), and an already opened descriptor still
names the original directory. Nothing here follows, removes or rewrites an entry that is
not a plain directory or regular file.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Callable

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
"""``O_NONBLOCK``: opening a planted FIFO must not hang; regular files ignore it."""
FILE_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_REFUSED_ERRNOS = {errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO}


class UnsafeEntry(Exception):
    """An entry on the way to an object is a symlink or not the expected file type."""

    def __init__(self, kind: str, where: str) -> None:
        super().__init__(f"{kind} at {where}")
        self.kind = kind
        self.where = where


def entry_kind(mode: int) -> str:
    """A short name for the file type of ``mode`` (for warnings and counters)."""
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "regular file"
    return "special file"


def refused(err: OSError, parent_fd: int, name: str, where: str) -> UnsafeEntry | None:
    """The ``UnsafeEntry`` an ``os.open`` error stands for, or None for other errors."""
    if err.errno not in _REFUSED_ERRNOS:
        return None
    try:
        mode = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
        kind = entry_kind(mode)
    except OSError:
        kind = "unexpected entry"
    return UnsafeEntry(kind, where)


def open_child_dir(
    parent_fd: int, name: str, *, create: bool, where: str | Callable[[], str]
) -> int | None:
    """Descriptor of directory ``name`` inside ``parent_fd``; None if absent and not ``create``.

    Raises ``UnsafeEntry`` when ``name`` is a symlink or not a directory, and
    FileNotFoundError when the parent itself was removed meanwhile. ``where`` (the path
    for messages, or a function building it: only errors need it).
    """
    for _ in range(3):
        try:
            return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                return None
        except OSError as err:
            bad = refused(err, parent_fd, name, where if isinstance(where, str) else where())
            if bad is not None:
                raise bad from None
            raise
        try:
            os.mkdir(name, 0o777, dir_fd=parent_fd)
        except FileExistsError:
            pass  # another writer created it (or an entry we refuse on the next open)
    path = where if isinstance(where, str) else where()
    raise FileNotFoundError(errno.ENOENT, "directory vanished while being created", path)


class DirCache:
    """Directory descriptors below ``root_fd`` opened during one batch call.

    ``get(parts)`` opens ``root/parts[0]/parts[1]/...`` component by component (see
    ``open_child_dir``), reusing descriptors of shared prefixes; ``close`` closes all of
    them (never ``root_fd``, which the caller owns). Not thread-safe: one per call.
    """

    def __init__(self, root_fd: int, root_name: str) -> None:
        self._root_fd = root_fd
        self._root_name = root_name
        self._fds: dict[tuple[str, ...], int] = {}

    def get(self, parts: tuple[str, ...], *, create: bool) -> int | None:
        """The descriptor of directory ``parts`` (None if absent and not ``create``)."""
        fd = self._root_fd
        for depth in range(1, len(parts) + 1):
            prefix = parts[:depth]
            cached = self._fds.get(prefix)
            if cached is not None:
                fd = cached
                continue
            child = open_child_dir(
                fd,
                prefix[-1],
                create=create,
                where=functools.partial(os.path.join, self._root_name, *prefix),
            )
            if child is None:
                return None
            self._fds[prefix] = child
            fd = child
        return fd

    def forget(self, parts: tuple[str, ...]) -> None:
        """Drop (and close) the cached descriptors of ``parts`` and below."""
        for prefix in [p for p in self._fds if p[: len(parts)] == parts]:
            os.close(self._fds.pop(prefix))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> DirCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
