"""Gated DeltaNet hybrids: ``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM`` and
``Qwen3_5MoeForCausalLM`` (text part).

A decoder layer is two blocks: the mixer (``input_layernorm`` + ``linear_attn`` (Gated
DeltaNet) or ``self_attn`` (gated attention)) and the feed-forward
(``post_attention_layernorm`` + ``mlp``: a SwiGLU MLP, or a top-k MoE whose shared expert
is gated by ``shared_expert_gate``). Every residual RMSNorm and QK-norm weight is stored
as ``w`` and applied as ``1 + w``; the Gated DeltaNet's output norm is plain ``w``.

Gated DeltaNet tensors: Qwen3-Next packs ``in_proj_qkvz`` per key head ``g`` as
``[q_g (Dk) | k_g (Dk) | v_g (H/G*Dv) | z_g (H/G*Dv)]`` and ``in_proj_ba`` per key head as
``[b_g (H/G) | a_g (H/G)]``; Qwen3.5 has ``in_proj_qkv`` ``[all q | all k | all v]`` and
separate ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``. Both convs hold channels
``[all q | all k | all v]`` without bias. ``q_proj`` holds per query head ``[q_h | gate_h]``.
Experts as saved: ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from runtime.checkpoints.base import TensorRef, hf_value, unsupported
from runtime.checkpoints.common import layer_kind, paired_ref
from runtime.model.config import ModelConfig

NEXT = "Qwen3NextForCausalLM"
QWEN35 = "Qwen3_5ForCausalLM"
QWEN35_MOE = "Qwen3_5MoeForCausalLM"


class Qwen3NextAdapter:
    """One adapter per architecture name; ``packed`` says which projection layout."""

    def __init__(self, architecture: str) -> None:
        self.architecture = architecture
        self.packed = architecture == NEXT

    def model_config(self, hf: Mapping[str, Any], dtype: torch.dtype, name: str) -> ModelConfig:
        arch = self.architecture

        def v(key: str, default: Any) -> Any:
            return hf_value(hf, key, default)

        if v("attention_bias", False):
            raise unsupported(arch, "attention_bias")
        if v("hidden_act", "silu") != "silu":
            raise unsupported(arch, f"hidden_act={v('hidden_act', '')!r}")
        if not v("norm_topk_prob", True):
            raise unsupported(arch, "norm_topk_prob=False")
        rope = v("rope_parameters", {}) or {}
        if rope.get("rope_type", "default") != "default":
            raise unsupported(arch, f"rope_type={rope.get('rope_type')!r}")
        n = v("num_hidden_layers", 48)
        layers = [layer_kind(t, arch) for t in v("layer_types", None) or []]
        if not layers:
            interval = v("full_attention_interval", 4)
            layers = ["A" if (i + 1) % interval == 0 else "S" for i in range(n)]
        experts = v("num_experts", 0) if arch != QWEN35 else 0
        step, mlp_only = v("decoder_sparse_step", 1), set(v("mlp_only_layers", []) or [])
        ffn = [
            "E" if experts > 0 and i not in mlp_only and (i + 1) % step == 0 else "M"
            for i in range(n)
        ]
        d, heads = v("hidden_size", 2048), v("num_attention_heads", 16)
        head_dim = v("head_dim", None) or d // heads
        factor = rope.get("partial_rotary_factor", v("partial_rotary_factor", 0.25))
        shared = v("shared_expert_intermediate_size", 0) if experts > 0 else 0
        if experts > 0 and not shared:
            raise unsupported(arch, "an MoE without a shared expert")
        return ModelConfig(
            name=name,
            vocab_size=v("vocab_size", 151936),
            d_model=d,
            layer_pattern="".join(layers),
            block_pattern="".join(kind + f for kind, f in zip(layers, ffn, strict=True)),
            num_heads=heads,
            num_kv_heads=v("num_key_value_heads", 2),
            head_dim=head_dim,
            ssm_kind="gdn",
            ssm_heads=v("linear_num_value_heads", 32),
            ssm_groups=v("linear_num_key_heads", 16),
            ssm_head_dim=v("linear_value_head_dim", 128),
            ssm_state_dim=v("linear_key_head_dim", 128),
            conv_kernel=v("linear_conv_kernel_dim", 4),
            conv_bias=False,
            scan_chunk=64,  # transformers' chunked delta rule: 64, not in config.json
            mlp_hidden=v("intermediate_size", 5632),
            mlp_kind="swiglu",
            num_experts=max(experts, 0),
            experts_per_token=v("num_experts_per_tok", 10) if experts > 0 else 0,
            expert_hidden=v("moe_intermediate_size", 512) if experts > 0 else 0,
            shared_expert_hidden=shared,
            shared_expert_gate=experts > 0,
            router="softmax",
            rope_theta=float(rope.get("rope_theta", v("rope_theta", 10000.0))),
            rotary_dim=int(head_dim * factor),
            attn_kind="gated",
            norm_offset=1.0,
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
            if config.blocks[b] == "A":
                return _attention(param, f"{prefix}.self_attn", config)
            return self._gdn(param, f"{prefix}.linear_attn", config)
        mlp = f"{prefix}.mlp"
        if config.blocks[b] == "M":
            return _mlp(mlp, param)
        if param == "router":
            return TensorRef(f"{mlp}.gate.weight")
        if param == "shared_gate":
            return TensorRef(f"{mlp}.shared_expert_gate.weight")
        group, rest = param.split(".", 1)
        if group == "shared":
            return _mlp(f"{mlp}.shared_expert", rest)
        return _mlp(f"{mlp}.experts.{rest.split('.', 1)[0]}", rest.split(".", 1)[1])

    def _gdn(self, param: str, prefix: str, config: ModelConfig) -> TensorRef:
        c = config
        dk, dv, g_all, h_all = c.ssm_state_dim, c.ssm_head_dim, c.ssm_groups, c.ssm_heads
        per = h_all // g_all
        simple = {"dt_bias": "dt_bias", "A_log": "A_log", "gated_norm": "norm.weight"}
        if param in simple:
            return TensorRef(f"{prefix}.{simple[param]}")
        if param == "out":
            return TensorRef(f"{prefix}.out_proj.weight")
        part, g_text = param.rsplit(".", 1)
        g = int(g_text)
        key = g_all * dk
        # Conv channels (and Qwen3.5's in_proj_qkv rows): [all q | all k | all v].
        flat = {"q": (g * dk, dk), "k": (key + g * dk, dk), "v": (2 * key + g * per * dv, per * dv)}
        if part.startswith("conv_"):
            row0, rows = flat[part.removeprefix("conv_")]
            return TensorRef(f"{prefix}.conv1d.weight", row0, rows, squeeze=True)
        if self.packed:
            stride = 2 * dk + 2 * per * dv
            qkvz = {"q": (0, dk), "k": (dk, dk), "v": (2 * dk, per * dv)}
            qkvz["z"] = (2 * dk + per * dv, per * dv)
            if part in qkvz:
                off, rows = qkvz[part]
                return TensorRef(f"{prefix}.in_proj_qkvz.weight", g * stride + off, rows)
            off = 0 if part == "b" else per
            return TensorRef(f"{prefix}.in_proj_ba.weight", g * 2 * per + off, per)
        if part in flat:
            row0, rows = flat[part]
            return TensorRef(f"{prefix}.in_proj_qkv.weight", row0, rows)
        if part == "z":
            return TensorRef(f"{prefix}.in_proj_z.weight", g * per * dv, per * dv)
        return TensorRef(f"{prefix}.in_proj_{part}.weight", g * per, per)


def _attention(param: str, prefix: str, config: ModelConfig) -> TensorRef:
    e = config.head_dim
    if param in ("k", "v", "o"):
        return TensorRef(f"{prefix}.{param}_proj.weight")
    if param in ("q_norm", "k_norm"):
        return TensorRef(f"{prefix}.{param}.weight")
    part, h_text = param.split(".")
    h = int(h_text)
    return TensorRef(f"{prefix}.q_proj.weight", 2 * h * e + (e if part == "gate" else 0), e)


def _mlp(prefix: str, param: str) -> TensorRef:
    return TensorRef(f"{prefix}.{param}_proj.weight")


ADAPTERS = tuple(Qwen3NextAdapter(a) for a in (NEXT, QWEN35, QWEN35_MOE))
