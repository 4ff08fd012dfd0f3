"""The connector's model identity: what names the exact weights in every storage key."""

from __future__ import annotations

from pathlib import Path

from mesh_hicache.identity import checkpoint_model_id


def connector_model_id(model: str, revision: str | None, dtype: object) -> str:
    """:func:`~mesh_hicache.identity.checkpoint_model_id` of the local model directory
    ``model`` with vLLM's ``revision`` and serving ``dtype`` as extras.

    Two checkpoints with equal configs and sizes but other weights (two fine-tunes of one
    base) get different ids, so their caches never mix. ValueError when ``model`` is not a
    local directory (a hub name alone does not name the weights).
    """
    if not Path(model).is_dir():
        raise ValueError(
            f"MeshHiCacheConnector needs the model as a local directory to name its weights, "
            f"got {model!r}"
        )
    extra = {"engine": "vllm", "revision": revision or "", "dtype": str(dtype)}
    return checkpoint_model_id(model, extra=extra)
