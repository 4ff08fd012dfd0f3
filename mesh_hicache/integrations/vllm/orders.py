"""What the scheduler side tells the workers each step, and what they report back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PageOrder:
    """One page: its L2 entry, hash, tenant, the vLLM block id of each group (loads and
    saves; empty for prefetches) and which groups (indices) the order concerns."""

    entry_id: int
    page_hash: bytes
    tenant: str
    block_ids: tuple[int, ...] = ()
    groups: tuple[int, ...] = ()


@dataclass(slots=True)
class StepOrders:
    """The orders of one step, applied by every worker in this order: saves, loads, drops
    (before the forward), state saves (after it); prefetches run in the background."""

    saves: list[PageOrder] = field(default_factory=list)
    save_request_ids: list[str] = field(default_factory=list)
    """Requests whose blocks vLLM holds until the saves above are copied."""
    write_l3: bool = True
    """Saves go to L3 now (write_through, or no L2)."""
    loads: list[PageOrder] = field(default_factory=list)
    drops: list[int] = field(default_factory=list)
    drops_to_l3: bool = False
    """Write dropped entries to L3 first (write_back)."""
    prefetches: list[PageOrder] = field(default_factory=list)
    state_saves: list[PageOrder] = field(default_factory=list)
    """Boundary states vLLM writes in this step's forward: copied after it
    (``wait_for_save``), before vLLM may reuse their blocks."""

    def empty(self) -> bool:
        return not (self.saves or self.loads or self.drops or self.prefetches or self.state_saves)


@dataclass(slots=True)
class WorkerReport:
    """Finished prefetches of one or more workers: entry id -> one ok flag per worker."""

    prefetched: dict[int, list[bool]] = field(default_factory=dict)

    def merge(self, other: WorkerReport) -> WorkerReport:
        out = {k: list(v) for k, v in self.prefetched.items()}
        for k, v in other.prefetched.items():
            out.setdefault(k, []).extend(v)
        return WorkerReport(out)
