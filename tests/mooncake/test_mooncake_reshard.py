"""Reshard on read over Mooncake: L3 written by one mesh, read by another.

The reader finds the writer's layout in the registry entries stored in Mooncake (no
listing), fetches the objects covering its shard and serves the same outputs as the
writer (outputs are mesh-independent, checked against recompute elsewhere), with L3
hits counted as resharded on every rank. The tiny model is hybrid: the Mamba state
crosses the mesh change too.
"""

from __future__ import annotations

import pytest

from tests.mooncake import runtime_bodies
from tests.mooncake.services import MooncakeServices, NetnsWorker
from tests.mooncake.test_mooncake_runtime import WORKLOAD


@pytest.mark.parametrize(
    ("seed", "writer", "w_kv", "reader", "r_kv"),
    [
        pytest.param(21, (1, 1, 2), "replicate", (2, 1, 1), "replicate", id="tp2->pp2"),
        pytest.param(22, (1, 2, 1), "shard", (1, 1, 2), "replicate", id="cpkv_shard->tp2"),
    ],
)
def test_mesh_change_reads_mooncake_l3_through_resharding(
    mooncake_services: MooncakeServices, seed, writer, w_kv, reader, r_kv
) -> None:
    argv = ["--cache", "full", "--storage", "mooncake"]
    argv += ["--mooncake-master", mooncake_services.master_address]
    argv += [*WORKLOAD, "--first-prompt-len", "128", "--seed", str(seed)]
    w = NetnsWorker(mooncake_services, timeout=240)
    try:
        first = w.call(runtime_bodies.serve_mesh, writer, [*argv, "--cp-kv", w_kv])
        second = w.call(runtime_bodies.serve_mesh, reader, [*argv, "--cp-kv", r_kv])
    finally:
        w.close()
    assert all(r["storage_resharded_tokens"] == 0 for r in first)
    for r in second:
        assert not r["degraded"]
        assert r["outputs"] == first[0]["outputs"], r["coords"]
        assert r["hit_tokens_storage"] > 0, r["coords"]
        assert r["storage_resharded_tokens"] == r["hit_tokens_storage"], r
        assert r["cached_storage"] == second[0]["cached_storage"]
