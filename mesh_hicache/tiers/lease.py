"""Lease: the protections one holder keeps in the tree, each undone exactly once.

Two kinds of protection, both counted along the whole path to the root
(docs/DESIGN.md section 5): a *lock* keeps a node's device copy (never evicted from
device) and a *host protection* keeps its host copy. Requests hold one locked and one
host-protected node that move deeper as the request proceeds; a backup holds every node it copies
until the copy (and its L3 write) is consumed. Both go through this class, so the lock
protocol lives in one place.

Thread story: the scheduler thread only. No agreements: every rank takes and drops the
same protections in the same order because it makes the same decisions.
"""

from __future__ import annotations

from mesh_hicache.radix import RadixTree, TreeNode


class Lease:
    """Locks and host protections taken through this object, released through it."""

    __slots__ = ("_locked", "_protected", "_tree")

    def __init__(self, tree: RadixTree) -> None:
        self._tree = tree
        self._locked: list[TreeNode] = []
        self._protected: list[TreeNode] = []

    @property
    def locked(self) -> tuple[TreeNode, ...]:
        """Nodes whose path this lease keeps on device."""
        return tuple(self._locked)

    @property
    def protected(self) -> tuple[TreeNode, ...]:
        """Nodes whose path this lease keeps on host."""
        return tuple(self._protected)

    def hold(self, node: TreeNode, *, host: bool = True) -> None:
        """Lock ``node``'s path and, with ``host``, protect its host copies too."""
        self._tree.lock(node)
        self._locked.append(node)
        if host:
            self._tree.protect_host(node)
            self._protected.append(node)

    def move(self, node: TreeNode, *, host: bool) -> None:
        """Lock ``node`` instead of what is locked now (and, with ``host``, protect it
        instead of what is protected now). The new protection is taken before the old one
        is dropped, so a shared path is never unprotected in between."""
        self._tree.lock(node)
        self.unlock()
        self._locked.append(node)
        if host:
            self._tree.protect_host(node)
            self.release_host()
            self._protected.append(node)

    def unlock(self) -> None:
        """Drop every lock of this lease (its nodes may be evicted from device again)."""
        locked, self._locked = self._locked, []
        for node in locked:
            self._tree.unlock(node)

    def release_host(self) -> None:
        """Drop every host protection of this lease."""
        protected, self._protected = self._protected, []
        for node in protected:
            self._tree.release_host(node)

    def release(self) -> None:
        """Drop everything: locks first, then host protections."""
        self.unlock()
        self.release_host()
