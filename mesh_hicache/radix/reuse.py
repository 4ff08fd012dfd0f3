"""An eviction policy that learns, online, how likely a node is to be used again soon
(docs/DESIGN.md section 5), in the spirit of LRB (Song et al., "Learning Relaxed Belady
for CDN caching", NSDI 2020).

``ReusePolicy`` keeps ``AdaptiveCostPolicy``'s key as the queue order (so an arena still
picks KV or state by comparing queue heads), and chooses the victim inside a queue
(``select``) as the candidate of least ``log P + log value``: ``value`` is the compute a
hit at the node saves per byte (as ``AdaptiveCostPolicy``), ``P`` the predicted
probability that a request uses the node within ``W = window x`` the running mean victim
age. ``P`` is a logistic regression over what the tree shows of a node (its age over the
mean victim age, linear and in log form, prefix length, tokens, hit count, whether it has
children, whether the target is a state, the ticks from its previous access to its last
match), trained by SGD from labels that become known later: a sample is taken of the
victim and of ``samples`` other candidates at each eviction; it is labelled 1 when a later
match goes through the node, or, once it is evicted, when a later request's prefix
extends through its last page (a ghost: the end position and last page of its prefix,
checked against a BLAKE2 digest of the whole prefix), and 0 when ``W`` passes first. The
weights start where the ranking equals adaptive's (a weight on age of ``-1 / (scale x
mean victim age)``), so an untrained policy behaves like ``adaptive`` and the data moves
it.

The policy sees requests through ``on_match``, which the tree calls on every touching
match before stamping the path (``RadixTree.match_prefix``). Everything is a function of
the tree's operations in order, in a fixed float order, so every rank learns the same
weights and evicts the same nodes. Costs: a scan of at most ``scan`` candidates per
victim, a dictionary probe per page of each match past its cached part (only at the end
positions where a ghost waits), a digest of the whole prefix per evicted sampled node.
Memory: one pending sample per sampled node, at most one ghost per evicted sampled node,
both dropped when labelled (within ``W``), and one gap per node seen by a match (pruned
of dead nodes).
"""

from __future__ import annotations

import hashlib
import heapq
import math
from typing import TYPE_CHECKING, Any

from mesh_hicache.radix.adaptive import AdaptiveCostPolicy
from mesh_hicache.radix.eviction import CostModel, EvictTarget, NodeStats, path_stats

if TYPE_CHECKING:
    from mesh_hicache.radix.node import TreeNode

_FLOOR = 1e-6
_STATE = (EvictTarget.MAMBA_DEVICE, EvictTarget.MAMBA_HOST)
#: Features (``_features``): bias, log age, its square, log prefix, log tokens, log hits,
#: has children, state target, log gap, no gap known, linear age.
NUM_FEATURES = 11
#: Gaps kept before dead nodes are pruned from the table.
_GAP_PRUNE = 1 << 16


