"""Windowed KV in its own region: ``kv`` holds the full-attention layers, ``kv_window``
the sliding-window ones (layout, device pools, transfer segments, reshard plans)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from mesh_hicache.choices import CpKvMode
from mesh_hicache.layout import RegionName, StateLayout, all_layouts
from mesh_hicache.pools import DevicePools, HostPools
from mesh_hicache.pools.arena import ArenaPlan
from mesh_hicache.spec import Family, KVSpec, StateSpec, WindowSpec
from mesh_hicache.tiers.reshard import MeshLayoutId, plan_source, row_maps
from mesh_hicache.topology import all_coordinates
from mesh_hicache.transfer import CpuTransferEngine
from mesh_hicache.transfer.segments import build_segments
from tests.unit.test_layout import MESHES, hybrid_spec, kv_only_spec
from tests.unit.transfer_support import randomize, same_bits, snapshot

KV_REGIONS = (RegionName.KV, RegionName.KV_WINDOW)


def windowed_spec(windows: tuple[tuple[int, ...], ...], num_layers: int = 6) -> StateSpec:
    """Attention on every layer, ``windows`` the layer ids of each window group."""
    return StateSpec(
        model_id="test-model",
        page_size=4,
        kv=KVSpec(layer_ids=tuple(range(num_layers)), num_kv_heads=2, head_dim=2),
        windows=tuple(WindowSpec(layer_ids=ids, window=4 + g) for g, ids in enumerate(windows)),
    )


def hybrid_windowed() -> StateSpec:
    """test_layout's hybrid spec (KV 0 1 2 4 7, Mamba 3 5 6, indexer 1 4), 0 2 7 windowed."""
    group = WindowSpec(layer_ids=(0, 2, 7), window=4, sink_tokens=1)
    return dataclasses.replace(hybrid_spec(2), windows=(group,))


def names(lay: StateLayout) -> list[str]:
    return [r.name.value for r in lay.regions]


def test_spec_splits_kv_layers_into_full_and_windowed() -> None:
    spec = windowed_spec(((4, 5), (0, 2)))
    assert spec.window_layer_ids == (0, 2, 4, 5)
    assert spec.full_kv_layer_ids == (1, 3)
    plain = kv_only_spec(2)
    assert (plain.window_layer_ids, plain.full_kv_layer_ids) == ((), (0, 1, 2, 3, 4))


def test_kv_window_region_only_with_windows() -> None:
    lay = StateLayout.for_coords(kv_only_spec(2), (1, 1, 1), (0, 0, 0))
    assert names(lay) == ["kv"]
    assert names(StateLayout.for_coords(hybrid_spec(2), (1, 1, 1), (0, 0, 0))) == [
        "kv",
        "indexer",
        "mamba_conv",
        "mamba_ssm",
    ]
    lay = StateLayout.for_coords(hybrid_windowed(), (1, 1, 1), (0, 0, 0))
    assert names(lay) == ["kv", "kv_window", "indexer", "mamba_conv", "mamba_ssm"]
    assert lay.region("kv").local_layer_ids == (1, 4)
    assert lay.region("kv_window").local_layer_ids == (0, 2, 7)
    assert lay.region_layers(RegionName.KV_WINDOW) == (0, 2, 7)
    assert lay.family_layers(Family.KV) == (0, 1, 2, 4, 7)  # both regions together
    assert lay.region("kv_window").family is Family.KV and lay.region("kv_window").paged
    assert lay.page_bytes == sum(r.row_bytes for r in lay.regions if r.paged)


def test_stages_of_only_windowed_or_only_full_layers() -> None:
    spec = windowed_spec(((0, 1, 2),))  # pp=2: stage 0 windowed only, stage 1 full only
    first, second = (StateLayout.for_coords(spec, (2, 1, 1), (p, 0, 0)) for p in range(2))
    assert (first.region("kv").local_layer_ids, first.region("kv_window").local_layer_ids) == (
        (),
        (0, 1, 2),
    )
    assert second.region("kv").local_layer_ids == (3, 4, 5)
    assert second.region("kv_window").local_layer_ids == ()
    assert [r.name for r in first.held_regions()] == [RegionName.KV_WINDOW]
    assert [r.name for r in second.held_regions(paged=True)] == [RegionName.KV]
    assert not first.region("kv").is_writer and first.region("kv_window").is_writer
    assert second.region("kv").is_writer and not second.region("kv_window").is_writer
    assert first.page_bytes == second.page_bytes == first.region("kv").row_bytes
    # Layer coordinates of reshard: the position in the region's own layer id list.
    assert row_maps(first, first.region("kv_window"))[0] == ((0, 3, 0),)
    assert row_maps(second, second.region("kv"))[0] == ((0, 3, 0),)
    assert row_maps(first, first.region("kv")) == ()


