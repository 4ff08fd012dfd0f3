"""Sliding-window layers in the tiers: the host (L2) and storage (L3) tiers keep a
windowed page only where a boundary needs it, a hit ends only where every needed page is
present, and what a resume reads is bit-exact (one rank, file storage, recognizable
contents from ``cache_support``).

Spec: 4 KV layers, 0 and 2 windowed (6 tokens: a resume at ``b`` reads tokens
``b - 5 .. b - 1``, two pages of 4 tokens), 1 and 3 full; checkpoints every 16 tokens.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from mesh_hicache.cache import HiCache
from mesh_hicache.radix import RadixKey
from mesh_hicache.spec import KVSpec, StateSpec, WindowSpec
from mesh_hicache.testing import internals
from tests.unit.cache_support import (
    PS,
    budget_overrides,
    hashes_of,
    make_config,
    poison_free_device,
    serve,
    stored_objects,
)

A = list(range(100, 140))  # 10 pages
B = A[:28] + list(range(500, 512))  # shares 7 pages with A
C = A[:28] + list(range(900, 908))  # likewise, ends elsewhere
Z = list(range(700, 788))  # 22 pages sharing nothing with A: serving it empties L1


def window_spec(sinks: int = 0) -> StateSpec:
    return StateSpec(
        page_size=PS,
        kv=KVSpec(layer_ids=(0, 1, 2, 3), num_kv_heads=2, head_dim=2),
        windows=(WindowSpec(layer_ids=(0, 2), window=6, sink_tokens=sinks),),
        model_id="test/window",
    )


@pytest.fixture
def make_cache(one_rank_topology):
    caches: list[HiCache] = []

    def build(root: Path, *, sinks: int = 0, **overrides) -> HiCache:
        config = make_config(root, **{"device_pages": 24, "host_pages": 48, **overrides})
        cache = HiCache(one_rank_topology, window_spec(sinks), config)
        caches.append(cache)
        return cache

    yield build
    for cache in caches:
        cache.close()


def write_a(make_cache, root: Path, **overrides) -> Counter[str]:
    """Serve A once in a fresh cache and close it: A's pages go to L3."""
    cache = make_cache(root, **overrides)
    assert serve(cache, A).prefix == 0
    cache.flush()
    cache.close()
    return Counter(region for region, _, _ in stored_objects(root))


def test_l3_stores_only_the_windowed_pages_a_boundary_needs(make_cache, tmp_path):
    files = write_a(make_cache, tmp_path / "l3", window_checkpoint_tokens=16)
    # Full layers: every page. Windowed: the end (pages 8, 9) and the checkpoints at 16
    # (pages 2, 3) and 32 (6, 7).
    assert files["kv"] == 10 and files["kv_window"] == 6
    every = write_a(make_cache, tmp_path / "l3_every", window_checkpoint_tokens=0)
    assert every["kv"] == every["kv_window"] == 10


def test_a_hit_ends_where_the_windowed_pages_are(make_cache, tmp_path):
    root = tmp_path / "l3"
    write_a(make_cache, root, window_checkpoint_tokens=16)
    reader = make_cache(root, window_checkpoint_tokens=16)
    poison_free_device(reader)
    got = serve(reader, A)  # at the node end: pages 8 and 9 are stored
    assert got.hit.storage_tokens == 40 and got.served == (0, 0, 40) and got.mismatches == 0
    reader.check_integrity()

    other = make_cache(root, window_checkpoint_tokens=16)
    poison_free_device(other)
    got = serve(other, B)  # 28, 24 and 20 need page 4 or 5: back to the checkpoint at 16
    assert got.hit.storage_tokens == 16 and got.served == (0, 0, 16) and got.mismatches == 0
    # Now the tree holds [0, 16) from L3 (pages 0, 1 without windowed K/V) and B's tail.
    # A reuses 28 tokens from L1 (B's computed pages 4..6 carry the window) and the rest
    # from L3: its end needs pages 8, 9 and the checkpoint at 32 pages 6, 7.
    got = serve(other, A)
    assert got.served == (28, 0, 12) and got.mismatches == 0
    other.flush()
    other.check_integrity()


