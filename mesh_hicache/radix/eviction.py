"""Eviction policies of the radix tree (docs/DESIGN.md section 5).

A policy ranks eviction candidates; the tree decides which nodes are candidates (unlocked,
unprotected, no dependent children on that tier) and what evicting one means. The tree
keeps one sorted queue per target (``queues.EvictionQueues``) keyed by the priority the
policy gives a node's ``NodeStats``, so a priority must be a function of those stats
only, never of the current clock or of other nodes. "Age" is therefore expressed as
``last_access`` (a logical clock value; smaller is older).

Touches are cheap: a match or insert only stores the node's new ``last_access`` and
``hit_count``. A policy whose priority never decreases when those grow (``monotone``,
the default; true of LRU) lets the tree re-rank a touched node lazily, when it
reaches the top of a queue. A policy that sets ``monotone = False`` is re-ranked on every
touch instead (correct, but a touch then costs a queue update per node).

Determinism: every rank of the mesh runs the same tree operations and must evict the
same nodes, so priorities must be deterministic (no wall-clock time, no ``hash()``).
Ties are broken by the tree with the node's creation id.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from mesh_hicache.radix.node import TreeNode
    from mesh_hicache.spec import StateSpec


class EvictTarget(str, enum.Enum):
    """What an eviction frees: a tier of one state family."""

    DEVICE_KV = "device_kv"
    HOST_KV = "host_kv"
    MAMBA_DEVICE = "mamba_device"
    MAMBA_HOST = "mamba_host"


class NodeStats(NamedTuple):
    """What a policy may look at to rank a node."""

    last_access: int
    """Logical clock value of the node's last access (match or insert)."""
    hit_count: int
    """Number of matches whose KV path went through the node."""
    num_tokens: int
    """Tokens held by the node (a multiple of the page size)."""
    has_mamba_state: bool
    """Whether the node holds a Mamba state on any tier."""
    prefix_len: int = 0
    """Tokens from the root to the end of the node (filled for ``path_stats`` policies)."""
    anchor_len: int = 0
    """``prefix_len`` of the nearest ancestor that could serve a hit instead of this node:
    with Mamba the nearest one holding a state (0: the zero state at the root), without
    Mamba the parent. Refreshed whenever the node is re-queued (``path_stats`` policies)."""
    num_children: int = 0
    """Children of the node (none: evicting its state removes it; one: its state serves
    only requests that end exactly there)."""
    serves: bool = True
    """Whether a hit can end at the node (with Mamba: it holds a state)."""
    inflation: float = 0.0
    """GreedyDual clock of the target's tier at ``last_access`` (``aging`` policies)."""


def path_stats(node: TreeNode, has_mamba: bool, inflation: float = 0.0) -> NodeStats:
    """``node``'s stats with the path fields (``anchor_len`` as last refreshed); a node
    serves a hit when it holds a state or hits need none (``has_mamba`` False)."""
    return NodeStats(
        node.last_access,
        node.hit_count,
        node.num_tokens,
        node.has_mamba_state,
        node.prefix_len,
        node.anchor_len,
        len(node.children),
        node.has_mamba_state or not has_mamba,
        inflation,
    )


