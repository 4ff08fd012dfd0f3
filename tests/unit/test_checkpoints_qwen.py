"""Qwen3-Next / Qwen3.5 (Gated DeltaNet hybrids) on one rank equal transformers.

Oracle: transformers' eager PyTorch implementation on the same ``save_pretrained``
directory. Tolerance (float32): ATOL = 1e-4 on logits of magnitude ~1-10 (only the order
of float sums differs: our chunked delta rule vs theirs, SDPA vs eager attention).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.checkpoints import load_checkpoint
from tests.checkpoint_cases import (
    PROMPT,
    assert_bfloat16_close_to_transformers,
    assert_greedy_equals_generate,
    assert_prefill_equals_transformers,
    assert_resume_from_every_tier,
)
from tests.qwen_cases import CASES, build, hf_conv_to_runtime, hf_recurrent_to_runtime


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qwen_ckpt")


@pytest.mark.parametrize("case", CASES)
def test_logits_and_state_equal_transformers(root: Path, case: str) -> None:
    # One cache layer per decoder layer: transformers' index is the layer's own.
    assert_prefill_equals_transformers(
        build(case, root),
        lambda config, layer: layer,
        hf_conv_to_runtime,
        hf_recurrent_to_runtime,
    )


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_generate(root: Path, case: str) -> None:
    assert_greedy_equals_generate(build(case, root))


@pytest.mark.parametrize("case", ["qwen3_next", "qwen35"])
def test_resume_from_every_tier_equals_recompute(
    root: Path, case: str, one_rank_topology, tmp_path
):
    # The recurrent state goes through the cache's one recurrent family (L1, L2, L3;
    # aligned and unaligned prefixes; evict and reload), like a Mamba-2 state.
    assert_resume_from_every_tier(one_rank_topology, build(case, root), tmp_path)


def test_bfloat16_close_to_transformers(root: Path) -> None:
    # bfloat16 rounding on this random model moves transformers' own logits by ~0.8 (of a
    # scale ~4) from its float32 ones; a wrong bfloat16 path would not stay within 1.5x.
    model = assert_bfloat16_close_to_transformers(build("qwen3_next", root), PROMPT)
    assert model.blocks[0].mixer.w_out.dtype == torch.bfloat16


def test_config_follows_the_checkpoint(root: Path) -> None:
    c = load_checkpoint(build("qwen3_next", root)).config
    assert (c.layer_pattern, c.blocks) == ("SSAS", "SESMAESE")  # layer 1 is mlp-only
    assert (c.ssm_kind, c.attn_kind, c.norm_offset, c.shared_expert_gate) == (
        "gdn",
        "gated",
        1.0,
        True,
    )
    assert (c.ssm_heads, c.ssm_groups, c.ssm_head_dim, c.ssm_state_dim) == (4, 2, 6, 8)
    assert c.rope_dim == 4  # partial rotary 0.5 of head_dim 8
    rec = c.state_spec(16).mamba
    assert rec is not None and rec.ssm_shape == (4, 6, 8) and rec.conv_dim == 2 * 2 * 8 + 4 * 6
    d = load_checkpoint(build("qwen35", root)).config
    assert (d.blocks, d.ssm_groups, d.tie_embeddings) == ("SMSMAMSM", 1, True)
