"""vLLM integration: ``MeshHiCacheConnector`` (see docs/vllm.md).

Only ``connector.py`` imports vLLM, and only when the connector is asked for, so the
vLLM-free parts (config, layout, directory, scheduler and worker logic) import without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MeshHiCacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "MeshHiCacheConnector":
        from mesh_hicache.integrations.vllm.connector import MeshHiCacheConnector

        return MeshHiCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
