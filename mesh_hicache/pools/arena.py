"""One arena of fixed-size blocks per tier, shared by KV pages and recurrent-state slots.

docs/DESIGN.md section 7 ("Memory budgets"). A tier with a byte budget is one buffer of
``num_blocks`` blocks of ``block_bytes``. A *page* (every paged region of this rank's
layers: ``kv``, ``indexer``) takes ``blocks_per_page`` consecutive blocks, a *slot* (every
slot region: ``mamba_conv``, ``mamba_ssm``) takes ``blocks_per_slot``; how many of each
the arena holds follows the workload.

Ids: a page's (or slot's) id is the index of its first block, so the per-region tensors
are strided views over the one buffer, ``[num_ids, *row]`` with a dim-0 stride of one
block (``ArenaPlan.region_view``), and pages and slots stay addressed by integer ids
exactly as with separate pools (tree, transfers, host DTensors, storage rows unchanged).
The id space of a kind is ``num_blocks - blocks_per_item + 1``; only ids of allocated
items are ever read or written, and allocated extents never overlap.

Placement (deterministic, so equal call sequences give equal ids on every rank): a call
takes the smallest free run that holds all its items (best fit; one request's pages are
then consecutive and come back as one run), else first fit run by run; pages from the
low end, slots from the high end, so the two kinds grow towards each other and the free
space is mostly one gap between them.
Fragmentation: an item needs ``blocks_per_item`` *consecutive* free blocks. With the
default block size the smaller kind is one block and can never be blocked; the larger
kind (usually the state) can fail while enough blocks are free when the free blocks are
scattered holes of the other kind. The allocator then reports it as not fitting and the
caller evicts until a run is free (``tiers/alloc.py``).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from mesh_hicache.choices import CpKvMode
from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import RegionLayout, StateLayout
from mesh_hicache.spec import StateSpec

#: Every region row starts at a multiple of this many bytes inside its page or slot (and
#: blocks are multiples of it), so every dtype view of the arena is aligned.
ALIGN = 16

#: Default block size: the smaller of page and slot is split into at most this many
#: blocks, the fewest that keep the rounding waste of both at most ``MAX_WASTE``.
MAX_SPLIT = 64
MAX_WASTE = 1 / 32


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def item_row_offsets(regions: Sequence[RegionLayout]) -> tuple[dict[str, int], int]:
    """Offset of each region's row inside one item, and the item's (aligned) bytes."""
    offsets: dict[str, int] = {}
    pos = 0
    for r in regions:
        offsets[r.name.value] = pos
        pos += _align(r.row_bytes)
    return offsets, pos


def default_block_bytes(page_bytes: int, slot_bytes: int) -> int:
    """The block size used when none is configured (see ``MAX_SPLIT``); sizes count
    rounded up to ``ALIGN`` (items are laid out aligned)."""
    sizes = [_align(b) for b in (page_bytes, slot_bytes) if b > 0]
    if not sizes:
        raise ValueError("an arena needs a page or a slot of at least one byte")
    small = min(sizes)
    for k in range(1, MAX_SPLIT + 1):
        block = _align(-(-small // k))
        waste = max((math.ceil(b / block) * block - b) / b for b in sizes)
        if waste <= MAX_WASTE:
            return block
    return _align(-(-small // MAX_SPLIT))


@dataclass(frozen=True, slots=True)
class ArenaPlan:
    """The shape of one tier's arena; identical on every rank (built from agreed numbers).

    ``page_bytes`` / ``slot_bytes`` are the mesh-wide maximum bytes of one page / slot
    (a rank whose rows are smaller leaves the rest of its blocks unused).
    """

    num_blocks: int
    block_bytes: int
    page_bytes: int
    slot_bytes: int

    def __post_init__(self) -> None:
        if self.num_blocks < 0 or self.block_bytes < 1 or self.block_bytes % ALIGN:
            raise ValueError(
                f"arena needs num_blocks >= 0 and block_bytes a positive multiple of {ALIGN}, "
                f"got num_blocks={self.num_blocks}, block_bytes={self.block_bytes}"
            )

    @classmethod
    def for_budget(
        cls, budget_bytes: int, page_bytes: int, slot_bytes: int, block_bytes: int = 0
    ) -> ArenaPlan:
        """The largest arena of at most ``budget_bytes`` (``block_bytes`` 0: the default).

        ``ValueError`` (naming the values) when the budget holds no page, or no slot where
        slots have bytes: such a tier could never cache anything."""
        if page_bytes < 1:
            raise ValueError(f"a byte budget needs pages of at least one byte, got {page_bytes}")
        block = block_bytes or default_block_bytes(page_bytes, slot_bytes)
        plan = cls(budget_bytes // block if block else 0, block, page_bytes, slot_bytes)
        need = max(plan.blocks_per_page, plan.blocks_per_slot)
        if plan.num_blocks < need:
            raise ValueError(
                f"a budget of {budget_bytes} bytes holds {plan.num_blocks} blocks of {block} "
                f"bytes, fewer than one page ({page_bytes} B = {plan.blocks_per_page} blocks) "
                f"or one state ({slot_bytes} B = {plan.blocks_per_slot} blocks)"
            )
        return plan

    @staticmethod
    def item_bytes(layout: StateLayout) -> tuple[int, int]:
        """This rank's (page bytes, slot bytes) with the arena's row alignment."""
        paged = [r for r in layout.regions if r.paged]
        slotted = [r for r in layout.regions if not r.paged]
        return item_row_offsets(paged)[1], item_row_offsets(slotted)[1]

    @property
    def blocks_per_page(self) -> int:
        return -(-self.page_bytes // self.block_bytes)

    @property
    def blocks_per_slot(self) -> int:
        return -(-self.slot_bytes // self.block_bytes)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def max_pages(self) -> int:
        """Pages an empty arena holds (no slots)."""
        return self.num_blocks // self.blocks_per_page if self.blocks_per_page else 0

    @property
    def max_slots(self) -> int:
        """Slots an empty arena holds (no pages)."""
        return self.num_blocks // self.blocks_per_slot if self.blocks_per_slot else 0

    def num_ids(self, paged: bool) -> int:
        """Size of the page (or slot) id space: every block an item can start at."""
        k = self.blocks_per_page if paged else self.blocks_per_slot
        return max(self.num_blocks - k + 1, 0) if k else 0

    def region_view(
        self, buffer: torch.Tensor, layout: StateLayout, region: RegionLayout
    ) -> torch.Tensor:
        """``[num_ids, *row]`` view of ``region`` over the uint8 ``buffer`` (no copy)."""
        assert buffer.dtype == torch.uint8 and buffer.numel() == self.nbytes
        same_kind = [r for r in layout.regions if r.paged == region.paged]
        offset = item_row_offsets(same_kind)[0][region.name.value]
        es = torch.empty((), dtype=region.dtype).element_size()
        assert offset % es == 0 and self.block_bytes % es == 0
        typed = buffer.view(region.dtype)
        count = self.num_ids(region.paged)
        row_strides = torch.empty(region.local_shape, dtype=region.dtype, device="meta").stride()
        if count == 0:
            return typed[:0].view(0, *region.local_shape)
        return typed.as_strided(
            (count, *region.local_shape),
            (self.block_bytes // es, *row_strides),
            offset // es,
        )


def agreed_plan(
    layout: StateLayout, budget_bytes: int, agree: Consensus, block_bytes: int = 0
) -> ArenaPlan:
    """The arena of ``budget_bytes`` per rank, identical on every rank of ``agree``.

    Collective (one ``Consensus.min_max``): the ranks agree on the smallest budget and the
    largest page and slot bytes, and every rank derives the block size and counts from
    those agreed numbers, so all hold the same blocks, pages and slots. ``agree`` must
    span the whole mesh. ``ValueError`` (on every rank) when the budget holds no page or
    no state."""
    page, slot = ArenaPlan.item_bytes(layout)
    lows, highs = agree.min_max([budget_bytes, page, slot])
    return ArenaPlan.for_budget(lows[0], highs[1], highs[2], block_bytes)


def mesh_plan(
    spec: StateSpec,
    shape: Sequence[int],
    cp_kv: CpKvMode | str,
    budget_bytes: int,
    block_bytes: int = 0,
) -> ArenaPlan:
    """The plan ``agreed_plan`` gives every rank of a ``(pp, cp, tp)`` mesh, computed
    without a process group (the largest page and slot over all its ranks): to check a
    budget before any work starts, or to size one. ``ValueError`` like ``for_budget``."""
    pages, slots = [], []
    for coords in itertools.product(*(range(n) for n in shape)):
        page, slot = ArenaPlan.item_bytes(StateLayout.for_coords(spec, shape, coords, cp_kv))
        pages.append(page)
        slots.append(slot)
    return ArenaPlan.for_budget(budget_bytes, max(pages), max(slots), block_bytes)


class _FreeRuns:
    """Maximal runs of free blocks, as sorted starts and their lengths."""

    def __init__(self, num_blocks: int) -> None:
        self.starts: list[int] = [0] if num_blocks else []
        self.lengths: list[int] = [num_blocks] if num_blocks else []

    def count(self, k: int, n: int, from_top: bool) -> int:
        """How many ``k``-block extents (up to ``n``) the runs hold."""
        total = 0
        order = reversed(self.lengths) if from_top else iter(self.lengths)
        for length in order:
            total += length // k
            if total >= n:
                return n
        return total

    def take(self, k: int, n: int, from_top: bool) -> list[int]:
        """Carve ``n`` ``k``-block extents (caller checked ``count``); their starts.

        Best fit first: the smallest run that holds all ``n`` (ties: the lowest, or the
        highest ``from_top``), so one call's items are consecutive and freeing them
        together gives back one run; else first fit from the chosen end, run by run."""
        need = n * k
        fits = [i for i, length in enumerate(self.lengths) if length >= need]
        if fits:
            side = -1 if from_top else 1
            best = min(fits, key=lambda i: (self.lengths[i], side * self.starts[i]))
            return self._carve(best, k, n, from_top)
        out: list[int] = []
        while len(out) < n:
            # Runs too short for one item are skipped; carving never reorders runs.
            usable = [i for i, length in enumerate(self.lengths) if length >= k]
            i = usable[-1] if from_top else usable[0]
            out += self._carve(i, k, min(self.lengths[i] // k, n - len(out)), from_top)
        return sorted(out)

    def _carve(self, i: int, k: int, n: int, from_top: bool) -> list[int]:
        """``n`` extents from the low (or high) end of run ``i``, increasing."""
        s, length = self.starts[i], self.lengths[i]
        if from_top:
            out = [s + length - (j + 1) * k for j in range(n)][::-1]
        else:
            out = [s + j * k for j in range(n)]
            self.starts[i] = s + n * k
        self.lengths[i] = length - n * k
        if self.lengths[i] == 0:
            del self.starts[i], self.lengths[i]
        return out

    def give(self, start: int, k: int) -> None:
        """Return the extent ``[start, start + k)``, merging with its neighbours."""
        i = bisect.bisect_left(self.starts, start)
        merge_left = i > 0 and self.starts[i - 1] + self.lengths[i - 1] == start
        merge_right = i < len(self.starts) and self.starts[i] == start + k
        if merge_left and merge_right:
            self.lengths[i - 1] += k + self.lengths[i]
            del self.starts[i], self.lengths[i]
        elif merge_left:
            self.lengths[i - 1] += k
        elif merge_right:
            self.starts[i] = start
            self.lengths[i] += k
        else:
            self.starts.insert(i, start)
            self.lengths.insert(i, k)


class BlockArena:
    """Block accounting of one arena; ``pages`` and ``slots`` are its two id spaces.

    Not thread-safe (one owner thread, like ``PageAllocator``)."""

    def __init__(self, plan: ArenaPlan) -> None:
        self.plan = plan
        self._runs = _FreeRuns(plan.num_blocks)
        self.pages = ArenaIds(self, plan.blocks_per_page, plan.num_ids(True), "page", False)
        self.slots = ArenaIds(self, plan.blocks_per_slot, plan.num_ids(False), "slot", True)

    @property
    def num_blocks(self) -> int:
        return self.plan.num_blocks

    @property
    def free_blocks(self) -> int:
        return sum(self._runs.lengths)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def largest_free_run(self) -> int:
        return max(self._runs.lengths, default=0)

    def check_integrity(self) -> None:
        """``RuntimeError`` unless free runs and allocated extents tile the blocks exactly."""
        mark = bytearray(self.num_blocks)
        runs = self._runs
        if runs.starts != sorted(runs.starts) or any(n <= 0 for n in runs.lengths):
            raise RuntimeError("arena corrupt: free runs unsorted or empty")
        for a, b, n in zip(runs.starts, runs.starts[1:], runs.lengths, strict=False):
            if a + n >= b:
                raise RuntimeError(f"arena corrupt: free runs at {a} and {b} touch or overlap")
        for s, n in zip(runs.starts, runs.lengths, strict=True):
            mark[s : s + n] = b"\x01" * n
        for ids in (self.pages, self.slots):
            for s in ids.allocated:
                if any(mark[s : s + ids.blocks]) or s + ids.blocks > self.num_blocks:
                    raise RuntimeError(f"arena corrupt: {ids.kind} {s} overlaps another extent")
                mark[s : s + ids.blocks] = b"\x01" * ids.blocks
        if not all(mark):
            raise RuntimeError(f"arena leaks block {mark.index(0)}")

    def __repr__(self) -> str:
        p = self.plan
        return (
            f"BlockArena(blocks={p.num_blocks} x {p.block_bytes} B, pages={self.pages.num_used}"
            f" x {p.blocks_per_page}, slots={self.slots.num_used} x {p.blocks_per_slot}, "
            f"free={self.free_blocks})"
        )


class ArenaIds:
    """One id space of a :class:`BlockArena`, with the interface of ``PageAllocator``.

    ``capacity`` is the size of the id space (ids are first-block indices), not how many
    items fit: that is ``num_free`` now and ``ArenaPlan.max_pages``/``max_slots`` when
    empty. ``is_free(i)``: ``i`` is not the id of an allocated item of this kind.
    ``allocate(n)`` is all-or-nothing (``RuntimeError`` when fewer fit); ``free`` raises
    ``ValueError`` for a double or foreign free and frees none of the given ids then.
    """

    def __init__(self, arena: BlockArena, blocks: int, capacity: int, kind: str, top: bool):
        self._arena = arena
        self.blocks = blocks
        self._capacity = capacity
        self.kind = kind
        self._from_top = top
        self.allocated: set[int] = set()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_used(self) -> int:
        return len(self.allocated)

    @property
    def num_free(self) -> int:
        """Items of this kind that could be allocated now (the arena's free runs)."""
        if not self.blocks:
            return 0
        return self._arena._runs.count(self.blocks, self._arena.num_blocks, self._from_top)

    def is_free(self, index: int) -> bool:
        if not 0 <= index < self._capacity:
            raise ValueError(
                f"{self.kind} id {index} is foreign to an id space of {self._capacity}"
            )
        return index not in self.allocated

    def can_allocate(self, n: int) -> bool:
        if n < 0:
            return False
        if n == 0:
            return True
        return bool(self.blocks) and self._arena._runs.count(self.blocks, n, self._from_top) >= n

    def allocate(self, n: int) -> list[int]:
        """``n`` ids (increasing); pages from the low end, slots from the high end."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative count {n}")
        if not self.can_allocate(n):
            raise RuntimeError(
                f"cannot allocate {n} {self.kind}s of {self.blocks} blocks: "
                f"{self._arena.free_blocks} blocks free, largest run {self._arena.largest_free_run}"
            )
        out = self._arena._runs.take(self.blocks, n, self._from_top) if n else []
        self.allocated.update(out)
        return out

    def free(self, indices: Iterable[int]) -> None:
        """Return ids to the arena; all-or-nothing on error (``ValueError``)."""
        idx = [int(i) for i in indices]
        if len(set(idx)) != len(idx) or any(i not in self.allocated for i in idx):
            bad = next(i for n, i in enumerate(idx) if i not in self.allocated or i in idx[:n])
            raise ValueError(f"double or foreign free of {self.kind} id {bad}")
        for i in idx:
            self.allocated.discard(i)
            self._arena._runs.give(i, self.blocks)

    def check_integrity(self) -> None:
        self._arena.check_integrity()

    def __repr__(self) -> str:
        return f"ArenaIds({self.kind}, blocks={self.blocks}, used={self.num_used})"
