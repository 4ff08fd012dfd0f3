"""CUDA transfer engine: cupy pinned host pools, a dedicated CUDA stream, an event per layer.

The worker thread issues every layer's copies of an operation on its own stream and
records one CUDA event per layer, then waits on the events in layer order and publishes
each layer as ready (so ``wait_layer(i)`` returns while layers after ``i`` still copy).

Per job (one region of one layer, all pages of the op), the device side is gathered or
scattered with one ``index_select``/``index_copy_`` through a preallocated device staging
buffer; the host side moves whole page rows (each contiguous in the page-first host pool)
with asynchronous DMA copies from/to pinned memory.
"""

from __future__ import annotations

import torch

from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools
from mesh_hicache.transfer.engine import CopyJob, TransferEngine, TransferKind, _Op

STAGING_BYTES = 64 << 20


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
        super().__init__(device_pools, host_pools)
        self._device = device_pools.device
        self._stream = torch.cuda.Stream(device=self._device)
        self._staging = torch.empty(staging_bytes, dtype=torch.uint8, device=self._device)

    def _run_layers(
        self, kind: TransferKind, plan: list[tuple[int, list[CopyJob]]], op: _Op
    ) -> None:
        torch.cuda.set_device(self._device)
        events: list[torch.cuda.Event] = []
        error: Exception | None = None
        with torch.cuda.stream(self._stream):
            # The device pools may have been written on the caller's stream.
            self._stream.wait_stream(torch.cuda.default_stream(self._device))
            for layer, jobs in plan:
                try:
                    self._check_fault(op, layer)
                    for job in jobs:
                        self._copy_rows(job, kind)
                except Exception as exc:
                    error = exc
                    break
                event = torch.cuda.Event()
                event.record(self._stream)
                events.append(event)
        for pos, event in enumerate(events):
            event.synchronize()
            self._layer_ready(op, pos)
        self._stream.synchronize()
        if error is not None:
            raise error

    def _copy_rows(self, job: CopyJob, kind: TransferKind) -> None:
        n = job.src_idx.numel()
        if n == 0:
            return
        device_rows = job.src if kind is TransferKind.BACKUP else job.dst
        row_shape = device_rows.shape[1:]
        row_numel = device_rows[0].numel()
        row_bytes = row_numel * device_rows.element_size()
        chunk = max(1, self._staging.numel() // row_bytes)
        flat = self._staging[: chunk * row_bytes].view(device_rows.dtype)
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            buf = flat[: m * row_numel].view(m, *row_shape)
            src_idx = job.src_idx[start : start + m]
            dst_idx = job.dst_idx[start : start + m]
            if kind is TransferKind.BACKUP:
                torch.index_select(job.src, 0, src_idx, out=buf)
                for j, h in enumerate(dst_idx.tolist()):
                    job.dst[h].copy_(buf[j], non_blocking=True)
            else:
                for j, h in enumerate(src_idx.tolist()):
                    buf[j].copy_(job.src[h], non_blocking=True)
                job.dst.index_copy_(0, dst_idx, buf)
