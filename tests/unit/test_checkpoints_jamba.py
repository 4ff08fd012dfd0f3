"""Jamba (Mamba-1 + attention + MoE) on one rank equals transformers.

Oracle: transformers' ``JambaForCausalLM`` (its PyTorch selective scan, eager attention) on
the same ``save_pretrained`` directory. Tolerance (float32): ATOL = 1e-4 on logits of
magnitude ~4 (measured ~1.5e-6; only the order of float sums differs: our chunked scan vs
their token loop). Leaving out the dt / B / C norms moves the logits by far more (checked,
so the comparison cannot pass by accident).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from runtime.checkpoints import load_checkpoint
from runtime.model import HybridModel
from runtime.model.mamba1 import Mamba1
from tests.checkpoint_cases import (
    PROMPT,
    assert_bfloat16_close_to_transformers,
    assert_chunked_prefill_and_decode_equal,
    assert_decode_batch_equals_one_by_one,
    assert_greedy_equals_generate,
    assert_prefill_equals_transformers,
    assert_resume_from_every_tier,
    hf_logits,
    prompt_ids,
)
from tests.jamba_cases import build, hf_conv_to_runtime, hf_recurrent_to_runtime

LENGTH = 45


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jamba_ckpt")


def test_logits_and_state_equal_transformers(root: Path) -> None:
    # Two blocks per decoder layer: transformers' layer index is the cache layer's own.
    assert_prefill_equals_transformers(
        build("jamba", root), lambda config, layer: layer, hf_conv_to_runtime,
        hf_recurrent_to_runtime,
    )  # fmt: skip


@pytest.mark.parametrize("paged", [False, True])
def test_chunked_prefill_and_decode_equal_transformers(root: Path, paged: bool) -> None:
    # Chunks of 5 and 11 tokens then one-token decodes (the recurrent step), each
    # position's logits against transformers' full forward.
    assert_chunked_prefill_and_decode_equal(build("jamba", root), LENGTH, paged)


def test_decode_batch_equals_one_by_one(root: Path) -> None:
    assert_decode_batch_equals_one_by_one(build("jamba", root))


def test_state_norms_matter(root: Path) -> None:
    # The dt / B / C RMSNorms are Jamba's difference from plain Mamba-1: with unit-weight
    # norms in their place (still normalised) the logits move, without them even more.
    directory = build("jamba", root)
    ckpt = load_checkpoint(directory)
    ids = prompt_ids(PROMPT)
    want = hf_logits(directory, ids)
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    for block in model.blocks:
        if isinstance(block.mixer, Mamba1):
            for name in ("dt_norm", "b_norm", "c_norm"):
                setattr(block.mixer, name, torch.ones_like(getattr(block.mixer, name)))
    got = model.prefill(ids, model.new_state(), all_logits=True)
    assert (got - want).abs().max() > 1e-2


def test_greedy_tokens_equal_transformers(root: Path) -> None:
    assert_greedy_equals_generate(build("jamba", root))


def test_resume_from_every_tier_equals_recompute(root: Path, one_rank_topology, tmp_path):
    # The Mamba-1 state goes through the cache's one recurrent family (L1, L2, L3;
    # aligned and unaligned prefixes; evict and reload).
    assert_resume_from_every_tier(one_rank_topology, build("jamba", root), tmp_path)


def test_config_follows_the_checkpoint(root: Path) -> None:
    c = load_checkpoint(build("jamba", root)).config
    # Attention every 3rd layer from 1, MoE every 2nd from 1.
    assert (c.layer_pattern, c.blocks) == ("SASSA", "SMAESMSEAM")
    assert (c.ssm_kind, c.ssm_heads, c.ssm_head_dim, c.ssm_state_dim, c.ssm_dt_rank) == (
        "mamba1", 64, 1, 8, 4,
    )  # fmt: skip
    assert (c.rope_dim, c.router, c.router_normalize, c.num_experts) == (0, "softmax", False, 4)
    rec = c.state_spec(16).mamba
    assert rec is not None and rec.conv_shape == (64, 3) and rec.ssm_shape == (64, 1, 8)
    with pytest.raises(ValueError, match="mamba1"):
        replace(c, ssm_dt_rank=0)


def test_bfloat16_close_to_transformers(root: Path) -> None:
    model = assert_bfloat16_close_to_transformers(build("jamba", root), PROMPT)
    assert model.blocks[0].mixer.w_out.dtype == torch.bfloat16
