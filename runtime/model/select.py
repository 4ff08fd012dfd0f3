"""Selections over scores that can tie, with one defined order: the lower index first.

``torch.topk`` keeps *some* of the tied elements at the k-th place, and which ones
depends on the tensor's shape and the kernel: a full prefill (``[T, L]`` scores), a
suffix after a cached prefix (``[1, L]``), a chunk of a batch. A model whose output
depends on that choice gives a cached prefill other logits than a recompute. Every
selection inside the model goes through these functions instead, so the chosen set is a
function of the scores alone.

transformers uses ``torch.topk``: where scores tie at the k-th place the two may keep
different keys (neither is more right; ours is reproducible). Outside ties they agree.
"""

from __future__ import annotations

import torch
from torch import Tensor


def top_k_mask(scores: Tensor, k: int) -> Tensor:
    """Bool of ``scores``' shape: per row (last dim) the ``k`` largest scores, among equal
    scores the lower positions first. ``k`` is clipped to the row length. ``-inf`` scores
    may be chosen when a row has fewer than ``k`` finite ones (mask them after)."""
    k = min(k, scores.shape[-1])
    if k <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    # The k-th largest value is unique whatever topk picks; everything above it is in,
    # and of the values equal to it the first ``k - above`` positions are.
    kth = scores.topk(k, dim=-1).values[..., -1:]
    above = scores > kth
    equal = scores == kth
    need = k - above.sum(dim=-1, keepdim=True)
    return above | (equal & (equal.cumsum(dim=-1) <= need))


def top_k(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, indices) of the ``k`` largest of the last dim, in descending order, equal
    values by ascending index (a stable sort: the same for every batch shape)."""
    order = torch.sort(values, dim=-1, descending=True, stable=True)
    return order.values[..., :k], order.indices[..., :k]
