"""LFM2: ``Lfm2ForCausalLM``, gated short convolutions and GQA attention.

A decoder layer is two blocks: the mixer (``operator_norm`` + ``conv`` or ``self_attn``)
and the feed-forward (``ffn_norm`` + ``feed_forward``, a SwiGLU MLP ``w2(silu(w1 x) * w3 x)``).
``layer_types`` says which layers are ``conv`` and which ``full_attention``. The final norm
is ``model.embedding_norm``; the LM head is tied to the embedding by default.

Short conv tensors: ``conv.in_proj`` ``[3D, D]`` packs rows ``[B | C | x]``,
``conv.conv.weight`` ``[D, 1, L_cache]``, ``conv.out_proj`` ``[D, D]``; all three have a
bias when ``conv_bias``. Attention: ``q/k/v_proj``, ``out_proj``, a per-head RMSNorm on q
and k (``q_layernorm`` / ``k_layernorm``) before RoPE. The cache keeps the attention K/V
and each conv layer's last ``L_cache - 1`` conv inputs (``MambaSpec.short_conv``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from runtime.checkpoints.base import TensorRef, hf_value, unsupported
from runtime.checkpoints.common import block_param, outer_ref
from runtime.model.config import ModelConfig

ARCH = "Lfm2ForCausalLM"


def ffn_hidden(hf: Mapping[str, Any]) -> int:
    """The feed-forward width as transformers derives it from ``intermediate_size``
    (``block_ff_dim``): with ``block_auto_adjust_ff_dim``, 2/3 of it, times
    ``block_ffn_dim_multiplier``, rounded up to a multiple of ``block_multiple_of``."""
    hidden = int(hf_value(hf, "intermediate_size", None) or hf_value(hf, "block_ff_dim", 12288))
    if not hf_value(hf, "block_auto_adjust_ff_dim", True):
        return hidden
    hidden = int(2 * hidden / 3)
    multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        hidden = int(float(multiplier) * hidden)
        step = int(hf_value(hf, "block_multiple_of", 256))
        hidden = step * ((hidden + step - 1) // step)
    return hidden


class Lfm2Adapter:
    architecture = ARCH

    def model_config(self, hf: Mapping[str, Any], dtype: torch.dtype, name: str) -> ModelConfig:
        def v(key: str, default: Any) -> Any:
            return hf_value(hf, key, default)

        n, d = v("num_hidden_layers", 32), v("hidden_size", 2560)
        heads = v("num_attention_heads", 32)
        types = v("layer_types", None)
        if types is None:
            attn = v("full_attn_idxs", None)
            attn = set(range(n) if attn is None else attn)
            types = ["full_attention" if i in attn else "conv" for i in range(n)]
        if len(types) != n or set(types) - {"conv", "full_attention"}:
            raise unsupported(ARCH, f"layer_types={types!r}")
        rope = v("rope_parameters", None) or v("rope_scaling", None) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise unsupported(ARCH, f"rope_type={rope.get('rope_type')!r}")
        theta = float(rope.get("rope_theta", v("rope_theta", 1_000_000.0)))
        tied = v("tie_word_embeddings", None)
        if tied is None:  # the hub's configs name it tie_embedding
            tied = v("tie_embedding", True)
        return ModelConfig(
            name=name,
            vocab_size=v("vocab_size", 65536),
            d_model=d,
            layer_pattern="".join("S" if t == "conv" else "A" for t in types),
            num_heads=heads,
            num_kv_heads=v("num_key_value_heads", 8),
            head_dim=d // heads,
            qk_norm=True,
            rope_theta=theta,
            ssm_kind="shortconv",
            ssm_heads=d,
            ssm_head_dim=1,
            ssm_state_dim=1,
            conv_kernel=v("conv_L_cache", 3),
            conv_bias=bool(v("conv_bias", False)),
            mlp_hidden=ffn_hidden(hf),
            mlp_kind="swiglu",
            tie_embeddings=bool(tied),
            norm_eps=float(v("norm_eps", 1e-5)),
            dtype=dtype,
        )

    def tensor(self, name: str, config: ModelConfig, hf: Mapping[str, Any]) -> TensorRef:
        ref = outer_ref(name, config, "model.embed_tokens.weight", "model.embedding_norm.weight")
        if ref is not None:
            return ref
        b, param = block_param(name)
        layer, is_ffn = divmod(b, 2)
        prefix = f"model.layers.{layer}"
        if param == "norm":
            return TensorRef(f"{prefix}.{'ffn_norm' if is_ffn else 'operator_norm'}.weight")
        if is_ffn:
            w = {"gate": "w1", "up": "w3", "down": "w2"}[param]
            return TensorRef(f"{prefix}.feed_forward.{w}.weight")
        if config.layer_pattern[layer] == "A":
            attn = f"{prefix}.self_attn"
            if param in ("q_norm", "k_norm"):
                return TensorRef(f"{attn}.{param[0]}_layernorm.weight")
            return TensorRef(f"{attn}.{'out' if param == 'o' else param}_proj.weight")
        conv, d = f"{prefix}.conv", config.d_model
        kind = "bias" if param.endswith("bias") else "weight"
        part = param.removesuffix("_bias")
        if part in ("B", "C", "x"):
            return TensorRef(f"{conv}.in_proj.{kind}", "BCx".index(part) * d, d)
        if part == "conv":
            return TensorRef(f"{conv}.conv.{kind}", squeeze=kind == "weight")
        assert part == "out", param
        return TensorRef(f"{conv}.out_proj.{kind}")


ADAPTER = Lfm2Adapter()
