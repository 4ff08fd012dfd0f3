"""Tiny random DeepSeek-V3.2 checkpoints built by transformers (no download).

``build(root)`` saves a ``DeepseekV32ForCausalLM`` with MLA (q/kv lora ranks, a decoupled
RoPE key), the lightning indexer (``index_topk`` = 6, far below the prompts the tests use,
so the top-k really drops keys), one dense first layer and MoE layers (group-limited
sigmoid router with a correction bias, a shared expert). Weights are re-drawn so the
model is non-trivial. ``hf_latent`` / ``hf_index_keys`` read transformers' cache in this
runtime's :class:`~runtime.model.SeqState` layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
pytest.importorskip("safetensors", reason="needs safetensors (test extra)")

from tests.checkpoint_cases import hf_model, prompt_ids  # noqa: E402,F401  (re-exported)

VOCAB = 128
INDEX_TOPK = 6
CASE = "deepseek_v32"


def hf_config(**overrides: object):
    """The tiny config: 3 layers (dense, MoE, MoE), 4 heads; every size splits over tp=2."""
    values: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        index_topk=INDEX_TOPK,
        index_head_dim=16,
        index_n_heads=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=1024,
    )
    values.update(overrides)
    return transformers.DeepseekV32Config(**values)


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def randn(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if not p.is_floating_point() or "inv_freq" in name:
            continue
        if name.endswith("e_score_correction_bias"):
            p.copy_(randn(p.shape) * 0.1)
        elif name.endswith("k_norm.bias"):
            p.copy_(randn(p.shape) * 0.1)
        elif p.dim() == 1:  # RMSNorm / LayerNorm weights
            p.copy_(1 + 0.1 * randn(p.shape))
        elif "embed" in name:
            p.copy_(randn(p.shape))
        else:
            p.copy_(randn(p.shape) * p.shape[-1] ** -0.5)


def build(root: Path, seed: int = 0, name: str = CASE, **overrides: object) -> Path:
    """Save the tiny checkpoint (config ``hf_config(**overrides)``) under ``root / name``
    (once) and return the directory, ready for ``load_checkpoint`` / ``--model``."""
    directory = Path(root) / name
    if not (directory / "config.json").exists():
        model = transformers.DeepseekV32ForCausalLM(hf_config(**overrides)).eval()
        _redraw(model, seed)
        model.save_pretrained(directory)
    return directory


def hf_latent(cache, layer: int) -> torch.Tensor:
    """transformers' cached MLA latent of ``layer`` as ``[t, kv_lora_rank + rope]``: the
    normed compressed KV (``keys``) then the roped key (``values``), batch 0."""
    entry = cache.layers[layer]
    return torch.cat([entry.keys[0, 0], entry.values[0, 0]], dim=-1)


def hf_index_keys(cache, layer: int) -> torch.Tensor:
    """transformers' cached indexer keys of ``layer`` ``[t, index_head_dim]``, batch 0."""
    return cache.layers[layer].indexer_keys[0]