class EvictionPolicy(abc.ABC):
    """Ranks eviction candidates: the smallest priority is evicted first."""

    monotone: bool = True
    """Whether ``priority`` never decreases as ``last_access`` and ``hit_count`` grow."""
    path_stats: bool = False
    """Whether ``priority`` reads ``prefix_len`` / ``anchor_len`` / ``num_children`` / ``serves``
    (the queues then fill them: a walk up to the nearest state per re-queue)."""
    aging: bool = False
    """GreedyDual aging: the queues keep one clock per tier (device, host) that becomes the
    first priority element of each victim, and pass the clock's value at the node's
    ``last_access`` as ``inflation``. Then ``priority(...)[0]`` must be ``inflation +`` a
    non-negative value."""

    @abc.abstractmethod
    def priority(self, stats: NodeStats, target: EvictTarget) -> tuple[int | float, ...]:
        """Priority of a candidate for ``target``; smaller is evicted earlier. Pure."""

    on_evict: Callable[[TreeNode, EvictTarget, NodeStats, int], None] | None = None
    """None, or called by the queues with each victim they pop, its stats as ranked and the
    tree's logical clock. A policy that learns from it (``AdaptiveCostPolicy``) changes its
    state only there, the same on every rank, and keeps a stored key valid: ``priority``
    stays a function of the stats and of that fixed past."""

    has_mamba: bool = True
    """Whether a hit in the tree needs a state (a node serves only with one); the tree's
    queues set it when they take the policy (a policy object ranks one tree)."""

    on_match: Callable[[bytes, list[TreeNode], int, int, int, int], None] | None = None
    """None, or called by the tree on every touching match, before it stamps the path:
    ``(key bytes, cached nodes walked, bytes they cover, key end in whole pages, page
    bytes, logical clock)``. A policy that learns from requests (``ReusePolicy``) reads it;
    it must not change the tree."""

    def select(self, entries: list[tuple[Any, ...]], target: EvictTarget) -> int | None:
        """Index into ``entries`` (a target's queue, in priority order) of the victim to take
        instead of the first, or None for the first. A policy whose ranking depends on the
        other candidates (``ReusePolicy``) overrides this; it costs a scan per victim."""
        return None


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def priority(self, stats: NodeStats, target: EvictTarget) -> tuple[int | float, ...]:
        return (stats.last_access,)


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """What a hit saves and what a cached node costs, for value-aware policies.

    FLOPs of the token at position ``t`` (0-based; it attends to ``t + 1`` keys):
    ``flops_per_token + flops_per_key * (t + 1)`` (every layer: projections, MLP,
    recurrence; the attention scores and values per key). Bytes: ``kv_bytes_per_token``
    of KV per cached token (pages included whole), ``state_bytes`` per recurrent-state
    checkpoint. Only ratios matter to a ranking, so any consistent unit works.
    """

    kv_bytes_per_token: float
    state_bytes: float = 0.0
    flops_per_token: float
    flops_per_key: float = 0.0

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "flops_per_token"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CostModel.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("state_bytes", "flops_per_key"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)!r}")

    @classmethod
    def from_spec(cls, spec: StateSpec) -> CostModel:
        """A rough default from a ``StateSpec`` (which knows no hidden size): bytes exact
        (whole model, before sharding: the same on every rank), FLOPs as if every layer
        had ``24 h^2`` per token with ``h`` the widest per-token state (KV heads x head
        dim, or SSM heads x head dim) and ``4 h`` per key per attention layer. The runtime
        passes the model's own numbers (``HiCacheConfig.cost_model``)."""
        kv, mamba = spec.kv, spec.mamba
        kv_bytes = 0.0
        h = 1
        if kv is not None:
            width = kv.num_kv_heads * kv.head_dim
            kv_bytes = len(kv.layer_ids) * kv.num_parts * width * kv.dtype.itemsize
            h = max(h, width)
        if spec.indexer is not None:
            ix = spec.indexer
            kv_bytes += len(ix.layer_ids) * ix.key_dim * ix.dtype.itemsize
        state = 0.0
        if mamba is not None:
            conv = mamba.conv_dim * (mamba.conv_kernel - 1) * mamba.conv_dtype.itemsize
            ssm = mamba.num_heads * mamba.head_dim * mamba.state_dim * mamba.ssm_dtype.itemsize
            ssm *= mamba.recurrent
            state = len(mamba.layer_ids) * (conv + ssm)
            h = max(h, mamba.num_heads * mamba.head_dim)
        per_key = 4.0 * h * (len(kv.layer_ids) if kv is not None else 0)
        return cls(
            kv_bytes_per_token=kv_bytes or 1.0,
            state_bytes=state,
            flops_per_token=24.0 * h * h * spec.num_layers,
            flops_per_key=per_key,
        )

    def flops(self, start: int, end: int) -> float:
        """FLOPs of positions ``[start, end)`` (closed form)."""
        n = end - start
        if n <= 0:
            return 0.0
        keys = (end * (end + 1) - start * (start + 1)) // 2
        return self.flops_per_token * n + self.flops_per_key * keys

    def node_bytes(self, stats: NodeStats, target: EvictTarget) -> float:
        """Bytes that evicting the node for ``target`` frees (its pages and its state when
        the node goes with them; only the state when an inner node loses it)."""
        kv = stats.num_tokens * self.kv_bytes_per_token
        state = self.state_bytes if stats.has_mamba_state else 0.0
        if target in _STATE_TARGETS and stats.num_children:
            return state or kv
        return kv + state

    def saved_flops(self, stats: NodeStats) -> float:
        """What a hit ending at the node saves over one ending at its anchor."""
        if not stats.serves:
            return 0.0
        return self.flops(stats.anchor_len, stats.prefix_len)

    def value(
        self,
        stats: NodeStats,
        target: EvictTarget,
        *,
        run_bytes: bool = False,
        lone_state: float = 1.0,
    ) -> float:
        """Saved FLOPs per byte that evicting the node for ``target`` frees (>= 0).

        An inner node's state eviction frees the state only; with ``lone_state`` the
        saving of a state at an inner node with one child is scaled (it serves only
        requests that end exactly there). A leaf frees its pages and its state; with
        ``run_bytes`` also the stateless run above it, back to its anchor (those nodes
        go with it)."""
        saved = self.saved_flops(stats)
        if not saved:
            return 0.0
        if stats.num_children:
            if target in _STATE_TARGETS:
                if stats.num_children == 1:
                    saved *= lone_state
                size = self.state_bytes
            else:
                size = self.node_bytes(stats, target)
        else:
            tokens = stats.num_tokens
            if run_bytes:
                tokens = max(tokens, stats.prefix_len - stats.anchor_len)
            size = tokens * self.kv_bytes_per_token + self.state_bytes
        return saved / size if size else 0.0


