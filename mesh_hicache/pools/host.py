"""L2 host pools: one page-first tensor per region, exposed as DTensors over the mesh.

Layout: each region is ``[num_ids, *row]`` with the row shapes of
:mod:`mesh_hicache.layout` (``kv`` and ``kv_window``: ``[L, 2, T, H, D]``, or
``[L, 1, T, H, D]`` keys only; ``indexer``: ``[L, T, E]``; ``mamba_conv``: ``[L, C, K]``;
``mamba_ssm``: ``[L, H, D, N]``). Three id spaces index the rows: pages (``kv``,
``indexer``), Mamba slots (``mamba_conv``, ``mamba_ssm``) and window ids (``kv_window``).

Why window ids of their own: a sliding-window layer's page is read by a resume only
within the window before the boundary (and the sinks), so L2 need not hold a windowed
page for every page it holds. ``kv_window`` rows are therefore allocated apart from
pages (``window_allocator``) and there may be fewer of them; a transfer names them with
their own index pair (``TransferEngine.backup(window_pages=...)``). The device pool
(L1) keeps its ``kv_window`` tensor indexed by device page ids.

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

Page, slot and window counts must be equal on every rank of the mesh (host indices are
agreed decisions); :meth:`HostPools.from_bytes` agrees on them with ``Consensus.min``.

With ``arena=ArenaPlan`` (a byte budget, docs/DESIGN.md section 7) the regions are strided
views over ONE buffer of blocks (:mod:`mesh_hicache.pools.arena`): a row is still one
contiguous run of ``row_bytes`` (storage reads and writes it in place), consecutive rows
are one block apart, and the DTensor of a region wraps that view (still zero-copy). A
windowed layout needs a plan with a window kind (``window_bytes``, e.g.
``agreed_plan(..., separate_windows=True)``): windows are items of their own there.
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
from mesh_hicache.pools.arena import (
    ArenaIds,
    ArenaPlan,
    BlockArena,
    mesh_item_bytes,
    region_kind,
)
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
    """This rank's L2 tensors for every region of ``layout``, with page, slot and window
    allocators.

    Fixed pools: ``num_pages`` pages, ``num_slots`` slots and ``num_window_pages`` window
    ids (None: ``num_pages``; 0 when the layout has no ``kv_window``, whatever is given).
    ``arena`` (excludes the counts): the id spaces of one :class:`BlockArena`; with a
    ``kv_window`` region the plan must have a window kind. ``topology`` is needed only
    for :meth:`dtensor`. ``pinned=None`` pins (cupy) exactly when CUDA and cupy are
    available.

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
        num_window_pages: int | None = None,
        topology: MeshTopology | None = None,
        pinned: bool | None = None,
        arena: ArenaPlan | None = None,
    ) -> None:
        windows = num_pages if num_window_pages is None else num_window_pages
        if num_pages < 0 or num_slots < 0 or windows < 0:
            raise ValueError(
                f"num_pages={num_pages}, num_slots={num_slots}, "
                f"num_window_pages={num_window_pages} must be >= 0"
            )
        if arena is not None and (num_pages or num_slots or num_window_pages):
            raise ValueError(
                f"an arena excludes num_pages={num_pages}, num_slots={num_slots} and "
                f"num_window_pages={num_window_pages}"
            )
        has_windows = layout.has_region(RegionName.KV_WINDOW)
        if arena is not None and has_windows and not arena.window_bytes:
            raise ValueError(
                "a host arena of a layout with kv_window needs a window kind (window_bytes > 0, "
                "e.g. agreed_plan(..., separate_windows=True))"
            )
        self.layout = layout
        self.topology = topology
        self.pinned = cupy_cuda_available() if pinned is None else pinned
        self.arena = BlockArena(arena) if arena is not None else None
        self.page_allocator: PageAllocator | ArenaIds
        self.slot_allocator: PageAllocator | ArenaIds
        #: Allocator of the ``kv_window`` rows (window ids); ``PageAllocator(0)`` when the
        #: layout has no ``kv_window``.
        self.window_allocator: PageAllocator | ArenaIds
        if self.arena is not None:
            assert arena is not None
            num_pages, num_slots = arena.num_ids("page"), arena.num_ids("slot")
            self.page_allocator, self.slot_allocator = self.arena.pages, self.arena.slots
            windows = arena.num_ids("window") if has_windows else 0
            self.window_allocator = self.arena.windows if has_windows else PageAllocator(0)
        else:
            windows = windows if has_windows else 0
            self.page_allocator = PageAllocator(num_pages)
            self.slot_allocator = PageAllocator(num_slots)
            self.window_allocator = PageAllocator(windows)
        self.num_pages = num_pages
        self.num_slots = num_slots
        #: Size of the window id space (rows of ``kv_window``; 0 without it).
        self.num_window_pages = windows
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
        counts = {"page": num_pages, "slot": num_slots, "window": windows}
        for region in layout.regions:
            count = counts[region_kind(region, separate_windows=True)]
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
        """``ratio`` times the device pool's pages, slots and (window ids: pages) rounded
        down; for a device arena, an arena of ``ratio`` times its blocks (same block size).

        The device arena keeps ``kv_window`` inside its pages; a windowed host arena is
        laid out for its own items instead: pages without ``kv_window`` and windows apart,
        each the largest over the layout's mesh (computed, no process group), so every
        rank derives the same plan."""
        if ratio <= 0:
            raise ValueError(f"host pool ratio must be > 0, got {ratio}")
        layout = device_pools.layout
        if device_pools.arena is not None:
            p = device_pools.arena.plan
            page, window = p.page_bytes, 0
            if layout.has_region(RegionName.KV_WINDOW):
                page, _, window = mesh_item_bytes(layout.spec, layout.shape, layout.cp_kv, True)
            blocks = int(p.num_blocks * ratio)
            plan = ArenaPlan(blocks, p.block_bytes, page, p.slot_bytes, window)
            return cls(layout, topology=topology, pinned=pinned, arena=plan)
        return cls(
            layout,
            num_pages=int(device_pools.num_pages * ratio),
            num_slots=int(device_pools.num_slots * ratio),
            num_window_pages=int(device_pools.num_pages * ratio),
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
        budgeted per page, and one window row per page (``num_window_pages`` =
        ``num_pages``). Collective (one ``Consensus.min``).
        """
        if bytes_per_rank < 0 or slots_per_page < 0:
            raise ValueError(
                f"bytes_per_rank={bytes_per_rank} and slots_per_page={slots_per_page} must be >= 0"
            )
        # Paged regions: kv, indexer and the one kv_window row of each page.
        page = sum(r.row_bytes for r in layout.regions if r.paged)
        slot = sum(r.row_bytes for r in layout.regions if not r.paged)
        cost = page + slots_per_page * slot
        proposal = int(bytes_per_rank // cost) if cost > 0 else 0
        num_pages = consensus.min(proposal)
        return cls(
            layout,
            num_pages=num_pages,
            num_slots=int(num_pages * slots_per_page),
            num_window_pages=num_pages,
            topology=topology,
            pinned=pinned,
        )

    # -- access -----------------------------------------------------------------------------

    def region(self, name: RegionName | str) -> RegionLayout:
        return self.layout.region(name)

    def local(self, name: RegionName | str) -> torch.Tensor:
        """The backing tensor of a region on CPU: ``[num_pages, *row]`` (``kv``,
        ``indexer``), ``[num_slots, *row]`` (Mamba) or ``[num_window_pages, *row]``
        (``kv_window``)."""
        return self._tensors[self.layout.region(name).name]

    def row(self, name: RegionName | str, index: int) -> torch.Tensor:
        """Page/slot/window id ``index`` of a region (the id space of the region, see
        :meth:`local`): a contiguous view of ``row_bytes`` bytes.

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
        """Pages an empty pool holds (with no slots or windows, for an arena)."""
        return self.arena.plan.max_pages if self.arena is not None else self.num_pages

    @property
    def max_slots(self) -> int:
        """Slots an empty pool holds (with no pages or windows, for an arena)."""
        return self.arena.plan.max_slots if self.arena is not None else self.num_slots

    @property
    def max_window_pages(self) -> int:
        """Window rows an empty pool holds (with no pages or slots, for an arena); 0
        without ``kv_window``."""
        if self.arena is not None and self.num_window_pages:
            return self.arena.plan.max_windows
        return self.num_window_pages

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers)

    def __repr__(self) -> str:
        return (
            f"HostPools(pages={self.num_pages}, slots={self.num_slots}, "
            f"windows={self.num_window_pages}, pinned={self.pinned}, bytes={self.nbytes})"
        )
