"""Tiny random local/global attention checkpoints built by transformers (no download).

Cases: ``gpt_oss`` (alternating sliding / full layers with a window of ``WINDOWS["gpt_oss"]``
tokens, attention sinks, q/k/v/o biases, YaRN RoPE, a top-2 MoE of 4 clamped SwiGLU experts
with a router bias) and ``gemma3`` (three sliding layers then a full one, window
``WINDOWS["gemma3"]``, its (1 + w) RMSNorms, q/k norms, sandwich norms, embedding scale,
``query_pre_attn_scalar``, a local RoPE base and a linearly scaled global RoPE, GeGLU).
The windows are tiny so that test prompts cross them many times: 8 divides the engine
tests' 16-token pages (every cached boundary is exactly at a window edge), 12 does not
(boundaries inside a window). Weights are re-drawn (``checkpoint_cases._redraw``) and the
sinks made large enough to matter, then ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
pytest.importorskip("safetensors", reason="needs safetensors (test extra)")

from tests.checkpoint_cases import _redraw  # noqa: E402

VOCAB = 128
CASES = ("gpt_oss", "gemma3")
WINDOWS = {"gpt_oss": 8, "gemma3": 12}
_MODELS = {"gpt_oss": "GptOssForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def _config(case: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    if case == "gpt_oss":
        return transformers.GptOssConfig(
            **common,
            head_dim=8,
            num_hidden_layers=4,
            sliding_window=WINDOWS[case],
            intermediate_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            swiglu_limit=2.0,  # tight enough that the clamp bites on these activations
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
            max_position_embeddings=2048,
        )
    assert case == "gemma3"
    return transformers.Gemma3TextConfig(
        **common,
        head_dim=8,
        num_hidden_layers=4,
        sliding_window=WINDOWS[case],
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        intermediate_size=48,
        query_pre_attn_scalar=12,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
        max_position_embeddings=2048,
    )


def build(case: str, root: Path, seed: int = 0) -> Path:
    """Save case ``case`` under ``root / case`` (once) and return the directory."""
    directory = root / case
    if not (directory / "config.json").exists():
        model = getattr(transformers, _MODELS[case])(_config(case)).eval()
        _redraw(model, seed)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed + 1)
            for name, p in model.named_parameters():
                if name.endswith("sinks"):  # logits of the order of the scores
                    p.copy_(torch.randn(p.shape, generator=gen) * 2)
        model.save_pretrained(directory)
    return directory
