"""gpt-oss: ``GptOssForCausalLM`` (unquantized weights: bfloat16 or float32).

A decoder layer is two blocks: attention (``input_layernorm`` + ``self_attn``, q/k/v/o with
biases, one sink logit per query head, ``sliding_attention`` layers with a window of
``sliding_window`` tokens) and a top-k MoE (``post_attention_layernorm`` + ``mlp``: a
router with a bias, softmax over the top-k logits, clamped SwiGLU experts with biases).
RoPE is as configured (YaRN on every layer for the released models).

Experts as saved: ``gate_up_proj`` ``[X, D, 2F]`` (``x @ W``; gate at even, up at odd
columns), ``gate_up_proj_bias`` ``[X, 2F]``, ``down_proj`` ``[X, F, D]``,
``down_proj_bias`` ``[X, D]``. MXFP4-quantized checkpoints (``quantization_config``) are
not read: dequantize them first (transformers saves the unquantized tensors).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from runtime.checkpoints.base import TensorRef, hf_value, unsupported
from runtime.checkpoints.common import paired_ref
from runtime.checkpoints.deepseek_v32 import yarn
from runtime.model.config import ModelConfig

ARCH = "GptOssForCausalLM"


def window_layers(hf: Mapping[str, Any], arch: str, n: int, pattern: int) -> list[int]:
    """1 for a ``sliding_attention`` layer, 0 for ``full_attention`` (``layer_types``; by
    default every ``pattern``-th layer is full)."""
    types = hf_value(hf, "layer_types", None) or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise unsupported(arch, f"layer_types={types!r}")
    return [1 if t == "sliding_attention" else 0 for t in types]


class GptOssAdapter:
    architecture = ARCH

    def model_config(self, hf: Mapping[str, Any], dtype: torch.dtype, name: str) -> ModelConfig:
        def v(key: str, default: Any) -> Any:
            return hf_value(hf, key, default)

        if hf.get("quantization_config"):
            raise unsupported(ARCH, "a quantized checkpoint (dequantize it first)")
        if v("hidden_act", "silu") != "silu":
            raise unsupported(ARCH, f"hidden_act={v('hidden_act', '')!r}")
        n = v("num_hidden_layers", 36)
        d, heads = v("hidden_size", 2880), v("num_attention_heads", 64)
        head_dim = v("head_dim", None) or d // heads
        window = v("sliding_window", 128) or 0
        windows = [window * w for w in window_layers(hf, ARCH, n, 2)]
        rope = dict(v("rope_parameters", None) or v("rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = float(rope.get("rope_theta", v("rope_theta", 150000.0)))
        inv_freq: tuple[float, ...] = ()
        cos_scale = 1.0
        if rope_type == "yarn":
            inv_freq, cos_scale, _ = yarn(rope, head_dim, theta, v("max_position_embeddings", 0))
        elif rope_type != "default":
            raise unsupported(ARCH, f"rope_type={rope_type!r}")
        bias = bool(v("attention_bias", True))
        return ModelConfig(
            name=name,
            vocab_size=v("vocab_size", 201088),
            d_model=d,
            layer_pattern="A" * n,
            block_pattern="AE" * n,
            num_heads=heads,
            num_kv_heads=v("num_key_value_heads", 8),
            head_dim=head_dim,
            attn_kind="windowed",
            layer_windows=tuple(windows),
            attn_sinks=True,
            attn_bias=bias,
            rope_theta=theta,
            rope_inv_freq=inv_freq,
            rope_cos_scale=cos_scale,
            mlp_hidden=v("intermediate_size", 2880),
            mlp_kind="swiglu_clamp",
            swiglu_alpha=float(v("swiglu_alpha", 1.702)),
            swiglu_limit=float(v("swiglu_limit", 7.0)),
            num_experts=v("num_local_experts", 128),
            experts_per_token=v("num_experts_per_tok", 4),
            expert_hidden=v("intermediate_size", 2880),
            router="softmax",
            router_has_bias=True,
            tie_embeddings=bool(v("tie_word_embeddings", False)),
            norm_eps=float(v("rms_norm_eps", 1e-5)),
            dtype=dtype,
        )

    def tensor(self, name: str, config: ModelConfig, hf: Mapping[str, Any]) -> TensorRef:
        found = paired_ref(name, config, "model.norm.weight", "post_attention_layernorm")
        if isinstance(found, TensorRef):
            return found
        _, is_ffn, param, prefix = found
        if not is_ffn:
            attn = f"{prefix}.self_attn"
            if param == "sinks":
                return TensorRef(f"{attn}.sinks")
            proj, _, kind = param.partition("_")
            return TensorRef(f"{attn}.{proj}_proj.{'bias' if kind else 'weight'}")
        mlp = f"{prefix}.mlp"
        if param == "router":
            return TensorRef(f"{mlp}.router.weight")
        if param == "router_bias":
            return TensorRef(f"{mlp}.router.bias")
        _, e_text, part = param.split(".", 2)
        e, f = int(e_text), config.expert_hidden
        experts = f"{mlp}.experts"
        if part in ("gate", "up"):
            row0 = 0 if part == "gate" else 1
            return TensorRef(f"{experts}.gate_up_proj", row0, f, expert=e, step=2, transposed=True)
        if part in ("gate_bias", "up_bias"):
            row0 = 0 if part == "gate_bias" else 1
            return TensorRef(f"{experts}.gate_up_proj_bias", row0, f, expert=e, step=2)
        if part == "down":
            return TensorRef(f"{experts}.down_proj", expert=e, transposed=True)
        assert part == "down_bias", part
        return TensorRef(f"{experts}.down_proj_bias", expert=e)


ADAPTER = GptOssAdapter()
