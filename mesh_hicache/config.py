"""HiCacheConfig: every knob of the cache, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mesh_hicache.choices import (
    Choice,
    CpKvMode,
    EvictionPolicyKind,
    PrefetchPolicy,
    StorageKind,
    TransferBackend,
    WritePolicy,
)
from mesh_hicache.pools.arena import ALIGN as ARENA_ALIGN
from mesh_hicache.radix.eviction import CostModel, EvictionPolicy

#: Reserved in tenants and namespaces: it separates them in the tree's namespace.
TENANT_SEPARATOR = "\x1f"

#: Integer fields that must be >= 0 (``device_pages``/``device_bytes``: one of them > 0).
_COUNTS = (
    "device_pages",
    "device_mamba_slots",
    "device_bytes",
    "host_pages",
    "host_mamba_slots",
    "host_bytes",
    "block_bytes",
    "window_checkpoint_tokens",
)

#: The choice fields and their enums; a plain string is accepted and stored as the member.
_CHOICES: dict[str, type[Choice]] = {
    "write_policy": WritePolicy,
    "prefetch_policy": PrefetchPolicy,
    "storage": StorageKind,
    "cp_kv": CpKvMode,
    "transfer": TransferBackend,
    "eviction_policy": EvictionPolicyKind,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class HiCacheConfig:
    """Configuration of one ``HiCache``; identical on every rank of the mesh.

    Choice fields (``write_policy``, ``prefetch_policy``, ``storage``, ``cp_kv``,
    ``transfer``) take the enum member or its string; after construction they hold the
    member (which still compares equal to the string).
    """

    device_pages: int = 0
    """L1 KV pages per rank (each page holds ``spec.page_size`` tokens of this rank's shard),
    a fixed pool beside a fixed state pool. 0: L1 is a byte budget (``device_bytes``);
    exactly one of the two is given."""
    device_mamba_slots: int = 0
    """L1 Mamba state slots per rank with ``device_pages``; 0 = ``max(8, device_pages // 4)``
    for hybrid specs. Must be 0 with ``device_bytes``."""
    device_bytes: int = 0
    """L1 byte budget per rank: one arena of ``block_bytes`` blocks shared by KV pages and
    recurrent states, whose split follows the workload (docs/DESIGN.md section 7). The
    block count is derived from mesh-agreed page/state sizes, equal on every rank."""
    host_pages: int = 0
    """L2 KV pages per rank (a fixed pool); 0 = ``host_ratio * device_pages``, or an arena of
    ``host_ratio * device_bytes`` when L1 is a byte budget (unused without the host tier)."""
    host_ratio: float = 4.0
    """L2 size per L1 size (pages, slots or bytes) when L2 is not given."""
    host_mamba_slots: int = 0
    """L2 Mamba state slots with a fixed L2; 0 = ``host_ratio * device_mamba_slots``."""
    host_bytes: int = 0
    """L2 byte budget per rank: one arena like ``device_bytes``. Excludes ``host_pages`` and
    ``host_mamba_slots``."""
    block_bytes: int = 0
    """Arena block size in bytes (a multiple of 16); 0 = derived from the page and state
    sizes (rounding waste <= 1/32). Only with ``device_bytes`` or ``host_bytes``."""
    enable_host: bool = True
    """False: L1 only (a plain radix cache); storage then needs the host tier and is refused."""
    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    """When device pages are copied to host: ``write_through`` (on insert),
    ``write_through_selective`` (on a node's second hit) or ``write_back`` (on eviction)."""
    storage: StorageKind | str = StorageKind.NONE
    """L3 backend: ``none``, ``file`` (embedded default) or ``mooncake``."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the backend (``root`` for file; master address etc. for mooncake)."""
    prefetch_threshold: int = 256
    """Prefetch from L3 only when the agreed L3 hit beyond L1/L2 is at least this many tokens."""
    prefetch_policy: PrefetchPolicy | str = PrefetchPolicy.WAIT_COMPLETE
    """When a prefetch stops: ``best_effort`` (take what arrived when the request is
    scheduled), ``wait_complete`` or ``timeout``."""
    prefetch_timeout_base_s: float = 1.0
    """``timeout`` policy: base seconds to wait."""
    prefetch_timeout_per_1k_s: float = 0.5
    """``timeout`` policy: extra seconds per 1,000 prefetched tokens."""
    cp_kv: CpKvMode | str = CpKvMode.REPLICATE
    """CP KV placement: ``replicate`` (full pages on every CP rank) or ``shard``."""
    transfer: TransferBackend | str = TransferBackend.AUTO
    """Transfer engine: ``auto`` (cuda when available), ``cpu`` or ``cuda``."""
    tenant: str = ""
    """The default tenant of this cache's requests (``HiCache.match(..., tenant=)`` may name
    another). It namespaces the tree (L1/L2: tenants never share a node) and every page
    hash, and is part of every storage key (L3): tenants never read each other's entries.
    Any string without the reserved character ``"\x1f"``."""
    window_checkpoint_tokens: int = 2048
    """Sliding-window models: L2 and L3 keep a windowed layer's K/V page only where a
    resume needs it, i.e. within the window before each backed-up node's end and before
    every multiple of this many tokens. A hit from L2 or L3 can then end up to this many
    tokens before the full-attention match (at a boundary whose window was not kept).
    0 keeps every page. A multiple of the page size (checked when the cache is built)."""
    layout_version: int = 1
    """Bumped whenever the stored byte layout changes; part of every storage key."""
    eviction_policy: EvictionPolicyKind | str | EvictionPolicy = EvictionPolicyKind.LRU
    """How the tree ranks eviction victims: ``lru`` (default), ``cost`` (the FLOPs a hit
    saves per byte, decaying exponentially with age; ``radix.eviction.DecayCostPolicy``,
    docs/DESIGN.md section 5; ahead of LRU in 6 of the 9 replayed cells, behind in 3 and on
    the main job, so opt-in), ``adaptive`` and ``reuse`` (``cost`` with a learnt horizon,
    and a learnt reuse probability; ``radix.adaptive`` / ``radix.reuse``), or a stateless
    ``EvictionPolicy`` instance (the benchmarks' baselines, ``scripts/baseline_policies.py``)."""
    collective_timeout_s: float = 60.0
    """Seconds within which a cache agreement fails on every rank when a rank of the mesh
    does not join it (it called another cache operation, none, or is dead or frozen); the
    same default bound as the bundled runtime's ``--collective-timeout-s``. On a CPU (gloo)
    mesh of several ranks the cache agrees over its own group with this bound; on CUDA the
    mesh's NCCL group and its timeout are used."""
    cost_model: CostModel | None = None
    """Bytes per KV token and per state, FLOPs per token and per key for ``cost``;
    None = ``CostModel.from_spec`` (rough). The runtime passes its model's numbers."""

    def __post_init__(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"HiCacheConfig.{name} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"HiCacheConfig.{name} must be >= 0, got {value}")
        if self.prefetch_threshold < 0:
            raise ValueError(
                f"HiCacheConfig.prefetch_threshold must be >= 0, got {self.prefetch_threshold}"
            )
        if not isinstance(self.tenant, str) or TENANT_SEPARATOR in self.tenant:
            raise ValueError(
                f"HiCacheConfig.tenant must be a str without {TENANT_SEPARATOR!r}, "
                f"got {self.tenant!r}"
            )
        timeout = self.collective_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < float("inf")
        ):
            raise ValueError(
                f"HiCacheConfig.collective_timeout_s must be a number of seconds > 0, "
                f"got {timeout!r}"
            )
        if self.host_ratio <= 0:
            raise ValueError(f"HiCacheConfig.host_ratio must be > 0, got {self.host_ratio}")
        self._check_budgets()
        for name, enum_type in _CHOICES.items():
            if name == "eviction_policy" and isinstance(self.eviction_policy, EvictionPolicy):
                continue
            member = enum_type.parse(getattr(self, name), f"HiCacheConfig.{name}")
            object.__setattr__(self, name, member)
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            raise TypeError(
                f"HiCacheConfig.cost_model must be a CostModel or None, got {self.cost_model!r}"
            )
        if self.storage is not StorageKind.NONE and not self.enable_host:
            raise ValueError(
                f"HiCacheConfig.storage={str(self.storage)!r} needs the host tier "
                "(enable_host=True)"
            )
        if self.write_policy is WritePolicy.WRITE_BACK and not self.enable_host:
            raise ValueError("HiCacheConfig.write_policy='write_back' needs enable_host=True")

    def _check_budgets(self) -> None:
        if (self.device_pages > 0) == (self.device_bytes > 0):
            raise ValueError(
                "HiCacheConfig needs exactly one of device_pages (>= 1) and device_bytes (> 0), "
                f"got device_pages={self.device_pages}, device_bytes={self.device_bytes}"
            )
        if self.device_bytes and self.device_mamba_slots:
            raise ValueError(
                f"HiCacheConfig.device_mamba_slots={self.device_mamba_slots} is fixed-pool only: "
                f"with device_bytes={self.device_bytes} pages and states share one arena"
            )
        if self.host_bytes and (self.host_pages or self.host_mamba_slots):
            raise ValueError(
                f"HiCacheConfig.host_bytes={self.host_bytes} excludes host_pages="
                f"{self.host_pages} and host_mamba_slots={self.host_mamba_slots}"
            )
        if self.block_bytes % ARENA_ALIGN:
            raise ValueError(
                f"HiCacheConfig.block_bytes must be a multiple of {ARENA_ALIGN}, "
                f"got {self.block_bytes}"
            )
        if self.block_bytes and not (self.device_bytes or self.host_arena_bytes()):
            raise ValueError(
                f"HiCacheConfig.block_bytes={self.block_bytes} needs device_bytes or host_bytes"
            )

    def mamba_device_slots(self) -> int:
        """Fixed L1 state slots (0 when L1 is an arena)."""
        if self.device_bytes:
            return 0
        return self.device_mamba_slots or max(8, self.device_pages // 4)

    def num_host_pages(self) -> int:
        """Fixed L2 pages (0 when L2 is an arena)."""
        if self.host_arena_bytes():
            return 0
        return self.host_pages or int(self.host_ratio * self.device_pages)

    def mamba_host_slots(self) -> int:
        """Fixed L2 state slots (0 when L2 is an arena)."""
        if self.host_arena_bytes():
            return 0
        return self.host_mamba_slots or int(self.host_ratio * self.mamba_device_slots())

    def host_arena_bytes(self) -> int:
        """L2 arena budget per rank: ``host_bytes``, else ``host_ratio * device_bytes``
        when L1 is an arena and L2 has no fixed size; 0 for a fixed L2."""
        if self.host_bytes:
            return self.host_bytes
        if self.device_bytes and not self.host_pages:
            return int(self.host_ratio * self.device_bytes)
        return 0
