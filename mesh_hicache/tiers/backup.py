"""The backup queue (device -> host -> L3) and the one owner of the write policy.

Write policy (docs/DESIGN.md section 7), decided here and nowhere else:

- ``write_through``: :meth:`BackupQueue.on_insert` backs up the inserted path;
- ``write_through_selective``: :meth:`BackupQueue.on_match` backs up nodes on their
  second hit;
- ``write_back``: :meth:`BackupQueue.write_back_hook` hands eviction a callback that
  copies a device victim to host (and waits for the copy) before it goes. With
  ``value_gate`` only when it is worth its bytes there (:meth:`BackupQueue.worth_host`:
  the eviction policy ranks it above the host tier's own next victim); off by default,
  as it measured lower hit rates on the replayed traces (docs/performance.md).

With sliding-window layers a backup keeps a page's windowed K/V only where a resume needs
it (``BackupQueue._window_plan``, rules in ``window_rule.py``), in window rows of its own.

A backup reserves host pages/slots (agreed), records them in the tree at once, and keeps
its nodes locked (device copy stays) and host-protected (host copy stays) through a
:class:`~mesh_hicache.tiers.lease.Lease` until the copy is consumed; with L3, the host
protection lasts until the L3 write is consumed too. A failed copy drops its host copies
everywhere (they never became valid).

Thread story: the scheduler thread only. Copies run on the transfer engine's worker and
L3 writes on the storage tier's writer thread; this module only submits them and reads
their completion.

Agreements: :meth:`BackupQueue.step` consumes finished work the same number of times on
every rank: MIN over the count of leading finished copies, MIN over their success flags,
then (with L3) MIN over the count of leading finished writes; always in that order. A
backup's host reservation agrees through ``alloc``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from mesh_hicache.choices import WritePolicy
from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import StateLayout
from mesh_hicache.radix import EvictTarget, Family, RadixTree, Tier, TreeNode
from mesh_hicache.stats import CacheStats
from mesh_hicache.tiers.alloc import TierAllocator
from mesh_hicache.tiers.l3 import InFlight, StorageTier
from mesh_hicache.tiers.lease import Lease
from mesh_hicache.tiers.window_rule import WindowRule
from mesh_hicache.transfer import TransferEngine, TransferHandle

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Backup:
    """A device -> host copy in flight; ``lease`` locks and host-protects ``nodes``."""

    handle: TransferHandle
    nodes: list[TreeNode]
    lease: Lease
    host_pages: list[int]
    host_slots: list[int]
    num_bytes: int
    fills: list[tuple[int, int]]
    """(host page, window row) of ancestors' host copies given their windowed K/V by
    this copy (a branch point's window): recorded in the tree once the copy succeeded."""


@dataclass(slots=True)
class _StorageWrite:
    """An L3 write in flight; ``lease`` keeps its nodes host-protected until consumed."""

    future: Future[int]
    lease: Lease


class BackupQueue:
    """Device -> host backups and their L3 writes, in FIFO order; see the module docstring.

    ``engine`` is None without a host tier: then nothing is ever backed up.
    """

    def __init__(
        self,
        policy: WritePolicy,
        tree: RadixTree,
        engine: TransferEngine | None,
        alloc: TierAllocator,
        l3: StorageTier | None,
        layout: StateLayout,
        agree: Consensus,
        stats: CacheStats,
        window: WindowRule | None = None,
    ) -> None:
        self.policy = policy
        """The write policy; tests may switch it between requests (same on every rank)."""
        self._tree = tree
        self._engine = engine
        self._alloc = alloc
        self._l3 = l3
        self._layout = layout
        self._agree = agree
        self._stats = stats
        self._window = window
        self._backups: deque[_Backup] = deque()
        self._writes: deque[_StorageWrite] = deque()
        self._copying_pages: set[int] = set()
        self._copying_slots: set[int] = set()
        """Host pages and slots of the backups not yet consumed (their copies may be
        incomplete): an L3 write skips them."""
        self.value_gate = False
        """Whether write-back asks ``worth_host`` first (tests and benchmarks may set it;
        the same on every rank)."""
        self.refused_write_backs = 0
        """Device victims ``worth_host`` kept off the host tier (same on every rank)."""

    # -- the write policy -------------------------------------------------------------------

    def on_match(self, nodes: Sequence[TreeNode]) -> None:
        """A request matched ``nodes`` (hit counts already advanced). Collective."""
        if self.policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            self.backup_nodes([n for n in nodes if n.hit_count >= 2])

    def on_insert(self, node: TreeNode) -> None:
        """A request inserted the path ending at ``node``. Collective."""
        if self.policy is WritePolicy.WRITE_THROUGH:
            self.backup_nodes(self._tree.nodes_on_path(node))

    def write_back_hook(self) -> Callable[[TreeNode], None] | None:
        """The callback eviction offers device victims without a host copy, or None."""
        return self._write_back if self.policy is WritePolicy.WRITE_BACK else None

    def worth_host(self, node: TreeNode) -> bool:
        """Whether a device victim is worth its bytes on the host tier: the eviction
        policy's key for it there (its pages, or its state alone when only that goes)
        is not below the first entry of the host queues, i.e. the host would not have to
        evict something it values more to take it. True when the host has no candidate.
        Reads replicated tree state only (the same on every rank)."""
        tree = self._tree
        target = EvictTarget.HOST_KV if node.host_indices is None else EvictTarget.MAMBA_HOST
        heads = [tree.eviction_head(t) for t in (EvictTarget.HOST_KV, EvictTarget.MAMBA_HOST)]
        floors = [h[:-2] for h in heads if h is not None]
        return not floors or tree.eviction_key(node, target)[:-1] >= min(floors)

    def _write_back(self, node: TreeNode) -> None:
        if self.value_gate and not self.worth_host(node):
            self.refused_write_backs += 1
            return
        # The host allocation below may evict host copies: keep it from removing this very
        # victim (a host-only childless node that still holds a device state).
        self._tree.protect_host(node)
        try:
            self._backup([node], wait=True)
        finally:
            self._tree.release_host(node)

    # -- queueing ---------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether copies or L3 writes are still queued (same on every rank)."""
        return bool(self._backups or self._writes)

    def leases(self) -> list[Lease]:
        """The leases of the copies and L3 writes in flight (for ``check_integrity``)."""
        return [b.lease for b in self._backups] + [w.lease for w in self._writes]

    def backup_nodes(self, nodes: Sequence[TreeNode]) -> None:
        """Queue device -> host copies of those ``nodes`` that lack a host copy (agreed)."""
        if self._engine is None:
            return
        todo = [
            n
            for n in nodes
            if n.device_indices is not None and (n.host_indices is None or _needs_state_backup(n))
        ]
        self._backup(todo, wait=False)

    def _backup(self, nodes: list[TreeNode], wait: bool) -> None:
        assert self._engine is not None
        kv_nodes = [n for n in nodes if n.host_indices is None]
        state_nodes = [n for n in nodes if _needs_state_backup(n)]
        num_pages = sum(n.num_pages for n in kv_nodes)
        if num_pages == 0 and not state_nodes:
            return
        keep, fills = self._window_plan(kv_nodes, state_nodes)
        num_windows = sum(map(len, keep.values())) + len(fills)
        got = self._alloc.try_alloc_host(num_pages, len(state_nodes), num_windows)
        if got is None:
            self._stats.record_skip("backup")
            return
        dev_pages: list[int] = []
        dev_windows: list[int] = []
        rows = iter(got.windows)
        pos = 0
        for n in kv_nodes:
            assert n.device_indices is not None
            dev_pages.extend(n.device_indices)
            host = got.pages[pos : pos + n.num_pages]
            pos += n.num_pages
            if self._window is None:
                self._tree.attach(n, Tier.HOST, Family.KV, host)
                continue
            offsets = keep[n]
            gaps = _others(offsets, n.num_pages)
            self._tree.attach(n, Tier.HOST, Family.KV, host, window_missing=gaps)
            dev_windows.extend(n.device_indices[i] for i in offsets)
            self._alloc.bind_windows([host[i] for i in offsets], [next(rows) for _ in offsets])
        filled: list[tuple[int, int]] = []
        for owner, i in fills:
            if owner.host_indices is None:
                continue  # the allocation above evicted that host copy (on every rank)
            assert owner.device_indices is not None
            dev_windows.append(owner.device_indices[i])
            filled.append((owner.host_indices[i], next(rows)))
        spare = list(rows)  # the rows of dropped fills
        self._alloc.free_host(windows=spare)
        host_windows = got.windows[: len(got.windows) - len(spare)]
        dev_slots = []
        for n, slot in zip(state_nodes, got.slots, strict=True):
            assert n.mamba_device_slot is not None
            dev_slots.append(n.mamba_device_slot)
            self._tree.attach(n, Tier.HOST, Family.STATE, [slot])
        held = list(dict.fromkeys(kv_nodes + state_nodes))
        lease = Lease(self._tree)
        for n in held:
            lease.hold(n)
        handle = self._engine.backup(
            (dev_pages, got.pages), (dev_slots, got.slots), (dev_windows, host_windows)
        )
        self._copying_pages.update(got.pages)
        self._copying_slots.update(got.slots)
        nbytes = self._layout.copy_bytes(len(dev_pages), len(dev_slots), len(dev_windows))
        self._backups.append(_Backup(handle, held, lease, got.pages, got.slots, nbytes, filled))
        if wait:
            self.step(block=True)

    # -- consuming finished work (agreed) ---------------------------------------------------

    def step(self, block: bool = False) -> None:
        """Consume finished backups and L3 writes, the same number on every rank.

        ``block=True`` first waits until this rank's queued work is done.
        """
        if block:
            for b in self._backups:
                b.handle.wait()
        local = 0
        for b in self._backups:
            if not b.handle.done:
                break
            local += 1
        count = self._agree.min(local)
        done = [self._backups.popleft() for _ in range(count)]
        oks = self._agree.min_list([int(b.handle.ok) for b in done])
        for b, ok in zip(done, oks, strict=True):
            self._finish_backup(b, bool(ok))
        if self._l3 is None:
            return
        if block:
            for w in self._writes:
                w.future.exception()
        local = 0
        for w in self._writes:
            if not w.future.done():
                break
            local += 1
        for _ in range(self._agree.min(local)):
            self._writes.popleft().lease.release_host()

    def flush(self) -> None:
        """Wait for every backup and L3 write on every rank and consume them. Collective."""
        while self.pending:
            self.step(block=True)

    def _finish_backup(self, b: _Backup, ok: bool) -> None:
        b.lease.unlock()
        self._copying_pages.difference_update(b.host_pages)
        self._copying_slots.difference_update(b.host_slots)
        self._stats.record_backup(ok, b.num_bytes)
        if not ok:
            logger.warning(
                "device -> host backup failed (%s); its host copies are dropped",
                b.handle.error or "on another rank",
            )
            self._alloc.free_host(windows=[row for _, row in b.fills])
            self._undo(b)
            return
        if b.fills:
            self._fill(b)
        if self._l3 is not None:
            copying = InFlight(self._copying_pages, self._copying_slots)
            future = self._l3.write(self._holders(b), copying)
            self._writes.append(_StorageWrite(future, b.lease))
            return
        b.lease.release_host()

    # -- windowed pages --------------------------------------------------------------------

    def _window_plan(
        self, kv_nodes: list[TreeNode], state_nodes: list[TreeNode]
    ) -> tuple[dict[TreeNode, tuple[int, ...]], list[tuple[TreeNode, int]]]:
        """Which windowed pages a backup keeps on host: per node of ``kv_nodes``, the
        offsets its end and the checkpoints need (``WindowRule.write_offsets``); and the
        pages a resume at the end of each backed-up node (and the start of each KV one)
        needs: in a node of the same backup, kept with it; in an ancestor already on host
        without them (a branch point, a new state's boundary), copied from its device copy
        ("fills"). Pages a device copy lacks are never kept. Empty without windowed
        layers. Replicated tree state only: the same on every rank."""
        rule = self._window
        if rule is None:
            return {}, []
        keep = {n: set(rule.write_offsets(n)) for n in kv_nodes}
        fills: dict[tuple[int, int], tuple[TreeNode, int]] = {}
        for n in dict.fromkeys([*kv_nodes, *state_nodes]):
            bounds = [n.prefix_len, n.prefix_len - n.num_tokens] if n in keep else [n.prefix_len]
            for b in bounds:
                for owner, i in rule.resume_pages(n, b):
                    if i in owner.window_missing:
                        continue  # the device copy lacks it too
                    if owner in keep:
                        keep[owner].add(i)
                    elif owner.host_indices is not None and i in owner.host_window_missing:
                        fills[(owner.id, i)] = (owner, i)
        return {n: tuple(sorted(o)) for n, o in keep.items()}, list(fills.values())

    def _fill(self, b: _Backup) -> None:
        """Record the ancestors' windowed pages ``b`` copied: the nodes holding those host
        pages now (on the path of ``b``'s nodes, maybe split meanwhile) have them."""
        rows = dict(b.fills)
        # Another backup in flight may have filled the same page first: keep its row.
        spare = [rows.pop(p) for p in list(rows) if self._alloc.window_row(p) is not None]
        self._alloc.free_host(windows=spare)
        self._alloc.bind_windows(list(rows), list(rows.values()))
        seen: set[int] = set()
        for n in b.nodes:
            for m in self._tree.nodes_on_path(n):
                if m.id in seen or m.host_indices is None:
                    continue
                seen.add(m.id)
                offsets = [i for i, p in enumerate(m.host_indices) if p in rows]
                if offsets:
                    self._tree.fill_window(m, Tier.HOST, offsets)

    def _holders(self, b: _Backup) -> list[TreeNode]:
        """The nodes holding ``b``'s host pages or slots now: a node split while the copy
        was in flight holds them in two parts, both on the path of the original."""
        pages, slots = set(b.host_pages), set(b.host_slots)
        found: dict[int, TreeNode] = {}
        for n in b.nodes:
            for m in self._tree.nodes_on_path(n):
                kv = m.host_indices is not None and set(m.host_indices) <= pages
                if kv or m.mamba_host_slot in slots:
                    found[m.id] = m
        return list(found.values())

    def _undo(self, b: _Backup) -> None:
        """A backup failed on some rank: drop its host copies everywhere."""
        b.lease.release_host()
        pages, slots = set(b.host_pages), set(b.host_slots)
        for m in self._holders(b):
            if m.host_indices is not None and set(m.host_indices) <= pages:
                self._alloc.free_host(
                    pages=self._tree.detach(m, Tier.HOST, Family.KV, invalid=True)
                )
            if m.mamba_host_slot in slots:
                self._alloc.free_host(slots=self._tree.detach(m, Tier.HOST, Family.STATE))


def _others(offsets: Sequence[int], num_pages: int) -> list[int]:
    """The offsets of ``[0, num_pages)`` not in ``offsets``."""
    kept = set(offsets)
    return [i for i in range(num_pages) if i not in kept]


def _needs_state_backup(n: TreeNode) -> bool:
    return n.mamba_device_slot is not None and n.mamba_host_slot is None
