"""L1 device pools, L2 host pools and their index allocators."""

from __future__ import annotations

from mesh_hicache.pools.allocator import PageAllocator
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools, cupy_cuda_available

__all__ = ["DevicePools", "HostPools", "PageAllocator", "cupy_cuda_available"]
