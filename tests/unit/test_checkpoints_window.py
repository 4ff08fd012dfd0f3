"""gpt-oss and Gemma 3 (local/global attention) on one rank equal transformers.

Oracle: transformers' eager implementation on the same ``save_pretrained`` directory.
Tolerance (float32): ATOL = 1e-4 on logits (max magnitude ~4 for gpt-oss, ~80 for Gemma 3
with its sqrt(d) embedding scale and tied head); observed <= 3e-5, only the order of
float sums differs. Wrong windows, sinks or clamps move logits by far more (checked below,
so the comparison cannot pass by accident).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from runtime.checkpoints import load_checkpoint
from runtime.engine import Engine
from runtime.model import HybridModel, windowed
from tests.checkpoint_cases import (
    ATOL,
    assert_bfloat16_close_to_transformers,
    assert_chunked_prefill_and_decode_equal,
    assert_greedy_equals_generate,
    assert_resume_from_every_tier,
    hf_logits,
    prompt_ids,
)
from tests.window_cases import CASES, WINDOWS, build

LENGTH = 45


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("window_ckpt")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block", [128, 7])
def test_logits_equal_transformers(root: Path, case: str, block: int, monkeypatch) -> None:
    # block 7: the prefill's attention runs in several query blocks, each reading only
    # the keys its queries can see.
    monkeypatch.setattr(windowed, "QUERY_BLOCK", block)
    directory = build(case, root)
    ckpt = load_checkpoint(directory)
    ids = prompt_ids(LENGTH)
    want = hf_logits(directory, ids)
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    got = model.prefill(ids, model.new_state(), all_logits=True)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # The window is what makes these layers differ: without it the logits move a lot.
    full = replace(ckpt.config, layer_windows=())
    other = HybridModel(full, weights=load_checkpoint(directory).weights, page_size=16)
    moved = other.prefill(ids, other.new_state(), all_logits=True)
    assert (moved - want).abs().max() > 1e-2


def test_sinks_and_clamp_matter(root: Path) -> None:
    directory = build("gpt_oss", root)
    ckpt = load_checkpoint(directory)
    ids = prompt_ids(LENGTH)
    want = hf_logits(directory, ids)
    for change in (dict(attn_sinks=False), dict(swiglu_limit=1e9)):
        config = replace(ckpt.config, **change)  # type: ignore[arg-type]
        model = HybridModel(config, weights=load_checkpoint(directory).weights, page_size=16)
        got = model.prefill(ids, model.new_state(), all_logits=True)
        assert (got - want).abs().max() > 1e-2, change


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("paged", [False, True])
def test_chunked_prefill_and_decode_equal_transformers(root: Path, case: str, paged: bool):
    # Chunks of 5 / 11 tokens then one-token decodes, each position's logits against
    # transformers' full forward: every query's window starts at a different key.
    assert_chunked_prefill_and_decode_equal(build(case, root), LENGTH, paged)


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_generate(root: Path, case: str) -> None:
    assert_greedy_equals_generate(build(case, root))


@pytest.mark.parametrize("case", CASES)
def test_resume_from_every_tier_equals_recompute(
    root: Path, case: str, one_rank_topology, tmp_path
):
    # Prefixes of 128 tokens (16-token pages): a multiple of gpt-oss's window 8 (a
    # boundary exactly at a window edge) and 8 past a multiple of Gemma 3's 12 (inside).
    assert_resume_from_every_tier(one_rank_topology, build(case, root), tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_resume_at_and_inside_the_window_edge(root: Path, case: str, one_rank_topology, tmp_path):
    # Cached boundaries at 16, 32 and 48 tokens: for window 8 every one is at an edge; for
    # window 12, 16 and 32 are inside one and 48 = 4 windows is at an edge. Each resumed
    # request equals a recompute of its whole prompt.
    from mesh_hicache.cache import HiCache
    from mesh_hicache.config import HiCacheConfig

    directory = build(case, root)
    ckpt = load_checkpoint(directory)
    model = HybridModel(ckpt.config, one_rank_topology, page_size=16, weights=ckpt.weights)
    spec = ckpt.config.state_spec(16)
    cfg = HiCacheConfig(
        device_pages=64, host_pages=64, storage="file", storage_options={"root": str(tmp_path)}
    )
    cache = HiCache(one_rank_topology, spec, cfg)
    engine = Engine(model, cache, max_new_tokens=3, keep_logits=True)
    ref = Engine(model, None, max_new_tokens=3, keep_logits=True)
    base = prompt_ids(64, seed=9).tolist()
    window = WINDOWS[case]
    for boundary in (16, 32, 48):
        engine.serve(base[:boundary])
        prompt = base[:boundary] + prompt_ids(window + 3, seed=boundary).tolist()
        got, want = engine.serve(prompt), ref.serve(prompt)
        assert got.cached_device == boundary, (boundary, got.cached_device)
        assert got.output_ids == want.output_ids
        assert got.last_logits is not None and want.last_logits is not None
        diff = (torch.tensor(got.last_logits) - torch.tensor(want.last_logits)).abs().max()
        assert diff < ATOL, (boundary, float(diff))
    cache.close()


@pytest.mark.parametrize("case", CASES)
def test_config_follows_the_checkpoint(root: Path, case: str) -> None:
    c = load_checkpoint(build(case, root)).config
    if case == "gpt_oss":
        assert (c.layer_windows, c.blocks, c.attn_sinks, c.attn_bias) == (
            (8, 0, 8, 0),
            "AEAEAEAE",
            True,
            True,
        )
        assert (c.mlp_kind, c.router_has_bias, c.swiglu_limit) == ("swiglu_clamp", True, 2.0)
        assert len(c.rope_inv_freq) == 4 and c.rope_cos_scale > 1.0  # YaRN
    else:
        assert (c.layer_windows, c.blocks, c.qk_norm, c.sandwich_norm) == (
            (12, 12, 12, 0),
            "AMAMAMAM",
            True,
            True,
        )
        assert (c.norm_offset, c.local_rope_theta, c.attn_scale) == (1.0, 1000.0, 12**-0.5)
        assert c.embed_scale == pytest.approx(32**0.5)
    # Windowed layers are cached as full KV layers (every token's K/V is kept).
    spec = c.state_spec(16)
    assert spec.kv is not None and spec.kv.layer_ids == tuple(range(c.num_layers))


@pytest.mark.parametrize("case", CASES)
def test_bfloat16_close_to_transformers(root: Path, case: str) -> None:
    model = assert_bfloat16_close_to_transformers(build(case, root), LENGTH)
    assert model.blocks[0].mixer.wqkv.dtype == torch.bfloat16
