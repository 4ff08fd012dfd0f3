"""Tenants: two tenants with identical prompts share nothing in any tier (L1,
L2, L3), and one tenant's hits are the same with or without another tenant's traffic."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh_hicache.cache import HiCache, tenant_namespace
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.testing import internals
from tests.unit.cache_support import (
    PS,
    hashes_of,
    make_config,
    make_spec,
    serve,
    stored_objects,
)

A = list(range(100, 112))  # 3 pages
B = list(range(200, 208))


@pytest.fixture
def make_cache(one_rank_topology):
    caches: list[HiCache] = []

    def build(root: Path | None = None, **overrides) -> HiCache:
        cache = HiCache(one_rank_topology, make_spec(), make_config(root, **overrides))
        caches.append(cache)
        return cache

    yield build
    for cache in caches:
        cache.close()


def hit_of(cache: HiCache, tokens: list[int], tenant: str | None = None):
    req = cache.match(tokens, tenant=tenant)
    hit = req.hit
    cache.release(req)
    return hit


# -- L1 and L2: the tree ----------------------------------------------------------------


def test_config_tenant_namespaces_the_tree(make_cache):
    cache = make_cache(tenant="alice")
    serve(cache, A)
    cache.flush()
    assert hit_of(cache, A).device_tokens == 12  # the cache's own tenant
    for other in ("bob", ""):
        assert hit_of(cache, A, tenant=other).total == 0
    namespaces = {n.namespace for n in internals(cache).tree.iter_nodes()}
    assert namespaces == {tenant_namespace("alice")}


def test_two_tenants_share_nothing_on_device(make_cache):
    cache = make_cache()
    serve(cache, A, tenant="alice")
    cache.flush()
    assert hit_of(cache, A, tenant="bob").total == 0
    serve(cache, A, tenant="bob")
    cache.flush()
    for t in ("alice", "bob"):
        assert hit_of(cache, A, tenant=t).device_tokens == 12
    cache.check_integrity()


def test_two_tenants_share_nothing_on_host(make_cache):
    cache = make_cache()
    serve(cache, A, tenant="alice")
    cache.flush()
    inner = internals(cache)
    inner.allocator.reclaim(inner.tree.evict_device(10**6))  # alice's A: host only
    assert hit_of(cache, A, tenant="alice").host_tokens == 12
    assert hit_of(cache, A, tenant="bob").total == 0
    got = serve(cache, A, tenant="bob")
    assert got.prefix == 0 and got.served == (0, 0, 0)
    cache.check_integrity()


# -- L3 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["request", "config"])
def test_two_tenants_share_nothing_in_storage(make_cache, tmp_path, where):
    root = tmp_path / "l3"

    def cache_of(tenant: str) -> tuple[HiCache, str | None]:
        if where == "config":
            return make_cache(root, tenant=tenant), None
        return make_cache(root), tenant

    def stored_hashes() -> set[str]:
        return {o[1] for o in stored_objects(root)}

    def page_hashes(tenant: str) -> set[str]:
        return {h.hex() for h in hashes_of(A, tenant_namespace(tenant))}

    writer, t = cache_of("alice")
    serve(writer, A, tenant=t)
    writer.flush()
    assert page_hashes("alice") <= stored_hashes()
    reader, t = cache_of("bob")
    got = serve(reader, A, tenant=t)
    assert got.hit.total == 0 and got.prefix == 0
    reader.flush()
    # Bob wrote his own objects, under page hashes that are not alice's.
    assert page_hashes("bob") <= stored_hashes()
    assert page_hashes("alice").isdisjoint(page_hashes("bob"))
    again, t = cache_of("alice")
    assert serve(again, A, tenant=t).hit.storage_tokens == 12  # alice's are still there


# -- one tenant's hits do not depend on another's traffic -------------------------------


def test_hits_unchanged_by_another_tenants_traffic(make_cache):
    trace = [A, B, A + [7] * PS, B, A]

    def alice_hits(with_bob: bool) -> list[tuple[int, int, int]]:
        cache = make_cache(device_pages=64, host_pages=128, device_mamba_slots=32)
        out = []
        for tokens in trace:
            if with_bob:  # bob first, the same prompts: nothing of his may reach alice
                serve(cache, tokens, tenant="bob")
            out.append(tuple(serve(cache, tokens, tenant="alice").served))
        cache.check_integrity()
        return out

    alone = alice_hits(with_bob=False)
    assert alone[0] == (0, 0, 0) and sum(alone[-1]) == 12
    assert alice_hits(with_bob=True) == alone


def test_tenant_values_are_validated(make_cache):
    with pytest.raises(ValueError, match="tenant"):
        HiCacheConfig(device_pages=4, tenant="a\x1fb")
    cache = make_cache()
    with pytest.raises(ValueError, match="namespace"):
        cache.match(A, namespace="x\x1f")
    with pytest.raises(TypeError, match="tenant"):
        cache.match(A, tenant=3)  # type: ignore[arg-type]
    assert internals(cache).num_open == 0
    assert tenant_namespace("", "ns") == "ns"
    assert len({tenant_namespace("a", "b"), tenant_namespace("a\x00", "b"), "ab"}) == 3
