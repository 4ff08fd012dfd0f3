"""Host pools as DTensors: full_tensor() equals the global reference; zero-copy."""

from __future__ import annotations

import pytest
import torch

from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import RegionLayout, RegionName, StateLayout
from mesh_hicache.pools import HostPools
from mesh_hicache.spec import IndexerSpec, KVSpec, MambaSpec, StateSpec
from mesh_hicache.topology import MeshTopology
from tests.distributed.harness import run_on_mesh

NUM_PAGES, NUM_SLOTS = 3, 2


def make_spec(kv_heads: int) -> StateSpec:
    # 5 layers: pp=2 gives stages [0,3) and [3,5); kv 0,1,4 -> 2 and 1 per stage (padded).
    return StateSpec(
        model_id="test-model",
        page_size=4,
        kv=KVSpec(layer_ids=(0, 1, 4), num_kv_heads=kv_heads, head_dim=3),
        mamba=MambaSpec(
            layer_ids=(2, 3), conv_dim=4, conv_kernel=3, num_heads=2, head_dim=2, state_dim=2
        ),
        indexer=IndexerSpec(layer_ids=(1, 4), key_dim=2),
    )


def code(page, layer, kv, token, head, d):
    """A float32-exact number that names one element."""
    return page * 10**6 + layer * 10**4 + kv * 10**3 + token * 100 + head * 10 + d


def _layer_table(region: RegionLayout, layout: StateLayout, num_rows: int) -> torch.Tensor:
    """Model layer id of each global L row (padding rows get their own code 50 + row)."""
    table = []
    for grow in range(num_rows):
        stage, i = divmod(grow, region.num_layer_rows)
        ids = layout.family_layers(region.family, stage)
        table.append(ids[i] if i < len(ids) else 50 + grow)
    return torch.tensor(table, dtype=torch.float32)


def _codes(region: RegionLayout, grids: list[torch.Tensor], layers: torch.Tensor) -> torch.Tensor:
    """code() for every element, from per-dim global index grids (page, row, ...)."""
    page, layer = grids[0], layers[grids[1]]
    if region.name is RegionName.KV:
        kv, tok, head, d = grids[2:]
        return code(page, layer, kv, tok, head, d)
    if region.name is RegionName.INDEXER:
        tok, d = grids[2:]
        return code(page, layer, 0, tok, 0, d)
    if region.name is RegionName.MAMBA_CONV:
        ch, k = grids[2:]
        return code(page, layer, 0, k, 0, ch)
    head, d, n = grids[2:]
    return code(page, layer, n, 0, head, d)


def _grids(shape) -> list[torch.Tensor]:
    return [g.float() for g in torch.meshgrid(*[torch.arange(s) for s in shape], indexing="ij")]


def fill_local(host: HostPools, layout: StateLayout) -> None:
    """Write code(page, layer, ...) using only this rank's global slice and stage."""
    for region in layout.regions:
        t = host.local(region.name)
        sl = region.global_slice
        grids = _grids(t.shape)
        grids[1] = grids[1] + layout.coords[0] * region.num_layer_rows
        if region.name is RegionName.KV:
            grids[3] += sl.tokens[0]
            grids[4] += sl.heads[0]
        elif region.name is RegionName.INDEXER:
            grids[2] += sl.tokens[0]
        elif region.name is RegionName.MAMBA_CONV:
            grids[2] += sl.heads[0] * (t.shape[2] // (sl.heads[1] - sl.heads[0]))
        else:
            grids[2] += sl.heads[0]
        grids[1] = grids[1].long()
        layers = _layer_table(region, layout, layout.shape[0] * region.num_layer_rows)
        t.copy_(_codes(region, grids, layers))


def reference(region: RegionLayout, layout: StateLayout, spec: StateSpec, tp: int) -> torch.Tensor:
    """The global tensor built in one process from the global shape alone."""
    count = NUM_PAGES if region.paged else NUM_SLOTS
    shape = (count, *region.global_shape)
    grids = _grids(shape)
    grids[1] = grids[1].long()
    assert spec.kv is not None
    if region.name is RegionName.KV and spec.kv.num_kv_heads < tp:
        # The global head dim then holds tp duplicated heads: index h is real head h // group.
        grids[4] = torch.div(grids[4], tp // spec.kv.num_kv_heads, rounding_mode="floor")
    return _codes(region, grids, _layer_table(region, layout, region.global_shape[0]))


def _body(mesh, kv_heads: int, cp_kv: str):
    topo = MeshTopology.from_mesh(mesh)
    spec = make_spec(kv_heads)
    layout = StateLayout(spec, topo, cp_kv)
    host = HostPools(layout, num_pages=NUM_PAGES, num_slots=NUM_SLOTS, topology=topo)
    fill_local(host, layout)
    checked = []
    for region in layout.regions:
        dt = host.dtensor(region.name)
        assert dt.to_local().data_ptr() == host.local(region.name).data_ptr()
        full = dt.full_tensor()
        ref = reference(region, layout, spec, topo.size("tp"))
        assert torch.equal(full, ref), region.name
        checked.append(region.name.value)
    # Zero-copy both ways: a write to the buffer shows in the DTensor's local tensor.
    host.local("kv").view(-1)[0] = -7.0
    assert host.dtensor("kv").to_local().view(-1)[0].item() == -7.0
    # Sizing by bytes agrees on one count across the mesh although budgets differ.
    consensus = Consensus.over(topo, "pp", "cp", "tp")
    page = sum(r.row_bytes for r in layout.regions if r.paged)
    budget = page * (5 + sum(topo.coords))
    sized = HostPools.from_bytes(layout, budget, consensus, topology=topo, pinned=False)
    return checked, sized.num_pages


@pytest.mark.parametrize(
    "shape,kv_heads,cp_kv",
    # 2x2x2: duplicated heads (kv_heads < tp), token shards over cp, padded uneven stages.
    # 1x2x2: heads split over tp, pages replicated over cp.
    [((2, 2, 2), 1, "shard"), ((1, 2, 2), 4, "replicate")],
)
def test_host_dtensor_matches_global_reference(shape, kv_heads, cp_kv):
    out = run_on_mesh(shape, _body, kv_heads, cp_kv, timeout=120)
    for checked, num_pages in out:
        assert checked == ["kv", "indexer", "mamba_conv", "mamba_ssm"]
        assert num_pages == 5
