"""The tiny hybrid model (attention + Mamba-2 style SSM layers) with TP / CP / PP.

Public API::

    config = preset("tiny")                       # or ModelConfig(...)
    model = HybridModel(config, topology, cp_kv="replicate", page_size=16)
    state = model.new_state()                     # or built from cached pages
    logits = model.prefill(tokens, state)         # float32 [vocab], same on every rank
    logits = model.decode(token, state)
    logits = model.decode_batch([t1, t2], [state1, state2])  # [B, vocab]
    state = model.paged_state(pools, pages, num_tokens, slot=slot)  # attention on L1 pages
"""

from __future__ import annotations

from runtime.model.config import PRESETS, ModelConfig, preset
from runtime.model.hybrid import HybridModel
from runtime.model.parallel import (
    cp_chunk_bounds,
    kv_shard_owner,
    kv_shard_positions,
    stage_layer_range,
)
from runtime.model.state import PageTable, SeqState

__all__ = [
    "PRESETS",
    "HybridModel",
    "ModelConfig",
    "PageTable",
    "SeqState",
    "cp_chunk_bounds",
    "kv_shard_owner",
    "kv_shard_positions",
    "preset",
    "stage_layer_range",
]
