"""A cost-aware eviction policy whose recency/value balance follows the cache's own
residency time (docs/DESIGN.md section 5).

``DecayCostPolicy`` ranks a node by ``last_access + horizon * l`` (``l`` the log of the
compute a hit at the node saves per byte): ``horizon`` 0 is LRU, a large one ranks by
value. A fixed horizon in logical ticks means something else in a 1 GB cache, whose
victims were last used a few ticks ago, than in a 20 GB one, whose victims are hundreds of
ticks old, and the best fixed horizon moved with the budget (docs/performance.md "Cache policy on
replayed traces"). The Marconi paper's baseline is scale-free instead: it normalizes
recency by the span of the candidates' ages. This policy does the same online, in a
heap-friendly form: the horizon is ``scale`` times the running mean age of its victims
(ticks from their last access to their eviction), learnt from the eviction stream alone.

The horizon is a function of logical time, ``H(t)``, that moves towards its target at a
slope of at most ``1 / clip`` per tick and is only ever extended past the present, so
``t + H(t) * l`` never decreases in ``t`` for ``|l| <= clip``: a touch only raises a
node's key (``monotone``; the queues re-rank lazily) and a node's key depends only on its
stats and on ``H``'s fixed past. Everything is driven by the tree's operations, the same
on every rank, so ranks agree. Memory is bounded: at most ``_MAX_KNOTS`` knots of ``H``
(the oldest half dropped when full; a node untouched since then is ranked with the oldest
kept horizon, which can re-key it once).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import TYPE_CHECKING

from mesh_hicache.radix.eviction import (
    CostModel,
    EvictionPolicy,
    EvictTarget,
    NodeStats,
)

if TYPE_CHECKING:
    from mesh_hicache.radix.node import TreeNode

#: Knots of ``H(t)`` kept (see the module docstring).
_MAX_KNOTS = 4096
#: Smallest relative value whose log is taken (a node that saves nothing).
_FLOOR = 1e-6


class AdaptiveCostPolicy(EvictionPolicy):
    """``priority = last_access + H(last_access) * l`` (module docstring).

    ``l``: ``ln(value / unit)`` clipped to ``[-clip, clip]``, with ``value`` and ``unit`` as
    in ``DecayCostPolicy``. ``H`` starts at ``horizon`` and follows
    ``min(scale * mean victim age, max_horizon)``; the mean is an exponential moving
    average with weight ``mean_decay`` per victim, and the target moves when it drifts
    by more than 2 % (plus one tick) from the last one. The constants were chosen once
    on the seed-1 traces for every shape and budget alike (docs/performance.md).
    """

    path_stats = True

    def __init__(
        self,
        cost: CostModel,
        *,
        scale: float = 6.0,
        horizon: float = 200.0,
        max_horizon: float = 2000.0,
        clip: float = 8.0,
        mean_decay: float = 1.0 / 1024,
    ) -> None:
        if not isinstance(cost, CostModel):
            raise TypeError(f"AdaptiveCostPolicy needs a CostModel, got {cost!r}")
        if not 0 <= horizon <= max_horizon:
            raise ValueError(f"need 0 <= horizon <= max_horizon, got {horizon!r}, {max_horizon!r}")
        for name, v in (("scale", scale), ("clip", clip), ("mean_decay", mean_decay)):
            if not v > 0:
                raise ValueError(f"AdaptiveCostPolicy {name} must be > 0, got {v!r}")
        if not mean_decay <= 1:
            raise ValueError(f"AdaptiveCostPolicy mean_decay must be <= 1, got {mean_decay!r}")
        self.cost = cost
        self.scale = float(scale)
        self.max_horizon = float(max_horizon)
        self.clip = float(clip)
        self.mean_decay = float(mean_decay)
        self._cost = cost
        self._unit = cost.flops_per_token / cost.kv_bytes_per_token
        # 0.999: float rounding must never let a key decrease on a touch.
        self._rate = 0.999 / self.clip
        # Knots of H: from time _times[i] on, H starts at _h[i] and moves towards _goal[i].
        self._times: list[int] = [0]
        self._h: list[float] = [float(horizon)]
        self._goal: list[float] = [float(horizon)]
        self._age = 0.0
        self._clock = 0  # the latest logical time seen (a knot starts after it)
        self.victims = 0
        """Victims seen (each fed the mean age)."""

    # ------------------------------------------------------------------ ranking

    def log_value(self, stats: NodeStats, target: EvictTarget) -> float:
        """The node's ``l``: ``ln(value / unit)`` clipped to ``[-clip, clip]``."""
        rel = max(self._cost.value(stats, target) / self._unit, _FLOOR)
        return min(max(math.log(rel), -self.clip), self.clip)

    def horizon_at(self, t: int) -> float:
        """``H(t)``: the horizon a node last touched at logical time ``t`` is ranked with."""
        i = bisect_right(self._times, t) - 1
        if i < 0:
            return self._h[0]
        h, goal = self._h[i], self._goal[i]
        room = self._rate * (t - self._times[i])
        return min(goal, h + room) if goal >= h else max(goal, h - room)

    @property
    def horizon(self) -> float:
        """The horizon ``H`` moves towards now."""
        return self._goal[-1]

    @property
    def mean_age(self) -> float:
        """Running mean age of the victims, in logical ticks."""
        return self._age

    def priority(self, stats: NodeStats, target: EvictTarget) -> tuple[int | float, ...]:
        if stats.last_access > self._clock:
            self._clock = stats.last_access
        h = self.horizon_at(stats.last_access)
        return (stats.last_access + h * self.log_value(stats, target), stats.last_access)

    # ----------------------------------------------------------------- learning

    def on_evict(self, node: TreeNode, target: EvictTarget, stats: NodeStats, clock: int) -> None:
        """Feed the victim's age to the mean and retarget ``H`` (called by the queues)."""
        if clock > self._clock:
            self._clock = clock
        age = max(self._clock - stats.last_access, 0)
        self._age += (self.mean_decay if self.victims else 1.0) * (age - self._age)
        self.victims += 1
        goal = min(self.scale * self._age, self.max_horizon)
        if abs(goal - self._goal[-1]) > 0.02 * self._goal[-1] + 1.0:
            self._set_goal(self._clock + 1, goal)

    def _set_goal(self, t: int, goal: float) -> None:
        """From time ``t`` on (after every key computed so far), move ``H`` towards ``goal``."""
        times = self._times
        if t <= times[-1]:
            return  # one knot per tick
        h = self.horizon_at(t)
        times.append(t)
        self._h.append(h)
        self._goal.append(goal)
        if len(times) > _MAX_KNOTS:
            half = _MAX_KNOTS // 2
            del times[:half], self._h[:half], self._goal[:half]

    def knots(self) -> int:
        """Knots of ``H`` held (at most ``_MAX_KNOTS``)."""
        return len(self._times)
