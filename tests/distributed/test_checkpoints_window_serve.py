"""``runtime.serve --model DIR --prompts P.jsonl`` on gpt-oss and Gemma 3 (local/global
attention) equals transformers' greedy generate; L3 written by one mesh is read by another.

The requests (``test_checkpoints_serve``'s: sessions, a text line, prompts of 9-45 tokens
and session histories past 60) cross the 8- and 12-token windows many times. On one rank
and under torchrun (1x2x2 with ``cp_kv=shard``, 2x1x1); a second run on the same storage
root reads L3 and still matches. Reshard: a root filled by one rank is read by a 1x1x2
(tp) and a 2x1x1 (pp) mesh (other layer ranges / head slices per object) with the same
tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_checkpoints_serve import _check_l3_resharded, _check_serve_twice
from tests.window_cases import build


@pytest.mark.parametrize(
    ("case", "mesh"),
    [
        ("gpt_oss", ()),
        ("gemma3", ()),
        ("gpt_oss", ("--cp", "2", "--tp", "2", "--cp-kv", "shard")),
        ("gemma3", ("--cp", "2", "--tp", "2", "--cp-kv", "shard")),
        ("gpt_oss", ("--pp", "2")),
        ("gemma3", ("--pp", "2")),
    ],
    ids=[
        "gpt_oss-1rank",
        "gemma3-1rank",
        "gpt_oss-1x2x2",
        "gemma3-1x2x2",
        "gpt_oss-2x1x1",
        "gemma3-2x1x1",
    ],  # fmt: skip
)
def test_windowed_serve_equals_transformers_generate(tmp_path: Path, case: str, mesh) -> None:
    _check_serve_twice(build(case, tmp_path), tmp_path, *mesh)


@pytest.mark.parametrize("case", ["gpt_oss", "gemma3"])
def test_windowed_l3_resharded_between_meshes(tmp_path: Path, case: str) -> None:
    _check_l3_resharded(build(case, tmp_path), tmp_path)
