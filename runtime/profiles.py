"""Model profiles for hit-rate studies: bytes per KV page and per state, FLOPs per token.

A ``ModelProfile`` is the size of a hybrid model as the cache sees it, without weights:
how many bytes one KV token and one recurrent-state checkpoint take, and how much
compute a cache hit saves. ``PROFILES["hybrid-7b"]`` is the 7B Attention-Mamba2 hybrid
of issue 16 (4 attention layers, 24 Mamba-2 layers, 28 MLP layers, d = 4096, SSM state
128, fp16); ``from_hf_config`` reads a Hugging Face ``config.json`` of a hybrid model.

Bytes (``dtype_bytes`` per element):

- KV per token: ``attention_layers * 2 * kv_heads * head_dim``; a page is
  ``page_size`` tokens of it.
- state per checkpoint: ``ssm_layers * (conv_dim * conv_state_width + ssm_heads *
  ssm_head_dim * ssm_state_dim)``. The cache of this project keeps ``conv_kernel - 1``
  conv inputs per channel; ``hybrid-7b`` follows the issue's (Marconi's) accounting
  instead: the SSM state is ``d x N`` and the conv keeps the whole ``d_conv = 4`` window
  of the ``2d + 2N`` x/B/C channels: 24 * (4096 * 128 + 4 * 8448) * 2 B = 26,787,840 B.

FLOPs of one token at position ``t`` (0-based, so it attends to ``t + 1`` keys), 2 per
multiply-add, forward only; embeddings and the LM head are left out (a prefix hit does
not skip the LM head of the last token, and an embedding is a lookup):

- attention layer: projections ``2 d (H + 2 KV) hd + 2 H hd d``, plus scores and values
  ``4 H hd (t + 1)``;
- Mamba-2 layer: in-projection ``2 d (2 I + 2 G N + SH)`` (z, x, B, C, dt; ``I = SH *
  SP``), depthwise conv ``2 conv_dim conv_kernel``, recurrence ``5 I N`` (decay multiply,
  input multiply-add, output multiply-add per state element), out-projection ``2 I d``;
- MLP layer: ``2 * (3 if gated else 2) * d * mlp_hidden``.

``flops(start, end)`` sums these over positions ``[start, end)`` in closed form; the hit
of ``n`` tokens saves ``flops(0, n)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mesh_hicache.radix.eviction import CostModel

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """State sizes and FLOPs of one hybrid model. Validated on construction."""

    name: str
    d_model: int
    attention_layers: int
    """Full-attention layers (each keeps K and V per token)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ssm_layers: int
    """Recurrent (Mamba-2) layers (each keeps one conv + SSM state per checkpoint)."""
    ssm_heads: int = 1
    ssm_head_dim: int = 1
    ssm_state_dim: int = 1
    ssm_groups: int = 1
    """B/C groups (``n_groups``)."""
    conv_kernel: int = 4
    conv_dim: int = 0
    """Conv channels; 0 = ``ssm_heads * ssm_head_dim + 2 * ssm_groups * ssm_state_dim``."""
    conv_state_width: int = 0
    """Conv inputs kept per channel in a checkpoint; 0 = ``conv_kernel - 1``."""
    mlp_layers: int = 0
    mlp_hidden: int = 0
    mlp_gated: bool = True
    """SwiGLU-style (3 matrices) or plain (2 matrices)."""
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("d_model", "num_heads", "num_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelProfile.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("attention_layers", "ssm_layers", "mlp_layers", "mlp_hidden"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelProfile.{name} must be >= 0, got {getattr(self, name)}")
        if self.attention_layers + self.ssm_layers == 0:
            raise ValueError("ModelProfile needs attention or SSM layers; got neither")
        if self.conv_dim == 0:
            inner = self.ssm_heads * self.ssm_head_dim
            object.__setattr__(self, "conv_dim", inner + 2 * self.ssm_groups * self.ssm_state_dim)
        if self.conv_state_width == 0:
            object.__setattr__(self, "conv_state_width", max(self.conv_kernel - 1, 1))

    # -- bytes ----------------------------------------------------------------------------------

    @property
    def has_ssm(self) -> bool:
        return self.ssm_layers > 0

    @property
    def kv_bytes_per_token(self) -> int:
        return self.attention_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one KV page of ``page_size`` tokens (all attention layers)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        return page_size * self.kv_bytes_per_token

    @property
    def state_bytes(self) -> int:
        """Bytes of one recurrent-state checkpoint (all SSM layers; 0 without SSM)."""
        conv = self.conv_dim * self.conv_state_width
        ssm = self.ssm_heads * self.ssm_head_dim * self.ssm_state_dim
        return self.ssm_layers * (conv + ssm) * self.dtype_bytes

    # -- FLOPs ----------------------------------------------------------------------------------

    @property
    def linear_flops_per_token(self) -> int:
        """FLOPs per token that do not depend on its position (all layers)."""
        d, hd = self.d_model, self.head_dim
        attn = 2 * d * (self.num_heads + 2 * self.num_kv_heads) * hd + 2 * self.num_heads * hd * d
        inner = self.ssm_heads * self.ssm_head_dim
        gn = self.ssm_groups * self.ssm_state_dim
        ssm = (
            2 * d * (2 * inner + 2 * gn + self.ssm_heads)
            + 2 * self.conv_dim * self.conv_kernel
            + 5 * inner * self.ssm_state_dim
            + 2 * inner * d
        )
        mlp = 2 * (3 if self.mlp_gated else 2) * d * self.mlp_hidden
        return self.attention_layers * attn + self.ssm_layers * ssm + self.mlp_layers * mlp

    @property
    def attention_flops_per_key(self) -> int:
        """FLOPs per (query token, key) pair over all attention layers: scores + values."""
        return self.attention_layers * 4 * self.num_heads * self.head_dim

    def cost_model(self) -> CostModel:
        """The numbers the cache's cost-aware eviction ranks by (``HiCacheConfig.cost_model``):
        the same bytes and FLOPs as ``kv_bytes_per_token``, ``state_bytes`` and ``flops``."""
        return CostModel(
            kv_bytes_per_token=self.kv_bytes_per_token,
            state_bytes=self.state_bytes,
            flops_per_token=self.linear_flops_per_token,
            flops_per_key=self.attention_flops_per_key,
        )

    def flops(self, start: int, end: int) -> int:
        """FLOPs of computing positions ``[start, end)`` (``0 <= start <= end``)."""
        if not 0 <= start <= end:
            raise ValueError(f"flops({start}, {end}): need 0 <= start <= end")
        # Position t attends to t + 1 keys: sum_{t=start}^{end-1} (t + 1).
        keys = (end * (end + 1) - start * (start + 1)) // 2
        return (end - start) * self.linear_flops_per_token + keys * self.attention_flops_per_key