def test_rows_padded_per_region() -> None:
    spec = windowed_spec(((0, 1, 2, 4),), num_layers=5)  # stages 0..2 and 3..4
    lays = [StateLayout.for_coords(spec, (2, 1, 1), (p, 0, 0)) for p in range(2)]
    assert [lay.region("kv_window").local_layer_ids for lay in lays] == [(0, 1, 2), (4,)]
    assert [lay.region("kv").local_layer_ids for lay in lays] == [(), (3,)]
    for lay in lays:
        assert lay.region("kv_window").num_layer_rows == 3
        assert lay.region("kv").num_layer_rows == 1
        assert lay.region("kv_window").global_shape[0] == 6
    assert lays[1].region("kv_window").global_slice.layers == (4, 5)
    assert lays[1].region("kv").global_slice.layers == (3, 4)
    assert lays[0].region("kv").global_slice.layers == (0, 0)  # none held
    assert row_maps(lays[1], lays[1].region("kv_window"))[0] == ((3, 4, 0),)


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("cp_kv", ["replicate", "shard"])
def test_regions_follow_the_kv_rules_per_rank(shape, cp_kv) -> None:
    spec = hybrid_windowed()
    plain = hybrid_spec(2)
    pp = shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pairs = zip(all_layouts(spec, shape, cp_kv), all_layouts(plain, shape, cp_kv), strict=True)
    for coords, (lay, ref) in zip(all_coordinates(shape), pairs, strict=True):
        same = ref.region("kv")
        for name, all_ids in zip(KV_REGIONS, ((1, 4), (0, 2, 7)), strict=True):
            region = lay.region(name)
            stage = lay.stage_layers(coords[0])
            ids = tuple(i for i in all_ids if i in stage)
            rows = max(len([i for i in all_ids if i in lay.stage_layers(s)]) for s in range(pp))
            assert region.local_layer_ids == ids
            assert region.local_shape == (rows, *same.local_shape[1:])
            assert region.global_shape == (rows * pp, *same.global_shape[1:])
            assert region.placements == same.placements
            span = (ids[0], ids[-1] + 1) if ids else (stage.start, stage.start)
            assert region.global_slice == dataclasses.replace(same.global_slice, layers=span)
            # Writer election: the kv rule, on the region's own layers.
            assert region.is_writer == (bool(ids) and same.is_writer)
        for name in (RegionName.INDEXER, RegionName.MAMBA_CONV, RegionName.MAMBA_SSM):
            assert lay.region(name) == ref.region(name)


# -- pools and transfers -------------------------------------------------------------------


def _pools(arena: bool) -> tuple[DevicePools, HostPools]:
    lay = StateLayout.for_coords(hybrid_windowed(), (1, 1, 2), (0, 0, 1))
    host = HostPools(lay, num_pages=6, num_slots=3, pinned=False)
    if arena:
        page, slot, _ = ArenaPlan.item_bytes(lay)
        return DevicePools(lay, arena=ArenaPlan.for_budget(20_000, page, slot)), host
    return DevicePools(lay, num_pages=5, num_slots=3), host


@pytest.mark.parametrize("arena", [False, True])
def test_device_kv_of_windowed_layers_is_its_own_tensor(arena: bool) -> None:
    dev, _ = _pools(arena)
    assert dev.layers(Family.KV) == (0, 1, 2, 4, 7)
    shape = (dev.num_pages, 8, 1, 4)  # [pages, T, H (tp=2 of 2), D]
    for layer in dev.layers(Family.KV):
        assert dev.k(layer).shape == dev.v(layer).shape == shape
    if not arena:  # separate allocations
        windowed = dev.k(0).untyped_storage().data_ptr()
        assert dev.k(7).untyped_storage().data_ptr() == windowed
        assert dev.k(1).untyped_storage().data_ptr() != windowed
    # Rows of one tensor each: a value per (layer, part) on one page reads back unchanged.
    for v, layer in enumerate(dev.layers(Family.KV), 1):
        dev.k(layer)[2] = v
        dev.v(layer)[2] = -v
    for v, layer in enumerate(dev.layers(Family.KV), 1):
        assert dev.k(layer)[2].eq(v).all() and dev.v(layer)[2].eq(-v).all()
    with pytest.raises(ValueError, match="no kv state"):
        dev.k(3)


def test_segments_copy_each_layer_from_its_region() -> None:
    dev, host = _pools(False)
    layers = (0, 1, 2, 3, 4, 5, 6, 7)
    for seg in build_segments(dev, host, layers):
        if seg.part not in ("k", "v"):
            continue
        layer = layers[seg.layer_pos]
        name = RegionName.KV_WINDOW if layer in (0, 2, 7) else RegionName.KV
        region = host.region(name)
        want = host.local(name)[:, region.layer_row(layer), ("k", "v").index(seg.part)]
        assert seg.host.data_ptr() == want.data_ptr() and seg.host.shape == want.shape


@pytest.mark.parametrize("arena", [False, True])
def test_backup_and_load_round_trip_is_bit_exact(arena: bool) -> None:
    dev, host = _pools(arena)
    randomize(dev, torch.Generator().manual_seed(5))
    pages = dev.page_allocator.allocate(3)
    slots = dev.slot_allocator.allocate(2)
    want = snapshot(dev)
    # The windowed layers' K/V go by window ids (the host's own id space for kv_window).
    pairs = ((pages, [5, 0, 3]), (slots, [2, 0]), (pages, [1, 4, 2]))
    with CpuTransferEngine(dev, host) as engine:
        assert engine.backup(*pairs).wait()
        randomize(dev, torch.Generator().manual_seed(6))
        assert engine.load(*pairs).wait()
    got = snapshot(dev)
    for key, t in want.items():
        ids = slots if key[0] in ("conv", "ssm") else pages
        assert same_bits(got[key][ids], t[ids]), key


# -- reshard -------------------------------------------------------------------------------


def test_reshard_plan_one_rank_to_pp_tp() -> None:
    spec = windowed_spec(((0, 2), (3,)))
    for reader in all_layouts(spec, (2, 1, 2)):
        plan = plan_source(reader, MeshLayoutId(1, 1, 1, CpKvMode.REPLICATE))
        assert plan is not None and not plan.same_keys
        for rp in plan.regions:
            (read,) = rp.reads  # the one rank's object of the region, all its layers
            region = reader.region(rp.region)
            all_ids = spec.window_layer_ids if rp.region is RegionName.KV_WINDOW else (1, 4, 5)
            assert read.shape[0] == len(all_ids)
            first = all_ids.index(region.local_layer_ids[0])
            assert read.copies[0].src[0] == slice(first, first + len(region.local_layer_ids))
