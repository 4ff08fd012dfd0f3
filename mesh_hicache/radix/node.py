"""Radix tree nodes and the results of tree operations (docs/DESIGN.md section 5).

Index conventions: device pages, host pages and Mamba state slots are plain ints (the
pools' indices). A node's ``device_indices`` / ``host_indices`` are tuples with one page
per ``page_size`` tokens of the node, or None when the node has no copy on that tier.
Nodes are mutated only by ``RadixTree``; callers read them and pass them back.

Tokens are stored packed: ``data`` holds the node's token ids as little-endian int64
bytes (``hashing.pack_tokens``), so comparing a node against a key is one bytes
comparison. Page hashes are computed from those bytes on first use (``hashes``) and kept.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mesh_hicache.radix.hashing import packed_page_hashes, unpack_tokens

NO_PAGES: frozenset[int] = frozenset()
"""The empty page set, shared by every node and result without windowed-KV gaps."""


class Tier(str, enum.Enum):
    """Where a copy lives: device memory (L1) or host memory (L2)."""

    DEVICE = "device"
    HOST = "host"


class Family(str, enum.Enum):
    """What the tree records for a node on a tier: KV pages or a recurrent-state slot."""

    KV = "kv"
    """One page index per page of the node."""
    STATE = "state"
    """One slot index: the recurrent (Mamba) state after the node's last token."""


