"""L2 host pools: one page-first tensor per region, exposed as DTensors over the mesh.

Layout: each region is ``[num_pages_or_slots, *row]`` with the row shapes of
:mod:`mesh_hicache.layout` (``kv``: ``[L, 2, T, H, D]``, or ``[L, 1, T, H, D]`` keys only;
``indexer``: ``[L, T, E]``; ``mamba_conv``: ``[L, C, K]``; ``mamba_ssm``: ``[L, H, D, N]``).

Why page-first (page index outermost) rather than layer-first like the device pool: one
page (or slot) of all this rank's layers is then ONE contiguous run of memory. Storage
reads and writes a page as a single buffer (no gather, one syscall or one RDMA op per
object), and a page's storage object maps 1:1 onto a row. The cost falls on device<->host
copies, which touch ``L`` strided runs per page; the transfer engine batches those per
layer, which keeps them large (a whole page of one layer, not one token).

Backing memory: on CUDA, pinned memory from cupy (``cupy.cuda.alloc_pinned_memory``),
viewed by a CPU torch tensor, so copies to and from the GPU are DMA and asynchronous; on
CPU, ordinary memory. ``dtensor(region)`` wraps the local tensor with
``DTensor.from_local(..., run_check=False)``: the DTensor's local tensor IS the buffer
(zero-copy). ``run_check=True`` must not be used: it broadcasts Replicate placements and
would overwrite other ranks' buffers.

Page and slot counts must be equal on every rank of the mesh (host indices are agreed
decisions); :meth:`HostPools.from_bytes` agrees on them with ``Consensus.min``.

With ``arena=ArenaPlan`` (a byte budget, docs/DESIGN.md section 7) the regions are strided
views over ONE buffer of blocks (:mod:`mesh_hicache.pools.arena`): a row is still one
contiguous run of ``row_bytes`` (storage reads and writes it in place), consecutive rows
are one block apart, and the DTensor of a region wraps that view (still zero-copy).
``buffers()`` lists the contiguous allocations to register with a zero-copy backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import RegionLayout, RegionName, StateLayout
from mesh_hicache.pools.allocator import PageAllocator
from mesh_hicache.pools.arena import ArenaIds, ArenaPlan, BlockArena
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.topology import MeshTopology


def cupy_cuda_available() -> bool:
    """True iff torch sees CUDA and cupy imports and sees a CUDA device."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # type: ignore[import-not-found]

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def alloc_host_buffer(nbytes: int, pinned: bool) -> tuple[torch.Tensor, Any]:
    """A zeroed uint8 CPU tensor of ``nbytes`` and the object that owns its memory.

    ``pinned=True`` uses cupy pinned memory (keep the owner alive as long as the tensor).
    """
    if not pinned:
        return torch.zeros(nbytes, dtype=torch.uint8), None
    import cupy
    import numpy as np

    mem = cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
    arr = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
    tensor = torch.from_numpy(arr)
    tensor.zero_()
    return tensor, mem


