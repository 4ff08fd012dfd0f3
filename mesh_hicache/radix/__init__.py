"""The hybrid radix tree: prefix matching over KV pages and Mamba checkpoints per tier."""

from mesh_hicache.radix.eviction import EvictionPolicy, EvictTarget, LFUPolicy, LRUPolicy, NodeStats
from mesh_hicache.radix.hashing import RadixKey, page_hashes
from mesh_hicache.radix.node import EvictResult, InsertResult, MatchResult, PoolUsage, TreeNode
from mesh_hicache.radix.tree import RadixTree

__all__ = [
    "EvictResult",
    "EvictTarget",
    "EvictionPolicy",
    "InsertResult",
    "LFUPolicy",
    "LRUPolicy",
    "MatchResult",
    "NodeStats",
    "PoolUsage",
    "RadixKey",
    "RadixTree",
    "TreeNode",
    "page_hashes",
]
