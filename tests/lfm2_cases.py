"""Tiny random LFM2 checkpoints built by transformers (no download).

Cases: ``lfm2`` (conv, attention, conv, conv, attention: consecutive conv layers and a
conv layer after attention, ``L_cache`` 3, no biases, tied embeddings, the feed-forward
width derived with a multiplier and rounding) and ``lfm2_bias`` (``L_cache`` 4, biases on
the conv's in/out projections and the conv itself, an untied LM head, no width
adjustment). Weights are re-drawn (``checkpoint_cases._redraw``; the depthwise conv
weights at scale 0.5 like a Mamba conv), then ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
pytest.importorskip("safetensors", reason="needs safetensors (test extra)")

from tests.checkpoint_cases import _redraw  # noqa: E402

VOCAB = 128
CASES = ("lfm2", "lfm2_bias")


def _config(case: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if case == "lfm2":
        return transformers.Lfm2Config(
            **common,
            num_hidden_layers=5,
            layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
            conv_L_cache=3,
            intermediate_size=72,  # 2/3 -> 48, x1.5 -> 72, rounded up to 16s -> 80
            block_ffn_dim_multiplier=1.5,
            block_multiple_of=16,
            tie_word_embeddings=True,
        )
    assert case == "lfm2_bias"
    return transformers.Lfm2Config(
        **common,
        num_hidden_layers=3,
        layer_types=["conv", "conv", "full_attention"],
        conv_L_cache=4,
        conv_bias=True,
        intermediate_size=48,
        block_auto_adjust_ff_dim=False,
        tie_word_embeddings=False,
    )


def build(case: str, root: Path, seed: int = 0) -> Path:
    """Save case ``case`` under ``root / case`` (once) and return the directory."""
    directory = root / case
    if not (directory / "config.json").exists():
        model = transformers.Lfm2ForCausalLM(_config(case)).eval()
        _redraw(model, seed)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed + 1)
            for name, p in model.named_parameters():
                if name.endswith("conv.conv.weight"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        model.save_pretrained(directory)
    return directory
