"""Gemma 3 text models: ``Gemma3ForCausalLM`` (the 1B, and any text-only Gemma 3).

A decoder layer is two blocks with sandwich norms: attention (``input_layernorm``,
``self_attn`` with per-head ``q_norm``/``k_norm``, ``post_attention_layernorm`` on its
output) and a GeGLU MLP (``pre_feedforward_layernorm``, ``mlp``,
``post_feedforward_layernorm``). Every RMSNorm weight is applied as ``1 + w``. Embeddings
are scaled by ``sqrt(hidden_size)``; scores by ``query_pre_attn_scalar ** -0.5``.
``sliding_attention`` layers attend within ``sliding_window`` tokens with their own RoPE
base (``rope_parameters["sliding_attention"]``); full layers use theirs (default or
linear scaling).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from runtime.checkpoints.base import TensorRef, hf_value, unsupported
from runtime.checkpoints.common import paired_ref
from runtime.checkpoints.gpt_oss import window_layers
from runtime.model.config import ModelConfig
from runtime.model.layers import default_inv_freq

ARCH = "Gemma3ForCausalLM"


def _rope(hf: Mapping[str, Any], kind: str, fallback_theta: float) -> tuple[float, float]:
    """(base, linear factor) of layer type ``kind`` (``ValueError`` for other scalings)."""
    params = hf_value(hf, "rope_parameters", None) or {}
    if "rope_type" in params or "rope_theta" in params:  # one dict for every layer type
        params = {"full_attention": params, "sliding_attention": params}
    rope = dict(params.get(kind) or {})
    legacy = hf_value(hf, "rope_scaling", None)
    if kind == "full_attention" and legacy and not rope:
        rope = dict(legacy)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", fallback_theta))
    if rope_type == "linear":
        return theta, float(rope["factor"])
    if rope_type != "default":
        raise unsupported(ARCH, f"{kind} rope_type={rope_type!r}")
    return theta, 1.0


class Gemma3Adapter:
    architecture = ARCH

    def model_config(self, hf: Mapping[str, Any], dtype: torch.dtype, name: str) -> ModelConfig:
        def v(key: str, default: Any) -> Any:
            return hf_value(hf, key, default)

        for flag in ("final_logit_softcapping", "attn_logit_softcapping"):
            if v(flag, None) is not None:
                raise unsupported(ARCH, f"{flag}={v(flag, None)!r}")
        if v("use_bidirectional_attention", False):
            raise unsupported(ARCH, "use_bidirectional_attention")
        if v("attention_bias", False):
            raise unsupported(ARCH, "attention_bias")
        if v("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise unsupported(ARCH, f"hidden_activation={v('hidden_activation', '')!r}")
        n, d = v("num_hidden_layers", 26), v("hidden_size", 2304)
        head_dim = v("head_dim", 256)
        window = v("sliding_window", 4096) or 0
        pattern = v("sliding_window_pattern", 6)
        windows = [window * w for w in window_layers(hf, ARCH, n, pattern)]
        theta, factor = _rope(hf, "full_attention", float(v("rope_theta", 1_000_000.0)))
        local_theta, local_factor = _rope(
            hf, "sliding_attention", float(v("rope_local_base_freq", 10_000.0))
        )
        if local_factor != 1.0:
            raise unsupported(ARCH, "a scaled RoPE on sliding_attention layers")
        inv_freq: tuple[float, ...] = ()
        if factor != 1.0:
            inv_freq = tuple((default_inv_freq(theta, head_dim) / factor).tolist())
        return ModelConfig(
            name=name,
            vocab_size=v("vocab_size", 262208),
            d_model=d,
            layer_pattern="A" * n,
            num_heads=v("num_attention_heads", 8),
            num_kv_heads=v("num_key_value_heads", 4),
            head_dim=head_dim,
            attn_kind="windowed",
            layer_windows=tuple(windows),
            qk_norm=True,
            sandwich_norm=True,
            norm_offset=1.0,
            rope_theta=theta,
            rope_inv_freq=inv_freq,
            local_rope_theta=local_theta,
            attn_scale=float(v("query_pre_attn_scalar", 256)) ** -0.5,
            # transformers rounds the scale to the weights' dtype before multiplying.
            embed_scale=float(torch.tensor(float(d) ** 0.5, dtype=dtype)),
            mlp_hidden=v("intermediate_size", 9216),
            mlp_kind="geglu",
            tie_embeddings=bool(v("tie_word_embeddings", True)),
            norm_eps=float(v("rms_norm_eps", 1e-6)),
            dtype=dtype,
        )

    def tensor(self, name: str, config: ModelConfig, hf: Mapping[str, Any]) -> TensorRef:
        found = paired_ref(name, config, "model.norm.weight", "pre_feedforward_layernorm")
        if isinstance(found, TensorRef):
            return found
        _, is_ffn, param, prefix = found
        if param == "post_norm":
            norm = "post_feedforward_layernorm" if is_ffn else "post_attention_layernorm"
            return TensorRef(f"{prefix}.{norm}.weight")
        if is_ffn:
            return TensorRef(f"{prefix}.mlp.{param}_proj.weight")
        attn = f"{prefix}.self_attn"
        if param in ("q_norm", "k_norm"):
            return TensorRef(f"{attn}.{param}.weight")
        return TensorRef(f"{attn}.{param}_proj.weight")


ADAPTER = Gemma3Adapter()
