"""LFM2 (gated short convolutions + attention) on a mesh equals one rank.

Tolerance: float32 ATOL = 1e-4, as ``test_checkpoints.py`` (only the order of float sums
differs: tp partial output projections, cp-gathered K/V and log-sum-exp merges). tp shards
the conv channels (each rank's conv window is its block of the one-rank window); cp hands
each chunk the last ``L_cache - 1`` conv inputs of the chunks before it, including a
one-token chunk (shorter than the window) and an empty one; a tp or pp rank reads less
than 0.8 of the checkpoint's bytes (its own slices).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_checkpoints import _check, _check_resume
from tests.lfm2_cases import build


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lfm2_mesh")


@pytest.mark.parametrize(
    ("case", "shape", "cp_kv", "prefix"),
    [
        ("lfm2", (1, 1, 2), "replicate", 13),
        ("lfm2_bias", (1, 1, 2), "replicate", 0),
        ("lfm2", (1, 2, 1), "shard", 13),
        ("lfm2_bias", (1, 2, 1), "replicate", 16),
        ("lfm2", (2, 1, 1), "replicate", 16),
        ("lfm2_bias", (2, 1, 1), "replicate", 13),
        ("lfm2", (1, 2, 2), "replicate", 16),
        ("lfm2", (1, 2, 2), "shard", 28),  # a one-token suffix: an empty cp chunk
        ("lfm2_bias", (1, 2, 2), "shard", 26),  # 3 tokens: one-token and two-token chunks
    ],
)
def test_lfm2_on_mesh_equals_one_rank(root: Path, case: str, shape, cp_kv: str, prefix: int):
    results = _check(build(case, root), shape, cp_kv, prefix, timeout=240)
    assert sum(len(r["conv"]) for r in results) > 0
    assert all(not r["ssm"] for r in results)  # conv state only


@pytest.mark.parametrize(("shape", "cp_kv"), [((1, 2, 2), "shard"), ((2, 1, 2), "replicate")])
def test_lfm2_resume_from_every_tier_on_mesh(root: Path, tmp_path: Path, shape, cp_kv: str):
    _check_resume(shape, build("lfm2", root), cp_kv, tmp_path, timeout=400)