PROFILES: dict[str, ModelProfile] = {
    "hybrid-7b": ModelProfile(
        name="hybrid-7b",
        d_model=4096,
        attention_layers=4,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        ssm_layers=24,
        ssm_heads=64,
        ssm_head_dim=64,
        ssm_state_dim=128,
        ssm_groups=1,
        conv_kernel=4,
        conv_dim=2 * 4096 + 2 * 128,
        conv_state_width=4,
        mlp_layers=28,
        mlp_hidden=16384,
        mlp_gated=False,
        dtype_bytes=2,
    ),
}


def profile(name: str) -> ModelProfile:
    """A built-in profile by name."""
    if name not in PROFILES:
        raise ValueError(f"unknown model profile {name!r}; choose from {sorted(PROFILES)}")
    return PROFILES[name]


# -- Hugging Face configs ----------------------------------------------------------------------


def _get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is not None:
        return default
    raise ValueError(f"model config has none of the keys {list(names)}")


def _layer_kinds(cfg: Mapping[str, Any]) -> tuple[int, int, int]:
    """(attention, ssm, mlp) layer counts from the config's layer pattern."""
    n = int(_get(cfg, "num_hidden_layers", "n_layer", "num_layers"))
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str):  # NemotronH: M = Mamba-2, * = attention, - = MLP, E = MoE
        return pattern.count("*"), pattern.count("M"), pattern.count("-") + pattern.count("E")
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type")
    if isinstance(kinds, list):
        attn = sum(1 for k in kinds if k in ("attention", "full_attention", "hybrid"))
        ssm = sum(1 for k in kinds if k in ("mamba", "mamba2", "linear_attention"))
        return attn, ssm, len(kinds)
    if cfg.get("attn_layer_indices") is not None:
        attn = len(cfg["attn_layer_indices"])
        return attn, n - attn, n
    if cfg.get("attn_layer_period"):
        period, offset = int(cfg["attn_layer_period"]), int(cfg.get("attn_layer_offset", 0))
        attn = sum(1 for i in range(n) if i % period == offset)
        return attn, n - attn, n
    raise ValueError(
        "model config names no layer pattern (hybrid_override_pattern, layer_types, "
        "layers_block_type, attn_layer_indices or attn_layer_period)"
    )


