"""MeshTopology on real multi-rank meshes (docs/DESIGN.md section 3)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from mesh_hicache import MeshAxis, MeshTopology
from tests.distributed.harness import run_on_mesh

CASES = [
    ((1, 1, 1), ("pp", "cp", "tp")),
    ((2,), ("tp",)),
    ((1, 2, 2), ("pp", "cp", "tp")),
    ((2, 2, 1), ("pp", "cp", "tp")),
    ((2, 1, 2), ("pp", "cp", "tp")),
    ((2, 2, 2), ("pp", "cp", "tp")),
    ((2, 2), ("cp", "tp")),
    ((2, 2), ("pp", "tp")),
]


def _describe(mesh):
    topo = MeshTopology.from_mesh(mesh)
    native = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True))
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
    cache_ranks = dist.get_process_group_ranks(topo.cache_group)
    pp_ranks = dist.get_process_group_ranks(topo.pp_group)
    assert topo.submesh("cp", "tp") is topo.submesh(MeshAxis.TP, MeshAxis.CP)
    return {
        "coords": {a.value: topo.coord(a) for a in MeshAxis},
        "sizes": {a.value: topo.size(a) for a in MeshAxis},
        "native": native,
        "native_sizes": sizes,
        "cache_ranks": sorted(cache_ranks),
        "pp_ranks": sorted(pp_ranks),
        "submesh_cache": sorted(topo.submesh("cp", "tp").mesh.flatten().tolist()),
        "ranks_of_cache": sorted(topo.ranks_of("cp", "tp")),
    }


@pytest.mark.parametrize(("shape", "names"), CASES)
def test_coordinates_sizes_and_groups(shape, names):
    out = run_on_mesh(shape, _describe, names=names)
    for rank, info in enumerate(out):
        for axis in ("pp", "cp", "tp"):
            assert info["coords"][axis] == info["native"].get(axis, 0)
            assert info["sizes"][axis] == info["native_sizes"].get(axis, 1)
        same_stage = [r for r, o in enumerate(out) if o["coords"]["pp"] == info["coords"]["pp"]]
        assert info["cache_ranks"] == same_stage, f"rank {rank}"
        assert info["submesh_cache"] == same_stage
        assert info["ranks_of_cache"] == same_stage
        same_pipe = [
            r
            for r, o in enumerate(out)
            if (o["coords"]["cp"], o["coords"]["tp"])
            == (info["coords"]["cp"], info["coords"]["tp"])
        ]
        assert info["pp_ranks"] == same_pipe
    assert len({tuple(o["coords"].values()) for o in out}) == len(out)


def _bad_group_size(mesh):
    # A 2-rank mesh checked against a one-rank group: sizes do not match.
    groups = [dist.new_group([r]) for r in range(dist.get_world_size(dist.group.WORLD))]
    solo = groups[dist.get_rank()]
    with pytest.raises(ValueError, match="has 2 ranks but the process group has 1"):
        MeshTopology.from_mesh(mesh, group=solo)
    return True


def test_mesh_size_must_match_group():
    assert run_on_mesh((2,), _bad_group_size) == [True, True]
