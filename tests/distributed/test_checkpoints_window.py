"""gpt-oss and Gemma 3 (local/global attention) on a mesh equal one rank.

Tolerance: float32 ATOL = 1e-4, as ``test_checkpoints.py`` (only the order of float sums
differs: tp partial matmuls, cp-gathered K/V, log-sum-exp merges of per-rank partial
attention under ``cp_kv="shard"``, before the sinks join the denominator). Prompts of 29
tokens plus 6 decodes cross the 8- and 12-token windows several times; a tp or pp rank
reads less than 0.8 of the checkpoint's bytes (its own slices).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_checkpoints import _check, _check_resume
from tests.window_cases import build


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("window_mesh")


@pytest.mark.parametrize(
    ("case", "shape", "cp_kv", "prefix"),
    [
        ("gpt_oss", (1, 1, 2), "replicate", 13),
        ("gemma3", (1, 1, 2), "replicate", 0),
        ("gpt_oss", (1, 2, 1), "shard", 13),
        ("gemma3", (1, 2, 1), "shard", 16),
        ("gpt_oss", (2, 1, 1), "replicate", 16),
        ("gemma3", (2, 1, 1), "replicate", 13),
        ("gpt_oss", (1, 2, 2), "replicate", 16),
        ("gemma3", (1, 2, 2), "replicate", 13),
        ("gpt_oss", (1, 2, 2), "shard", 28),  # a one-token suffix: an empty cp chunk
        ("gemma3", (1, 2, 2), "shard", 8),
        ("gpt_oss", (2, 2, 2), "shard", 13),
    ],
)
def test_windowed_checkpoint_on_mesh_equals_one_rank(
    root: Path, case: str, shape, cp_kv: str, prefix: int
):
    _check(build(case, root), shape, cp_kv, prefix)


@pytest.mark.parametrize(
    ("case", "shape", "cp_kv"),
    [("gpt_oss", (1, 2, 2), "shard"), ("gemma3", (2, 1, 2), "replicate")],
)
def test_windowed_resume_from_every_tier_on_mesh(
    root: Path, tmp_path: Path, case: str, shape, cp_kv: str
):
    _check_resume(shape, build(case, root), cp_kv, tmp_path, timeout=300)
