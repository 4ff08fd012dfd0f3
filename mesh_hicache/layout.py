"""Placements -> local shard shape, global slice, writer election (docs/DESIGN.md section 4).

Every host-pool tensor is a *region* (:class:`RegionName`): ``kv`` (K and V together),
``indexer``, ``mamba_conv`` and ``mamba_ssm`` (separate tensors: their dtypes may
differ). A region's global tensor has the host page (or slot) index as dim 0 and one
*row* per page/slot after it; the row shapes and their placements over (pp, cp, tp) are
the table of docs/DESIGN.md section 4 (placement dims count the page dim 0: ``Shard(1)``
is L).

Derived rules:

- **PP** splits the model's layers into contiguous stages balanced by layer count
  (:func:`stage_layers`). A family's local layers are its ids inside the stage's range,
  possibly none. Stages may hold different numbers of a family's layers; the L dim of
  every rank's host pool is padded to the maximum over stages so that local shapes (and
  page/slot counts) are equal on every rank, as ``Shard`` over pp requires. Row ``i`` of
  the L dim holds ``local_layer_ids[i]``; rows past them are padding, never read.
- **kv_heads < tp**: each tp rank holds one head; ``tp / kv_heads`` consecutive tp ranks
  hold the same head. The DTensor's global H dim is then ``tp`` (heads duplicated) so that
  ``Shard`` over tp still works; :class:`GlobalSlice` reports the real head.
- **cp_kv="shard"**: cp rank ``c`` holds tokens ``[c*T/cp, (c+1)*T/cp)`` of every page.
- **Writer election**: a rank writes a region's shard to storage iff its coordinate is 0 on
  every axis where the region is replicated (for duplicated KV heads: it is the first of
  the tp ranks holding that head) and its stage holds at least one of the family's layers.
  Every distinct non-empty shard then has exactly one writer.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from mesh_hicache.choices import CpKvMode, RegionName
from mesh_hicache.spec import Family, MambaSpec, StateSpec
from mesh_hicache.topology import MeshTopology, all_coordinates


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


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Model layers of pipeline ``stage``: contiguous, sizes differ by at most one.

    The first ``num_layers % pp`` stages get one extra layer.
    """
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not in range(pp={pp})")
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class StateLayout:
    """Placements, local shapes, global slices and writers of every region on one rank.

    Build with ``StateLayout(spec, topology, cp_kv)`` on a rank, or with
    :meth:`for_coords` from a mesh shape and coordinate (no process group needed).
    Raises ``ValueError`` when ``spec`` cannot be split over tp, ``cp_kv`` is unknown, or
    ``cp_kv="shard"`` with a page size not divisible by cp. Immutable.
    """

    def __init__(
        self, spec: StateSpec, topology: MeshTopology, cp_kv: CpKvMode | str = CpKvMode.REPLICATE
    ) -> None:
        self._init(spec, topology.shape, topology.coords, cp_kv)

    @classmethod
    def for_coords(
        cls,
        spec: StateSpec,
        shape: Sequence[int],
        coords: Sequence[int],
        cp_kv: CpKvMode | str = CpKvMode.REPLICATE,
    ) -> StateLayout:
        """The layout of the rank at ``coords`` (pp, cp, tp) of a mesh of ``shape``."""
        if len(shape) != 3 or len(coords) != 3:
            raise ValueError(
                f"shape {tuple(shape)} and coords {tuple(coords)} must be (pp, cp, tp)"
            )
        if any(not 0 <= c < s for c, s in zip(coords, shape, strict=True)):
            raise ValueError(f"coords {tuple(coords)} lie outside mesh shape {tuple(shape)}")
        self = cls.__new__(cls)
        pp, cp, tp = (int(s) for s in shape)
        p, c, t = (int(x) for x in coords)
        self._init(spec, (pp, cp, tp), (p, c, t), cp_kv)
        return self

    def _init(
        self,
        spec: StateSpec,
        shape: tuple[int, int, int],
        coords: tuple[int, int, int],
        cp_kv: CpKvMode | str,
    ) -> None:
        mode = CpKvMode.parse(cp_kv, "cp_kv")
        pp, cp, tp = shape
        spec.check_tp(tp)
        if mode is CpKvMode.SHARD:
            if spec.page_size % cp:
                raise ValueError(
                    f"cp_kv='shard' needs page_size ({spec.page_size}) divisible by cp ({cp})"
                )
            if cp == 1:
                warnings.warn(
                    "cp_kv='shard' has no effect with cp=1 (pages are whole)", stacklevel=3
                )
        self.spec = spec
        self.shape = shape
        self.coords = coords
        self.cp_kv = mode
        self.layer_ids = stage_layers(spec.num_layers, pp, coords[0])
        self.page_size_local = spec.page_size // cp if mode is CpKvMode.SHARD else spec.page_size
        self._regions = tuple(self._build_regions())

    # -- derived quantities -----------------------------------------------------------------

    def stage_layers(self, stage: int) -> range:
        """Model layers of pipeline ``stage`` of this mesh."""
        return stage_layers(self.spec.num_layers, self.shape[0], stage)

    def family_layers(self, family: Family, stage: int | None = None) -> tuple[int, ...]:
        """The family's layer ids on ``stage`` (default: this rank's stage); may be empty."""
        ids = self._family_ids(family)
        rng = self.layer_ids if stage is None else self.stage_layers(stage)
        return tuple(i for i in ids if i in rng)

    def _family_ids(self, family: Family) -> tuple[int, ...]:
        spec = self.spec
        if family is Family.KV:
            return spec.kv.layer_ids if spec.kv is not None else ()
        if family is Family.MAMBA:
            return spec.mamba.layer_ids if spec.mamba is not None else ()
        return spec.indexer.layer_ids if spec.indexer is not None else ()

    def _padded_layers(self, family: Family) -> int:
        return max(len(self.family_layers(family, s)) for s in range(self.shape[0]))

    @property
    def local_kv_heads(self) -> int:
        """KV heads on this rank (1 when kv_heads < tp; all of them for MLA)."""
        kv = self.spec.kv
        assert kv is not None
        tp = self.shape[2]
        if kv.mla:
            return kv.num_kv_heads
        return max(kv.num_kv_heads // tp, 1)

    @property
    def local_ssm_heads(self) -> int:
        assert self.spec.mamba is not None
        return self.spec.mamba.num_heads // self.shape[2]

    @property
    def local_conv_dim(self) -> int:
        assert self.spec.mamba is not None
        return mamba_local_conv_dim(self.spec.mamba, self.shape[2])

    @property
    def regions(self) -> tuple[RegionLayout, ...]:
        """Present regions in a fixed order: kv, indexer, mamba_conv, mamba_ssm."""
        return self._regions

    def region(self, name: RegionName | str) -> RegionLayout:
        """The region called ``name``; ``ValueError`` if the spec has no such family."""
        key = RegionName(name)
        for r in self._regions:
            if r.name is key:
                return r
        present = [r.name.value for r in self._regions]
        raise ValueError(f"region {key.value!r} not in this spec; present: {present}")

    def has_region(self, name: RegionName | str) -> bool:
        return any(r.name is RegionName(name) for r in self._regions)

    def held_regions(self, paged: bool | None = None) -> tuple[RegionLayout, ...]:
        """Regions of which this rank's stage holds at least one layer, in region order.

        ``paged=True``: only page-indexed ones (kv, indexer); ``False``: only the Mamba slot
        ones; ``None``: all. These are the regions a rank copies, stores and reads.
        """
        return tuple(
            r for r in self._regions if r.local_layer_ids and (paged is None or r.paged == paged)
        )

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every held paged region (one device <-> host page copy)."""
        return sum(r.row_bytes for r in self.held_regions(paged=True))

    @property
    def slot_bytes(self) -> int:
        """Bytes of one Mamba state slot over every held slot region (0 without Mamba)."""
        return sum(r.row_bytes for r in self.held_regions(paged=False))

    # -- construction -----------------------------------------------------------------------

    def _token_split(self) -> tuple[bool, tuple[int, int]]:
        """(whether cp shards the T dim, this rank's token range) for paged regions."""
        _, cp, _ = self.shape
        c = self.coords[1]
        ps = self.spec.page_size
        if self.cp_kv is CpKvMode.SHARD:
            n = ps // cp
            return True, (c * n, (c + 1) * n)
        return False, (0, ps)

    def _layer_range(self, ids: tuple[int, ...]) -> tuple[int, int]:
        if not ids:
            return (self.layer_ids.start, self.layer_ids.start)
        return (ids[0], ids[-1] + 1)

    def _build_regions(self) -> list[RegionLayout]:
        pp, cp, tp = self.shape
        _, c, t = self.coords
        out: list[RegionLayout] = []
        cp_sharded, tokens = self._token_split()
        first_cp = c == 0 or cp_sharded
        spec = self.spec
        if spec.kv is not None:
            kv = spec.kv
            ids = self.family_layers(Family.KV)
            rows = self._padded_layers(Family.KV)
            h_local = self.local_kv_heads
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
            out.append(
                RegionLayout(
                    name=RegionName.KV,
                    family=Family.KV,
                    dtype=kv.dtype,
                    placements=(Shard(1), _cp_placement(cp_sharded, 3), tp_place),
                    local_shape=(rows, 2, self.page_size_local, h_local, kv.head_dim),
                    global_shape=(rows * pp, 2, spec.page_size, h_global, kv.head_dim),
                    global_slice=GlobalSlice(self._layer_range(ids), heads, tokens),
                    is_writer=bool(ids) and first_cp and first_tp,
                    local_layer_ids=ids,
                )
            )
        if spec.indexer is not None:
            ids = self.family_layers(Family.INDEXER)
            rows = self._padded_layers(Family.INDEXER)
            e = spec.indexer.key_dim
            out.append(
                RegionLayout(
                    name=RegionName.INDEXER,
                    family=Family.INDEXER,
                    dtype=spec.indexer.dtype,
                    placements=(Shard(1), _cp_placement(cp_sharded, 2), Replicate()),
                    local_shape=(rows, self.page_size_local, e),
                    global_shape=(rows * pp, spec.page_size, e),
                    global_slice=GlobalSlice(self._layer_range(ids), (0, 1), tokens),
                    is_writer=bool(ids) and first_cp and t == 0,
                    local_layer_ids=ids,
                )
            )
        if spec.mamba is not None:
            m = spec.mamba
            ids = self.family_layers(Family.MAMBA)
            rows = self._padded_layers(Family.MAMBA)
            h = self.local_ssm_heads
            sl = GlobalSlice(self._layer_range(ids), (t * h, (t + 1) * h), (0, 1))
            writer = bool(ids) and c == 0
            k = m.conv_kernel - 1
            out.append(
                RegionLayout(
                    name=RegionName.MAMBA_CONV,
                    family=Family.MAMBA,
                    dtype=m.conv_dtype,
                    placements=(Shard(1), Replicate(), Shard(2)),
                    local_shape=(rows, self.local_conv_dim, k),
                    # Groups replicated over tp are duplicated in the global view.
                    global_shape=(rows * pp, self.local_conv_dim * tp, k),
                    global_slice=sl,
                    is_writer=writer,
                    local_layer_ids=ids,
                )
            )
            out.append(
                RegionLayout(
                    name=RegionName.MAMBA_SSM,
                    family=Family.MAMBA,
                    dtype=m.ssm_dtype,
                    placements=(Shard(1), Replicate(), Shard(2)),
                    local_shape=(rows, h, m.head_dim, m.state_dim),
                    global_shape=(rows * pp, m.num_heads, m.head_dim, m.state_dim),
                    global_slice=sl,
                    is_writer=writer,
                    local_layer_ids=ids,
                )
            )
        return out

    def __repr__(self) -> str:
        return (
            f"StateLayout(shape={self.shape}, coords={self.coords}, cp_kv={self.cp_kv.value!r}, "
            f"layers={self.layer_ids.start}..{self.layer_ids.stop})"
        )


def _cp_placement(sharded: bool, token_dim: int) -> Placement:
    return Shard(token_dim) if sharded else Replicate()


def all_layouts(
    spec: StateSpec, shape: Sequence[int], cp_kv: CpKvMode | str = CpKvMode.REPLICATE
) -> list[StateLayout]:
    """The layout of every rank of a mesh of ``shape`` (pp, cp, tp), in rank order.

    Single process, no process group: for tests and for planning reads across meshes.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [StateLayout.for_coords(spec, shape, c, cp_kv) for c in all_coordinates(shape)]


# -- tp / cp shard math shared by the cache, the model and the engine ------------------------


def tp_split(total: int, tp: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous ``[start, stop)`` of ``total`` items split evenly over tp."""
    if total % tp:
        raise ValueError(f"{total} items cannot be split evenly over tp={tp}")
    n = total // tp
    return (rank * n, (rank + 1) * n)


def kv_head_range(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """KV heads a tp rank holds: its share, or (kv_heads < tp) the one its query heads read."""
    if num_kv_heads >= tp:
        return tp_split(num_kv_heads, tp, rank)
    q0 = tp_split(num_heads, tp, rank)[0]
    k0 = q0 // (num_heads // num_kv_heads)
    return (k0, k0 + 1)


def ssm_group_range(num_groups: int, tp: int, rank: int) -> tuple[int, int]:
    """B/C groups a tp rank holds: its share (groups >= tp) or the one group of its heads."""
    if num_groups >= tp:
        return tp_split(num_groups, tp, rank)
    g = rank // (tp // num_groups)
    return (g, g + 1)


def mamba_local_conv_dim(mamba: MambaSpec, tp: int) -> int:
    """Conv channels on one tp rank (a replicated group's B and C count on every rank)."""
    if mamba.num_groups and mamba.num_groups < tp:
        return mamba.num_heads // tp * mamba.head_dim + 2 * mamba.state_dim
    return mamba.conv_dim // tp


def kv_shard_owner(positions: torch.Tensor, page_size: int, cp: int) -> torch.Tensor:
    """The cp rank that keeps each position under ``cp_kv="shard"``.

    Rank c keeps the tokens whose position-in-page lies in ``[c*ps/cp, (c+1)*ps/cp)``.
    """
    assert page_size % cp == 0
    return (positions % page_size) // (page_size // cp)


def kv_page_tokens(page_size: int, cp: int, cp_rank: int, cp_kv: CpKvMode | str) -> tuple[int, int]:
    """The token-in-page range ``[start, stop)`` a cp rank keeps of every KV page."""
    if CpKvMode.parse(cp_kv, "cp_kv") is CpKvMode.SHARD:
        n = page_size // cp
        return (cp_rank * n, (cp_rank + 1) * n)
    return (0, page_size)


def kv_shard_positions(num_tokens: int, page_size: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Positions in ``[0, num_tokens)`` kept by ``cp_rank`` under ``cp_kv="shard"``, ascending."""
    positions = torch.arange(num_tokens)
    return positions[kv_shard_owner(positions, page_size, cp) == cp_rank]