class TreeNode:
    """One edge of the radix tree: a run of whole pages with per-tier state.

    Sentinels (the tree root and one root per namespace) hold no tokens and are never
    evicted. Every other node holds at least one page and a KV copy on device, host or
    both. A Mamba state (device and/or host slot) is valid exactly at the node's last token.
    """

    __slots__ = (
        "id",
        "namespace",
        "parent",
        "children",
        "data",
        "num_pages",
        "_hashes",
        "device_indices",
        "host_indices",
        "mamba_device_slot",
        "mamba_host_slot",
        "lock_ref",
        "host_ref",
        "hit_count",
        "last_access",
        "num_device_children",
        "alive",
        "is_sentinel",
        "queue_entry",
        "_prefix_len",
        "anchor_len",
        "state_access",
        "window_missing",
        "host_window_missing",
    )

    def __init__(
        self,
        node_id: int,
        namespace: str,
        parent: TreeNode | None,
        data: bytes,
        num_pages: int,
        *,
        is_sentinel: bool = False,
    ) -> None:
        self.id = node_id
        """Creation id: unique, increasing; the deterministic tie-breaker."""
        self.namespace = namespace
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        """Child nodes keyed by the packed bytes of their first page."""
        self.data = data
        """The node's tokens packed as little-endian int64 bytes (8 bytes per token)."""
        self.num_pages = num_pages
        self._hashes: tuple[bytes, ...] | None = () if is_sentinel else None
        self.device_indices: tuple[int, ...] | None = None
        self.host_indices: tuple[int, ...] | None = None
        self.mamba_device_slot: int | None = None
        self.mamba_host_slot: int | None = None
        self.lock_ref = 0
        """Device protection: requests using the path through this node."""
        self.host_ref = 0
        """Host protection: in-flight transfers using the path through this node."""
        self.hit_count = 0
        self.last_access = 0
        """Logical clock value of the last match/insert through this node."""
        self.num_device_children = 0
        """Children that hold a device copy (device eviction takes device leaves only)."""
        self.alive = True
        self.is_sentinel = is_sentinel
        self.queue_entry: list[tuple[Any, ...] | None] = [None, None, None, None]
        """The node's entry in each eviction queue (``queues.EvictionQueues``), or None."""
        self._prefix_len: int | None = 0 if is_sentinel else None
        self.anchor_len = 0
        """Snapshot for value-aware policies: ``prefix_len`` of the nearest ancestor that
        could serve instead (``eviction.NodeStats.anchor_len``), refreshed by the queues."""
        self.state_access = 0
        """Logical clock value of the last match that resumed from this node's state (or
        of the insert that gave it one): how recently the state itself was used."""
        self.window_missing = NO_PAGES
        """Page offsets inside the node (0 = its first page) whose windowed K/V (the
        tree's ``windows`` groups) the copy a match reads lacks: the device copy's when
        the node has one, else the host copy's (then equal to ``host_window_missing``).
        Per tier, not a union over the copies: a host copy holding only the windowed
        pages a resume needs must not cut hits served from a complete device copy."""
        self.host_window_missing = NO_PAGES
        """Page offsets inside the node whose windowed K/V its host copy lacks; empty
        when it has no host copy. What a load to device starts from, and what
        ``window_missing`` becomes when the device copy is dropped."""

    @property
    def num_tokens(self) -> int:
        return len(self.data) >> 3

    @property
    def prefix_len(self) -> int:
        """Tokens from the namespace root to the node's end. Computed once per node and
        kept: a split changes a node's start and parent, never its end (the new upper
        node computes its own)."""
        n = self._prefix_len
        if n is None:
            chain: list[TreeNode] = []
            m: TreeNode | None = self
            while m is not None and m._prefix_len is None:
                chain.append(m)
                m = m.parent
            n = m._prefix_len if m is not None else 0
            assert n is not None
            for c in reversed(chain):
                n += len(c.data) >> 3
                c._prefix_len = n
        return n

    @property
    def tokens(self) -> tuple[int, ...]:
        """The node's token ids (unpacked on each call: prefer ``data`` in hot paths)."""
        return unpack_tokens(self.data)

    def first_page(self, page_size: int) -> bytes:
        """Packed bytes of the node's first page: its key in ``parent.children``."""
        return self.data[: page_size * 8]

    @property
    def hashes(self) -> tuple[bytes, ...]:
        """One chained page hash per page (``hashing.page_hashes``), computed on first use
        for this node and every ancestor still without them, then kept."""
        hashes = self._hashes
        if hashes is None:
            hashes = self._compute_hashes()
        return hashes

    def _compute_hashes(self) -> tuple[bytes, ...]:
        chain: list[TreeNode] = []
        n: TreeNode | None = self
        while n is not None and n._hashes is None:
            chain.append(n)
            n = n.parent
        parent_hash = n._hashes[-1] if n is not None and n._hashes else None
        for m in reversed(chain):
            ps = m.num_tokens // m.num_pages
            hashes = tuple(packed_page_hashes(m.data, ps, m.namespace, parent_hash))
            m._hashes = hashes
            parent_hash = hashes[-1]
        assert self._hashes is not None
        return self._hashes

    @property
    def hashes_known(self) -> bool:
        """Whether ``hashes`` were computed already (reading them never costs a hash)."""
        return self._hashes is not None

    @property
    def on_device(self) -> bool:
        return self.device_indices is not None

    @property
    def on_host(self) -> bool:
        return self.host_indices is not None

    @property
    def has_mamba_state(self) -> bool:
        """Whether a Mamba state exists at this node on any tier."""
        return self.mamba_device_slot is not None or self.mamba_host_slot is not None

    @property
    def last_hash(self) -> bytes | None:
        """Hash of the node's last page (None for sentinels); computes hashes if needed."""
        if self.is_sentinel:
            return None
        return self.hashes[-1]

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, ns={self.namespace!r}, tokens={self.num_tokens}, "
            f"device={self.device_indices}, host={self.host_indices}, "
            f"mamba=({self.mamba_device_slot}, {self.mamba_host_slot}), "
            f"lock={self.lock_ref}, host_ref={self.host_ref})"
        )


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The usable cached prefix of a key (see ``RadixTree.match_prefix``).

    The usable prefix is ``device_len`` tokens on device (pages ``device_indices``)
    followed by ``host_len`` tokens held on host only (pages ``host_indices``). On a miss
    every length is 0, the index tuples are empty and ``last_node`` is a sentinel.
    """

    device_indices: tuple[int, ...]
    host_indices: tuple[int, ...]
    last_node: TreeNode
    """Node where the usable prefix ends (lock it to protect the prefix)."""
    device_len: int
    host_len: int
    usable_len: int
    """``device_len + host_len``: tokens the caller may reuse."""
    raw_kv_len: int
    """Page-aligned KV match length before the Mamba and window rules cut it back."""
    mamba_on_device: int | None
    """Device slot of the Mamba state at ``last_node`` (None if none, or no Mamba)."""
    mamba_on_host: int | None
    nodes: tuple[TreeNode, ...]
    """Non-sentinel nodes from the root to ``last_node``, top-down."""
    window_missing: frozenset[int] = NO_PAGES
    """Page indices of the usable prefix (0 = its first page) whose windowed K/V the
    returned copies lack (``TreeNode.window_missing`` of ``nodes``); empty normally."""


@dataclass(frozen=True, slots=True)
class InsertResult:
    """Outcome of ``RadixTree.insert``. The caller frees every index the tree did not take."""

    num_existing_pages: int
    """Leading pages of the key that were already in the tree (on any tier)."""
    node: TreeNode
    """Node that ends at the key's last whole page (a sentinel for an empty key)."""
    unused_device_indices: tuple[int, ...]
    """Given device pages the tree did not take (their page already had a device copy)."""
    unused_host_indices: tuple[int, ...]
    mamba_device_taken: bool
    """Whether the given device Mamba slot was attached (False if none was given)."""
    mamba_host_taken: bool


@dataclass(frozen=True, slots=True)
class EvictResult:
    """Everything an eviction freed; the caller returns each index to its allocator.

    Evicting one tier can free others too: removing a node (its last KV copy, or a
    childless tombstone) frees all its pages and slots.
    """

    device_pages: tuple[int, ...] = ()
    host_pages: tuple[int, ...] = ()
    mamba_device_slots: tuple[int, ...] = ()
    mamba_host_slots: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolUsage:
    """An allocator's view of one pool, for ``RadixTree.check_integrity``."""

    capacity: int
    """Number of indices in the pool: valid indices are ``range(capacity)``."""
    free: Iterable[int]
    """Indices currently free in the allocator."""
    held: Iterable[int] = field(default=())
    """Indices held outside the tree (e.g. by in-flight requests)."""
