"""``JambaForCausalLM`` (AI21 Jamba): Mamba-1 and attention layers, dense MLPs and MoE.

A decoder layer is two blocks: the mixer (``input_layernorm`` + ``mamba`` or ``self_attn``)
and the feed-forward (``pre_ff_layernorm`` + ``feed_forward``). Layer ``i`` is attention
when ``i % attn_layer_period == attn_layer_offset`` (no positional encoding), else Mamba-1;
its feed-forward is a MoE when ``i % expert_layer_period == expert_layer_offset`` (and
``num_experts > 1``), else a SwiGLU MLP. The router takes the top-k of the softmax over
all experts, weights not renormalised.

Mamba-1 tensors: ``in_proj`` ``[2C, D]`` holds rows ``[x | z]``, ``conv1d.weight``
``[C, 1, K]`` / ``conv1d.bias`` over x, ``x_proj`` ``[R + 2N, C]`` rows ``[dt | B | C]``,
``dt_proj`` ``[C, R]`` with its bias, ``A_log`` ``[C, N]``, ``D`` ``[C]``, the
``dt_layernorm`` / ``b_layernorm`` / ``c_layernorm`` weights and ``out_proj``. Experts as
saved: ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``; router ``router.weight``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from runtime.checkpoints.base import TensorRef, hf_value, unsupported
from runtime.checkpoints.common import attention_ref, paired_ref
from runtime.model.config import ModelConfig

ARCH = "JambaForCausalLM"


def _blocks(hf: Mapping[str, Any]) -> str:
    """The block pattern: per layer its mixer (``A``/``S``) then ``E`` or ``M``."""

    def v(key: str, default: Any) -> Any:
        return hf_value(hf, key, default)

    n, experts = v("num_hidden_layers", 32), v("num_experts", 16)
    attn_period, attn_offset = v("attn_layer_period", 8), v("attn_layer_offset", 4)
    moe_period, moe_offset = v("expert_layer_period", 2), v("expert_layer_offset", 1)
    if not 0 <= attn_offset < attn_period or not 0 <= moe_offset < moe_period:
        raise unsupported(ARCH, "a layer offset outside its period")
    out = []
    for i in range(n):
        out.append("A" if i % attn_period == attn_offset else "S")
        out.append("E" if experts > 1 and i % moe_period == moe_offset else "M")
    return "".join(out)


class JambaAdapter:
    architecture = ARCH

    def model_config(self, hf: Mapping[str, Any], dtype: torch.dtype, name: str) -> ModelConfig:
        def v(key: str, default: Any) -> Any:
            return hf_value(hf, key, default)

        if v("hidden_act", "silu") != "silu":
            raise unsupported(ARCH, f"hidden_act={v('hidden_act', '')!r}")
        if v("mamba_proj_bias", False):
            raise unsupported(ARCH, "mamba_proj_bias")
        if hf.get("quantization_config"):
            raise unsupported(ARCH, "a quantized checkpoint")
        d = v("hidden_size", 4096)
        heads = v("num_attention_heads", 32)
        rank = v("mamba_dt_rank", "auto")
        rank = math.ceil(d / 16) if rank == "auto" else int(rank)
        blocks = _blocks(hf)
        moe = "E" in blocks
        return ModelConfig(
            name=name,
            vocab_size=v("vocab_size", 65536),
            d_model=d,
            layer_pattern="".join(b for b in blocks if b in "AS"),
            block_pattern=blocks,
            num_heads=heads,
            num_kv_heads=v("num_key_value_heads", None) or heads,
            head_dim=v("head_dim", None) or d // heads,
            rotary_dim=0,
            ssm_kind="mamba1",
            ssm_heads=v("mamba_expand", 2) * d,
            ssm_head_dim=1,
            ssm_state_dim=v("mamba_d_state", 16),
            ssm_dt_rank=rank,
            conv_kernel=v("mamba_d_conv", 4),
            conv_bias=bool(v("mamba_conv_bias", True)),
            mlp_hidden=v("intermediate_size", 14336),
            mlp_kind="swiglu",
            num_experts=v("num_experts", 16) if moe else 0,
            experts_per_token=v("num_experts_per_tok", 2) if moe else 0,
            expert_hidden=v("intermediate_size", 14336) if moe else 0,
            router="softmax",
            router_normalize=False,
            tie_embeddings=bool(v("tie_word_embeddings", False)),
            norm_eps=float(v("rms_norm_eps", 1e-6)),
            dtype=dtype,
        )

    def tensor(self, name: str, config: ModelConfig, hf: Mapping[str, Any]) -> TensorRef:
        found = paired_ref(name, config, "model.final_layernorm.weight", "pre_ff_layernorm")
        if isinstance(found, TensorRef):
            return found
        b, is_ffn, param, prefix = found
        if is_ffn:
            ffn = f"{prefix}.feed_forward"
            if param == "router":
                return TensorRef(f"{ffn}.router.weight")
            if param.startswith("experts."):
                _, e, part = param.split(".", 2)
                return TensorRef(f"{ffn}.experts.{e}.{part}_proj.weight")
            return TensorRef(f"{ffn}.{param}_proj.weight")
        if config.blocks[b] == "A":
            return attention_ref(param, f"{prefix}.self_attn")
        return _mamba1_ref(param, f"{prefix}.mamba", config)


def _mamba1_ref(param: str, prefix: str, config: ModelConfig) -> TensorRef:
    inner = config.ssm_heads
    packed = {"x": ("in_proj.weight", 0, inner), "z": ("in_proj.weight", inner, inner)}
    if param in packed:
        tensor, row0, rows = packed[param]
        return TensorRef(f"{prefix}.{tensor}", row0, rows)
    if param == "conv_x":
        return TensorRef(f"{prefix}.conv1d.weight", squeeze=True)
    names = {
        "conv_bias_x": "conv1d.bias", "x_proj": "x_proj.weight",
        "dt_norm": "dt_layernorm.weight", "B_norm": "b_layernorm.weight",
        "C_norm": "c_layernorm.weight", "dt": "dt_proj.weight", "dt_bias": "dt_proj.bias",
        "A_log": "A_log", "D": "D", "out": "out_proj.weight",
    }  # fmt: skip
    return TensorRef(f"{prefix}.{names[param]}")


ADAPTER = JambaAdapter()