def from_hf_config(cfg: Mapping[str, Any], name: str = "hf") -> ModelProfile:
    """A profile from a Hugging Face ``config.json`` dict of a hybrid (Mamba-2) model.

    Reads the layer pattern (see ``_layer_kinds``), attention heads, the Mamba-2 sizes
    (``mamba_num_heads``/``mamba_n_heads``, ``mamba_head_dim``/``mamba_d_head``,
    ``ssm_state_size``/``mamba_d_state``, ``n_groups``/``mamba_n_groups``,
    ``conv_kernel``/``mamba_d_conv``), ``intermediate_size`` and ``torch_dtype``.
    ``ValueError`` names a missing key or an unknown dtype.
    """
    d = int(_get(cfg, "hidden_size", "d_model"))
    attn, ssm, mlp = _layer_kinds(cfg)
    heads = int(_get(cfg, "num_attention_heads", "n_head"))
    kv_heads = int(_get(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_get(cfg, "head_dim", "attention_head_dim", default=d // heads))
    dtype = str(_get(cfg, "torch_dtype", "dtype", default="bfloat16"))
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"model config dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    ssm_fields: dict[str, int] = {}
    if ssm:
        expand = int(_get(cfg, "mamba_expand", "expand", default=2))
        ssm_head_dim = int(_get(cfg, "mamba_head_dim", "mamba_d_head", "ssm_head_dim", default=64))
        inner = int(cfg.get("mamba_intermediate_size") or expand * d)
        default_heads = max(inner // ssm_head_dim, 1)
        ssm_fields = dict(
            ssm_heads=int(_get(cfg, "mamba_num_heads", "mamba_n_heads", default=default_heads)),
            ssm_head_dim=ssm_head_dim,
            ssm_state_dim=int(_get(cfg, "ssm_state_size", "mamba_d_state", "state_size")),
            ssm_groups=int(_get(cfg, "n_groups", "mamba_n_groups", "ngroups", default=1)),
            conv_kernel=int(_get(cfg, "conv_kernel", "mamba_d_conv", "d_conv", default=4)),
        )
    act = str(cfg.get("mlp_hidden_act") or cfg.get("hidden_act") or "silu")
    return ModelProfile(
        name=name,
        d_model=d,
        attention_layers=attn,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ssm_layers=ssm,
        mlp_layers=mlp,
        mlp_hidden=int(cfg.get("intermediate_size") or 0),
        mlp_gated=act not in ("relu2", "gelu", "gelu_new", "relu"),
        dtype_bytes=DTYPE_BYTES[dtype],
        **ssm_fields,
    )


def load_hf_config(path: str) -> ModelProfile:
    """``from_hf_config`` of the JSON file at ``path`` (named after the file's folder)."""
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return from_hf_config(cfg, name=str(cfg.get("_name_or_path") or path))
