"""Hugging Face checkpoints on one rank equal transformers on the same weights.

Oracle: transformers' own eager PyTorch implementation of each architecture, loading
the same ``save_pretrained`` directory. Tolerance (float32): ATOL = 1e-4 on logits of
magnitude ~1-10; only the order of float sums differs (our chunked scan vs theirs,
SDPA vs eager attention). Measured max differences are ~1e-6. bfloat16 is checked
against transformers in bfloat16 with a tolerance of 5e-2 relative to the logit scale
(both round activations to 8 bits, in different places).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.checkpoints import SUPPORTED, load_checkpoint
from runtime.model import HybridModel
from tests.checkpoint_cases import (
    ATOL,
    CASES,
    DENSE_CASES,
    PROMPT,
    assert_greedy_equals_generate,
    assert_prefill_equals_transformers,
    assert_resume_from_every_tier,
    build,
    hf_conv_to_runtime,
    hf_layer_index,
    hf_model,
)
from tests.checkpoint_cases import prompt_ids as _ids


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_ckpt")


@pytest.mark.parametrize("case", CASES + DENSE_CASES)
def test_logits_and_state_equal_transformers(root: Path, case: str) -> None:
    # The state after the prompt equals transformers' cache, layer by layer.
    assert_prefill_equals_transformers(
        build(case, root),
        lambda config, layer: hf_layer_index(case, config, layer),
        hf_conv_to_runtime,
        lambda ssm: ssm.float(),
    )


@pytest.mark.parametrize("case", CASES + DENSE_CASES)
def test_greedy_tokens_equal_generate(root: Path, case: str) -> None:
    assert_greedy_equals_generate(build(case, root))


def test_nemotron_dt_clamp_is_applied(root: Path) -> None:
    # Two heads per SSM layer have dt ~ 5e-5 < time_step_limit[0]: without the clamp the
    # logits move far beyond the tolerance (checked here so the case can fail).
    directory = build("nemotron_h", root)
    ckpt = load_checkpoint(directory)
    assert ckpt.config.dt_min == pytest.approx(1e-3)
    ids = _ids(PROMPT)
    clamped = HybridModel(ckpt.config, weights=ckpt.weights)
    from dataclasses import replace

    free = HybridModel(replace(ckpt.config, dt_min=0.0), weights=ckpt.weights)
    a = clamped.prefill(ids, clamped.new_state(), all_logits=True)
    b = free.prefill(ids, free.new_state(), all_logits=True)
    assert (a - b).abs().max() > 100 * ATOL


@pytest.mark.parametrize("case", ["granite_moe", "nemotron_h"])
def test_bfloat16_close_to_transformers(root: Path, case: str) -> None:
    directory = build(case, root)
    ckpt = load_checkpoint(directory, dtype=torch.bfloat16)
    assert ckpt.config.dtype == torch.bfloat16
    model = HybridModel(ckpt.config, weights=ckpt.weights)
    assert model.blocks[0].mixer.w_out.dtype == torch.bfloat16
    ids = _ids(PROMPT)
    with torch.no_grad():
        want = hf_model(directory, torch.bfloat16)(ids[None], use_cache=False).logits[0].float()
    got = model.prefill(ids, model.new_state(), all_logits=True)
    scale = want.abs().max()
    assert (got - want).abs().max() < 5e-2 * scale


def test_config_follows_the_checkpoint(root: Path) -> None:
    c = load_checkpoint(build("granite_moe", root)).config
    assert (c.layer_pattern, c.blocks) == ("SASS", "SEAESESE")
    assert (c.num_groups, c.rope_dim, c.tie_embeddings) == (1, 0, True)
    assert (c.embed_scale, c.attn_scale, c.residual_scale, c.logits_scale) == (3.0, 0.25, 0.6, 2.5)
    assert (c.num_experts, c.experts_per_token, c.expert_hidden) == (4, 2, 16)
    spec = c.state_spec(16)
    assert spec.mamba is not None and spec.mamba.num_groups == 1
    assert spec.mamba.conv_dim == 8 * 8 + 2 * 1 * 8
    b = load_checkpoint(build("bamba", root)).config
    assert (b.rope_dim, b.head_dim, b.num_groups) == (4, 8, 2)
    n = load_checkpoint(build("nemotron_h", root)).config
    assert (n.blocks, n.layer_pattern, n.mlp_kind, n.router) == (
        "MSEAMSS",
        "SASS",
        "relu2",
        "sigmoid",
    )
    assert n.layer_blocks() == [[0, 1, 2], [3, 4], [5], [6]]
    assert (c.scan_chunk, b.scan_chunk, n.scan_chunk) == (16, 16, 16)  # the checkpoints'


def test_checkpoint_chunk_size_stays_within_tolerance(root: Path, tmp_path: Path) -> None:
    # Granite 4.0-H saves mamba_chunk_size 128: a 300-token prompt crosses chunk borders
    # at 128 and 256; the logits equal the 16-token chunks' within ATOL.
    import os

    directory = build("granite_moe", root)
    hf = json.loads((directory / "config.json").read_text()) | {"mamba_chunk_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    os.symlink(directory / "model.safetensors", tmp_path / "model.safetensors")
    wide = load_checkpoint(tmp_path)
    assert wide.config.scan_chunk == 128
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(1))
    logits = []
    for ckpt in (wide, load_checkpoint(directory)):
        model = HybridModel(ckpt.config, weights=ckpt.weights)
        logits.append(model.prefill(ids, model.new_state(), all_logits=True))
    assert logits[0].abs().max() > 1.0
    torch.testing.assert_close(logits[0], logits[1], atol=ATOL, rtol=0)


def test_dense_config_follows_the_checkpoint(root: Path) -> None:
    q = load_checkpoint(build("qwen3_moe", root)).config
    assert (q.layer_pattern, q.blocks, q.qk_norm, q.attn_bias) == ("AAA", "AEAMAE", True, False)
    assert (q.num_experts, q.experts_per_token, q.expert_hidden, q.router_normalize) == (
        4,
        2,
        16,
        False,
    )
    spec = q.state_spec(16)  # KV only: the cache keeps no recurrent state
    assert spec.mamba is None and spec.kv is not None and spec.kv.layer_ids == (0, 1, 2)
    assert load_checkpoint(build("qwen2", root)).config.attn_bias
    assert load_checkpoint(build("qwen3", root)).config.head_dim == 16
    llama = load_checkpoint(build("llama", root)).config
    assert llama.tie_embeddings and len(llama.rope_inv_freq) == llama.head_dim // 2
    # The llama3 scaling divides the long wavelengths by factor 8 (theta 5e5, head 8).
    assert llama.rope_inv_freq[-1] == pytest.approx(500000.0 ** (-6 / 8) / 8)


@pytest.mark.parametrize(
    ("case", "edit", "message"),
    [
        ("mistral", {"sliding_window": 4096}, "sliding_window"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ],
)
def test_dense_unsupported_feature_is_a_clear_error(
    root: Path, tmp_path: Path, case: str, edit: dict, message: str
) -> None:
    hf = json.loads((build(case, root) / "config.json").read_text()) | edit
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path)


def test_stop_ids_as_transformers_takes_them(root: Path, tmp_path: Path) -> None:
    # generation_config.json first (a list allowed), then config.json, then the tokenizer.
    from runtime.checkpoints.loader import stop_ids

    hf = json.loads((build("llama", root) / "config.json").read_text())
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        (tmp_path / name).unlink(missing_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(hf | {"eos_token_id": None}))
    assert stop_ids(tmp_path) == ()
    tokens = {"added_tokens": [{"id": 5, "content": "<|end|>"}], "model": {"vocab": {"x": 9}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokens))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    assert stop_ids(tmp_path) == (5,)
    (tmp_path / "config.json").write_text(json.dumps(hf | {"eos_token_id": [2, 3]}))
    assert stop_ids(tmp_path) == (2, 3)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8, 7]}))
    assert stop_ids(tmp_path) == (7, 8)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert stop_ids(tmp_path) == (4,)
    assert load_checkpoint(build("llama", root)).eos_token_ids == (2,)  # LlamaConfig's


def test_unsupported_architecture_lists_the_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load_checkpoint(tmp_path)
    for arch in SUPPORTED:
        assert arch in str(err.value)
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(tmp_path / "missing")


def test_unsupported_feature_is_a_clear_error(root: Path, tmp_path: Path) -> None:
    directory = build("bamba", root)
    hf = json.loads((directory / "config.json").read_text())
    hf["mlp_bias"] = True
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="mlp_bias"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("case", ["granite_moe", "nemotron_h", "llama", "qwen3_moe"])
def test_resume_from_every_tier_equals_recompute(
    root: Path, case: str, one_rank_topology, tmp_path
):
    assert_resume_from_every_tier(one_rank_topology, build(case, root), tmp_path)


def test_legacy_config_keys_give_the_same_model(root: Path, tmp_path: Path) -> None:
    # Released Nemotron-H / Granite configs predate transformers 5's key names.
    import os

    # Hub configs of Llama 3.1 keep ``rope_scaling`` + ``rope_theta``, of Qwen3-MoE
    # ``num_experts``.
    llama_rope = json.loads((build("llama", root) / "config.json").read_text())["rope_parameters"]
    for case, edit in (
        ("nemotron_h", {"hybrid_override_pattern": "-ME*-MM", "attention_head_dim": 8}),
        ("granite_moe", {"layer_types": ["mamba", "attention", "mamba", "mamba"]}),
        ("llama", {"rope_scaling": llama_rope, "rope_theta": llama_rope.pop("rope_theta")}),
        ("qwen3_moe", {"num_experts": 4}),
    ):
        directory = build(case, root)
        hf = json.loads((directory / "config.json").read_text())
        hf.pop("layers_block_type", None)
        hf.pop("head_dim", None) if case == "nemotron_h" else None
        hf.pop("rope_parameters", None) if case == "llama" else None
        hf.pop("num_local_experts", None) if case == "qwen3_moe" else None
        hf |= edit
        legacy = tmp_path / case
        legacy.mkdir()
        (legacy / "config.json").write_text(json.dumps(hf))
        os.symlink(directory / "model.safetensors", legacy / "model.safetensors")
        new, old = load_checkpoint(directory).config, load_checkpoint(legacy).config
        assert (old.blocks, old.head_dim) == (new.blocks, new.head_dim)
        ids = _ids(11)
        a = HybridModel(new, weights=load_checkpoint(directory).weights)
        b = HybridModel(old, weights=load_checkpoint(legacy).weights)
        torch.testing.assert_close(
            a.prefill(ids, a.new_state()), b.prefill(ids, b.new_state()), atol=0, rtol=0
        )
