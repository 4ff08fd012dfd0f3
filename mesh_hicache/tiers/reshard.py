"""Reshard on read: which stored objects of another mesh cover this rank's rows.

A stored object is one writer rank's local row of one region (docs/DESIGN.md section 4): its
bytes are the writer's ``local_shape``, and every dim of that row maps to a set of
*global* coordinates derived from the writer's placements (the layout's global slice),
never from rank numbers. Per dim, a :data:`DimMap` lists ``(global start, global stop,
local start)`` pieces in local order:

=============  ==============================================================
dim            global coordinate
=============  ==============================================================
L (layers)     index in the region's layer id list (padding rows map to none)
T (tokens)     token in page (cp_kv="shard" keeps a contiguous range)
H (heads)      KV head / SSM head (duplicated KV heads map to the same head)
C (conv)       channel of the tp=1 conv state, group-major: per group the x of
               its heads, then B, then C (head-major when ``num_groups == 0``)
others         the whole dim
=============  ==============================================================

:func:`plan_source` intersects the reader's maps with those of every elected writer of
a writer mesh and returns the reads (objects) and box copies that cover each reader
element exactly once. Objects that overlap (B/C conv channels of a group replicated over
the writer's tp ranks) are de-duplicated: a later writer keeps only what no earlier
writer with the same other dims holds. Each read also lists the byte ranges of the
object that its boxes touch (:func:`box_ranges`), so a backend with ranged reads fetches
(and verifies) only the chunks holding them (``storage/objects.py``). Pure functions, no I/O.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mesh_hicache.choices import CpKvMode, RegionName
from mesh_hicache.layout import GlobalSlice, RegionLayout, StateLayout, all_layouts, ssm_group_range
from mesh_hicache.regions import region_layer_ids
from mesh_hicache.spec import Family, MambaSpec
from mesh_hicache.storage.objects import chunk_bytes_for, chunk_spans

DimMap = tuple[tuple[int, int, int], ...]
"""Per dim of a row: ``(global start, global stop, local start)`` pieces in local order."""


class MeshLayoutId(NamedTuple):
    """A mesh shape and KV cp mode: what a writer's objects depend on besides the spec."""

    pp: int
    cp: int
    tp: int
    cp_kv: CpKvMode

    @classmethod
    def of(cls, layout: StateLayout) -> MeshLayoutId:
        """The id of ``layout``'s mesh (cp_kv is normalised to replicate when cp == 1)."""
        pp, cp, tp = layout.shape
        mode = layout.cp_kv if cp > 1 else CpKvMode.REPLICATE
        return cls(pp, cp, tp, mode)

    def describe(self) -> str:
        return f"pp{self.pp}xcp{self.cp}xtp{self.tp}/{self.cp_kv.value}"


class BoxCopy(NamedTuple):
    """``dst[dst_box] = src[src_box]``: one slice per row dim."""

    dst: tuple[slice, ...]
    src: tuple[slice, ...]


@dataclass(frozen=True, slots=True)
class ObjectRead:
    """One stored object to fetch and the boxes of it that this reader keeps."""

    slice: GlobalSlice
    """The writer's global slice (the key's slice tag)."""
    shape: tuple[int, ...]
    """The object's row shape (the writer's local_shape)."""
    copies: tuple[BoxCopy, ...]
    direct: bool
    """True when the object is exactly this reader's row (read into it, no copy)."""
    ranges: tuple[tuple[int, int], ...]
    """``(offset, length)`` byte ranges of the object's payload that ``copies`` read."""

    def whole(self, itemsize: int) -> bool:
        """True when the ranges are the whole object (read it with a plain get)."""
        return self.ranges == ((0, _numel(self.shape) * itemsize),)

    def bytes_read(self, itemsize: int) -> int:
        """Payload bytes a ranged read fetches: the writer's chunks holding ``ranges``."""
        nbytes = _numel(self.shape) * itemsize
        chunk = chunk_bytes_for(self.shape, itemsize)
        return sum(b - a for a, b in chunk_spans(self.ranges, nbytes, chunk))