class HostPools:
    """This rank's L2 tensors for every region of ``layout``, with page and slot allocators.

    ``topology`` is needed only for :meth:`dtensor`. ``pinned=None`` pins (cupy) exactly
    when CUDA and cupy are available.

    The DTensors live on a CPU DeviceMesh over the topology's rank grid (a DTensor on a
    CUDA mesh would copy its local tensor to the GPU, losing zero-copy). On a CPU topology
    that is the topology's own mesh; on a CUDA topology a CPU twin is built here, which is
    collective (all ranks construct their HostPools together) and needs a process group
    that handles CPU tensors, e.g. ``init_process_group("cpu:gloo,cuda:nccl")``.
    """

    def __init__(
        self,
        layout: StateLayout,
        *,
        num_pages: int = 0,
        num_slots: int = 0,
        topology: MeshTopology | None = None,
        pinned: bool | None = None,
        arena: ArenaPlan | None = None,
    ) -> None:
        if num_pages < 0 or num_slots < 0:
            raise ValueError(f"num_pages={num_pages}, num_slots={num_slots} must be >= 0")
        if arena is not None and (num_pages or num_slots):
            raise ValueError(f"an arena excludes num_pages={num_pages} and num_slots={num_slots}")
        self.layout = layout
        self.topology = topology
        self.pinned = cupy_cuda_available() if pinned is None else pinned
        self.arena = BlockArena(arena) if arena is not None else None
        self.page_allocator: PageAllocator | ArenaIds
        self.slot_allocator: PageAllocator | ArenaIds
        if self.arena is not None:
            assert arena is not None
            num_pages, num_slots = arena.num_ids(True), arena.num_ids(False)
            self.page_allocator, self.slot_allocator = self.arena.pages, self.arena.slots
        else:
            self.page_allocator = PageAllocator(num_pages)
            self.slot_allocator = PageAllocator(num_slots)
        self.num_pages = num_pages
        self.num_slots = num_slots
        self._host_mesh: DeviceMesh | None = None
        if topology is not None:
            mesh = topology.mesh
            if mesh.device_type == "cpu":
                self._host_mesh = mesh
            else:
                self._host_mesh = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)
        self._tensors: dict[RegionName, torch.Tensor] = {}
        self._owners: list[Any] = []
        self._buffers: list[torch.Tensor] = []
        if arena is not None:
            raw, owner = alloc_host_buffer(arena.nbytes, self.pinned)
            self._owners.append(owner)
            self._buffers.append(raw)
            for region in layout.regions:
                self._tensors[region.name] = arena.region_view(raw, layout, region)
            return
        for region in layout.regions:
            count = num_pages if region.paged else num_slots
            raw, owner = alloc_host_buffer(count * region.row_bytes, self.pinned)
            self._owners.append(owner)
            local = raw.view(region.dtype).view(count, *region.local_shape)
            self._tensors[region.name] = local
            self._buffers.append(local)

    # -- sizing -----------------------------------------------------------------------------

    @classmethod
    def from_ratio(
        cls,
        device_pools: DevicePools,
        ratio: float,
        *,
        topology: MeshTopology | None = None,
        pinned: bool | None = None,
    ) -> HostPools:
        """``ratio`` times the device pool's pages and slots (rounded down); for a device
        arena, an arena of ``ratio`` times its blocks (same block size)."""
        if ratio <= 0:
            raise ValueError(f"host pool ratio must be > 0, got {ratio}")
        if device_pools.arena is not None:
            p = device_pools.arena.plan
            plan = ArenaPlan(int(p.num_blocks * ratio), p.block_bytes, p.page_bytes, p.slot_bytes)
            return cls(device_pools.layout, topology=topology, pinned=pinned, arena=plan)
        return cls(
            device_pools.layout,
            num_pages=int(device_pools.num_pages * ratio),
            num_slots=int(device_pools.num_slots * ratio),
            topology=topology,
            pinned=pinned,
        )

    @classmethod
    def from_bytes(
        cls,
        layout: StateLayout,
        bytes_per_rank: int,
        consensus: Consensus,
        *,
        slots_per_page: float = 0.0,
        topology: MeshTopology | None = None,
        pinned: bool | None = None,
    ) -> HostPools:
        """At most ``bytes_per_rank`` bytes on this rank; counts agreed over ``consensus``.

        ``consensus`` must span the whole mesh (pp, cp, tp): per-rank byte costs differ
        (uneven heads or layers), but the counts must be equal everywhere, so each rank
        proposes what fits and all take the minimum. ``slots_per_page`` Mamba slots are
        budgeted per page. Collective (one ``Consensus.min``).
        """
        if bytes_per_rank < 0 or slots_per_page < 0:
            raise ValueError(
                f"bytes_per_rank={bytes_per_rank} and slots_per_page={slots_per_page} must be >= 0"
            )
        page = sum(r.row_bytes for r in layout.regions if r.paged)
        slot = sum(r.row_bytes for r in layout.regions if not r.paged)
        cost = page + slots_per_page * slot
        proposal = int(bytes_per_rank // cost) if cost > 0 else 0
        num_pages = consensus.min(proposal)
        return cls(
            layout,
            num_pages=num_pages,
            num_slots=int(num_pages * slots_per_page),
            topology=topology,
            pinned=pinned,
        )

    # -- access -----------------------------------------------------------------------------

    def region(self, name: RegionName | str) -> RegionLayout:
        return self.layout.region(name)

    def local(self, name: RegionName | str) -> torch.Tensor:
        """The backing tensor of a region: ``[num_pages_or_slots, *row]`` on CPU."""
        return self._tensors[self.layout.region(name).name]

    def row(self, name: RegionName | str, index: int) -> torch.Tensor:
        """Page/slot ``index`` of a region: a contiguous view of ``row_bytes`` bytes.

        Storage reads and writes it directly. ``IndexError`` for an out-of-range index.
        """
        local = self.local(name)
        if not 0 <= index < local.shape[0]:
            raise IndexError(f"{name} row {index} outside [0, {local.shape[0]})")
        return local[index]

    def dtensor(self, name: RegionName | str) -> DTensor:
        """The region as a DTensor over the 3D mesh; its local tensor is the buffer."""
        if self._host_mesh is None:
            raise ValueError("HostPools was built without a topology; pass topology= for DTensors")
        region = self.layout.region(name)
        return DTensor.from_local(
            self.local(name), self._host_mesh, list(region.placements), run_check=False
        )

    @property
    def host_mesh(self) -> DeviceMesh | None:
        """The CPU mesh of the DTensors (None without a topology)."""
        return self._host_mesh

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The contiguous CPU allocations behind the regions (one per region, or the one
        arena buffer): what a zero-copy storage backend registers."""
        return tuple(self._buffers)

    @property
    def max_pages(self) -> int:
        """Pages an empty pool holds (with no slots, for an arena)."""
        return self.arena.plan.max_pages if self.arena is not None else self.num_pages

    @property
    def max_slots(self) -> int:
        """Slots an empty pool holds (with no pages, for an arena)."""
        return self.arena.plan.max_slots if self.arena is not None else self.num_slots

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers)

    def __repr__(self) -> str:
        return (
            f"HostPools(pages={self.num_pages}, slots={self.num_slots}, "
            f"pinned={self.pinned}, bytes={self.nbytes})"
        )
