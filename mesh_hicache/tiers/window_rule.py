"""Which windowed pages the host (L2) and storage (L3) tiers keep (the ``kv_window`` region).

A resume at boundary ``b`` reads a windowed layer's K/V of only the last ``window - 1``
tokens before ``b`` and the sinks (:mod:`mesh_hicache.radix.window`). Below the device
tier a page's windowed K/V is therefore kept only where a boundary needs it; the
full-attention K/V (``kv``) of every page is kept as before:

- **keep** (:meth:`WindowRule.write_offsets`): a node backed up to host keeps the
  windowed pages that a resume at its end needs, and those that a resume at every
  multiple of ``checkpoint_tokens`` inside or just past it needs, among those its device
  copy holds; L3 stores what the host copy holds. The checkpoints depend on the page
  index alone, so whatever way the tree splits a path later, a boundary at each
  checkpoint finds its windowed pages. A node end created by a later split (a branch
  point) gets them when a node below it is backed up (:meth:`WindowRule.start_pages`:
  the pages a resume at that node's start needs, copied from its ancestors' device
  copies to their host copies, then stored in L3 unless present); until then a hit
  there from host or L3 falls back to the deepest boundary that has them (at most
  ``checkpoint_tokens`` shorter). ``checkpoint_tokens=0`` keeps every page.
- **hit** (:meth:`WindowRule.limit`, :meth:`WindowRule.resumes`): an L3 hit ends at the
  deepest boundary at which every page a resume needs is present (in L3, or before the
  hit's start in the tree), and before the first checkpoint whose pages L3 lacks (so a
  lost object only shortens hits). Meshes sharing an L3 namespace should use the same
  ``checkpoint_tokens``. Host and device hits follow the tree's record of the pages each
  copy lacks (``TreeNode.window_missing``, ``host_window_missing``).
- **read** (:meth:`WindowRule.kept`, :meth:`WindowRule.kept_missing`): a prefetch of a
  hit ending at ``end`` reserves host window rows for the pages its end and the
  checkpoints up to it need (the same count on every rank) and reads those that exist;
  the tree records every other page as missing.

Pure functions of page indices and the spec; no storage access, no collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mesh_hicache.radix.node import TreeNode
from mesh_hicache.radix.window import boundary_pages, resumable
from mesh_hicache.spec import WindowSpec


class WindowRule:
    """Which ``kv_window`` pages L3 writes and when a hit may end (module docstring).

    ``groups``: the spec's window groups (non-empty); ``checkpoint_tokens``: a multiple of
    ``page_size`` >= 0 (``ValueError`` otherwise); 0 makes every page boundary a
    checkpoint, so every page is stored.
    """

    def __init__(
        self, groups: Sequence[WindowSpec], page_size: int, checkpoint_tokens: int
    ) -> None:
        if not groups:
            raise ValueError("WindowRule needs at least one window group")
        if checkpoint_tokens < 0 or checkpoint_tokens % page_size:
            raise ValueError(
                f"window_checkpoint_tokens must be a multiple of the page size ({page_size}) "
                f">= 0, got {checkpoint_tokens}"
            )
        self.groups = tuple(groups)
        self.page_size = page_size
        self.checkpoint_tokens = checkpoint_tokens
        self._step = checkpoint_tokens or page_size
        self._reach = max(g.window for g in self.groups)
        self._sink_pages = -(-max(g.sink_tokens for g in self.groups) // page_size)

    def needed(self, boundary: int) -> frozenset[int]:
        """Pages (absolute) of any group that a resume at ``boundary`` tokens needs."""
        out: set[int] = set()
        for g in self.groups:
            out |= boundary_pages(boundary, self.page_size, g)
        return frozenset(out)

    def checkpoint_pages(self, first: int, last: int, upto: int) -> set[int]:
        """Pages in ``[first, last)`` that a resume at a checkpoint ``<= upto`` tokens needs."""
        ps, step = self.page_size, self._step
        out: set[int] = set()
        b = (first * ps // step + 1) * step  # checkpoints before first * ps need no page here
        stop = min(upto, last * ps + self._reach - 1)  # later ones need none either
        while b <= stop:
            out.update(p for p in self.needed(b) if first <= p < last)
            b += step
        return out

    def write_offsets(self, node: TreeNode) -> tuple[int, ...]:
        """Offsets of ``node``'s pages (0 = its first) whose windowed K/V a backup of its
        device copy keeps: those its end and the checkpoints need, except the pages the
        copy lacks (``window_missing``)."""
        first = (node.prefix_len - node.num_tokens) // self.page_size
        last = first + node.num_pages
        pages = self.checkpoint_pages(first, last, last * self.page_size + self._reach)
        pages.update(p for p in self.needed(node.prefix_len) if p >= first)
        gaps = node.window_missing
        return tuple(p - first for p in sorted(pages) if p - first not in gaps)

    def start_pages(self, node: TreeNode) -> list[tuple[TreeNode, int]]:
        """The windowed pages a resume at ``node``'s start (its parent's end) needs that
        lie in its ancestors, are not sinks and that no checkpoint needs (those are kept
        with their node), as ``(ancestor, offset)``."""
        start = node.prefix_len - node.num_tokens
        skip = self.checkpoint_pages(0, start // self.page_size, start + self._reach)
        out = []
        for owner, i in self.resume_pages(node, start):
            page = owner.prefix_len // self.page_size - owner.num_pages + i
            if page >= self._sink_pages and page not in skip:
                out.append((owner, i))
        return out

    def resume_pages(self, node: TreeNode, boundary: int) -> list[tuple[TreeNode, int]]:
        """The windowed pages a resume at ``boundary`` tokens (at most ``node``'s end)
        needs, located in ``node`` and its ancestors, as ``(owner, offset)``."""
        pages = self.needed(boundary)
        out: list[tuple[TreeNode, int]] = []
        owner: TreeNode | None = node
        end = node.prefix_len // self.page_size  # owner's pages are [end - num_pages, end)
        while pages and owner is not None and not owner.is_sentinel:
            first = end - owner.num_pages
            out.extend((owner, p - first) for p in sorted(pages) if first <= p < end)
            pages = frozenset(p for p in pages if p < first)
            owner, end = owner.parent, first
        return out

    def limit(self, start_page: int, candidates: int, present: Callable[[int], bool]) -> int:
        """``candidates`` cut back before the first checkpoint past ``start_page`` whose
        pages (page ``start_page + i`` iff ``present(i)``) are not all present: a hit
        never ends past it, so every rank holds the pages :meth:`kept_missing` keeps."""
        ps = self.page_size
        end = start_page + candidates
        for p in sorted(self.checkpoint_pages(start_page, end, end * ps)):
            if not present(p - start_page):
                # Every checkpoint needing page p lies past it: stop before the first.
                first_b = (p // (self._step // ps) + 1) * self._step
                return min(candidates, (first_b - 1) // ps - start_page)
        return candidates

    def resumes(
        self,
        start_page: int,
        pages: int,
        present: Callable[[int], bool],
        missing_before: frozenset[int],
    ) -> bool:
        """Whether a resume ``pages`` past ``start_page`` finds every page it needs:
        pages before ``start_page`` unless in ``missing_before`` (the tree's), page
        ``start_page + i`` iff ``present(i)`` (L3's)."""
        have = _Presence(start_page, present, missing_before)
        return resumable((start_page + pages) * self.page_size, have, self.page_size, self.groups)

    def kept(self, start_page: int, pages: int) -> set[int]:
        """Pages of ``[start_page, end)`` that a resume at ``end = start_page + pages`` or
        at a checkpoint up to it needs."""
        end = start_page + pages
        keep = self.checkpoint_pages(start_page, end, end * self.page_size)
        keep.update(p for p in self.needed(end * self.page_size) if p >= start_page)
        return keep

    def kept_missing(self, start_page: int, pages: int) -> tuple[int, ...]:
        """Pages ``[start_page, end)`` a prefetch ending at ``end = start_page + pages``
        marks missing in the tree: all but :meth:`kept` (:meth:`limit` made sure every
        rank read these)."""
        keep = self.kept(start_page, pages)
        return tuple(p for p in range(start_page, start_page + pages) if p not in keep)


class _Presence:
    """A page-presence container: the tree's pages before ``start``, then L3's."""

    __slots__ = ("_missing", "_present", "_start")

    def __init__(self, start: int, present: Callable[[int], bool], missing: frozenset[int]) -> None:
        self._start, self._present, self._missing = start, present, missing

    def __contains__(self, page: object) -> bool:
        assert isinstance(page, int)
        if page < self._start:
            return page not in self._missing
        return self._present(page - self._start)
