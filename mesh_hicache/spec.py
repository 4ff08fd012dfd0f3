"""StateSpec: the model's state families, their shapes and dtypes (docs/DESIGN.md section 4).

Three families:

- ``KV`` (full attention): per layer ``K`` and ``V`` of shape ``[tokens, kv_heads, head_dim]``,
  stored in pages of ``page_size`` tokens. MLA declares its latent as head-less keys only
  (``mla=True, values=False, num_kv_heads=1``), replicated over tp.
- ``MAMBA`` (recurrent): per layer a conv state ``[conv_dim, conv_kernel - 1]`` and a
  recurrent state ``[num_heads, head_dim, state_dim]``, one per prefix boundary (a "slot"),
  not per token. Conv channel order: with ``num_groups=0`` head-major (head ``s`` owns
  channels ``[s*conv_dim/num_heads, (s+1)*conv_dim/num_heads)``), so tp rank ``t`` holds the
  contiguous block ``[t*conv_dim/tp, (t+1)*conv_dim/tp)``; with ``num_groups > 0``
  group-major (per group: the channels of its heads, then the group's shared channels,
  B then C), and tp rank ``t`` holds, in that order, the channels of its heads and of its
  groups (``ssm_group_range``: whole groups when ``num_groups >= tp``, a contiguous block;
  else its heads' channels then its one group's B and C, replicated on the ranks of that
  group). The cached conv state of a rank is exactly its conv's channels in that order.
  It is the one recurrent family (``RecurrentSpec``): the cache never asks which
  recurrence produced a state. Mamba-2 declares it directly; Gated DeltaNet through
  :meth:`MambaSpec.gated_deltanet` (its state kept as ``[value_heads, value_dim, key_dim]``),
  Mamba-1 through :meth:`MambaSpec.mamba1` (one channel per head: conv ``[d_inner, K-1]``,
  state ``[d_inner, 1, d_state]``).
  The family's value ``"mamba"`` stays in storage keys for every producer.
  A short convolution (LFM2) declares a conv state only (:meth:`MambaSpec.short_conv`,
  ``recurrent=False``): no recurrent tensor is allocated, copied or stored.
- ``INDEXER`` (optional, sparse attention): per layer a per-token key ``[tokens, key_dim]``,
  paged like KV.
- windowed KV (optional, ``StateSpec.windows``): groups of KV layers with a sliding window
  (and optional sink tokens), one :class:`WindowSpec` per group. A resume at a prefix
  boundary needs their K/V of only the last ``window - 1`` tokens and the sinks
  (:mod:`mesh_hicache.radix.window` holds the rules). Their K/V shapes are the KV
  family's; they are kept in their own region, ``kv_window``
  (:attr:`StateSpec.window_layer_ids`).

Layer ids are global model layer indices; the ids of all families together are exactly
``range(num_layers)`` (a hybrid model: some layers attention, the others SSM). A layer
may be in both KV and MAMBA (a parallel layer, Falcon-H1: attention and Mamba-2 on the
same input): it then keeps K/V pages and a state slot, each in its own region, and
nothing below the spec asks which layers overlap. INDEXER layers are a subset of the KV
layers.
Specs are validated on construction; ``check_tp(tp)`` validates the split over a tp axis.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class Family(str, enum.Enum):
    """A state family. Values are used in storage keys: never rename them."""

    KV = "kv"
    MAMBA = "mamba"
    INDEXER = "indexer"


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


def _check_layers(owner: str, layer_ids: tuple[int, ...]) -> None:
    if not layer_ids:
        raise ValueError(f"{owner}.layer_ids must not be empty")
    if any(not isinstance(i, int) or i < 0 for i in layer_ids):
        raise ValueError(f"{owner}.layer_ids must be non-negative ints, got {layer_ids}")
    if len(set(layer_ids)) != len(layer_ids) or list(layer_ids) != sorted(layer_ids):
        raise ValueError(f"{owner}.layer_ids must be strictly increasing, got {layer_ids}")


def _check_dtype(owner: str, name: str, dtype: object) -> None:
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{owner}.{name} must be a torch.dtype, got {dtype!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class KVSpec:
    """Full-attention KV: per layer K and V of ``[tokens, num_kv_heads, head_dim]``."""

    layer_ids: tuple[int, ...]
    """Global ids of the attention layers, strictly increasing."""
    num_kv_heads: int
    """KV heads of the whole model (before tp). 0 is not allowed; MLA-style head-less KV
    is ``num_kv_heads=1`` with ``mla=True``."""
    head_dim: int
    """Elements per head per token (K and V alike)."""
    dtype: torch.dtype = torch.float32
    """Element type of K and V."""
    mla: bool = False
    """Head-less latent KV (MLA): replicated over tp instead of sharded by head."""
    values: bool = True
    """False: keys only, no V tensor (an MLA latent: one ``[tokens, 1, head_dim]`` tensor
    per layer, e.g. ``head_dim = kv_lora_rank + qk_rope_head_dim``). No V is allocated,
    copied or stored; the ``kv`` region's part dim has size 1 instead of 2."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        _check_layers("KVSpec", self.layer_ids)
        _check_positive("KVSpec", num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        _check_dtype("KVSpec", "dtype", self.dtype)
        for name in ("mla", "values"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KVSpec.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def num_parts(self) -> int:
        """Tensors per layer and token: 2 (K and V) or 1 (keys only)."""
        return 2 if self.values else 1


@dataclass(frozen=True, kw_only=True, slots=True)
class MambaSpec:
    """Recurrent state: per layer conv ``[conv_dim, conv_kernel-1]`` and SSM
    ``[num_heads, head_dim, state_dim]``, one of each per prefix boundary."""

    layer_ids: tuple[int, ...]
    """Global ids of the SSM layers, strictly increasing."""
    conv_dim: int
    """Channels of the causal depthwise conv: a multiple of ``num_heads``, head-major, when
    ``num_groups`` is 0; else group-major (``num_groups``)."""
    conv_kernel: int
    """Conv kernel width; the state keeps the last ``conv_kernel - 1`` inputs (>= 2)."""
    num_heads: int
    """SSM heads of the whole model (before tp)."""
    head_dim: int
    """Channels per SSM head."""
    state_dim: int
    """SSM state size N per head channel."""
    conv_dtype: torch.dtype = torch.float32
    ssm_dtype: torch.dtype = torch.float32
    num_groups: int = 0
    """B/C groups (Mamba-2 ``n_groups``). 0: B and C per head, channels head-major. Else
    ``conv_dim == num_heads*head_dim + 2*num_groups*state_dim`` with channels group-major
    (per group: the x of its heads, then its B, then its C); under tp the groups are
    sharded when ``num_groups >= tp`` and replicated (one per tp rank) otherwise."""
    recurrent: bool = True
    """False: the layers keep a conv state only (a short convolution): no recurrent
    ``[num_heads, head_dim, state_dim]`` tensor is allocated, copied or stored; the
    ``mamba_ssm`` region does not exist. ``head_dim`` / ``state_dim`` then only size the
    tp split (:meth:`short_conv` sets them to 1)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        _check_layers("MambaSpec", self.layer_ids)
        if not isinstance(self.recurrent, bool):
            raise ValueError(f"MambaSpec.recurrent must be a bool, got {self.recurrent!r}")
        if self.num_groups:
            self._check_groups()
        _check_positive(
            "MambaSpec",
            conv_dim=self.conv_dim,
            conv_kernel=self.conv_kernel,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            state_dim=self.state_dim,
        )
        if self.conv_kernel < 2:
            raise ValueError(f"MambaSpec.conv_kernel must be >= 2, got {self.conv_kernel}")
        if not self.num_groups and self.conv_dim % self.num_heads:
            raise ValueError(
                f"MambaSpec.conv_dim ({self.conv_dim}) must be a multiple of "
                f"num_heads ({self.num_heads}): conv channels are head-major"
            )
        _check_dtype("MambaSpec", "conv_dtype", self.conv_dtype)
        _check_dtype("MambaSpec", "ssm_dtype", self.ssm_dtype)

    @classmethod
    def gated_deltanet(
        cls,
        *,
        layer_ids: tuple[int, ...],
        key_heads: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        conv_kernel: int,
        conv_dtype: torch.dtype = torch.float32,
    ) -> MambaSpec:
        """The recurrent state of Gated DeltaNet layers (Qwen3-Next, Qwen3.5).

        Per layer: a conv state over the q, k, v channels, group-major by key head
        (``[v of its value heads | k_g | q_g]``, so ``conv_dim = 2*key_heads*key_dim +
        value_heads*value_dim``), and the delta-rule state, float32, transposed to
        ``[value_heads, value_dim, key_dim]``. TP shards the value heads (state dim 0 and
        their v channels) and the key heads like B/C groups (sharded when
        ``key_heads >= tp``, else replicated to the ranks of their value heads).
        """
        return cls(
            layer_ids=layer_ids,
            conv_dim=2 * key_heads * key_dim + value_heads * value_dim,
            conv_kernel=conv_kernel,
            num_heads=value_heads,
            head_dim=value_dim,
            state_dim=key_dim,
            conv_dtype=conv_dtype,
            ssm_dtype=torch.float32,
            num_groups=key_heads,
        )

    @classmethod
    def mamba1(
        cls,
        *,
        layer_ids: tuple[int, ...],
        inner: int,
        state_dim: int,
        conv_kernel: int,
        conv_dtype: torch.dtype = torch.float32,
    ) -> MambaSpec:
        """The recurrent state of Mamba-1 layers (Jamba, Falcon-Mamba).

        Per layer: a conv state over the ``inner`` (``d_inner``) channels of x,
        ``[inner, conv_kernel - 1]``, and the selective-scan state, float32, one row of
        ``state_dim`` per channel (``[inner, 1, state_dim]``: each channel is a head of
        width 1, so the bytes are those of ``[inner, state_dim]``). TP shards the channels
        (conv rows and state rows alike, one contiguous block per rank).
        """
        return cls(
            layer_ids=layer_ids,
            conv_dim=inner,
            conv_kernel=conv_kernel,
            num_heads=inner,
            head_dim=1,
            state_dim=state_dim,
            conv_dtype=conv_dtype,
            ssm_dtype=torch.float32,
        )

    @classmethod
    def short_conv(
        cls,
        *,
        layer_ids: tuple[int, ...],
        channels: int,
        conv_kernel: int,
        conv_dtype: torch.dtype = torch.float32,
    ) -> MambaSpec:
        """The state of short-convolution layers (LFM2's gated depthwise conv).

        Per layer only a conv state ``[channels, conv_kernel - 1]`` (the last inputs of the
        causal depthwise conv, ``conv_kernel`` being LFM2's ``L_cache``); no recurrent
        state. Every channel is its own "head" of width 1, so tp shards the channels into
        contiguous blocks (``channels`` divisible by tp).
        """
        return cls(
            layer_ids=layer_ids,
            conv_dim=channels,
            conv_kernel=conv_kernel,
            num_heads=channels,
            head_dim=1,
            state_dim=1,
            conv_dtype=conv_dtype,
            recurrent=False,
        )

    def _check_groups(self) -> None:
        g = self.num_groups
        if not isinstance(g, int) or g < 0 or self.num_heads % g:
            raise ValueError(
                f"MambaSpec.num_groups={g!r} must be a positive divisor of "
                f"num_heads={self.num_heads} (or 0)"
            )
        want = self.num_heads * self.head_dim + 2 * g * self.state_dim
        if self.conv_dim != want:
            raise ValueError(
                f"MambaSpec.conv_dim={self.conv_dim} must be num_heads*head_dim + "
                f"2*num_groups*state_dim = {want}"
            )

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_dim)


RecurrentSpec = MambaSpec
"""The recurrent family's spec under its general name (Mamba-2, Gated DeltaNet, Mamba-1)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexerSpec:
    """Sparse-attention indexer: per layer a per-token key ``[tokens, key_dim]``, paged."""

    layer_ids: tuple[int, ...]
    """Global ids of the layers with an indexer (a subset of the KV layers)."""
    key_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        _check_layers("IndexerSpec", self.layer_ids)
        _check_positive("IndexerSpec", key_dim=self.key_dim)
        _check_dtype("IndexerSpec", "dtype", self.dtype)


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowSpec:
    """A group of sliding-window attention layers: a query at position ``p`` sees the keys
    at ``p - window < k <= p`` and the first ``sink_tokens`` keys. Their K/V have the KV
    family's shapes (the layers are a subset of ``StateSpec.kv.layer_ids``)."""

    layer_ids: tuple[int, ...]
    """Global ids of the group's layers, strictly increasing."""
    window: int
    """Keys a query sees, itself included (gpt-oss: 128; Gemma 3: ``sliding_window``)."""
    sink_tokens: int = 0
    """Leading tokens every query also sees (StreamingLLM-style sinks; learned per-head
    sink logits, as gpt-oss has, are weights, not tokens: 0)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        _check_layers("WindowSpec", self.layer_ids)
        _check_positive("WindowSpec", window=self.window)
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(
                f"WindowSpec.sink_tokens must be an int >= 0, got {self.sink_tokens!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class StateSpec:
    """All state families of one model. At least one of ``kv`` / ``mamba`` is required."""

    page_size: int
    """Tokens per page (KV and INDEXER pages, and the radix tree's key granularity)."""
    kv: KVSpec | None = None
    mamba: MambaSpec | None = None
    indexer: IndexerSpec | None = None
    windows: tuple[WindowSpec, ...] = ()
    """Sliding-window groups among the KV layers (disjoint; empty: every KV layer is full)."""
    model_id: str = ""
    """Required: names the exact weights (part of every storage key). Derive it from a
    checkpoint directory with ``mesh_hicache.identity.checkpoint_model_id(dir)``; it must
    change whenever the cached numbers would (weights, config, dtype, the engine's
    numerics). Leaving it out is a ``ValueError``: a shared default would let two models
    read each other's state."""
    num_layers: int = field(init=False)
    """Derived: the number of model layers (all families' layer ids together)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(
                f"StateSpec.model_id is required (got {self.model_id!r}): pass the identity "
                "of the weights, e.g. model_id=mesh_hicache.identity.checkpoint_model_id("
                "model_dir), or a name you manage that changes whenever the weights do"
            )
        _check_positive("StateSpec", page_size=self.page_size)
        if self.kv is None and self.mamba is None:
            raise ValueError("StateSpec needs kv or mamba (or both); got neither")
        # KV and MAMBA layers may overlap: a parallel layer keeps both (module doc).
        kv_layers = set(self.kv.layer_ids) if self.kv else set()
        mamba_layers = set(self.mamba.layer_ids) if self.mamba else set()
        if self.indexer is not None and not set(self.indexer.layer_ids) <= kv_layers:
            raise ValueError(
                f"StateSpec.indexer.layer_ids {self.indexer.layer_ids} must be attention "
                f"(kv) layers {sorted(kv_layers)}"
            )
        self._check_windows(kv_layers)
        layers = kv_layers | mamba_layers
        if layers != set(range(len(layers))):
            raise ValueError(
                f"StateSpec layer ids {sorted(layers)} must cover range({len(layers)}) exactly"
            )
        object.__setattr__(self, "num_layers", len(layers))

    def _check_windows(self, kv_layers: set[int]) -> None:
        object.__setattr__(self, "windows", tuple(self.windows))
        seen: set[int] = set()
        for group in self.windows:
            if not isinstance(group, WindowSpec):
                raise ValueError(f"StateSpec.windows must hold WindowSpec, got {group!r}")
            ids = set(group.layer_ids)
            if not ids <= kv_layers or (self.kv is not None and self.kv.mla):
                raise ValueError(
                    f"StateSpec.windows layer_ids {group.layer_ids} must be (non-MLA) kv "
                    f"layers {sorted(kv_layers)}"
                )
            if ids & seen:
                raise ValueError(f"StateSpec.windows overlap at {sorted(ids & seen)}")
            seen |= ids

    def layer_window(self, layer_id: int) -> WindowSpec | None:
        """The window group of ``layer_id``; None for a full-attention or SSM layer."""
        for group in self.windows:
            if layer_id in group.layer_ids:
                return group
        return None

    @property
    def window_layer_ids(self) -> tuple[int, ...]:
        """The sliding-window KV layers of every group, increasing (empty without windows)."""
        return tuple(sorted(i for group in self.windows for i in group.layer_ids))

    @property
    def full_kv_layer_ids(self) -> tuple[int, ...]:
        """The full-attention KV layers: ``kv.layer_ids`` without the windowed ones."""
        if self.kv is None:
            return ()
        windowed = set(self.window_layer_ids)
        return tuple(i for i in self.kv.layer_ids if i not in windowed)

    @property
    def families(self) -> tuple[Family, ...]:
        """The families present, in a fixed order (KV, MAMBA, INDEXER)."""
        present = {Family.KV: self.kv, Family.MAMBA: self.mamba, Family.INDEXER: self.indexer}
        return tuple(f for f, s in present.items() if s is not None)

    @property
    def has_mamba(self) -> bool:
        return self.mamba is not None

    def layer_families(self, layer_id: int) -> tuple[Family, ...]:
        """The families ``layer_id`` keeps state in, in the order (KV, MAMBA): one for an
        attention or an SSM layer, both for a parallel layer. ``ValueError`` for a layer
        outside ``range(num_layers)``."""
        out = tuple(
            fam
            for fam, sub in ((Family.KV, self.kv), (Family.MAMBA, self.mamba))
            if sub is not None and layer_id in sub.layer_ids
        )
        if not out:
            raise ValueError(f"layer {layer_id} is not in range({self.num_layers})")
        return out

    def layer_family(self, layer_id: int) -> Family:
        """KV for an attention layer, MAMBA for an SSM layer; ``ValueError`` for a layer in
        both families (use :meth:`layer_families`) or outside ``range(num_layers)``."""
        families = self.layer_families(layer_id)
        if len(families) > 1:
            raise ValueError(
                f"layer {layer_id} is in {[f.value for f in families]}: use layer_families"
            )
        return families[0]

    def check_tp(self, tp: int) -> None:
        """Raise ``ValueError`` unless every family splits (or replicates) evenly over ``tp``."""
        if self.kv is not None and not self.kv.mla:
            heads = self.kv.num_kv_heads
            if heads % tp and tp % heads:
                raise ValueError(
                    f"StateSpec.kv.num_kv_heads={heads} can be neither split over tp={tp} "
                    f"nor replicated evenly (one must divide the other)"
                )
        if self.mamba is not None and self.mamba.num_heads % tp:
            raise ValueError(
                f"StateSpec.mamba.num_heads={self.mamba.num_heads} must be divisible by tp={tp}"
            )
        groups = self.mamba.num_groups if self.mamba is not None else 0
        if groups and groups % tp and tp % groups:
            raise ValueError(
                f"StateSpec.mamba.num_groups={groups} can be neither split over tp={tp} "
                f"nor replicated evenly (one must divide the other)"
            )
