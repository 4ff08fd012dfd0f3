"""Tiny random Gated DeltaNet hybrids built by transformers (no download).

Cases: ``qwen3_next`` (Qwen3-Next: packed ``in_proj_qkvz``/``in_proj_ba``, MoE with a
gated shared expert on some layers and dense MLPs on others, two value heads per key
head), ``qwen35`` (Qwen3.5 dense: separate projections, tied embeddings, one key head) and
``qwen35_moe`` (Qwen3.5 MoE). Weights are re-drawn so the model is non-trivial, then
``save_pretrained``. Helpers turn transformers' cache into this runtime's state layout.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
pytest.importorskip("safetensors", reason="needs safetensors (test extra)")

from tests.checkpoint_cases import hf_model  # noqa: E402,F401  (re-exported)

VOCAB = 128
CASES = ("qwen3_next", "qwen35", "qwen35_moe")
_MODELS = {
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig"),
    "qwen35": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig"),
    "qwen35_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig"),
}


def _config(case: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        intermediate_size=48,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    )
    moe = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
    )  # fmt: skip
    types = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    if case == "qwen3_next":
        return transformers.Qwen3NextConfig(
            **common, **moe, num_hidden_layers=4, layer_types=types, mlp_only_layers=[1]
        )
    if case == "qwen35":
        # One key head for four value heads: under tp=2 the key head is replicated.
        common["linear_num_key_heads"] = 1
        return transformers.Qwen3_5TextConfig(
            **common, num_hidden_layers=4, layer_types=types, tie_word_embeddings=True
        )
    assert case == "qwen35_moe"
    return transformers.Qwen3_5MoeTextConfig(
        **common, **moe, num_hidden_layers=4, layer_types=types
    )


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 4 + 0.5))
        elif leaf == "dt_bias":
            lo, hi = math.log(1e-2), math.log(3e-1)
            dt0 = torch.exp(torch.rand(p.shape, generator=gen) * (hi - lo) + lo)
            p.copy_(dt0 + torch.log(-torch.expm1(-dt0)))
        elif p.dim() == 1:  # norms: (1 + w) ones and the gated norm's plain w
            p.copy_(
                0.2 * torch.randn(p.shape, generator=gen) + (1.0 if "linear_attn" in name else 0.0)
            )
        elif "conv1d" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif "embed" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def build(case: str, root: Path, seed: int = 0) -> Path:
    """Save case ``case`` under ``root / case`` (once) and return the directory."""
    directory = root / case
    if not (directory / "config.json").exists():
        model = getattr(transformers, _MODELS[case][0])(_config(case)).eval()
        _redraw(model, seed)
        model.save_pretrained(directory)
    return directory


def hf_conv_to_runtime(conv: torch.Tensor, config) -> torch.Tensor:
    """transformers' conv state ``[all q | all k | all v, K']`` -> this runtime's
    group-major ``[v_g | k_g | q_g]`` channels, last ``K-1`` columns."""
    c = config
    dk, dv, g = c.ssm_state_dim, c.ssm_head_dim, c.ssm_groups
    key, width = g * dk, c.ssm_heads // g * dv
    rows = []
    for group in range(g):
        rows.append(conv[2 * key + group * width : 2 * key + (group + 1) * width])
        rows.append(conv[key + group * dk : key + (group + 1) * dk])
        rows.append(conv[group * dk : (group + 1) * dk])
    return torch.cat(rows)[:, -(c.conv_kernel - 1) :]


def hf_recurrent_to_runtime(state: torch.Tensor) -> torch.Tensor:
    """transformers' ``[H, Dk, Dv]`` -> the cached ``[H, Dv, Dk]``."""
    return state.float().transpose(-1, -2)
