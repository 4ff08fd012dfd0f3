"""Dense attention decoders: ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM``.

Every decoder layer is two blocks: attention (``input_layernorm`` + ``self_attn``) and
the feed-forward (``post_attention_layernorm`` + ``mlp``, a SwiGLU MLP or, for Qwen3-MoE
layers that are not ``mlp_only_layers``, top-k experts ``mlp.experts.{e}.*_proj`` routed
by ``mlp.gate``). Qwen2 adds a bias to ``q/k/v_proj``; Qwen3 a per-head RMSNorm on q and k
(``self_attn.q_norm`` / ``k_norm``, before RoPE). RoPE is full, ``default`` or ``llama3``
(the frequencies are derived here). The cache keeps K/V only (no recurrent state).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from runtime.checkpoints.base import TensorRef, hf_value, unsupported
from runtime.checkpoints.common import paired_ref
from runtime.model.config import ModelConfig

LLAMA = "LlamaForCausalLM"
MISTRAL = "MistralForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"


def llama3_inv_freq(rope: Mapping[str, Any], theta: float, dim: int) -> tuple[float, ...]:
    """Llama 3.1's RoPE frequencies: long wavelengths divided by ``factor``, short ones
    kept, a linear blend in between (by the wavelength's share of the original context)."""
    factor = float(rope["factor"])
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    context = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for i in range(0, dim, 2):
        freq = theta ** (-i / dim)
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            out.append(freq)
        elif wavelength > context / low:
            out.append(freq / factor)
        else:
            blend = (context / wavelength - low) / (high - low)
            out.append((1 - blend) * freq / factor + blend * freq)
    return tuple(out)


class DenseAdapter:
    """One adapter per architecture name (they differ in biases, norms and experts)."""

    def __init__(self, architecture: str) -> None:
        self.architecture = architecture

    def model_config(self, hf: Mapping[str, Any], dtype: torch.dtype, name: str) -> ModelConfig:
        arch = self.architecture

        def v(key: str, default: Any) -> Any:
            return hf_value(hf, key, default)

        if arch in (LLAMA, MISTRAL, QWEN3, QWEN3_MOE) and v("attention_bias", False):
            raise unsupported(arch, "attention_bias")
        if v("mlp_bias", False):
            raise unsupported(arch, "mlp_bias")
        if v("hidden_act", "silu") != "silu":
            raise unsupported(arch, f"hidden_act={v('hidden_act', '')!r}")
        if arch == MISTRAL and v("sliding_window", None):
            raise unsupported(
                arch, f"sliding_window={v('sliding_window', None)} (windowed attention)"
            )
        if v("use_sliding_window", False):
            raise unsupported(arch, "use_sliding_window=True (windowed attention)")
        d, heads = v("hidden_size", 4096), v("num_attention_heads", 32)
        head_dim = v("head_dim", None) or d // heads
        n = v("num_hidden_layers", 32)
        rope = v("rope_parameters", None) or v("rope_scaling", None) or {}
        theta = float(rope.get("rope_theta", v("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        inv_freq: tuple[float, ...] = ()
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(rope, theta, head_dim)
        elif rope_type != "default":
            raise unsupported(arch, f"rope_type={rope_type!r}")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise unsupported(arch, "partial_rotary_factor")
        experts = 0
        if arch == QWEN3_MOE:  # transformers saves num_local_experts, the hub num_experts
            experts = v("num_experts", None) or v("num_local_experts", 128)
        step, mlp_only = v("decoder_sparse_step", 1), set(v("mlp_only_layers", []) or [])
        ffn = [
            "E" if experts > 0 and i not in mlp_only and (i + 1) % step == 0 else "M"
            for i in range(n)
        ]
        moe = "E" in ffn
        return ModelConfig(
            name=name,
            vocab_size=v("vocab_size", 32000),
            d_model=d,
            layer_pattern="A" * n,
            block_pattern="".join("A" + f for f in ffn),
            num_heads=heads,
            num_kv_heads=v("num_key_value_heads", None) or heads,
            head_dim=head_dim,
            mlp_hidden=v("intermediate_size", 11008),
            mlp_kind="swiglu",
            num_experts=experts if moe else 0,
            experts_per_token=v("num_experts_per_tok", 8) if moe else 0,
            expert_hidden=v("moe_intermediate_size", 768) if moe else 0,
            router="softmax",
            router_normalize=bool(v("norm_topk_prob", False)) if moe else True,
            rope_theta=theta,
            rope_inv_freq=inv_freq,
            attn_bias=arch == QWEN2,
            qk_norm=arch in (QWEN3, QWEN3_MOE),
            tie_embeddings=bool(v("tie_word_embeddings", False)),
            norm_eps=float(v("rms_norm_eps", 1e-6)),
            dtype=dtype,
        )

    def tensor(self, name: str, config: ModelConfig, hf: Mapping[str, Any]) -> TensorRef:
        found = paired_ref(name, config, "model.norm.weight", "post_attention_layernorm")
        if isinstance(found, TensorRef):
            return found
        b, is_ffn, param, prefix = found
        if not is_ffn:
            attn = f"{prefix}.self_attn"
            if param in ("q", "k", "v", "o"):
                return TensorRef(f"{attn}.{param}_proj.weight")
            if param in ("q_bias", "k_bias", "v_bias"):
                return TensorRef(f"{attn}.{param[0]}_proj.bias")
            return TensorRef(f"{attn}.{param}.weight")  # q_norm, k_norm
        mlp = f"{prefix}.mlp"
        if config.blocks[b] == "M":
            return TensorRef(f"{mlp}.{param}_proj.weight")
        if param == "router":
            return TensorRef(f"{mlp}.gate.weight")
        _, e, part = param.split(".", 2)  # experts.{e}.{gate,up,down}
        return TensorRef(f"{mlp}.experts.{e}.{part}_proj.weight")


ADAPTERS = tuple(DenseAdapter(a) for a in (LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE))
