"""Placements -> local shard shape, global slice, writer election (docs/DESIGN.md section 4).

:class:`StateLayout` is one rank's view of every host-pool region (:mod:`mesh_hicache.regions`
builds each region's placements and shapes; :mod:`mesh_hicache.shards` holds the split
math). Derived rules:

- **PP** splits the model's layers into contiguous stages balanced by layer count
  (:func:`stage_layers`). A family's local layers are its ids inside the stage's range,
  possibly none. Stages may hold different numbers of a region's layers; the L dim of
  every rank's host pool is padded to the maximum over stages so that local shapes (and
  page/slot counts) are equal on every rank, as ``Shard`` over pp requires. Row ``i`` of
  the L dim holds ``local_layer_ids[i]``; rows past them are padding, never read.
- **Windowed KV**: with ``spec.windows`` the ``kv`` region holds the full-attention layers
  and a ``kv_window`` region (same placements) the sliding-window ones, each padded over
  stages by its own layer count.
- **kv_heads < tp**: each tp rank holds one head; ``tp / kv_heads`` consecutive tp ranks
  hold the same head. The DTensor's global H dim is then ``tp`` (heads duplicated) so that
  ``Shard`` over tp still works; :class:`GlobalSlice` reports the real head.
- **cp_kv="shard"**: cp rank ``c`` holds tokens ``[c*T/cp, (c+1)*T/cp)`` of every page.
- **Writer election**: a rank writes a region's shard to storage iff its coordinate is 0 on
  every axis where the region is replicated (for duplicated KV heads: it is the first of
  the tp ranks holding that head) and its stage holds at least one of the region's layers.
  Every distinct non-empty shard then has exactly one writer.

The moved names (regions, shard math) are re-exported here so importers keep one entry point.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from mesh_hicache.choices import CpKvMode, RegionName
from mesh_hicache.regions import (
    REGION_FAMILY,
    GlobalSlice,
    RankPosition,
    RegionLayers,
    RegionLayout,
    family_layer_ids,
    indexer_region,
    kv_region,
    local_kv_heads,
    mamba_regions,
    region_layer_ids,
)
from mesh_hicache.shards import (
    kv_head_range,
    kv_page_tokens,
    kv_shard_owner,
    kv_shard_positions,
    mamba_local_conv_dim,
    ssm_group_range,
    stage_layers,
    tp_split,
)
from mesh_hicache.spec import Family, StateSpec
from mesh_hicache.topology import MeshTopology, all_coordinates

__all__ = [
    "REGION_FAMILY",
    "GlobalSlice",
    "RegionLayout",
    "RegionName",
    "StateLayout",
    "all_layouts",
    "kv_head_range",
    "kv_page_tokens",
    "kv_shard_owner",
    "kv_shard_positions",
    "mamba_local_conv_dim",
    "ssm_group_range",
    "stage_layers",
    "tp_split",
]


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
        """The family's layer ids on ``stage`` (default: this rank's stage); may be empty.
        KV: full-attention and windowed layers together."""
        return self._on_stage(self._family_ids(family), stage)

    def _family_ids(self, family: Family) -> tuple[int, ...]:
        return family_layer_ids(self.spec, family)

    def region_layers(self, name: RegionName | str, stage: int | None = None) -> tuple[int, ...]:
        """The layer ids region ``name`` holds on ``stage`` (default: this rank's stage);
        may be empty (``kv``: the full-attention layers, ``kv_window``: the windowed ones)."""
        return self._on_stage(region_layer_ids(self.spec, RegionName(name)), stage)

    def _on_stage(self, ids: tuple[int, ...], stage: int | None) -> tuple[int, ...]:
        rng = self.layer_ids if stage is None else self.stage_layers(stage)
        return tuple(i for i in ids if i in rng)

    @property
    def local_kv_heads(self) -> int:
        """KV heads on this rank (1 when kv_heads < tp; all of them for MLA)."""
        assert self.spec.kv is not None
        return local_kv_heads(self.spec.kv, self.shape[2])

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
        """Present regions in a fixed order: kv, kv_window, indexer, mamba_conv, mamba_ssm."""
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

        ``paged=True``: only page-indexed ones (kv, kv_window, indexer); ``False``: only the
        Mamba slot ones; ``None``: all. These are the regions a rank copies, stores and reads.
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

    @property
    def window_bytes(self) -> int:
        """Bytes of one page of the sliding-window layers held here (its ``kv_window``
        row; 0 without them). Part of ``page_bytes`` on device; on host its own row."""
        return sum(
            r.row_bytes for r in self.held_regions(paged=True) if r.name is RegionName.KV_WINDOW
        )

    def copy_bytes(self, pages: int, slots: int, windows: int = 0) -> int:
        """Bytes a device <-> host copy moves: ``pages`` pages of the other paged regions,
        ``slots`` states and ``windows`` windowed pages (``kv_window`` rows)."""
        w = self.window_bytes
        return pages * (self.page_bytes - w) + slots * self.slot_bytes + windows * w

    # -- construction -----------------------------------------------------------------------

    def _position(self) -> RankPosition:
        """This rank's position as the region builders see it."""
        _, cp, _ = self.shape
        c = self.coords[1]
        ps = self.spec.page_size
        if self.cp_kv is CpKvMode.SHARD:
            n = ps // cp
            return RankPosition(self.shape, self.coords, True, (c * n, (c + 1) * n), n)
        return RankPosition(self.shape, self.coords, False, (0, ps), ps)

    def _layers(self, name: RegionName) -> RegionLayers:
        """Region ``name``'s layers here, its L dim padded to the most any stage holds."""
        ids = self.region_layers(name)
        rows = max(len(self.region_layers(name, s)) for s in range(self.shape[0]))
        start = self.layer_ids.start
        span = (ids[0], ids[-1] + 1) if ids else (start, start)
        return RegionLayers(ids, rows, span)

    def _build_regions(self) -> list[RegionLayout]:
        pos = self._position()
        spec = self.spec
        out: list[RegionLayout] = []
        if spec.kv is not None:
            out.append(kv_region(spec.kv, spec.page_size, pos, self._layers(RegionName.KV)))
            if spec.windows:
                window = self._layers(RegionName.KV_WINDOW)
                out.append(kv_region(spec.kv, spec.page_size, pos, window, RegionName.KV_WINDOW))
        if spec.indexer is not None:
            out.append(indexer_region(spec, pos, self._layers(RegionName.INDEXER)))
        if spec.mamba is not None:
            out.extend(mamba_regions(spec, pos, self._layers(RegionName.MAMBA_CONV)))
        return out

    def __repr__(self) -> str:
        return (
            f"StateLayout(shape={self.shape}, coords={self.coords}, cp_kv={self.cp_kv.value!r}, "
            f"layers={self.layer_ids.start}..{self.layer_ids.stop})"
        )


def all_layouts(
    spec: StateSpec, shape: Sequence[int], cp_kv: CpKvMode | str = CpKvMode.REPLICATE
) -> list[StateLayout]:
    """The layout of every rank of a mesh of ``shape`` (pp, cp, tp), in rank order.

    Single process, no process group: for tests and for planning reads across meshes.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [StateLayout.for_coords(spec, shape, c, cp_kv) for c in all_coordinates(shape)]
