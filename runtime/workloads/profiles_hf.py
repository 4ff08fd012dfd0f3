"""Model profiles from Hugging Face configs (``runtime.workloads.profiles.ModelProfile``).

``from_hf_config`` reads a Hugging Face ``config.json`` of one of the
families the runtime serves (``runtime.checkpoints``), chosen by ``model_type`` /
``architectures`` (an unknown one is a ``ValueError``, never another family's numbers):

- **Mamba-2 hybrids** (``nemotron_h``, ``granitemoehybrid``, ``bamba``): GQA attention,
  Mamba-2 layers, dense MLPs and MoE blocks;
- **Gated DeltaNet hybrids** (``qwen3_next``, ``qwen3_5_text``, ``qwen3_5_moe_text``
  and the ``qwen3_5*`` wrappers of a ``text_config``): gated GQA attention on the layers
  ``layer_types`` (or every ``full_attention_interval``-th) names, GDN elsewhere, MoE;
- **MLA** (``deepseek_v3``, ``deepseek_v32``): every layer MLA, V3.2 with the lightning
  indexer; the first ``first_k_dense_replace`` (or ``mlp_layer_types``) dense, then MoE.

The byte and FLOP accounting is ``runtime.workloads.profiles``'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from runtime.workloads.profiles import DTYPE_BYTES, ModelProfile

MAMBA2_TYPES = {
    "nemotron_h": "NemotronHForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "bamba": "BambaForCausalLM",
}
GDN_TYPES = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
MLA_TYPES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}
WRAPPERS = ("qwen3_5", "qwen3_5_moe")
"""Multimodal configs whose ``text_config`` is the language model."""


def _need(cfg: Mapping[str, Any], *names: str) -> Any:
    """The first of ``names`` the config sets; ``ValueError`` naming them all otherwise."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    kind = cfg.get("model_type", "?")
    raise ValueError(f"model config ({kind}) has none of the keys {list(names)}")


def _opt(cfg: Mapping[str, Any], name: str, default: Any) -> Any:
    """``cfg[name]`` or the config class's default (``save_pretrained`` omits the keys
    ``PretrainedConfig`` itself defines when they hold its defaults)."""
    value = cfg.get(name)
    return default if value is None else value


def _family(cfg: Mapping[str, Any]) -> tuple[str, str]:
    """(family, model_type) from ``model_type``, else ``architectures[0]``."""
    kind = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    tables = (("mamba2", MAMBA2_TYPES), ("gdn", GDN_TYPES), ("mla", MLA_TYPES))
    for family, table in tables:
        if kind in table:
            return family, str(kind)
    for family, table in tables:  # e.g. Kimi-K2: model_type kimi_k2, DeepseekV3ForCausalLM
        for model_type, arch in table.items():
            if archs and archs[0] == arch:
                return family, model_type
    known = sorted([*MAMBA2_TYPES, *GDN_TYPES, *MLA_TYPES, *WRAPPERS])
    raise ValueError(
        f"model config: model_type {kind!r} / architectures {archs} is not a family this "
        f"profile knows (Mamba-2 hybrids, Gated DeltaNet hybrids, MLA); known model_type: "
        f"{known}"
    )


def _dtype_bytes(cfg: Mapping[str, Any]) -> int:
    dtype = str(_opt(cfg, "torch_dtype", None) or _opt(cfg, "dtype", "bfloat16"))
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"model config dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def _mamba2_blocks(cfg: Mapping[str, Any], model_type: str) -> str:
    """The block pattern, one letter per block: A attention, S Mamba-2, M MLP, E MoE."""
    ffn = "M"
    if model_type == "granitemoehybrid":
        ffn = "E" if int(_opt(cfg, "num_local_experts", 0)) > 0 else "M"
    letters = {"M": "S", "*": "A", "-": "M", "E": "E", "mamba": "S", "linear_attention": "S"}
    letters |= {"attention": "A", "full_attention": "A", "mlp": "M", "moe": "E"}
    pattern = cfg.get("hybrid_override_pattern")
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not kinds and isinstance(pattern, str):
        kinds = list(pattern)
    if kinds:
        unknown = sorted({k for k in kinds if k not in letters})
        if unknown:
            raise ValueError(f"model config ({model_type}): unknown layer types {unknown}")
        blocks = [letters[k] for k in kinds]
        if model_type == "nemotron_h":  # one block per entry
            return "".join(blocks)
        return "".join(b + ffn for b in blocks)  # a mixer and its feed-forward per layer
    n = int(_need(cfg, "num_hidden_layers", "n_layer", "num_layers"))
    if cfg.get("attn_layer_indices") is not None or model_type == "bamba":
        attn = set(cfg.get("attn_layer_indices") or ())  # Bamba: none listed, none
    elif cfg.get("attn_layer_period"):
        period, offset = int(cfg["attn_layer_period"]), int(cfg.get("attn_layer_offset", 0))
        attn = {i for i in range(n) if i % period == offset}
    else:
        raise ValueError(
            f"model config ({model_type}) names no layer pattern (hybrid_override_pattern, "
            "layer_types, layers_block_type, attn_layer_indices or attn_layer_period)"
        )
    return "".join(("A" if i in attn else "S") + ffn for i in range(n))


