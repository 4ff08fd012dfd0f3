"""Every model family the runtime serves, built once, for the split-prefill property tests.

``FAMILIES``: the seeded presets (``tiny``, ``small``) and one tiny random checkpoint of
every architecture ``runtime.checkpoints`` reads (built by transformers, no download),
plus ``deepseek_ties``: DeepSeek-V3.2 with a single indexer head. With one head a key's
score is ``w * relu(q . k)``: every key the relu cuts scores exactly 0, and for a query
whose head weight ``w`` is negative the zeros are the best scores, so the top-k place is
decided among dozens of tied keys (``count_kth_ties`` counts them). torch's ``topk``
breaks such ties differently for a ``[T, L]`` and a ``[1, L]`` score matrix.
"""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.checkpoints import load_checkpoint
from runtime.model import HybridModel
from runtime.model.config import preset
from tests import (
    checkpoint_cases,
    deepseek_cases,
    falcon_h1_cases,
    jamba_cases,
    lfm2_cases,
    qwen_cases,
    window_cases,
)

PAGE = 16
FAMILIES = (
    "tiny",
    "small",
    *checkpoint_cases.CASES,
    *checkpoint_cases.DENSE_CASES,
    *qwen_cases.CASES,
    *window_cases.CASES,
    *jamba_cases.CASES,
    *lfm2_cases.CASES,
    *falcon_h1_cases.CASES,
    "deepseek_v32",
    "deepseek_ties",
)


def build_family(name: str, root: Path) -> tuple[HybridModel, Path | None]:
    """(the model on one rank, its checkpoint directory or None for a preset)."""
    if name in ("tiny", "small"):
        return HybridModel(preset(name), page_size=PAGE), None
    if name in checkpoint_cases.CASES + checkpoint_cases.DENSE_CASES:
        directory = checkpoint_cases.build(name, root)
    elif name in qwen_cases.CASES:
        directory = qwen_cases.build(name, root)
    elif name in window_cases.CASES:
        directory = window_cases.build(name, root)
    elif name in jamba_cases.CASES:
        directory = jamba_cases.build(name, root)
    elif name in lfm2_cases.CASES:
        directory = lfm2_cases.build(name, root)
    elif name in falcon_h1_cases.CASES:
        directory = falcon_h1_cases.build(name, root)
    elif name == "deepseek_v32":
        directory = deepseek_cases.build(root)
    else:
        assert name == "deepseek_ties", name
        directory = deepseek_cases.build(root, name=name, index_n_heads=1)
    ckpt = load_checkpoint(directory)
    return HybridModel(ckpt.config, weights=ckpt.weights, page_size=PAGE), directory


def count_kth_ties(model: HybridModel, ids: torch.Tensor) -> int:
    """Rows (query, indexer layer) of a full prefill of ``ids`` whose k-th best indexer
    score equals the (k+1)-th: where ``topk`` must choose among equal keys."""
    ties = 0
    layers = [b.mixer for b in model.blocks if hasattr(b.mixer, "_select")]
    originals = {id(m): m._select for m in layers}

    def counting(layer, q_idx, w_idx, k_idx, q_pos):
        nonlocal ties
        scores = torch.matmul(q_idx.float(), k_idx.float().T).relu_()
        index = torch.matmul(w_idx.unsqueeze(-2), scores).squeeze(-2)
        causal = torch.arange(k_idx.shape[0])[None, :] <= q_pos[:, None]
        index = index.masked_fill(~causal, float("-inf"))
        k = layer.topk
        if index.shape[-1] > k:
            top = index.topk(k + 1, dim=-1).values
            ties += int(((top[:, k - 1] == top[:, k]) & causal.sum(-1).gt(k)).sum())
        return originals[id(layer)](q_idx, w_idx, k_idx, q_pos)

    for m in layers:
        m._select = lambda *a, _m=m: counting(_m, *a)  # type: ignore[method-assign]
    try:
        model.prefill(ids, model.new_state())
    finally:
        for m in layers:
            del m._select
    return ties
