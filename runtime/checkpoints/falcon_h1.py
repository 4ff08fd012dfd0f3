"""``FalconH1ForCausalLM`` (TII Falcon-H1): attention and Mamba-2 in parallel in every layer.

A decoder layer is two blocks: the parallel mixer (``input_layernorm``, then
``self_attn`` and ``mamba`` on the same normed input, outputs summed: a ``P`` layer) and
the SwiGLU MLP (``pre_ff_layernorm`` + ``feed_forward.{gate,up,down}_proj``). Attention is
GQA with full RoPE; the Mamba-2 tensors are the shared layout (``common.mamba_ref``);
the SSM's output norm is ``mamba.norm`` (grouped, before or after the gate) only with
``mamba_rms_norm``, else the output is ``y * silu(z)``.

muP multipliers are constants around linear maps, so each is folded into the weight it
scales when the rank reads its slice (``TensorRef.scale``): ``attention_in_multiplier``
into q / k / v, ``key_multiplier`` into k, ``attention_out_multiplier`` into o,
``ssm_in_multiplier`` times ``ssm_multipliers[z, x, B, C, dt]`` into the rows of
``in_proj`` of each segment (transformers' ``mup_vector``), ``ssm_out_multiplier`` into
``out_proj``, ``mlp_multipliers`` into gate / down, ``embedding_multiplier`` into the
embedding and ``lm_head_multiplier`` into the LM head (each separately when tied).
Biases (``attention_bias``, ``mamba_proj_bias``, ``projectors_bias``, ``mlp_bias``),
another activation or RoPE type are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from runtime.checkpoints.base import TensorRef, hf_value, unsupported
from runtime.checkpoints.common import attention_ref, mamba_ref, paired_ref
from runtime.model.config import ModelConfig

ARCH = "FalconH1ForCausalLM"
SSM_SEGMENTS = ("z", "x", "B", "C", "dt")
"""The ``in_proj`` row segments, in ``ssm_multipliers`` order."""


def _multipliers(hf: Mapping[str, Any]) -> dict[str, float]:
    """Per logical tensor name (``attn.q``, ``ssm.z``, ``gate``, ``embed``, ...) the
    constant its weight is scaled by; absent names are 1."""

    def m(key: str) -> float:
        return float(hf_value(hf, key, 1.0))

    ssm = [float(x) for x in hf_value(hf, "ssm_multipliers", [1.0] * 5)]
    mlp = [float(x) for x in hf_value(hf, "mlp_multipliers", [1.0, 1.0])]
    if len(ssm) != 5 or len(mlp) != 2:
        raise unsupported(ARCH, f"ssm_multipliers={ssm!r} / mlp_multipliers={mlp!r}")
    attn_in = m("attention_in_multiplier")
    out = {
        "attn.q": attn_in,
        "attn.k": attn_in * m("key_multiplier"),
        "attn.v": attn_in,
        "attn.o": m("attention_out_multiplier"),
        "ssm.out": m("ssm_out_multiplier"),
        "gate": mlp[0],
        "down": mlp[1],
        "embed": m("embedding_multiplier"),
        "lm_head": m("lm_head_multiplier"),
    }
    for part, mult in zip(SSM_SEGMENTS, ssm, strict=True):
        out[f"ssm.{part}"] = m("ssm_in_multiplier") * mult
    return out


class FalconH1Adapter:
    architecture = ARCH

    def model_config(self, hf: Mapping[str, Any], dtype: torch.dtype, name: str) -> ModelConfig:
        def v(key: str, default: Any) -> Any:
            return hf_value(hf, key, default)

        for flag in ("attention_bias", "mamba_proj_bias", "projectors_bias", "mlp_bias"):
            if v(flag, False):
                raise unsupported(ARCH, flag)
        if v("hidden_act", "silu") != "silu":
            raise unsupported(ARCH, f"hidden_act={v('hidden_act', '')!r}")
        if hf.get("quantization_config"):
            raise unsupported(ARCH, "a quantized checkpoint")
        rope = v("rope_parameters", {}) or {}
        if v("rope_scaling", None) or rope.get("rope_type", "default") != "default":
            raise unsupported(ARCH, f"rope_type={rope.get('rope_type')!r} (only default RoPE)")
        _multipliers(hf)  # validates the multiplier lists
        d = v("hidden_size", 4096)
        heads = v("num_attention_heads", 32)
        ssm_heads = v("mamba_n_heads", 128)
        inner = v("mamba_d_ssm", None) or v("mamba_expand", 2) * d
        d_head = v("mamba_d_head", "auto")
        d_head = inner // ssm_heads if d_head == "auto" else int(d_head)
        if d_head * ssm_heads != inner:
            raise unsupported(ARCH, f"mamba_d_head={d_head} x mamba_n_heads != d_ssm={inner}")
        norm = "none"
        if v("mamba_rms_norm", False):
            norm = "before_gate" if v("mamba_norm_before_gate", True) else "after_gate"
        lo, hi = v("time_step_limit", [0.0, float("inf")]) or [0.0, float("inf")]
        n = v("num_hidden_layers", 32)
        return ModelConfig(
            name=name,
            vocab_size=v("vocab_size", 128000),
            d_model=d,
            layer_pattern="P" * n,
            num_heads=heads,
            num_kv_heads=v("num_key_value_heads", None) or heads,
            head_dim=v("head_dim", None) or d // heads,
            ssm_heads=ssm_heads,
            ssm_groups=v("mamba_n_groups", 1),
            ssm_head_dim=d_head,
            ssm_state_dim=v("mamba_d_state", 256),
            ssm_norm=norm,
            conv_kernel=v("mamba_d_conv", 4),
            conv_bias=bool(v("mamba_conv_bias", True)),
            scan_chunk=v("mamba_chunk_size", 256),
            mlp_hidden=v("intermediate_size", 14336),
            mlp_kind="swiglu",
            rope_theta=float(rope.get("rope_theta", v("rope_theta", 10000.0))),
            tie_embeddings=bool(v("tie_word_embeddings", False)),
            dt_min=float(lo),
            dt_max=float(hi),
            norm_eps=float(v("rms_norm_eps", 1e-5)),
            dtype=dtype,
        )

    def tensor(self, name: str, config: ModelConfig, hf: Mapping[str, Any]) -> TensorRef:
        scales = _multipliers(hf)
        found = paired_ref(name, config, "model.final_layernorm.weight", "pre_ff_layernorm")
        if isinstance(found, TensorRef):
            return replace(found, scale=scales.get(name, 1.0))
        b, is_ffn, param, prefix = found
        if is_ffn:
            ref = TensorRef(f"{prefix}.feed_forward.{param}_proj.weight")
        else:
            part, rest = param.split(".", 1)
            if part == "attn":
                ref = attention_ref(rest, f"{prefix}.self_attn")
            else:
                ref = mamba_ref(rest, f"{prefix}.mamba", config)
        return replace(ref, scale=scales.get(param, 1.0))


ADAPTER = FalconH1Adapter()
