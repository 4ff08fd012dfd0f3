"""StateLayout: placements, local shapes, global slices, writer election, PP stages."""

from __future__ import annotations

import itertools
import warnings
from collections import defaultdict

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from mesh_hicache.layout import (
    GlobalSlice,
    RegionName,
    StateLayout,
    all_layouts,
    stage_layers,
)
from mesh_hicache.spec import Family, IndexerSpec, KVSpec, MambaSpec, StateSpec
from mesh_hicache.topology import all_coordinates

MESHES = [(1, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 1), (1, 2, 2), (2, 2, 2), (1, 1, 4)]
KV_LAYERS = (0, 1, 2, 4, 7)
MAMBA_LAYERS = (3, 5, 6)


def hybrid_spec(kv_heads: int, *, mla: bool = False, page_size: int = 8) -> StateSpec:
    return StateSpec(
        model_id="test-model",
        page_size=page_size,
        kv=KVSpec(layer_ids=KV_LAYERS, num_kv_heads=kv_heads, head_dim=4, mla=mla),
        mamba=MambaSpec(
            layer_ids=MAMBA_LAYERS, conv_dim=16, conv_kernel=4, num_heads=4, head_dim=2, state_dim=3
        ),
        indexer=IndexerSpec(layer_ids=(1, 4), key_dim=5),
    )


