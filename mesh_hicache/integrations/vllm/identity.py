"""The connector's model identity: what names the exact weights in every storage key."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_CHUNK = 1 << 20


def connector_model_id(model: str, revision: str | None, dtype: object) -> str:
    """A digest of the bytes of every file of the local model directory ``model``, its
    ``revision`` and the serving ``dtype``.

    Two checkpoints with equal configs and sizes but other weights (two fine-tunes of one
    base) get different ids, so their caches never mix. ValueError when ``model`` is not a
    local directory (a hub name alone does not name the weights).
    """
    root = Path(model)
    if not root.is_dir():
        raise ValueError(
            f"MeshHiCacheConnector needs the model as a local directory to name its weights, "
            f"got {model!r}"
        )
    h = hashlib.blake2b(digest_size=20, person=b"mhc-vllm-model")
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = os.fsencode(path.relative_to(root).as_posix())
        h.update(len(rel).to_bytes(8, "little") + rel)
        h.update(path.stat().st_size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                h.update(block)
    h.update(f"|revision={revision or ''}|dtype={dtype}".encode())
    return "weights:" + h.hexdigest()
