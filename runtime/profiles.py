"""Model profiles for hit-rate studies: bytes per KV page and per state, FLOPs per token.

A ``ModelProfile`` is the size of a model as the cache sees it, without weights: how
many bytes one cached token and one recurrent-state checkpoint take, and how much
compute a cache hit saves. ``PROFILES["hybrid-7b"]`` is the 7B Attention-Mamba2 hybrid
of issue 16 (4 attention layers, 24 Mamba-2 layers, 28 MLP layers, d = 4096, SSM state
128, fp16). ``from_hf_config`` reads a Hugging Face ``config.json`` of one of the
families the runtime serves (``runtime.checkpoints``), chosen by ``model_type`` /
``architectures`` (an unknown one is a ``ValueError``, never another family's numbers):

- **Mamba-2 hybrids** (``nemotron_h``, ``granitemoehybrid``, ``bamba``): GQA attention,
  Mamba-2 layers, dense MLPs and MoE blocks;
- **Gated DeltaNet hybrids** (``qwen3_next``, ``qwen3_5_text``, ``qwen3_5_moe_text``
  and the ``qwen3_5*`` wrappers of a ``text_config``): gated GQA attention on the layers
  ``layer_types`` (or every ``full_attention_interval``-th) names, GDN elsewhere, MoE;
- **MLA** (``deepseek_v3``, ``deepseek_v32``): every layer MLA, V3.2 with the lightning
  indexer; the first ``first_k_dense_replace`` (or ``mlp_layer_types``) dense, then MoE.

Bytes (``dtype_bytes`` per element; ``state_dtype_bytes`` for the recurrent state):

- cached per token: GQA ``attention_layers * 2 * kv_heads * head_dim``; MLA
  ``attention_layers * (kv_lora_rank + qk_rope_head_dim + index_head_dim)`` (the latent,
  the shared RoPE key and, V3.2, the indexer key; no V). A page is ``page_size`` tokens.
- state per checkpoint: ``ssm_layers * (conv_dim * conv_state_width * dtype_bytes +
  ssm_heads * ssm_head_dim * ssm_state_dim * state_dtype_bytes)``; ``conv_dim = heads *
  head_dim + 2 * groups * state_dim`` for Mamba-2 (x, B, C) and for GDN (v, k, q: value
  heads x value dim + 2 x key heads x key dim), whose state is ``[value heads, value dim,
  key dim]``. ``from_hf_config`` counts as this runtime's cache allocates
  (``ModelConfig.state_spec``): ``conv_kernel - 1`` conv inputs, the recurrent state in
  float32. ``hybrid-7b`` follows the issue's (Marconi's) accounting instead: fp16 state
  ``d x N`` and the whole ``d_conv = 4`` window of the ``2d + 2N`` x/B/C channels:
  24 * (4096 * 128 + 4 * 8448) * 2 B = 26,787,840 B.

FLOPs of one token at position ``t`` (0-based, so it attends to ``t + 1`` keys), 2 per
multiply-add, forward only, prefill form; embeddings, the LM head, norms and the
one-row gates (Qwen3-Next's shared-expert gate) are left out:

- GQA layer: projections ``2 d (H + 2 KV) hd + 2 H hd d`` (``gated``: q_proj also emits
  a per-head output gate, ``+ 2 d H hd``), scores and values ``4 H hd (t + 1)``;
- MLA layer (``H`` heads, ``hd = nope + rope``, value dim ``V``, ranks ``Lq``/``Lkv``):
  ``2 d Lq + 2 Lq H hd`` (q; ``2 d H hd`` without ``q_lora_rank``), ``2 d (Lkv + rope)``
  (kv_a), ``2 Lkv H (nope + V)`` (kv_b expands the token's latent once, as prefill
  does), ``2 H V d`` (o); per key ``2 H hd + 2 H V``, over at most ``index_topk`` keys
  when the layer has an indexer, whose own cost is ``2 Lq Hi Di + 2 d Di + 2 d Hi`` per
  token and ``2 Hi Di + 2 Hi`` per key over every previous key;
- Mamba-2 layer: in-projection ``2 d (2 I + 2 G N + SH)`` (z, x, B, C, dt; ``I = SH *
  SP``), depthwise conv ``2 conv_dim conv_kernel``, recurrence ``5 I N``, out-projection
  ``2 I d``;
- GDN layer (``H`` value heads of dim ``Dv``, ``G`` key heads of dim ``Dk``): in-projection
  ``2 d (2 G Dk + 2 H Dv + 2 H)`` (q, k, v, z, b, a), conv ``2 conv_dim conv_kernel``,
  delta rule ``7 H Dk Dv`` (decay, ``S k``, the rank-1 update, ``S q``), out ``2 H Dv d``;
- MLP layer: ``2 * (3 if gated else 2) * d * mlp_hidden``; MoE layer: the router
  ``2 d E`` plus that MLP cost for ``experts_per_token * expert_hidden +
  shared_expert_hidden`` hidden channels (active experts only).

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
ATTENTION_KINDS = ("gqa", "gated", "mla")
SSM_KINDS = ("mamba2", "gdn")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """State sizes and FLOPs of one model. Validated on construction."""

    name: str
    d_model: int
    attention_layers: int
    """Full-attention layers (GQA: K and V per token; MLA: the latent per token)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Query/key channels per head (MLA: ``qk_nope_head_dim + qk_rope_head_dim``)."""
    ssm_layers: int
    """Recurrent layers (each keeps one conv + recurrent state per checkpoint)."""
    ssm_heads: int = 1
    """Mamba-2 heads; GDN value heads."""
    ssm_head_dim: int = 1
    """Mamba-2 head dim; GDN value head dim."""
    ssm_state_dim: int = 1
    """Mamba-2 state size N; GDN key head dim."""
    ssm_groups: int = 1
    """Mamba-2 B/C groups (``n_groups``); GDN key heads."""
    conv_kernel: int = 4
    conv_dim: int = 0
    """Conv channels; 0 = ``ssm_heads * ssm_head_dim + 2 * ssm_groups * ssm_state_dim``."""
    conv_state_width: int = 0
    """Conv inputs kept per channel in a checkpoint; 0 = ``conv_kernel - 1``."""
    mlp_layers: int = 0
    """Dense feed-forward blocks."""
    mlp_hidden: int = 0
    mlp_gated: bool = True
    """SwiGLU-style (3 matrices) or plain (2 matrices); also the experts'."""
    dtype_bytes: int = 2
    state_dtype_bytes: int = 0
    """Bytes per recurrent-state element; 0 = ``dtype_bytes``."""
    attention_kind: str = "gqa"
    """``gqa``, ``gated`` (Qwen3-Next: q_proj emits an output gate too) or ``mla``."""
    ssm_kind: str = "mamba2"
    """``mamba2`` or ``gdn`` (Gated DeltaNet)."""
    q_lora_rank: int = 0
    """MLA: compressed query width (0: a plain q_proj)."""
    kv_lora_rank: int = 0
    """MLA: cached latent width."""
    qk_rope_head_dim: int = 0
    """MLA: RoPE channels per head; the one cached RoPE key has this width."""
    v_head_dim: int = 0
    """MLA: value channels per head."""
    index_heads: int = 0
    """MLA (DeepSeek-V3.2): lightning-indexer query heads; 0 = no indexer."""
    index_head_dim: int = 0
    """MLA: indexer key width (cached per token)."""
    index_topk: int = 0
    """MLA with an indexer: keys each query attends to at most."""
    moe_layers: int = 0
    """Mixture-of-experts feed-forward blocks."""
    num_experts: int = 0
    experts_per_token: int = 0
    expert_hidden: int = 0
    shared_expert_hidden: int = 0
    """Hidden channels of the always-on shared expert(s) of a MoE block, all together."""

    def __post_init__(self) -> None:
        for name in ("d_model", "num_heads", "num_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelProfile.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("attention_layers", "ssm_layers", "mlp_layers", "mlp_hidden", "moe_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelProfile.{name} must be >= 0, got {getattr(self, name)}")
        if self.attention_layers + self.ssm_layers == 0:
            raise ValueError("ModelProfile needs attention or SSM layers; got neither")
        if self.attention_kind not in ATTENTION_KINDS or self.ssm_kind not in SSM_KINDS:
            raise ValueError(
                f"ModelProfile.attention_kind={self.attention_kind!r} / ssm_kind="
                f"{self.ssm_kind!r}; valid: {ATTENTION_KINDS} / {SSM_KINDS}"
            )
        if self.attention_kind == "mla":
            rope, nope = self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim
            if min(self.kv_lora_rank, rope, nope, self.v_head_dim) < 1:
                raise ValueError(
                    f"MLA profile needs kv_lora_rank, qk_rope_head_dim, v_head_dim >= 1 and "
                    f"head_dim > qk_rope_head_dim; got {self.kv_lora_rank}, {rope}, "
                    f"{self.v_head_dim}, head_dim {self.head_dim}"
                )
            ix = (self.index_heads, self.index_head_dim, self.index_topk)
            if any(ix) and min(ix) < 1:
                raise ValueError(
                    f"MLA indexer needs index_heads, index_head_dim, index_topk >= 1, got {ix}"
                )
        if self.moe_layers and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"MoE profile needs 0 < experts_per_token ({self.experts_per_token}) <= "
                f"num_experts ({self.num_experts})"
            )
        if self.conv_dim == 0:
            inner = self.ssm_heads * self.ssm_head_dim
            object.__setattr__(self, "conv_dim", inner + 2 * self.ssm_groups * self.ssm_state_dim)
        if self.conv_state_width == 0:
            object.__setattr__(self, "conv_state_width", max(self.conv_kernel - 1, 1))
        if self.state_dtype_bytes == 0:
            object.__setattr__(self, "state_dtype_bytes", self.dtype_bytes)

    # -- bytes ----------------------------------------------------------------------------------

    @property
    def has_ssm(self) -> bool:
        return self.ssm_layers > 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token holds in the cache over every attention layer."""
        if self.attention_kind == "mla":
            width = self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim
        else:
            width = 2 * self.num_kv_heads * self.head_dim
        return self.attention_layers * width * self.dtype_bytes

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one KV page of ``page_size`` tokens (all attention layers)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        return page_size * self.kv_bytes_per_token

    @property
    def state_bytes(self) -> int:
        """Bytes of one recurrent-state checkpoint (all SSM layers; 0 without SSM)."""
        conv = self.conv_dim * self.conv_state_width * self.dtype_bytes
        ssm = self.ssm_heads * self.ssm_head_dim * self.ssm_state_dim * self.state_dtype_bytes
        return self.ssm_layers * (conv + ssm)

    # -- FLOPs ----------------------------------------------------------------------------------

    def _attention_linear(self) -> int:
        d, h, hd = self.d_model, self.num_heads, self.head_dim
        if self.attention_kind != "mla":
            q = (2 if self.attention_kind == "gated" else 1) * h
            return 2 * d * (q + 2 * self.num_kv_heads) * hd + 2 * h * hd * d
        rq, rkv, rope, v = (
            self.q_lora_rank,
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            self.v_head_dim,
        )
        q = 2 * d * rq + 2 * rq * h * hd if rq else 2 * d * h * hd
        kv = 2 * d * (rkv + rope) + 2 * rkv * h * (hd - rope + v)
        ih, idim = self.index_heads, self.index_head_dim
        indexer = 2 * (rq or d) * ih * idim + 2 * d * idim + 2 * d * ih
        return q + kv + 2 * h * v * d + indexer

    def _ssm_linear(self) -> int:
        d, heads, hdim, n = self.d_model, self.ssm_heads, self.ssm_head_dim, self.ssm_state_dim
        inner = heads * hdim
        conv = 2 * self.conv_dim * self.conv_kernel
        if self.ssm_kind == "gdn":
            in_proj = 2 * d * (2 * self.ssm_groups * n + 2 * inner + 2 * heads)
            return in_proj + conv + 7 * heads * n * hdim + 2 * inner * d
        in_proj = 2 * d * (2 * inner + 2 * self.ssm_groups * n + heads)
        return in_proj + conv + 5 * inner * n + 2 * inner * d

    @property
    def linear_flops_per_token(self) -> int:
        """FLOPs per token that do not depend on its position (all layers)."""
        per_channel = 2 * (3 if self.mlp_gated else 2) * self.d_model
        mlp = per_channel * self.mlp_hidden
        active = self.experts_per_token * self.expert_hidden + self.shared_expert_hidden
        moe = 2 * self.d_model * self.num_experts + per_channel * active
        return (
            self.attention_layers * self._attention_linear()
            + self.ssm_layers * self._ssm_linear()
            + self.mlp_layers * mlp
            + self.moe_layers * moe
        )

    @property
    def sparse_flops_per_key(self) -> int:
        """FLOPs per (query, key) pair over the keys a sparse (indexed) layer attends to,
        at most ``index_topk`` of them; 0 for dense attention."""
        if self.attention_kind != "mla" or not self.index_heads:
            return 0
        return self._main_flops_per_key()

    def _main_flops_per_key(self) -> int:
        h = self.num_heads
        if self.attention_kind == "mla":
            return self.attention_layers * (2 * h * self.head_dim + 2 * h * self.v_head_dim)
        return self.attention_layers * 4 * h * self.head_dim

    @property
    def dense_flops_per_key(self) -> int:
        """FLOPs per (query, key) pair over every previous key: dense attention, or the
        lightning indexer's scores of a sparse layer."""
        if self.sparse_flops_per_key:
            return self.attention_layers * (
                2 * self.index_heads * self.index_head_dim + 2 * self.index_heads
            )
        return self._main_flops_per_key()

    @property
    def attention_flops_per_key(self) -> int:
        """FLOPs per (query, key) pair of a query with every key in reach (the sparse part
        counted as if dense: what the linear-in-keys ``CostModel`` can hold)."""
        return self.dense_flops_per_key + self.sparse_flops_per_key

    def cost_model(self) -> CostModel:
        """The numbers the cache's cost-aware eviction ranks by (``HiCacheConfig.cost_model``):
        the bytes of ``kv_bytes_per_token`` and ``state_bytes``, the FLOPs of ``flops``
        (a sparse layer's top-k cap left out: the cost model is linear in keys)."""
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
        # Position t attends to t + 1 keys (at most k of them in a sparse layer).
        keys = (end * (end + 1) - start * (start + 1)) // 2
        total = (end - start) * self.linear_flops_per_token + keys * self.dense_flops_per_key
        if self.sparse_flops_per_key:
            k = self.index_topk

            def capped(n: int) -> int:  # sum_{t < n} min(t + 1, k)
                return n * (n + 1) // 2 if n <= k else k * (k + 1) // 2 + (n - k) * k

            total += (capped(end) - capped(start)) * self.sparse_flops_per_key
        return total


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
