"""One arena of fixed-size blocks per tier, shared by KV pages, window pages and states.

docs/DESIGN.md section 7 ("Memory budgets"). A tier with a byte budget is one buffer of
``num_blocks`` blocks of ``block_bytes``, holding items of up to three kinds:

- a *page* (every paged region of this rank's layers: ``kv``, ``indexer``, and
  ``kv_window`` unless windows are separate) takes ``blocks_per_page`` consecutive blocks;
- a *slot* (every slot region: ``mamba_conv``, ``mamba_ssm``) takes ``blocks_per_slot``;
- a *window* (one ``kv_window`` row: a page of the sliding-window layers) takes
  ``blocks_per_window``, only where the plan has ``window_bytes`` (the host arena: L2
  keeps only the windowed pages a resume needs, so they get their own ids; the device
  arena keeps every page's windowed K/V inside that page, ``window_bytes`` 0).

How many of each the arena holds follows the workload.

Ids: an item's id is the index of its first block, so the per-region tensors are strided
views over the one buffer, ``[num_ids, *row]`` with a dim-0 stride of one block
(``ArenaPlan.region_view``), and items stay addressed by integer ids exactly as with
separate pools (tree, transfers, host DTensors, storage rows unchanged). Each kind has
its own id space, ``num_blocks - blocks_per_item + 1`` wide; only ids of allocated items
are ever read or written, and allocated extents (of every kind) never overlap.

Placement (deterministic, so equal call sequences give equal ids on every rank): a call
takes the smallest free run that holds all its items (best fit; one request's pages are
then consecutive and come back as one run), else first fit run by run; pages and windows
from the low end (both are small, paged K/V), slots from the high end, so the page-like
kinds and the states grow towards each other and the free space is mostly one gap
between them.
Fragmentation: an item needs ``blocks_per_item`` *consecutive* free blocks. With the
default block size the smallest kind is usually one block and then never blocked; a larger
kind (usually the state) can fail while enough blocks are free when the free blocks are
scattered holes of the other kinds. The allocator then reports it as not fitting and the
caller evicts until a run is free (``tiers/alloc.py``).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from mesh_hicache.choices import CpKvMode, RegionName
from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import RegionLayout, StateLayout
from mesh_hicache.spec import StateSpec

#: Every region row starts at a multiple of this many bytes inside its item (and blocks
#: are multiples of it), so every dtype view of the arena is aligned.
ALIGN = 16

#: Default block size: the smallest item is split into at most this many blocks, the
#: fewest that keep the rounding waste of every item at most ``MAX_WASTE``.
MAX_SPLIT = 64
MAX_WASTE = 1 / 32

#: The kinds of item an arena holds (see the module doc).
ItemKind = Literal["page", "slot", "window"]
ITEM_KINDS: tuple[ItemKind, ...] = ("page", "slot", "window")


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


def region_kind(region: RegionLayout, separate_windows: bool) -> ItemKind:
    """The kind of item that holds ``region``'s rows: ``kv_window`` is a window of its own
    when ``separate_windows``, else part of the page like every other paged region."""
    if separate_windows and region.name is RegionName.KV_WINDOW:
        return "window"
    return "page" if region.paged else "slot"


def kind_regions(
    layout: StateLayout, kind: ItemKind, separate_windows: bool
) -> tuple[RegionLayout, ...]:
    """The regions of ``layout`` whose rows make up one item of ``kind``, in region order."""
    return tuple(r for r in layout.regions if region_kind(r, separate_windows) == kind)


def default_block_bytes(page_bytes: int, slot_bytes: int, window_bytes: int = 0) -> int:
    """The block size used when none is configured (see ``MAX_SPLIT``), over every item
    size that is not 0; sizes count rounded up to ``ALIGN`` (items are laid out aligned)."""
    sizes = [_align(b) for b in (page_bytes, slot_bytes, window_bytes) if b > 0]
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

    ``page_bytes`` / ``slot_bytes`` / ``window_bytes`` are the mesh-wide maximum bytes of
    one page / slot / window (a rank whose rows are smaller leaves the rest of its blocks
    unused). ``window_bytes`` 0: no window kind; a layout's ``kv_window`` rows, if any,
    are then part of its pages.
    """

    num_blocks: int
    block_bytes: int
    page_bytes: int
    slot_bytes: int
    window_bytes: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks < 0 or self.block_bytes < 1 or self.block_bytes % ALIGN:
            raise ValueError(
                f"arena needs num_blocks >= 0 and block_bytes a positive multiple of {ALIGN}, "
                f"got num_blocks={self.num_blocks}, block_bytes={self.block_bytes}"
            )
        if min(self.page_bytes, self.slot_bytes, self.window_bytes) < 0:
            raise ValueError(
                f"arena item bytes must be >= 0, got page_bytes={self.page_bytes}, "
                f"slot_bytes={self.slot_bytes}, window_bytes={self.window_bytes}"
            )

    @classmethod
    def for_budget(
        cls,
        budget_bytes: int,
        page_bytes: int,
        slot_bytes: int,
        block_bytes: int = 0,
        window_bytes: int = 0,
    ) -> ArenaPlan:
        """The largest arena of at most ``budget_bytes`` (``block_bytes`` 0: the default).

        ``ValueError`` (naming the values) when the budget holds no page, or no slot
        (window) where slots (windows) have bytes: such a tier could never cache anything."""
        if page_bytes < 1:
            raise ValueError(f"a byte budget needs pages of at least one byte, got {page_bytes}")
        block = block_bytes or default_block_bytes(page_bytes, slot_bytes, window_bytes)
        blocks = budget_bytes // block if block else 0
        plan = cls(blocks, block, page_bytes, slot_bytes, window_bytes)
        need = max(plan.blocks_per_page, plan.blocks_per_slot, plan.blocks_per_window)
        if plan.num_blocks < need:
            window = (
                f" or one window ({window_bytes} B = {plan.blocks_per_window} blocks)"
                if window_bytes
                else ""
            )
            raise ValueError(
                f"a budget of {budget_bytes} bytes holds {plan.num_blocks} blocks of {block} "
                f"bytes, fewer than one page ({page_bytes} B = {plan.blocks_per_page} blocks) "
                f"or one state ({slot_bytes} B = {plan.blocks_per_slot} blocks){window}"
            )
        return plan

    @staticmethod
    def item_bytes(layout: StateLayout, separate_windows: bool = False) -> tuple[int, int, int]:
        """This rank's (page, slot, window) bytes with the arena's row alignment.

        window is 0 unless ``separate_windows`` and the layout has a ``kv_window`` region;
        the page then leaves ``kv_window`` out."""
        return (
            item_row_offsets(kind_regions(layout, "page", separate_windows))[1],
            item_row_offsets(kind_regions(layout, "slot", separate_windows))[1],
            item_row_offsets(kind_regions(layout, "window", separate_windows))[1],
        )

    @property
    def separate_windows(self) -> bool:
        """Whether ``kv_window`` rows are items of their own (``window_bytes`` > 0)."""
        return self.window_bytes > 0

    def item_bytes_of(self, kind: ItemKind) -> int:
        """The plan's bytes of one item of ``kind``."""
        if kind == "page":
            return self.page_bytes
        if kind == "slot":
            return self.slot_bytes
        if kind == "window":
            return self.window_bytes
        raise ValueError(f"unknown arena item kind {kind!r}; choose from {ITEM_KINDS}")

    def blocks_per(self, kind: ItemKind) -> int:
        """Consecutive blocks one item of ``kind`` takes (0 for a kind without bytes)."""
        return -(-self.item_bytes_of(kind) // self.block_bytes)

    @property
    def blocks_per_page(self) -> int:
        return self.blocks_per("page")

    @property
    def blocks_per_slot(self) -> int:
        return self.blocks_per("slot")

    @property
    def blocks_per_window(self) -> int:
        return self.blocks_per("window")

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def max_items(self, kind: ItemKind) -> int:
        """Items of ``kind`` an empty arena holds (no item of another kind)."""
        k = self.blocks_per(kind)
        return self.num_blocks // k if k else 0

    @property
    def max_pages(self) -> int:
        """Pages an empty arena holds (no slots, no windows)."""
        return self.max_items("page")

    @property
    def max_slots(self) -> int:
        """Slots an empty arena holds (no pages, no windows)."""
        return self.max_items("slot")

    @property
    def max_windows(self) -> int:
        """Windows an empty arena holds (no pages, no slots); 0 without a window kind."""
        return self.max_items("window")

    def num_ids(self, kind: ItemKind) -> int:
        """Size of the id space of ``kind``: every block an item of it can start at (0 for
        a kind without bytes)."""
        k = self.blocks_per(kind)
        return max(self.num_blocks - k + 1, 0) if k else 0

    def region_view(
        self, buffer: torch.Tensor, layout: StateLayout, region: RegionLayout
    ) -> torch.Tensor:
        """``[num_ids, *row]`` view of ``region`` over the uint8 ``buffer`` (no copy), in
        the id space of the kind holding it (``kv_window``: windows when the plan has them,
        else pages)."""
        assert buffer.dtype == torch.uint8 and buffer.numel() == self.nbytes
        kind = region_kind(region, self.separate_windows)
        same_kind = kind_regions(layout, kind, self.separate_windows)
        offset = item_row_offsets(same_kind)[0][region.name.value]
        es = torch.empty((), dtype=region.dtype).element_size()
        assert offset % es == 0 and self.block_bytes % es == 0
        typed = buffer.view(region.dtype)
        count = self.num_ids(kind)
        row_strides = torch.empty(region.local_shape, dtype=region.dtype, device="meta").stride()
        if count == 0:
            return typed[:0].view(0, *region.local_shape)
        return typed.as_strided(
            (count, *region.local_shape),
            (self.block_bytes // es, *row_strides),
            offset // es,
        )


def agreed_plan(
    layout: StateLayout,
    budget_bytes: int,
    agree: Consensus,
    block_bytes: int = 0,
    separate_windows: bool = False,
) -> ArenaPlan:
    """The arena of ``budget_bytes`` per rank, identical on every rank of ``agree``.

    Collective (one ``Consensus.min_max``): the ranks agree on the smallest budget and the
    largest page, slot and window bytes, and every rank derives the block size and counts
    from those agreed numbers, so all hold the same blocks, pages, slots and windows.
    ``separate_windows``: ``kv_window`` rows are windows of their own (the host arena),
    not part of the page. ``agree`` must span the whole mesh. ``ValueError`` (on every
    rank) when the budget holds no page, no state or no window."""
    page, slot, window = ArenaPlan.item_bytes(layout, separate_windows)
    lows, highs = agree.min_max([budget_bytes, page, slot, window])
    return ArenaPlan.for_budget(lows[0], highs[1], highs[2], block_bytes, highs[3])


def mesh_item_bytes(
    spec: StateSpec, shape: Sequence[int], cp_kv: CpKvMode | str, separate_windows: bool = False
) -> tuple[int, int, int]:
    """The largest (page, slot, window) bytes over every rank of a ``(pp, cp, tp)`` mesh
    (``ArenaPlan.item_bytes`` of each rank's layout), without a process group."""
    items = [
        ArenaPlan.item_bytes(StateLayout.for_coords(spec, shape, coords, cp_kv), separate_windows)
        for coords in itertools.product(*(range(n) for n in shape))
    ]
    page, slot, window = (max(sizes) for sizes in zip(*items, strict=True))
    return page, slot, window


def mesh_plan(
    spec: StateSpec,
    shape: Sequence[int],
    cp_kv: CpKvMode | str,
    budget_bytes: int,
    block_bytes: int = 0,
    separate_windows: bool = False,
) -> ArenaPlan:
    """The plan ``agreed_plan`` gives every rank of a ``(pp, cp, tp)`` mesh, computed
    without a process group (the largest page, slot and window over all its ranks): to
    check a budget before any work starts, or to size one. ``ValueError`` like
    ``for_budget``."""
    page, slot, window = mesh_item_bytes(spec, shape, cp_kv, separate_windows)
    return ArenaPlan.for_budget(budget_bytes, page, slot, block_bytes, window)


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
    """Block accounting of one arena; ``pages``, ``slots`` and ``windows`` are its id
    spaces (``windows`` is empty, capacity 0, without a window kind).

    Not thread-safe (one owner thread, like ``PageAllocator``)."""

    def __init__(self, plan: ArenaPlan) -> None:
        self.plan = plan
        self._runs = _FreeRuns(plan.num_blocks)
        self.pages = self._ids("page", False)
        self.slots = self._ids("slot", True)
        self.windows = self._ids("window", False)

    def _ids(self, kind: ItemKind, top: bool) -> ArenaIds:
        return ArenaIds(self, self.plan.blocks_per(kind), self.plan.num_ids(kind), kind, top)

    @property
    def kinds(self) -> tuple[ArenaIds, ArenaIds, ArenaIds]:
        """The id spaces: pages, slots, windows."""
        return self.pages, self.slots, self.windows

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
        for ids in self.kinds:
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
            f"windows={self.windows.num_used} x {p.blocks_per_window}, free={self.free_blocks})"
        )


class ArenaIds:
    """One id space of a :class:`BlockArena`, with the interface of ``PageAllocator``.

    ``capacity`` is the size of the id space (ids are first-block indices), not how many
    items fit: that is ``num_free`` now and ``ArenaPlan.max_pages``/``max_slots``/
    ``max_windows`` when empty. ``is_free(i)``: ``i`` is not the id of an allocated item
    of this kind. ``allocate(n)`` is all-or-nothing (``RuntimeError`` when fewer fit);
    ``free`` raises ``ValueError`` for a double or foreign free and frees none of the
    given ids then.
    """

    def __init__(
        self, arena: BlockArena, blocks: int, capacity: int, kind: ItemKind, top: bool
    ) -> None:
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
        """``n`` ids (increasing); pages and windows from the low end, slots from the high
        end."""
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