class ReusePolicy(AdaptiveCostPolicy):
    """Victim = least ``log P(use within W) + log value`` (module docstring).

    ``window``: ``W`` in mean victim ages. ``lr``: SGD step of the logistic loss.
    ``samples``: candidates sampled per victim besides the victim (strided over the queue).
    ``scan``: candidates scored per victim (all when fewer; else the first half in queue
    order and the rest strided). The other keywords go to ``AdaptiveCostPolicy`` (its
    ``scale`` also sets the starting weight on age).
    """

    def __init__(
        self,
        cost: CostModel,
        *,
        window: float = 2.0,
        lr: float = 0.05,
        samples: int = 32,
        scan: int = 256,
        **adaptive: Any,
    ) -> None:
        super().__init__(cost, **adaptive)
        if not window > 0:
            raise ValueError(f"ReusePolicy window must be > 0, got {window!r}")
        if not lr >= 0:
            raise ValueError(f"ReusePolicy lr must be >= 0, got {lr!r}")
        for name, v, least in (("samples", samples, 0), ("scan", scan, 2)):
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"ReusePolicy {name} must be an int >= {least}, got {v!r}")
        self.window = float(window)
        self.lr = float(lr)
        self.samples = samples
        self.scan = scan
        self.weights = [0.0] * NUM_FEATURES
        """The model: ``z = weights . features``, ``P = 1 / (1 + exp(-z))``."""
        self.weights[0] = -2.0
        self.weights[10] = -8.0 / self.scale  # feature 10 is min(age / m, 32) / 8
        # node id -> (deadline, features) of its pending sample; heap of (deadline, id).
        self._pending: dict[int, tuple[int, tuple[float, ...]]] = {}
        self._deadlines: list[tuple[int, int]] = []
        # Ghosts: prefix end byte -> [(last page, prefix digest, node id)]; id -> end byte.
        self._ghosts: dict[int, list[tuple[bytes, bytes, int]]] = {}
        self._ghost_end: dict[int, int] = {}
        # node id -> (ticks from its previous access to its last match, node).
        self._gaps: dict[int, tuple[int, TreeNode]] = {}
        self._selects = 0
        self.labels = [0, 0]
        """Samples labelled 0 (not used within ``W``) and 1 (used)."""
        self.ghost_hits = 0
        """Positive labels that came from an evicted node's ghost."""

    def held(self) -> tuple[int, int, int]:
        """(pending samples, ghosts, gaps) held: the policy's memory, in entries."""
        return len(self._pending), len(self._ghost_end), len(self._gaps)

    # ------------------------------------------------------------------ model

    def _features(self, node: TreeNode, target: EvictTarget, now: int) -> tuple[float, ...]:
        m = self._age if self._age > 0 else 1.0
        age = max(now - node.last_access, 0)
        la = math.log2((age + 1.0) / (m + 1.0)) * 0.25
        known = self._gaps.get(node.id)
        lg = 0.0 if known is None else math.log2((known[0] + 1.0) / (m + 1.0)) * 0.25
        return (
            1.0,
            la,
            la * la,
            math.log2(node.prefix_len * 0.0625 + 1.0) * 0.1,
            math.log2(node.num_tokens * 0.0625 + 1.0) * 0.1,
            math.log2(node.hit_count + 1.0) * 0.25,
            1.0 if node.children else 0.0,
            1.0 if target in _STATE else 0.0,
            lg,
            1.0 if known is None else 0.0,
            min(age / m, 32.0) * 0.125,
        )

    def _z(self, x: tuple[float, ...]) -> float:
        z = 0.0
        for w, xi in zip(self.weights, x, strict=True):
            z += w * xi
        return z

    def probability(self, node: TreeNode, target: EvictTarget, now: int) -> float:
        """The model's ``P(use within W)`` of ``node`` for ``target`` at logical time ``now``."""
        z = self._z(self._features(node, target, now))
        if z >= 0:
            return 1.0 / (1.0 + math.exp(-z))
        e = math.exp(z)
        return e / (1.0 + e)

    def _learn(self, x: tuple[float, ...], y: int) -> None:
        z = self._z(x)
        p = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))
        g = self.lr * (y - p)
        w = self.weights
        for i, xi in enumerate(x):
            w[i] += g * xi
        self.labels[y] += 1

    def score(self, node: TreeNode, target: EvictTarget, now: int) -> float:
        """``log P + log(value / unit)``: the victim is the candidate of least score."""
        stats = path_stats(node, self.has_mamba)
        v = max(self._cost.value(stats, target) / self._unit, _FLOOR)
        z = self._z(self._features(node, target, now))
        logp = -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))
        return logp + math.log(v)

    # ----------------------------------------------------------------- labels

    def _expire(self, now: int) -> None:
        """Label 0 every pending sample whose window ended before ``now``."""
        heap, pending = self._deadlines, self._pending
        while heap and heap[0][0] < now:
            deadline, nid = heapq.heappop(heap)
            rec = pending.get(nid)
            if rec is None or rec[0] != deadline:
                continue
            del pending[nid]
            self._drop_ghost(nid)
            self._learn(rec[1], 0)

    def _drop_ghost(self, nid: int) -> None:
        end = self._ghost_end.pop(nid, None)
        if end is None:
            return
        kept = [g for g in self._ghosts[end] if g[2] != nid]
        if kept:
            self._ghosts[end] = kept
        else:
            del self._ghosts[end]

    def _used(self, nid: int) -> bool:
        rec = self._pending.pop(nid, None)
        if rec is None:
            return False
        self._drop_ghost(nid)
        self._learn(rec[1], 1)
        return True

    def on_match(
        self, data: bytes, path: list[TreeNode], pos: int, end: int, page_bytes: int, clock: int
    ) -> None:
        """Called by the tree on every touching match of ``data[:end]`` (bytes of whole
        pages) at logical time ``clock``, before the path is stamped: ``path`` the cached
        nodes it walks through, ``pos`` the bytes they cover."""
        if clock > self._clock:
            self._clock = clock
        self._expire(clock)
        gaps, pending = self._gaps, self._pending
        for node in path:
            gaps[node.id] = (clock - node.last_access, node)
            if node.id in pending:
                self._used(node.id)
        if len(gaps) > _GAP_PRUNE:
            for nid in [k for k, (_, n) in gaps.items() if not n.alive]:
                del gaps[nid]
        ghosts = self._ghosts
        if not ghosts:
            return
        digest = None
        p = pos + page_bytes
        while p <= end:
            waiting = ghosts.get(p)
            if waiting is not None:
                page = data[p - page_bytes : p]
                for last, dig, nid in list(waiting):
                    if last == page:
                        if digest is None or digest[0] != p:
                            digest = (p, hashlib.blake2b(data[:p], digest_size=16).digest())
                        if dig == digest[1] and self._used(nid):
                            self.ghost_hits += 1
            p += page_bytes

    def _sample(self, node: TreeNode, target: EvictTarget, now: int) -> None:
        if node.id in self._pending:
            return
        m = self._age if self._age > 0 else 1.0
        deadline = now + max(int(self.window * m), 1)
        self._pending[node.id] = (deadline, self._features(node, target, now))
        heapq.heappush(self._deadlines, (deadline, node.id))

    def _ghost(self, node: TreeNode) -> None:
        """Remember an evicted sampled leaf by its whole prefix (end, last page, digest)."""
        parts = []
        n: TreeNode | None = node
        while n is not None and not n.is_sentinel:
            parts.append(n.data)
            n = n.parent
        data = b"".join(reversed(parts))
        end = len(data)
        page = len(node.data) // node.num_pages
        digest = hashlib.blake2b(data, digest_size=16).digest()
        self._ghosts.setdefault(end, []).append((data[end - page :], digest, node.id))
        self._ghost_end[node.id] = end

    # ----------------------------------------------------------------- choice

    def select(self, entries: list[tuple[Any, ...]], target: EvictTarget) -> int | None:
        n = len(entries)
        if n < 2:
            return None
        now = self._clock
        self._expire(now)
        self._selects += 1
        if n <= self.scan:
            idx: range | list[int] = range(n)
        else:
            half = self.scan // 2
            step = (n - half) / half
            idx = list(range(half)) + [half + int(k * step) for k in range(half)]
        best = math.inf
        best_i = 0
        for i in idx:
            s = self.score(entries[i][-1], target, now)
            if s < best:
                best, best_i = s, i
        self._sample(entries[best_i][-1], target, now)
        if self.samples:
            stride = max(n // (self.samples + 1), 1)
            first = (self._selects * 7919) % stride
            for j in range(self.samples):
                i = first + j * stride
                if i < n and i != best_i:
                    self._sample(entries[i][-1], target, now)
        return best_i

    def on_evict(self, node: TreeNode, target: EvictTarget, stats: NodeStats, clock: int) -> None:
        """Adaptive's learning, then a ghost for a sampled leaf that leaves the tree."""
        super().on_evict(node, target, stats, clock)
        if not node.children:
            if node.id in self._pending and node.id not in self._ghost_end:
                self._ghost(node)
            self._gaps.pop(node.id, None)
