"""Where each copy of an operation goes: per-(layer, part) segments and bulk row addresses.

A *segment* is one part of one layer: ``k`` or ``v`` of a full-attention layer, or
``indexer`` (indexed by pages), ``k`` or ``v`` of a sliding-window layer (indexed by window
pages: device page ids, host window ids of the ``kv_window`` region), or ``conv`` or
``ssm`` (indexed by Mamba slots); :class:`IndexKind` says which of an operation's three
index pairs addresses it. Each segment is a pair of tensors whose rows (dim 0) are
contiguous and of equal size: the device pool's ``[N, *row]`` tensor of that layer and
part, and the matching strided view of the page-first host pool (row ``p`` at
``host_ptr + p * host_stride``). Pointers, strides and row sizes are read once, when the
engine is built; the pools never move.

Per operation, row addresses of every segment are computed in bulk with numpy
(``base + index * stride``, one broadcast per group of segments), never per row in Python.
Runs of pairs consecutive on both sides are merged into one copy where both sides of the
segment are contiguous across rows (device pools always are; host regions only when a
row holds a single layer part, e.g. a one-layer Mamba or indexer region).
"""

from __future__ import annotations

import ctypes
import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from mesh_hicache.layout import RegionName
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools
from mesh_hicache.spec import Family

IndexArray = np.ndarray  # 1-D int64
#: An operation's ``(device indices, host indices)`` of every :class:`IndexKind`, in
#: kind order: pages, slots, windows.
KindPairs = Sequence[tuple[IndexArray, IndexArray]]


class IndexKind(enum.IntEnum):
    """Which index pair of an operation addresses a segment's rows (its value is the
    native copy loop's kind column and the position in :data:`KindPairs`)."""

    PAGES = 0
    """``kv_pages``: ``kv`` and ``indexer``."""
    SLOTS = 1
    """``mamba_slots``: ``mamba_conv`` and ``mamba_ssm``."""
    WINDOWS = 2
    """``window_pages``: ``kv_window`` (device page ids, host window ids)."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One (layer, part) of this rank's state, on both sides (see module doc)."""

    layer_pos: int
    """Position of the layer in the engine's ``layer_ids`` (copy order)."""
    part: str
    kind: IndexKind
    """The index pair that addresses its rows."""
    device: torch.Tensor
    host: torch.Tensor
    device_ptr: int
    device_stride: int
    host_ptr: int
    host_stride: int
    row_bytes: int
    device_buffer: tuple[int, int]
    """(address, bytes) of the whole allocation the device rows live in."""
    host_buffer: tuple[int, int]

    @property
    def mergeable(self) -> bool:
        """Consecutive rows are one contiguous block on both sides."""
        return self.device_stride == self.row_bytes == self.host_stride


