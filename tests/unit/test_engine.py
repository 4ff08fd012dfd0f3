"""The engine on one rank: cached prefill equals recompute from every tier (DESIGN.md 10)."""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh

from mesh_hicache.topology import MeshTopology
from tests.engine_cases import ATOL, resume_scenarios


@pytest.fixture(scope="module")
def topology(single_rank_group):
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "cp", "tp"))
    return MeshTopology.from_mesh(mesh)


def test_resume_from_every_tier_equals_recompute(topology, tmp_path):
    checks = resume_scenarios(topology, root=str(tmp_path))
    for c in checks:
        assert c.cached > 0, f"{c.label}: expected a {c.tier} hit"
        assert c.max_diff < ATOL, f"{c.label}: logits differ by {c.max_diff}"
        assert c.tokens_equal, c.label
    assert {c.tier for c in checks} == {"device", "host", "storage"}