class DecayCostPolicy(EvictionPolicy):
    """Saved compute per byte, decaying exponentially with age (``cost``, opt-in).

    ``priority = last_access + horizon * ln(value / unit)``, i.e. the node of least
    ``value * exp((last_access - now) / horizon)`` goes first: ``value`` is
    ``CostModel.value`` (the FLOPs a hit at the node saves, back to the nearest ancestor
    that could serve instead, per byte its eviction frees), ``unit`` the value of a token
    run without attention or state bytes (``flops_per_token / kv_bytes_per_token``; only
    shifts every key alike), and ``horizon`` the logical-clock ticks over which a value
    drops by a factor ``e`` (the tree ticks once per match and per insert). In this log
    form the key is fixed between touches and only grows on a touch (``monotone``), so
    queues stay sorted and re-rank lazily; ties (equal keys) go by ``last_access``. A node
    no hit can end at (value 0) ranks as if ``-ln(_FLOOR)`` horizons older.

    Against GreedyDual-Size (value added to a clock; a benchmark baseline in
    ``scripts/baseline_policies.py``) the value enters as a
    log, so twice the value buys the same extra lifetime (``horizon * ln 2``) whatever its
    size, and recency keeps its weight on workloads where the value says little (agent
    traces; docs/performance.md "Cache policy on replayed traces"). ``horizon`` 200 was
    chosen once on the seed-1 traces, for every shape and budget alike (docs/DESIGN.md section 5).
    """

    path_stats = True

    def __init__(self, cost: CostModel, *, horizon: float = 200.0) -> None:
        if not isinstance(cost, CostModel):
            raise TypeError(f"DecayCostPolicy needs a CostModel, got {cost!r}")
        if not horizon > 0:
            raise ValueError(f"DecayCostPolicy horizon must be > 0, got {horizon!r}")
        self.cost = cost
        self.horizon = float(horizon)
        self._unit = cost.flops_per_token / cost.kv_bytes_per_token

    def value(self, stats: NodeStats, target: EvictTarget) -> float:
        """Saved FLOPs per freed byte (``CostModel.value``; a leaf counts its own bytes,
        not the stateless run above it: measured better on the agent traces, equal
        elsewhere)."""
        return self.cost.value(stats, target)

    def priority(self, stats: NodeStats, target: EvictTarget) -> tuple[int | float, ...]:
        rel = max(self.value(stats, target) / self._unit, _FLOOR)
        return (stats.last_access + self.horizon * math.log(rel), stats.last_access)


#: Smallest relative value ``DecayCostPolicy`` takes a log of (a node that saves nothing).
_FLOOR = 1e-6


_STATE_TARGETS = (EvictTarget.MAMBA_DEVICE, EvictTarget.MAMBA_HOST)
