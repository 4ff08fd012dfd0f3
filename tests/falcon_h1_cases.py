"""Tiny random Falcon-H1 checkpoints built by transformers (no download).

Every layer runs attention and Mamba-2 in parallel. Cases:

- ``falcon_h1``: three layers, Mamba-2 of 8 heads x 8 (``mamba_d_ssm`` 64, not
  ``expand * hidden``) in 2 B/C groups, ``d_state`` 8, chunk 16, no SSM output norm
  (``mamba_rms_norm=False``, transformers' default), every muP multiplier != 1 (most of
  the order of the released models'; the LM head's larger, so logits stay ~2.5), an
  untied LM head.
- ``falcon_h1_norm``: two layers, one B/C group, the grouped RMSNorm before the gate
  (``mamba_rms_norm=True``, ``mamba_norm_before_gate=True``), tied embeddings with
  different embedding and LM-head multipliers, GQA 4/1.

Weights are re-drawn (``checkpoint_cases._redraw``), then ``save_pretrained``; the muP
vector is a non-persistent buffer that transformers recomputes from the config on load.
"""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
pytest.importorskip("safetensors", reason="needs safetensors (test extra)")

from tests.checkpoint_cases import _redraw  # noqa: E402

VOCAB = 128
CASES = ("falcon_h1", "falcon_h1_norm")

MULTIPLIERS = dict(
    embedding_multiplier=5.6,
    lm_head_multiplier=0.6,
    key_multiplier=0.4,
    attention_in_multiplier=1.3,
    attention_out_multiplier=0.9,
    ssm_in_multiplier=1.25,
    ssm_out_multiplier=0.24,
    ssm_multipliers=[0.35, 0.25, 0.5, 0.35, 0.6],
    mlp_multipliers=[0.9, 0.6],
)


def _config(case: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=48,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_chunk_size=16,
        rms_norm_eps=1e-5,
    )
    if case == "falcon_h1":
        return transformers.FalconH1Config(
            **common,
            **MULTIPLIERS,
            num_key_value_heads=2,
            num_hidden_layers=3,
            mamba_d_ssm=64,
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_rms_norm=False,
            tie_word_embeddings=False,
        )
    assert case == "falcon_h1_norm"
    return transformers.FalconH1Config(
        **common,
        num_key_value_heads=1,
        num_hidden_layers=2,
        mamba_d_ssm=None,
        mamba_expand=2,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_rms_norm=True,
        mamba_norm_before_gate=True,
        tie_word_embeddings=True,
        embedding_multiplier=2.0,
        lm_head_multiplier=0.3,
    )


def build(case: str, root: Path, seed: int = 0) -> Path:
    """Save case ``case`` under ``root / case`` (once) and return the directory."""
    assert case in CASES, case
    directory = root / case
    if not (directory / "config.json").exists():
        model = transformers.FalconH1ForCausalLM(_config(case)).eval()
        _redraw(model, seed)
        model.save_pretrained(directory)
    return directory
