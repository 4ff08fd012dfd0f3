"""HiCacheConfig: every knob of the cache, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mesh_hicache.choices import (
    Choice,
    CpKvMode,
    PrefetchPolicy,
    StorageKind,
    TransferBackend,
    WritePolicy,
)

#: Reserved in tenants and namespaces: it separates them in the tree's namespace.
TENANT_SEPARATOR = "\x1f"

#: The choice fields and their enums; a plain string is accepted and stored as the member.
_CHOICES: dict[str, type[Choice]] = {
    "write_policy": WritePolicy,
    "prefetch_policy": PrefetchPolicy,
    "storage": StorageKind,
    "cp_kv": CpKvMode,
    "transfer": TransferBackend,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class HiCacheConfig:
    """Configuration of one ``HiCache``; identical on every rank of the mesh.

    Choice fields (``write_policy``, ``prefetch_policy``, ``storage``, ``cp_kv``,
    ``transfer``) take the enum member or its string; after construction they hold the
    member (which still compares equal to the string).
    """

    device_pages: int
    """L1 KV pages per rank (each page holds ``spec.page_size`` tokens of this rank's shard)."""
    device_mamba_slots: int = 0
    """L1 Mamba state slots per rank; 0 = ``max(8, device_pages // 4)`` for hybrid specs."""
    host_pages: int = 0
    """L2 KV pages per rank; 0 = ``host_ratio * device_pages`` (unused without the host tier)."""
    host_ratio: float = 4.0
    """Host pages per device page when ``host_pages`` is 0."""
    host_mamba_slots: int = 0
    """L2 Mamba state slots; 0 = ``host_ratio * device_mamba_slots``."""
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
    layout_version: int = 1
    """Bumped whenever the stored byte layout changes; part of every storage key."""

    def __post_init__(self) -> None:
        if self.device_pages < 1:
            raise ValueError(f"HiCacheConfig.device_pages must be >= 1, got {self.device_pages}")
        for name in ("device_mamba_slots", "host_pages", "host_mamba_slots", "prefetch_threshold"):
            if getattr(self, name) < 0:
                raise ValueError(f"HiCacheConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not isinstance(self.tenant, str) or TENANT_SEPARATOR in self.tenant:
            raise ValueError(
                f"HiCacheConfig.tenant must be a str without {TENANT_SEPARATOR!r}, "
                f"got {self.tenant!r}"
            )
        if self.host_ratio <= 0:
            raise ValueError(f"HiCacheConfig.host_ratio must be > 0, got {self.host_ratio}")
        for name, enum_type in _CHOICES.items():
            member = enum_type.parse(getattr(self, name), f"HiCacheConfig.{name}")
            object.__setattr__(self, name, member)
        if self.storage is not StorageKind.NONE and not self.enable_host:
            raise ValueError(
                f"HiCacheConfig.storage={str(self.storage)!r} needs the host tier "
                "(enable_host=True)"
            )
        if self.write_policy is WritePolicy.WRITE_BACK and not self.enable_host:
            raise ValueError("HiCacheConfig.write_policy='write_back' needs enable_host=True")

    def mamba_device_slots(self) -> int:
        return self.device_mamba_slots or max(8, self.device_pages // 4)

    def num_host_pages(self) -> int:
        return self.host_pages or int(self.host_ratio * self.device_pages)

    def mamba_host_slots(self) -> int:
        return self.host_mamba_slots or int(self.host_ratio * self.mamba_device_slots())
