"""One region of a rank's host pool: its placements, row shapes and global slice.

A *region* (:class:`RegionName`) is one host-pool tensor: ``kv`` (K and V together),
``kv_window`` (the same for the sliding-window layers, when the spec has any),
``indexer``, ``mamba_conv`` and ``mamba_ssm``. Its global tensor has the host page (or
slot) index as dim 0 and one *row* per page/slot after it; placements over (pp, cp, tp)
follow the table of docs/DESIGN.md section 4 (placement dims count the page dim 0:
``Shard(1)`` is L). The builders here turn a family's spec and a rank's position
(:class:`RankPosition`) into a :class:`RegionLayout`; :class:`mesh_hicache.layout.StateLayout`
decides which layers each region holds and calls them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from mesh_hicache.choices import RegionName
from mesh_hicache.shards import mamba_local_conv_dim
from mesh_hicache.spec import Family, KVSpec, StateSpec


@dataclass(frozen=True, slots=True)
class GlobalSlice:
    """The part of one family's global per-page (or per-slot) object that a shard holds.

    Half-open ranges in global (whole-model) coordinates; no rank numbers. ``heads`` is
    the KV head range (KV), SSM head range (MAMBA; conv channels follow the heads) or
    ``(0, 1)`` for head-less families; ``tokens`` is the token-in-page range (``(0, 1)``
    for MAMBA, whose objects are per boundary, not per token).
    """

    layers: tuple[int, int]
    heads: tuple[int, int]
    tokens: tuple[int, int]

    def tag(self) -> str:
        """A stable, filename-safe text form used in storage keys, e.g. ``L0-4.H2-4.T0-16``."""
        (l0, l1), (h0, h1), (t0, t1) = self.layers, self.heads, self.tokens
        return f"L{l0}-{l1}.H{h0}-{h1}.T{t0}-{t1}"


REGION_FAMILY: dict[RegionName, Family] = {
    RegionName.KV: Family.KV,
    RegionName.KV_WINDOW: Family.KV,
    RegionName.INDEXER: Family.INDEXER,
    RegionName.MAMBA_CONV: Family.MAMBA,
    RegionName.MAMBA_SSM: Family.MAMBA,
}


@dataclass(frozen=True, slots=True)
class RegionLayout:
    """One region of this rank's host pool.

    ``local_shape``/``global_shape`` are the shapes of ONE page/slot row (without the page
    dim 0); the pool tensor is ``[num_pages_or_slots, *local_shape]``. ``placements`` are
    over the 3D mesh ``(pp, cp, tp)`` for the pool tensor including dim 0. The L dim
    (dim 0 of the row) is padded to ``num_layer_rows``; its first ``len(local_layer_ids)``
    entries hold ``local_layer_ids`` in order.
    """

    name: RegionName
    family: Family
    dtype: torch.dtype
    placements: tuple[Placement, Placement, Placement]
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_slice: GlobalSlice
    is_writer: bool
    local_layer_ids: tuple[int, ...]

    @property
    def paged(self) -> bool:
        """True for page-indexed regions (kv, indexer); False for Mamba slot regions."""
        return self.family is not Family.MAMBA

    @property
    def num_layer_rows(self) -> int:
        """Size of the (padded) L dim of a row."""
        return self.local_shape[0]

    @property
    def row_numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.dtype.itemsize

    def layer_row(self, layer_id: int) -> int:
        """Index in the L dim of ``layer_id``; ``ValueError`` if this rank does not hold it."""
        try:
            return self.local_layer_ids.index(layer_id)
        except ValueError:
            raise ValueError(
                f"layer {layer_id} is not in region {self.name.value}'s local layers "
                f"{self.local_layer_ids}"
            ) from None


@dataclass(frozen=True, slots=True)
class RankPosition:
    """What the region builders need to know of one rank.

    ``shape``/``coords`` are (pp, cp, tp); ``cp_sharded`` says whether cp splits the
    token dim of paged regions (``cp_kv="shard"``), ``tokens`` is then this rank's
    token-in-page range (else the whole page) and ``page_size_local`` its length.
    """

    shape: tuple[int, int, int]
    coords: tuple[int, int, int]
    cp_sharded: bool
    tokens: tuple[int, int]
    page_size_local: int

    @property
    def first_cp(self) -> bool:
        """True when this rank writes paged regions as far as cp is concerned."""
        return self.coords[1] == 0 or self.cp_sharded


@dataclass(frozen=True, slots=True)
class RegionLayers:
    """A region's layers on a rank: ids held, padded row count, global layer range."""

    ids: tuple[int, ...]
    rows: int
    span: tuple[int, int]


def family_layer_ids(spec: StateSpec, family: Family) -> tuple[int, ...]:
    """Global ids of ``family``'s layers (KV: full-attention and windowed together)."""
    sub = {Family.KV: spec.kv, Family.MAMBA: spec.mamba, Family.INDEXER: spec.indexer}[family]
    return sub.layer_ids if sub is not None else ()


