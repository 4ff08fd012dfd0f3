"""LFM2 (gated short convolutions + attention) on one rank equals transformers.

Oracle: transformers' eager implementation on the same ``save_pretrained`` directory.
Tolerance (float32): ATOL = 1e-4 on logits, K/V and conv state, as for the other
checkpoints (max logit magnitude ~26 with the tied head; observed ~1e-5: only the order
of float sums differs). A conv state that is one token off, or a conv without its gates,
moves the logits by far more (checked below, so the comparison cannot pass by accident).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mesh_hicache.choices import RegionName
from runtime.checkpoints import load_checkpoint
from runtime.model import HybridModel
from tests.checkpoint_cases import (
    ATOL,
    assert_bfloat16_close_to_transformers,
    assert_chunked_prefill_and_decode_equal,
    assert_decode_batch_equals_one_by_one,
    assert_greedy_equals_generate,
    assert_prefill_equals_transformers,
    assert_resume_from_every_tier,
    hf_model,
    prompt_ids,
)
from tests.lfm2_cases import CASES, build

LENGTH = 37


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lfm2_ckpt")


def _theirs(directory: Path, ids: torch.Tensor):
    with torch.no_grad():
        return hf_model(directory)(ids[None], position_ids=torch.arange(len(ids))[None])


@pytest.mark.parametrize("case", CASES)
def test_prefill_logits_and_state_equal_transformers(root: Path, case: str) -> None:
    # One cache layer per decoder layer; a short conv keeps its conv window only (the
    # last L_cache - 1 inputs of transformers' window), no recurrent state.
    directory = build(case, root)
    state = assert_prefill_equals_transformers(
        directory,
        lambda config, layer: layer,
        lambda conv, config: conv[:, -(config.conv_kernel - 1) :],
        None,
    )
    c = load_checkpoint(directory).config
    for conv in state.conv.values():
        assert conv.shape == (c.d_model, c.conv_kernel - 1)


def test_the_gated_conv_matters(root: Path) -> None:
    # A kernel one shorter (a window one token short) moves the logits far past ATOL.
    directory = build("lfm2", root)
    ckpt = load_checkpoint(directory)
    ids = prompt_ids(LENGTH)
    want = _theirs(directory, ids).logits[0].float()
    weights = load_checkpoint(directory).weights

    class Shorter:
        def get(self, name, rows=None, cols=None):
            w = weights.get(name, rows, cols)
            return w[:, 1:] if name.endswith(".conv") else w

    short = replace(ckpt.config, conv_kernel=ckpt.config.conv_kernel - 1)
    model = HybridModel(short, weights=Shorter(), page_size=16)
    got = model.prefill(ids, model.new_state(), all_logits=True)
    assert (got - want).abs().max() > 1e-2


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("paged", [False, True])
def test_chunked_prefill_and_decode_equal_transformers(root: Path, case: str, paged: bool):
    # Chunks of 1, 2 and 11 tokens (shorter and longer than the conv window) then
    # one-token decodes; every position's logits against transformers' full forward.
    directory = build(case, root)
    want = _theirs(directory, prompt_ids(LENGTH)).logits[0].float()
    assert_chunked_prefill_and_decode_equal(
        directory, LENGTH, paged, chunks=(1, 2, 11), page_ids=(5, 2, 7), want=want
    )


@pytest.mark.parametrize("case", CASES)
def test_batched_decode_equals_one_by_one(root: Path, case: str) -> None:
    prompts = [prompt_ids(9, seed=1), prompt_ids(4, seed=2), prompt_ids(13, seed=3)]
    states, singles = assert_decode_batch_equals_one_by_one(
        build(case, root), prompts, tokens=(7, 100, 3), atol=ATOL
    )
    for batched, one in zip(states, singles, strict=True):
        for lid, conv in one.conv.items():
            # The batch's one GEMM rounds B * x like a different sum order: ~1e-7.
            torch.testing.assert_close(batched.conv[lid], conv, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers(root: Path, case: str) -> None:
    assert_greedy_equals_generate(build(case, root))


@pytest.mark.parametrize("case", CASES)
def test_resume_from_every_tier_equals_recompute(
    root: Path, case: str, one_rank_topology, tmp_path
):
    assert_resume_from_every_tier(one_rank_topology, build(case, root), tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_config_and_spec_follow_the_checkpoint(root: Path, case: str) -> None:
    c = load_checkpoint(build(case, root)).config
    if case == "lfm2":
        assert (c.layer_pattern, c.conv_kernel, c.conv_bias, c.mlp_hidden) == (
            "SASSA",
            3,
            False,
            80,
        )
        assert c.tie_embeddings
    else:
        assert (c.layer_pattern, c.conv_kernel, c.conv_bias, c.mlp_hidden) == ("SSA", 4, True, 48)
        assert not c.tie_embeddings
    assert (c.ssm_kind, c.qk_norm, c.head_dim) == ("shortconv", True, 8)
    spec = c.state_spec(16)
    assert spec.mamba is not None and not spec.mamba.recurrent
    assert spec.mamba.conv_shape == (32, c.conv_kernel - 1)
    assert spec.mamba.layer_ids == c.ssm_layers
    model = HybridModel(c, weights=load_checkpoint(build(case, root)).weights)
    assert not model.layout.has_region(RegionName.MAMBA_SSM)


@pytest.mark.parametrize("case", CASES)
def test_bfloat16_close_to_transformers(root: Path, case: str) -> None:
    assert_bfloat16_close_to_transformers(build(case, root), LENGTH)
