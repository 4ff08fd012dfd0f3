"""Windowed-KV rules: which pages a prefix boundary needs of a sliding-window layer group.

A query at position ``p`` of a layer with window ``W`` and ``S`` sink tokens sees the
keys at ``p - W < k <= p`` and at ``k < S``. A request resumed at boundary ``b`` (``b``
cached tokens; its first new token sits at position ``b``) therefore reads from the
cache only the windowed K/V of positions ``[max(0, b - W + 1), b)`` and ``[0, min(S,
b))``: every later query's window starts later. Pages are the cache's pages
(``page_size`` tokens, page ``i`` holds positions ``[i * ps, (i + 1) * ps)``).

The rules, as pure functions of the boundaries and the :class:`~mesh_hicache.spec.WindowSpec`
groups (nothing here knows a model):

- :func:`boundary_pages`: the pages of one group that a resume at ``b`` needs;
- :func:`live_pages` / :func:`freeable_pages`: on one path with several cached
  boundaries, the pages some boundary still needs, and the others, which can be freed
  first (or never written to L2/L3);
- :func:`resumable` / :func:`deepest_resumable`: a hit at ``b`` is allowed only where
  every group's needed pages are present (the full-attention KV and any recurrent state
  are checked by the tree as before); on a matched path, the deepest such boundary;
  :func:`deepest_window_end` is the same rule over a path's per-node missing pages
  (``TreeNode.window_missing``), as ``RadixTree.match_prefix`` applies it;
- :func:`tree_window_pages` / :func:`held_bytes`: over a tree, the pages each node keeps
  for the boundaries below and at it, and the bytes that holds compared with treating the
  windowed layers as full attention.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence, Set
from dataclasses import dataclass

from mesh_hicache.radix.node import NO_PAGES, TreeNode
from mesh_hicache.spec import StateSpec, WindowSpec


def needed_tokens(boundary: int, group: WindowSpec) -> tuple[tuple[int, int], ...]:
    """Half-open token ranges of ``group``'s K/V that a resume at ``boundary`` reads,
    in order, without overlap (the sinks first when they lie before the window)."""
    if boundary < 0:
        raise ValueError(f"boundary must be >= 0, got {boundary}")
    lo = max(0, boundary - group.window + 1)
    sinks = min(group.sink_tokens, boundary)
    if sinks >= lo:
        return ((0, boundary),) if boundary else ()
    ranges = [(0, sinks)] if sinks else []
    if lo < boundary:
        ranges.append((lo, boundary))
    return tuple(ranges)


def boundary_pages(boundary: int, page_size: int, group: WindowSpec) -> frozenset[int]:
    """Page indices of ``group``'s K/V that a resume at ``boundary`` needs."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    pages: set[int] = set()
    for start, end in needed_tokens(boundary, group):
        pages.update(range(start // page_size, (end - 1) // page_size + 1))
    return frozenset(pages)


def live_pages(boundaries: Iterable[int], page_size: int, group: WindowSpec) -> frozenset[int]:
    """Pages of one path that at least one of its cached ``boundaries`` needs."""
    live: set[int] = set()
    for b in boundaries:
        live |= boundary_pages(b, page_size, group)
    return frozenset(live)


def freeable_pages(
    num_pages: int, boundaries: Iterable[int], page_size: int, group: WindowSpec
) -> tuple[int, ...]:
    """Pages ``[0, num_pages)`` of one path behind the window of every cached boundary."""
    live = live_pages(boundaries, page_size, group)
    return tuple(i for i in range(num_pages) if i not in live)


def resumable(
    boundary: int, present: Container[int], page_size: int, groups: Sequence[WindowSpec]
) -> bool:
    """Whether every group's pages that a resume at ``boundary`` needs are ``present``
    (page indices of the path whose windowed K/V is held on some tier)."""
    return all(all(p in present for p in boundary_pages(boundary, page_size, g)) for g in groups)


def deepest_resumable(
    boundaries: Iterable[int], present: Container[int], page_size: int, groups: Sequence[WindowSpec]
) -> int:
    """The deepest of a matched path's candidate ``boundaries`` (token counts, e.g. the
    ends of the nodes that hold the full-attention KV and any state) at which
    :func:`resumable` holds; 0 (recompute from the start) when none does."""
    ok = [b for b in boundaries if resumable(b, present, page_size, groups)]
    return max(ok, default=0)


class _AllBut:
    """Every page index except ``missing`` (a ``Container`` for :func:`resumable`)."""

    __slots__ = ("missing",)

    def __init__(self, missing: Set[int]) -> None:
        self.missing = missing

    def __contains__(self, page: object) -> bool:
        return page not in self.missing


def deepest_window_end(
    starts: Sequence[int],
    missing: Sequence[Set[int]],
    candidates: Iterable[int],
    page_size: int,
    groups: Sequence[WindowSpec],
) -> tuple[int, frozenset[int]]:
    """On a matched path whose ``i``-th node starts at page ``starts[i]`` and lacks the
    windowed K/V of its page offsets ``missing[i]`` (every other page held): the first of
    ``candidates`` (boundaries in tokens, deepest first, none past the path) at which
    :func:`resumable` holds, and the path's missing pages before it (absolute indices).
    ``(0, empty)`` when none does."""
    gaps = frozenset(s + p for s, m in zip(starts, missing, strict=True) for p in m)
    present = _AllBut(gaps)
    for b in candidates:
        if resumable(b, present, page_size, groups):
            pages = -(-b // page_size)
            return b, frozenset(p for p in gaps if p < pages) or NO_PAGES
    return 0, NO_PAGES


def _default_boundary(node: TreeNode) -> bool:
    return not node.children or node.has_mamba_state


def tree_window_pages(
    nodes: Iterable[TreeNode],
    page_size: int,
    group: WindowSpec,
    is_boundary: Callable[[TreeNode], bool] = _default_boundary,
) -> dict[int, frozenset[int]]:
    """Per node id, the page offsets inside the node (0 = its first page) that some
    boundary at or below it needs of ``group``. ``nodes``: every node of a tree (e.g.
    ``RadixTree.iter_nodes()``); ``is_boundary``: the nodes a hit may end at (default: the
    leaves, where inserts end, and the nodes holding a recurrent state)."""
    nodes = list(nodes)
    needed: dict[int, set[int]] = {n.id: set() for n in nodes}
    by_id = {n.id: n for n in nodes}
    for node in nodes:
        if not is_boundary(node):
            continue
        pages = boundary_pages(node.prefix_len, page_size, group)
        m: TreeNode | None = node
        while m is not None and m.id in by_id and pages:
            start = (m.prefix_len - m.num_tokens) // page_size
            inside = {p for p in pages if p >= start}
            needed[m.id].update(p - start for p in inside)
            pages = pages - inside
            m = m.parent
    return {k: frozenset(v) for k, v in needed.items()}


@dataclass(frozen=True, slots=True)
class HeldBytes:
    """Bytes a set of cached pages holds, the windowed groups counted two ways."""

    tokens: int
    """Cached tokens (pages x page size)."""
    full_bytes: int
    """Every KV layer's pages kept, the windowed ones like full attention."""
    window_bytes: int
    """Full layers' pages kept; windowed layers' only where a boundary needs them."""

    @property
    def ratio(self) -> float:
        """``window_bytes / full_bytes`` (1.0 when nothing is cached)."""
        return self.window_bytes / self.full_bytes if self.full_bytes else 1.0


def layer_page_bytes(spec: StateSpec) -> int:
    """Bytes of one KV layer's page (K and V of ``page_size`` tokens, all heads)."""
    kv = spec.kv
    if kv is None:
        return 0
    return spec.page_size * kv.num_parts * kv.num_kv_heads * kv.head_dim * kv.dtype.itemsize


def held_bytes(
    nodes: Iterable[TreeNode],
    spec: StateSpec,
    held: Callable[[TreeNode], bool] = lambda n: n.device_indices is not None,
    is_boundary: Callable[[TreeNode], bool] = _default_boundary,
) -> HeldBytes:
    """The KV bytes of the ``held`` nodes (default: those with a device copy), with the
    windowed groups of ``spec`` counted as full attention and by the window rule."""
    nodes = [n for n in nodes if held(n)]
    per_layer = layer_page_bytes(spec)
    kv_layers = len(spec.kv.layer_ids) if spec.kv is not None else 0
    win_layers = sum(len(g.layer_ids) for g in spec.windows)
    pages = sum(n.num_pages for n in nodes)
    window = pages * (kv_layers - win_layers) * per_layer
    for group in spec.windows:
        need = tree_window_pages(nodes, spec.page_size, group, is_boundary)
        window += sum(len(v) for v in need.values()) * len(group.layer_ids) * per_layer
    return HeldBytes(pages * spec.page_size, pages * kv_layers * per_layer, window)
