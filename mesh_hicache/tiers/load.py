"""Loads: host (L2) -> device (L1) copies of a matched prefix, layer by layer.

A load reserves device pages for the host-only nodes of a prefix and a device slot for
the host state at its end (agreed through ``alloc``), queues one layer-wise copy on the
transfer engine, and on completion records the device copies in the tree. The caller
keeps the loaded nodes host-protected (and the prefix locked) meanwhile, so the source
rows stay valid.

Shared loads: requests in flight together often share a prefix that is on host only (a
batch of chat turns after a restart, agents over one system prompt). Each node is loaded
once: a load started while another one copies some nodes of its path copies only the
nodes (and the state) nobody is copying yet, and depends on the loads in flight that do.
Finishing a load finishes its dependencies first, in start order, so a node's parent is
always on device before the node is attached; a load whose dependency failed fails too.
An insert that would give a node in flight a device copy of its own finishes that load
first (:meth:`Loader.settle`), so every node gets exactly one device copy.

A load covers a path segment, not a node list: between the start and the finish other
requests may split a node of the segment (an insert, an L3 prefetch), which adds nodes
but neither pages nor tokens; the finish walks the segment as it is then and hands out
the reserved pages top-down.

Thread story: the scheduler thread; the copy runs on the transfer engine's worker, and
the model may wait on single layers (:meth:`PendingLoad.wait_layer`) from the scheduler.

Agreements: :meth:`Loader.start` 1 or 2 (device pages, then the slot: ``alloc``), none
when everything it needs is already being copied; :meth:`Loader.finish` 1 (``all_true``
over the copy's success) per load not finished yet, its dependencies first. Which loads
are in flight and which nodes they cover is replicated state (the same on every rank), so
every rank finishes the same loads in the same order. A load that failed on any rank
frees its reservation on every rank and serves nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.radix import Family, RadixTree, Tier, TreeNode
from mesh_hicache.stats import CacheStats
from mesh_hicache.tiers.alloc import CacheFull, TierAllocator
from mesh_hicache.transfer import TransferEngine, TransferHandle


class PendingLoad:
    """A started load: the path segment it copies, its reservation, the loads it waits
    for, and (once finished) its agreed outcome. Mutated only by :class:`Loader`."""

    __slots__ = (
        "after",
        "anchor",
        "handle",
        "last",
        "num_tokens",
        "num_windows",
        "ok",
        "pages",
        "prefix_pages",
        "prefix_slot",
        "slot",
        "started",
        "state_node",
    )

    def __init__(
        self,
        handle: TransferHandle | None = None,
        *,
        anchor: TreeNode | None = None,
        last: TreeNode | None = None,
        pages: Sequence[int] = (),
        state_node: TreeNode | None = None,
        slot: int | None = None,
        after: Sequence[PendingLoad] = (),
        num_tokens: int = 0,
        prefix_pages: Sequence[int] = (),
        prefix_slot: int | None = None,
        num_windows: int = 0,
    ) -> None:
        self.handle = handle
        """The copy of this load's own part; None when it copies nothing itself."""
        self.anchor = anchor
        """The node above the segment (on device, a sentinel, or in a load it depends on)."""
        self.last = last
        """The deepest node of the segment; None: no KV of its own."""
        self.pages = tuple(pages)
        """Device pages reserved for the segment, top-down (one per page)."""
        self.state_node = state_node
        """The node whose host state this load copies (None: no state of its own)."""
        self.slot = slot
        """Device slot reserved for that state."""
        self.after = tuple(after)
        """Loads in flight at the start that copy part of this request's prefix."""
        self.num_tokens = num_tokens
        """Tokens of the request's prefix that were on host only at the start (copied by
        this load or by those it depends on)."""
        self.prefix_pages = tuple(prefix_pages)
        """Device pages of the request's whole prefix once every load it needs finished."""
        self.prefix_slot = prefix_slot
        """Device slot of the state at the prefix end loaded here or by a dependency
        (None: no state is loaded)."""
        self.num_windows = num_windows
        """Windowed pages this load copies (the others' windowed K/V is zeroed)."""
        self.ok: bool | None = None
        """None while in flight; then whether it succeeded on every rank."""
        self.started = time.monotonic()

    def segment(self) -> list[TreeNode]:
        """The nodes this load brings to device, top-down (as the tree is now)."""
        out: list[TreeNode] = []
        node = self.last
        while node is not None and node is not self.anchor:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def wait_layer(self, layer_id: int) -> bool:
        """Block until layer ``layer_id``'s part is on device, from this load and from
        the loads it depends on (True if all of them succeeded)."""
        ok = all(dep.wait_layer(layer_id) for dep in self.after)
        if self.handle is not None:
            ok = self.handle.wait_layer(layer_id) and ok
        return ok


