"""Ranks that call different cache operations are named on every rank, in bounded time:
one rank calls ``match`` while its peer closes, or calls nothing at all."""

from __future__ import annotations

import time
from typing import Any

from mesh_hicache import CollectiveTimeout, HiCache, RanksDisagree
from mesh_hicache.topology import MeshTopology
from tests.distributed.harness import run_on_mesh
from tests.unit.cache_support import PS, make_config, make_spec, serve

BOUND_S = 6.0
"""The cache's collective timeout in these tests (HiCacheConfig.collective_timeout_s)."""


def _only_rank0_matches(mesh: Any, peer: str) -> dict[str, Any]:
    topo = MeshTopology.from_mesh(mesh)
    rank = topo.coord("tp")
    cache = HiCache(topo, make_spec(), make_config(collective_timeout_s=BOUND_S))
    tokens = list(range(2 * PS))
    serve(cache, tokens)  # in step: both ranks
    start = time.monotonic()
    try:
        with cache:
            if rank == 0:
                cache.match(tokens)
            elif peer == "close":
                pass  # leaves the block: close() on this rank only
            else:
                time.sleep(BOUND_S * 2)  # calls nothing, then closes
    except (RanksDisagree, CollectiveTimeout) as err:
        return {"error": type(err).__name__, "message": str(err), "seconds": _since(start)}
    return {"error": None, "seconds": _since(start)}


def _since(start: float) -> float:
    return time.monotonic() - start


def test_a_match_on_one_rank_and_close_on_the_other_is_named_on_both():
    results = run_on_mesh((2,), _only_rank0_matches, "close", timeout=120)
    for rank, r in enumerate(results):
        assert r["error"] == "RanksDisagree", (rank, r)
        assert "rank 0 in match" in r["message"] and "rank 1 in close" in r["message"], r
        assert "\n" not in r["message"]
        assert r["seconds"] < BOUND_S, r  # found at once, not after a timeout


def test_a_rank_that_calls_nothing_fails_its_peer_within_the_bound():
    results = run_on_mesh((2,), _only_rank0_matches, "idle", timeout=120)
    first = results[0]
    assert first["error"] == "CollectiveTimeout", first
    assert first["message"].startswith("match (operation #"), first
    assert f"within {BOUND_S:g} s" in first["message"], first
    assert first["seconds"] <= BOUND_S + 1.0, first  # 1 s for a loaded machine
    # The idle rank's own next call (close, leaving the block) finds rank 0 gone.
    assert results[1]["error"] == "CollectiveTimeout", results[1]
    assert results[1]["message"].startswith("close (operation #"), results[1]
