"""Tensor layouts the three architectures share: the Mamba-2 mixer and GQA attention.

Mamba-2 (``mamba_ssm`` layout, as transformers saves it): ``in_proj.weight`` packs rows
``[z (S*P) | x (S*P) | B (G*N) | C (G*N) | dt (S)]``; ``conv1d.weight`` ``[C, 1, K]`` and
``conv1d.bias`` hold channels ``[x | B | C]`` (all x first, then all B, then all C; the
model regroups them group-major when it reads its slices). Attention: ``q/k/v/o_proj``.
Also the naming every adapter shares: embedding, LM head, final norm, and the
``blocks.{b}.{param}`` split (two blocks per decoder layer where the checkpoint pairs them).
"""

from __future__ import annotations

from typing import NamedTuple

from runtime.checkpoints.base import TensorRef
from runtime.model.config import ModelConfig


def mamba_ref(param: str, prefix: str, config: ModelConfig) -> TensorRef:
    """The checkpoint tensor of SSM parameter ``param`` under module ``prefix``."""
    c = config
    inner = c.ssm_heads * c.ssm_head_dim
    bc = c.num_groups * c.ssm_state_dim
    packed = {"z": (0, inner), "x": (inner, inner), "B": (2 * inner, bc)}
    packed |= {"C": (2 * inner + bc, bc), "dt": (2 * inner + 2 * bc, c.ssm_heads)}
    if param in packed:
        row0, rows = packed[param]
        return TensorRef(f"{prefix}.in_proj.weight", row0, rows)
    channels = {"x": (0, inner), "B": (inner, bc), "C": (inner + bc, bc)}
    if param.startswith("conv_bias_"):
        row0, rows = channels[param.removeprefix("conv_bias_")]
        return TensorRef(f"{prefix}.conv1d.bias", row0, rows)
    if param.startswith("conv_"):
        row0, rows = channels[param.removeprefix("conv_")]
        return TensorRef(f"{prefix}.conv1d.weight", row0, rows, squeeze=True)
    names = {"dt_bias": "dt_bias", "A_log": "A_log", "D": "D", "ssm_norm": "norm.weight"}
    names["out"] = "out_proj.weight"
    return TensorRef(f"{prefix}.{names[param]}")


def attention_ref(param: str, prefix: str) -> TensorRef:
    """The checkpoint tensor of attention projection ``param`` (q, k, v, o)."""
    assert param in ("q", "k", "v", "o"), param
    return TensorRef(f"{prefix}.{param}_proj.weight")


def layer_kind(text: str, architecture: str) -> str:
    """``S`` for a Mamba layer type, ``A`` for attention (either naming convention)."""
    if text in ("mamba", "linear_attention", "M"):
        return "S"
    if text in ("attention", "full_attention", "*"):
        return "A"
    raise ValueError(f"{architecture}: layer type {text!r} is not supported")


def outer_ref(name: str, config: ModelConfig, embed: str, final_norm: str) -> TensorRef | None:
    """The embedding, LM head (the embedding when tied) or final norm for ``name``;
    ``None`` when ``name`` is a block's tensor (``blocks.{b}.{param}``)."""
    if name == "embed" or (name == "lm_head" and config.tie_embeddings):
        return TensorRef(embed)
    if name == "lm_head":
        return TensorRef("lm_head.weight")
    if name == "final_norm":
        return TensorRef(final_norm)
    return None


def block_param(name: str) -> tuple[int, str]:
    """``blocks.{b}.{param}`` -> ``(b, param)``."""
    _, b_text, param = name.split(".", 2)
    return int(b_text), param


class PairedBlock(NamedTuple):
    """Block ``block`` of a checkpoint whose decoder layer ``block // 2`` holds the mixer
    (even block) and the feed-forward (odd block) under module ``prefix``."""

    block: int
    is_ffn: bool
    param: str
    prefix: str


def paired_ref(
    name: str, config: ModelConfig, final_norm: str, ffn_norm: str
) -> TensorRef | PairedBlock:
    """For ``model.layers.{i}`` checkpoints with two blocks per layer: the tensor of the
    embedding / LM head / final norm / either block norm (``input_layernorm`` for the
    mixer, ``ffn_norm`` for the feed-forward), else the block the caller resolves."""
    ref = outer_ref(name, config, "model.embed_tokens.weight", final_norm)
    if ref is not None:
        return ref
    b, param = block_param(name)
    layer, is_ffn = divmod(b, 2)
    prefix = f"model.layers.{layer}"
    if param == "norm":
        norm = ffn_norm if is_ffn else "input_layernorm"
        return TensorRef(f"{prefix}.{norm}.weight")
    return PairedBlock(b, bool(is_ffn), param, prefix)
