"""The engine on a 1x2x2 mesh: cached prefill equals recompute from every tier."""

from __future__ import annotations

import pytest

from mesh_hicache.topology import MeshTopology
from tests.distributed.harness import run_on_mesh
from tests.engine_cases import ATOL, resume_scenarios


def _scenarios(mesh, cp_kv, root):
    return resume_scenarios(MeshTopology.from_mesh(mesh), cp_kv=cp_kv, root=root)


@pytest.mark.parametrize("cp_kv", ["replicate", "shard"])
def test_resume_on_cp_tp_mesh(cp_kv, tmp_path):
    out = run_on_mesh((1, 2, 2), _scenarios, cp_kv, str(tmp_path), timeout=240)
    for rank_checks in out:
        assert rank_checks == out[0], "ranks disagree on hits or tokens"
        for c in rank_checks:
            assert c.cached > 0, f"{c.label}: expected a {c.tier} hit"
            assert c.max_diff < ATOL, f"{c.label}: logits differ by {c.max_diff}"
            assert c.tokens_equal, c.label


@pytest.mark.parametrize(("shape", "cp_kv"), [((2, 1, 2), "replicate"), ((2, 2, 1), "shard")])
def test_resume_on_pipeline_mesh(shape, cp_kv, tmp_path):
    # pp > 1: every stage serves the same requests; the last stage's logits reach all.
    out = run_on_mesh(shape, _scenarios, cp_kv, str(tmp_path), timeout=240)
    for rank_checks in out:
        assert rank_checks == out[0], "ranks disagree on hits or tokens"
        for c in rank_checks:
            assert c.cached > 0, f"{c.label}: expected a {c.tier} hit"
            assert c.max_diff < ATOL, f"{c.label}: logits differ by {c.max_diff}"
            assert c.tokens_equal, c.label
    assert {c.tier for c in out[0]} == {"device", "host", "storage"}
