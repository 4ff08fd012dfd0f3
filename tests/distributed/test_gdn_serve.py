"""``runtime.serve --model DIR --prompts P.jsonl --cache full`` on Gated DeltaNet
checkpoints (Qwen3-Next, Qwen3.5) equals transformers' greedy generate, on one rank and
under torchrun (1x2x2 with cp_kv=shard, 2x1x1); a second run on the same storage root
reads L3 and still matches. Same requests and tokenizer as ``test_checkpoints_serve``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_checkpoints_serve import _check_serve_twice
from tests.qwen_cases import build

tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers (test extra)")


@pytest.mark.parametrize(
    ("case", "mesh"),
    [
        ("qwen3_next", ()),
        ("qwen35", ()),
        ("qwen3_next", ("--cp", "2", "--tp", "2", "--cp-kv", "shard")),
        ("qwen35_moe", ("--pp", "2")),
    ],
    ids=["next-1rank", "qwen35-1rank", "next-1x2x2", "qwen35moe-2x1x1"],
)
def test_serve_prompts_equals_transformers_generate(tmp_path: Path, case: str, mesh) -> None:
    _check_serve_twice(build(case, tmp_path), tmp_path, *mesh)
