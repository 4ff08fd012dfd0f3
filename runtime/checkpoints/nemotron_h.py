"""``NemotronHForCausalLM`` (NVIDIA Nemotron-H): one op per block, squared-ReLU MLPs.

Every decoder layer of the checkpoint is one block (``norm`` + ``mixer``) of type
``M`` Mamba-2, ``*`` attention (no positional encoding), ``-`` MLP (``up_proj`` ->
relu^2 -> ``down_proj``) or ``E`` MoE (sigmoid router with score-correction bias and
group-limited top-k, squared-ReLU experts, a shared expert). The block pattern comes
from ``layers_block_type`` (or the legacy ``hybrid_override_pattern``); stateless blocks
join the cache layer of the mixer before them. The SSM step is clamped to
``time_step_limit`` (transformers >= 5.25 and the original implementation; 5.24 and
earlier clamped it below at ``time_step_min`` instead).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from runtime.checkpoints.base import TensorRef, hf_value, unsupported
from runtime.checkpoints.common import attention_ref, block_param, mamba_ref, outer_ref
from runtime.model.config import ModelConfig

ARCH = "NemotronHForCausalLM"
_BLOCKS = {"linear_attention": "S", "full_attention": "A", "mlp": "M", "moe": "E"}
_BLOCKS |= {"M": "S", "*": "A", "-": "M", "E": "E"}


def _blocks(hf: Mapping[str, Any]) -> str:
    kinds = hf_value(hf, "layers_block_type", None) or hf_value(hf, "layer_types", None)
    if not kinds:
        kinds = list(hf_value(hf, "hybrid_override_pattern", ""))
    try:
        return "".join(_BLOCKS[k] for k in kinds)
    except KeyError as err:
        raise unsupported(ARCH, f"block type {err.args[0]!r}") from None


class NemotronHAdapter:
    architecture = ARCH

    def model_config(self, hf: Mapping[str, Any], dtype: torch.dtype, name: str) -> ModelConfig:
        def v(key: str, default: Any) -> Any:
            return hf_value(hf, key, default)

        for flag in ("attention_bias", "mamba_proj_bias", "mlp_bias", "use_bias"):
            if v(flag, False):
                raise unsupported(ARCH, flag)
        if v("moe_latent_size", None) is not None:
            raise unsupported(ARCH, "moe_latent_size")
        if v("mlp_hidden_act", "relu2") != "relu2" or v("mamba_hidden_act", "silu") != "silu":
            raise unsupported(ARCH, "activations other than relu2 (MLP) / silu (Mamba)")
        if v("sliding_window", None) is not None:
            raise unsupported(ARCH, "sliding_window")
        if v("num_nextn_predict_layers", 0):
            raise unsupported(ARCH, "multi-token prediction layers")
        blocks = _blocks(hf)
        heads = v("num_attention_heads", 32)
        moe = "E" in blocks
        # ``mamba_dt_limit``: the key's name in some released configs.
        dt_lo, dt_hi = v("time_step_limit", None) or v("mamba_dt_limit", [0.0, float("inf")])
        return ModelConfig(
            name=name,
            vocab_size=v("vocab_size", 131072),
            d_model=v("hidden_size", 4096),
            layer_pattern="".join(b for b in blocks if b in "AS"),
            block_pattern=blocks,
            num_heads=heads,
            num_kv_heads=v("num_key_value_heads", None) or heads,
            head_dim=v("head_dim", None) or v("attention_head_dim", 128),
            ssm_heads=v("mamba_num_heads", 128),
            ssm_groups=v("n_groups", v("mamba_n_groups", 8)),
            ssm_head_dim=v("mamba_head_dim", 64),
            ssm_state_dim=v("ssm_state_size", 128),
            conv_kernel=v("conv_kernel", 4),
            conv_bias=bool(v("use_conv_bias", True)),
            scan_chunk=v("chunk_size", 128),
            mlp_hidden=v("intermediate_size", 21504),
            mlp_kind="relu2",
            num_experts=v("n_routed_experts", 8) if moe else 0,
            experts_per_token=v("num_experts_per_tok", 2) if moe else 0,
            expert_hidden=v("moe_intermediate_size", 7688) if moe else 0,
            shared_expert_hidden=(
                v("moe_shared_expert_intermediate_size", 7688)
                if moe and v("n_shared_experts", 1)
                else 0
            ),
            router="sigmoid",
            router_groups=v("n_group", 1),
            router_topk_groups=v("topk_group", 1),
            router_normalize=bool(v("norm_topk_prob", True)),
            router_scale=float(v("routed_scaling_factor", 1.0)),
            rotary_dim=0,
            tie_embeddings=bool(v("tie_word_embeddings", False)),
            dt_min=float(dt_lo),
            dt_max=float(dt_hi),
            norm_eps=float(v("layer_norm_epsilon", 1e-5)),
            dtype=dtype,
        )

    def tensor(self, name: str, config: ModelConfig, hf: Mapping[str, Any]) -> TensorRef:
        ref = outer_ref(name, config, "backbone.embeddings.weight", "backbone.norm_f.weight")
        if ref is not None:
            return ref
        b, param = block_param(name)
        prefix = f"backbone.layers.{b}"
        if param == "norm":
            return TensorRef(f"{prefix}.norm.weight")
        kind, mixer = config.blocks[b], f"{prefix}.mixer"
        if kind == "A":
            return attention_ref(param, mixer)
        if kind == "S":
            return mamba_ref(param, mixer, config)
        if kind == "M":
            return TensorRef(f"{mixer}.{param}_proj.weight")
        if param == "router":
            return TensorRef(f"{mixer}.gate.weight")
        if param == "router_bias":
            return TensorRef(f"{mixer}.gate.e_score_correction_bias")
        group, rest = param.split(".", 1)
        if group == "shared":
            return TensorRef(f"{mixer}.shared_experts.{rest}_proj.weight")
        e, rest = rest.split(".", 1)
        return TensorRef(f"{mixer}.experts.{e}.{rest}_proj.weight")


ADAPTER = NemotronHAdapter()
