"""A layer in two families (Falcon-H1's parallel layer: attention and Mamba-2 on the same
input) is declared by listing it in both ``kv.layer_ids`` and ``mamba.layer_ids``. Each
family keeps its own region over the same layers; transfer segments, pools, storage
objects and the tiers follow the regions, with no branch on the model."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

from mesh_hicache.cache import HiCache
from mesh_hicache.choices import RegionName
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools
from mesh_hicache.radix.eviction import CostModel
from mesh_hicache.spec import Family, KVSpec, MambaSpec, StateSpec
from mesh_hicache.tiers.reshard import row_maps
from mesh_hicache.transfer.cpu import CpuTransferEngine
from tests.unit.cache_support import (
    PS,
    make_config,
    poison_free_device,
    serve,
    stored_objects,
)

LAYERS = (0, 1, 2)
HEADS, HEAD_DIM, STATE, K = 4, 2, 2, 3
CONV_DIM = HEADS * HEAD_DIM  # head-major, 2 channels per head


def _spec(model_id: str = "test/parallel") -> StateSpec:
    """Three layers, each with K/V (4 KV heads) and a Mamba state (4 heads)."""
    return StateSpec(
        page_size=PS,
        kv=KVSpec(layer_ids=LAYERS, num_kv_heads=4, head_dim=2),
        mamba=MambaSpec(
            layer_ids=LAYERS,
            conv_dim=CONV_DIM,
            conv_kernel=K,
            num_heads=HEADS,
            head_dim=HEAD_DIM,
            state_dim=STATE,
        ),
        model_id=model_id,
    )


def _layouts(spec: StateSpec, tp: int) -> list[StateLayout]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [StateLayout.for_coords(spec, (1, 1, tp), (0, 0, t)) for t in range(tp)]


def test_a_layer_may_be_declared_in_both_families() -> None:
    spec = _spec()
    assert spec.num_layers == 3 and spec.families == (Family.KV, Family.MAMBA)
    assert spec.layer_families(1) == (Family.KV, Family.MAMBA)
    with pytest.raises(ValueError, match="layer_families"):
        spec.layer_family(1)
    with pytest.raises(ValueError, match="not in range"):
        spec.layer_families(3)
    # Partly shared: layer 0 attention only, 1 both, 2 SSM only.
    mixed = StateSpec(
        model_id="m",
        page_size=PS,
        kv=KVSpec(layer_ids=(0, 1), num_kv_heads=2, head_dim=2),
        mamba=MambaSpec(
            layer_ids=(1, 2), conv_dim=8, conv_kernel=3, num_heads=4, head_dim=2, state_dim=2
        ),
    )
    assert [mixed.layer_families(i) for i in range(3)] == [
        (Family.KV,), (Family.KV, Family.MAMBA), (Family.MAMBA,),
    ]  # fmt: skip
    assert mixed.layer_family(0) is Family.KV and mixed.layer_family(2) is Family.MAMBA
    with pytest.raises(ValueError, match="cover"):  # the union must still be range(n)
        StateSpec(
            model_id="m",
            page_size=PS,
            kv=KVSpec(layer_ids=(0, 2), num_kv_heads=2, head_dim=2),
            mamba=MambaSpec(
                layer_ids=(0, 2), conv_dim=8, conv_kernel=3, num_heads=4, head_dim=2, state_dim=2
            ),
        )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layout_holds_both_regions_over_the_same_layers(tp: int) -> None:
    spec = _spec()
    spec.check_tp(tp)
    heads, kv_heads = HEADS // tp, 4 // tp
    for t, lay in enumerate(_layouts(spec, tp)):
        assert [r.name for r in lay.held_regions()] == [
            RegionName.KV, RegionName.MAMBA_CONV, RegionName.MAMBA_SSM,
        ]  # fmt: skip
        for r in lay.regions:
            assert r.local_layer_ids == LAYERS
        assert lay.region(RegionName.KV).local_shape == (3, 2, PS, kv_heads, 2)
        assert lay.region(RegionName.MAMBA_SSM).local_shape == (3, heads, HEAD_DIM, STATE)
        # A page is every layer's K/V; a slot is every layer's conv and SSM state.
        assert lay.page_bytes == 3 * 2 * PS * kv_heads * 2 * 4
        assert lay.slot_bytes == 3 * (heads * HEAD_DIM * (K - 1) + heads * HEAD_DIM * STATE) * 4
        # Reshard maps each region's layer dim to the family's positions 0..2, and the
        # rank's heads / channels to its contiguous block.
        kv = row_maps(lay, lay.region(RegionName.KV))
        ssm = row_maps(lay, lay.region(RegionName.MAMBA_SSM))
        assert kv[0] == ssm[0] == ((0, 3, 0),)
        assert kv[3] == ((t * kv_heads, (t + 1) * kv_heads, 0),)
        assert ssm[1] == ((t * heads, (t + 1) * heads, 0),)


def test_device_pools_and_segments_hold_both_parts_of_a_layer() -> None:
    lay = _layouts(_spec(), 1)[0]
    dev = DevicePools(lay, num_pages=3, num_slots=2)
    host = HostPools(lay, num_pages=4, num_slots=3, pinned=False)
    assert dev.layers(Family.KV) == dev.layers(Family.MAMBA) == LAYERS
    assert dev.k(1).shape == (3, PS, 4, 2) and dev.conv(1).shape == (2, CONV_DIM, K - 1)
    assert dev.nbytes == 3 * lay.page_bytes + 2 * lay.slot_bytes
    with CpuTransferEngine(dev, host) as eng:
        assert eng.layer_ids == LAYERS
        parts = [(LAYERS[s.layer_pos], s.part) for s in eng.segments.segments]
        assert parts == [(i, p) for i in LAYERS for p in ("k", "v", "conv", "ssm")]
        # A backup then a load moves both families of every layer, bit for bit.
        for layer in LAYERS:
            dev.k(layer)[1] = layer + 1.0
            dev.v(layer)[1] = -layer - 1.0
            dev.conv(layer)[0] = 10.0 + layer
            dev.ssm(layer)[0] = 20.0 + layer
        assert eng.backup(((1,), (2,)), ((0,), (1,))).wait()
        for t in (dev.k, dev.v, dev.conv, dev.ssm):
            for layer in LAYERS:
                t(layer).fill_(float("nan"))
        assert eng.load(((0,), (2,)), ((1,), (1,))).wait()  # (device, host) pairs
    for layer in LAYERS:
        assert torch.all(dev.k(layer)[0] == layer + 1.0)
        assert torch.all(dev.v(layer)[0] == -layer - 1.0)
        assert torch.all(dev.conv(layer)[1] == 10.0 + layer)
        assert torch.all(dev.ssm(layer)[1] == 20.0 + layer)


def test_cost_model_counts_both_families_of_a_layer() -> None:
    cost = CostModel.from_spec(_spec())
    assert cost.state_bytes == 3 * (CONV_DIM * (K - 1) + HEADS * HEAD_DIM * STATE) * 4


A = list(range(100, 112))  # 3 pages
B = list(range(200, 212))
C = list(range(300, 312))


@pytest.fixture
def make_cache(one_rank_topology):
    caches: list[HiCache] = []

    def build(root: Path | None = None, **overrides) -> HiCache:
        cache = HiCache(one_rank_topology, _spec(), make_config(root, **overrides))
        caches.append(cache)
        return cache

    yield build
    for cache in caches:
        cache.close()


def test_every_tier_round_trip_is_bit_exact(make_cache, tmp_path) -> None:
    # L1, then L2 after eviction, then L3 from a new cache: each hit loads the K/V pages
    # and the state slot of the same layers, bit-exact (poisoned free rows would show).
    root = tmp_path / "l3"
    cache = make_cache(root, write_policy="write_through", device_pages=6)
    assert serve(cache, A, checkpoints=(2, 3)).prefix == 0
    got = serve(cache, A)
    assert got.served == (12, 0, 0) and got.mismatches == 0
    cache.flush()
    serve(cache, B, checkpoints=(3,))
    serve(cache, C, checkpoints=(3,))
    cache.flush()
    poison_free_device(cache)
    got = serve(cache, A)
    assert got.served == (0, 12, 0) and got.mismatches == 0
    cache.flush()
    cache.check_integrity()
    cache.close()
    files = Counter(region for region, _, _ in stored_objects(root))
    # Per stored page one KV object (all three layers); per stored boundary one conv and
    # one SSM object (all three layers): A (2 boundaries), B and C (one each).
    assert files["kv"] == 9 and files["mamba_conv"] == files["mamba_ssm"] == 4, files
    second = make_cache(root)
    poison_free_device(second)
    got = serve(second, A)
    assert got.hit.storage_tokens == 12 and got.served == (0, 0, 12) and got.mismatches == 0
    second.flush()
    second.check_integrity()
