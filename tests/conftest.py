"""Shared fixtures: a one-rank gloo process group for single-process tests."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def single_rank_group():
    """A world of one rank (gloo, in-memory store) for tests that need a DeviceMesh."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    return dist.group.WORLD