def _rows_contiguous(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _segment(
    pos: int, part: str, kind: IndexKind, dev: torch.Tensor, host: torch.Tensor
) -> Segment:
    assert dev.dtype == host.dtype and dev.shape[1:] == host.shape[1:], part
    assert _rows_contiguous(dev) and _rows_contiguous(host), f"{part} rows must be contiguous"
    es = dev.element_size()
    return Segment(
        layer_pos=pos,
        part=part,
        kind=kind,
        device=dev,
        host=host,
        device_ptr=dev.data_ptr(),
        device_stride=dev.stride(0) * es,
        host_ptr=host.data_ptr(),
        host_stride=host.stride(0) * es,
        row_bytes=int(np.prod(dev.shape[1:], dtype=np.int64)) * es,
        device_buffer=(dev.untyped_storage().data_ptr(), dev.untyped_storage().nbytes()),
        host_buffer=(host.untyped_storage().data_ptr(), host.untyped_storage().nbytes()),
    )


def build_segments(
    device_pools: DevicePools, host_pools: HostPools, layer_ids: tuple[int, ...]
) -> tuple[Segment, ...]:
    """Every segment of ``layer_ids`` in copy order (layer, then k, v, indexer, conv, ssm:
    the parts of the layer's families)."""
    dev, host, spec = device_pools, host_pools, device_pools.layout.spec
    indexer_layers = set(dev.layers(Family.INDEXER))
    out: list[Segment] = []
    for pos, layer in enumerate(layer_ids):
        # A layer in both families (a parallel layer) has its paged parts, then its slot
        # parts: each family's segments come from its own region.
        families = spec.layer_families(layer)
        if Family.KV in families:
            # Full-attention and sliding-window layers live in their own regions; the
            # windowed ones' host rows are window ids.
            name, kind = RegionName.KV, IndexKind.PAGES
            if spec.layer_window(layer):
                name, kind = RegionName.KV_WINDOW, IndexKind.WINDOWS
            kv = host.local(name)[:, host.region(name).layer_row(layer)]
            out.append(_segment(pos, "k", kind, dev.k(layer), kv[:, 0]))
            if spec.kv is not None and spec.kv.values:  # keys-only (MLA latent): no V
                out.append(_segment(pos, "v", kind, dev.v(layer), kv[:, 1]))
            if layer in indexer_layers:
                row = host.region(RegionName.INDEXER).layer_row(layer)
                idx = host.local(RegionName.INDEXER)[:, row]
                out.append(_segment(pos, "indexer", IndexKind.PAGES, dev.indexer(layer), idx))
        if Family.MAMBA in families:
            row = host.region(RegionName.MAMBA_CONV).layer_row(layer)
            conv = host.local(RegionName.MAMBA_CONV)[:, row]
            out.append(_segment(pos, "conv", IndexKind.SLOTS, dev.conv(layer), conv))
            if host.layout.has_region(RegionName.MAMBA_SSM):  # else a conv state only
                row = host.region(RegionName.MAMBA_SSM).layer_row(layer)
                ssm = host.local(RegionName.MAMBA_SSM)[:, row]
                out.append(_segment(pos, "ssm", IndexKind.SLOTS, dev.ssm(layer), ssm))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Runs:
    """Maximal stretches of index pairs consecutive on both sides, in order."""

    src: IndexArray
    dst: IndexArray
    length: IndexArray


def index_runs(src: IndexArray, dst: IndexArray) -> Runs:
    """The runs of ``(src[i], dst[i])``: a run continues while both sides step by +1."""
    assert src.shape == dst.shape and src.ndim == 1
    n = src.shape[0]
    if n == 0:
        return Runs(src[:0], dst[:0], src[:0])
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), breaks))
    length = np.diff(np.concatenate((starts, np.array([n], dtype=np.int64))))
    return Runs(src[starts], dst[starts], length)


class MemRows(NamedTuple):
    """An operation's copies as raw addresses, layer-major: copy ``i`` moves ``size[i]``
    bytes from ``src[i]`` to ``dst[i]``; layer position ``p`` owns copies
    ``[bounds[p], bounds[p + 1])``. ``block`` is one C-contiguous ``[3, copies]`` int64
    array whose rows are ``dst``, ``src`` and ``size`` (one pointer for a native loop)."""

    dst: np.ndarray
    src: np.ndarray
    size: np.ndarray
    bounds: list[int]
    block: np.ndarray


def _mem_rows(block: np.ndarray, bounds: list[int]) -> MemRows:
    return MemRows(block[0], block[1], block[2], bounds, block)


_NO_ROWS = np.zeros((3, 0), dtype=np.int64)


@dataclass(frozen=True, slots=True)
class _Group:
    """Segments of one index kind and mergeability: their columns, shaped ``[G, 1]``."""

    kind: IndexKind
    merge: bool
    in_block: bool
    ids: np.ndarray
    dev_ptr: np.ndarray
    dev_stride: np.ndarray
    host_ptr: np.ndarray
    host_stride: np.ndarray
    row_bytes: np.ndarray


