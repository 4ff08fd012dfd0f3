"""L1 device pools, L2 host pools, their index allocators and the block arena of a tier
with a byte budget."""

from __future__ import annotations

from mesh_hicache.pools.allocator import PageAllocator
from mesh_hicache.pools.arena import ArenaIds, ArenaPlan, BlockArena
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools, cupy_cuda_available

__all__ = [
    "ArenaIds",
    "ArenaPlan",
    "BlockArena",
    "DevicePools",
    "HostPools",
    "PageAllocator",
    "cupy_cuda_available",
]