def kv_only_spec(kv_heads: int, num_layers: int = 5) -> StateSpec:
    return StateSpec(
        model_id="test-model",
        page_size=4,
        kv=KVSpec(layer_ids=tuple(range(num_layers)), num_kv_heads=kv_heads, head_dim=2),
    )


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
@pytest.mark.parametrize("cp_kv", ["replicate", "shard"])
def test_kv_region_per_rank(shape, kv_heads, cp_kv):
    spec = hybrid_spec(kv_heads)
    pp, cp, tp = shape
    for coords, lay in zip(all_coordinates(shape), all_layouts(spec, shape, cp_kv), strict=True):
        p, c, t = coords
        kv = lay.region("kv")
        stage = stage_layers(8, pp, p)
        ids = tuple(i for i in KV_LAYERS if i in stage)
        rows = max(len([i for i in KV_LAYERS if i in stage_layers(8, pp, s)]) for s in range(pp))
        assert kv.local_layer_ids == ids
        heads_local = max(kv_heads // tp, 1)
        tokens_local = 8 // cp if cp_kv == "shard" else 8
        assert kv.local_shape == (rows, 2, tokens_local, heads_local, 4)
        assert kv.global_shape == (rows * pp, 2, 8, max(kv_heads, tp), 4)
        cp_place = Shard(3) if cp_kv == "shard" else Replicate()
        assert kv.placements == (Shard(1), cp_place, Shard(4))
        if kv_heads >= tp:
            heads = (t * heads_local, (t + 1) * heads_local)
            first_tp = True
        else:
            group = tp // kv_heads
            heads = (t // group, t // group + 1)
            first_tp = t % group == 0
        tokens = (c * tokens_local, (c + 1) * tokens_local) if cp_kv == "shard" else (0, 8)
        assert kv.global_slice == GlobalSlice((ids[0], ids[-1] + 1), heads, tokens)
        assert kv.is_writer == (first_tp and (cp_kv == "shard" or c == 0))
        # Indexer: replicated over tp, like KV over cp.
        ix = lay.region("indexer")
        assert ix.placements == (
            Shard(1),
            Shard(2) if cp_kv == "shard" else Replicate(),
            Replicate(),
        )
        assert ix.local_shape[1:] == (tokens_local, 5)
        ix_ids = tuple(i for i in (1, 4) if i in stage)
        assert ix.is_writer == (bool(ix_ids) and t == 0 and (cp_kv == "shard" or c == 0))
        # Mamba: sharded by head over tp, replicated over cp.
        conv, ssm = lay.region("mamba_conv"), lay.region("mamba_ssm")
        assert conv.placements == ssm.placements == (Shard(1), Replicate(), Shard(2))
        assert conv.local_shape[1:] == (16 // tp, 3)
        assert ssm.local_shape[1:] == (4 // tp, 2, 3)
        m_ids = tuple(i for i in MAMBA_LAYERS if i in stage)
        assert conv.is_writer == ssm.is_writer == (bool(m_ids) and c == 0)
        assert ssm.global_slice.heads == (t * 4 // tp, (t + 1) * 4 // tp)
        assert ssm.global_slice.tokens == (0, 1)


@pytest.mark.parametrize("shape", MESHES)
def test_mla_replicates_over_tp(shape):
    spec = hybrid_spec(1, mla=True)
    for (_, c, t), lay in zip(all_coordinates(shape), all_layouts(spec, shape), strict=True):
        kv = lay.region("kv")
        assert kv.placements[2] == Replicate()
        assert kv.local_shape[3] == 1 and kv.global_slice.heads == (0, 1)
        assert kv.is_writer == (c == 0 and t == 0)


def _specs():
    yield hybrid_spec(1)
    yield hybrid_spec(2)
    yield hybrid_spec(4)
    yield hybrid_spec(8)
    yield hybrid_spec(1, mla=True)
    yield kv_only_spec(2, num_layers=3)
    yield StateSpec(
        model_id="test-model",
        page_size=4,
        mamba=MambaSpec(
            layer_ids=(0, 1, 2), conv_dim=8, conv_kernel=2, num_heads=8, head_dim=1, state_dim=2
        ),
    )


def _real_heads(spec: StateSpec, name: RegionName) -> int:
    if name is RegionName.KV:
        assert spec.kv is not None
        return spec.kv.num_kv_heads
    if name is RegionName.INDEXER:
        return 1
    assert spec.mamba is not None
    return spec.mamba.num_heads


@pytest.mark.parametrize("cp_kv", ["replicate", "shard"])
def test_every_shard_has_exactly_one_writer(cp_kv):
    """Over all coordinates of many meshes: each distinct non-empty shard has one writer,
    and the writers' slices tile every (layer, head, token) of each region exactly once."""
    shapes = [s for s in itertools.product((1, 2, 3), (1, 2, 4), (1, 2, 4, 8)) if s[1] <= 4]
    checked = 0
    for spec in _specs():
        for shape in shapes:
            try:
                layouts = all_layouts(spec, shape, cp_kv)
            except ValueError:
                continue  # tp that the spec cannot split (checked in test_bad_layouts)
            writers: dict[tuple[RegionName, GlobalSlice], int] = defaultdict(int)
            holders: dict[tuple[RegionName, GlobalSlice], int] = defaultdict(int)
            for lay in layouts:
                for r in lay.regions:
                    if not r.local_layer_ids:
                        assert not r.is_writer
                        continue
                    holders[(r.name, r.global_slice)] += 1
                    writers[(r.name, r.global_slice)] += int(r.is_writer)
            for key in holders:
                assert writers[key] == 1, (spec, shape, key, writers[key])
            covered: dict[RegionName, list[tuple[int, int, int]]] = defaultdict(list)
            for lay in layouts:
                for r in lay.regions:
                    if r.is_writer:
                        sl = r.global_slice
                        covered[r.name] += list(
                            itertools.product(
                                r.local_layer_ids, range(*sl.heads), range(*sl.tokens)
                            )
                        )
            for name, cells in covered.items():
                fam = {RegionName.KV: Family.KV, RegionName.INDEXER: Family.INDEXER}.get(
                    name, Family.MAMBA
                )
                ids = layouts[0]._family_ids(fam)
                tokens = spec.page_size if fam is not Family.MAMBA else 1
                expect = set(itertools.product(ids, range(_real_heads(spec, name)), range(tokens)))
                assert len(cells) == len(set(cells)) and set(cells) == expect, (spec, shape, name)
            checked += 1
    assert checked > 50


def test_stage_layers_contiguous_and_balanced():
    for n, pp in itertools.product(range(1, 12), range(1, 5)):
        if pp > n:
            continue
        stages = [stage_layers(n, pp, s) for s in range(pp)]
        assert [i for r in stages for i in r] == list(range(n))
        sizes = [len(r) for r in stages]
        assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="stage"):
        stage_layers(4, 2, 2)


def test_uneven_stages_pad_layer_dim():
    spec = hybrid_spec(2)
    lays = all_layouts(spec, (2, 1, 1))
    # Stage 0 holds kv 0,1,2 and mamba 3; stage 1 holds kv 4,7 and mamba 5,6.
    assert lays[0].region("kv").local_layer_ids == (0, 1, 2)
    assert lays[1].region("kv").local_layer_ids == (4, 7)
    assert lays[0].region("mamba_ssm").local_layer_ids == (3,)
    for name in ("kv", "indexer", "mamba_conv", "mamba_ssm"):
        assert lays[0].region(name).local_shape == lays[1].region(name).local_shape
    assert lays[1].region("kv").num_layer_rows == 3
    assert lays[1].region("kv").layer_row(7) == 1
    with pytest.raises(ValueError, match="layer 0"):
        lays[1].region("kv").layer_row(0)


def test_stage_without_family_has_no_writer():
    spec = StateSpec(
        model_id="test-model",
        page_size=4,
        kv=KVSpec(layer_ids=(0, 1), num_kv_heads=2, head_dim=2),
        mamba=MambaSpec(
            layer_ids=(2, 3), conv_dim=4, conv_kernel=2, num_heads=2, head_dim=1, state_dim=1
        ),
    )
    s0, s1 = all_layouts(spec, (2, 1, 1))
    assert s0.region("mamba_ssm").local_layer_ids == () and not s0.region("mamba_ssm").is_writer
    assert s1.region("kv").local_layer_ids == () and not s1.region("kv").is_writer
    assert s1.region("kv").local_shape == s0.region("kv").local_shape
    assert s1.region("kv").global_slice.layers == (2, 2)


def test_bad_layouts():
    with pytest.raises(ValueError, match="cp_kv"):
        StateLayout.for_coords(kv_only_spec(2), (1, 1, 1), (0, 0, 0), cp_kv="stripe")
    with pytest.raises(ValueError, match="page_size"):
        StateLayout.for_coords(kv_only_spec(2), (1, 3, 1), (0, 0, 0), cp_kv="shard")
    with pytest.raises(ValueError, match="num_kv_heads"):
        StateLayout.for_coords(kv_only_spec(3), (1, 1, 2), (0, 0, 0))
    with pytest.raises(ValueError, match="outside"):
        StateLayout.for_coords(kv_only_spec(2), (1, 1, 2), (0, 0, 2))
    with pytest.raises(ValueError, match="not in this spec"):
        StateLayout.for_coords(kv_only_spec(2), (1, 1, 1), (0, 0, 0)).region("mamba_ssm")


def test_shard_with_cp1_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lay = StateLayout.for_coords(kv_only_spec(2), (1, 1, 1), (0, 0, 0), cp_kv="shard")
    assert any("cp=1" in str(w.message) for w in caught)
    assert lay.page_size_local == 4


def test_region_bytes_and_dtypes():
    spec = StateSpec(
        model_id="test-model",
        page_size=4,
        kv=KVSpec(layer_ids=(0,), num_kv_heads=2, head_dim=8, dtype=torch.bfloat16),
        mamba=MambaSpec(
            layer_ids=(1,),
            conv_dim=4,
            conv_kernel=3,
            num_heads=2,
            head_dim=2,
            state_dim=2,
            conv_dtype=torch.bfloat16,
            ssm_dtype=torch.float32,
        ),
    )
    lay = StateLayout.for_coords(spec, (1, 1, 1), (0, 0, 0))
    assert [r.name.value for r in lay.regions] == ["kv", "mamba_conv", "mamba_ssm"]
    assert lay.region("kv").row_bytes == 1 * 2 * 4 * 2 * 8 * 2
    assert lay.region("mamba_conv").dtype == torch.bfloat16
    assert lay.region("mamba_ssm").row_bytes == 1 * 2 * 2 * 2 * 4
    assert lay.region("kv").paged and not lay.region("mamba_ssm").paged
