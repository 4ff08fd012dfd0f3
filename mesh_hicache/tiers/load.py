"""Loads: host (L2) -> device (L1) copies of a matched prefix, layer by layer.

A load reserves device pages for the host-only nodes of a prefix and a device slot for
the host state at its end (agreed through ``alloc``), queues one layer-wise copy on the
transfer engine, and on completion records the device copies in the tree. The caller
keeps the loaded nodes host-protected (and the prefix locked) meanwhile, so the source
rows stay valid.

Thread story: the scheduler thread; the copy runs on the transfer engine's worker, and
the model may wait on single layers (:meth:`PendingLoad.wait_layer`) from the scheduler.

Agreements: :meth:`Loader.start` 1 or 2 (device pages, then the slot: ``alloc``);
:meth:`Loader.finish` 1 (``all_true`` over the copy's success). A load that failed on
any rank frees its reservation on every rank and serves nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import StateLayout
from mesh_hicache.radix import Family, RadixTree, Tier, TreeNode
from mesh_hicache.stats import CacheStats
from mesh_hicache.tiers.alloc import CacheFull, TierAllocator
from mesh_hicache.transfer import TransferEngine, TransferHandle


@dataclass(frozen=True, slots=True)
class PendingLoad:
    """A started load: what it copies and where to (device pages/slot reserved)."""

    handle: TransferHandle | None
    """The copy; None when there was nothing to copy."""
    host_nodes: tuple[TreeNode, ...] = ()
    """Host-only nodes being loaded, top-down."""
    pages: tuple[int, ...] = ()
    """Device pages reserved for them, in order (one per page)."""
    state_node: TreeNode | None = None
    """The node whose host state is loaded (None: no state to load)."""
    slot: int | None = None
    """Device slot reserved for that state."""
    started: float = field(default_factory=time.monotonic)

    @property
    def num_tokens(self) -> int:
        """Tokens of KV this load brings to device."""
        return sum(n.num_tokens for n in self.host_nodes)

    def wait_layer(self, layer_id: int) -> bool:
        """Block until layer ``layer_id``'s part is on device (True if it succeeded)."""
        return self.handle.wait_layer(layer_id) if self.handle is not None else True


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
    ) -> None:
        self._engine = engine
        self._tree = tree
        self._alloc = alloc
        self._layout = layout
        self._agree = agree
        self._stats = stats

    def start(self, host_nodes: Sequence[TreeNode], state_node: TreeNode | None) -> PendingLoad:
        """Load the host-only ``host_nodes`` (top-down) and the host state of ``state_node``.

        Reserves device pages and a slot (agreed; ``CacheFull`` on every rank if
        impossible, with nothing reserved) and queues one layer-wise copy.
        """
        num_pages = sum(n.num_pages for n in host_nodes)
        pages = self._alloc.alloc_device_pages(num_pages)
        slot: int | None = None
        if state_node is not None:
            try:
                slot = self._alloc.alloc_device_slot()
            except CacheFull:
                self._alloc.free_device(pages=pages)
                raise
        if not pages and slot is None:
            return PendingLoad(None)
        assert self._engine is not None
        host_pages = [p for n in host_nodes for p in (n.host_indices or ())]
        slots: tuple[Sequence[int], Sequence[int]] = ((), ())
        if state_node is not None and slot is not None:
            assert state_node.mamba_host_slot is not None
            slots = ([slot], [state_node.mamba_host_slot])
        handle = self._engine.load((pages, host_pages), slots)
        return PendingLoad(handle, tuple(host_nodes), tuple(pages), state_node, slot)

    def finish(self, load: PendingLoad) -> bool:
        """Wait for ``load``, agree on its success, and record the device copies (or free
        the reservation on every rank). Collective; True when the prefix is on device."""
        ok = load.handle.wait() if load.handle is not None else True
        if not self._agree.all_true(ok):
            self._alloc.free_device(load.pages, [load.slot] if load.slot is not None else [])
            self._stats.record_load(False, 0, 0.0)
            return False
        pos = 0
        for n in load.host_nodes:
            self._tree.attach(n, Tier.DEVICE, Family.KV, load.pages[pos : pos + n.num_pages])
            pos += n.num_pages
        if load.state_node is not None and load.slot is not None:
            self._tree.attach(load.state_node, Tier.DEVICE, Family.STATE, [load.slot])
        lay = self._layout
        nbytes = len(load.pages) * lay.page_bytes + (load.slot is not None) * lay.slot_bytes
        seconds = time.monotonic() - load.started if load.pages else 0.0
        self._stats.record_load(True, nbytes, seconds)
        return True
