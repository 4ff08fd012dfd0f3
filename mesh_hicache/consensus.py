"""Cross-rank agreement over a sub-mesh (docs/DESIGN.md section 7).

Every decision that depends on rank-local state is made as reserve -> agree -> commit
or abort. ``Consensus`` is the "agree" step: each call is exactly one collective on its
group, issued unconditionally, so every rank must make the same sequence of calls with
lists of the same length (that is the protocol, and it is what keeps NCCL/gloo from
hanging). A group of one rank agrees with itself without a collective.

A background thread must not share a group with the main thread: give it its own
``Consensus`` built on ``MeshTopology.new_group(..., backend="gloo")``.

Ranks that disagree are named, not hung. A caller that drives the group through
operations (``HiCache``'s public calls) opens each with :meth:`Consensus.enter`: one
small collective of a fixed size carrying the operation's name (as a code) and its
sequence number. When they differ anywhere, every rank gathers the names and raises one
:class:`RanksDisagree` naming each rank's operation (gloo would otherwise abort the
process on a size mismatch, or pair unrelated calls silently). Each agreement inside an
operation carries the operation code and its own sequence number in the same buffer as
its values (no extra collective), so a rank that took another path inside an operation
is named too. A collective that fails (a rank that never arrives within the group's
timeout, a closed connection) raises :class:`CollectiveTimeout` naming the operation,
the sequence number and the bound.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mesh_hicache.topology import AxisLike, MeshTopology


class RanksDisagree(RuntimeError):
    """The ranks of a group called different agreements (operation or sequence number)."""


class CollectiveTimeout(RuntimeError):
    """An agreement failed: a rank did not arrive within the bound, or its connection
    closed (it called nothing, is dead, or is frozen)."""


def _op_code(name: str) -> int:
    return zlib.crc32(name.encode())


class Consensus:
    """Agree on small integer values across one process group.

    ``device`` is where the reduction buffer lives: ``cpu`` for gloo, the rank's CUDA
    device for NCCL. All methods return the same value on every rank of the group.
    ``timeout_s``: the group's collective timeout, quoted in errors (None: unknown).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device | str = "cpu",
        timeout_s: float | None = None,
    ) -> None:
        self.group = group
        self.device = torch.device(device)
        self.num_ranks = dist.get_world_size(group)
        self.timeout_s = timeout_s
        #: Number of collectives issued so far (tests compare it across ranks).
        self.num_calls = 0
        self._held: torch.Tensor | None = None
        #: Operations opened with :meth:`enter` so far.
        self.num_entries = 0
        #: The operation the next agreements serve (named in errors; :meth:`during`).
        self.operation = "agree"

    @classmethod
    def over(
        cls,
        topology: MeshTopology,
        *axes: AxisLike,
        background: bool = False,
        timeout_s: float | None = None,
    ) -> Consensus:
        """A consensus over ``axes`` of ``topology``.

        ``background=True`` creates a dedicated gloo group (collective on all ranks) for
        use from a thread other than the one doing the model's collectives. ``timeout_s``
        on a CPU mesh of several ranks also creates a dedicated gloo group (collective on
        all ranks) whose collectives fail after a bound chosen so that a missing rank is
        reported within ``timeout_s`` (gloo notices a silent peer up to about two of its
        timeouts after the wait began, so the group gets 0.45 of it). On CUDA the
        mesh's own (NCCL) group is used and its timeout applies.
        """
        bound = None if timeout_s is None else timedelta(seconds=0.45 * timeout_s)
        if background:
            return cls(topology.new_group(*axes, backend="gloo", timeout=bound), "cpu", timeout_s)
        if topology.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
            return cls(topology.group(*axes), device)
        group = topology.group(*axes)
        if bound is not None and dist.get_world_size(group) > 1:
            group = topology.new_group(*axes, backend="gloo", timeout=bound)
        return cls(group, "cpu", timeout_s)

    @contextlib.contextmanager
    def during(self, operation: str) -> Iterator[None]:
        """Name the agreements issued inside the block ``operation`` (restored after)."""
        outer, self.operation = self.operation, operation
        try:
            yield
        finally:
            self.operation = outer

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

    def enter(self, operation: str) -> None:
        """Open ``operation`` (named by :meth:`during` too) on every rank: one fixed-size
        collective; ``RanksDisagree`` on every rank when a rank entered another operation
        or another number of operations; ``CollectiveTimeout`` when one never enters."""
        self.operation = operation
        self.num_entries += 1
        if self.num_ranks == 1:
            return
        code, seq = _op_code(operation), self.num_entries
        head = self._all_reduce([code, -code, seq, -seq], dist.ReduceOp.MIN)
        if head != [code, -code, seq, -seq]:
            self._raise_disagreement()

    def _reduce(self, values: list[int], op: Any) -> list[int]:
        self.num_calls += 1
        if self.num_ranks == 1:
            return values
        # Everything as a MIN (max = -min(-x)), behind a header of the operation code and
        # this agreement's number: one collective, and a disagreement shows in the header.
        sign = -1 if op == dist.ReduceOp.MAX else 1
        code, seq = _op_code(self.operation), self.num_calls
        head = [code, -code, seq, -seq]
        out = self._all_reduce(head + [sign * v for v in values], dist.ReduceOp.MIN)
        if out[:4] != head:
            self._raise_disagreement()
        return [sign * v for v in out[4:]]

    def _all_reduce(self, values: list[int], op: Any) -> list[int]:
        buf = torch.tensor(values, dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(buf, op=op, group=self.group)
        except (RuntimeError, dist.DistError) as err:
            raise CollectiveTimeout(self._timeout_message(err)) from err
        # Keep the buffer until the next agreement: gloo's worker thread drops its own
        # reference to it just after the call returns, and if that drop were the last one
        # it would need the GIL; in a process that is exiting that aborts (SIGABRT). Held
        # here, the last reference is always dropped by this thread.
        self._held = buf
        return [int(v) for v in buf.tolist()]

    def _where(self) -> str:
        return f"{self.operation} (operation #{self.num_entries}, agreement #{self.num_calls})"

    def _timeout_message(self, err: BaseException) -> str:
        bound = "" if self.timeout_s is None else f" within {self.timeout_s:g} s"
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        me = dist.get_rank()
        ranks = dist.get_process_group_ranks(self.group)
        return (
            f"{self._where()} on rank {me}: not every rank of {ranks} joined it{bound} "
            f"(a rank called no agreement, or is dead or frozen): {first}"
        )

    def _raise_disagreement(self) -> None:
        mine = (dist.get_rank(), self.operation, self.num_entries, self.num_calls)
        seen: list[Any] = [None] * self.num_ranks
        try:
            dist.all_gather_object(seen, mine, group=self.group)
        except (RuntimeError, dist.DistError) as err:
            raise CollectiveTimeout(self._timeout_message(err)) from err
        parts = ", ".join(
            f"rank {r} in {op} (operation #{n}, agreement #{seq})" for r, op, n, seq in seen
        )
        raise RanksDisagree(
            f"ranks called different cache operations: {parts}; every rank must make the "
            "same cache calls in the same order"
        )