class SegmentTable:
    """The segments of an engine with their pointers as arrays, for bulk address math."""

    def __init__(self, segments: tuple[Segment, ...], num_layers: int) -> None:
        self.segments = segments
        self.num_layers = num_layers
        #: Segment positions per layer position, in copy order.
        self.by_layer: tuple[tuple[int, ...], ...] = tuple(
            tuple(i for i, s in enumerate(segments) if s.layer_pos == pos)
            for pos in range(num_layers)
        )
        # First segment of each layer position (segments are layer-major), then the end.
        sizes = [len(ids) for ids in self.by_layer]
        self._layer_start = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        #: Segments ``[layer_bounds[p], layer_bounds[p + 1])`` belong to layer position ``p``.
        self.layer_bounds: list[int] = self._layer_start.tolist()
        #: One row per segment, for the native copy loop (mesh_hicache/native.py): device
        #: address, device stride, host address, host stride, row bytes, index kind.
        self.native_table = np.array(
            [
                (s.device_ptr, s.device_stride, s.host_ptr, s.host_stride, s.row_bytes, s.kind)
                for s in segments
            ],
            dtype=np.int64,
        ).reshape(len(segments), 6)
        #: Bytes of one index pair of each kind over every segment (one direction).
        self.kind_bytes: tuple[int, ...] = tuple(
            sum(s.row_bytes for s in segments if s.kind is kind) for kind in IndexKind
        )
        self._blocks = _small_row_blocks(segments)
        small = {int(i) for b in self._blocks for i in b.ids}
        #: Whether some segment's rows are not covered by :meth:`small_row_copies`.
        self.has_large_rows = len(small) < len(segments)
        # Segments grouped by (index kind, mergeable, in a small-row block); ids ascending
        # = layer-major.
        self._groups: list[_Group] = []
        for kind, merge, in_block in itertools.product(IndexKind, (True, False), (True, False)):
            ids = [
                i
                for i, s in enumerate(segments)
                if s.kind is kind and s.mergeable is merge and (i in small) is in_block
            ]
            if not ids:
                continue

            def col(name: str, ids: list[int] = ids) -> np.ndarray:
                return np.array([[getattr(segments[i], name)] for i in ids], dtype=np.int64)

            self._groups.append(
                _Group(
                    kind,
                    merge,
                    in_block,
                    np.array(ids, dtype=np.int64),
                    col("device_ptr"),
                    col("device_stride"),
                    col("host_ptr"),
                    col("host_stride"),
                    col("row_bytes"),
                )
            )

    def op_bytes(self, pairs: KindPairs) -> int:
        """Bytes an operation with these index pairs (pages, slots, windows) moves (one
        direction)."""
        (pages, _), (slots, _), (windows, _) = pairs
        page, slot, window = self.kind_bytes
        return pages.shape[0] * page + slots.shape[0] * slot + windows.shape[0] * window

    def mem_rows(self, backup: bool, pairs: KindPairs, skip_small: bool = False) -> MemRows:
        """Every copy of an operation as raw addresses (valid for CPU memory only).

        ``pairs`` holds the ``(device indices, host indices)`` of each :class:`IndexKind`
        (pages, slots, windows); ``backup`` copies device -> host, else host -> device. A
        few numpy calls per group of segments, whatever the number of rows or layers.
        ``skip_small`` leaves out the segments that :meth:`small_row_copies` covers.
        """
        counts = np.zeros(len(self.segments) + 1, dtype=np.int64)  # [0] stays 0
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for g in self._groups:
            dev_idx, host_idx = pairs[g.kind]
            if dev_idx.shape[0] == 0 or (skip_small and g.in_block):
                continue
            if g.merge:
                runs = index_runs(dev_idx, host_idx)
                dev_idx, host_idx = runs.src, runs.dst
                size = (g.row_bytes * runs.length).ravel()
            else:
                size = np.repeat(g.row_bytes, dev_idx.shape[0])
            dev = g.dev_ptr + dev_idx * g.dev_stride  # [G, rows]: one row per segment
            host = g.host_ptr + host_idx * g.host_stride
            src, dst = (dev, host) if backup else (host, dev)
            counts[g.ids + 1] = dev_idx.shape[0]
            parts.append((g.ids, dst.ravel(), src.ravel(), size))
        bounds = np.cumsum(counts)[self._layer_start].tolist()
        if not parts:
            return _mem_rows(_NO_ROWS, bounds)
        if len(parts) == 1:  # one group: its rows are already layer-major
            _, dst, src, size = parts[0]
            return _mem_rows(np.concatenate((dst, src, size)).reshape(3, -1), bounds)
        # Several groups: order every row by its segment (= layer-major order).
        seg = np.concatenate([np.repeat(ids, d.shape[0] // ids.shape[0]) for ids, d, _, _ in parts])
        order = np.argsort(seg, kind="stable")
        rows = [np.concatenate([p[k] for p in parts])[order] for k in (1, 2, 3)]
        return _mem_rows(np.concatenate(rows).reshape(3, -1), bounds)

    def small_row_copies(
        self, backup: bool, pairs: KindPairs
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """The rows of small-row segments as ``(dst, dst_rows, src, src_rows)``: one numpy
        fancy copy ``dst[dst_rows] = src[src_rows]`` per block of segments (CPU memory);
        ``pairs`` as for :meth:`mem_rows`."""
        out = []
        for b in self._blocks:
            dev_idx, host_idx = pairs[b.kind]
            if dev_idx.shape[0] == 0:
                continue
            dev = (b.dev_row0 + dev_idx * b.dev_step).ravel()
            host = (b.host_row0 + host_idx * b.host_step).ravel()
            out.append((b.host, host, b.dev, dev) if backup else (b.dev, dev, b.host, host))
        return out


#: Rows up to this size are copied by numpy fancy indexing in one call per block (a
#: backup, where nothing is published layer by layer): below it, one ``memmove`` call
#: costs more than the bytes it moves.
SMALL_ROW_BYTES = 4096


@dataclass(frozen=True, slots=True)
class _Block:
    """Small-row segments whose rows are elements of one array on each side: row ``i``
    of segment ``j`` is ``dev[dev_row0[j] + i * dev_step[j]]`` (likewise for the host)."""

    kind: IndexKind
    ids: np.ndarray
    dev: np.ndarray
    host: np.ndarray
    dev_row0: np.ndarray
    dev_step: np.ndarray
    host_row0: np.ndarray
    host_step: np.ndarray


def _rows_of(buffer: tuple[int, int], row: int) -> np.ndarray:
    """The allocation at ``buffer`` as a 1-D array of ``row``-byte elements (a view)."""
    address, nbytes = buffer
    raw = (ctypes.c_char * nbytes).from_address(address)
    return np.frombuffer(memoryview(raw), dtype=np.dtype((np.void, row)), count=nbytes // row)


def _small_row_blocks(segments: tuple[Segment, ...]) -> list[_Block]:
    keys: dict[tuple[IndexKind, tuple[int, int], tuple[int, int], int], list[int]] = {}
    for i, s in enumerate(segments):
        r = s.row_bytes
        if not 0 < r <= SMALL_ROW_BYTES or s.device.device.type != "cpu":
            continue
        if not (s.device_buffer[1] and s.host_buffer[1]):
            continue  # an empty pool: no rows to copy
        offsets = (s.device_ptr - s.device_buffer[0], s.host_ptr - s.host_buffer[0])
        if any(x % r for x in (*offsets, s.device_stride, s.host_stride)):
            continue
        keys.setdefault((s.kind, s.device_buffer, s.host_buffer, r), []).append(i)
    return [
        _block(kind, [segments[i] for i in ids], ids, dev_buf, host_buf, row)
        for (kind, dev_buf, host_buf, row), ids in keys.items()
    ]


def _block(
    kind: IndexKind,
    members: list[Segment],
    ids: list[int],
    dev_buf: tuple[int, int],
    host_buf: tuple[int, int],
    row: int,
) -> _Block:
    def col(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)[:, None]

    return _Block(
        kind,
        np.array(ids, dtype=np.int64),
        _rows_of(dev_buf, row),
        _rows_of(host_buf, row),
        col([(s.device_ptr - dev_buf[0]) // row for s in members]),
        col([s.device_stride // row for s in members]),
        col([(s.host_ptr - host_buf[0]) // row for s in members]),
        col([s.host_stride // row for s in members]),
    )
