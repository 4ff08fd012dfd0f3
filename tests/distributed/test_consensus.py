"""Consensus: every rank gets the same agreed value; background groups do not deadlock."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from mesh_hicache import Consensus, MeshTopology
from tests.distributed.harness import run_on_mesh


def _agree(mesh):
    topo = MeshTopology.from_mesh(mesh)
    rank = dist.get_rank()
    cache = Consensus.over(topo, "cp", "tp")
    pp = Consensus.over(topo, "pp")
    return {
        "coords": topo.coords,
        "min": cache.min(10 + rank),
        "max": cache.max(10 + rank),
        "all_true": cache.all_true(rank != 1),
        "any_true": cache.any_true(rank == 1),
        "min_list": cache.min_list([rank, 100 - rank, 5]),
        "min_max": cache.min_max([rank, -rank]),
        "pp_max": pp.max(rank),
        "calls": cache.num_calls,
    }


@pytest.mark.parametrize("shape", [(1, 2, 2), (2, 1, 2), (2, 2, 2)])
def test_ranks_agree(shape):
    out = run_on_mesh(shape, _agree)
    for o in out:
        stage = [r for r, p in enumerate(out) if p["coords"][0] == o["coords"][0]]
        pipe = [r for r, p in enumerate(out) if p["coords"][1:] == o["coords"][1:]]
        assert o["min"] == 10 + min(stage) and o["max"] == 10 + max(stage)
        assert o["all_true"] == (1 not in stage)
        assert o["any_true"] == (1 in stage)
        assert o["min_list"] == [min(stage), 100 - max(stage), 5]
        assert o["min_max"] == ([min(stage), -max(stage)], [max(stage), -min(stage)])
        assert o["pp_max"] == max(pipe)
        assert o["calls"] == 6


def _background_thread(mesh):
    topo = MeshTopology.from_mesh(mesh)
    main = Consensus.over(topo, "cp", "tp")
    background = Consensus.over(topo, "cp", "tp", background=True)
    rank = dist.get_rank()
    got: list[int] = []

    def worker():
        # Interleaves arbitrarily with the main thread's collectives on another group.
        for i in range(50):
            got.append(background.max(rank * 1000 + i))

    thread = threading.Thread(target=worker)
    thread.start()
    main_out = []
    for i in range(50):
        main_out.append(main.min(rank + i))
        t = torch.ones(4)
        dist.all_reduce(t, group=topo.cache_group)
        main_out.append(int(t[0]))
    thread.join(timeout=30)
    assert not thread.is_alive(), "background consensus deadlocked"
    return got, main_out


def test_background_group_runs_beside_main_thread():
    out = run_on_mesh((1, 2, 2), _background_thread, timeout=60)
    for got, main_out in out:
        assert got == [3000 + i for i in range(50)]
        assert main_out[::2] == list(range(50)) and main_out[1::2] == [4] * 50
