"""Model profiles for hit-rate studies: bytes per KV page and per state, FLOPs per token.

A ``ModelProfile`` is the size of a model as the cache sees it, without weights: how
many bytes one cached token and one recurrent-state checkpoint take, and how much
compute a cache hit saves. ``PROFILES["hybrid-7b"]`` is the 7B Attention-Mamba2 hybrid
the cache policy benchmarks model (4 attention layers, 24 Mamba-2 layers, 28 MLP layers,
d = 4096, SSM state 128, fp16). ``runtime.workloads.profiles_hf.from_hf_config`` builds one from a
Hugging Face ``config.json``.

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

from dataclasses import dataclass

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
