"""Gated DeltaNet checkpoints on a mesh equal one rank: logits, greedy decode, state shards.

Tolerance: float32 ATOL = 1e-4 (as ``test_checkpoints.py``). Cases: Qwen3-Next with two
key heads (sharded at tp=2), Qwen3.5 with ONE key head (replicated over tp: each rank
keeps it beside its share of the value heads), Qwen3.5 MoE; CP runs the delta rule's
chunk-transition combination (both KV modes, one case with an empty cp chunk); PP cuts
between layers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_checkpoints import _check, _check_resume
from tests.qwen_cases import build


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qwen_mesh")


@pytest.mark.parametrize(
    ("case", "shape", "cp_kv", "prefix"),
    [
        ("qwen3_next", (1, 1, 2), "replicate", 0),
        ("qwen35", (1, 1, 2), "replicate", 13),
        ("qwen3_next", (1, 2, 1), "shard", 13),
        ("qwen35_moe", (2, 1, 1), "replicate", 16),
        ("qwen3_next", (1, 2, 2), "replicate", 16),
        ("qwen35", (1, 2, 2), "shard", 28),  # a one-token suffix: an empty cp chunk
        ("qwen35_moe", (2, 2, 2), "shard", 13),
    ],
)
def test_mesh_equals_one_rank(root: Path, case: str, shape, cp_kv: str, prefix: int) -> None:
    results = _check(build(case, root), shape, cp_kv, prefix, timeout=240, slices=False)
    assert sum(len(r["ssm"]) for r in results) > 0


def test_resume_on_cp_tp_mesh(root: Path, tmp_path: Path) -> None:
    # The delta-rule state sharded over tp, combined over cp, cached and reloaded from
    # L1 / L2 / L3 at aligned and unaligned boundaries equals recompute on the mesh.
    _check_resume((1, 2, 2), build("qwen3_next", root), "shard", tmp_path, timeout=400)
