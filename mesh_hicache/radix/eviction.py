"""Eviction policies of the radix tree (docs/DESIGN.md section 5).

A policy ranks eviction candidates; the tree decides which nodes are candidates (unlocked,
unprotected, no dependent children on that tier) and what evicting one means. The tree
keeps one sorted queue per target (``queues.EvictionQueues``) keyed by the priority the
policy gives a node's ``NodeStats``, so a priority must be a function of those stats
only, never of the current clock or of other nodes. "Age" is therefore expressed as
``last_access`` (a logical clock value; smaller is older).

Touches are cheap: a match or insert only stores the node's new ``last_access`` and
``hit_count``. A policy whose priority never decreases when those grow (``monotone``,
the default; true of LRU and LFU) lets the tree re-rank a touched node lazily, when it
reaches the top of a queue. A policy that sets ``monotone = False`` is re-ranked on every
touch instead (correct, but a touch then costs a queue update per node).

Determinism: every rank of the mesh runs the same tree operations and must evict the
same nodes, so priorities must be deterministic (no wall-clock time, no ``hash()``).
Ties are broken by the tree with the node's creation id.
"""

from __future__ import annotations

import abc
import enum
from typing import NamedTuple


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


class EvictionPolicy(abc.ABC):
    """Ranks eviction candidates: the smallest priority is evicted first."""

    monotone: bool = True
    """Whether ``priority`` never decreases as ``last_access`` and ``hit_count`` grow."""

    @abc.abstractmethod
    def priority(self, stats: NodeStats, target: EvictTarget) -> tuple[int | float, ...]:
        """Priority of a candidate for ``target``; smaller is evicted earlier. Pure."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def priority(self, stats: NodeStats, target: EvictTarget) -> tuple[int | float, ...]:
        return (stats.last_access,)


class LFUPolicy(EvictionPolicy):
    """Least frequently used first, then least recently used."""

    def priority(self, stats: NodeStats, target: EvictTarget) -> tuple[int | float, ...]:
        return (stats.hit_count, stats.last_access)
