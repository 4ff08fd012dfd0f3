"""``runtime.serve --model DIR --prompts P.jsonl --cache full`` on a tiny random
DeepSeek-V3.2 checkpoint (MLA latent KV + lightning indexer, top-k sparse attention, MoE)
equals transformers' greedy generate, on one rank and under torchrun (1x2x2 with
cp_kv=shard, 2x1x1); a second run on the same storage root reads L3 and still matches.

The indexer keeps only ``index_topk`` = 6 of the 40-70 previous tokens, so a resumed
prefill is right only if the cached latent and indexer keys are: the one-rank case
checks (on transformers' own indexer) that the second turn's queries select tokens that
came from the cache. Same requests and tokenizer as ``test_checkpoints_serve``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.test_checkpoints_serve import _requests, _serve, _setup

tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers (test extra)")
deepseek_cases = pytest.importorskip("tests.deepseek_cases", reason="needs transformers")


def _selected_positions(directory: Path, prompt: list[int], start: int) -> set[int]:
    """Key positions transformers' indexers select (any layer) for the queries at
    positions ``>= start`` of a full forward over ``prompt``."""
    model = deepseek_cases.hf_model(directory)
    picked: set[int] = set()

    def record(_module, _args, out) -> None:
        picked.update(out[0, start:].flatten().tolist())

    hooks = [layer.self_attn.indexer.register_forward_hook(record) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.tensor([prompt]))
    finally:
        for h in hooks:
            h.remove()
    return picked


@pytest.mark.parametrize(
    "mesh",
    [(), ("--cp", "2", "--tp", "2", "--cp-kv", "shard"), ("--pp", "2")],
    ids=["1rank", "1x2x2", "2x1x1"],
)
def test_serve_prompts_equals_transformers_generate(tmp_path: Path, mesh) -> None:
    directory = deepseek_cases.build(tmp_path)
    prompts, want = _setup(directory, tmp_path)
    requests = _requests()
    storage = tmp_path / "l3"
    first = _serve(directory, prompts, storage, tmp_path / "first.json", *mesh)
    assert [r["output_ids"] for r in first["requests"]] == want
    history = requests[0]["input_ids"] + want[0] + requests[2]["input_ids"]
    cached = first["requests"][2]["cached"]["device"]  # the second turn of session "a"
    assert cached > 0
    if not mesh:
        picked = _selected_positions(directory, history, cached)
        assert any(p < cached for p in picked), (cached, sorted(picked))
    # A new process on the same storage root: cold L1/L2, the prefixes come from L3.
    again = _serve(directory, prompts, storage, tmp_path / "again.json", *mesh)
    assert again["summary"]["cached_storage"] > 0
    assert [r["output_ids"] for r in again["requests"]] == want
    from_l3 = again["requests"][2]["cached"]["storage"]
    assert from_l3 > 0
    if not mesh:
        picked = _selected_positions(directory, history, from_l3)
        assert any(p < from_l3 for p in picked), (from_l3, sorted(picked))


@pytest.mark.parametrize(
    ("shape", "cp_kv"),
    [((1, 2, 2), "shard"), ((2, 1, 2), "replicate"), ((2, 2, 2), "shard")],
    ids=["1x2x2", "2x1x2", "2x2x2"],
)
def test_resume_from_every_tier_on_a_mesh(tmp_path: Path, shape, cp_kv: str) -> None:
    """L1 / L2 / L3 hits (aligned, unaligned, after evict/reload cycles) equal recompute
    on every rank; the prompts are 8+ pages against ``index_topk`` = 6."""
    from tests.distributed.test_checkpoints import _check_resume

    directory = deepseek_cases.build(tmp_path)
    _check_resume(shape, directory, cp_kv, tmp_path / "l3", timeout=500)


def test_l3_written_under_one_mesh_serves_another(tmp_path: Path) -> None:
    """Written by 1x2x2 (cp_kv=shard, the latent and keys split over cp), read by 2x1x1:
    the reader reshards every hit and still gives transformers' tokens."""
    directory = deepseek_cases.build(tmp_path)
    prompts, want = _setup(directory, tmp_path)
    storage = tmp_path / "l3"
    writer = ("--cp", "2", "--tp", "2", "--cp-kv", "shard")
    first = _serve(directory, prompts, storage, tmp_path / "first.json", *writer)
    assert [r["output_ids"] for r in first["requests"]] == want
    again = _serve(directory, prompts, storage, tmp_path / "again.json", "--pp", "2")
    summary = again["summary"]
    assert summary["cached_storage"] > 0
    assert summary["storage_resharded_tokens"] == summary["cached_storage"]
    assert [r["output_ids"] for r in again["requests"]] == want
