"""Device arenas on CUDA: the CUDA transfer engine copies pages and states between a
device arena (strided per-layer views) and a pinned host arena or fixed host pool, and
windowed pages into a host arena's window kind, bit-exact (skipped without CUDA and
cupy)."""

from __future__ import annotations

import pytest
import torch

from mesh_hicache.pools import cupy_cuda_available
from mesh_hicache.transfer.cuda import CudaTransferEngine
from tests.unit.test_arena import arena_round_trip, windowed_arena_round_trip

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not cupy_cuda_available(), reason="needs CUDA with cupy"),
]


@pytest.mark.parametrize("host_arena", [True, False])
def test_cuda_backup_and_load_between_arenas_are_bit_exact(host_arena):
    arena_round_trip("cuda", host_arena, True, CudaTransferEngine)


def test_cuda_windowed_arenas_round_trip_by_window_ids():
    windowed_arena_round_trip("cuda", True, CudaTransferEngine)
