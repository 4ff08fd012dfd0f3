"""``GraniteMoeHybridForCausalLM`` (IBM Granite 4.0-H): dense or MoE, nope or RoPE.

A decoder layer is two blocks: the mixer (``input_layernorm`` + ``mamba`` or
``self_attn``) and the feed-forward (``post_attention_layernorm`` + ``shared_mlp``, plus
``block_sparse_moe`` when ``num_local_experts > 0``). ``shared_mlp.input_linear`` packs
``[gate | up]``; the MoE's ``input_linear`` ``[X, 2F, D]`` packs the same per expert and
``output_linear`` is ``[X, D, F]``. Multipliers: embeddings, residual (every block), the
attention score scale (instead of ``head_dim ** -0.5``) and logits (divided).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from runtime.checkpoints.base import TensorRef, hf_value, unsupported
from runtime.checkpoints.common import attention_ref, layer_kind, mamba_ref, paired_ref
from runtime.model.config import ModelConfig

ARCH = "GraniteMoeHybridForCausalLM"


class GraniteMoeHybridAdapter:
    architecture = ARCH

    def model_config(self, hf: Mapping[str, Any], dtype: torch.dtype, name: str) -> ModelConfig:
        def v(key: str, default: Any) -> Any:
            return hf_value(hf, key, default)

        for flag in ("attention_bias", "mamba_proj_bias"):
            if v(flag, False):
                raise unsupported(ARCH, flag)
        if v("hidden_act", "silu") != "silu":
            raise unsupported(ARCH, f"hidden_act={v('hidden_act', '')!r}")
        d = v("hidden_size", 4096)
        layers = [layer_kind(t, ARCH) for t in v("layer_types", None) or v("layers_block_type", [])]
        experts = v("num_local_experts", 8)
        ffn = "E" if experts > 0 else "M"
        heads = v("num_attention_heads", 32)
        ssm_heads = v("mamba_n_heads", 128)
        d_head = v("mamba_d_head", "auto")
        if d_head == "auto":
            d_head = v("mamba_expand", 2) * d // ssm_heads
        rope = v("rope_parameters", {}) or {}
        if v("rope_scaling", None):
            raise unsupported(ARCH, f"rope_scaling={v('rope_scaling', None)!r}")
        if v("position_embedding_type", None) == "rope":
            if rope.get("rope_type", "default") != "default":
                raise unsupported(ARCH, f"rope_type={rope.get('rope_type')!r}")
            head_dim = d // heads
            rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        else:
            rotary = 0
        lo, hi = v("time_step_limit", [0.0, float("inf")])
        shared = v("shared_intermediate_size", 1024)
        return ModelConfig(
            name=name,
            vocab_size=v("vocab_size", 32000),
            d_model=d,
            layer_pattern="".join(layers),
            block_pattern="".join(kind + ffn for kind in layers),
            num_heads=heads,
            num_kv_heads=v("num_key_value_heads", None) or heads,
            head_dim=d // heads,
            ssm_heads=ssm_heads,
            ssm_groups=v("mamba_n_groups", 1),
            ssm_head_dim=d_head,
            ssm_state_dim=v("mamba_d_state", 256),
            conv_kernel=v("mamba_d_conv", 4),
            conv_bias=bool(v("mamba_conv_bias", True)),
            scan_chunk=v("mamba_chunk_size", 256),
            mlp_hidden=shared,
            mlp_kind="swiglu",
            num_experts=max(experts, 0),
            experts_per_token=v("num_experts_per_tok", 2) if experts > 0 else 0,
            expert_hidden=v("intermediate_size", 11008) if experts > 0 else 0,
            shared_expert_hidden=shared if experts > 0 else 0,
            router="softmax",
            rope_theta=float(rope.get("rope_theta", v("rope_theta", 10000.0))),
            rotary_dim=rotary,
            attn_scale=float(v("attention_multiplier", 1.0)),
            embed_scale=float(v("embedding_multiplier", 1.0)),
            residual_scale=float(v("residual_multiplier", 1.0)),
            logits_scale=float(v("logits_scaling", 1.0)),
            tie_embeddings=bool(v("tie_word_embeddings", False)),
            dt_min=float(lo),
            dt_max=float(hi),
            norm_eps=float(v("rms_norm_eps", 1e-6)),
            dtype=dtype,
        )

    def tensor(self, name: str, config: ModelConfig, hf: Mapping[str, Any]) -> TensorRef:
        found = paired_ref(name, config, "model.norm.weight", "post_attention_layernorm")
        if isinstance(found, TensorRef):
            return found
        b, is_ffn, param, prefix = found
        if not is_ffn:
            if config.blocks[b] == "A":
                return attention_ref(param, f"{prefix}.self_attn")
            return mamba_ref(param, f"{prefix}.mamba", config)
        if param == "router":
            return TensorRef(f"{prefix}.block_sparse_moe.router.layer.weight")
        if config.blocks[b] == "M":  # dense: the shared MLP is the whole block
            return self._mlp(f"{prefix}.shared_mlp", param, config.mlp_hidden, None)
        group, rest = param.split(".", 1)
        if group == "shared":
            return self._mlp(f"{prefix}.shared_mlp", rest, config.shared_expert_hidden, None)
        e, rest = rest.split(".", 1)
        moe = f"{prefix}.block_sparse_moe"
        return self._mlp(moe, rest, config.expert_hidden, int(e))

    @staticmethod
    def _mlp(prefix: str, param: str, hidden: int, expert: int | None) -> TensorRef:
        if param == "down":
            return TensorRef(f"{prefix}.output_linear.weight", expert=expert)
        row0 = 0 if param == "gate" else hidden
        return TensorRef(f"{prefix}.input_linear.weight", row0, hidden, expert=expert)


ADAPTER = GraniteMoeHybridAdapter()
