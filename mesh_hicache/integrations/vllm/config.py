"""The connector's settings, read from vLLM's ``kv_connector_extra_config`` (no vLLM import).

Keys (all optional but one of ``storage_root`` / ``storage``):

- ``storage_root``: directory of the file L3 store (shared by every engine that should
  share cached prefixes).
- ``storage``: ``"file"`` (default when ``storage_root`` is set) or ``"mooncake"``; with
  ``"mooncake"``, ``master`` is the master's ``host:port`` and ``mooncake`` an optional dict
  of further ``MooncakeStorage`` keyword arguments.
- ``host_bytes``: the L2 budget in bytes per worker (0: no L2, pages go straight to L3).
- ``storage_secret_file``: a file holding the storage secret (objects carry a keyed MAC;
  an object that does not verify is a miss).
- ``tenant``: the default tenant; a request's ``cache_salt`` overrides it.
- ``write_policy``: ``write_through`` (L3 written when a request's pages are saved) or
  ``write_back`` (L3 written when L2 evicts a page; with no L2, at save time).
- ``prefetch_threshold``: the fewest tokens an L3 hit beyond L2 must bring for the
  connector to read it (shorter hits are recomputed).
- ``stats_file``: a JSON file the connector rewrites with its counters (tokens per tier).
- ``layout_version``: bump to invalidate everything stored (default 1).
- ``layerwise_load``: copy loaded KV pages into vLLM's blocks layer by layer on a
  background thread while the forward runs, each attention layer waiting only for its
  own (default true); false copies every layer before the forward starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

WRITE_POLICIES = ("write_through", "write_back")
KNOWN_KEYS = frozenset(
    {
        "storage_root",
        "storage",
        "master",
        "mooncake",
        "host_bytes",
        "storage_secret_file",
        "tenant",
        "write_policy",
        "prefetch_threshold",
        "stats_file",
        "layout_version",
        "layerwise_load",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorConfig:
    """The validated extra config of one connector."""

    storage: str
    """``"file"`` or ``"mooncake"``."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the backend (``root`` or ``master_address`` ...)."""
    host_bytes: int = 1 << 30
    """L2 budget in bytes per worker; 0 = no L2."""
    secret_file: str | None = None
    """Storage secret file, or None (CRC only)."""
    tenant: str = ""
    """Default tenant of requests without a ``cache_salt``."""
    write_policy: str = "write_through"
    """When L3 is written: ``write_through`` or ``write_back``."""
    prefetch_threshold: int = 0
    """Fewest tokens an L3 read must bring."""
    stats_file: str | None = None
    """Where the counters are written as JSON, or None."""
    layout_version: int = 1
    """Enters every key's namespace."""
    layerwise_load: bool = True
    """KV loads overlap the forward, layer by layer."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Validate ``kv_connector_extra_config``; ValueError names a bad key or value."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - KNOWN_KEYS)
        if unknown:
            raise ValueError(
                f"unknown MeshHiCacheConnector extra config keys {unknown}; "
                f"valid: {sorted(KNOWN_KEYS)}"
            )
        storage = extra.get("storage", "file")
        if storage == "file":
            root = extra.get("storage_root")
            if not isinstance(root, str) or not root:
                raise ValueError(
                    f"MeshHiCacheConnector needs 'storage_root' (a directory) for the file "
                    f"store, got {root!r}"
                )
            options: dict[str, Any] = {"root": root}
        elif storage == "mooncake":
            master = extra.get("master")
            if not isinstance(master, str) or ":" not in master:
                raise ValueError(f"storage 'mooncake' needs 'master' as host:port, got {master!r}")
            options = {"master_address": master, **dict(extra.get("mooncake") or {})}
        else:
            raise ValueError(f"storage must be 'file' or 'mooncake', got {storage!r}")
        host_bytes = extra.get("host_bytes", 1 << 30)
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 0:
            raise ValueError(f"host_bytes must be an int >= 0, got {host_bytes!r}")
        policy = extra.get("write_policy", "write_through")
        if policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {policy!r}")
        threshold = extra.get("prefetch_threshold", 0)
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"prefetch_threshold must be an int >= 0, got {threshold!r}")
        tenant = extra.get("tenant", "")
        if not isinstance(tenant, str):
            raise ValueError(f"tenant must be a str, got {tenant!r}")
        version = extra.get("layout_version", 1)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"layout_version must be an int >= 0, got {version!r}")
        secret_file = extra.get("storage_secret_file")
        if secret_file is not None and not isinstance(secret_file, str):
            raise ValueError(f"storage_secret_file must be a path, got {secret_file!r}")
        stats_file = extra.get("stats_file")
        if stats_file is not None and not isinstance(stats_file, str):
            raise ValueError(f"stats_file must be a path, got {stats_file!r}")
        layerwise = extra.get("layerwise_load", True)
        if not isinstance(layerwise, bool):
            raise ValueError(f"layerwise_load must be true or false, got {layerwise!r}")
        return cls(
            storage=storage,
            storage_options=options,
            host_bytes=host_bytes,
            secret_file=secret_file,
            tenant=tenant,
            write_policy=policy,
            prefetch_threshold=threshold,
            stats_file=stats_file,
            layout_version=version,
            layerwise_load=layerwise,
        )
