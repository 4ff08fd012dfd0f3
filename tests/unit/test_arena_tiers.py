"""Agreed allocation over arenas (tiers/alloc.py): fit before evict, eviction across the
two kinds sharing one budget, and a whole cache on a byte budget."""

from __future__ import annotations

import json

import pytest
import torch

from mesh_hicache.cache import HiCache
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools.arena import ArenaPlan
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools
from mesh_hicache.radix import RadixKey, RadixTree
from mesh_hicache.spec import Family
from mesh_hicache.stats import CacheStats
from mesh_hicache.storage.file import FileStorage
from mesh_hicache.storage.keys import tensor_bytes
from mesh_hicache.testing import internals
from mesh_hicache.tiers import CacheFull, EvictHooks, TierAllocator
from runtime.serve import main as serve_cli
from tests.unit.cache_support import PS, make_spec, serve
from tests.unit.test_misconfig import TINY

HOOKS = EvictHooks(write_back=lambda: None, in_flight=lambda: False, drain=lambda: None)


def _layout() -> StateLayout:
    return StateLayout.for_coords(make_spec(), (1, 1, 1), (0, 0, 0))


def _plan(pages: int, slots: int) -> ArenaPlan:
    """An arena of exactly ``pages`` pages plus ``slots`` states, blocks of one page."""
    page, slot, _ = ArenaPlan.item_bytes(_layout())
    per_slot = -(-slot // page)
    return ArenaPlan(pages + slots * per_slot, page, page, slot)


def _allocator(group, device: DevicePools, host: HostPools | None = None):
    tree = RadixTree(PS, has_mamba=True)
    stats = CacheStats()
    return TierAllocator(device, host, tree, Consensus(group), stats, HOOKS), tree, stats


def _key(first: int, pages: int) -> RadixKey:
    return RadixKey(tuple(range(first, first + pages * PS)))


@pytest.mark.parametrize("arena", [False, True])
def test_a_request_larger_than_an_empty_device_tier_evicts_nothing(single_rank_group, arena):
    layout = _layout()
    if arena:
        device = DevicePools(layout, arena=_plan(6, 0))
    else:
        device = DevicePools(layout, num_pages=6, num_slots=2)
    alloc, tree, stats = _allocator(single_rank_group, device)
    cap = device.max_pages
    pages = alloc.alloc_device_pages(cap)
    tree.insert(_key(0, cap), device_indices=pages)
    with pytest.raises(CacheFull, match="exceed an empty device tier"):
        alloc.alloc_device_pages(cap + 1)
    assert tree.num_device_pages == cap and stats.evicted_device_pages == 0
    assert tree.match_prefix(_key(0, cap)).raw_kv_len == cap * PS  # still cached
    assert len(alloc.alloc_device_pages(cap)) == cap  # one that fits does evict
    assert stats.evicted_device_pages == cap


@pytest.mark.parametrize("arena", [False, True])
def test_host_reservation_larger_than_an_empty_host_tier_evicts_nothing(single_rank_group, arena):
    layout = _layout()
    device = DevicePools(layout, num_pages=4, num_slots=2)
    if arena:
        host = HostPools(layout, arena=_plan(5, 1), pinned=False)
    else:
        host = HostPools(layout, num_pages=5, num_slots=1, pinned=False)
    alloc, tree, stats = _allocator(single_rank_group, device, host)
    got = alloc.try_alloc_host(3, 0)
    assert got is not None
    tree.insert(_key(0, 3), host_indices=got.pages)
    huge = (host.max_pages + 1, 0) if not arena else (5, 2)  # arena: 5 pages + 2 states > 5 + 1
    assert alloc.try_alloc_host(*huge) is None
    assert tree.num_host_pages == 3 and stats.evicted_host_pages == 0


def test_an_arena_evicts_the_older_kind_to_make_room(single_rank_group):
    """Pages and states share the blocks: a page request evicts an old state when the
    state is the older victim (LRU across both queues), so the split follows demand."""
    device = DevicePools(_layout(), arena=_plan(4, 1))
    alloc, tree, stats = _allocator(single_rank_group, device)
    per_slot = device.arena.plan.blocks_per_slot
    old_pages = alloc.alloc_device_pages(2)
    slot = alloc.alloc_device_slot()
    tree.insert(_key(0, 2), device_indices=old_pages, mamba_device_slot=slot)  # older
    new_pages = alloc.alloc_device_pages(2)
    tree.insert(_key(1000, 2), device_indices=new_pages)  # a newer KV-only leaf
    assert device.arena.free_blocks == 0
    # Room for per_slot more pages: the old node goes first (its state and pages), the
    # newer KV leaf stays.
    got = alloc.alloc_device_pages(per_slot)
    assert len(got) == per_slot
    assert stats.evicted_device_slots == 1
    assert tree.match_prefix(_key(1000, 2)).raw_kv_len == 2 * PS
    assert tree.match_prefix(_key(0, 2)).raw_kv_len == 0
    device.arena.check_integrity()


def test_a_state_request_evicts_older_pages_before_a_newer_state(single_rank_group):
    """The victim is the older head of either queue, not the requested kind: a state
    request frees an old KV-only leaf and keeps the newer state."""
    per_slot = _plan(0, 1).blocks_per_slot
    device = DevicePools(_layout(), arena=_plan(per_slot + 2, 1))
    alloc, tree, stats = _allocator(single_rank_group, device)
    old = alloc.alloc_device_pages(per_slot)  # one run of blocks, a KV-only leaf
    tree.insert(_key(0, per_slot), device_indices=old)
    pages, slot = alloc.alloc_device_pages(2), alloc.alloc_device_slot()
    tree.insert(_key(5000, 2), device_indices=pages, mamba_device_slot=slot)  # newer
    assert device.arena.free_blocks == 0
    alloc.alloc_device_slot()
    assert stats.evicted_device_slots == 0 and stats.evicted_device_pages == per_slot
    assert tree.match_prefix(_key(5000, 2)).device_len == 2 * PS  # state kept: a full hit
    assert tree.match_prefix(_key(0, per_slot)).raw_kv_len == 0
    device.arena.check_integrity()


def test_an_arena_evicts_old_pages_for_a_state(single_rank_group):
    device = DevicePools(_layout(), arena=_plan(2, 1))
    alloc, tree, stats = _allocator(single_rank_group, device)
    per_slot = device.arena.plan.blocks_per_slot
    pages = alloc.alloc_device_pages(2 + per_slot)  # pages fill the whole arena
    tree.insert(_key(0, 2 + per_slot), device_indices=pages)
    slot = alloc.alloc_device_slot()  # pages make way for a state
    assert slot in range(device.num_slots)
    assert stats.evicted_device_pages >= per_slot
    device.arena.check_integrity()


def _budget_config(**overrides) -> HiCacheConfig:
    layout = _layout()
    page, slot, _ = ArenaPlan.item_bytes(layout)
    kw = dict(
        device_bytes=8 * page + 4 * slot,
        host_bytes=64 * page + 32 * slot,
        transfer="cpu",
        prefetch_threshold=PS,
    )
    kw.update(overrides)
    return HiCacheConfig(**kw)


def test_a_cache_on_a_byte_budget_serves_hits_from_both_tiers(one_rank_topology):
    cache = HiCache(one_rank_topology, make_spec(), _budget_config())
    dev = cache.device
    assert dev.arena is not None and internals(cache).host.arena is not None
    a = list(range(3 * PS))
    assert serve(cache, a).mismatches == 0
    again = serve(cache, a + [7] * PS)
    assert again.prefix == 3 * PS and again.served[0] == 3 * PS and again.mismatches == 0
    for i in range(6):  # push a out of L1: it comes back from L2
        serve(cache, [100 * (i + 1) + t for t in range(4 * PS)])
    cache.flush()
    back = serve(cache, a + [9] * PS)
    assert back.prefix == 3 * PS and back.mismatches == 0
    assert back.served[1] > 0  # some from host
    cache.flush()
    cache.check_integrity()
    cache.close()


def test_a_prompt_beyond_an_empty_l1_budget_is_uncached_and_evicts_nothing(one_rank_topology):
    cache = HiCache(one_rank_topology, make_spec(), _budget_config(enable_host=False))
    a = list(range(3 * PS))
    serve(cache, a)
    tree = internals(cache).tree

    def held():
        return [(n.id, n.device_indices, n.mamba_device_slot) for n in tree.iter_nodes()]

    before = held()
    too_long = list(range(5000, 5000 + (cache.device.max_pages + 1) * PS))
    assert serve(cache, too_long).cache_full
    assert held() == before
    assert cache.stats().evicted_device_pages == 0
    assert serve(cache, a + [1] * PS).prefix == 3 * PS
    cache.check_integrity()
    cache.close()


def test_budget_views_are_strided_over_one_buffer(one_rank_topology):
    cache = HiCache(one_rank_topology, make_spec(), _budget_config())
    dev = cache.device
    layer = dev.layers(Family.KV)[0]
    assert dev.k(layer).stride(0) * dev.k(layer).element_size() == dev.arena.plan.block_bytes
    assert dev.nbytes <= cache.config.device_bytes
    host = internals(cache).host
    assert host.nbytes <= cache.config.host_bytes
    assert len(host.buffers()) == 1 and host.buffers()[0].dtype == torch.uint8
    cache.close()


def test_runtime_serve_runs_on_byte_budgets(tmp_path, single_rank_group):
    out = tmp_path / "run.json"
    argv = [*TINY, "--cache", "host", "--device-bytes", "400000", "--host-bytes", "1600000"]
    assert serve_cli.main([*argv, "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["summary"]["hit_rate"] > 0 and run["summary"]["requests_uncached_l1"] == 0
    assert run["config"]["device_bytes"] == 400000


def test_l3_registers_the_one_contiguous_arena_buffer(one_rank_topology, tmp_path, monkeypatch):
    """A zero-copy backend (Mooncake) needs contiguous buffers: with a host arena the
    storage tier registers the arena's one buffer, never the strided region views."""
    seen: list[torch.Tensor] = []

    def record(self, buffer: torch.Tensor) -> None:
        tensor_bytes(buffer)  # what MooncakeStorage.register_buffer checks first
        seen.append(buffer)

    monkeypatch.setattr(FileStorage, "register_buffer", record)
    config = _budget_config(storage="file", storage_options={"root": str(tmp_path)})
    cache = HiCache(one_rank_topology, make_spec(), config)
    host = internals(cache).host
    assert [b.data_ptr() for b in seen] == [host.buffers()[0].data_ptr()]
    assert serve(cache, list(range(3 * PS))).mismatches == 0
    cache.close()