def test_every_page_stored_resumes_anywhere(make_cache, tmp_path):
    root = tmp_path / "l3"
    write_a(make_cache, root, window_checkpoint_tokens=0)
    reader = make_cache(root, window_checkpoint_tokens=0)
    poison_free_device(reader)
    got = serve(reader, B)
    assert got.hit.storage_tokens == 28 and got.mismatches == 0


def test_sinks_are_stored_with_every_boundary(make_cache, tmp_path):
    root = tmp_path / "l3"
    files = write_a(make_cache, root, sinks=5, window_checkpoint_tokens=16)
    assert files["kv_window"] == 8  # pages 0, 1 (sink tokens 0..4) as well
    reader = make_cache(root, sinks=5, window_checkpoint_tokens=16)
    poison_free_device(reader)
    got = serve(reader, A)
    assert got.served == (0, 0, 40) and got.mismatches == 0
    got = serve(make_cache(root, sinks=5, window_checkpoint_tokens=16), B)
    assert got.hit.storage_tokens == 16 and got.mismatches == 0


def test_a_lost_windowed_object_only_shortens_the_hit(make_cache, tmp_path):
    root = tmp_path / "l3"
    write_a(make_cache, root, window_checkpoint_tokens=16)
    lost = hashes_of(A)[7].hex()  # the checkpoint at 32 needs it
    (tag,) = [t for r, h, t in stored_objects(root) if r == "kv_window" and h == lost]
    next((root / "v1").glob(f"*/kv_window/{lost}/{tag}")).unlink()
    reader = make_cache(root, window_checkpoint_tokens=16)
    poison_free_device(reader)
    got = serve(reader, A)  # stops before the checkpoint at 32: back to 16
    assert got.hit.storage_tokens == 16 and got.mismatches == 0
    reader.check_integrity()


class StillCopying(set):
    """Host pages being copied, among them ``stuck`` for good (a copy that never ends)."""

    def __init__(self, stuck) -> None:
        super().__init__(stuck)
        self.stuck = frozenset(stuck)

    def difference_update(self, *others) -> None:
        super().difference_update(*others)
        self.update(self.stuck)


def branch_point_objects(make_cache, root: Path, settled: bool = True) -> set[str]:
    """Serve A, write it, then B (which splits A's node at 28) and write it: the page
    hashes of the windowed objects stored. ``settled=False``: A's host copy reads as still
    being copied when B is written, so no ancestor page is written with B."""
    cache = make_cache(root, window_checkpoint_tokens=16)
    serve(cache, A)
    cache.flush()  # A is written as one node: its end is 40
    if not settled:
        backups = internals(cache).controller.backups
        node = internals(cache).tree.node_at(RadixKey(tuple(A), ""))
        assert node is not None and node.host_indices is not None
        backups._copying_pages = StillCopying(node.host_indices)
    serve(cache, B)  # splits A's node at 28 and writes B's [28, 40) below it
    cache.flush()
    cache.close()
    return {h for r, h, _ in stored_objects(root) if r == "kv_window"}


def test_a_branch_point_is_stored_when_a_node_below_it_is_written(make_cache, tmp_path):
    root = tmp_path / "l3"
    stored = branch_point_objects(make_cache, root)
    # A's 6; B's own end and checkpoint pages 7, 8, 9; and page 5 for a resume at 28
    # (page 6, the other one it needs, is the checkpoint at 32's and already stored).
    assert len(stored) == 10 and hashes_of(A)[5].hex() in stored
    reader = make_cache(root, window_checkpoint_tokens=16)
    poison_free_device(reader)
    got = serve(reader, C)  # without page 5: back to 16
    assert got.hit.storage_tokens == 28 and got.served == (0, 0, 28) and got.mismatches == 0
    reader.check_integrity()
    # A host copy still being copied is never read: page 5 then stays out.
    unsettled = branch_point_objects(make_cache, tmp_path / "unsettled", settled=False)
    assert unsettled == stored - {hashes_of(A)[5].hex()}


