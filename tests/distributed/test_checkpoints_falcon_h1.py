"""Falcon-H1 (attention and Mamba-2 in parallel in every layer) on a mesh equals one rank;
resume on a mesh equals recompute; ``runtime.serve`` on one rank and on meshes equals
transformers' greedy tokens, and L3 written by one mesh is read by another.

Tolerance: float32 ATOL = 1e-4, as ``test_checkpoints.py`` (only the order of float sums
differs: tp partial sums of both mixers' output projections and of the MLP, cp chunks
scanned from zero and chained by their decays, cp-gathered K/V and log-sum-exp merges).
Every layer is in both cached families: each rank holds its K/V heads (or, with
``cp_kv=shard``, its tokens of them) AND its SSM heads / conv channels of the same layer,
and a tp or pp rank reads < 0.8 of the checkpoint's bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_checkpoints import _check, _check_resume
from tests.distributed.test_checkpoints_serve import _check_l3_resharded, _check_serve_twice
from tests.falcon_h1_cases import build


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("falcon_h1_mesh")


@pytest.mark.parametrize(
    ("case", "shape", "cp_kv", "prefix"),
    [
        ("falcon_h1", (1, 1, 2), "replicate", 13),
        ("falcon_h1", (1, 2, 1), "replicate", 0),
        ("falcon_h1", (1, 2, 1), "shard", 13),
        ("falcon_h1_norm", (1, 2, 1), "shard", 16),
        ("falcon_h1", (2, 1, 1), "replicate", 16),
        ("falcon_h1_norm", (2, 1, 1), "replicate", 13),
        ("falcon_h1", (1, 2, 2), "replicate", 16),
        ("falcon_h1", (1, 2, 2), "shard", 28),  # a one-token suffix: an empty cp chunk
    ],
)
def test_falcon_h1_on_mesh_equals_one_rank(
    root: Path, case: str, shape, cp_kv: str, prefix: int
) -> None:
    results = _check(build(case, root), shape, cp_kv, prefix, timeout=300)
    for r in results:  # every layer of the rank's stage holds K/V and a state
        assert r["k"] and sorted(r["k"]) == sorted(r["conv"]) == sorted(r["ssm"])


@pytest.mark.parametrize(("shape", "cp_kv"), [((1, 2, 2), "shard"), ((2, 1, 2), "replicate")])
def test_falcon_h1_resume_from_every_tier_on_mesh(
    root: Path, tmp_path: Path, shape, cp_kv: str
) -> None:
    _check_resume(shape, build("falcon_h1", root), cp_kv, tmp_path, timeout=400)


@pytest.mark.parametrize(
    "mesh",
    [(), ("--cp", "2", "--tp", "2", "--cp-kv", "shard"), ("--pp", "2")],
    ids=["1rank", "1x2x2", "2x1x1"],
)
def test_falcon_h1_serve_equals_transformers_greedy(tmp_path: Path, mesh) -> None:
    _check_serve_twice(build("falcon_h1", tmp_path), tmp_path, *mesh)


def test_falcon_h1_l3_resharded_between_meshes(tmp_path: Path) -> None:
    # L3 written by one rank, read by tp=2 (other head / channel slices of both families'
    # objects) and pp=2 (other layer ranges): the same tokens.
    _check_l3_resharded(build("falcon_h1", tmp_path), tmp_path)
