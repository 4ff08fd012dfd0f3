"""CPU transfer engine: a worker thread (or a waiting caller) doing the copies in order.

Rows (a whole page of one layer part, e.g. 128 KiB for 64 tokens x 8 heads x 128 dims in
bf16; never a token) are contiguous in both pools. An operation's row addresses come in
bulk from :class:`~mesh_hicache.transfer.segments.SegmentTable`; each row (or merged run)
is one ``ctypes.memmove`` straight from pool to pool, which releases the GIL, and the
calls run inside ``map`` (no Python loop per row):

- a load goes layer by layer, one ``map`` per layer, each layer published as soon as it
  is in place;
- a backup (nothing waits for it layer by layer) and a load of at most
  ``SINGLE_PASS_BYTES`` go in one pass and publish every layer at once; there, rows of at
  most ``SMALL_ROW_BYTES`` (4 KiB) go by one numpy fancy copy per pool buffer instead,
  since one ``memmove`` call would cost more than its bytes.

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

from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools
from mesh_hicache.transfer.engine import TransferEngine, _Op

#: A load of at most this many bytes is copied in one pass and published at once: it
#: takes less time (~25 us at memory bandwidth) than publishing it layer by layer costs.
SINGLE_PASS_BYTES = 256 << 10


class CpuTransferEngine(TransferEngine):
    """Thread-backed engine for pools on the CPU (tests, CPU-only runs)."""

    kind = "cpu"

    def __init__(self, device_pools: DevicePools, host_pools: HostPools) -> None:
        if device_pools.device.type != "cpu":
            raise ValueError(f"CpuTransferEngine needs CPU device pools, got {device_pools.device}")
        super().__init__(device_pools, host_pools)

    def _steps(self, op: _Op) -> Iterator[None]:
        table, move, ready = self.segments, ctypes.memmove, self._layer_ready
        sink: Callable[[Iterable[object]], None] = collections.deque[object](maxlen=0).extend
        last = len(self.layer_ids) - 1
        whole = op.backup or table.op_bytes(op.pages, op.slots) <= SINGLE_PASS_BYTES
        if whole and not op.inject:
            # Nothing waits for a backup layer by layer (it is consumed whole), and a small
            # load copies faster than per-layer bookkeeping would let a waiter start: small
            # rows by one numpy copy per block, the others in one native loop, then every
            # layer is published at once.
            for dst_arr, dst_rows, src_arr, src_rows in table.small_row_copies(
                op.backup, op.pages, op.slots
            ):
                dst_arr[dst_rows] = src_arr[src_rows]
            dst, src, size, _ = table.mem_rows(op.backup, op.pages, op.slots, skip_small=True)
            sink(map(move, dst, src, size))
            ready(op, last)
            yield
            return
        dst, src, size, bounds = table.mem_rows(op.backup, op.pages, op.slots)
        a = 0
        for pos in range(last + 1):
            if op.inject:
                self._check_fault(op, pos)
            b = bounds[pos + 1]
            if b - a > 4:
                sink(map(move, dst[a:b], src[a:b], size[a:b]))  # the loop runs in C
            else:  # a page or two: cheaper than three slices and a map
                for i in range(a, b):
                    move(dst[i], src[i], size[i])
            a = b
            ready(op, pos)
            yield
