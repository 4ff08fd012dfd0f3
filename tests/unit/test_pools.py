"""PageAllocator, DevicePools and HostPools (single process)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools import DevicePools, HostPools, PageAllocator
from mesh_hicache.spec import Family, IndexerSpec, KVSpec, MambaSpec, StateSpec, WindowSpec


def spec() -> StateSpec:
    return StateSpec(
        model_id="test-model",
        page_size=8,
        kv=KVSpec(layer_ids=(0, 2, 3), num_kv_heads=4, head_dim=6, dtype=torch.bfloat16),
        mamba=MambaSpec(
            layer_ids=(1, 4),
            conv_dim=8,
            conv_kernel=4,
            num_heads=4,
            head_dim=2,
            state_dim=3,
            ssm_dtype=torch.float16,
        ),
        indexer=IndexerSpec(layer_ids=(2,), key_dim=5),
    )


def test_allocator_lowest_first_and_accounting():
    a = PageAllocator(6)
    assert a.allocate(3) == [0, 1, 2]
    assert (a.num_free, a.num_used, a.capacity) == (3, 3, 6)
    a.free([1])
    assert a.is_free(1) and not a.is_free(0)
    assert a.allocate(2) == [1, 3]
    assert not a.can_allocate(3) and a.can_allocate(2)
    with pytest.raises(RuntimeError, match="only 2 free"):
        a.allocate(3)
    assert a.num_free == 2  # a failed allocation takes nothing
    a.check_integrity()


def test_allocator_errors_are_all_or_nothing():
    a = PageAllocator(4)
    a.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        a.free([0, 2])
    assert not a.is_free(0)  # index 0 was not freed by the failed call
    with pytest.raises(ValueError, match="double free"):
        a.free([1, 1])
    with pytest.raises(ValueError, match="foreign"):
        a.free([4])
    with pytest.raises(ValueError, match="foreign"):
        a.free([-1])
    a.free([0, 1])
    assert a.num_free == 4
    a.check_integrity()


def test_allocator_is_deterministic():
    def run(seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        a = PageAllocator(32)
        held: list[int] = []
        out = []
        for _ in range(200):
            if held and rng.random() < 0.5:
                k = rng.randint(1, len(held))
                rng.shuffle(held)
                a.free(held[:k])
                held = held[k:]
            else:
                n = rng.randint(0, 5)
                if a.can_allocate(n):
                    got = a.allocate(n)
                    out.append(got)
                    held += got
        a.check_integrity()
        return out

    assert run(1) == run(1)


def test_device_pool_shapes():
    lay = StateLayout.for_coords(spec(), (1, 2, 2), (0, 1, 1), cp_kv="shard")
    dev = DevicePools(lay, num_pages=5, num_slots=3)
    assert dev.k(0).shape == (5, 4, 2, 6) and dev.k(0).dtype == torch.bfloat16
    assert dev.v(3).shape == (5, 4, 2, 6) and dev.v(3).is_contiguous()
    assert dev.indexer(2).shape == (5, 4, 5)
    assert dev.conv(1).shape == (3, 4, 3)
    assert dev.ssm(4).shape == (3, 2, 2, 3) and dev.ssm(4).dtype == torch.float16
    assert dev.layers(Family.KV) == (0, 2, 3)
    dev.k(2)[1] = 1
    assert dev.k(2)[1].eq(1).all() and dev.v(2).eq(0).all() and dev.k(0).eq(0).all()
    with pytest.raises(ValueError, match="layer 1 has no kv"):
        dev.k(1)
    with pytest.raises(ValueError, match="no indexer"):
        dev.indexer(0)
    assert dev.page_allocator.capacity == 5 and dev.slot_allocator.capacity == 3


def test_host_pool_is_page_first():
    lay = StateLayout.for_coords(spec(), (1, 1, 1), (0, 0, 0))
    host = HostPools(lay, num_pages=4, num_slots=2, pinned=False)
    kv = host.local("kv")
    assert kv.shape == (4, 3, 2, 8, 4, 6) and kv.is_contiguous()
    for p in range(4):
        row = host.row("kv", p)
        assert row.is_contiguous()
        # One page of every layer is one run; consecutive pages are adjacent runs.
        assert row.data_ptr() == kv.data_ptr() + p * lay.region("kv").row_bytes
        assert row.numel() * row.element_size() == lay.region("kv").row_bytes
    assert host.row("mamba_ssm", 1).shape == (2, 4, 2, 3)
    with pytest.raises(IndexError):
        host.row("mamba_conv", 2)
    with pytest.raises(ValueError, match="topology"):
        host.dtensor("kv")


def test_host_pool_sizing(single_rank_group):
    lay = StateLayout.for_coords(spec(), (1, 1, 1), (0, 0, 0))
    dev = DevicePools(lay, num_pages=10, num_slots=4)
    host = HostPools.from_ratio(dev, 2.5, pinned=False)
    assert (host.num_pages, host.num_slots) == (25, 10)
    assert host.page_allocator.capacity == 25 and host.slot_allocator.capacity == 10

    page = sum(r.row_bytes for r in lay.regions if r.paged)
    slot = sum(r.row_bytes for r in lay.regions if not r.paged)
    budget = 7 * (page + 0.5 * slot) + 1
    consensus = Consensus(single_rank_group)
    sized = HostPools.from_bytes(lay, int(budget), consensus, slots_per_page=0.5, pinned=False)
    assert (sized.num_pages, sized.num_slots) == (7, 3)
    assert sized.nbytes <= budget
    with pytest.raises(ValueError, match="ratio"):
        HostPools.from_ratio(dev, 0)


# -- windowed layers: kv_window rows have an id space of their own -------------------------


def window_spec() -> StateSpec:
    """:func:`spec` with KV layers 0 and 3 sliding-window (their K/V in ``kv_window``)."""
    group = WindowSpec(layer_ids=(0, 3), window=8, sink_tokens=1)
    return dataclasses.replace(spec(), windows=(group,))


def fill_distinct(host: HostPools, ids: dict[str, list[int]]) -> dict[tuple[str, int], int]:
    """A distinct byte value in every given row of every region (``ids`` by region name);
    the value each (region, id) got."""
    values: dict[tuple[str, int], int] = {}
    for region in host.layout.regions:
        for i in ids[region.name.value]:
            values[(region.name.value, i)] = v = len(values) + 1
            host.row(region.name, i).view(torch.uint8).fill_(v)
    return values


def check_distinct(host: HostPools, values: dict[tuple[str, int], int]) -> None:
    for (name, i), v in values.items():
        assert host.row(name, i).view(torch.uint8).eq(v).all(), (name, i)


def test_fixed_host_pool_has_a_window_id_space():
    lay = StateLayout.for_coords(window_spec(), (1, 1, 1), (0, 0, 0))
    host = HostPools(lay, num_pages=6, num_slots=2, num_window_pages=3, pinned=False)
    assert (host.num_pages, host.num_slots, host.num_window_pages) == (6, 2, 3)
    assert host.window_allocator.capacity == 3 and host.max_window_pages == 3
    assert host.page_allocator.capacity == 6 and host.max_pages == 6
    region = lay.region("kv_window")
    assert host.local("kv_window").shape == (3, *region.local_shape)
    assert host.local("kv").shape[0] == 6 and host.local("indexer").shape[0] == 6
    for i in range(3):
        row = host.row("kv_window", i)
        assert row.is_contiguous() and row.numel() * row.element_size() == region.row_bytes
    with pytest.raises(IndexError):
        host.row("kv_window", 3)
    values = fill_distinct(
        host,
        {
            "kv": list(range(6)),
            "indexer": list(range(6)),
            "kv_window": list(range(3)),
            "mamba_conv": [0, 1],
            "mamba_ssm": [0, 1],
        },
    )
    check_distinct(host, values)
    assert host.nbytes == sum(
        r.row_bytes * {"kv_window": 3, "mamba_conv": 2, "mamba_ssm": 2}.get(r.name.value, 6)
        for r in lay.regions
    )
    assert "windows=3" in repr(host)
    # Default: one window id per page.
    same = HostPools(lay, num_pages=5, num_slots=1, pinned=False)
    assert same.num_window_pages == same.window_allocator.capacity == 5
    with pytest.raises(ValueError, match="num_window_pages=-1"):
        HostPools(lay, num_pages=5, num_window_pages=-1, pinned=False)


def test_host_pool_without_windows_is_unchanged():
    lay = StateLayout.for_coords(spec(), (1, 1, 1), (0, 0, 0))
    host = HostPools(lay, num_pages=4, num_slots=2, num_window_pages=9, pinned=False)
    assert host.num_window_pages == host.max_window_pages == 0
    assert isinstance(host.window_allocator, PageAllocator)
    assert host.window_allocator.capacity == 0
    assert [r.name.value for r in lay.regions] == ["kv", "indexer", "mamba_conv", "mamba_ssm"]
    assert host.local("kv").shape[0] == 4 and host.local("mamba_ssm").shape[0] == 2


def test_windowed_host_pool_sizing(single_rank_group):
    lay = StateLayout.for_coords(window_spec(), (1, 1, 1), (0, 0, 0))
    dev = DevicePools(lay, num_pages=10, num_slots=4)
    host = HostPools.from_ratio(dev, 2.5, pinned=False)
    assert (host.num_pages, host.num_slots, host.num_window_pages) == (25, 10, 25)
    assert host.window_allocator.capacity == 25
    # One window row per page in the byte cost (kv_window is a paged region).
    page = sum(r.row_bytes for r in lay.regions if r.paged)
    assert page == sum(lay.region(n).row_bytes for n in ("kv", "kv_window", "indexer"))
    slot = sum(r.row_bytes for r in lay.regions if not r.paged)
    budget = int(7 * (page + 0.5 * slot) + 1)
    sized = HostPools.from_bytes(
        lay, budget, Consensus(single_rank_group), slots_per_page=0.5, pinned=False
    )
    assert (sized.num_pages, sized.num_slots, sized.num_window_pages) == (7, 3, 7)
    assert sized.nbytes <= budget
