"""mesh_hicache: a hierarchical prefix cache for hybrid models on a pp x cp x tp DeviceMesh."""

from mesh_hicache.cache import (
    CacheClosed,
    CachedRequest,
    CacheFull,
    ConcurrentUse,
    HiCache,
    PrefixHit,
    ServedTokens,
)
from mesh_hicache.choices import (
    CpKvMode,
    PrefetchPolicy,
    RegionName,
    StorageKind,
    TransferBackend,
    WritePolicy,
)
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.consensus import CollectiveTimeout, Consensus, RanksDisagree
from mesh_hicache.identity import checkpoint_model_id
from mesh_hicache.spec import Family, IndexerSpec, KVSpec, MambaSpec, StateSpec
from mesh_hicache.stats import CacheStats
from mesh_hicache.topology import MeshAxis, MeshTopology

__all__ = [
    "CacheClosed",
    "CacheFull",
    "CacheStats",
    "CachedRequest",
    "CollectiveTimeout",
    "ConcurrentUse",
    "Consensus",
    "CpKvMode",
    "Family",
    "HiCache",
    "HiCacheConfig",
    "IndexerSpec",
    "KVSpec",
    "MambaSpec",
    "MeshAxis",
    "MeshTopology",
    "PrefetchPolicy",
    "PrefixHit",
    "RanksDisagree",
    "RegionName",
    "ServedTokens",
    "StateSpec",
    "StorageKind",
    "TransferBackend",
    "WritePolicy",
    "checkpoint_model_id",
]
__version__ = "0.1.0"
