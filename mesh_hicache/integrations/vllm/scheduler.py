"""The connector's scheduler side: hits beyond vLLM's own, L2 placement, L3 lookups.

Runs in vLLM's engine-core process (no vLLM import here; requests and block lists are
duck-typed). Hit rule: a page counts only when every KV cache group's object of it can be
restored; a model with a group the connector cannot restore gets no hit at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from mesh_hicache.integrations.vllm.config import ConnectorConfig
from mesh_hicache.integrations.vllm.directory import HostDirectory, HostEntry
from mesh_hicache.integrations.vllm.layout import KeyPlan
from mesh_hicache.integrations.vllm.orders import PageOrder, StepOrders, WorkerReport
from mesh_hicache.integrations.vllm.stats import SchedulerCounters, as_dict, write_json
from mesh_hicache.storage.base import StorageBackend

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    """One request between its hit decision and its load."""

    tenant: str
    hashes: list[bytes]
    local_tokens: int = 0
    hit_pages: int = 0
    entries: list[HostEntry] = field(default_factory=list)
    prefetching: set[int] = field(default_factory=set)
    l3_checked: bool = False
    counted: bool = False


class ConnectorScheduler:
    """Scheduler-side state of one engine."""

    def __init__(
        self,
        config: ConnectorConfig,
        plan: KeyPlan,
        storage: StorageBackend | None,
        *,
        page_bytes: int,
        num_workers: int,
        tp_size: int,
    ) -> None:
        self.config = config
        self.plan = plan
        self.storage = storage
        self.num_workers = num_workers
        self.tp_size = tp_size
        capacity = config.host_bytes // page_bytes if page_bytes else 0
        self.directory = HostDirectory(capacity)
        self.counters = SchedulerCounters()
        self._pending: dict[str, _Pending] = {}
        self._orders = StepOrders()
        self._reports: dict[int, list[bool]] = {}
        self._prefetching: dict[int, tuple[str, HostEntry]] = {}

    # -- hits -----------------------------------------------------------------------------

    def tenant_of(self, request: object) -> str:
        salt = getattr(request, "cache_salt", None)
        return salt if salt else self.config.tenant

    def num_new_matched_tokens(self, request: object, num_computed: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: tokens beyond ``num_computed`` from L2
        (after an L3 prefetch into L2 where L3 holds more); None while a prefetch runs."""
        req_id: str = request.request_id  # type: ignore[attr-defined]
        pending = self._pending.get(req_id)
        if pending is None:
            if not self.plan.supported:
                self._count_request(request, num_computed, unsupported=True)
                return 0, False
            tokens = list(request.all_token_ids)  # type: ignore[attr-defined]
            # The last prompt token is always computed by the engine (it yields the logits).
            usable = max(0, len(tokens) - 1) // self.plan.page_size * self.plan.page_size
            tenant = self.tenant_of(request)
            pending = _Pending(tenant, self.plan.page_hashes(tokens[:usable], tenant))
            pending.local_tokens = num_computed
            self._pending[req_id] = pending
        if pending.prefetching:
            return None, False
        hashes = pending.hashes
        in_l2 = self.directory.ready_run(hashes)
        if not pending.l3_checked and self.storage is not None and in_l2 < len(hashes):
            pending.l3_checked = True
            if self._start_prefetch(req_id, pending, in_l2):
                return None, False
        page = self.plan.page_size
        hit_pages = in_l2
        if hit_pages * page <= num_computed:
            self._finish_pending(req_id, request, num_computed, 0)
            return 0, False
        pending.hit_pages = hit_pages
        pending.local_tokens = num_computed
        return hit_pages * page - num_computed, False

    def _start_prefetch(self, req_id: str, pending: _Pending, start: int) -> bool:
        assert self.storage is not None
        wanted = pending.hashes[start:]
        keys = [k for h in wanted for k in self.plan.keys(h, pending.tenant, 0, self.tp_size)]
        per_page = len(self.plan.groups)
        found = self.storage.exists(keys) // per_page
        if found * self.plan.page_size < max(1, self.config.prefetch_threshold):
            return False
        found = min(found, self.directory.can_hold(found))
        for h in wanted[:found]:
            entry = self.directory.add(h, ready=False, from_l3=True, pinned=True)
            pending.entries.append(entry)
            pending.prefetching.add(entry.entry_id)
            self._prefetching[entry.entry_id] = (req_id, entry)
            self._orders.prefetches.append(PageOrder(entry.entry_id, h, pending.tenant))
        return bool(found)

    def worker_report(self, report: WorkerReport) -> None:
        """Prefetch results from the workers (ready once every worker read its shard)."""
        for entry_id, oks in report.prefetched.items():
            got = self._reports.setdefault(entry_id, [])
            got.extend(oks)
            if len(got) < self.num_workers:
                continue
            del self._reports[entry_id]
            if entry_id not in self._prefetching:
                continue
            req_id, entry = self._prefetching.pop(entry_id)
            pending = self._pending.get(req_id)
            if pending is not None:
                pending.prefetching.discard(entry_id)
            if all(got):
                entry.ready = True
                self.counters.prefetched_pages += 1
            else:
                self.counters.prefetch_failed_pages += 1
                self.directory.remove(entry.page_hash)

    def after_alloc(self, request: object, block_ids: tuple[list[int], ...], n_ext: int) -> None:
        """vLLM's ``update_state_after_alloc``: the load orders for the external tokens."""
        req_id: str = request.request_id  # type: ignore[attr-defined]
        pending = self._pending.get(req_id)
        if pending is None:
            return
        page = self.plan.page_size
        loaded = 0
        if n_ext > 0:
            first = pending.local_tokens // page
            last = (pending.local_tokens + n_ext) // page
            for i in range(first, last):
                entry = self.directory.get(pending.hashes[i])
                assert entry is not None and entry.ready, "a loaded page left L2 before its load"
                self._orders.loads.append(
                    PageOrder(
                        entry.entry_id,
                        entry.page_hash,
                        pending.tenant,
                        tuple(ids[i] for ids in block_ids),
                    )
                )
                if entry.from_l3:
                    self.counters.l3_hit_tokens += page
                    entry.from_l3 = False
                else:
                    self.counters.l2_hit_tokens += page
                self.directory.touch(entry.page_hash)
                loaded += 1
        self._finish_pending(req_id, request, pending.local_tokens, loaded)

    def _finish_pending(self, req_id: str, request: object, local: int, loaded: int) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is None:
            return
        for entry in pending.entries:
            if entry.pins:
                self.directory.unpin(entry)
        self._count_request(request, local, unsupported=False)

    def _count_request(self, request: object, local: int, *, unsupported: bool) -> None:
        c = self.counters
        c.requests += 1
        c.prompt_tokens += int(getattr(request, "num_prompt_tokens", 0))
        c.device_hit_tokens += local
        c.unsupported_requests += int(unsupported)
        self.write_stats()

    # -- saves ----------------------------------------------------------------------------

    def request_finished(self, request: object, block_ids: tuple[list[int], ...]) -> bool:
        """Save the request's whole computed pages not yet in L2; True when vLLM must keep
        its blocks until the workers copied them."""
        req_id: str = request.request_id  # type: ignore[attr-defined]
        pending = self._pending.pop(req_id, None)
        if pending is not None:  # finished (or aborted) before its load: release its pages
            for entry in pending.entries:
                if entry.pins:
                    self.directory.unpin(entry)
        if not self.plan.supported or not block_ids or not block_ids[0]:
            return False
        computed = int(getattr(request, "num_computed_tokens", 0))
        tokens = list(request.all_token_ids)[:computed]  # type: ignore[attr-defined]
        tenant = self.tenant_of(request)
        hashes = self.plan.page_hashes(tokens, tenant)
        n = min(len(hashes), *(len(ids) for ids in block_ids))
        saved = False
        for i in range(n):
            h = hashes[i]
            if self.directory.get(h) is not None:
                self.directory.touch(h)
                continue
            entry = self.directory.add(h, ready=True, from_l3=False, pinned=False)
            self._orders.saves.append(
                PageOrder(entry.entry_id, h, tenant, tuple(ids[i] for ids in block_ids))
            )
            self.counters.saved_pages += 1
            saved = True
        if saved:
            self._orders.save_request_ids.append(req_id)
        return saved

    # -- steps ----------------------------------------------------------------------------

    def take_orders(self) -> StepOrders:
        """This step's orders (then a fresh, empty set)."""
        orders, self._orders = self._orders, StepOrders()
        dropped = self.directory.take_dropped()
        self.counters.l2_evicted_pages += len(dropped)
        orders.drops = dropped
        write_back = self.config.write_policy == "write_back" and self.directory.capacity > 0
        orders.write_l3 = self.storage is not None and not write_back
        orders.drops_to_l3 = self.storage is not None and write_back
        return orders

    def write_stats(self) -> None:
        if self.config.stats_file:
            try:
                write_json(self.config.stats_file, {"scheduler": as_dict(self.counters)})
            except OSError as err:  # statistics never stop serving
                logger.warning("cannot write connector stats: %s", err)
