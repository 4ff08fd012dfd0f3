"""HiCacheController: the tiers, their write policies, load-back, L3 backup and prefetch.

DESIGN.md sections 5-8. The controller owns the device pools (L1), the host pools (L2),
the transfer engine, the radix tree and the storage backend (L3), and keeps the tree
identical on every rank of the mesh:

- Every decision that depends on rank-local state goes through ``Consensus`` over the
  whole mesh: allocation success (reserve -> agree -> commit or abort), how many
  finished transfers / storage writes to consume, the L3 hit length, how much of a
  prefetch arrived, whether a load succeeded. Each agreement is issued unconditionally,
  the same number of times on every rank, also on error paths.
- Everything else (eviction order, allocation order, tree shape) is deterministic, so
  identical call sequences give identical trees, host slots and allocations everywhere.

Why agree over the whole mesh (pp too) rather than per cache group: host slot ``s`` must
hold the same logical page on every rank, pp stages included (DESIGN.md section 4). The
bundled runtime drives every rank through the same request sequence in lockstep, so a
mesh-wide agreement never waits on a stage that is busy elsewhere.

Threads: transfers run on the transfer engine's worker; storage reads and writes run on
one storage thread (FIFO). Neither issues collectives; all agreements happen on the
scheduling thread in ``step``/``load``/``alloc_*``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from mesh_hicache.config import HiCacheConfig
from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import RegionLayout, StateLayout
from mesh_hicache.pools.allocator import PageAllocator
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools
from mesh_hicache.radix import RadixKey, RadixTree
from mesh_hicache.radix.node import EvictResult, PoolUsage, TreeNode
from mesh_hicache.spec import StateSpec
from mesh_hicache.stats import CacheStats
from mesh_hicache.storage.base import StorageBackend
from mesh_hicache.storage.factory import open_storage
from mesh_hicache.storage.keys import KeyNamespace, StorageKey
from mesh_hicache.topology import MeshTopology
from mesh_hicache.transfer import TransferEngine, TransferHandle, make_transfer_engine

logger = logging.getLogger(__name__)

#: Pages per storage read batch: the unit at which a prefetch can be stopped.
PREFETCH_BATCH_PAGES = 16


class CacheFull(RuntimeError):
    """Not enough device pages or slots even after eviction (agreed on every rank)."""


@dataclass(slots=True)
class _Backup:
    """A device -> host copy in flight: its nodes are locked and host-protected until acked."""

    handle: TransferHandle
    nodes: list[TreeNode]
    host_pages: list[int]
    host_slots: list[int]
    num_bytes: int


@dataclass(slots=True)
class _StorageWrite:
    """An L3 write in flight: its nodes stay host-protected until it is consumed."""

    future: Future[int]
    nodes: list[TreeNode]


@dataclass(slots=True)
class Prefetch:
    """An L3 -> host read in flight for one request (pages reserved in the host pool)."""

    key: RadixKey
    start_page: int
    num_pages: int
    host_pages: list[int]
    host_slot: int | None
    hashes: list[bytes]
    started: float = field(default_factory=time.monotonic)
    pages_done: int = 0
    state_ok: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)


class HiCacheController:
    """Tier management for one rank. Collective construction; see the module docstring."""

    def __init__(self, topology: MeshTopology, spec: StateSpec, config: HiCacheConfig) -> None:
        self.topology = topology
        self.spec = spec
        self.config = config
        self.page_size = spec.page_size
        self.layout = StateLayout(spec, topology, config.cp_kv)
        device = torch.device("cpu")
        if topology.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        slots = config.mamba_device_slots() if spec.has_mamba else 0
        self.device = DevicePools(
            self.layout, num_pages=config.device_pages, num_slots=slots, device=device
        )
        self.host: HostPools | None = None
        self.engine: TransferEngine | None = None
        if config.enable_host:
            host_slots = config.mamba_host_slots() if spec.has_mamba else 0
            self.host = HostPools(
                self.layout,
                num_pages=config.num_host_pages(),
                num_slots=host_slots,
                topology=topology,
            )
            self.engine = make_transfer_engine(self.device, self.host, config.transfer)
        self.tree = RadixTree(spec.page_size, spec.has_mamba)
        self.agree = Consensus.over(topology, "pp", "cp", "tp")
        self.stats = CacheStats(prefetch_policy=config.prefetch_policy)
        self.namespace = KeyNamespace(
            model_id=spec.model_id,
            dtype=str(self._state_dtype()).removeprefix("torch."),
            layout_version=config.layout_version,
            tenant=config.tenant,
        )
        self.storage: StorageBackend | None = None
        # Writes and reads get one thread each, so a prefetch never queues behind backups.
        self._writer: ThreadPoolExecutor | None = None
        self._reader: ThreadPoolExecutor | None = None
        if config.storage != "none":
            assert self.host is not None
            self.storage = open_storage(config.storage, **config.storage_options)
            for region in self._regions(paged=None):
                self.storage.register_buffer(self.host.local(region.name))
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l3-write")
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l3-read")
        self._backups: deque[_Backup] = deque()
        self._writes: deque[_StorageWrite] = deque()

    # -- allocation (reserve -> agree -> commit/abort) --------------------------------------

    def alloc_device_pages(self, n: int) -> list[int]:
        """``n`` device pages, evicting as needed; ``CacheFull`` on every rank if impossible."""
        return self._alloc(self.device.page_allocator, n, self._evict_device_pages, "device pages")

    def alloc_device_slot(self) -> int:
        """One device Mamba slot, evicting device states as needed."""
        return self._alloc(self.device.slot_allocator, 1, self._evict_device_slots, "slots")[0]

    def try_alloc_host(self, pages: int, slots: int) -> tuple[list[int], list[int]] | None:
        """Host pages and slots (evicting host copies as needed), or None on every rank."""
        assert self.host is not None
        try:
            got_pages = self._alloc(
                self.host.page_allocator, pages, self._evict_host_pages, "host pages"
            )
        except CacheFull:
            return None
        try:
            got_slots = self._alloc(
                self.host.slot_allocator, slots, self._evict_host_slots, "host slots"
            )
        except CacheFull:
            self.host.page_allocator.free(got_pages)
            return None
        return got_pages, got_slots

    def _alloc(
        self,
        allocator: PageAllocator,
        n: int,
        evict: Callable[[int], None],
        what: str,
    ) -> list[int]:
        if n == 0:
            return []
        got = self._try_alloc(allocator, n, evict)
        ok = self.agree.all_true(got is not None)
        if not ok and (self._backups or self._writes):
            # Nodes of in-flight backups / storage writes stay locked or host-protected
            # until consumed, so eviction skipped them: wait for them and retry rather
            # than fail. The queues are consumed by agreement, so their lengths (and
            # this branch) are the same on every rank.
            if got is not None:
                allocator.free(got)
            self.flush()
            got = self._try_alloc(allocator, n, evict)
            ok = self.agree.all_true(got is not None)
        if not ok:
            if got is not None:
                allocator.free(got)
            raise CacheFull(f"cannot allocate {n} {what} on every rank")
        assert got is not None
        return got

    @staticmethod
    def _try_alloc(
        allocator: PageAllocator, n: int, evict: Callable[[int], None]
    ) -> list[int] | None:
        if allocator.num_free < n:
            # Deterministic: the same tree evicts the same victims on every rank.
            evict(n - allocator.num_free)
        return allocator.allocate(n) if allocator.can_allocate(n) else None

    def _free(self, result: EvictResult) -> None:
        self.device.page_allocator.free(result.device_pages)
        self.device.slot_allocator.free(result.mamba_device_slots)
        if self.host is not None:
            self.host.page_allocator.free(result.host_pages)
            self.host.slot_allocator.free(result.mamba_host_slots)
        self.stats.evicted_device_pages += len(result.device_pages)
        self.stats.evicted_host_pages += len(result.host_pages)
        self.stats.evicted_device_slots += len(result.mamba_device_slots)
        self.stats.evicted_host_slots += len(result.mamba_host_slots)

    def _evict_device_pages(self, n: int) -> None:
        before = self._write_back if self.config.write_policy == "write_back" else None
        self._free(self.tree.evict_device(n, before_evict=before))

    def _evict_device_slots(self, n: int) -> None:
        before = self._write_back if self.config.write_policy == "write_back" else None
        self._free(self.tree.evict_mamba_device(n, before_evict=before))

    def _evict_host_pages(self, n: int) -> None:
        self._free(self.tree.evict_host(n))

    def _evict_host_slots(self, n: int) -> None:
        self._free(self.tree.evict_mamba_host(n))

    # -- device -> host backup (write policies) ---------------------------------------------

    def backup_path(self, node: TreeNode) -> None:
        """Back up every node on ``node``'s path that lacks a host copy of its KV or state."""
        self.backup_nodes(self.tree.nodes_on_path(node))

    def backup_nodes(self, nodes: Sequence[TreeNode]) -> None:
        """Queue device -> host copies of those ``nodes`` that lack a host copy (agreed)."""
        if self.host is None:
            return
        todo = [
            n
            for n in nodes
            if n.device_indices is not None
            and (n.host_indices is None or self._needs_state_backup(n))
        ]
        self._backup(todo, wait=False)

    def _needs_state_backup(self, n: TreeNode) -> bool:
        return n.mamba_device_slot is not None and n.mamba_host_slot is None

    def _write_back(self, node: TreeNode) -> None:
        """``before_evict`` hook of write-back: copy the victim to host before it goes."""
        self._backup([node], wait=True)

    def _backup(self, nodes: list[TreeNode], wait: bool) -> None:
        assert self.host is not None and self.engine is not None
        kv_nodes = [n for n in nodes if n.host_indices is None]
        state_nodes = [n for n in nodes if self._needs_state_backup(n)]
        num_pages = sum(n.num_pages for n in kv_nodes)
        if num_pages == 0 and not state_nodes:
            return
        got = self.try_alloc_host(num_pages, len(state_nodes))
        if got is None:
            self.stats.backup_skipped_host_full += 1
            return
        host_pages, host_slots = got
        dev_pages: list[int] = []
        pos = 0
        for n in kv_nodes:
            assert n.device_indices is not None
            dev_pages.extend(n.device_indices)
            self.tree.set_host(n, host_pages[pos : pos + n.num_pages])
            pos += n.num_pages
        dev_slots = []
        for n, slot in zip(state_nodes, host_slots, strict=True):
            assert n.mamba_device_slot is not None
            dev_slots.append(n.mamba_device_slot)
            self.tree.set_mamba_host(n, slot)
        protected = list(dict.fromkeys(kv_nodes + state_nodes))
        for n in protected:
            self.tree.lock(n)
            self.tree.protect_host(n)
        handle = self.engine.backup((dev_pages, host_pages), (dev_slots, host_slots))
        nbytes = self._kv_bytes(len(dev_pages)) + self._slot_bytes(len(dev_slots))
        self._backups.append(_Backup(handle, protected, host_pages, host_slots, nbytes))
        if wait:
            self.step(block=True)

    # -- consuming finished work (agreed) ---------------------------------------------------

    def step(self, block: bool = False) -> None:
        """Consume finished backups and storage writes, the same number on every rank.

        ``block=True`` first waits until this rank's pending work is done (flush).
        Two agreements per queue, always issued, in a fixed order.
        """
        if block:
            for b in self._backups:
                b.handle.wait()
        local = 0
        for b in self._backups:
            if not b.handle.done:
                break
            local += 1
        count = self.agree.min(local)
        done = [self._backups.popleft() for _ in range(count)]
        oks = self.agree.min_list([int(b.handle.ok) for b in done])
        for b, ok in zip(done, oks, strict=True):
            self._finish_backup(b, bool(ok))
        if block:
            for w in self._writes:
                w.future.exception()
        local = 0
        for w in self._writes:
            if not w.future.done():
                break
            local += 1
        for _ in range(self.agree.min(local)):
            w = self._writes.popleft()
            for n in w.nodes:
                self.tree.release_host(n)

    def _finish_backup(self, b: _Backup, ok: bool) -> None:
        for n in b.nodes:
            self.tree.unlock(n)
        if not ok:
            self.stats.backup_failures += 1
            logger.warning(
                "device -> host backup failed (%s); its host copies are dropped",
                b.handle.error or "on another rank",
            )
            self._undo_backup(b)
            return
        self.stats.bytes_device_to_host += b.num_bytes
        if self.storage is not None and self._writer is not None:
            keys, rows = self._storage_items(self._holders(b))
            future = self._writer.submit(self._put, keys, rows)
            self._writes.append(_StorageWrite(future, b.nodes))
            return
        for n in b.nodes:
            self.tree.release_host(n)

    def _holders(self, b: _Backup) -> list[TreeNode]:
        """The nodes holding ``b``'s host pages or slots now: a node split while the copy
        was in flight holds them in two parts, both on the path of the original."""
        pages, slots = set(b.host_pages), set(b.host_slots)
        found: dict[int, TreeNode] = {}
        for n in b.nodes:
            for m in self.tree.nodes_on_path(n):
                kv = m.host_indices is not None and set(m.host_indices) <= pages
                if kv or m.mamba_host_slot in slots:
                    found[m.id] = m
        return list(found.values())

    def _undo_backup(self, b: _Backup) -> None:
        """A backup failed on some rank: drop its host copies everywhere."""
        assert self.host is not None
        for n in b.nodes:
            self.tree.release_host(n)
        pages, slots = set(b.host_pages), set(b.host_slots)
        for m in self._holders(b):
            if m.host_indices is not None and set(m.host_indices) <= pages:
                self.host.page_allocator.free(self.tree.clear_host(m, invalid=True))
            if m.mamba_host_slot in slots:
                self.host.slot_allocator.free([self.tree.clear_mamba_host(m)])

    def flush(self) -> None:
        """Wait for every backup and storage write on every rank and consume them."""
        while self._backups or self._writes:
            self.step(block=True)

    # -- L3: keys, writes, reads ------------------------------------------------------------

    def _regions(self, paged: bool | None) -> list[RegionLayout]:
        """This rank's regions that hold layers (optionally only paged / only slot ones)."""
        return [
            r
            for r in self.layout.regions
            if r.local_layer_ids and (paged is None or r.paged == paged)
        ]

    def _key(self, region: RegionLayout, page_hash: bytes) -> StorageKey:
        return StorageKey(self.namespace, region.name.value, page_hash, region.global_slice)

    def _storage_items(self, nodes: list[TreeNode]) -> tuple[list[StorageKey], list[torch.Tensor]]:
        """Keys and host rows of what this rank writes for ``nodes`` (elected writers only)."""
        assert self.host is not None
        keys: list[StorageKey] = []
        rows: list[torch.Tensor] = []
        for n in nodes:
            for region in self._regions(paged=True):
                if not region.is_writer or n.host_indices is None:
                    continue
                for h, page in zip(n.hashes, n.host_indices, strict=True):
                    keys.append(self._key(region, h))
                    rows.append(self.host.row(region.name, page))
            if n.mamba_host_slot is not None and n.last_hash is not None:
                for region in self._regions(paged=False):
                    if region.is_writer:
                        keys.append(self._key(region, n.last_hash))
                        rows.append(self.host.row(region.name, n.mamba_host_slot))
        return keys, rows

    def _put(self, keys: list[StorageKey], rows: list[torch.Tensor]) -> int:
        assert self.storage is not None
        if not keys:
            return 0
        flags = self.storage.put(keys, rows)
        written = sum(r.numel() * r.element_size() for r, ok in zip(rows, flags, strict=True) if ok)
        with self.stats.lock:
            self.stats.storage_put_objects += sum(flags)
            self.stats.bytes_host_to_storage += written
            self.stats.storage_put_dropped += len(flags) - sum(flags)
        return written

    def query_storage(self, hashes: Sequence[bytes]) -> int:
        """How many of the pages ``hashes`` (chained page hashes beyond what L1/L2 hold)
        every rank can read from L3, ending at a Mamba state when the model has one.
        Agreed (1 or 2 collectives, always the same count)."""
        local = 0
        if self.storage is not None and hashes:
            local = self._local_storage_hit(hashes)
        pages = self.agree.min(local)
        if pages and self.spec.has_mamba:
            has_state = True
            if self.storage is not None:
                has_state = self._state_exists(hashes[pages - 1])
            if not self.agree.all_true(has_state):
                pages = 0
        return pages

    def _local_storage_hit(self, hashes: Sequence[bytes]) -> int:
        assert self.storage is not None
        n = len(hashes)
        for region in self._regions(paged=True):
            n = min(n, self.storage.exists([self._key(region, h) for h in hashes[:n]]))
        if self.spec.has_mamba:
            while n > 0 and not self._state_exists(hashes[n - 1]):
                n -= 1
        return n

    def _state_exists(self, page_hash: bytes) -> bool:
        assert self.storage is not None
        return all(
            self.storage.exists_one(self._key(r, page_hash)) for r in self._regions(paged=False)
        )

    def start_prefetch(
        self, key: RadixKey, start_page: int, hashes: Sequence[bytes]
    ) -> Prefetch | None:
        """Reserve host pages and a slot (agreed) and start reading the KV pages ``hashes``
        (pages ``start_page`` onward of ``key``) from L3 in the background, then the state
        at their end."""
        num_pages = len(hashes)
        got = self.try_alloc_host(num_pages, 1 if self.spec.has_mamba else 0)
        if got is None:
            self.stats.prefetch_skipped_host_full += 1
            return None
        assert self._reader is not None
        pages, slots = got
        job = Prefetch(key, start_page, num_pages, pages, slots[0] if slots else None, list(hashes))
        self._reader.submit(self._run_prefetch, job)
        return job

    def _run_prefetch(self, job: Prefetch) -> None:
        try:
            for lo in range(0, job.num_pages, PREFETCH_BATCH_PAGES):
                if job.cancel.is_set():
                    return
                hi = min(lo + PREFETCH_BATCH_PAGES, job.num_pages)
                job.pages_done = lo + self._read_pages(job, lo, hi)
                if job.pages_done < hi:
                    return
            job.state_ok = self._read_state(job, job.num_pages)
        finally:
            job.finished.set()

    def _read_pages(self, job: Prefetch, lo: int, hi: int) -> int:
        """Read pages ``[lo, hi)`` of every paged region; returns how many leading pages
        arrived whole (all regions)."""
        assert self.storage is not None and self.host is not None
        keys: list[StorageKey] = []
        rows: list[torch.Tensor] = []
        regions = self._regions(paged=True)
        for region in regions:
            for i in range(lo, hi):
                keys.append(self._key(region, job.hashes[i]))
                rows.append(self.host.row(region.name, job.host_pages[i]))
        if not keys:
            return hi - lo
        flags = self.storage.get(keys, rows)
        self._count_read(rows, flags)
        whole = [all(flags[r * (hi - lo) + i] for r in range(len(regions))) for i in range(hi - lo)]
        return whole.index(False) if False in whole else hi - lo

    def _read_state(self, job: Prefetch, pages: int) -> bool:
        """Read the state stored at the end of page ``pages`` into the job's host slot."""
        assert self.storage is not None and self.host is not None
        if job.host_slot is None:
            return True
        regions = self._regions(paged=False)
        keys = [self._key(r, job.hashes[pages - 1]) for r in regions]
        rows = [self.host.row(r.name, job.host_slot) for r in regions]
        flags = self.storage.get(keys, rows) if keys else []
        self._count_read(rows, flags)
        return all(flags)

    def _count_read(self, rows: list[torch.Tensor], flags: list[bool]) -> None:
        nbytes = sum(r.numel() * r.element_size() for r, ok in zip(rows, flags, strict=True) if ok)
        with self.stats.lock:
            self.stats.bytes_storage_to_host += nbytes
            self.stats.storage_get_misses += len(flags) - sum(flags)

    def cancel_prefetch(self, job: Prefetch) -> None:
        """Abandon a prefetch (its request was aborted): stop it and free its reservation.

        Every rank abandons the same request, so no agreement is needed."""
        job.cancel.set()
        job.finished.wait()
        self._free_prefetch(job, 0)
        self.stats.record_prefetch(self.config.prefetch_policy, "aborted")

    def _free_prefetch(self, job: Prefetch, keep_pages: int) -> None:
        assert self.host is not None
        self.host.page_allocator.free(job.host_pages[keep_pages:])
        if job.host_slot is not None and keep_pages == 0:
            self.host.slot_allocator.free([job.host_slot])

    def finish_prefetch(self, job: Prefetch) -> int:
        """Apply the stop policy, agree on what arrived and insert it host-only.

        The kept prefix ends at the deepest page boundary that every rank has the KV up
        to and a state at (DESIGN.md section 5): a prefetch that got KV but no state
        there is cut back to a shallower stored state, or to nothing. Returns the tokens
        now on host beyond the job's start. Collective (1 or 2 agreements).
        """
        policy = self.config.prefetch_policy
        if policy == "wait_complete":
            job.finished.wait()
        elif policy == "timeout":
            tokens = job.num_pages * self.page_size
            budget = (
                self.config.prefetch_timeout_base_s
                + self.config.prefetch_timeout_per_1k_s * tokens / 1000
            )
            job.finished.wait(max(0.0, budget - (time.monotonic() - job.started)))
        job.cancel.set()
        job.finished.wait()  # at most one batch more: the pages must not change under us
        complete = job.pages_done == job.num_pages and job.state_ok
        local = job.num_pages if complete else self._deepest_state(job, job.pages_done)
        pages = self.agree.min(local)
        if pages:
            ok = complete if pages == job.num_pages else self._read_state(job, pages)
            if not self.agree.all_true(ok):
                pages = 0
        outcome = "completed" if pages == job.num_pages else "partial" if pages else "aborted"
        self.stats.record_prefetch(policy, outcome)
        self._free_prefetch(job, pages)
        if not pages:
            return 0
        end = (job.start_page + pages) * self.page_size
        prefix = RadixKey(job.key.tokens[:end], job.key.namespace)
        result = self.tree.insert(
            prefix,
            host_indices=job.host_pages[:pages],
            host_first_page=job.start_page,
            mamba_host_slot=job.host_slot,
        )
        assert self.host is not None
        self.host.page_allocator.free(result.unused_host_indices)
        if job.host_slot is not None and not result.mamba_host_taken:
            self.host.slot_allocator.free([job.host_slot])
        return pages * self.page_size

    def _deepest_state(self, job: Prefetch, pages: int) -> int:
        """Deepest boundary within the first ``pages`` read pages that has a stored state."""
        if not self.spec.has_mamba or self.storage is None:
            return pages
        while pages > 0 and not self._state_exists(job.hashes[pages - 1]):
            pages -= 1
        return pages

    # -- host -> device load ----------------------------------------------------------------

    def start_load(
        self, host_nodes: Sequence[TreeNode], state_node: TreeNode | None
    ) -> tuple[TransferHandle | None, list[int], int | None]:
        """Load the host-only ``host_nodes`` (top-down) and the host state of ``state_node``.

        Reserves device pages/slot (agreed; ``CacheFull`` on every rank if impossible) and
        queues one layer-wise load. Returns (handle or None if nothing to load, the
        reserved device pages, the reserved device slot).
        """
        num_pages = sum(n.num_pages for n in host_nodes)
        pages = self.alloc_device_pages(num_pages)
        slot: int | None = None
        if state_node is not None:
            try:
                slot = self.alloc_device_slot()
            except CacheFull:
                self.device.page_allocator.free(pages)
                raise
        if not pages and slot is None:
            return None, [], None
        assert self.engine is not None
        host_pages = [p for n in host_nodes for p in (n.host_indices or ())]
        slots: tuple[Sequence[int], Sequence[int]] = ((), ())
        if state_node is not None and slot is not None:
            assert state_node.mamba_host_slot is not None
            slots = ([slot], [state_node.mamba_host_slot])
        handle = self.engine.load((pages, host_pages), slots)
        return handle, pages, slot

    def finish_load(
        self,
        handle: TransferHandle | None,
        host_nodes: Sequence[TreeNode],
        pages: list[int],
        state_node: TreeNode | None,
        slot: int | None,
    ) -> bool:
        """Wait for a load, agree on its success, and record the device copies (or free)."""
        ok = handle.wait() if handle is not None else True
        if not self.agree.all_true(ok):
            self.device.page_allocator.free(pages)
            if slot is not None:
                self.device.slot_allocator.free([slot])
            self.stats.load_failures += 1
            return False
        pos = 0
        for n in host_nodes:
            self.tree.attach_device(n, pages[pos : pos + n.num_pages])
            pos += n.num_pages
        if state_node is not None and slot is not None:
            self.tree.attach_mamba_device(state_node, slot)
        self.stats.bytes_host_to_device += self._kv_bytes(len(pages))
        self.stats.bytes_host_to_device += self._slot_bytes(0 if slot is None else 1)
        return True

    # -- misc -------------------------------------------------------------------------------

    def _state_dtype(self) -> torch.dtype:
        if self.spec.kv is not None:
            return self.spec.kv.dtype
        assert self.spec.mamba is not None
        return self.spec.mamba.conv_dtype

    def _kv_bytes(self, pages: int) -> int:
        return pages * sum(r.row_bytes for r in self._regions(paged=True))

    def _slot_bytes(self, slots: int) -> int:
        return slots * sum(r.row_bytes for r in self._regions(paged=False))

    def check_integrity(
        self, held_pages: Sequence[int] = (), held_slots: Sequence[int] = ()
    ) -> None:
        """Tree invariants plus exact pool accounting: tree + free + held = capacity.

        ``held_*``: device pages/slots owned by open requests. Host pools must have no
        reservation in flight (call after ``flush`` with no prefetch running)."""

        def usage(allocator: PageAllocator, held: Sequence[int] = ()) -> PoolUsage:
            free = [i for i in range(allocator.capacity) if allocator.is_free(i)]
            return PoolUsage(capacity=allocator.capacity, free=free, held=held)

        host = self.host
        self.tree.check_integrity(
            device=usage(self.device.page_allocator, held_pages),
            host=usage(host.page_allocator) if host is not None else None,
            mamba_device=usage(self.device.slot_allocator, held_slots),
            mamba_host=usage(host.slot_allocator) if host is not None else None,
        )

    def stats_snapshot(self) -> CacheStats:
        """The counters, with the storage backend's error count and degraded flag."""
        snap = self.stats.snapshot()
        if self.storage is not None:
            snap.storage_errors = self.storage.stats.errors
            snap.storage_degraded = bool(getattr(self.storage, "degraded", False))
        return snap

    def close(self) -> None:
        """Flush, then stop the transfer worker and the storage thread; idempotent."""
        self.flush()
        if self.engine is not None:
            self.engine.close()
        for pool in (self._writer, self._reader):
            if pool is not None:
                pool.shutdown(wait=True)
        self._writer = self._reader = None
        if self.storage is not None:
            self.storage.close()
            self.storage = None
