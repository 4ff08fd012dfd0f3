"""ModelConfig: the shapes of the hybrid model, its presets and its cached state.

The model is a decoder whose layers follow ``layer_pattern``: ``"A"`` is a GQA attention
layer, ``"S"`` a Mamba-2 SSM layer, ``"P"`` a parallel layer (Falcon-H1: attention and
Mamba-2 on the same normed input, their outputs summed; it keeps K/V and a recurrent
state). A layer is one state-carrying mixer block plus the stateless feed-forward blocks
that follow it in ``block_pattern`` (``"M"`` dense MLP, ``"E"`` mixture of experts); by
default every mixer is followed by one MLP. Feed-forward blocks before the first mixer
belong to layer 0. Every block is pre-norm residual: ``h += residual_scale *
op(norm(h))``. The config also says exactly which state the serving cache must keep
(:meth:`ModelConfig.state_spec`). Presets (``tiny``, ``small``) have seeded random
weights; checkpoints (``runtime.checkpoints``) derive a config from their
``config.json``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields, replace

import torch

from mesh_hicache.choices import CpKvMode
from mesh_hicache.spec import IndexerSpec, KVSpec, MambaSpec, StateSpec, WindowSpec

ATTENTION = "A"
SSM = "S"
PARALLEL = "P"
MIXERS = (ATTENTION, SSM, PARALLEL)
MLP = "M"
MOE = "E"
MLP_KINDS = ("swiglu", "gelu", "relu2", "geglu", "swiglu_clamp")
ROUTERS = ("softmax", "sigmoid")
SSM_KINDS = ("mamba2", "gdn", "mamba1", "shortconv")
ATTN_KINDS = ("plain", "gated", "mla", "windowed")
SSM_NORMS = ("after_gate", "before_gate", "none")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NUMERICS_VERSION = 2
"""The runtime's numerics for given weights, part of every model id it derives. Bump it
whenever the model code computes other numbers from the same weights (2: the sparse
indexer's top-k keeps the lower position among tied scores)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Shapes and numerics of :class:`runtime.model.HybridModel`. Validated on construction."""

    vocab_size: int = 256
    """Token ids are in ``range(vocab_size)``; divisible by tp (the LM head is split by vocab)."""
    d_model: int = 64
    """Width of the residual stream."""
    layer_pattern: str = "SSASSSAS"
    """One letter per layer: ``A`` attention, ``S`` SSM, ``P`` both in parallel (plain
    attention and Mamba-2 on the same normed input, outputs summed: Falcon-H1; the layer
    is in both cached families). Layer ids are string indices."""
    num_heads: int = 8
    """Attention query heads (divisible by tp)."""
    num_kv_heads: int = 2
    """Attention KV heads (GQA); divides ``num_heads``; either divides tp or tp divides it."""
    head_dim: int = 8
    """Channels per attention head (even, for RoPE)."""
    ssm_heads: int = 8
    """SSM heads (divisible by tp)."""
    ssm_groups: int = 0
    """B/C groups (Mamba-2 ``n_groups``, divides ssm_heads); 0 means one per head."""
    ssm_head_dim: int = 16
    """Channels per SSM head (``P``); the SSM inner width is ``ssm_heads * ssm_head_dim``."""
    ssm_state_dim: int = 8
    """SSM state size per head channel (``N``)."""
    conv_kernel: int = 4
    """Width of the causal depthwise conv over the x, B, C channels (>= 2)."""
    scan_chunk: int = 64
    """Tokens per block of the chunked SSM scan (a speed knob; results do not depend on it
    beyond float rounding)."""
    mlp_hidden: int = 128
    """Hidden width of each MLP (divisible by tp)."""
    mlp_kind: str = "swiglu"
    """``swiglu`` (silu(gate) * up), ``gelu``, ``relu2`` (squared ReLU), ``geglu``
    (gelu_tanh(gate) * up, Gemma 3) or ``swiglu_clamp`` (gpt-oss: gate and up clamped to
    ``swiglu_limit``, ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``, with biases);
    also the experts'."""
    swiglu_alpha: float = 1.702
    """``swiglu_clamp``: the sigmoid's slope."""
    swiglu_limit: float = 7.0
    """``swiglu_clamp``: gate <= limit, -limit <= up <= limit."""
    router_has_bias: bool = False
    """The ``softmax`` router's logits have a bias (``router_bias``; gpt-oss)."""
    block_pattern: str = ""
    """Blocks in order: ``A``/``S``/``P`` mixers (exactly ``layer_pattern``'s letters, in order),
    ``M`` dense MLP, ``E`` MoE. Empty: every mixer followed by one ``M``."""
    num_experts: int = 0
    """Routed experts of each ``E`` block."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k)."""
    expert_hidden: int = 0
    """Hidden width of one expert (divisible by tp: every expert is split like an MLP)."""
    shared_expert_hidden: int = 0
    """Hidden width of the always-on shared expert of an ``E`` block; 0: none."""
    router: str = "softmax"
    """``softmax``: softmax over the top-k logits (Granite). ``sigmoid``: sigmoid scores,
    top-k of scores + bias within the best groups, weights = scores (Nemotron-H)."""
    router_groups: int = 1
    """Expert groups of the ``sigmoid`` router (``n_group``)."""
    router_topk_groups: int = 1
    """Groups a token may choose experts from (``topk_group``)."""
    router_normalize: bool = True
    """Divide the chosen weights by their sum (``softmax``: the softmax over the top-k
    logits; else the top-k of the softmax over all experts)."""
    router_scale: float = 1.0
    """Multiplies the routed experts' weights."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rotary_dim: int = -1
    """Leading channels of each attention head that RoPE rotates: -1 all (full RoPE),
    0 none (no positional encoding), else a partial rotary (even)."""
    attn_scale: float = 0.0
    """Attention score scale; 0 means ``head_dim ** -0.5``."""
    embed_scale: float = 1.0
    """Multiplies the token embeddings."""
    residual_scale: float = 1.0
    """Multiplies every block's output before it is added to the residual stream."""
    logits_scale: float = 1.0
    """Logits are divided by it."""
    tie_embeddings: bool = False
    """The LM head is the embedding matrix."""
    conv_bias: bool = True
    """The causal conv has a bias."""
    dt_min: float = 0.0
    """Lower clamp of the SSM step ``dt`` after softplus (Nemotron-H ``time_step_min``)."""
    dt_max: float = float("inf")
    """Upper clamp of ``dt``."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (also of the SSM's gated norm)."""
    name: str = ""
    """For checkpoints: the identity of the weights (``model_id`` then uses it, not the
    seed): ``runtime.checkpoints`` sets it to the content digest of the checkpoint
    (``mesh_hicache.identity.checkpoint_model_id``) or to the user's ``--model-id``."""
    seed: int = 0
    """Weights are a pure function of (seed, tensor name): same seed, same model, any mesh."""
    dtype: torch.dtype = torch.float32
    """Weights, activations, K/V and conv state. The SSM state is always float32."""
    ssm_kind: str = "mamba2"
    """The recurrent mixer of ``S`` layers: ``mamba2`` or ``gdn`` (Gated DeltaNet: then
    ``ssm_heads``/``ssm_groups`` are the value/key heads, ``ssm_head_dim`` the value and
    ``ssm_state_dim`` the key head dim; ``runtime.model.gdn``), ``mamba1`` (Jamba's
    selective scan, ``runtime.model.mamba1``: ``ssm_heads`` is ``d_inner``, one channel per
    head, ``ssm_head_dim`` 1, ``ssm_groups`` 0, conv over x only) or ``shortconv`` (LFM2's
    gated short convolution, ``runtime.model.shortconv``: ``ssm_heads`` is its channels
    (= ``d_model``), ``ssm_head_dim`` and ``ssm_state_dim`` are 1, ``conv_kernel`` is
    ``L_cache``; the cache keeps its conv state only)."""
    ssm_norm: str = "after_gate"
    """``mamba2``'s output norm (a grouped RMSNorm, weight ``ssm_norm``): ``after_gate``
    ``norm(y * silu(z))`` (Mamba-2), ``before_gate`` ``norm(y) * silu(z)`` or ``none``
    ``y * silu(z)`` (Falcon-H1's ``mamba_rms_norm=False``; no norm weight is read)."""
    ssm_dt_rank: int = 0
    """``mamba1``: rank of the low-rank step projection (``x_proj`` -> ``dt_proj``)."""
    attn_kind: str = "plain"
    """``plain`` GQA or ``gated`` (Qwen3-Next: per-head output gate, QK RMSNorm)."""
    norm_offset: float = 0.0
    """Added to every RMSNorm weight of the residual stream and of QK-norm (1.0 for the
    ``(1 + w)`` norms of Qwen3-Next / Qwen3.5)."""
    shared_expert_gate: bool = False
    """The MoE's shared expert is scaled by ``sigmoid(x @ w_gate)`` (Qwen3-Next)."""
    q_lora_rank: int = 0
    """``attn_kind="mla"`` (DeepSeek-V3.2, ``runtime.model.mla``): width of the compressed
    query (``q_a``), also the lightning indexer's query input."""
    kv_lora_rank: int = 0
    """MLA: width of the compressed latent KV (cached per token, with the RoPE key)."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key channels without RoPE (expanded from the latent)."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query channels with RoPE; the one shared RoPE key has this width.
    Also the indexer's rotated channels."""
    v_head_dim: int = 0
    """MLA: per-head value channels."""
    index_heads: int = 0
    """MLA: lightning-indexer query heads (the indexer is replicated over tp)."""
    index_head_dim: int = 0
    """MLA: indexer key / query width (the per-token indexer key is cached)."""
    index_topk: int = 0
    """MLA: keys each query attends to (the indexer's top-k over all previous tokens)."""
    rope_inv_freq: tuple[float, ...] = ()
    """RoPE inverse frequency of each rotated pair (MLA: ``qk_rope_head_dim / 2``, plain
    attention: ``rope_dim / 2``), for a scaled RoPE a checkpoint derives (YaRN, Llama 3);
    empty: ``rope_theta ** (-2i / dim)``."""
    rope_cos_scale: float = 1.0
    """MLA: multiplies RoPE's cos and sin (YaRN's attention factor)."""
    layer_windows: tuple[int, ...] = ()
    """``windowed`` attention: per layer, 0 for full attention or the window W of a
    sliding-window layer (a query at position p sees keys at ``p - W < k <= p``). Empty:
    every layer full."""
    attn_sinks: bool = False
    """``windowed``: every query head has a learned sink logit (``sinks``, gpt-oss) that
    joins the softmax's denominator and attends to nothing."""
    attn_bias: bool = False
    """Plain attention: the q, k, v projections have a bias (Qwen2; ``q_bias``, ``k_bias``,
    ``v_bias``); ``windowed``: q, k, v and o projections have biases."""
    qk_norm: bool = False
    """Plain and ``windowed`` attention: a per-head RMSNorm on q and k before RoPE (Qwen3,
    Gemma 3; ``q_norm``, ``k_norm`` ``[E]``, plus ``norm_offset``)."""
    sandwich_norm: bool = False
    """Every block's output is RMS-normed (``post_norm``) before the residual add (Gemma 3)."""
    local_rope_theta: float = 0.0
    """``windowed``: RoPE base of the sliding-window layers (plain RoPE); 0: as full layers.
    Full layers use ``rope_inv_freq`` / ``rope_cos_scale`` when set, else ``rope_theta``."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size", "d_model", "num_heads", "num_kv_heads", "head_dim", "ssm_heads",
            "ssm_head_dim", "ssm_state_dim", "conv_kernel", "scan_chunk", "mlp_hidden",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if not self.layer_pattern or set(self.layer_pattern) - set(MIXERS):
            raise ValueError(
                f"ModelConfig.layer_pattern must be a non-empty string of 'A' (attention), "
                f"'S' (SSM) and 'P' (both in parallel), got {self.layer_pattern!r}"
            )
        if PARALLEL in self.layer_pattern and (
            self.attn_kind != "plain" or self.ssm_kind != "mamba2"
        ):
            raise ValueError(
                f"ModelConfig: parallel ('P') layers need attn_kind='plain' and "
                f"ssm_kind='mamba2', got {self.attn_kind!r} / {self.ssm_kind!r}"
            )
        if self.ssm_norm not in SSM_NORMS or (
            self.ssm_norm != "after_gate" and self.ssm_kind != "mamba2"
        ):
            raise ValueError(
                f"ModelConfig.ssm_norm={self.ssm_norm!r}; valid: {SSM_NORMS} (other than "
                f"'after_gate' only for ssm_kind='mamba2')"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.conv_kernel < 2:
            raise ValueError(f"ModelConfig.conv_kernel must be >= 2, got {self.conv_kernel}")
        if self.mlp_kind not in MLP_KINDS:
            raise ValueError(f"ModelConfig.mlp_kind={self.mlp_kind!r}; valid: {MLP_KINDS}")
        if self.router not in ROUTERS:
            raise ValueError(f"ModelConfig.router={self.router!r}; valid: {ROUTERS}")
        if self.ssm_groups < 0 or (self.ssm_groups and self.ssm_heads % self.ssm_groups):
            raise ValueError(
                f"ModelConfig.ssm_groups={self.ssm_groups} must divide ssm_heads={self.ssm_heads}"
            )
        if not -1 <= self.rotary_dim <= self.head_dim or (
            self.rotary_dim > 0 and self.rotary_dim % 2
        ):
            raise ValueError(
                f"ModelConfig.rotary_dim={self.rotary_dim} must be -1, 0 or an even number "
                f"<= head_dim={self.head_dim}"
            )
        blocks = self.blocks
        if set(blocks) - {*MIXERS, MLP, MOE}:
            raise ValueError(f"ModelConfig.block_pattern={blocks!r} may hold only A, S, P, M, E")
        if "".join(b for b in blocks if b in MIXERS) != self.layer_pattern:
            raise ValueError(
                f"ModelConfig.block_pattern={blocks!r} must hold the mixers of "
                f"layer_pattern={self.layer_pattern!r} in order"
            )
        if MOE in blocks:
            k, e = self.experts_per_token, self.num_experts
            if not 0 < k <= e or self.expert_hidden <= 0:
                raise ValueError(
                    f"MoE blocks need 0 < experts_per_token ({k}) <= num_experts ({e}) and "
                    f"expert_hidden > 0 ({self.expert_hidden})"
                )
            if e % self.router_groups or not 0 < self.router_topk_groups <= self.router_groups:
                raise ValueError(
                    f"ModelConfig.router_groups={self.router_groups} must divide num_experts "
                    f"and hold router_topk_groups={self.router_topk_groups}"
                )
        if self.ssm_kind not in SSM_KINDS or self.attn_kind not in ATTN_KINDS:
            raise ValueError(
                f"ModelConfig.ssm_kind={self.ssm_kind!r} / attn_kind={self.attn_kind!r}; "
                f"valid: {SSM_KINDS} / {ATTN_KINDS}"
            )
        if self.ssm_kind == "gdn" and not self.ssm_groups:
            raise ValueError("ModelConfig.ssm_kind='gdn' needs ssm_groups (key heads) > 0")
        if self.ssm_kind == "mamba1" and (
            self.ssm_head_dim != 1 or self.ssm_groups or self.ssm_dt_rank <= 0
        ):
            raise ValueError(
                "ModelConfig.ssm_kind='mamba1' needs ssm_head_dim=1 (one channel per head), "
                f"ssm_groups=0 and ssm_dt_rank > 0; got {self.ssm_head_dim}, "
                f"{self.ssm_groups}, {self.ssm_dt_rank}"
            )
        if self.ssm_kind == "shortconv" and (
            self.ssm_groups or self.ssm_head_dim != 1 or self.ssm_state_dim != 1
        ):
            raise ValueError(
                "ModelConfig.ssm_kind='shortconv' needs ssm_groups=0 and "
                "ssm_head_dim = ssm_state_dim = 1 (ssm_heads is the conv's channels)"
            )
        if self.attn_kind == "mla":
            self._check_mla()
        elif self.attn_kind == "windowed":
            self._check_windowed()
        elif self.rope_cos_scale != 1.0:
            raise ValueError("ModelConfig.rope_cos_scale is for MLA and windowed attention only")
        if self.attn_kind != "mla" and (
            self.rope_inv_freq and len(self.rope_inv_freq) != self.rope_dim // 2
        ):
            raise ValueError(
                f"ModelConfig.rope_inv_freq has {len(self.rope_inv_freq)} values, want "
                f"rope_dim / 2 = {self.rope_dim // 2}"
            )
        if self.attn_kind != "windowed" and (self.layer_windows or self.attn_sinks):
            raise ValueError("ModelConfig.layer_windows / attn_sinks need attn_kind='windowed'")
        if self.attn_kind == "mla" and (self.attn_bias or self.qk_norm):
            raise ValueError("ModelConfig.attn_bias / qk_norm are for plain and windowed attention")
        if self.dtype not in DTYPES.values():
            raise ValueError(f"ModelConfig.dtype={self.dtype}; valid: {list(DTYPES.values())}")

    def _check_mla(self) -> None:
        for name in (
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "index_heads", "index_head_dim", "index_topk",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"ModelConfig.{name} must be a positive int for MLA, got {value!r}"
                )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(
                f"ModelConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= "
                f"index_head_dim={self.index_head_dim}"
            )
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError(
                f"ModelConfig.head_dim={self.head_dim} must be qk_nope_head_dim + "
                f"qk_rope_head_dim for MLA"
            )
        if SSM in self.layer_pattern:
            raise ValueError("ModelConfig: MLA models have no SSM layers (layer_pattern)")
        if self.rope_inv_freq and len(self.rope_inv_freq) != self.qk_rope_head_dim // 2:
            raise ValueError(
                f"ModelConfig.rope_inv_freq has {len(self.rope_inv_freq)} values, want "
                f"qk_rope_head_dim / 2 = {self.qk_rope_head_dim // 2}"
            )

    def _check_windowed(self) -> None:
        w = self.layer_windows
        if w and (len(w) != self.num_layers or any(not isinstance(x, int) or x < 0 for x in w)):
            raise ValueError(
                f"ModelConfig.layer_windows={w!r} must hold one int >= 0 per layer "
                f"({self.num_layers})"
            )
        if any(x and self.layer_pattern[i] != ATTENTION for i, x in enumerate(w)):
            raise ValueError(f"ModelConfig.layer_windows={w!r}: only attention layers have windows")

    def window(self, layer_id: int) -> int:
        """The sliding window of attention layer ``layer_id`` (0: full attention)."""
        return self.layer_windows[layer_id] if self.layer_windows else 0

    # -- derived shapes -----------------------------------------------------------------------

    @property
    def mla_layers(self) -> tuple[int, ...]:
        """The MLA layers (every attention layer of an ``mla`` model; each has an indexer)."""
        return self.attention_layers if self.attn_kind == "mla" else ()

    @property
    def latent_dim(self) -> int:
        """Cached MLA channels per token: the latent KV then the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_layers(self) -> int:
        """Layers of the cache (= mixer blocks)."""
        return len(self.layer_pattern)

    @property
    def blocks(self) -> str:
        """The block pattern, with the default (each mixer followed by an MLP) filled in."""
        return self.block_pattern or "".join(kind + MLP for kind in self.layer_pattern)

    def layer_blocks(self) -> list[list[int]]:
        """Block indices of each layer: the mixer, the blocks after it and (layer 0) before it."""
        groups: list[list[int]] = []
        leading: list[int] = []
        for b, kind in enumerate(self.blocks):
            if kind in MIXERS:
                groups.append(leading + [b] if not groups else [b])
                leading = []
            elif groups:
                groups[-1].append(b)
            else:
                leading.append(b)
        return groups

    @property
    def num_groups(self) -> int:
        """B/C groups (``ssm_groups``, or one per head)."""
        return self.ssm_groups or self.ssm_heads

    @property
    def rope_dim(self) -> int:
        """Channels RoPE rotates per head (0: no positional encoding)."""
        return self.head_dim if self.rotary_dim < 0 else self.rotary_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with attention (``A`` and ``P``): the KV family's layer ids."""
        return tuple(i for i, kind in enumerate(self.layer_pattern) if kind in "AP")

    @property
    def ssm_layers(self) -> tuple[int, ...]:
        """Layers with a recurrent mixer (``S`` and ``P``): the recurrent family's ids."""
        return tuple(i for i, kind in enumerate(self.layer_pattern) if kind in "SP")

    @property
    def ssm_inner(self) -> int:
        """Width of the SSM's x (and gate z): ``ssm_heads * ssm_head_dim``."""
        return self.ssm_heads * self.ssm_head_dim

    @property
    def conv_dim(self) -> int:
        """Conv channels, group-major: group g owns ``[x of its heads, B_g (N), C_g (N)]``
        (head-major ``[x_h, B_h, C_h]`` with one group per head). Mamba-1: x only; a
        short conv: its channels."""
        if self.ssm_kind in ("mamba1", "shortconv"):
            return self.ssm_heads
        return self.ssm_heads * self.ssm_head_dim + 2 * self.num_groups * self.ssm_state_dim

    def check_mesh(self, *, tp: int, cp: int, pp: int, page_size: int, cp_kv: str) -> None:
        """Raise ``ValueError`` unless the model splits over a ``pp x cp x tp`` mesh."""
        for name, value, total in (
            ("num_heads", self.num_heads, tp),
            ("ssm_heads", self.ssm_heads, tp),
            ("mlp_hidden", self.mlp_hidden, tp),
            ("expert_hidden", self.expert_hidden, tp),
            ("shared_expert_hidden", self.shared_expert_hidden, tp),
            ("vocab_size", self.vocab_size, tp),
        ):
            if value % total:
                raise ValueError(f"ModelConfig.{name}={value} must be divisible by tp={total}")
        groups = self.num_groups
        if groups % tp and tp % groups:
            raise ValueError(
                f"ModelConfig.ssm_groups={groups} and tp={tp}: one must divide the other"
            )
        kv = self.num_kv_heads
        if kv % tp and tp % kv:
            raise ValueError(
                f"ModelConfig.num_kv_heads={kv} and tp={tp}: one must divide the other"
            )
        if pp > self.num_layers:
            raise ValueError(f"pp={pp} stages for only {self.num_layers} layers")
        if CpKvMode.parse(cp_kv, "cp_kv") is CpKvMode.SHARD and page_size % cp:
            raise ValueError(f"cp_kv='shard' needs page_size ({page_size}) divisible by cp={cp}")

    def state_spec(self, page_size: int) -> StateSpec:
        """The state the cache keeps for this model: whole-model shapes, layer ids = pattern
        (a ``P`` layer is in both the KV and the recurrent family).

        KV and conv state use ``dtype``; the SSM state is float32.
        """
        if self.mla_layers:
            return StateSpec(
                page_size=page_size,
                kv=KVSpec(
                    layer_ids=self.mla_layers,
                    num_kv_heads=1,
                    head_dim=self.latent_dim,
                    dtype=self.dtype,
                    mla=True,
                    values=False,
                ),
                indexer=IndexerSpec(
                    layer_ids=self.mla_layers, key_dim=self.index_head_dim, dtype=self.dtype
                ),
                model_id=self.model_id,
            )
        kv = None
        if self.attention_layers:
            kv = KVSpec(
                layer_ids=self.attention_layers,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                dtype=self.dtype,
            )
        mamba = None
        if self.ssm_layers and self.ssm_kind == "gdn":
            mamba = MambaSpec.gated_deltanet(
                layer_ids=self.ssm_layers,
                key_heads=self.ssm_groups,
                value_heads=self.ssm_heads,
                key_dim=self.ssm_state_dim,
                value_dim=self.ssm_head_dim,
                conv_kernel=self.conv_kernel,
                conv_dtype=self.dtype,
            )
        elif self.ssm_layers and self.ssm_kind == "mamba1":
            mamba = MambaSpec.mamba1(
                layer_ids=self.ssm_layers,
                inner=self.ssm_heads,
                state_dim=self.ssm_state_dim,
                conv_kernel=self.conv_kernel,
                conv_dtype=self.dtype,
            )
        elif self.ssm_layers and self.ssm_kind == "shortconv":
            mamba = MambaSpec.short_conv(
                layer_ids=self.ssm_layers,
                channels=self.ssm_heads,
                conv_kernel=self.conv_kernel,
                conv_dtype=self.dtype,
            )
        elif self.ssm_layers:
            mamba = MambaSpec(
                layer_ids=self.ssm_layers,
                conv_dim=self.conv_dim,
                conv_kernel=self.conv_kernel,
                num_heads=self.ssm_heads,
                head_dim=self.ssm_head_dim,
                state_dim=self.ssm_state_dim,
                conv_dtype=self.dtype,
                ssm_dtype=torch.float32,
                num_groups=self.ssm_groups,
            )
        return StateSpec(
            page_size=page_size,
            kv=kv,
            mamba=mamba,
            windows=self.window_groups(),
            model_id=self.model_id,
        )

    def window_groups(self) -> tuple[WindowSpec, ...]:
        """The sliding-window layers, one group per window size (no sink tokens: gpt-oss's
        sinks are learned logits, not tokens)."""
        by_window: dict[int, list[int]] = {}
        for layer, w in enumerate(self.layer_windows):
            if w:
                by_window.setdefault(w, []).append(layer)
        return tuple(
            WindowSpec(layer_ids=tuple(ids), window=w) for w, ids in sorted(by_window.items())
        )

    @property
    def model_id(self) -> str:
        """Names the weights (part of every storage key). Seeded weights: every field that
        shapes them, the seed, the dtype and ``NUMERICS_VERSION`` (the weights are a pure
        function of those). A checkpoint: its ``name`` (the content identity) and dtype."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.name:
            return f"{self.name}-{dtype}"
        return (
            f"seeded-n{NUMERICS_VERSION}-hybrid-v{self.vocab_size}-d{self.d_model}-{self.layer_pattern}"
            f"-h{self.num_heads}kv{self.num_kv_heads}x{self.head_dim}"
            f"-s{self.ssm_heads}x{self.ssm_head_dim}n{self.ssm_state_dim}k{self.conv_kernel}"
            f"-{self.mlp_kind}{self.mlp_hidden}-seed{self.seed}-{dtype}{self._extras_tag()}"
        )

    def _extras_tag(self) -> str:
        # The fields added for checkpoint architectures, when they differ from the
        # defaults, so that two seeded models never share storage keys.
        changed = []
        for f in fields(self):
            if f.name in _LEGACY_ID_FIELDS or f.name == "scan_chunk":
                continue
            if getattr(self, f.name) != f.default:
                changed.append(f"{f.name}={getattr(self, f.name)!r}")
        if not changed:
            return ""
        return "-x" + hashlib.sha256(";".join(changed).encode()).hexdigest()[:10]


_LEGACY_ID_FIELDS = frozenset(
    (
        "vocab_size", "d_model", "layer_pattern", "num_heads", "num_kv_heads", "head_dim",
        "ssm_heads", "ssm_head_dim", "ssm_state_dim", "conv_kernel", "mlp_hidden",
        "mlp_kind", "seed", "dtype", "name", "rope_theta", "norm_eps",
    )
)  # fmt: skip

PRESETS: dict[str, ModelConfig] = {
    # Fast tests: every mesh up to tp=8 splits it.
    "tiny": ModelConfig(),
    # Benchmarks: on CPU its compute dominates the cache's copies.
    "small": ModelConfig(
        vocab_size=4096,
        d_model=512,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        ssm_heads=16,
        ssm_head_dim=64,
        ssm_state_dim=32,
        scan_chunk=64,
        mlp_hidden=1536,
    ),
}


def preset(name: str, **overrides: object) -> ModelConfig:
    """A named preset (``tiny`` or ``small``) with field overrides, e.g. ``seed=1``."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]