# -- the host tier ----------------------------------------------------------------------


def host_rows(cache: HiCache) -> tuple[int, int]:
    """(host pages, host window rows) in use."""
    host = internals(cache).host
    assert host is not None
    return host.page_allocator.num_used, host.window_allocator.num_used


def host_budget(budget: bool) -> dict[str, int]:
    """Overrides for byte budgets (one arena per tier) of the fixed pools' bytes."""
    if not budget:
        return {}
    return budget_overrides(window_spec(), device_pages=24, host_pages=48, device_mamba_slots=0)


@pytest.mark.parametrize("budget", [False, True], ids=["pools", "byte-budget"])
def test_host_keeps_only_the_windowed_pages_a_boundary_needs(make_cache, tmp_path, budget):
    cache = make_cache(tmp_path / "l3", window_checkpoint_tokens=16, **host_budget(budget))
    serve(cache, A)
    cache.flush()
    # A's end needs pages 8, 9; the checkpoints at 16 and 32 pages 2, 3 and 6, 7.
    assert host_rows(cache) == (10, 6)
    cache.flush()
    cache.check_integrity()
    # The device copy is whole: a hit at 28 (needs pages 5 and 6) comes from L1.
    got = serve(cache, C)
    assert got.served == (28, 0, 0) and got.mismatches == 0
    cache.flush()
    cache.check_integrity()


def test_a_host_hit_ends_where_the_host_holds_the_window(make_cache, tmp_path):
    cache = make_cache(None, window_checkpoint_tokens=16)
    serve(cache, A)
    cache.flush()
    serve(cache, Z)  # A leaves the device
    cache.flush()
    poison_free_device(cache)
    got = serve(cache, C)  # 28 and 24 need page 5 or 4 (not on host): back to 16
    assert got.hit.host_tokens == 16 and got.served == (0, 16, 0) and got.mismatches == 0
    cache.flush()
    cache.check_integrity()
    got = serve(cache, A)  # A's end: pages 8, 9 and the checkpoint at 32's 6, 7 on host
    assert got.served[2] == 0 and got.prefix == 40 and got.mismatches == 0
    cache.flush()
    cache.check_integrity()


def test_a_branch_point_gets_its_window_on_host(make_cache, tmp_path):
    cache = make_cache(None, window_checkpoint_tokens=16)
    serve(cache, A)
    cache.flush()
    serve(cache, B)  # B's backup copies page 5 to A's host copy: 28 becomes resumable
    cache.flush()
    assert host_rows(cache) == (13, 6 + 3 + 1)
    cache.flush()
    cache.check_integrity()
    serve(cache, Z)
    cache.flush()
    poison_free_device(cache)
    got = serve(cache, C)
    assert got.hit.host_tokens == 28 and got.mismatches == 0
    cache.flush()
    cache.check_integrity()


def test_a_recomputed_page_fills_the_device_copy_that_lacked_its_window(make_cache, tmp_path):
    cache = make_cache(None, window_checkpoint_tokens=16)
    serve(cache, A)
    cache.flush()
    serve(cache, Z)
    cache.flush()
    assert serve(cache, A).served == (0, 40, 0)  # back on device, without pages 0, 1, 4, 5
    cache.flush()
    got = serve(cache, C)  # 28, 24 and 20 need page 4 or 5: from 16 on, C computes
    assert got.served == (16, 0, 0) and got.mismatches == 0
    cache.flush()
    cache.check_integrity()
    # C's pages 4, 5 (computed) were copied into A's device copy: 28 now resumes.
    poison_free_device(cache)
    got = serve(cache, A[:28] + list(range(950, 954)))
    assert got.served == (28, 0, 0) and got.mismatches == 0
    cache.flush()
    cache.check_integrity()
