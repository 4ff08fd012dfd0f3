"""Contiguous shard math over pp, tp and cp, shared by the cache, the model and the engine.

Pure functions of sizes and a coordinate (no mesh, no process group): the layer range of
a pipeline stage, a tp rank's share of heads or channels, and the token-in-page range a
cp rank keeps under ``cp_kv="shard"``. :mod:`mesh_hicache.layout` derives region shapes
from them and the runtime's model splits its weights with the same functions, so the two
can never disagree on who holds what.
"""

from __future__ import annotations

import torch

from mesh_hicache.choices import CpKvMode
from mesh_hicache.spec import MambaSpec


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Model layers of pipeline ``stage``: contiguous, sizes differ by at most one.

    The first ``num_layers % pp`` stages get one extra layer.
    """
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not in range(pp={pp})")
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def tp_split(total: int, tp: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous ``[start, stop)`` of ``total`` items split evenly over tp."""
    if total % tp:
        raise ValueError(f"{total} items cannot be split evenly over tp={tp}")
    n = total // tp
    return (rank * n, (rank + 1) * n)


def kv_head_range(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """KV heads a tp rank holds: its share, or (kv_heads < tp) the one its query heads read."""
    if num_kv_heads >= tp:
        return tp_split(num_kv_heads, tp, rank)
    q0 = tp_split(num_heads, tp, rank)[0]
    k0 = q0 // (num_heads // num_kv_heads)
    return (k0, k0 + 1)


def ssm_group_range(num_groups: int, tp: int, rank: int) -> tuple[int, int]:
    """B/C groups a tp rank holds: its share (groups >= tp) or the one group of its heads."""
    if num_groups >= tp:
        return tp_split(num_groups, tp, rank)
    g = rank // (tp // num_groups)
    return (g, g + 1)


def mamba_local_conv_dim(mamba: MambaSpec, tp: int) -> int:
    """Conv channels on one tp rank (a replicated group's B and C count on every rank)."""
    if mamba.num_groups and mamba.num_groups < tp:
        return mamba.num_heads // tp * mamba.head_dim + 2 * mamba.state_dim
    return mamba.conv_dim // tp


def kv_shard_owner(positions: torch.Tensor, page_size: int, cp: int) -> torch.Tensor:
    """The cp rank that keeps each position under ``cp_kv="shard"``.

    Rank c keeps the tokens whose position-in-page lies in ``[c*ps/cp, (c+1)*ps/cp)``.
    """
    assert page_size % cp == 0
    return (positions % page_size) // (page_size // cp)


def kv_page_tokens(page_size: int, cp: int, cp_rank: int, cp_kv: CpKvMode | str) -> tuple[int, int]:
    """The token-in-page range ``[start, stop)`` a cp rank keeps of every KV page."""
    if CpKvMode.parse(cp_kv, "cp_kv") is CpKvMode.SHARD:
        n = page_size // cp
        return (cp_rank * n, (cp_rank + 1) * n)
    return (0, page_size)


def kv_shard_positions(num_tokens: int, page_size: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Positions in ``[0, num_tokens)`` kept by ``cp_rank`` under ``cp_kv="shard"``, ascending."""
    positions = torch.arange(num_tokens)
    return positions[kv_shard_owner(positions, page_size, cp) == cp_rank]