@dataclass(frozen=True, slots=True)
class RegionPlan:
    """Every object of one region that a reader fetches for one page (or state slot)."""

    region: RegionName
    reads: tuple[ObjectRead, ...]
    dtype: torch.dtype

    def bytes_read(self) -> int:
        """Payload bytes fetched for one page/slot with ranged reads (chunk-rounded)."""
        return sum(r.bytes_read(self.dtype.itemsize) for r in self.reads)

    def bytes_read_whole(self) -> int:
        """Payload bytes fetched for one page/slot when objects are read whole."""
        return sum(_numel(r.shape) for r in self.reads) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class SourcePlan:
    """How a reader assembles its rows from the objects of one writer mesh."""

    writer: MeshLayoutId
    regions: tuple[RegionPlan, ...]
    """One per region the reader holds, in the reader's region order."""
    same_keys: bool
    """True when every read is direct under the reader's own slices (nothing to reshard)."""

    def region(self, name: RegionName) -> RegionPlan:
        for r in self.regions:
            if r.region is name:
                return r
        raise ValueError(f"no plan for region {name.value}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def conv_channel_ranges(
    mamba: MambaSpec, heads: tuple[int, int], groups: tuple[int, int]
) -> list[tuple[int, int]]:
    """Global conv channels held by a rank with SSM ``heads`` and B/C ``groups``, in the
    local (group-major) order the model and the host pool use."""
    h0, h1 = heads
    if not mamba.num_groups:
        per = mamba.conv_dim // mamba.num_heads
        return [(h0 * per, h1 * per)]
    p, n = mamba.head_dim, mamba.state_dim
    per_group = mamba.num_heads // mamba.num_groups
    width = per_group * p + 2 * n
    out: list[tuple[int, int]] = []
    for g in range(*groups):
        a, b = max(g * per_group, h0), min((g + 1) * per_group, h1)
        base = g * width
        out.append((base + (a - g * per_group) * p, base + (b - g * per_group) * p))
        out.append((base + per_group * p, base + per_group * p + 2 * n))  # B then C
    return out


def _as_map(ranges: list[tuple[int, int]]) -> DimMap:
    out: list[tuple[int, int, int]] = []
    off = 0
    for g0, g1 in ranges:
        if out and out[-1][1] == g0:  # contiguous in both spaces: one piece
            a, _, o = out[-1]
            out[-1] = (a, g1, o)
        else:
            out.append((g0, g1, off))
        off += g1 - g0
    return tuple(out)


def row_maps(layout: StateLayout, region: RegionLayout) -> tuple[DimMap, ...]:
    """The global coordinates of every dim of ``region``'s local row on ``layout``'s rank.

    Empty when the rank's stage holds none of the region's layers."""
    if not region.local_layer_ids:
        return ()
    spec = layout.spec
    ids = region_layer_ids(spec, region.name)
    first = ids.index(region.local_layer_ids[0])
    layers = _as_map([(first, first + len(region.local_layer_ids))])
    sl = region.global_slice
    shape = region.local_shape

    def whole(d: int) -> DimMap:
        return ((0, shape[d], 0),)

    if region.family is Family.KV:  # kv and kv_window
        return (layers, whole(1), _as_map([sl.tokens]), _as_map([sl.heads]), whole(4))
    if region.name is RegionName.INDEXER:
        return (layers, _as_map([sl.tokens]), whole(2))
    mamba = spec.mamba
    assert mamba is not None
    if region.name is RegionName.MAMBA_SSM:
        return (layers, _as_map([sl.heads]), whole(2), whole(3))
    tp, t = layout.shape[2], layout.coords[2]
    groups = ssm_group_range(mamba.num_groups, tp, t) if mamba.num_groups else (0, 0)
    conv = _as_map(conv_channel_ranges(mamba, sl.heads, groups))
    assert sum(b - a for a, b, _ in conv) == shape[1], (conv, shape)
    return (layers, conv, whole(2))


