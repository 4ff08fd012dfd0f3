"""Device <-> host transfer engines (one interface, CPU and CUDA implementations)."""

from __future__ import annotations

from mesh_hicache.choices import TransferBackend
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools, cupy_cuda_available
from mesh_hicache.transfer.cpu import CpuTransferEngine
from mesh_hicache.transfer.engine import (
    InjectedFailure,
    TransferAck,
    TransferEngine,
    TransferHandle,
    TransferKind,
)

TRANSFER_KINDS: tuple[str, ...] = TransferBackend.values()


def make_transfer_engine(
    device_pools: DevicePools,
    host_pools: HostPools,
    kind: TransferBackend | str = TransferBackend.AUTO,
) -> TransferEngine:
    """The engine for these pools.

    ``auto`` picks ``cuda`` only when torch sees CUDA, cupy imports and sees a device, and
    the device pools are on CUDA; otherwise ``cpu``. ``ValueError`` for an unknown kind
    or ``cuda`` without CUDA.
    """
    kind = TransferBackend.parse(kind, "transfer engine kind")
    on_cuda = device_pools.device.type == "cuda"
    if kind is TransferBackend.AUTO:
        kind = TransferBackend.CUDA if on_cuda and cupy_cuda_available() else TransferBackend.CPU
    if kind is TransferBackend.CUDA:
        if not (on_cuda and cupy_cuda_available()):
            raise ValueError("kind='cuda' needs CUDA device pools, torch CUDA and cupy")
        from mesh_hicache.transfer.cuda import CudaTransferEngine

        return CudaTransferEngine(device_pools, host_pools)
    if on_cuda:
        raise ValueError("kind='cpu' cannot copy CUDA device pools; use 'cuda' or 'auto'")
    return CpuTransferEngine(device_pools, host_pools)


__all__ = [
    "CpuTransferEngine",
    "InjectedFailure",
    "TransferAck",
    "TransferEngine",
    "TransferHandle",
    "TransferKind",
    "make_transfer_engine",
]