def region_layer_ids(spec: StateSpec, name: RegionName) -> tuple[int, ...]:
    """Global ids of the layers region ``name`` holds rows of: ``kv`` the full-attention
    layers, ``kv_window`` the sliding-window ones, any other region its family's."""
    if name is RegionName.KV:
        return spec.full_kv_layer_ids
    if name is RegionName.KV_WINDOW:
        return spec.window_layer_ids
    return family_layer_ids(spec, REGION_FAMILY[name])


def local_kv_heads(kv: KVSpec, tp: int) -> int:
    """KV heads on one tp rank (1 when kv_heads < tp; all of them for MLA)."""
    if kv.mla:
        return kv.num_kv_heads
    return max(kv.num_kv_heads // tp, 1)


def _cp_placement(sharded: bool, token_dim: int) -> Placement:
    return Shard(token_dim) if sharded else Replicate()


def kv_region(
    kv: KVSpec,
    page_size: int,
    pos: RankPosition,
    layers: RegionLayers,
    name: RegionName = RegionName.KV,
) -> RegionLayout:
    """The ``kv`` region: ``[L, 2, T, H, D]`` rows (K and V; ``[L, 1, T, H, D]`` keys only,
    e.g. an MLA latent), see docs/DESIGN.md section 4. ``name`` ``kv_window``: the same
    region for the sliding-window layers (only ``layers`` differ)."""
    pp, _, tp = pos.shape
    t = pos.coords[2]
    h_local = local_kv_heads(kv, tp)
    if kv.mla:
        tp_place: Placement = Replicate()
        h_global, heads, first_tp = h_local, (0, kv.num_kv_heads), t == 0
    elif kv.num_kv_heads >= tp:
        tp_place = Shard(4)
        h_global, heads, first_tp = kv.num_kv_heads, (t * h_local, (t + 1) * h_local), True
    else:
        group = tp // kv.num_kv_heads
        tp_place = Shard(4)
        h_global, heads, first_tp = tp, (t // group, t // group + 1), t % group == 0
    return RegionLayout(
        name=name,
        family=Family.KV,
        dtype=kv.dtype,
        placements=(Shard(1), _cp_placement(pos.cp_sharded, 3), tp_place),
        local_shape=(layers.rows, kv.num_parts, pos.page_size_local, h_local, kv.head_dim),
        global_shape=(layers.rows * pp, kv.num_parts, page_size, h_global, kv.head_dim),
        global_slice=GlobalSlice(layers.span, heads, pos.tokens),
        is_writer=bool(layers.ids) and pos.first_cp and first_tp,
        local_layer_ids=layers.ids,
    )


def indexer_region(spec: StateSpec, pos: RankPosition, layers: RegionLayers) -> RegionLayout:
    """The ``indexer`` region: ``[L, T, E]`` rows, replicated over tp (one writer)."""
    assert spec.indexer is not None
    pp = pos.shape[0]
    e = spec.indexer.key_dim
    return RegionLayout(
        name=RegionName.INDEXER,
        family=Family.INDEXER,
        dtype=spec.indexer.dtype,
        placements=(Shard(1), _cp_placement(pos.cp_sharded, 2), Replicate()),
        local_shape=(layers.rows, pos.page_size_local, e),
        global_shape=(layers.rows * pp, spec.page_size, e),
        global_slice=GlobalSlice(layers.span, (0, 1), pos.tokens),
        is_writer=bool(layers.ids) and pos.first_cp and pos.coords[2] == 0,
        local_layer_ids=layers.ids,
    )


def mamba_regions(
    spec: StateSpec, pos: RankPosition, layers: RegionLayers
) -> tuple[RegionLayout, ...]:
    """The ``mamba_conv`` ``[L, C, K-1]`` and ``mamba_ssm`` ``[L, H, P, N]`` slot regions
    (the conv region only for a spec without a recurrent state: ``recurrent=False``)."""
    m = spec.mamba
    assert m is not None
    pp, _, tp = pos.shape
    _, c, t = pos.coords
    h = m.num_heads // tp
    conv_dim = mamba_local_conv_dim(m, tp)
    sl = GlobalSlice(layers.span, (t * h, (t + 1) * h), (0, 1))
    writer = bool(layers.ids) and c == 0
    k = m.conv_kernel - 1
    conv = RegionLayout(
        name=RegionName.MAMBA_CONV,
        family=Family.MAMBA,
        dtype=m.conv_dtype,
        placements=(Shard(1), Replicate(), Shard(2)),
        local_shape=(layers.rows, conv_dim, k),
        # Groups replicated over tp are duplicated in the global view.
        global_shape=(layers.rows * pp, conv_dim * tp, k),
        global_slice=sl,
        is_writer=writer,
        local_layer_ids=layers.ids,
    )
    if not m.recurrent:
        return (conv,)
    ssm = RegionLayout(
        name=RegionName.MAMBA_SSM,
        family=Family.MAMBA,
        dtype=m.ssm_dtype,
        placements=(Shard(1), Replicate(), Shard(2)),
        local_shape=(layers.rows, h, m.head_dim, m.state_dim),
        global_shape=(layers.rows * pp, m.num_heads, m.head_dim, m.state_dim),
        global_slice=sl,
        is_writer=writer,
        local_layer_ids=layers.ids,
    )
    return conv, ssm
