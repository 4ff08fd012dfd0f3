"""Cross-rank agreement over a sub-mesh (docs/DESIGN.md section 7).

Every decision that depends on rank-local state is made as reserve -> agree -> commit
or abort. ``Consensus`` is the "agree" step: each call is exactly one collective on its
group, issued unconditionally, so every rank must make the same sequence of calls with
lists of the same length (that is the protocol, and it is what keeps NCCL/gloo from
hanging). A group of one rank agrees with itself without a collective.

A background thread must not share a group with the main thread: give it its own
``Consensus`` built on ``MeshTopology.new_group(..., backend="gloo")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mesh_hicache.topology import AxisLike, MeshTopology


class Consensus:
    """Agree on small integer values across one process group.

    ``device`` is where the reduction buffer lives: ``cpu`` for gloo, the rank's CUDA
    device for NCCL. All methods return the same value on every rank of the group.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device | str = "cpu") -> None:
        self.group = group
        self.device = torch.device(device)
        self.num_ranks = dist.get_world_size(group)
        #: Number of collectives issued so far (tests compare it across ranks).
        self.num_calls = 0

    @classmethod
    def over(cls, topology: MeshTopology, *axes: AxisLike, background: bool = False) -> Consensus:
        """A consensus over ``axes`` of ``topology``.

        ``background=True`` creates a dedicated gloo group (collective on all ranks) for
        use from a thread other than the one doing the model's collectives.
        """
        if background:
            return cls(topology.new_group(*axes, backend="gloo"), "cpu")
        device = torch.device("cpu")
        if topology.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(topology.group(*axes), device)

    def min_list(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum of ``values`` over the group, in one collective."""
        return self._reduce(list(values), dist.ReduceOp.MIN)

    def max_list(self, values: Sequence[int]) -> list[int]:
        """Element-wise maximum of ``values`` over the group, in one collective."""
        return self._reduce(list(values), dist.ReduceOp.MAX)

    def min(self, value: int) -> int:
        return self.min_list([value])[0]

    def max(self, value: int) -> int:
        return self.max_list([value])[0]

    def all_true(self, flag: bool) -> bool:
        """True iff ``flag`` is true on every rank."""
        return bool(self.min(int(bool(flag))))

    def any_true(self, flag: bool) -> bool:
        """True iff ``flag`` is true on some rank."""
        return bool(self.max(int(bool(flag))))

    def min_max(self, values: Sequence[int]) -> tuple[list[int], list[int]]:
        """Element-wise (min, max) of ``values`` in one collective (max = -min(-x))."""
        vals = list(values)
        both = self._reduce(vals + [-v for v in vals], dist.ReduceOp.MIN)
        n = len(vals)
        return both[:n], [-v for v in both[n:]]

    def _reduce(self, values: list[int], op: Any) -> list[int]:
        self.num_calls += 1
        if self.num_ranks == 1 or not values:
            # Lengths are protocol-fixed, so an empty list is empty on every rank.
            return values
        buf = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(buf, op=op, group=self.group)
        return [int(v) for v in buf.tolist()]
