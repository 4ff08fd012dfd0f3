"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): MLA + lightning indexer + MoE.

A decoder layer is two blocks: the attention (``input_layernorm`` + ``self_attn``: MLA
projections ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``, ``kv_a_proj_with_mqa`` /
``kv_a_layernorm`` / ``kv_b_proj``, ``o_proj``, and the indexer ``indexer.wq_b`` /
``wk`` / ``k_norm`` (a LayerNorm with bias) / ``weights_proj``) and the feed-forward
(``post_attention_layernorm`` + ``mlp``): a SwiGLU MLP on the ``dense`` layers
(``mlp_layer_types``, default the first ``first_k_dense_replace``), else the MoE (sigmoid
router ``mlp.gate.weight`` with ``e_score_correction_bias``, group-limited top-k, experts
as saved ``experts.{e}.{gate,up,down}_proj``, ``shared_experts`` always on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from runtime.checkpoints.base import TensorRef, hf_value, unsupported
from runtime.checkpoints.common import paired_ref
from runtime.model.config import ModelConfig

ARCH = "DeepseekV32ForCausalLM"

_ATTENTION = {
    "q_a": "q_a_proj.weight",
    "q_a_norm": "q_a_layernorm.weight",
    "q_b": "q_b_proj.weight",
    "kv_a": "kv_a_proj_with_mqa.weight",
    "kv_a_norm": "kv_a_layernorm.weight",
    "kv_b": "kv_b_proj.weight",
    "o": "o_proj.weight",
    "index_q": "indexer.wq_b.weight",
    "index_k": "indexer.wk.weight",
    "index_norm": "indexer.k_norm.weight",
    "index_norm_bias": "indexer.k_norm.bias",
    "index_w": "indexer.weights_proj.weight",
}


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn(
    rope: Mapping[str, Any], dim: int, theta: float, max_positions: int
) -> tuple[tuple[float, ...], float, float]:
    """YaRN for a ``dim``-channel RoPE: (inverse frequencies, the cos/sin factor, the
    softmax-scale mscale). Frequencies of pairs that turn fewer than ``beta_slow`` times
    over the original context are divided by ``factor``, those turning more than
    ``beta_fast`` times are kept, with a linear ramp between (float32, as transformers)."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / original
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
    ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attention = rope.get("attention_factor")
    if attention is None:
        attention = (
            _mscale(factor, ms) / _mscale(factor, ms_all) if ms and ms_all else _mscale(factor)
        )

    def pair_at(turns: float) -> float:  # the pair index that turns ``turns`` times
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_at(fast), pair_at(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided)
    inv_freq = (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep
    mscale = _mscale(factor, ms_all) if ms_all else 1.0
    return tuple(inv_freq.tolist()), float(attention), mscale


class DeepseekV32Adapter:
    architecture = ARCH

    def model_config(self, hf: Mapping[str, Any], dtype: torch.dtype, name: str) -> ModelConfig:
        def v(key: str, default: Any) -> Any:
            return hf_value(hf, key, default)

        for flag in ("attention_bias", "mlp_bias"):
            if v(flag, False):
                raise unsupported(ARCH, flag)
        if v("hidden_act", "silu") != "silu":
            raise unsupported(ARCH, f"hidden_act={v('hidden_act', '')!r}")
        rope = dict(v("rope_parameters", None) or v("rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise unsupported(ARCH, f"rope_type={rope_type!r}")
        if not v("q_lora_rank", 1536):
            raise unsupported(ARCH, "q_lora_rank=None (no compressed query)")
        n = v("num_hidden_layers", 61)
        types = v("layer_types", None) or ["indexed_attention"] * n
        if set(types) != {"indexed_attention"}:
            raise unsupported(ARCH, f"layer_types={sorted(set(types))}")
        mlp_types = v("mlp_layer_types", None)
        if not mlp_types:
            dense = min(v("first_k_dense_replace", 3), n)
            mlp_types = ["dense"] * dense + ["sparse"] * (n - dense)
        ffn = ["E" if t == "sparse" else "M" for t in mlp_types]
        moe = "E" in ffn
        heads = v("num_attention_heads", 128)
        nope, rope_dim = v("qk_nope_head_dim", 128), v("qk_rope_head_dim", 64)
        expert = v("moe_intermediate_size", 2048)
        theta = float(rope.get("rope_theta", v("rope_theta", 10000.0)))
        inv_freq: tuple[float, ...] = ()
        cos_scale, attn_scale = 1.0, (nope + rope_dim) ** -0.5
        if rope_type == "yarn":
            inv_freq, cos_scale, mscale = yarn(
                rope, rope_dim, theta, v("max_position_embeddings", 0)
            )
            attn_scale *= mscale**2
        return ModelConfig(
            name=name,
            vocab_size=v("vocab_size", 129280),
            d_model=v("hidden_size", 7168),
            layer_pattern="A" * n,
            block_pattern="".join("A" + f for f in ffn),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=nope + rope_dim,
            attn_kind="mla",
            q_lora_rank=v("q_lora_rank", 1536),
            kv_lora_rank=v("kv_lora_rank", 512),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=v("v_head_dim", 128),
            index_heads=v("index_n_heads", 64),
            index_head_dim=v("index_head_dim", 128),
            index_topk=v("index_topk", 2048),
            mlp_hidden=v("intermediate_size", 18432),
            mlp_kind="swiglu",
            num_experts=v("n_routed_experts", 256) if moe else 0,
            experts_per_token=v("num_experts_per_tok", 8) if moe else 0,
            expert_hidden=expert if moe else 0,
            shared_expert_hidden=expert * v("n_shared_experts", 1) if moe else 0,
            router="sigmoid",
            router_groups=v("n_group", 8) if moe else 1,
            router_topk_groups=v("topk_group", 4) if moe else 1,
            router_normalize=bool(v("norm_topk_prob", True)),
            router_scale=float(v("routed_scaling_factor", 2.5)),
            rope_theta=theta,
            rope_inv_freq=inv_freq,
            rope_cos_scale=cos_scale,
            attn_scale=attn_scale,
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
            return TensorRef(f"{prefix}.self_attn.{_ATTENTION[param]}")
        mlp = f"{prefix}.mlp"
        if config.blocks[b] == "M":
            return TensorRef(f"{mlp}.{param}_proj.weight")
        if param == "router":
            return TensorRef(f"{mlp}.gate.weight")
        if param == "router_bias":
            return TensorRef(f"{mlp}.gate.e_score_correction_bias")
        group, rest = param.split(".", 1)
        if group == "shared":
            return TensorRef(f"{mlp}.shared_experts.{rest}_proj.weight")
        e, part = rest.split(".", 1)
        return TensorRef(f"{mlp}.experts.{e}.{part}_proj.weight")


ADAPTER = DeepseekV32Adapter()
