"""Shared fixtures: a one-rank gloo process group and its 1x1x1 mesh topology; the
versions of the oracle packages in the report header."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

# Processes the tests start (runtime.serve, the server, examples) run one torch thread,
# as torchrun's ranks do: two OpenMP threads on a 2-core machine that something else
# also loads stall in barriers (a test of three serve runs, ~11 s quiet, took 28-337 s).
# Set after torch is imported, so this process keeps torch's default.
os.environ.setdefault("OMP_NUM_THREADS", "1")


ORACLES = ("torch", "transformers", "safetensors", "tokenizers", "hypothesis", "openai")


def pytest_report_header(config) -> str:
    """The versions the suite ran with (the test extra bounds them)."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ORACLES:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} missing")
    return "versions: " + ", ".join(found)


@pytest.fixture(scope="session")
def single_rank_group():
    """A world of one rank (gloo, in-memory store) for tests that need a DeviceMesh."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    return dist.group.WORLD


@pytest.fixture(scope="session")
def one_rank_topology(single_rank_group):
    """The shared 1x1x1 (pp, cp, tp) CPU mesh topology of the single-process tests."""
    from torch.distributed.device_mesh import init_device_mesh

    from mesh_hicache.topology import MeshTopology

    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "cp", "tp"))
    return MeshTopology.from_mesh(mesh)