def _counts(blocks: str) -> dict[str, int]:
    return dict(
        attention_layers=blocks.count("A"),
        ssm_layers=blocks.count("S"),
        mlp_layers=blocks.count("M"),
        moe_layers=blocks.count("E"),
    )


def _from_mamba2(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    d = int(_need(cfg, "hidden_size", "d_model"))
    heads = int(_need(cfg, "num_attention_heads"))
    blocks = _mamba2_blocks(cfg, model_type)
    out: dict[str, Any] = dict(
        d_model=d, num_heads=heads, num_kv_heads=int(_opt(cfg, "num_key_value_heads", heads))
    )
    out |= _counts(blocks)
    if model_type == "nemotron_h":
        out |= dict(
            head_dim=int(_opt(cfg, "head_dim", None) or _need(cfg, "attention_head_dim")),
            ssm_heads=int(_need(cfg, "mamba_num_heads")),
            ssm_head_dim=int(_need(cfg, "mamba_head_dim")),
            ssm_state_dim=int(_need(cfg, "ssm_state_size")),
            ssm_groups=int(_need(cfg, "n_groups", "mamba_n_groups")),
            conv_kernel=int(_need(cfg, "conv_kernel", "mamba_d_conv")),
            mlp_hidden=int(_need(cfg, "intermediate_size")) if "M" in blocks else 0,
            mlp_gated=str(_opt(cfg, "mlp_hidden_act", "relu2")) not in ("relu2", "relu", "gelu"),
        )
        if "E" in blocks:
            has_shared = int(_opt(cfg, "n_shared_experts", 1)) > 0
            out |= dict(
                num_experts=int(_need(cfg, "n_routed_experts")),
                experts_per_token=int(_need(cfg, "num_experts_per_tok")),
                expert_hidden=int(_need(cfg, "moe_intermediate_size")),
                shared_expert_hidden=(
                    int(_need(cfg, "moe_shared_expert_intermediate_size")) if has_shared else 0
                ),
            )
        return out
    # Granite 4.0-H and Bamba name the Mamba-2 sizes mamba_*.
    ssm_heads = int(_need(cfg, "mamba_n_heads"))
    d_head = _opt(cfg, "mamba_d_head", "auto")
    if d_head == "auto":
        d_head = int(_opt(cfg, "mamba_expand", 2)) * d // ssm_heads
    out |= dict(
        head_dim=d // heads,
        ssm_heads=ssm_heads,
        ssm_head_dim=int(d_head),
        ssm_state_dim=int(_need(cfg, "mamba_d_state")),
        ssm_groups=int(_need(cfg, "mamba_n_groups")),
        conv_kernel=int(_need(cfg, "mamba_d_conv")),
    )
    if model_type == "bamba":
        return out | dict(mlp_hidden=int(_need(cfg, "intermediate_size")))
    shared = int(_need(cfg, "shared_intermediate_size"))
    if "E" not in blocks:
        return out | dict(mlp_hidden=shared)
    return out | dict(
        num_experts=int(_need(cfg, "num_local_experts")),
        experts_per_token=int(_need(cfg, "num_experts_per_tok")),
        expert_hidden=int(_need(cfg, "intermediate_size")),
        shared_expert_hidden=shared,
    )


def _from_gdn(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    n = int(_need(cfg, "num_hidden_layers"))
    kinds = cfg.get("layer_types")
    if kinds:
        bad = sorted({k for k in kinds if k not in ("linear_attention", "full_attention")})
        if bad or len(kinds) != n:
            raise ValueError(f"model config ({model_type}): layer_types {bad or len(kinds)}")
        mixers = ["A" if k == "full_attention" else "S" for k in kinds]
    else:
        interval = int(_opt(cfg, "full_attention_interval", 4))
        mixers = ["A" if (i + 1) % interval == 0 else "S" for i in range(n)]
    experts = 0 if model_type == "qwen3_5_text" else int(_opt(cfg, "num_experts", 0))
    step = int(_opt(cfg, "decoder_sparse_step", 1))
    dense = set(_opt(cfg, "mlp_only_layers", []))
    ffn = ["E" if experts and i not in dense and (i + 1) % step == 0 else "M" for i in range(n)]
    blocks = "".join(m + f for m, f in zip(mixers, ffn, strict=True))
    d, heads = int(_need(cfg, "hidden_size")), int(_need(cfg, "num_attention_heads"))
    out: dict[str, Any] = dict(
        d_model=d,
        num_heads=heads,
        num_kv_heads=int(_need(cfg, "num_key_value_heads")),
        head_dim=int(_opt(cfg, "head_dim", d // heads)),
        attention_kind="gated",
        ssm_kind="gdn",
        ssm_heads=int(_need(cfg, "linear_num_value_heads")),
        ssm_head_dim=int(_need(cfg, "linear_value_head_dim")),
        ssm_state_dim=int(_need(cfg, "linear_key_head_dim")),
        ssm_groups=int(_need(cfg, "linear_num_key_heads")),
        conv_kernel=int(_need(cfg, "linear_conv_kernel_dim")),
        mlp_hidden=int(_need(cfg, "intermediate_size")) if "M" in blocks else 0,
    )
    out |= _counts(blocks)
    if "E" in blocks:
        out |= dict(
            num_experts=experts,
            experts_per_token=int(_need(cfg, "num_experts_per_tok")),
            expert_hidden=int(_need(cfg, "moe_intermediate_size")),
            shared_expert_hidden=int(_opt(cfg, "shared_expert_intermediate_size", 0)),
        )
    return out


def _from_mla(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    n = int(_need(cfg, "num_hidden_layers"))
    mlp_types = cfg.get("mlp_layer_types")
    if not mlp_types:
        k = min(int(_need(cfg, "first_k_dense_replace")), n)
        mlp_types = ["dense"] * k + ["sparse"] * (n - k)
    blocks = "".join("A" + ("E" if t == "sparse" else "M") for t in mlp_types)
    heads = int(_need(cfg, "num_attention_heads"))
    rope = int(_need(cfg, "qk_rope_head_dim"))
    out: dict[str, Any] = dict(
        d_model=int(_need(cfg, "hidden_size")),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=int(_need(cfg, "qk_nope_head_dim")) + rope,
        attention_kind="mla",
        q_lora_rank=int(_opt(cfg, "q_lora_rank", 0)),
        kv_lora_rank=int(_need(cfg, "kv_lora_rank")),
        qk_rope_head_dim=rope,
        v_head_dim=int(_need(cfg, "v_head_dim")),
        ssm_layers=0,
        mlp_hidden=int(_need(cfg, "intermediate_size")) if "M" in blocks else 0,
    )
    out |= _counts(blocks)
    if model_type == "deepseek_v32":
        out |= dict(
            index_heads=int(_need(cfg, "index_n_heads")),
            index_head_dim=int(_need(cfg, "index_head_dim")),
            index_topk=int(_need(cfg, "index_topk")),
        )
    if "E" in blocks:
        expert = int(_need(cfg, "moe_intermediate_size"))
        out |= dict(
            num_experts=int(_need(cfg, "n_routed_experts")),
            experts_per_token=int(_need(cfg, "num_experts_per_tok")),
            expert_hidden=expert,
            shared_expert_hidden=expert * int(_opt(cfg, "n_shared_experts", 0)),
        )
    return out


def from_hf_config(cfg: Mapping[str, Any], name: str = "hf") -> ModelProfile:
    """A profile from a Hugging Face ``config.json`` dict (see the module docstring for
    the families). Bytes are those this runtime's cache allocates for the checkpoint
    (``ModelConfig.state_spec``: the config's dtype for KV and conv state, float32 for
    the recurrent state). ``ValueError`` names an unknown architecture, a missing key
    or an unknown dtype."""
    if cfg.get("model_type") in WRAPPERS and isinstance(cfg.get("text_config"), Mapping):
        outer = cfg
        cfg = dict(cfg["text_config"])
        cfg.setdefault("model_type", f"{outer['model_type']}_text")
        for key in ("torch_dtype", "dtype"):
            cfg.setdefault(key, outer.get(key))
    family, model_type = _family(cfg)
    fields = {"mamba2": _from_mamba2, "gdn": _from_gdn, "mla": _from_mla}[family](cfg, model_type)
    return ModelProfile(
        name=name,
        dtype_bytes=_dtype_bytes(cfg),
        state_dtype_bytes=4 if family != "mla" else 0,
        **fields,
    )


def load_hf_config(path: str) -> ModelProfile:
    """``from_hf_config`` of the JSON file at ``path`` (named after ``_name_or_path`` or
    the path)."""
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return from_hf_config(cfg, name=str(cfg.get("_name_or_path") or path))