def box_ranges(
    shape: tuple[int, ...], boxes: tuple[tuple[slice, ...], ...], itemsize: int
) -> tuple[tuple[int, int], ...]:
    """The ``(offset, length)`` byte ranges of a C-contiguous ``shape`` tensor that the
    ``boxes`` (one slice per dim each) cover, sorted and merged where they touch."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    runs: list[tuple[int, int]] = []
    for box in boxes:
        k = len(shape) - 1  # the innermost dim the box does not cover whole
        while k > 0 and box[k].start == 0 and box[k].stop == shape[k]:
            k -= 1
        length = (box[k].stop - box[k].start) * strides[k] * itemsize
        for idx in itertools.product(*(range(box[d].start, box[d].stop) for d in range(k))):
            off = sum(i * strides[d] for d, i in enumerate(idx)) + box[k].start * strides[k]
            runs.append((off * itemsize, length))
    runs.sort()
    merged: list[tuple[int, int]] = []
    for off, length in runs:
        if merged and merged[-1][0] + merged[-1][1] >= off:
            a, n = merged[-1]
            merged[-1] = (a, max(n, off + length - a))
        else:
            merged.append((off, length))
    return tuple(merged)


def _subtract(m: DimMap, other: DimMap) -> DimMap:
    """``m`` without the global coordinates ``other`` covers (local offsets kept)."""
    pieces = list(m)
    for b0, b1, _ in other:
        nxt: list[tuple[int, int, int]] = []
        for a0, a1, off in pieces:
            if b1 <= a0 or a1 <= b0:
                nxt.append((a0, a1, off))
                continue
            if a0 < b0:
                nxt.append((a0, b0, off))
            if b1 < a1:
                nxt.append((b1, a1, off + b1 - a0))
        pieces = nxt
    return tuple(pieces)


def _overlaps(dst: DimMap, src: DimMap) -> list[tuple[slice, slice]]:
    out: list[tuple[slice, slice]] = []
    for a0, a1, da in dst:
        for b0, b1, sb in src:
            lo, hi = max(a0, b0), min(a1, b1)
            if lo < hi:
                d, s = da + lo - a0, sb + lo - b0
                out.append((slice(d, d + hi - lo), slice(s, s + hi - lo)))
    return out


def _intersects(a: tuple[DimMap, ...], b: tuple[DimMap, ...]) -> bool:
    return all(_overlaps(x, y) for x, y in zip(a, b, strict=True))


def _dedup(writers: list[tuple[RegionLayout, tuple[DimMap, ...]]]) -> list[tuple[DimMap, ...]]:
    """Owned maps per writer: each global element to the first writer holding it."""
    owned: list[tuple[DimMap, ...]] = []
    for _, maps in writers:
        mine = maps
        for prev in owned:
            if not _intersects(mine, prev):
                continue
            differ = [d for d, (x, y) in enumerate(zip(mine, prev, strict=True)) if x != y]
            # Within one mesh, elected writers overlap only in duplicated conv channels.
            assert len(differ) == 1, (mine, prev)
            d = differ[0]
            mine = (*mine[:d], _subtract(mine[d], prev[d]), *mine[d + 1 :])
        owned.append(mine)
    return owned


def plan_region(
    reader: StateLayout, region: RegionLayout, writers: list[StateLayout]
) -> RegionPlan | None:
    """The reads covering ``region`` of ``reader`` from the ranks ``writers`` of one mesh.

    None when the writers do not cover every element (cannot happen for a valid mesh)."""
    dst_maps = row_maps(reader, region)
    held = [
        (w.region(region.name), row_maps(w, w.region(region.name)))
        for w in writers
        if w.region(region.name).is_writer
    ]
    held = [(r, m) for r, m in held if m]
    # The reader's own object first: duplicated channels are then read from it.
    held.sort(key=lambda rm: rm[0].global_slice != region.global_slice)
    reads: list[ObjectRead] = []
    covered = 0
    for (w_region, _), owned in zip(held, _dedup(held), strict=True):
        per_dim = [_overlaps(d, s) for d, s in zip(dst_maps, owned, strict=True)]
        if not all(per_dim):
            continue
        copies = tuple(
            BoxCopy(tuple(p[0] for p in combo), tuple(p[1] for p in combo))
            for combo in itertools.product(*per_dim)
        )
        covered += sum(_numel(tuple(s.stop - s.start for s in c.dst)) for c in copies)
        direct = (
            w_region.local_shape == region.local_shape
            and w_region.global_slice == region.global_slice
            and owned == dst_maps
        )
        shape = w_region.local_shape
        ranges = box_ranges(shape, tuple(c.src for c in copies), region.dtype.itemsize)
        reads.append(ObjectRead(w_region.global_slice, shape, copies, direct, ranges))
    want = _numel(tuple(sum(b - a for a, b, _ in m) for m in dst_maps))
    if covered != want:
        return None
    return RegionPlan(region.name, tuple(reads), region.dtype)


def plan_source(reader: StateLayout, writer: MeshLayoutId) -> SourcePlan | None:
    """How ``reader`` assembles every region it holds from ``writer``'s objects.

    None when ``writer`` is not a valid mesh for the spec (e.g. tp does not split its
    heads) or does not hold one of the reader's regions."""
    spec = reader.spec
    try:
        writers = all_layouts(spec, (writer.pp, writer.cp, writer.tp), writer.cp_kv)
    except ValueError:
        return None
    plans: list[RegionPlan] = []
    for region in reader.held_regions():
        if not writers[0].has_region(region.name):
            return None
        plan = plan_region(reader, region, writers)
        if plan is None:
            return None
        plans.append(plan)
    same = all(
        len(p.reads) == 1 and p.reads[0].direct and p.reads[0].slice == r.global_slice
        for p, r in zip(plans, reader.held_regions(), strict=True)
    )
    return SourcePlan(writer, tuple(plans), same)


def assemble(read: ObjectRead, obj: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the boxes of ``read`` from the fetched object ``obj`` (its row shape) into
    the reader's row ``dst`` (mutated)."""
    src = obj.view(read.shape)
    for c in read.copies:
        dst[c.dst].copy_(src[c.src])
