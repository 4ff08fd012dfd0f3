"""The eviction policies a configuration names (``choices.EvictionPolicyKind``).

The factory lives apart from the policies so that imports go one way: ``eviction`` (the
interface, LRU, ``cost``) <- ``adaptive`` <- ``reuse`` <- this module.
"""

from __future__ import annotations

from mesh_hicache.radix.adaptive import AdaptiveCostPolicy
from mesh_hicache.radix.eviction import CostModel, DecayCostPolicy, EvictionPolicy, LRUPolicy
from mesh_hicache.radix.reuse import ReusePolicy

POLICY_NAMES = ("lru", "cost", "adaptive", "reuse")


def make_policy(kind: str | EvictionPolicy, cost: CostModel) -> EvictionPolicy:
    """The policy named by ``kind`` (``choices.EvictionPolicyKind`` values), or ``kind``
    itself when it is a policy already. ``cost`` values nodes for all but ``lru``."""
    if isinstance(kind, EvictionPolicy):
        return kind
    kind = str(kind)
    if kind == "lru":
        return LRUPolicy()
    if kind == "cost":
        return DecayCostPolicy(cost)
    if kind == "adaptive":
        return AdaptiveCostPolicy(cost)
    if kind == "reuse":
        return ReusePolicy(cost)
    raise ValueError(f"eviction policy {kind!r}; choose from {POLICY_NAMES}")