_Owner = tuple[PendingLoad, int]
"""A node's load in flight and the offset of the node's pages in its reservation."""


class Loader:
    """Starts and finishes loads for one rank; see the module docstring."""

    def __init__(
        self,
        engine: TransferEngine | None,
        tree: RadixTree,
        alloc: TierAllocator,
        layout: StateLayout,
        agree: Consensus,
        stats: CacheStats,
        device: DevicePools,
    ) -> None:
        self._engine = engine
        self._device = device
        self._tree = tree
        self._alloc = alloc
        self._layout = layout
        self._agree = agree
        self._stats = stats
        self._in_flight: list[PendingLoad] = []
        """Started, not finished, in start order (replicated: equal on every rank)."""

    @property
    def in_flight(self) -> bool:
        """Some load started and not finished yet."""
        return bool(self._in_flight)

    @property
    def reserved(self) -> tuple[list[int], list[int]]:
        """Device pages and slots reserved by loads in flight (not in the tree yet)."""
        pages = [p for load in self._in_flight for p in load.pages]
        slots = [load.slot for load in self._in_flight if load.slot is not None]
        return pages, slots

    def _owners(self) -> tuple[dict[TreeNode, _Owner], dict[TreeNode, PendingLoad]]:
        """Per node in flight: (its load, offset of its pages in the load's reservation);
        per state in flight: its load."""
        kv: dict[TreeNode, _Owner] = {}
        state: dict[TreeNode, PendingLoad] = {}
        for load in self._in_flight:
            pos = 0
            for node in load.segment():
                kv[node] = (load, pos)
                pos += node.num_pages
            if load.state_node is not None:
                state[load.state_node] = load
        return kv, state

    def start(self, path: Sequence[TreeNode], state_node: TreeNode | None) -> PendingLoad:
        """Start bringing the matched ``path`` (top-down; device nodes first, then
        host-only ones) to device, and the host state of ``state_node`` (None: no state).

        Copies what no load in flight copies already and depends on those that do.
        Reserves device pages and a slot (agreed; ``CacheFull`` on every rank if
        impossible, with nothing reserved) and queues one layer-wise copy.
        """
        kv_owner, state_owner = self._owners()
        after: list[PendingLoad] = []
        own: list[TreeNode] = []
        num_tokens = 0
        for node in path:
            if node.device_indices is not None:
                continue
            num_tokens += node.num_tokens
            owner = kv_owner.get(node)
            if owner is None:
                own.append(node)
                continue
            # Device copies are prefix-closed and so are loads: a node a load copies has
            # its parent on device or copied by the same or an earlier load.
            assert not own, f"{node!r} is in flight below {own[-1]!r}, which is not"
            if owner[0] not in after:
                after.append(owner[0])
        state_dep = state_owner.get(state_node) if state_node is not None else None
        if state_dep is not None and state_dep not in after:
            after.append(state_dep)
        after.sort(key=self._in_flight.index)
        own_state = state_node if state_node is not None and state_dep is None else None
        pages = self._alloc.alloc_device_pages(sum(n.num_pages for n in own))
        slot: int | None = None
        if own_state is not None:
            try:
                slot = self._alloc.alloc_device_slot()
            except CacheFull:
                self._alloc.free_device(pages=pages)
                raise
        handle = None
        num_windows = 0
        if pages or slot is not None:
            assert self._engine is not None
            host_pages = [p for n in own for p in (n.host_indices or ())]
            slots: tuple[Sequence[int], Sequence[int]] = ((), ())
            if own_state is not None and slot is not None:
                assert own_state.mamba_host_slot is not None
                slots = ([slot], [own_state.mamba_host_slot])
            windows = self._windows(pages, host_pages)
            handle = self._engine.load((pages, host_pages), slots, windows)
            num_windows = len(windows[0])
        prefix_pages: list[int] = []
        pos = 0
        for node in path:
            if node.device_indices is not None:
                prefix_pages.extend(node.device_indices)
            elif node in kv_owner:
                dep, offset = kv_owner[node]
                prefix_pages.extend(dep.pages[offset : offset + node.num_pages])
            else:
                prefix_pages.extend(pages[pos : pos + node.num_pages])
                pos += node.num_pages
        load = PendingLoad(
            handle,
            anchor=own[0].parent if own else None,
            last=own[-1] if own else None,
            pages=pages,
            state_node=own_state,
            slot=slot,
            after=after,
            num_tokens=num_tokens,
            prefix_pages=prefix_pages,
            prefix_slot=slot if state_dep is None else state_dep.slot,
            num_windows=num_windows,
        )
        if handle is not None:
            self._in_flight.append(load)
        return load

    def _windows(
        self, pages: Sequence[int], host_pages: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """The (device page, host window row) pairs of the host pages that hold their
        windowed K/V; the other device pages' windowed K/V is zeroed (the tree records
        them as lacking it)."""
        dev: list[int] = []
        rows: list[int] = []
        zero: list[int] = []
        if self._layout.spec.windows:
            for page, host_page in zip(pages, host_pages, strict=True):
                row = self._alloc.window_row(host_page)
                if row is None:
                    zero.append(page)
                else:
                    dev.append(page)
                    rows.append(row)
            self._device.clear_window_pages(zero)
        return dev, rows

    def finish(self, load: PendingLoad) -> bool:
        """Wait for ``load`` and the loads it depends on, agree on their success, and
        record the device copies (or free the reservations on every rank). Collective;
        True when the whole prefix is on device. A load finished already (as another's
        dependency) returns its outcome without a collective."""
        if load.ok is not None:
            return load.ok
        deps_ok = all([self.finish(dep) for dep in load.after])
        if load.handle is None:
            load.ok = deps_ok
            return deps_ok
        ok = load.handle.wait()
        self._in_flight.remove(load)
        load.ok = self._agree.all_true(ok) and deps_ok
        if not load.ok:
            self._alloc.free_device(load.pages, [load.slot] if load.slot is not None else [])
            self._stats.record_load(False, 0, 0.0)
            return False
        pos = 0
        for n in load.segment():
            self._tree.attach(n, Tier.DEVICE, Family.KV, load.pages[pos : pos + n.num_pages])
            pos += n.num_pages
        assert pos == len(load.pages), (pos, len(load.pages))
        if load.state_node is not None and load.slot is not None:
            self._tree.attach(load.state_node, Tier.DEVICE, Family.STATE, [load.slot])
        slots = int(load.slot is not None)
        nbytes = self._layout.copy_bytes(len(load.pages), slots, load.num_windows)
        seconds = time.monotonic() - load.started if load.pages else 0.0
        self._stats.record_load(True, nbytes, seconds)
        return True

    def settle(self, nodes: Iterable[TreeNode]) -> None:
        """Finish every load in flight that copies one of ``nodes`` (KV or state), in
        start order: before an insert that could give them a device copy of their own.
        Collective (replicated state decides which loads)."""
        wanted = set(nodes)
        for load in list(self._in_flight):
            if load.ok is None and (
                load.state_node in wanted or any(n in wanted for n in load.segment())
            ):
                self.finish(load)
