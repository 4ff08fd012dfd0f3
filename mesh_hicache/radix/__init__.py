"""The hybrid radix tree: prefix matching over KV pages and Mamba checkpoints per tier."""

from mesh_hicache.radix.eviction import EvictionPolicy, EvictTarget, LRUPolicy, NodeStats
from mesh_hicache.radix.hashing import RadixKey, pack_tokens, page_hashes
from mesh_hicache.radix.node import (
    EvictResult,
    Family,
    InsertResult,
    MatchResult,
    PoolUsage,
    Tier,
    TreeNode,
)
from mesh_hicache.radix.tree import RadixTree

__all__ = [
    "EvictResult",
    "EvictTarget",
    "EvictionPolicy",
    "Family",
    "InsertResult",
    "LRUPolicy",
    "MatchResult",
    "NodeStats",
    "PoolUsage",
    "RadixKey",
    "RadixTree",
    "Tier",
    "TreeNode",
    "pack_tokens",
    "page_hashes",
]
