"""HiCacheController: builds the tiers of one rank, wires them, checks them, closes them.

docs/DESIGN.md sections 5-8. The controller owns the device pools (L1), the host pools (L2),
the transfer engine, the radix tree and the storage backend (L3) and hands them to the
parts in ``mesh_hicache/tiers/``, one concern each:

- ``tiers/alloc.py``: agreed allocation and eviction (``CacheFull``);
- ``tiers/backup.py``: the backup queue and the write policy;
- ``tiers/l3.py``: storage keys, elected writes, the existence query, prefetch;
- ``tiers/load.py``: host -> device loads;
- ``tiers/lease.py`` and ``tiers/requests.py``: what a request holds and its steps.

The tree stays identical on every rank of the mesh: every decision that depends on
rank-local state goes through ``Consensus`` over the whole mesh (reserve -> agree ->
commit or abort), each agreement issued unconditionally, the same number of times on
every rank, also on error paths; everything else (eviction order, allocation order,
tree shape) is deterministic, so identical call sequences give identical trees, host
slots and allocations everywhere. Each tier's module docstring lists its agreements.

Why agree over the whole mesh (pp too) rather than per cache group: host slot ``s`` must
hold the same logical page on every rank, pp stages included (docs/DESIGN.md section 4). The
bundled runtime drives every rank through the same request sequence in lockstep, so a
mesh-wide agreement never waits on a stage that is busy elsewhere.

Threads: transfers run on the transfer engine's worker; L3 writes and reads on the
storage tier's two threads. None issues collectives; all agreements happen on the
scheduling thread.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from mesh_hicache.choices import PrefetchPolicy, StorageKind, WritePolicy
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools.allocator import PageAllocator
from mesh_hicache.pools.arena import ArenaIds, agreed_plan
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools
from mesh_hicache.radix import PoolUsage, RadixKey, RadixTree
from mesh_hicache.radix.eviction import CostModel
from mesh_hicache.radix.policies import make_policy
from mesh_hicache.spec import StateSpec
from mesh_hicache.stats import CacheStats
from mesh_hicache.storage.factory import open_storage
from mesh_hicache.storage.guard import GuardedStorage
from mesh_hicache.storage.keys import KeyNamespace
from mesh_hicache.tiers import (
    BackupQueue,
    CacheFull,
    EvictHooks,
    Lease,
    Loader,
    PrefetchRules,
    PrefixHit,
    RequestFlow,
    RequestLease,
    ServedTokens,
    StorageTier,
    TierAllocator,
    WindowRule,
)
from mesh_hicache.topology import MeshTopology
from mesh_hicache.transfer import TransferEngine, make_transfer_engine

__all__ = ["CacheFull", "HiCacheController", "PrefixHit", "RequestLease", "ServedTokens"]


class HiCacheController:
    """The tiers of one rank. Collective construction; see the module docstring."""

    def __init__(self, topology: MeshTopology, spec: StateSpec, config: HiCacheConfig) -> None:
        self.topology = topology
        self.spec = spec
        self.config = config
        self.layout = StateLayout(spec, topology, config.cp_kv)
        device = torch.device("cpu")
        if topology.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        self.agree = Consensus.over(
            topology, "pp", "cp", "tp", timeout_s=config.collective_timeout_s
        )
        self.agree.enter("HiCache()")  # every rank constructs, or all raise naming it
        # A byte budget is one arena per tier, its blocks agreed over the mesh
        # (pools/arena.py); explicit counts are fixed pools.
        if config.device_bytes:
            plan = agreed_plan(self.layout, config.device_bytes, self.agree, config.block_bytes)
            self.device = DevicePools(self.layout, device=device, arena=plan)
        else:
            slots = config.mamba_device_slots() if spec.has_mamba else 0
            self.device = DevicePools(
                self.layout, num_pages=config.device_pages, num_slots=slots, device=device
            )
        self.host: HostPools | None = None
        self.engine: TransferEngine | None = None
        if config.enable_host:
            host_bytes = config.host_arena_bytes()
            if host_bytes:
                # L2 holds windowed pages apart from pages (pools/host.py): windows are
                # items of their own in the host arena.
                plan = agreed_plan(
                    self.layout, host_bytes, self.agree, config.block_bytes, separate_windows=True
                )
                self.host = HostPools(self.layout, topology=topology, arena=plan)
            else:
                self.host = HostPools(
                    self.layout,
                    num_pages=config.num_host_pages(),
                    num_slots=config.mamba_host_slots() if spec.has_mamba else 0,
                    topology=topology,
                )
            self.engine = make_transfer_engine(self.device, self.host, str(config.transfer))
        cost = config.cost_model or CostModel.from_spec(spec)
        evict_policy = make_policy(config.eviction_policy, cost)
        self.tree = RadixTree(spec.page_size, spec.has_mamba, evict_policy, windows=spec.windows)
        policy = PrefetchPolicy(config.prefetch_policy)
        self.stats = CacheStats(prefetch_policy=policy)
        self.namespace = KeyNamespace(
            model_id=spec.model_id,
            dtype=str(self._state_dtype()).removeprefix("torch."),
            layout_version=config.layout_version,
            tenant=config.tenant,
        )
        # Late-bound: eviction asks the backup queue (built below) through these.
        hooks = EvictHooks(
            write_back=lambda: self.backups.write_back_hook(),
            in_flight=lambda: self.backups.pending,
            drain=lambda: self.flush(),
        )
        self.alloc = TierAllocator(self.device, self.host, self.tree, self.agree, self.stats, hooks)
        self.l3: StorageTier | None = None
        window = None
        if spec.windows:  # also checks window_checkpoint_tokens against the page size
            window = WindowRule(spec.windows, spec.page_size, config.window_checkpoint_tokens)
        if config.storage != StorageKind.NONE:
            assert self.host is not None
            rules = PrefetchRules(
                threshold=config.prefetch_threshold,
                policy=policy,
                timeout_base_s=config.prefetch_timeout_base_s,
                timeout_per_1k_s=config.prefetch_timeout_per_1k_s,
            )
            self.l3 = StorageTier(
                self._open_storage(),
                self.namespace,
                self.layout,
                self.host,
                self.tree,
                self.alloc,
                self.agree,
                self.stats,
                rules,
                window,
            )
        self.backups = BackupQueue(
            WritePolicy(config.write_policy),
            self.tree,
            self.engine,
            self.alloc,
            self.l3,
            self.layout,
            self.agree,
            self.stats,
            window,
        )
        self.loader = Loader(
            self.engine, self.tree, self.alloc, self.layout, self.agree, self.stats, self.device
        )
        self.requests = RequestFlow(
            self.tree, self.alloc, self.backups, self.loader, self.l3, self.stats, self.device
        )
        self.agree.operation = "agree"

    def _open_storage(self) -> GuardedStorage:
        """The L3 backend, built now (``open_storage``); agreed: when it cannot be built on
        some rank every rank raises (one agreement, issued on every rank)."""
        storage: GuardedStorage | None = None
        error: ValueError | None = None
        try:
            storage = open_storage(str(self.config.storage), **self.config.storage_options)
        except (ValueError, TypeError) as err:
            error = ValueError(f"HiCacheConfig.storage_options: {err}")
        if self.agree.all_true(storage is not None):
            assert storage is not None
            return storage
        if storage is not None:
            storage.close()
        if self.engine is not None:
            self.engine.close()
        raise error or ValueError(
            f"HiCacheConfig.storage={str(self.config.storage)!r} could not be opened on "
            "another rank of the mesh (its error names the cause)"
        )

    # -- the request API (collective; see tiers/requests.py) --------------------------------

    def match(self, key: RadixKey) -> RequestLease:
        return self.requests.match(key)

    def load(self, lease: RequestLease) -> None:
        self.requests.load(lease)

    def finish_load(self, lease: RequestLease) -> int:
        return self.requests.finish_load(lease)

    def alloc_pages(self, lease: RequestLease, n: int) -> list[int]:
        return self.requests.alloc_pages(lease, n)

    def alloc_slot(self, lease: RequestLease) -> int:
        return self.requests.alloc_slot(lease)

    def insert(
        self, lease: RequestLease, key: RadixKey, pages: Sequence[int], mamba_slot: int | None
    ) -> int:
        return self.requests.insert(lease, key, pages, mamba_slot)

    def release(self, lease: RequestLease) -> None:
        self.requests.release(lease)

    def step(self, block: bool = False) -> None:
        """Consume finished backups and storage writes (agreed)."""
        self.backups.step(block)

    def flush(self) -> None:
        """Wait for every backup and storage write on every rank and consume them."""
        self.backups.flush()

    # -- integrity, stats, close ------------------------------------------------------------

    def _state_dtype(self) -> torch.dtype:
        if self.spec.kv is not None:
            return self.spec.kv.dtype
        assert self.spec.mamba is not None
        return self.spec.mamba.conv_dtype

    def check_integrity(self) -> None:
        """Tree invariants plus exact pool accounting: tree + free + held = capacity.

        Held: device pages/slots owned by open requests or reserved by loads in flight.
        Host pools must have no reservation in flight (call after ``flush`` with no
        prefetch running). Every
        node's ``lock_ref``/``host_ref`` must equal what the open requests and the backups
        in flight hold on it: a protection nobody holds is a leak (``RuntimeError``)."""
        leases = self.requests.open_leases
        self._check_protections([*leases, *self.backups.leases()])
        loading_pages, loading_slots = self.loader.reserved
        held_pages = [p for lease in leases for p in lease.owned_pages] + loading_pages
        held_slots = [s for lease in leases for s in lease.owned_slots] + loading_slots

        def usage(allocator: PageAllocator | ArenaIds, held: Sequence[int] = ()) -> PoolUsage:
            free = [i for i in range(allocator.capacity) if allocator.is_free(i)]
            return PoolUsage(capacity=allocator.capacity, free=free, held=held)

        host = self.host
        self.tree.check_integrity(
            device=usage(self.device.page_allocator, held_pages),
            host=usage(host.page_allocator) if host is not None else None,
            mamba_device=usage(self.device.slot_allocator, held_slots),
            mamba_host=usage(host.slot_allocator) if host is not None else None,
        )
        self.alloc.check_windows()
        for pools in (self.device, host):
            if pools is not None and pools.arena is not None:
                pools.arena.check_integrity()  # blocks: free runs + extents tile the arena

    def _check_protections(self, leases: Sequence[Lease]) -> None:
        expected = {"lock_ref": Counter[int](), "host_ref": Counter[int]()}
        for lease in leases:
            for attr, held in (("lock_ref", lease.locked), ("host_ref", lease.protected)):
                for node in held:
                    expected[attr].update(n.id for n in self.tree.nodes_on_path(node))
        for node in self.tree.iter_nodes():
            for attr, counts in expected.items():
                want, got = counts.get(node.id, 0), getattr(node, attr)
                if got != want:
                    raise RuntimeError(
                        f"{node!r}: {attr}={got} but open requests and backups hold {want} "
                        "(a leaked or lost protection)"
                    )

    def digest(self) -> str:
        return self.tree.digest()

    def stats_snapshot(self) -> CacheStats:
        """The counters, with the storage backend's error count and degraded flag."""
        snap = self.stats.snapshot()
        if self.l3 is not None and not self.l3.closed:
            backend = self.l3.backend
            snap.storage_errors = backend.stats.errors
            snap.storage_write_errors += backend.stats.write_errors
            snap.storage_degraded = bool(getattr(backend, "degraded", False))
        return snap

    def has_state_at(self, key: RadixKey) -> bool:
        """The tree holds a recurrent state (on device or host) at ``key``'s end."""
        node = self.tree.node_at(key)
        return node is not None and (
            node.mamba_device_slot is not None or node.mamba_host_slot is not None
        )

    def close(self) -> None:
        """Release open requests, flush, stop the transfer worker and the storage threads;
        idempotent. Collective."""
        for lease in self.requests.open_leases:
            self.requests.release(lease)
        self.flush()
        self.close_local()

    def close_local(self) -> None:
        """Stop this rank's threads and close its storage, with no agreement (the mesh may
        be out of step); idempotent."""
        if self.engine is not None:
            self.engine.close()
        if self.l3 is not None:
            self.l3.close()
