"""Eviction policies that serve only as baselines of ``bench_hitrate.py`` (they won no
measured cell; docs/results/HISTORY.md): GreedyDual-Size over compute (``--policy gds``)
and a rule after the Marconi paper (``--policy marconi``). Both rank by the library's
``CostModel``; pass an instance as ``HiCacheConfig.eviction_policy``."""

from __future__ import annotations

from typing import Any

from mesh_hicache.radix.eviction import CostModel, EvictionPolicy, EvictTarget, NodeStats


class GreedyDualSizePolicy(EvictionPolicy):
    """``priority = inflation + saved FLOPs / bytes`` (GreedyDual-Size over compute).

    The value is ``CostModel.value`` with ``run_bytes`` (a leaf frees the stateless run
    above it too) and ``lone_state``; ``inflation`` is the tier's clock at the node's last
    access and each victim's priority becomes the clock, so an untouched node ages
    relative to the ones touched after it. ``frequency`` scales the value by
    ``1 + hit_count`` (GreedyDual-Size-Frequency)."""

    path_stats = True
    aging = True

    def __init__(
        self,
        cost: CostModel,
        *,
        lone_state: float = 1.0,
        run_bytes: bool = True,
        frequency: bool = False,
    ) -> None:
        if not isinstance(cost, CostModel):
            raise TypeError(f"GreedyDualSizePolicy needs a CostModel, got {cost!r}")
        self.cost = cost
        self.lone_state = lone_state
        self.run_bytes = run_bytes
        self.frequency = frequency

    def value(self, stats: NodeStats, target: EvictTarget) -> float:
        """Saved FLOPs per freed byte (>= 0)."""
        value = self.cost.value(stats, target, run_bytes=self.run_bytes, lone_state=self.lone_state)
        return value * (1 + stats.hit_count) if self.frequency else value

    def priority(self, stats: NodeStats, target: EvictTarget) -> tuple[int | float, ...]:
        return (stats.inflation + self.value(stats, target), stats.last_access)


class MarconiPolicy(EvictionPolicy):
    """A baseline after the Marconi paper's description (Pan et al., MLSys 2025): evict
    the candidate of least ``recency + alpha * flop_efficiency``, both min-max normalized
    over the current candidates (recency: ``last_access``; FLOP efficiency: saved FLOPs
    per byte). Not heap-friendly: a scan of the candidates per victim (``select``);
    ``alpha`` tuned per trace offline."""

    path_stats = True
    monotone = False  # ``select`` reads every candidate's key: keep them all current

    def __init__(self, cost: CostModel, alpha: float) -> None:
        if not alpha >= 0:
            raise ValueError(f"MarconiPolicy alpha must be >= 0, got {alpha!r}")
        self.cost = cost
        self.alpha = float(alpha)

    def efficiency(self, stats: NodeStats, target: EvictTarget) -> float:
        """Saved FLOPs (back to the nearest state) per byte the eviction frees."""
        size = self.cost.node_bytes(stats, target)
        return self.cost.saved_flops(stats) / size if size else 0.0

    def priority(self, stats: NodeStats, target: EvictTarget) -> tuple[int | float, ...]:
        return (stats.last_access, self.efficiency(stats, target))

    def select(self, entries: list[tuple[Any, ...]], target: EvictTarget) -> int | None:
        if len(entries) < 2 or self.alpha == 0:
            return None
        t_lo, t_hi = entries[0][0], entries[-1][0]
        values = [e[1] for e in entries]
        v_lo, v_hi = min(values), max(values)
        t_span = (t_hi - t_lo) or 1
        v_span = (v_hi - v_lo) or 1.0
        alpha = self.alpha
        best, best_i = None, 0
        for i, e in enumerate(entries):
            score = (e[0] - t_lo) / t_span + alpha * (e[1] - v_lo) / v_span
            if best is None or score < best:
                best, best_i = score, i
        return best_i
