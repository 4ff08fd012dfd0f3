"""The parts of ``mesh_hicache/tiers/`` on their own: the lease protocol, agreed allocation
with its hooks, the stats arithmetic and the layout's region filters and byte sizes."""

from __future__ import annotations

import pytest
import torch

from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.radix import RadixKey, RadixTree
from mesh_hicache.stats import CacheStats
from mesh_hicache.tiers import CacheFull, EvictHooks, Lease, TierAllocator
from tests.unit.cache_support import PS, make_spec


def _tree_with_path() -> tuple[RadixTree, list]:
    """A tree holding one key of 2 pages split into two nodes (a parent and a child)."""
    tree = RadixTree(PS, has_mamba=False)
    tree.insert(RadixKey(tuple(range(2 * PS))), device_indices=[0, 1])
    tree.insert(RadixKey(tuple(range(PS)) + (99,) * PS), device_indices=[0, 2])
    m = tree.match_prefix(RadixKey(tuple(range(2 * PS))), touch=False)
    assert len(m.nodes) == 2
    return tree, list(m.nodes)


def test_lease_counts_each_protection_once():
    tree, (parent, child) = _tree_with_path()
    lease = Lease(tree)
    lease.hold(child)
    assert (parent.lock_ref, child.lock_ref, parent.host_ref, child.host_ref) == (1, 1, 1, 1)
    lease.move(parent, host=False)  # the lock moves up, the host protection stays
    assert (parent.lock_ref, child.lock_ref) == (1, 0)
    assert (parent.host_ref, child.host_ref) == (1, 1)
    assert lease.locked == (parent,) and lease.protected == (child,)
    lease.move(child, host=True)
    assert (parent.lock_ref, child.lock_ref, parent.host_ref, child.host_ref) == (1, 1, 1, 1)
    lease.release()
    assert (parent.lock_ref, child.lock_ref, parent.host_ref, child.host_ref) == (0, 0, 0, 0)
    lease.release()  # nothing left to drop: no double unlock
    assert lease.locked == () and lease.protected == ()


class _Hooks:
    """Records what the allocator asked of the tiers above it."""

    def __init__(self, in_flight: bool) -> None:
        self.busy = in_flight
        self.drains = 0

    def hooks(self) -> EvictHooks:
        return EvictHooks(write_back=lambda: None, in_flight=lambda: self.busy, drain=self.drain)

    def drain(self) -> None:
        self.drains += 1
        self.busy = False


def _allocator(group, hooks: EvictHooks) -> tuple[TierAllocator, RadixTree, CacheStats]:
    """4 device pages and 2 slots, no host tier."""
    layout = StateLayout.for_coords(make_spec(), (1, 1, 1), (0, 0, 0))
    device = DevicePools(layout, num_pages=4, num_slots=2, device=torch.device("cpu"))
    stats = CacheStats()
    tree = RadixTree(PS, has_mamba=True)
    return TierAllocator(device, None, tree, Consensus(group), stats, hooks), tree, stats


@pytest.mark.parametrize("in_flight", [False, True])
def test_cache_full_drains_in_flight_work_once_then_raises(single_rank_group, in_flight):
    rec = _Hooks(in_flight)
    alloc, _, _ = _allocator(single_rank_group, rec.hooks())
    got = alloc.alloc_device_pages(3)
    with pytest.raises(CacheFull, match="cannot allocate 2 device pages"):
        alloc.alloc_device_pages(2)
    assert rec.drains == (1 if in_flight else 0)
    alloc.free_device(pages=got)
    assert sorted(alloc.alloc_device_pages(4)) == [0, 1, 2, 3]  # the failed try kept nothing


def test_reclaim_counts_what_eviction_freed(single_rank_group):
    rec = _Hooks(False)
    alloc, tree, stats = _allocator(single_rank_group, rec.hooks())
    pages = alloc.alloc_device_pages(2)
    slot = alloc.alloc_device_slot()
    tree.insert(RadixKey(tuple(range(2 * PS))), device_indices=pages, mamba_device_slot=slot)
    assert alloc.alloc_device_pages(4)  # evicts the node: its 2 pages and its slot
    assert (stats.evicted_device_pages, stats.evicted_device_slots) == (2, 1)
    assert alloc.alloc_device_slot() in (0, 1)


def test_stats_record_arithmetic():
    s = CacheStats()
    s.record_request(20, (4, 8, 4), 16, "host")
    s.record_request(10, (0, 0, 0), 0, None)
    assert (s.requests, s.prompt_tokens, s.hit_tokens, s.raw_kv_hit_tokens) == (2, 30, 16, 16)
    assert (s.hit_tokens_device, s.hit_tokens_host, s.hit_tokens_storage) == (4, 8, 4)
    assert (s.mamba_hits_host, s.mamba_hits_device) == (1, 0)
    s.record_load(True, 1000, 0.5)
    s.record_load(False, 0, 0.0)
    assert (s.bytes_host_to_device, s.load_failures, s.load_gbps) == (1000, 1, 2e-6)
    s.record_backup(True, 300)
    s.record_backup(False, 300)
    assert (s.bytes_device_to_host, s.backup_failures) == (300, 1)
    s.record_put(3, 1, 120)
    s.record_get(2, 50)
    assert (s.storage_put_objects, s.storage_put_dropped, s.bytes_host_to_storage) == (3, 1, 120)
    assert (s.storage_get_misses, s.bytes_storage_to_host) == (2, 50)
    s.record_skip("backup")
    s.record_skip("prefetch")
    assert (s.backup_skipped_host_full, s.prefetch_skipped_host_full) == (1, 1)


def test_held_regions_and_byte_sizes_follow_the_stage():
    spec = make_spec()  # KV layers 1, 3; Mamba layers 0, 2 (fp32 everywhere)
    kv, m = spec.kv, spec.mamba
    assert kv is not None and m is not None
    page = 2 * 2 * PS * kv.num_kv_heads * kv.head_dim * 4  # 2 layers x (K, V) x T x H x D
    slot = 2 * (m.conv_dim * (m.conv_kernel - 1) + m.num_heads * m.head_dim * m.state_dim) * 4
    one = StateLayout.for_coords(spec, (1, 1, 1), (0, 0, 0))
    assert [r.name.value for r in one.held_regions(paged=True)] == ["kv"]
    assert [r.name.value for r in one.held_regions(paged=False)] == ["mamba_conv", "mamba_ssm"]
    assert (one.page_bytes, one.slot_bytes) == (page, slot)
    # pp=2, tp=2: each stage holds one layer of each family, each tp rank half the heads.
    quarter = StateLayout.for_coords(spec, (2, 1, 2), (1, 0, 1))
    assert (quarter.page_bytes, quarter.slot_bytes) == (page // 4, slot // 4)
    assert len(quarter.held_regions()) == 3
