"""PageAllocator: deterministic index allocation for device pages, host pages and slots.

Trees and host indices must be identical on every rank (docs/DESIGN.md section 4), so the
allocator is a pure function of its call sequence: ``allocate`` always returns the lowest
free indices, in increasing order. Ranks that make the same calls get the same indices.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class PageAllocator:
    """Hands out indices in ``range(capacity)``; not thread-safe (one owner thread).

    ``allocate(n)`` returns the ``n`` lowest free indices (increasing) or raises
    ``RuntimeError`` if fewer than ``n`` are free (nothing is taken then). ``free`` returns
    indices; freeing an index that is free already (double free) or outside the range
    (foreign) raises ``ValueError`` and frees none of the given indices.
    """

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be a non-negative int, got {capacity!r}")
        self._capacity = capacity
        self._free_heap = list(range(capacity))  # sorted, hence a valid heap
        self._is_free = bytearray(b"\x01") * capacity

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    @property
    def num_used(self) -> int:
        return self._capacity - len(self._free_heap)

    def is_free(self, index: int) -> bool:
        self._check_range(index)
        return bool(self._is_free[index])

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free_heap)

    def allocate(self, n: int) -> list[int]:
        """Take the ``n`` lowest free indices; ``RuntimeError`` if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative count {n}")
        if n > len(self._free_heap):
            raise RuntimeError(
                f"cannot allocate {n} of capacity {self._capacity}: only {self.num_free} free"
            )
        out = [heapq.heappop(self._free_heap) for _ in range(n)]
        for i in out:
            self._is_free[i] = 0
        return out

    def free(self, indices: Iterable[int]) -> None:
        """Return ``indices``; all-or-nothing on error (``ValueError``)."""
        idx = [int(i) for i in indices]
        seen: set[int] = set()
        for i in idx:
            self._check_range(i)
            if self._is_free[i] or i in seen:
                raise ValueError(f"double free of index {i} (capacity {self._capacity})")
            seen.add(i)
        for i in idx:
            self._is_free[i] = 1
            heapq.heappush(self._free_heap, i)

    def check_integrity(self) -> None:
        """``RuntimeError`` unless free + used = capacity and the free list is consistent."""
        flags = sum(self._is_free)
        if flags != len(self._free_heap) or len(set(self._free_heap)) != flags:
            raise RuntimeError(
                f"allocator corrupt: {flags} free flags, {len(self._free_heap)} free entries"
            )
        if any(not self._is_free[i] for i in self._free_heap):
            raise RuntimeError("allocator corrupt: a free-list entry is marked used")

    def _check_range(self, index: int) -> None:
        if not 0 <= index < self._capacity:
            raise ValueError(
                f"index {index} is foreign to an allocator of capacity {self._capacity}"
            )

    def __repr__(self) -> str:
        return f"PageAllocator(capacity={self._capacity}, free={self.num_free})"
