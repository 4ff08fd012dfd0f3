"""The L2 directory: which pages the workers hold in host memory (no vLLM import).

The scheduler owns it and decides every placement and eviction; the workers only apply
the orders (save, prefetch, drop) the scheduler sends with each step, so every tensor-
parallel worker holds the same pages under the same entry ids. LRU by bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class HostEntry:
    """One page held in L2: the objects of the groups in ``held`` (KV groups: the page's
    blocks; state groups: the state at the page's end)."""

    entry_id: int
    page_hash: bytes
    ready: bool
    """False while an L3 prefetch is filling it."""
    from_l3: bool
    """True until its first load: a hit on it counts as an L3 hit."""
    pins: int = 0
    held: set[int] = field(default_factory=set)
    """Group indices whose objects the workers hold (or will, once this step's saves ran)."""


class HostDirectory:
    """``page hash -> HostEntry`` with a capacity in pages; least recently used first out.

    ``capacity`` 0 keeps nothing resident: saves still pass through (for L3) and are dropped
    at once, prefetched pages are held (pinned) only until their load.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()
        self._next_id = 0
        self.dropped: list[int] = []
        """Entry ids evicted since the last ``take_dropped`` (the workers free them)."""

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, page_hash: bytes) -> HostEntry | None:
        return self._entries.get(page_hash)

    def touch(self, page_hash: bytes) -> None:
        if page_hash in self._entries:
            self._entries.move_to_end(page_hash)

    def add(
        self,
        page_hash: bytes,
        *,
        ready: bool,
        from_l3: bool,
        pinned: bool,
        held: set[int] | frozenset[int] = frozenset(),
    ) -> HostEntry:
        """A new entry for ``page_hash`` (which must not be held), evicting LRU unpinned
        entries beyond the capacity."""
        assert page_hash not in self._entries
        entry = HostEntry(self._next_id, page_hash, ready, from_l3, 1 if pinned else 0, set(held))
        self._next_id += 1
        self._entries[page_hash] = entry
        self._shrink()
        return entry

    def can_hold(self, n: int) -> int:
        """How many new pinned pages fit after evicting every unpinned one."""
        if self.capacity == 0:  # no L2: prefetched pages are staged only until their load
            return n
        pinned = sum(1 for e in self._entries.values() if e.pins)
        return min(n, max(0, self.capacity - pinned))

    def pin(self, entry: HostEntry) -> None:
        entry.pins += 1

    def unpin(self, entry: HostEntry) -> None:
        assert entry.pins > 0
        entry.pins -= 1
        self._shrink()

    def remove(self, page_hash: bytes) -> None:
        entry = self._entries.pop(page_hash, None)
        if entry is not None:
            self.dropped.append(entry.entry_id)

    def take_dropped(self) -> list[int]:
        out, self.dropped = self.dropped, []
        return out

    def _shrink(self) -> None:
        excess = len(self._entries) - self.capacity
        if excess <= 0:
            return
        for h in [h for h, e in self._entries.items() if not e.pins][:excess]:
            self.remove(h)
