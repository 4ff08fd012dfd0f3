"""``runtime.serve --model DIR --prompts P.jsonl`` on LFM2 equals transformers' greedy
decoding; L3 written by one mesh is read by another.

The requests (``test_checkpoints_serve``'s: sessions, a text line, prompts of 9-45 tokens)
on one rank and under torchrun (1x2x2 with ``cp_kv=shard``, 2x1x1); a second run on the
same storage root reads L3 (the attention pages and the conv windows of the boundaries)
and still matches. Reshard: a root filled by one rank is read by a 1x1x2 (tp: each rank
takes its block of conv channels out of the stored windows) and a 2x1x1 (pp) mesh.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_checkpoints_serve import _check_l3_resharded, _check_serve_twice
from tests.lfm2_cases import build


@pytest.mark.parametrize(
    ("case", "mesh"),
    [
        ("lfm2", ()),
        ("lfm2_bias", ()),
        ("lfm2", ("--cp", "2", "--tp", "2", "--cp-kv", "shard")),
        ("lfm2_bias", ("--pp", "2")),
    ],
    ids=["lfm2-1rank", "lfm2_bias-1rank", "lfm2-1x2x2", "lfm2_bias-2x1x1"],
)
def test_lfm2_serve_equals_transformers_greedy(tmp_path: Path, case: str, mesh) -> None:
    _check_serve_twice(build(case, tmp_path), tmp_path, *mesh)


def test_lfm2_l3_resharded_between_meshes(tmp_path: Path) -> None:
    _check_l3_resharded(build("lfm2", tmp_path), tmp_path)
