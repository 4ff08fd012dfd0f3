"""Tensor layouts the three architectures share: the Mamba-2 mixer and GQA attention.

Mamba-2 (``mamba_ssm`` layout, as transformers saves it): ``in_proj.weight`` packs rows
``[z (S*P) | x (S*P) | B (G*N) | C (G*N) | dt (S)]``; ``conv1d.weight`` ``[C, 1, K]`` and
``conv1d.bias`` hold channels ``[x | B | C]`` (all x first, then all B, then all C; the
model regroups them group-major when it reads its slices). Attention: ``q/k/v/o_proj``.
"""

from __future__ import annotations

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
