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
from runtime.engine import Engine
from runtime.model import HybridModel
from tests.qwen_cases import CASES, build, hf_conv_to_runtime, hf_model, hf_recurrent_to_runtime

ATOL = 1e-4
PROMPT = 37


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qwen_ckpt")


def _ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_logits_and_state_equal_transformers(root: Path, case: str) -> None:
    directory = build(case, root)
    ckpt = load_checkpoint(directory)
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    ids = _ids(PROMPT)
    hf = hf_model(directory)
    with torch.no_grad():
        out = hf(ids[None], position_ids=torch.arange(PROMPT)[None], use_cache=True)
    want = out.logits[0].float()
    assert want.abs().max() > 1.0  # a non-trivial model
    state = model.new_state()
    got = model.prefill(ids, state, all_logits=True)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    c = ckpt.config
    for layer in range(c.num_layers):
        if layer in state.k:
            keys = out.cache.layers[layer].keys[0].transpose(0, 1)
            values = out.cache.layers[layer].values[0].transpose(0, 1)
            torch.testing.assert_close(state.k[layer], keys, atol=ATOL, rtol=0)
            torch.testing.assert_close(state.v[layer], values, atol=ATOL, rtol=0)
        else:
            conv = hf_conv_to_runtime(out.cache.get_conv_state(layer, state_idx=0)[0], c)
            rec = hf_recurrent_to_runtime(out.cache.get_recurrent_state(layer, state_idx=0)[0])
            torch.testing.assert_close(state.conv[layer], conv, atol=ATOL, rtol=0)
            torch.testing.assert_close(state.ssm[layer], rec, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_generate(root: Path, case: str) -> None:
    directory = build(case, root)
    ckpt = load_checkpoint(directory)
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    prompt = _ids(21, seed=5)
    with torch.no_grad():
        generated = hf_model(directory).generate(
            prompt[None],
            attention_mask=torch.ones(1, 21, dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    want = generated[0, 21:].tolist()
    got = Engine(model, None, max_new_tokens=8).serve(prompt.tolist()).output_ids
    assert got == want


@pytest.mark.parametrize("case", ["qwen3_next", "qwen35"])
def test_resume_from_every_tier_equals_recompute(
    root: Path, case: str, one_rank_topology, tmp_path
):
    # The recurrent state goes through the cache's one recurrent family (L1, L2, L3;
    # aligned and unaligned prefixes; evict and reload), like a Mamba-2 state.
    from tests.engine_cases import ATOL as RESUME_ATOL
    from tests.engine_cases import resume_scenarios

    directory = build(case, root)
    checks = resume_scenarios(one_rank_topology, root=str(tmp_path), checkpoint=str(directory))
    for c in checks:
        assert c.cached > 0, f"{c.label}: expected a {c.tier} hit"
        assert c.max_diff < RESUME_ATOL, f"{c.label}: logits differ by {c.max_diff}"
        assert c.tokens_equal, c.label
    assert {c.tier for c in checks} == {"device", "host", "storage"}


def test_bfloat16_close_to_transformers(root: Path) -> None:
    # bfloat16 rounding on this random model moves transformers' own logits by ~0.8 (of a
    # scale ~4) from its float32 ones; ours must stay as close to float32 as transformers'
    # bfloat16 (at most 1.5x its error), which a wrong bfloat16 path would not.
    directory = build("qwen3_next", root)
    ckpt = load_checkpoint(directory, dtype=torch.bfloat16)
    model = HybridModel(ckpt.config, weights=ckpt.weights)
    assert model.blocks[0].mixer.w_out.dtype == torch.bfloat16
    ids = _ids(PROMPT)
    with torch.no_grad():
        exact = hf_model(directory)(ids[None]).logits[0].float()
        theirs = hf_model(directory, torch.bfloat16)(ids[None]).logits[0].float()
    got = model.prefill(ids, model.new_state(), all_logits=True)
    their_err = (theirs - exact).abs().max()
    assert 0 < their_err < 0.5 * exact.abs().max()
    assert (got - exact).abs().max() <= 1.5 * their_err


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
