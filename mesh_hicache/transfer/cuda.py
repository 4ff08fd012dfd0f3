"""CUDA transfer engine: cupy pinned host pools, a dedicated CUDA stream, an event per layer.

The copying thread (the worker, or a waiter that found it idle) issues every layer's
copies of an operation on the engine's own stream and records one CUDA event per layer,
then waits on the events in layer order and publishes each layer as ready (so
``wait_layer(i)`` returns while layers after ``i`` still copy).

Per segment (one part of one layer, all rows of the op), the device side is gathered or
scattered with one ``index_select``/``index_copy_`` through a preallocated device staging
buffer; the host side moves each run of consecutive host rows with ONE asynchronous 2-D
DMA copy (``cudaMemcpy2DAsync`` through cupy's runtime bindings: pitch = the host row
stride, width = the segment's row), from/to pinned memory, on raw addresses computed in
bulk (no tensor view per row). Same semantics as the CPU engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools
from mesh_hicache.transfer.engine import TransferEngine, _Op
from mesh_hicache.transfer.segments import IndexArray, IndexKind

STAGING_BYTES = 64 << 20


class _Chunk:
    """Positions ``[start, start + count)`` of one index kind (pages, slots or windows),
    ready to copy."""

    __slots__ = ("count", "device_idx", "host_idx", "run_first", "run_rows", "start")

    def __init__(self, start: int, device_idx: torch.Tensor, host_idx: IndexArray) -> None:
        self.start = start
        self.count = int(host_idx.shape[0])
        self.device_idx = device_idx
        self.host_idx = host_idx
        # Runs of consecutive host rows: first position (in this chunk) and row count.
        breaks = np.flatnonzero(np.diff(host_idx) != 1) + 1
        first = np.concatenate((np.zeros(1, dtype=np.int64), breaks))
        self.run_first = first
        self.run_rows = np.diff(np.concatenate((first, [self.count]))).tolist()


class CudaTransferEngine(TransferEngine):
    """Engine for device pools on a CUDA device and pinned host pools."""

    kind = "cuda"

    def __init__(
        self, device_pools: DevicePools, host_pools: HostPools, staging_bytes: int = STAGING_BYTES
    ) -> None:
        if device_pools.device.type != "cuda":
            raise ValueError(
                f"CudaTransferEngine needs CUDA device pools, got {device_pools.device}"
            )
        import cupy  # type: ignore[import-not-found]

        super().__init__(device_pools, host_pools)
        self._rt: Any = cupy.cuda.runtime
        index = device_pools.device.index
        self._device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        # cupy's runtime calls run on the thread's cupy device; make it the pools' one.
        self._cupy_device: Any = cupy.cuda.Device(self._device.index)
        self._stream = torch.cuda.Stream(device=self._device)
        # Where the pool tensors live (the pools' device; tests run this on CPU memory).
        segs = self.segments.segments
        self._tensor_device = segs[0].device.device if segs else self._device
        widest = max((s.row_bytes for s in self.segments.segments), default=1)
        self._staging = torch.empty(
            max(staging_bytes, widest), dtype=torch.uint8, device=self._tensor_device
        )
        #: Rows of one segment that fit the staging buffer at once.
        self._chunk_rows = [self._staging.numel() // s.row_bytes for s in self.segments.segments]

    def _submitted(self, op: _Op) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _chunks(self, pair: tuple[IndexArray, IndexArray], rows: int) -> list[_Chunk]:
        dev_np, host_np = pair
        out = []
        for start in range(0, dev_np.shape[0], rows):
            dev_idx = torch.from_numpy(dev_np[start : start + rows]).to(self._tensor_device)
            out.append(_Chunk(start, dev_idx, host_np[start : start + rows]))
        return out

    def _steps(self, op: _Op) -> Iterator[None]:
        events, error = self._issue(op)
        for pos, event in enumerate(events):
            event.synchronize()
            self._layer_ready(op, pos)
            yield
        if error is not None:
            self._stream.synchronize()
            raise error

    def _issue(self, op: _Op) -> tuple[list[torch.cuda.Event], Exception | None]:
        """Queue every layer's copies on the side stream, one event per layer; stop at the
        first error (returned) with the events of the layers queued before it."""
        events: list[torch.cuda.Event] = []
        error: Exception | None = None
        # Chunks are cut to the narrowest staging fit of their index kind (pages, slots,
        # windows), so every segment of that kind fits; device indices move to the GPU
        # once per op.
        table = self.segments.segments
        fits = {
            kind: min(
                (r for r, s in zip(self._chunk_rows, table, strict=True) if s.kind is kind),
                default=1,
            )
            for kind in IndexKind
        }
        # A context, not set_device: a waiter's thread may be the one issuing.
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream), self._cupy_device:
            # The device pools may have been written on the submitter's stream up to the
            # submission (op.after: an event recorded there then).
            self._stream.wait_event(op.after)
            chunks = {kind: self._chunks(op.pairs[kind], fits[kind]) for kind in IndexKind}
            for pos, seg_ids in enumerate(self.segments.by_layer):
                try:
                    self._check_fault(op, pos)
                    for seg in seg_ids:
                        for chunk in chunks[table[seg].kind]:
                            self._copy_chunk(seg, chunk, op.backup)
                except Exception as exc:
                    error = exc
                    break
                event = torch.cuda.Event()
                event.record(self._stream)
                events.append(event)
        return events, error

    def _copy_chunk(self, seg: int, chunk: _Chunk, backup: bool) -> None:
        s = self.segments.segments[seg]
        rb, n = s.row_bytes, chunk.count
        buf = self._staging[: n * rb].view(s.device.dtype).view(n, *s.device.shape[1:])
        staging = self._staging.data_ptr()
        host_addr = (s.host_ptr + chunk.host_idx[chunk.run_first] * s.host_stride).tolist()
        first = chunk.run_first.tolist()
        stream = self._stream.cuda_stream
        rt = self._rt
        if backup:
            torch.index_select(s.device, 0, chunk.device_idx, out=buf)
            for addr, j, rows in zip(host_addr, first, chunk.run_rows, strict=True):
                rt.memcpy2DAsync(
                    addr, s.host_stride, staging + j * rb, rb, rb, rows,
                    rt.memcpyDeviceToHost, stream,
                )  # fmt: skip
        else:
            for addr, j, rows in zip(host_addr, first, chunk.run_rows, strict=True):
                rt.memcpy2DAsync(
                    staging + j * rb, rb, addr, s.host_stride, rb, rows,
                    rt.memcpyHostToDevice, stream,
                )  # fmt: skip
            s.device.index_copy_(0, chunk.device_idx, buf)
