"""``runtime.serve --model DIR --prompts P.jsonl`` on LFM2 equals transformers' greedy
decoding; L3 written by one mesh is read by another.

The requests (``test_checkpoints_serve``'s: sessions, a text line, prompts of 9-45 tokens)
on one rank and under torchrun (1x2x2 with ``cp_kv=shard``, 2x1x1); a second run on the
same storage root reads L3 (the attention pages and the conv windows of the boundaries)
and still matches. Reshard: a root filled by one rank is read by a 1x1x2 (tp: each rank
takes its block of conv channels out of the stored windows) and a 2x1x1 (pp) mesh.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.test_checkpoints_serve import _expected, _requests, _serve, _tokenizer
from tests.lfm2_cases import build


def _setup(tmp_path: Path, case: str) -> tuple[Path, Path, list[list[int]]]:
    directory = build(case, tmp_path)
    _tokenizer(directory)
    requests = _requests()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in requests) + "\n")
    return directory, prompts, _expected(directory, requests)


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
    directory, prompts, want = _setup(tmp_path, case)
    storage = tmp_path / "l3"
    first = _serve(directory, prompts, storage, tmp_path / "first.json", *mesh)
    assert [r["output_ids"] for r in first["requests"]] == want
    assert first["requests"][2]["cached"]["device"] > 0  # the second turn of session "a"
    again = _serve(directory, prompts, storage, tmp_path / "again.json", *mesh)
    assert again["summary"]["cached_storage"] > 0
    assert [r["output_ids"] for r in again["requests"]] == want


def test_lfm2_l3_resharded_between_meshes(tmp_path: Path) -> None:
    directory, prompts, want = _setup(tmp_path, "lfm2")
    storage = tmp_path / "l3"
    one = _serve(directory, prompts, storage, tmp_path / "one.json")
    assert [r["output_ids"] for r in one["requests"]] == want
    for name, mesh in (("tp2", ("--tp", "2")), ("pp2", ("--pp", "2"))):
        got = _serve(directory, prompts, storage, tmp_path / f"{name}.json", *mesh)
        assert [r["output_ids"] for r in got["requests"]] == want, name
        summary = got["summary"]
        assert summary["cached_storage"] > 0, name
        assert summary["storage_resharded_tokens"] > 0, name
