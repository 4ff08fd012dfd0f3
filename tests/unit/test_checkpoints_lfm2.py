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
    assert_greedy_equals_generate,
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
    directory = build(case, root)
    ckpt = load_checkpoint(directory)
    ids = prompt_ids(LENGTH)
    out = _theirs(directory, ids)
    want = out.logits[0].float()
    assert want.abs().max() > 1.0  # a non-trivial model
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    state = model.new_state()
    got = model.prefill(ids, state, all_logits=True)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    c = ckpt.config
    assert state.ssm == {}  # a short conv keeps its conv window only
    for layer in range(c.num_layers):
        if layer in state.k:
            keys = out.cache.layers[layer].keys[0].transpose(0, 1)
            values = out.cache.layers[layer].values[0].transpose(0, 1)
            torch.testing.assert_close(state.k[layer], keys, atol=ATOL, rtol=0)
            torch.testing.assert_close(state.v[layer], values, atol=ATOL, rtol=0)
        else:
            theirs = out.cache.get_conv_state(layer, state_idx=0)[0]
            conv = theirs[:, -(c.conv_kernel - 1) :]
            assert state.conv[layer].shape == (c.d_model, c.conv_kernel - 1)
            torch.testing.assert_close(state.conv[layer], conv, atol=ATOL, rtol=0)


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
    from mesh_hicache.pools.device import DevicePools

    directory = build(case, root)
    ckpt = load_checkpoint(directory)
    ids = prompt_ids(LENGTH)
    want = _theirs(directory, ids).logits[0].float()
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    state = model.new_state()
    if paged:
        pools = DevicePools(model.layout, num_pages=8, num_slots=1)
        state = model.paged_state(pools, [5, 2, 7])
    got = [model.prefill(ids[:1], state, all_logits=True)]
    got.append(model.prefill(ids[1:3], state, all_logits=True))
    got.append(model.prefill(ids[3:14], state, all_logits=True))
    for i in range(14, LENGTH):
        got.append(model.decode(int(ids[i]), state)[None])
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_batched_decode_equals_one_by_one(root: Path, case: str) -> None:
    ckpt = load_checkpoint(build(case, root))
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    prompts = [prompt_ids(9, seed=1), prompt_ids(4, seed=2), prompt_ids(13, seed=3)]
    states = [model.new_state() for _ in prompts]
    singles = [model.new_state() for _ in prompts]
    for p, s, one in zip(prompts, states, singles, strict=True):
        model.prefill(p, s)
        model.prefill(p, one)
    tokens = [7, 100, 3]
    batch = model.decode_batch(tokens, states)
    for i, (tok, one) in enumerate(zip(tokens, singles, strict=True)):
        torch.testing.assert_close(batch[i], model.decode(tok, one), atol=ATOL, rtol=0)
        for lid, conv in one.conv.items():
            # The batch's one GEMM rounds B * x like a different sum order: ~1e-7.
            torch.testing.assert_close(states[i].conv[lid], conv, atol=ATOL, rtol=0)


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
    # bfloat16 rounding moves transformers' own logits away from its float32 ones; ours
    # must stay as close to float32 as transformers' bfloat16 (at most 1.5x its error).
    directory = build(case, root)
    ckpt = load_checkpoint(directory, dtype=torch.bfloat16)
    model = HybridModel(ckpt.config, weights=ckpt.weights)
    ids = prompt_ids(LENGTH)
    with torch.no_grad():
        exact = hf_model(directory)(ids[None]).logits[0].float()
        theirs = hf_model(directory, torch.bfloat16)(ids[None]).logits[0].float()
    got = model.prefill(ids, model.new_state(), all_logits=True)
    their_err = (theirs - exact).abs().max()
    assert 0 < their_err < 0.5 * exact.abs().max()
    assert (got - exact).abs().max() <= 1.5 * their_err
