"""One arena per tier (mesh_hicache/pools/arena.py): block accounting, placement,
fragmentation, the pools' views over it, transfers between arenas, the config, and the
window kind of a host arena (kv_window rows apart from pages)."""

from __future__ import annotations

import random

import pytest
import torch

from mesh_hicache.config import HiCacheConfig
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools import DevicePools, HostPools
from mesh_hicache.pools.arena import (
    ALIGN,
    MAX_WASTE,
    ArenaPlan,
    BlockArena,
    ItemKind,
    agreed_plan,
    default_block_bytes,
    mesh_plan,
)
from mesh_hicache.spec import Family
from mesh_hicache.transfer import CpuTransferEngine
from tests.unit.test_pools import spec, window_spec


def layout() -> StateLayout:
    return StateLayout.for_coords(spec(), (1, 1, 1), (0, 0, 0))


def plan_of(budget: int, block_bytes: int = 0) -> ArenaPlan:
    page, slot, _ = ArenaPlan.item_bytes(layout())
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
        assert plan.num_ids("page") == plan.num_blocks - plan.blocks_per_page + 1


def test_a_budget_below_one_page_or_state_is_a_value_error():
    page, slot, _ = ArenaPlan.item_bytes(layout())
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


@pytest.mark.parametrize("windows", [False, True], ids=["pages-slots", "three-kinds"])
def test_random_mixed_traffic_keeps_the_blocks_tiled(windows):
    rng = random.Random(9 if windows else 5)
    size = {"page": 2, "slot": 5}
    if windows:
        arena = windowed_arena(num_blocks=64, page=2, slot=5, window=1)
        spaces = {"page": arena.pages, "slot": arena.slots, "window": arena.windows}
        size["window"] = 1
    else:
        arena = small_arena(num_blocks=64, page=2, slot=5)
        spaces = {"page": arena.pages, "slot": arena.slots}
    held: dict[str, list[int]] = {kind: [] for kind in spaces}
    for _ in range(2000):
        kind = rng.choice(tuple(spaces))
        ids = spaces[kind]
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
        used = sum(size[k] * len(held[k]) for k in held)
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
    assert dev.k(0).shape[0] == dev.num_pages == plan.num_ids("page")
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


# -- a third kind: windows (kv_window rows apart from pages, the host arena) ---------------


def window_layout() -> StateLayout:
    return StateLayout.for_coords(window_spec(), (1, 1, 1), (0, 0, 0))


def window_plan(budget: int) -> ArenaPlan:
    page, slot, window = ArenaPlan.item_bytes(window_layout(), separate_windows=True)
    return ArenaPlan.for_budget(budget, page, slot, window_bytes=window)


def windowed_arena(num_blocks: int = 16, page: int = 2, slot: int = 3, window: int = 1):
    return BlockArena(ArenaPlan(num_blocks, ALIGN, page * ALIGN, slot * ALIGN, window * ALIGN))


