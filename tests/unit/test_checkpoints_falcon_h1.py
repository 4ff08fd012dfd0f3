"""Falcon-H1 (attention and Mamba-2 in parallel in every layer) on one rank equals
transformers.

Oracle: transformers' ``FalconH1ForCausalLM`` (its PyTorch chunked scan, eager attention)
on the same ``save_pretrained`` directory. Tolerance (float32): ATOL = 1e-4 on logits of
magnitude ~2.5 (``falcon_h1``) and ~12 (``falcon_h1_norm``); measured 6e-7 and 3e-6:
the muP multipliers folded into the weights and the order of float sums are the only
differences. Leaving the multipliers out moves the logits by far more (checked, so the
comparison cannot pass by accident).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from runtime.checkpoints import falcon_h1, load_checkpoint
from runtime.model import HybridModel
from runtime.model.parallel_mixer import ParallelMixer
from tests.checkpoint_cases import (
    PROMPT,
    assert_bfloat16_close_to_transformers,
    assert_chunked_prefill_and_decode_equal,
    assert_decode_batch_equals_one_by_one,
    assert_greedy_equals_generate,
    assert_prefill_equals_transformers,
    assert_resume_from_every_tier,
    hf_conv_to_runtime,
    hf_logits,
    prompt_ids,
)
from tests.falcon_h1_cases import CASES, build

LENGTH = 45


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("falcon_h1_ckpt")


@pytest.mark.parametrize("case", CASES)
def test_logits_and_both_states_equal_transformers(root: Path, case: str) -> None:
    # Every layer keeps K/V AND a conv / SSM state: both must equal transformers' cache.
    directory = build(case, root)
    state = assert_prefill_equals_transformers(
        directory, lambda config, layer: layer, hf_conv_to_runtime, lambda ssm: ssm.float()
    )
    layers = list(range(load_checkpoint(directory).config.num_layers))
    assert sorted(state.k) == sorted(state.conv) == sorted(state.ssm) == layers


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_chunked_prefill_and_decode_equal_transformers(root: Path, case: str, paged: bool) -> None:
    # Chunks of 5 and 11 tokens then one-token decodes (attention over the cached K/V and
    # the recurrent step), each position's logits against transformers' full forward.
    assert_chunked_prefill_and_decode_equal(build(case, root), LENGTH, paged)


def test_decode_batch_equals_one_by_one(root: Path) -> None:
    assert_decode_batch_equals_one_by_one(build("falcon_h1", root))


def test_multipliers_and_both_mixers_matter(root: Path, monkeypatch) -> None:
    # Without the folded muP multipliers, or without either mixer of the parallel layer,
    # the logits move by far more than the tolerance.
    directory = build("falcon_h1", root)
    ids = prompt_ids(PROMPT)
    want = hf_logits(directory, ids)

    def logits(model: HybridModel) -> torch.Tensor:
        return model.prefill(ids, model.new_state(), all_logits=True)

    ckpt = load_checkpoint(directory)
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    for block in model.blocks:
        assert isinstance(block.mixer, ParallelMixer)
        block.mixer.recurrent.w_out = torch.zeros_like(block.mixer.recurrent.w_out)
    assert (logits(model) - want).abs().max() > 1e-2
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    for block in model.blocks:
        assert isinstance(block.mixer, ParallelMixer)
        block.mixer.attention.wo = torch.zeros_like(block.mixer.attention.wo)
    assert (logits(model) - want).abs().max() > 1e-2
    monkeypatch.setattr(falcon_h1, "_multipliers", lambda hf: {})
    ckpt = load_checkpoint(directory)
    assert (logits(HybridModel(ckpt.config, weights=ckpt.weights)) - want).abs().max() > 1e-2


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers(root: Path, case: str) -> None:
    assert_greedy_equals_generate(build(case, root))


def test_resume_from_every_tier_equals_recompute(root: Path, one_rank_topology, tmp_path):
    # Each layer's K/V pages and its state slot go through L1, L2 and L3 together.
    assert_resume_from_every_tier(one_rank_topology, build("falcon_h1", root), tmp_path)


def test_config_and_spec_follow_the_checkpoint(root: Path) -> None:
    c = load_checkpoint(build("falcon_h1", root)).config
    assert (c.layer_pattern, c.blocks, c.ssm_norm) == ("PPP", "PMPMPM", "none")
    assert (c.ssm_heads, c.ssm_head_dim, c.ssm_groups, c.ssm_state_dim) == (8, 8, 2, 8)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rope_dim) == (4, 2, 8, 8)
    spec = c.state_spec(16)
    assert spec.kv is not None and spec.mamba is not None
    assert spec.kv.layer_ids == spec.mamba.layer_ids == (0, 1, 2)
    assert spec.mamba.conv_shape == (64 + 2 * 2 * 8, 3) and spec.mamba.ssm_shape == (8, 8, 8)
    normed = load_checkpoint(build("falcon_h1_norm", root)).config
    assert (normed.ssm_norm, normed.tie_embeddings, normed.ssm_head_dim) == (
        "before_gate",
        True,
        16,
    )
    with pytest.raises(ValueError, match="parallel"):
        replace(c, attn_kind="gated")
    with pytest.raises(ValueError, match="ssm_norm"):
        replace(c, ssm_norm="sometimes")


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("projectors_bias", True, "projectors_bias"),
        ("mamba_proj_bias", True, "mamba_proj_bias"),
        ("attention_bias", True, "attention_bias"),
        ("mlp_bias", True, "mlp_bias"),
        ("hidden_act", "gelu", "hidden_act"),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}, "rope"),
        ("ssm_multipliers", [1.0, 1.0], "ssm_multipliers"),
    ],
)
def test_unsupported_options_are_refused(root: Path, key: str, value, match: str) -> None:
    hf = json.loads((build("falcon_h1", root) / "config.json").read_text())
    hf[key] = value
    with pytest.raises(ValueError, match=f"FalconH1ForCausalLM: .*{match}"):
        falcon_h1.ADAPTER.model_config(hf, torch.float32, "m")


def test_bfloat16_close_to_transformers(root: Path) -> None:
    assert_bfloat16_close_to_transformers(build("falcon_h1", root), PROMPT)
