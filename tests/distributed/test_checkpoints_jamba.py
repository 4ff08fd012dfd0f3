"""Jamba (Mamba-1 + attention + MoE) on a mesh equals one rank; resume on a mesh equals
recompute; ``runtime.serve`` on one rank and on meshes equals transformers' greedy tokens.

Tolerance: float32 ATOL = 1e-4, as ``test_checkpoints.py`` (only the order of float sums
differs: tp partial sums of ``x_proj`` over the channels and of the output projections,
cp chunks scanned from zero and chained by their per-channel decays, cp-gathered K/V).
Every tp rank keeps its ``d_inner`` channels (conv and state rows) and reads < 0.8 of the
checkpoint's bytes; pp stages cut between Jamba's layers (``SASSA``: 3 + 2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_checkpoints import _check, _check_resume
from tests.distributed.test_checkpoints_serve import _check_l3_resharded, _check_serve_twice
from tests.jamba_cases import build


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jamba_mesh")


@pytest.mark.parametrize(
    ("shape", "cp_kv", "prefix"),
    [
        ((1, 1, 2), "replicate", 13),
        ((1, 2, 1), "replicate", 0),
        ((1, 2, 1), "shard", 13),
        ((2, 1, 1), "replicate", 16),
        ((1, 2, 2), "replicate", 16),
        ((1, 2, 2), "shard", 28),  # a one-token suffix: an empty cp chunk
        ((2, 2, 2), "shard", 13),
    ],
)
def test_jamba_on_mesh_equals_one_rank(root: Path, shape, cp_kv: str, prefix: int) -> None:
    _check(build("jamba", root), shape, cp_kv, prefix)


@pytest.mark.parametrize(("shape", "cp_kv"), [((1, 2, 2), "shard"), ((2, 1, 2), "replicate")])
def test_jamba_resume_from_every_tier_on_mesh(root: Path, tmp_path: Path, shape, cp_kv: str):
    _check_resume(shape, build("jamba", root), cp_kv, tmp_path, timeout=300)


@pytest.mark.parametrize(
    "mesh",
    [(), ("--cp", "2", "--tp", "2", "--cp-kv", "shard"), ("--pp", "2")],
    ids=["1rank", "1x2x2", "2x1x1"],
)
def test_jamba_serve_equals_transformers_generate(tmp_path: Path, mesh) -> None:
    _check_serve_twice(build("jamba", tmp_path), tmp_path, *mesh)


def test_jamba_l3_resharded_between_meshes(tmp_path: Path) -> None:
    # L3 written by one rank, read by tp=2 (other channel slices per object) and pp=2
    # (other layer ranges): the same tokens.
    _check_l3_resharded(build("jamba", tmp_path), tmp_path)