@pytest.mark.parametrize(
    ("page", "slot", "window"),
    [(4096, 43008, 2048), (1 << 20, 26_800_000, 3 << 19), (2464, 0, 1232), (112, 96, 7000)],
)
def test_default_block_size_bounds_the_waste_of_all_three_kinds(page, slot, window):
    block = default_block_bytes(page, slot, window)
    assert block % ALIGN == 0
    for size in (page, slot, window):
        if size:
            blocks = -(-size // block)
            assert (blocks * block - size) / size <= MAX_WASTE, (size, block)
    assert default_block_bytes(page, slot, 0) == default_block_bytes(page, slot)


def test_item_bytes_keep_windows_in_the_page_unless_separate():
    lay = window_layout()
    page, slot, window = ArenaPlan.item_bytes(lay)
    assert window == 0
    sep_page, sep_slot, sep_window = ArenaPlan.item_bytes(lay, separate_windows=True)
    assert sep_slot == slot and sep_window >= lay.region("kv_window").row_bytes > 0
    assert sep_page + sep_window == page  # every row starts aligned either way
    # Without kv_window nothing is separate.
    assert ArenaPlan.item_bytes(layout(), separate_windows=True) == (*plan_of_items(), 0)


def plan_of_items() -> tuple[int, int]:
    page, slot, window = ArenaPlan.item_bytes(layout())
    assert window == 0
    return page, slot


def test_the_plan_counts_windows_per_kind():
    plan = ArenaPlan(20, ALIGN, 2 * ALIGN, 5 * ALIGN, ALIGN + 1)
    assert (plan.blocks_per_page, plan.blocks_per_slot, plan.blocks_per_window) == (2, 5, 2)
    assert (plan.num_ids("page"), plan.num_ids("slot"), plan.num_ids("window")) == (19, 16, 19)
    assert (plan.max_pages, plan.max_slots, plan.max_windows) == (10, 4, 10)
    no_windows = ArenaPlan(20, ALIGN, 2 * ALIGN, 5 * ALIGN)
    assert no_windows.num_ids("window") == no_windows.max_windows == 0
    assert BlockArena(no_windows).windows.capacity == 0
    assert not BlockArena(no_windows).windows.can_allocate(1)
    with pytest.raises(ValueError, match="unknown arena item kind"):
        plan.num_ids("state")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fewer than one page .* or one window"):
        ArenaPlan.for_budget(4 * ALIGN, ALIGN, 0, ALIGN, window_bytes=5 * ALIGN)


def test_three_kinds_share_the_blocks():
    arena = windowed_arena()  # 16 blocks: pages of 2, states of 3, windows of 1
    assert arena.pages.allocate(2) == [0, 2]
    assert arena.windows.allocate(3) == [4, 5, 6]  # from the low end, like pages
    assert arena.slots.allocate(2) == [10, 13]  # from the high end
    assert arena.free_blocks == 3 and arena.windows.num_free == 3
    assert arena.pages.num_free == 1 and arena.slots.num_free == 1
    assert arena.pages.allocate(1) == [7] and not arena.slots.can_allocate(1)
    assert arena.windows.allocate(1) == [9] and arena.free_blocks == 0
    with pytest.raises(ValueError, match="window id 0"):
        arena.windows.free([0])  # a page id is foreign to the window id space
    with pytest.raises(ValueError, match="double or foreign free of window id 4"):
        arena.windows.free([4, 4])
    # Fragmentation: freed windows are holes of one block; a state needs three in a row.
    arena.windows.free([4, 6])
    assert arena.free_blocks == 2 and not arena.slots.can_allocate(1)
    assert not arena.pages.can_allocate(1)  # 4 and 6 are not adjacent
    arena.windows.free([5])  # blocks 4-6 are one run now
    assert arena.slots.allocate(1) == [4]
    assert "windows=1 x 1" in repr(arena)
    arena.check_integrity()
    for kind in arena.kinds:
        kind.free(sorted(kind.allocated))
    assert arena.free_blocks == arena.largest_free_run == 16
    arena.check_integrity()


def test_integrity_check_covers_windows():
    arena = windowed_arena()
    arena.pages.allocate(1)  # blocks 0-1
    arena.windows.allocate(1)  # block 2
    arena.check_integrity()
    arena.windows.allocated.add(1)  # a window inside the page: overlap
    with pytest.raises(RuntimeError, match="overlaps another extent"):
        arena.check_integrity()
    arena.windows.allocated.discard(1)
    arena.windows.allocated.discard(2)  # block 2 neither free nor held
    with pytest.raises(RuntimeError, match="leaks block 2"):
        arena.check_integrity()


def test_region_views_use_the_id_space_of_their_kind():
    lay = window_layout()
    plan = window_plan(30_000)
    buffer = torch.zeros(plan.nbytes, dtype=torch.uint8)
    kinds: dict[str, ItemKind] = {"kv": "page", "indexer": "page", "kv_window": "window"}
    kinds |= {"mamba_conv": "slot", "mamba_ssm": "slot"}
    for region in lay.regions:
        view = plan.region_view(buffer, lay, region)
        assert view.shape == (plan.num_ids(kinds[region.name.value]), *region.local_shape)
        assert view.stride(0) * view.element_size() == plan.block_bytes
    # A window's row starts its item; the page's rows follow one another without it.
    window = plan.region_view(buffer, lay, lay.region("kv_window"))
    assert window.data_ptr() == buffer.data_ptr()
    indexer = plan.region_view(buffer, lay, lay.region("indexer"))
    kv_bytes = -(-lay.region("kv").row_bytes // ALIGN) * ALIGN
    assert indexer.data_ptr() == buffer.data_ptr() + kv_bytes
    # Without separate windows, kv_window is part of the page (the device arena).
    page, slot, _ = ArenaPlan.item_bytes(lay)
    joint = ArenaPlan.for_budget(30_000, page, slot)
    view = joint.region_view(
        torch.zeros(joint.nbytes, dtype=torch.uint8), lay, lay.region("kv_window")
    )
    assert view.shape[0] == joint.num_ids("page")


def test_windowed_host_arena_rows_never_overlap():
    lay = window_layout()
    plan = window_plan(30_000)
    host = HostPools(lay, arena=plan, pinned=False)
    assert host.arena is not None and host.window_allocator is host.arena.windows
    assert host.num_window_pages == plan.num_ids("window") == host.local("kv_window").shape[0]
    assert host.max_window_pages == plan.max_windows > 0
    assert host.max_pages == plan.max_pages and host.max_slots == plan.max_slots
    pages = host.page_allocator.allocate(3)
    windows = host.window_allocator.allocate(4)
    slots = host.slot_allocator.allocate(2)
    host.arena.check_integrity()
    ids = {"kv": pages, "indexer": pages, "kv_window": windows}
    ids |= {"mamba_conv": slots, "mamba_ssm": slots}
    values: dict[tuple[str, int], int] = {}
    for region in lay.regions:  # a distinct byte in every allocated row of every region
        for i in ids[region.name.value]:
            values[(region.name.value, i)] = v = len(values) + 1
            row = host.row(region.name, i)
            assert row.is_contiguous() and row.shape == region.local_shape
            row.view(torch.uint8).fill_(v)
    for (name, i), v in values.items():
        assert host.row(name, i).view(torch.uint8).eq(v).all(), (name, i)
    (buffer,) = host.buffers()
    written = sum(lay.region(name).row_bytes for name, _ in values)
    assert int(buffer.ne(0).sum()) == written
    # A windowed layout's host arena needs the window kind; a device arena must not have it.
    page, slot, _ = ArenaPlan.item_bytes(lay)
    with pytest.raises(ValueError, match="needs a window kind"):
        HostPools(lay, arena=ArenaPlan.for_budget(30_000, page, slot), pinned=False)
    with pytest.raises(ValueError, match="keeps kv_window in its pages"):
        DevicePools(lay, arena=plan)


def test_host_from_ratio_of_a_windowed_device_arena_separates_windows():
    lay = window_layout()
    page, slot, _ = ArenaPlan.item_bytes(lay)
    dev = DevicePools(lay, arena=ArenaPlan.for_budget(20_000, page, slot))
    assert dev.arena is not None
    host = HostPools.from_ratio(dev, 2.5, pinned=False)
    assert host.arena is not None
    p, d = host.arena.plan, dev.arena.plan
    assert (p.num_blocks, p.block_bytes) == (int(2.5 * d.num_blocks), d.block_bytes)
    assert (p.page_bytes, p.slot_bytes, p.window_bytes) == ArenaPlan.item_bytes(lay, True)
    assert host.num_window_pages == p.num_ids("window")


class _OneRank:
    """Stands in for a Consensus of one rank; counts the collectives."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def min_max(self, values):
        self.calls.append(list(values))
        return list(values), list(values)


def test_agreed_and_mesh_plans_with_windows():
    lay = window_layout()
    agree = _OneRank()
    plan = agreed_plan(lay, 30_000, agree, separate_windows=True)  # type: ignore[arg-type]
    assert len(agree.calls) == 1  # budget, page, slot and window bytes in one collective
    assert plan == window_plan(30_000) and plan.window_bytes > 0
    assert plan == mesh_plan(window_spec(), (1, 1, 1), "replicate", 30_000, 0, True)
    device = agreed_plan(lay, 30_000, agree)  # type: ignore[arg-type]
    assert device.window_bytes == 0 and len(agree.calls) == 2
    assert device == mesh_plan(window_spec(), (1, 1, 1), "replicate", 30_000)


def windowed_arena_round_trip(device: str, pinned: bool, make_engine) -> None:
    """Random bits in 3 pages of a windowed device arena (kv_window inside its pages) ->
    a host arena with a window kind, the windows of 2 of the pages by their own (reversed)
    ids -> back, bit-exact; the page whose window was not copied keeps zeros there.
    Shared with tests/gpu/test_arena_cuda.py."""
    lay = window_layout()
    gen = torch.Generator().manual_seed(4)
    page, slot, _ = ArenaPlan.item_bytes(lay)
    dev = DevicePools(lay, arena=ArenaPlan.for_budget(20_000, page, slot), device=device)
    host = HostPools(lay, arena=window_plan(40_000), pinned=pinned)
    pages, slots = dev.page_allocator.allocate(3), dev.slot_allocator.allocate(1)
    views = {(layer, name): getattr(dev, name) for layer in dev.layers(Family.KV) for name in "kv"}
    for (layer, _), fn in views.items():
        t = fn(layer)
        raw = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=gen)
        t.copy_(raw.to(torch.uint8).view(t.dtype).view(t.shape))
    want = {key: fn(key[0]).cpu() for key, fn in views.items()}
    host_pages = host.page_allocator.allocate(3)
    host_windows = host.window_allocator.allocate(2)[::-1]  # two of the three, reversed
    host_slots = host.slot_allocator.allocate(1)
    windowed = window_spec().window_layer_ids
    with make_engine(dev, host) as engine:
        pairs = ((pages, host_pages), (slots, host_slots), (pages[1:], host_windows))
        assert engine.backup(*pairs).wait()
        for (layer, _), fn in views.items():
            fn(layer).zero_()
        assert engine.load(*pairs).wait()
    for (layer, name), fn in views.items():
        ids = pages[1:] if layer in windowed else pages
        got = fn(layer)[ids].cpu()
        assert torch.equal(got.view(torch.uint8), want[(layer, name)][ids].view(torch.uint8))
        if layer in windowed:  # the page loaded without its window stays zero
            assert fn(layer)[pages[0]].view(torch.uint8).eq(0).all()


def test_backup_and_load_between_windowed_arenas_are_bit_exact():
    windowed_arena_round_trip("cpu", False, CpuTransferEngine)
