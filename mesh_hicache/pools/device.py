"""L1 device pools: paged KV, indexer pages and Mamba state slots for this rank's layers.

Per attention layer ``k(layer_id)`` and ``v(layer_id)`` are ``[num_pages, T, H, D]`` and
``indexer(layer_id)`` is ``[num_pages, T, E]`` (T = tokens of a page held by this rank:
``page_size / cp`` under ``cp_kv="shard"``, else ``page_size``; H = this rank's KV heads);
the sliding-window layers' K/V (``StateSpec.windows``) live in their own tensor, like the
host pool's ``kv_window`` region.
Per SSM layer ``conv(layer_id)`` is ``[num_slots, C, K]`` and ``ssm(layer_id)`` is
``[num_slots, H_ssm, D_ssm, N]``. Page and slot indices come from ``page_allocator`` and
``slot_allocator``; the pools never allocate by themselves.

Two layouts, same accessors:

- fixed pools (``num_pages``/``num_slots``): each family lives in one buffer with the
  layer as the outermost dim, so every per-layer tensor is contiguous;
- one arena (``arena=ArenaPlan``, docs/DESIGN.md section 7): one buffer of blocks, page-
  and slot-first like the host pool (a page of all layers is one run of blocks); the
  per-layer tensors are strided views (row stride = one block), ``num_pages``/``num_slots``
  are the id spaces of :mod:`mesh_hicache.pools.arena` and both allocators are views of
  one ``BlockArena``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mesh_hicache.layout import RegionName, StateLayout
from mesh_hicache.pools.allocator import PageAllocator
from mesh_hicache.pools.arena import ArenaIds, ArenaPlan, BlockArena
from mesh_hicache.spec import Family


class DevicePools:
    """This rank's L1 state tensors (zero-initialised) plus their allocators.

    ``num_pages`` (KV and indexer) and ``num_slots`` (Mamba), or the ``arena`` plan, must
    be equal on every rank. Accessors raise ``ValueError`` for a layer this rank does not
    hold in that family. ``arena`` excludes ``num_pages``/``num_slots``.
    """

    def __init__(
        self,
        layout: StateLayout,
        *,
        num_pages: int = 0,
        num_slots: int = 0,
        device: torch.device | str = "cpu",
        arena: ArenaPlan | None = None,
    ) -> None:
        if num_pages < 0 or num_slots < 0:
            raise ValueError(f"num_pages={num_pages}, num_slots={num_slots} must be >= 0")
        spec = layout.spec
        self.layout = layout
        self.device = torch.device(device)
        self.arena: BlockArena | None = None
        self.page_allocator: PageAllocator | ArenaIds
        self.slot_allocator: PageAllocator | ArenaIds
        self._index: dict[Family, dict[int, int]] = {}
        self._kv = self._kv_window = self._indexer = self._conv = self._ssm = torch.empty(0)
        self._window_ids = frozenset(spec.window_layer_ids)
        if arena is not None:
            if num_pages or num_slots:
                raise ValueError(
                    f"an arena excludes num_pages={num_pages} and num_slots={num_slots}"
                )
            self._init_arena(arena)
            return
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.page_allocator = PageAllocator(num_pages)
        self.slot_allocator = PageAllocator(num_slots)
        t = layout.page_size_local
        if spec.kv is not None:
            self._kv = self._kv_pool(RegionName.KV, num_pages)
            if spec.windows:
                self._kv_window = self._kv_pool(RegionName.KV_WINDOW, num_pages)
        if spec.indexer is not None:
            ids = self._register(Family.INDEXER, layout.family_layers(Family.INDEXER))
            shape2 = (len(ids), num_pages, t, spec.indexer.key_dim)
            self._indexer = torch.zeros(shape2, dtype=spec.indexer.dtype, device=self.device)
        if spec.mamba is not None:
            m = spec.mamba
            ids = self._register(Family.MAMBA, layout.family_layers(Family.MAMBA))
            conv = (len(ids), num_slots, layout.local_conv_dim, m.conv_kernel - 1)
            ssm = (len(ids), num_slots, layout.local_ssm_heads, m.head_dim, m.state_dim)
            self._conv = torch.zeros(conv, dtype=m.conv_dtype, device=self.device)
            if m.recurrent:  # a short convolution keeps no recurrent state
                self._ssm = torch.zeros(ssm, dtype=m.ssm_dtype, device=self.device)

    def _init_arena(self, plan: ArenaPlan) -> None:
        layout = self.layout
        if plan.window_bytes:  # kv_window is indexed by page ids here
            raise ValueError(
                f"a device arena keeps kv_window in its pages: window_bytes must be 0, "
                f"got {plan.window_bytes}"
            )
        self.arena = BlockArena(plan)
        self.page_allocator, self.slot_allocator = self.arena.pages, self.arena.slots
        self.num_pages, self.num_slots = plan.num_ids("page"), plan.num_ids("slot")
        buffer = torch.zeros(plan.nbytes, dtype=torch.uint8, device=self.device)
        views: dict[RegionName, torch.Tensor] = {}
        for region in layout.regions:
            view = plan.region_view(buffer, layout, region)  # [N, L, ...]
            # Like the fixed pools: [L, 2, N, T, H, D] for kv, [L, N, ...] otherwise.
            views[region.name] = view.movedim(0, 2 if region.family is Family.KV else 1)
            self._register(region.family, region.local_layer_ids)
        empty = torch.empty(0, device=self.device)
        self._kv = views.get(RegionName.KV, empty)
        self._kv_window = views.get(RegionName.KV_WINDOW, empty)
        self._indexer = views.get(RegionName.INDEXER, empty)
        self._conv = views.get(RegionName.MAMBA_CONV, empty)
        self._ssm = views.get(RegionName.MAMBA_SSM, empty)
        self._buffer = buffer

    def _register(self, family: Family, ids: tuple[int, ...]) -> tuple[int, ...]:
        """Index ``ids`` (rows 0, 1, ... of one tensor) under ``family``. The kv and
        kv_window tensors share the KV index, the Mamba conv and ssm ones their rows."""
        self._index.setdefault(family, {}).update((layer, i) for i, layer in enumerate(ids))
        return ids

    def _kv_pool(self, name: RegionName, num_pages: int) -> torch.Tensor:
        """The zeroed ``[L, parts, num_pages, T, H, D]`` K/V tensor of region ``name``'s
        layers here (parts 1: keys only, e.g. an MLA latent; no V allocated)."""
        layout, kv = self.layout, self.layout.spec.kv
        assert kv is not None
        ids = self._register(Family.KV, layout.region_layers(name))
        t, h = layout.page_size_local, layout.local_kv_heads
        shape = (len(ids), kv.num_parts, num_pages, t, h, kv.head_dim)
        return torch.zeros(shape, dtype=kv.dtype, device=self.device)

    def _kv_of(self, layer_id: int) -> tuple[torch.Tensor, int]:
        """The K/V tensor holding ``layer_id`` (windowed or full) and the layer's row in it."""
        row = self._row(Family.KV, layer_id)
        return (self._kv_window if layer_id in self._window_ids else self._kv), row

    def clear_window_pages(self, pages: Sequence[int]) -> None:
        """Zero the windowed layers' K/V of device ``pages``: a page loaded from a host
        copy that lacks it (no resume reads it, but attention must not meet stale or
        non-finite values there)."""
        if pages and self._kv_window.numel():
            self._kv_window.index_fill_(2, self._ids(pages), 0)

    def copy_window_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the windowed layers' K/V of device pages ``src`` to pages ``dst``."""
        if src and self._kv_window.numel():
            rows = self._kv_window.index_select(2, self._ids(src))
            self._kv_window.index_copy_(2, self._ids(dst), rows)

    def _ids(self, pages: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(list(pages), dtype=torch.long, device=self.device)

    def _row(self, family: Family, layer_id: int) -> int:
        try:
            return self._index[family][layer_id]
        except KeyError:
            held = sorted(self._index.get(family, {}))
            raise ValueError(
                f"layer {layer_id} has no {family.value} state on this rank; held: {held}"
            ) from None

    def layers(self, family: Family) -> tuple[int, ...]:
        """Global layer ids of ``family`` held here, increasing (empty if none)."""
        return tuple(sorted(self._index.get(family, {})))

    def k(self, layer_id: int) -> torch.Tensor:
        """K pages of ``layer_id``: ``[num_pages, T, H, D]`` (a view; writes go to the pool)."""
        kv, row = self._kv_of(layer_id)
        return kv[row, 0]

    def v(self, layer_id: int) -> torch.Tensor:
        """V pages of ``layer_id``: ``[num_pages, T, H, D]``; ``ValueError`` for a keys-only
        spec (``KVSpec.values=False``)."""
        kv, row = self._kv_of(layer_id)
        if kv.shape[1] < 2:
            raise ValueError(f"layer {layer_id} has no V: the KV spec is keys only (values=False)")
        return kv[row, 1]

    def indexer(self, layer_id: int) -> torch.Tensor:
        """Indexer keys of ``layer_id``: ``[num_pages, T, E]``."""
        return self._indexer[self._row(Family.INDEXER, layer_id)]

    def conv(self, layer_id: int) -> torch.Tensor:
        """Conv states of ``layer_id``: ``[num_slots, C, K]``."""
        return self._conv[self._row(Family.MAMBA, layer_id)]

    def ssm(self, layer_id: int) -> torch.Tensor:
        """SSM states of ``layer_id``: ``[num_slots, H_ssm, D_ssm, N]``."""
        m = self.layout.spec.mamba
        if m is not None and not m.recurrent:
            raise ValueError(f"layer {layer_id} keeps a conv state only (no recurrent state)")
        return self._ssm[self._row(Family.MAMBA, layer_id)]

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
        if self.arena is not None:
            return self.arena.plan.nbytes
        bufs = (self._kv, self._kv_window, self._indexer, self._conv, self._ssm)
        return sum(b.numel() * b.element_size() for b in bufs)

    def __repr__(self) -> str:
        return (
            f"DevicePools(pages={self.num_pages}, slots={self.num_slots}, "
            f"device={self.device}, bytes={self.nbytes})"
        )
