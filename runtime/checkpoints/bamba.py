"""``BambaForCausalLM`` (IBM / Princeton / UIUC Bamba): Mamba-2 + attention, SwiGLU MLPs.

A decoder layer is two blocks: the mixer (``input_layernorm`` + ``mamba`` or
``self_attn``, attention at ``attn_layer_indices``) and the MLP (``pre_ff_layernorm`` +
``feed_forward.{gate,up,down}_proj``). RoPE is partial: the first
``partial_rotary_factor * head_dim`` channels of each head rotate (0.5 by default).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from runtime.checkpoints.base import TensorRef, hf_value, unsupported
from runtime.checkpoints.common import attention_ref, mamba_ref, paired_ref
from runtime.model.config import ModelConfig

ARCH = "BambaForCausalLM"


class BambaAdapter:
    architecture = ARCH

    def model_config(self, hf: Mapping[str, Any], dtype: torch.dtype, name: str) -> ModelConfig:
        def v(key: str, default: Any) -> Any:
            return hf_value(hf, key, default)

        for flag in ("attention_bias", "mamba_proj_bias", "mlp_bias"):
            if v(flag, False):
                raise unsupported(ARCH, flag)
        if v("hidden_act", "silu") != "silu":
            raise unsupported(ARCH, f"hidden_act={v('hidden_act', '')!r}")
        d = v("hidden_size", 4096)
        num_layers = v("num_hidden_layers", 32)
        attn = set(v("attn_layer_indices", []) or [])
        layers = "".join("A" if i in attn else "S" for i in range(num_layers))
        heads = v("num_attention_heads", 32)
        head_dim = d // heads
        ssm_heads = v("mamba_n_heads", 128)
        d_head = v("mamba_d_head", "auto")
        if d_head == "auto":
            d_head = v("mamba_expand", 2) * d // ssm_heads
        rope = v("rope_parameters", {}) or {}
        if v("rope_scaling", None):
            raise unsupported(ARCH, f"rope_scaling={v('rope_scaling', None)!r}")
        if rope.get("rope_type", "default") != "default":
            raise unsupported(ARCH, f"rope_type={rope.get('rope_type')!r}")
        rotary = int(head_dim * rope.get("partial_rotary_factor", 0.5))
        lo, hi = v("time_step_limit", [0.0, float("inf")])
        return ModelConfig(
            name=name,
            vocab_size=v("vocab_size", 128000),
            d_model=d,
            layer_pattern=layers,
            num_heads=heads,
            num_kv_heads=v("num_key_value_heads", None) or heads,
            head_dim=head_dim,
            ssm_heads=ssm_heads,
            ssm_groups=v("mamba_n_groups", 1),
            ssm_head_dim=d_head,
            ssm_state_dim=v("mamba_d_state", 256),
            conv_kernel=v("mamba_d_conv", 4),
            conv_bias=bool(v("mamba_conv_bias", True)),
            scan_chunk=v("mamba_chunk_size", 256),
            mlp_hidden=v("intermediate_size", 14336),
            mlp_kind="swiglu",
            rope_theta=float(rope.get("rope_theta", v("rope_theta", 10000.0))),
            rotary_dim=rotary,
            tie_embeddings=bool(v("tie_word_embeddings", False)),
            dt_min=float(lo),
            dt_max=float(hi),
            norm_eps=float(v("rms_norm_eps", 1e-5)),
            dtype=dtype,
        )

    def tensor(self, name: str, config: ModelConfig, hf: Mapping[str, Any]) -> TensorRef:
        found = paired_ref(name, config, "model.final_layernorm.weight", "pre_ff_layernorm")
        if isinstance(found, TensorRef):
            return found
        b, is_ffn, param, prefix = found
        if is_ffn:
            return TensorRef(f"{prefix}.feed_forward.{param}_proj.weight")
        if config.blocks[b] == "A":
            return attention_ref(param, f"{prefix}.self_attn")
        return mamba_ref(param, f"{prefix}.mamba", config)


ADAPTER = BambaAdapter()
