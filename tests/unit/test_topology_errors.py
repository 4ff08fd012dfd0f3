"""Bad meshes are a ValueError that names the mesh and what is allowed."""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mesh_hicache import MeshAxis, MeshTopology
from mesh_hicache.topology import as_axis


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (("dp",), "unknown"),
        (("cp", "ep"), "unknown"),
        (("tp", "cp"), "out of order"),
        (("tp", "pp", "cp"), "out of order"),
        (("cp", "cp"), "duplicates"),
    ],
)
def test_bad_dim_names(single_rank_group, names, message):
    mesh = DeviceMesh(
        "cpu",
        [[0]] if len(names) == 2 else [[[0]]] if len(names) == 3 else [0],
        mesh_dim_names=names,
        _init_backend=False,
    )
    with pytest.raises(ValueError, match=message) as info:
        MeshTopology.from_mesh(mesh)
    assert str(names) in str(info.value) and "pp" in str(info.value)


def test_unnamed_mesh(single_rank_group):
    mesh = DeviceMesh("cpu", [0], _init_backend=False)
    with pytest.raises(ValueError, match="no mesh_dim_names"):
        MeshTopology.from_mesh(mesh)


def test_not_a_mesh():
    with pytest.raises(TypeError, match="DeviceMesh"):
        MeshTopology.from_mesh("pp=2")  # type: ignore[arg-type]


def test_unknown_axis_query(single_rank_group):
    topo = MeshTopology.from_mesh(init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    with pytest.raises(ValueError, match="unknown mesh axis 'ep'"):
        topo.coord("ep")
    with pytest.raises(ValueError, match="duplicate axes"):
        topo.submesh("tp", MeshAxis.TP)
    assert topo.shape == (1, 1, 1) and topo.coords == (0, 0, 0)
    assert as_axis("cp") is MeshAxis.CP
