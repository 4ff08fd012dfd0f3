"""DeepSeek-V3.2 (MLA + lightning indexer + MoE) on one rank equals transformers.

Oracle: transformers' eager ``DeepseekV32ForCausalLM`` on the same ``save_pretrained``
directory (``tests.deepseek_cases``). Tolerance (float32): ATOL = 1e-4 on logits of
magnitude ~1-10, 1e-5 on the cached latent / indexer keys (only the order of float sums
differs). ``index_topk`` = 6 and prompts of 21-40 tokens: the top-k drops keys, which
``test_topk_really_drops_keys`` proves by showing dense attention gives other logits.

Ties: the runtime keeps the lower position among equal indexer scores
(``runtime.model.select``); transformers' ``torch.topk`` keeps a shape-dependent subset.
This checkpoint's 8-head indexer ties at the k-th place at most once on these prompts,
where both pick the same keys, so the comparison holds; a checkpoint built to tie is
compared with the runtime's own full prefill instead (``tests/unit/test_split_prefill.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from runtime.checkpoints import load_checkpoint
from runtime.model import HybridModel
from tests.deepseek_cases import (
    INDEX_TOPK,
    build,
    hf_config,
    hf_index_keys,
    hf_latent,
    hf_model,
    prompt_ids,
)

ATOL = 1e-4
STATE_ATOL = 1e-5
PROMPT = 40


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("deepseek_ckpt"))


@pytest.fixture(scope="module")
def hf(directory: Path):
    return hf_model(directory)


def _model(directory: Path, **overrides: object) -> HybridModel:
    ckpt = load_checkpoint(directory)
    config = dataclasses.replace(ckpt.config, **overrides) if overrides else ckpt.config
    return HybridModel(config, weights=ckpt.weights, page_size=16)


def _assert_state_equals_cache(state, cache, num_layers: int) -> None:
    for layer in range(num_layers):
        torch.testing.assert_close(
            state.latent[layer], hf_latent(cache, layer), atol=STATE_ATOL, rtol=0
        )
        torch.testing.assert_close(
            state.index_k[layer], hf_index_keys(cache, layer), atol=STATE_ATOL, rtol=0
        )


def test_config_from_checkpoint(directory: Path) -> None:
    c = load_checkpoint(directory).config
    assert c.attn_kind == "mla" and c.layer_pattern == "AAA" and c.blocks == "AMAEAE"
    assert (c.latent_dim, c.index_head_dim, c.index_topk) == (16 + 8, 16, INDEX_TOPK)
    spec = c.state_spec(16)
    assert spec.kv is not None and spec.kv.mla and not spec.kv.values
    assert spec.kv.head_dim == c.latent_dim and spec.kv.num_kv_heads == 1
    assert spec.indexer is not None and spec.indexer.layer_ids == (0, 1, 2)


def test_all_position_logits_and_caches_equal_transformers(directory: Path, hf) -> None:
    ids = prompt_ids(PROMPT)
    with torch.no_grad():
        out = hf(ids[None], position_ids=torch.arange(PROMPT)[None], use_cache=True)
    want = out.logits[0].float()
    assert want.abs().max() > 1.0  # a non-trivial model
    model = _model(directory)
    state = model.new_state()
    got = model.prefill(ids, state, all_logits=True)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert state.num_tokens == PROMPT
    _assert_state_equals_cache(state, out.cache, model.config.num_layers)


def test_topk_really_drops_keys(directory: Path, hf) -> None:
    # The same weights with a top-k that keeps every key: the late positions' logits move
    # well past ATOL, so the equality above depends on the sparse selection.
    ids = prompt_ids(PROMPT)
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    model = _model(directory, index_topk=PROMPT)
    dense = model.prefill(ids, model.new_state(), all_logits=True)
    early = slice(0, INDEX_TOPK)  # at most top-k visible keys: sparse = dense there
    torch.testing.assert_close(dense[early], want[early], atol=ATOL, rtol=0)
    assert (dense[INDEX_TOPK + 4 :] - want[INDEX_TOPK + 4 :]).abs().max() > 100 * ATOL


def test_decode_logits_and_caches_equal_transformers(directory: Path, hf) -> None:
    # Prefill 30, then decode 6 tokens one by one: every step's logits and the caches
    # after the last step equal transformers' incremental forward.
    ids = prompt_ids(36, seed=7)
    model = _model(directory)
    state = model.new_state()
    with torch.no_grad():
        out = hf(ids[None, :30], use_cache=True)
        cache = out.cache
        torch.testing.assert_close(
            model.prefill(ids[:30], state), out.logits[0, -1], atol=ATOL, rtol=0
        )
        for pos in range(30, 36):
            out = hf(ids[None, pos : pos + 1], cache=cache, use_cache=True)
            got = model.decode(int(ids[pos]), state)
            torch.testing.assert_close(got, out.logits[0, -1], atol=ATOL, rtol=0)
    assert state.num_tokens == 36
    _assert_state_equals_cache(state, cache, model.config.num_layers)


def test_greedy_tokens_equal_generate(directory: Path, hf) -> None:
    prompt = prompt_ids(21, seed=5)
    with torch.no_grad():
        generated = hf.generate(
            prompt[None],
            attention_mask=torch.ones(1, 21, dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    want = generated[0, 21:].tolist()
    model = _model(directory)
    state = model.new_state()
    token = int(model.prefill(prompt, state).argmax())
    got = [token]
    for _ in range(9):
        token = int(model.decode(token, state).argmax())
        got.append(token)
    assert got == want


@pytest.mark.parametrize("split", [9, 16, 27])
def test_prefill_after_cached_prefix_equals_whole_prompt(directory: Path, split: int) -> None:
    # The second prefill's top-k selects among the cached prefix's keys too: its logits
    # equal the whole prompt's from scratch (page-aligned and unaligned prefixes).
    ids = prompt_ids(PROMPT, seed=11)
    model = _model(directory)
    whole = model.prefill(ids, model.new_state(), all_logits=True)
    state = model.new_state()
    model.prefill(ids[:split], state)
    rest = model.prefill(ids[split:], state.clone(), all_logits=True)
    torch.testing.assert_close(rest, whole[split:], atol=ATOL, rtol=0)


def test_unsupported_features_are_named(tmp_path: Path) -> None:
    import json

    directory = build(tmp_path, name="dynamic")
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        load_checkpoint(directory)
    with pytest.raises(ValueError, match="index_topk"):
        dataclasses.replace(load_checkpoint(build(tmp_path)).config, index_topk=0)
    assert hf_config().index_topk == INDEX_TOPK


def test_resume_from_every_tier_equals_recompute(directory: Path, one_rank_topology, tmp_path):
    # The latent (keys-only KV) and indexer pages cached and reloaded from L1 / L2 / L3 at
    # aligned and unaligned boundaries: the suffix's top-k selects among reloaded keys.
    from tests.checkpoint_cases import assert_resume_from_every_tier

    assert_resume_from_every_tier(one_rank_topology, directory, tmp_path)


@pytest.mark.parametrize("num_queries", [1, 5])
def test_absorbed_attention_equals_expanded(directory: Path, num_queries: int) -> None:
    # Decode (and short suffixes) fold kv_b into the query / output and attend in the
    # latent space over the selected keys only; prefill expands every key. Same result.
    model = _model(directory)
    layer = model.blocks[1].mixer
    ids = prompt_ids(PROMPT, seed=2)
    state = model.new_state()
    model.prefill(ids, state)
    x = torch.randn(num_queries, model.config.d_model, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(PROMPT - num_queries, PROMPT)
    q, q_idx, w_idx, _, _ = layer._project_in(x, positions)
    latent = state.latent[layer.layer_id]
    allowed = layer._select(q_idx, w_idx, state.index_k[layer.layer_id], positions)
    assert int(allowed.sum(-1).max()) == INDEX_TOPK < PROMPT - num_queries
    want = layer._attend_expanded(q, latent, allowed, x.dtype)
    got = layer._attend_absorbed(q, latent, allowed, x.dtype)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # A different key set gives a different output: the mask is honoured.
    other = layer._attend_absorbed(q, latent, allowed.roll(1, dims=-1), x.dtype)
    assert (other - want).abs().max() > 1e-3


def test_bfloat16_close_to_transformers(directory: Path, hf) -> None:
    # bfloat16 rounding moves transformers' own logits from its float32 ones; ours must
    # stay as close to float32 as transformers' bfloat16 (at most 1.5x its error).
    ckpt = load_checkpoint(directory, dtype=torch.bfloat16)
    model = HybridModel(ckpt.config, weights=ckpt.weights)
    assert model.blocks[0].mixer.w_in.dtype == torch.bfloat16
    assert model.blocks[0].mixer.index_w.dtype == torch.float32
    ids = prompt_ids(PROMPT)
    with torch.no_grad():
        exact = hf(ids[None]).logits[0].float()
        theirs = hf_model(directory, torch.bfloat16)(ids[None]).logits[0].float()
    got = model.prefill(ids, model.new_state(), all_logits=True)
    assert model.new_state().latent[0].dtype == torch.bfloat16
    their_err = (theirs - exact).abs().max()
    assert 0 < their_err < 0.5 * exact.abs().max()
    assert (got - exact).abs().max() <= 1.5 * their_err


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,  # != mscale: cos/sin scaled by their ratio, softmax scale too
    "beta_fast": 32,
    "beta_slow": 1,
}


def test_yarn_rope_equals_transformers(tmp_path: Path) -> None:
    # DeepSeek-V3.2 ships YaRN: scaled inverse frequencies, cos/sin times the attention
    # factor and the softmax scale times mscale(factor, mscale_all_dim)^2.
    directory = build(tmp_path, name="yarn", rope_parameters=YARN)
    c = load_checkpoint(directory).config
    assert len(c.rope_inv_freq) == 4 and c.rope_cos_scale != 1.0
    assert c.attn_scale != c.head_dim**-0.5
    ids = prompt_ids(PROMPT, seed=9)
    hf = hf_model(directory)
    model = _model(directory)
    state = model.new_state()
    with torch.no_grad():
        out = hf(ids[None, :-1], use_cache=True)
        torch.testing.assert_close(
            model.prefill(ids[:-1], state, all_logits=True), out.logits[0], atol=ATOL, rtol=0
        )
        step = hf(ids[None, -1:], cache=out.cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(model.decode(int(ids[-1]), state), step, atol=ATOL, rtol=0)
    # Not the plain RoPE: the same weights without YaRN give other logits.
    plain = _model(directory, rope_inv_freq=(), rope_cos_scale=1.0)
    other = plain.prefill(ids[:-1], plain.new_state(), all_logits=True)
    assert (other - out.logits[0]).abs().max() > 100 * ATOL


def test_mla_config_is_validated(directory: Path) -> None:
    from runtime.model import ModelConfig

    c = load_checkpoint(directory).config
    with pytest.raises(ValueError, match="head_dim=18 must be qk_nope_head_dim"):
        dataclasses.replace(c, head_dim=18)
    with pytest.raises(ValueError, match="rope_inv_freq has 3 values"):
        dataclasses.replace(c, rope_inv_freq=(1.0, 0.5, 0.25))
    with pytest.raises(ValueError, match="q_lora_rank must be a positive int"):
        ModelConfig(attn_kind="mla", layer_pattern="AA", head_dim=8)
    with pytest.raises(ValueError, match="rope_cos_scale is for MLA and windowed"):
        ModelConfig(rope_cos_scale=2.0)
