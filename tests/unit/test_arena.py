"""One arena per tier (mesh_hicache/pools/arena.py): block accounting, placement,
fragmentation, the pools' views over it, transfers between arenas, and the config."""

from __future__ import annotations

import random

import pytest
import torch

from mesh_hicache.config import HiCacheConfig
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools import DevicePools, HostPools
from mesh_hicache.pools.arena import ALIGN, MAX_WASTE, ArenaPlan, BlockArena, default_block_bytes
from mesh_hicache.spec import Family
from mesh_hicache.transfer import CpuTransferEngine
from tests.unit.test_pools import spec


def layout() -> StateLayout:
    return StateLayout.for_coords(spec(), (1, 1, 1), (0, 0, 0))


def plan_of(budget: int, block_bytes: int = 0) -> ArenaPlan:
    page, slot = ArenaPlan.item_bytes(layout())
    return ArenaPlan.for_budget(budget, page, slot, block_bytes)


# -- the plan ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("page", "slot"),
    [(4096, 43008), (1 << 20, 26_800_000), (64, 64), (2464, 288), (112, 0), (4000, 96)],
)
def test_default_block_size_bounds_rounding_waste(page, slot):
    block = default_block_bytes(page, slot)
    assert block % ALIGN == 0
    for size in (page, slot):
        if size:
            blocks = -(-size // block)
            assert (blocks * block - size) / size <= MAX_WASTE, (size, block)


def test_budget_is_never_exceeded_and_counts_are_derived():
    for budget in (7_000, 20_000, 123_457):
        plan = plan_of(budget)
        assert plan.nbytes <= budget < plan.nbytes + plan.block_bytes
        assert plan.blocks_per_page * plan.block_bytes >= plan.page_bytes
        assert plan.blocks_per_slot * plan.block_bytes >= plan.slot_bytes
        assert plan.max_pages == plan.num_blocks // plan.blocks_per_page
        assert plan.num_ids(True) == plan.num_blocks - plan.blocks_per_page + 1


def test_a_budget_below_one_page_or_state_is_a_value_error():
    page, slot = ArenaPlan.item_bytes(layout())
    with pytest.raises(ValueError, match="fewer than one page"):
        ArenaPlan.for_budget(page - 1, page, slot)
    with pytest.raises(ValueError, match="block_bytes a positive multiple"):
        ArenaPlan(num_blocks=4, block_bytes=24, page_bytes=48, slot_bytes=0)


# -- block accounting --------------------------------------------------------------------


def small_arena(num_blocks: int = 12, page: int = 1, slot: int = 3) -> BlockArena:
    return BlockArena(ArenaPlan(num_blocks, ALIGN, page * ALIGN, slot * ALIGN))


def test_pages_grow_from_the_low_end_and_states_from_the_high_end():
    arena = small_arena()
    assert arena.pages.allocate(3) == [0, 1, 2]
    assert arena.slots.allocate(2) == [6, 9]  # blocks 6-8 and 9-11
    assert arena.free_blocks == 3 and arena.used_blocks == 9
    assert arena.pages.num_free == 3 and arena.slots.num_free == 1
    assert arena.slots.allocate(1) == [3] and arena.free_blocks == 0
    assert not arena.pages.can_allocate(1) and not arena.slots.can_allocate(1)
    with pytest.raises(RuntimeError, match="cannot allocate 1 pages"):
        arena.pages.allocate(1)
    arena.slots.free([6])
    assert arena.pages.allocate(3) == [6, 7, 8]  # a freed state's blocks serve pages
    arena.check_integrity()


def test_frees_are_checked_and_all_or_nothing():
    arena = small_arena()
    pages = arena.pages.allocate(2)
    slot = arena.slots.allocate(1)[0]
    with pytest.raises(ValueError, match="double or foreign free of page id 5"):
        arena.pages.free([pages[0], 5])
    assert not arena.pages.is_free(pages[0])  # not freed by the failed call
    with pytest.raises(ValueError, match="page id 0"):
        arena.pages.free([0, 0])
    with pytest.raises(ValueError, match="slot id 0"):
        arena.slots.free([0])  # a page id is foreign to the slot id space
    with pytest.raises(ValueError, match="foreign"):
        arena.pages.is_free(arena.pages.capacity)
    arena.pages.free(pages)
    arena.slots.free([slot])
    assert arena.free_blocks == 12 and arena.largest_free_run == 12
    arena.check_integrity()


def test_fragmentation_a_state_needs_consecutive_blocks():
    """Stated behaviour: scattered page holes serve pages, never a state, until a run
    of ``blocks_per_slot`` free blocks exists (the caller evicts until then)."""
    arena = small_arena(num_blocks=10, page=1, slot=3)
    arena.pages.allocate(10)
    arena.pages.free([1, 3, 5, 7])
    assert arena.free_blocks == 4 and arena.largest_free_run == 1
    assert not arena.slots.can_allocate(1) and arena.slots.num_free == 0
    assert arena.pages.can_allocate(4)
    arena.pages.free([2])  # blocks 1-3 are one run now
    assert arena.slots.allocate(1) == [1]
    arena.check_integrity()


def test_random_mixed_traffic_keeps_the_blocks_tiled():
    rng = random.Random(5)
    arena = small_arena(num_blocks=64, page=2, slot=5)
    held: dict[str, list[int]] = {"page": [], "slot": []}
    for _ in range(2000):
        kind = rng.choice(("page", "slot"))
        ids = arena.pages if kind == "page" else arena.slots
        if held[kind] and rng.random() < 0.45:
            victims = rng.sample(held[kind], rng.randint(1, len(held[kind])))
            ids.free(victims)
            held[kind] = [i for i in held[kind] if i not in victims]
        else:
            n = rng.randint(1, 3)
            fits = ids.can_allocate(n)
            assert fits == (ids.num_free >= n)
            if fits:
                held[kind] += ids.allocate(n)
        used = 2 * len(held["page"]) + 5 * len(held["slot"])
        assert used == arena.used_blocks <= arena.num_blocks
    arena.check_integrity()


# -- the pools over an arena -------------------------------------------------------------


def test_device_views_match_the_fixed_pools_and_never_overlap_across_items():
    lay = layout()
    plan = plan_of(20_000)
    dev = DevicePools(lay, arena=plan)
    fixed = DevicePools(lay, num_pages=5, num_slots=3)
    for name in ("k", "v"):
        for layer in dev.layers(Family.KV):
            assert getattr(dev, name)(layer).shape[1:] == getattr(fixed, name)(layer).shape[1:]
    assert dev.indexer(2).shape[1:] == fixed.indexer(2).shape[1:]
    assert dev.conv(1).shape[1:] == fixed.conv(1).shape[1:]
    assert dev.ssm(4).shape[1:] == fixed.ssm(4).shape[1:]
    assert dev.k(0).shape[0] == dev.num_pages == plan.num_ids(True)
    assert dev.nbytes == plan.nbytes <= 20_000
    pages = dev.page_allocator.allocate(3)
    slots = dev.slot_allocator.allocate(2)
    # Each item gets its own value in every layer; nothing may bleed into another item.
    for v, p in enumerate(pages, 1):
        for layer in dev.layers(Family.KV):
            dev.k(layer)[p] = v
            dev.v(layer)[p] = -v
        dev.indexer(2)[p] = v
    for v, s in enumerate(slots, 10):
        for layer in dev.layers(Family.MAMBA):
            dev.conv(layer)[s] = v
            dev.ssm(layer)[s] = v
    for v, p in enumerate(pages, 1):
        for layer in dev.layers(Family.KV):
            assert dev.k(layer)[p].eq(v).all() and dev.v(layer)[p].eq(-v).all()
        assert dev.indexer(2)[p].eq(v).all()
    for v, s in enumerate(slots, 10):
        for layer in dev.layers(Family.MAMBA):
            assert dev.conv(layer)[s].eq(v).all() and dev.ssm(layer)[s].eq(v).all()
    with pytest.raises(ValueError, match="excludes num_pages"):
        DevicePools(lay, num_pages=2, arena=plan)


def test_host_rows_are_contiguous_views_of_one_buffer():
    lay = layout()
    plan = plan_of(20_000)
    host = HostPools(lay, arena=plan, pinned=False)
    (buffer,) = host.buffers()
    assert buffer.is_contiguous() and buffer.numel() == plan.nbytes == host.nbytes
    page = host.page_allocator.allocate(1)[0]
    slot = host.slot_allocator.allocate(1)[0]
    for region in lay.regions:
        index = page if region.paged else slot
        row = host.row(region.name, index)
        assert row.is_contiguous() and row.shape == region.local_shape
        row.view(torch.uint8).fill_(7)
    assert int(buffer.eq(7).sum()) == sum(r.row_bytes for r in lay.regions)


def arena_round_trip(device: str, host_arena: bool, pinned: bool, make_engine) -> None:
    """Random bits in 3 pages and 2 states of a device arena -> host (arena or fixed) ->
    back into other device ids: bit-exact. Shared with tests/gpu/test_arena_cuda.py."""
    lay = layout()
    gen = torch.Generator().manual_seed(3)
    dev = DevicePools(lay, arena=plan_of(20_000), device=device)
    if host_arena:
        host = HostPools(lay, arena=plan_of(60_000), pinned=pinned)
    else:
        host = HostPools(lay, num_pages=9, num_slots=4, pinned=pinned)
    pages, slots = dev.page_allocator.allocate(3), dev.slot_allocator.allocate(2)
    kv_layers = dev.layers(Family.KV)
    views = [(fn, layer) for layer in kv_layers for fn in (dev.k, dev.v)] + [(dev.indexer, 2)]
    state_views = [(fn, layer) for layer in dev.layers(Family.MAMBA) for fn in (dev.conv, dev.ssm)]

    def fill(ids, fns):
        for fn, layer in fns:
            t = fn(layer)[ids]
            raw = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=gen)
            fn(layer)[ids] = raw.to(torch.uint8).view(t.dtype).view(t.shape).to(device)

    fill(pages, views)
    fill(slots, state_views)
    want = [fn(layer)[pages].cpu() for fn, layer in views]
    want_state = [fn(layer)[slots].cpu() for fn, layer in state_views]
    host_pages, host_slots = host.page_allocator.allocate(3), host.slot_allocator.allocate(2)
    with make_engine(dev, host) as engine:
        assert engine.backup((pages, host_pages), (slots, host_slots)).wait()
        dev.page_allocator.free(pages)
        dev.slot_allocator.free(slots)
        dev.page_allocator.allocate(1)  # other ids this time
        dev.slot_allocator.allocate(1)
        new_pages, new_slots = dev.page_allocator.allocate(3), dev.slot_allocator.allocate(2)
        assert new_pages != pages and new_slots != slots
        for fn, layer in views:  # what is not loaded back must not survive
            fn(layer)[new_pages] = 0
        for fn, layer in state_views:
            fn(layer)[new_slots] = 0
        assert engine.load((new_pages, host_pages), (new_slots, host_slots)).wait()
    got = [fn(layer)[new_pages].cpu() for fn, layer in views]
    got_state = [fn(layer)[new_slots].cpu() for fn, layer in state_views]
    for a, b in zip(want + want_state, got + got_state, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("host_arena", [True, False])
def test_backup_and_load_between_arenas_are_bit_exact(host_arena):
    arena_round_trip("cpu", host_arena, False, CpuTransferEngine)


# -- the config --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of device_pages"),
        ({"device_pages": 4, "device_bytes": 1 << 20}, "device_bytes=1048576"),
        ({"device_bytes": 1 << 20, "device_mamba_slots": 2}, "device_mamba_slots=2"),
        ({"device_bytes": 1 << 20, "host_bytes": 1 << 22, "host_pages": 3}, "host_pages=3"),
        ({"device_bytes": 1 << 20, "block_bytes": 24}, "multiple of 16, got 24"),
        ({"device_pages": 4, "block_bytes": 64}, "block_bytes=64 needs"),
        ({"device_bytes": -5}, "device_bytes must be >= 0, got -5"),
    ],
)
def test_config_budget_errors_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HiCacheConfig(**kwargs)


def test_config_budget_defaults():
    cfg = HiCacheConfig(device_bytes=1000)
    assert cfg.host_arena_bytes() == 4000 and cfg.mamba_device_slots() == 0
    assert cfg.num_host_pages() == 0 and cfg.mamba_host_slots() == 0
    fixed_host = HiCacheConfig(device_bytes=1000, host_pages=7)
    assert fixed_host.host_arena_bytes() == 0 and fixed_host.num_host_pages() == 7
    legacy = HiCacheConfig(device_pages=40)
    assert legacy.mamba_device_slots() == 10 and legacy.host_arena_bytes() == 0
    with pytest.raises(TypeError, match="device_bytes must be an int"):
        HiCacheConfig(device_bytes=1.5e9)


def test_host_from_ratio_of_a_device_arena_is_an_arena():
    dev = DevicePools(layout(), arena=plan_of(20_000))
    host = HostPools.from_ratio(dev, 2.5, pinned=False)
    assert host.arena is not None and dev.arena is not None
    assert host.arena.plan.num_blocks == int(2.5 * dev.arena.plan.num_blocks)
    assert host.arena.plan.block_bytes == dev.arena.plan.block_bytes
