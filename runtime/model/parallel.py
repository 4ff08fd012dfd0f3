"""How the model is cut over a ``pp x cp x tp`` mesh, and the collectives it uses.

Pure split functions (shared with the engine): :func:`stage_layer_range` (pp),
:func:`cp_chunk_bounds` (prefill tokens over cp). Which heads, groups and tokens a rank
keeps is ``mesh_hicache.layout``'s math (``tp_split``, ``kv_head_range``,
``ssm_group_range``, ``kv_shard_owner`` / ``kv_shard_positions``), re-exported here, so
the cache, the model and the engine share one source.

:class:`AxisComm` wraps one mesh axis's process group. A group of one rank needs no
communication, so its collectives return their input: the model code calls them
unconditionally and the same code runs on one device (``AxisComm.solo()``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from mesh_hicache.layout import kv_shard_owner, kv_shard_positions, stage_layers
from mesh_hicache.topology import MeshTopology

__all__ = [
    "AxisComm",
    "MeshComms",
    "cp_chunk_bounds",
    "kv_shard_owner",
    "kv_shard_positions",
    "stage_layer_range",
]


def stage_layer_range(num_layers: int, pp: int, stage: int) -> range:
    """Global layer ids of pipeline ``stage`` of ``pp``: the cache's own split
    (``mesh_hicache.layout.stage_layers``), so a stage's model layers and its cache
    pools always hold the same layers."""
    if not 0 < pp <= num_layers:
        raise ValueError(f"pp={pp} must be in [1, num_layers={num_layers}]")
    return stage_layers(num_layers, pp, stage)


def cp_chunk_bounds(num_tokens: int, cp: int) -> list[tuple[int, int]]:
    """Split ``num_tokens`` new tokens into ``cp`` contiguous ``[start, end)`` chunks.

    The first ``num_tokens % cp`` chunks get one token more; with fewer tokens than cp
    the last chunks are empty.
    """
    base, extra = divmod(num_tokens, cp)
    bounds = []
    start = 0
    for c in range(cp):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class AxisComm:
    """Collectives over one mesh axis (a process group), or none for a one-rank axis."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, rank: int) -> None:
        assert group is not None or size == 1
        self.group = group
        self.size = size
        self.rank = rank

    @classmethod
    def solo(cls) -> AxisComm:
        """An axis of one rank: every collective is the identity."""
        return cls(None, 1, 0)

    @classmethod
    def of(cls, topology: MeshTopology, axis: str) -> AxisComm:
        """The axis ``axis`` of ``topology`` (creates its group: collective on every rank)."""
        group = topology.group(axis)
        return cls(group, topology.size(axis), topology.coord(axis))

    def all_reduce(
        self, x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> Tensor:
        """Reduce ``x`` over the axis; returns a new tensor (``x`` is not modified)."""
        if self.size == 1:
            return x
        out = x.contiguous().clone()
        dist.all_reduce(out, op=op, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Stack every rank's ``x`` (same shape on all ranks): ``[size, *x.shape]``."""
        if self.size == 1:
            return x.unsqueeze(0)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    def all_gather_ragged(self, x: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        """Gather ``x`` (dim 0 of length ``lengths[rank]``) from every rank, in rank order.

        ``lengths`` must be known (identically) on every rank; rows are zero-padded to the
        longest (at least 1) for the collective and cut back afterwards.
        """
        assert x.shape[0] == lengths[self.rank]
        if self.size == 1:
            return [x]
        longest = max(max(lengths), 1)
        padded = x.new_zeros((longest, *x.shape[1:]))
        padded[: x.shape[0]] = x
        stacked = self.all_gather(padded)
        return [stacked[r, :n] for r, n in enumerate(lengths)]

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send ``x`` to axis coordinate ``dst``."""
        dist.send(x.contiguous(), group=self.group, group_dst=dst)

    def recv(self, out: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into ``out`` (contiguous, preallocated) from axis coordinate ``src``."""
        dist.recv(out, group=self.group, group_src=src)
        return out

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Broadcast ``x`` (in place on every rank) from axis coordinate ``src``."""
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=src)
        return x


class MeshComms:
    """The three axes the model communicates over. Build with :meth:`from_topology`."""

    def __init__(self, pp: AxisComm, cp: AxisComm, tp: AxisComm) -> None:
        self.pp = pp
        self.cp = cp
        self.tp = tp

    @classmethod
    def solo(cls) -> MeshComms:
        return cls(AxisComm.solo(), AxisComm.solo(), AxisComm.solo())

    @classmethod
    def from_topology(cls, topology: MeshTopology) -> MeshComms:
        """Creates the tp, cp and pp groups, in that order (collective on every rank)."""
        tp = AxisComm.of(topology, "tp")
        cp = AxisComm.of(topology, "cp")
        pp = AxisComm.of(topology, "pp")
        return cls(pp, cp, tp)
