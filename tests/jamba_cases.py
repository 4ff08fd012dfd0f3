"""A tiny random Jamba (Mamba-1 + attention + MoE) built by transformers (no download).

Case ``jamba``: five layers, attention every 3rd from offset 1 (pattern ``SASSA``), a
top-2 MoE of 4 experts every 2nd layer from offset 1 and SwiGLU MLPs elsewhere, Mamba-1
mixers with ``d_inner`` 64 (expand 2), ``d_state`` 8, conv kernel 4 and a step rank of 4,
GQA attention without positional encoding. Weights are re-drawn
(``checkpoint_cases._redraw``, then the step projection as Mamba initialises it: softplus
steps in [1e-3, 1e-1] plus a small input-dependent part), then ``save_pretrained``.
Helpers turn transformers' cache into this runtime's state layout.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
pytest.importorskip("safetensors", reason="needs safetensors (test extra)")

from tests.checkpoint_cases import _redraw  # noqa: E402

VOCAB = 128
CASES = ("jamba",)


def _config():
    return transformers.JambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=5,
        intermediate_size=24,
        attn_layer_period=3,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
        rms_norm_eps=1e-6,
    )


def build(case: str, root: Path, seed: int = 0) -> Path:
    """Save case ``case`` under ``root / case`` (once) and return the directory."""
    assert case in CASES, case
    directory = root / case
    if not (directory / "config.json").exists():
        model = transformers.JambaForCausalLM(_config()).eval()
        _redraw(model, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("dt_proj.bias"):
                    lo, hi = math.log(1e-3), math.log(1e-1)
                    dt0 = torch.exp(torch.rand(p.shape, generator=gen) * (hi - lo) + lo)
                    p.copy_(dt0 + torch.log(-torch.expm1(-dt0)))
                elif name.endswith("dt_proj.weight"):
                    p.copy_(0.5 * torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        model.save_pretrained(directory)
    return directory


def hf_conv_to_runtime(conv: torch.Tensor, config) -> torch.Tensor:
    """transformers' conv state ``[C, K]`` -> this runtime's ``[C, K-1]`` (same channels)."""
    return conv[:, -(config.conv_kernel - 1) :]


def hf_recurrent_to_runtime(state: torch.Tensor) -> torch.Tensor:
    """transformers' ``[C, N]`` -> the cached ``[C, 1, N]`` (a channel is a head of width 1)."""
    return state.float()[:, None]
