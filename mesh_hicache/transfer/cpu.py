"""CPU transfer engine: a worker thread (or a waiting caller) doing the copies in order.

Rows (a whole page of one layer part, e.g. 128 KiB for 64 tokens x 8 heads x 128 dims in
bf16; never a token) are contiguous in both pools. With the native loop
(``mesh_hicache/native.py``, built on first use) an operation is ONE C call per layer (or
one for a whole backup or small load), GIL released: it reads each segment's pointers and
strides from the table built at construction (``SegmentTable.native_table``) and the
operation's index arrays, and ``memcpy``s every row; nothing per row runs in Python or
numpy. Without it, row addresses come in bulk from
:class:`~mesh_hicache.transfer.segments.SegmentTable` (numpy, runs merged) and each row or
run is one ``ctypes.memmove`` inside ``map`` (or one native call over the address arrays):

- a load goes layer by layer, one call per layer, each layer published as soon as it is
  in place;
- a backup (nothing waits for it layer by layer) and a load of at most
  ``SINGLE_PASS_BYTES`` go in one pass and publish every layer at once; there, rows of at
  most ``SMALL_ROW_BYTES`` (4 KiB) go by one numpy fancy copy per pool buffer instead.

Measured on this project's 2-core CPU box (one thread, 64 rows of 32 KiB / 128 KiB):
``memmove`` per row 0.76x / 0.95x of one contiguous ``memmove`` of the same bytes, numpy
fancy indexing 0.54x / 0.41x and ``index_select`` + ``index_copy_`` on flattened
``int64`` views 0.38x / 0.13x (both gather into a temporary first, so every byte moves
twice). Same semantics as the CUDA engine.
"""

from __future__ import annotations

import collections
import ctypes
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from mesh_hicache import native
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools
from mesh_hicache.transfer.engine import TransferEngine, _Op
from mesh_hicache.transfer.segments import IndexKind, MemRows

#: A load of at most this many bytes is copied in one pass and published at once: it
#: takes less time (~25 us at memory bandwidth) than publishing it layer by layer costs.
SINGLE_PASS_BYTES = 256 << 10
#: The worker wakes at most this long after a submission (waker.py): a caller that waits
#: sooner copies itself. Past the 4 ms kernel tick, arming the timer costs ~3.5 us.
WAKE_GRACE = 5e-3


class CpuTransferEngine(TransferEngine):
    """Thread-backed engine for pools on the CPU (tests, CPU-only runs)."""

    kind = "cpu"
    inline_bytes = SINGLE_PASS_BYTES
    wake_grace = WAKE_GRACE

    def __init__(self, device_pools: DevicePools, host_pools: HostPools) -> None:
        if device_pools.device.type != "cpu":
            raise ValueError(f"CpuTransferEngine needs CPU device pools, got {device_pools.device}")
        super().__init__(device_pools, host_pools)
        #: Whether some segment goes by window pairs (the layout has kv_window).
        self._windows = any(s.kind is IndexKind.WINDOWS for s in self.segments.segments)
        #: One native call per layer's rows (mesh_hicache/native.py), or None: the numpy
        #: address paths below. Without windows, the variant that takes no window pair.
        self._copy_segments = native.segment_copier(self._windows)
        self._table_ptr = self.segments.native_table.ctypes.data
        #: One native call per list of rows (mesh_hicache/native.py), or None: memmove per row.
        self._copy_rows = native.row_copier()

    def _native_steps(self, op: _Op, fn: Callable[..., None]) -> Iterator[None]:
        """``_steps`` when the native loop is built: no address arrays at all, one call per
        layer (the loop computes each row's addresses from the segment table), or one call
        for a whole backup or small load."""
        table = self.segments
        ptr = self._table_ptr
        (pages, slots, windows), (pa, sa, wa) = op.pairs, op.addrs
        args: tuple[int, ...]
        if self._windows:
            n_w = windows[0].shape[0]
            args = (pa, pages[0].shape[0], sa, slots[0].shape[0], wa, n_w, int(op.backup))
        else:
            args = (pa, pages[0].shape[0], sa, slots[0].shape[0], int(op.backup))
        bounds, last = table.layer_bounds, len(self.layer_ids) - 1
        if (op.backup or op.load_bytes <= SINGLE_PASS_BYTES) and not op.inject:
            fn(ptr, 0, bounds[-1], *args)
            self._layer_ready(op, last)
            yield
            return
        for pos in range(last + 1):
            if op.inject:
                self._check_fault(op, pos)
            fn(ptr, bounds[pos], bounds[pos + 1], *args)
            self._layer_ready(op, pos)
            yield

    def _copier(self, rows: MemRows) -> Callable[[int, int], None]:
        """``copy(a, b)``: the copies ``[a, b)`` of ``rows``, in as few native calls as the
        build allows (one with the native loop, else one ``memmove`` per row or run)."""
        fn = self._copy_rows
        if fn is not None:
            block = rows.block
            ptr, n = block.ctypes.data, block.shape[1]

            def native_copy(a: int, b: int, keep: np.ndarray = block) -> None:
                if b > a:  # ``keep``: the address arrays live as long as the copier
                    fn(ptr + 8 * a, ptr + 8 * (n + a), ptr + 8 * (2 * n + a), b - a)

            return native_copy
        move = ctypes.memmove
        sink: Callable[[Iterable[object]], None] = collections.deque[object](maxlen=0).extend
        dst, src, size = rows.dst.tolist(), rows.src.tolist(), rows.size.tolist()

        def python_copy(a: int, b: int) -> None:
            if b - a > 4:
                sink(map(move, dst[a:b], src[a:b], size[a:b]))  # the loop runs in C
            else:  # a page or two: cheaper than three slices and a map
                for i in range(a, b):
                    move(dst[i], src[i], size[i])

        return python_copy

    def _steps(self, op: _Op) -> Iterator[None]:
        if self._copy_segments is not None:
            yield from self._native_steps(op, self._copy_segments)
            return
        table, ready = self.segments, self._layer_ready
        last = len(self.layer_ids) - 1
        whole = op.backup or op.load_bytes <= SINGLE_PASS_BYTES
        if whole and not op.inject:
            # Nothing waits for a backup layer by layer (it is consumed whole), and a small
            # load copies faster than per-layer bookkeeping would let a waiter start: small
            # rows by one numpy copy per block, the others in one native loop, then every
            # layer is published at once.
            for dst_arr, dst_rows, src_arr, src_rows in table.small_row_copies(op.backup, op.pairs):
                dst_arr[dst_rows] = src_arr[src_rows]
            if table.has_large_rows:
                rows = table.mem_rows(op.backup, op.pairs, skip_small=True)
                self._copier(rows)(0, rows.block.shape[1])
            ready(op, last)
            yield
            return
        rows = table.mem_rows(op.backup, op.pairs)
        copy, bounds = self._copier(rows), rows.bounds
        for pos in range(last + 1):
            if op.inject:
                self._check_fault(op, pos)
            copy(bounds[pos], bounds[pos + 1])
            ready(op, pos)
            yield
