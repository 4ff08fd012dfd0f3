"""The connector's scheduler side: hits beyond vLLM's own, L2 placement, L3 lookups.

Runs in vLLM's engine-core process (no vLLM import here; requests and block lists are
duck-typed). Hit rule: ``k`` pages count only when every KV group's objects of pages
``0..k-1`` and every state group's object at page ``k-1``'s end can be restored; a model
with a group the connector cannot restore gets no hit at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mesh_hicache.integrations.vllm.config import ConnectorConfig
from mesh_hicache.integrations.vllm.directory import HostDirectory, HostEntry
from mesh_hicache.integrations.vllm.layout import KeyPlan
from mesh_hicache.integrations.vllm.orders import PageOrder, StepOrders, WorkerReport
from mesh_hicache.integrations.vllm.stats import SchedulerCounters, StatsWriter, as_dict
from mesh_hicache.storage.base import StorageBackend


@dataclass(slots=True)
class _Pending:
    """One request between its first hit question and its admission (vLLM asks again at
    every step while the request waits: the hashes and the L3 lookup are done once)."""

    tenant: str
    hashes: list[bytes]
    local_tokens: int = 0
    hit_pages: int = 0
    entries: list[HostEntry] = field(default_factory=list)
    prefetching: set[int] = field(default_factory=set)
    l3_checked: bool = False
    unsupported: bool = False


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
        self._stats = StatsWriter(config.stats_file, lambda: {"scheduler": as_dict(self.counters)})
        self._pending: dict[str, _Pending] = {}
        self._orders = StepOrders()
        self._reports: dict[int, list[bool]] = {}
        self._prefetching: dict[int, tuple[str, HostEntry, tuple[int, ...]]] = {}
        self._live: dict[str, object] = {}
        """Requests between their first hit question and their end (for boundary states)."""

    # -- hits -----------------------------------------------------------------------------

    def tenant_of(self, request: object) -> str:
        salt = getattr(request, "cache_salt", None)
        return salt if salt else self.config.tenant

    def num_new_matched_tokens(self, request: object, num_computed: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: tokens beyond ``num_computed`` from L2
        (after an L3 prefetch into L2 where L3 holds more); None while a prefetch runs.

        vLLM asks again at every step while the request waits (for blocks, or for a
        token budget: a hybrid's prefill chunk must end at a block boundary); the request
        is counted once, when vLLM admits it (``after_alloc``)."""
        req_id: str = request.request_id  # type: ignore[attr-defined]
        pending = self._pending.get(req_id)
        if pending is None:
            if not self.plan.supported:
                pending = _Pending(self.tenant_of(request), [], unsupported=True)
                pending.local_tokens = num_computed
                self._pending[req_id] = pending
                return 0, False
            self._live[req_id] = request
            tokens = list(request.all_token_ids)  # type: ignore[attr-defined]
            # The last prompt token is always computed by the engine (it yields the logits).
            usable = max(0, len(tokens) - 1) // self.plan.page_size * self.plan.page_size
            tenant = self.tenant_of(request)
            pending = _Pending(tenant, self.plan.page_hashes(tokens[:usable], tenant))
            pending.local_tokens = num_computed
            self._pending[req_id] = pending
        if pending.unsupported:
            pending.local_tokens = num_computed
            return 0, False
        if pending.prefetching:
            return None, False
        hashes = pending.hashes
        page = self.plan.page_size
        in_l2 = self.plan.best_hit(self._l2_avail(hashes), num_computed // page)
        if (
            not pending.l3_checked
            and self.storage is not None
            and in_l2 < len(hashes)
            and len(hashes) * page > num_computed
        ):
            pending.l3_checked = True
            if self._start_prefetch(req_id, pending, in_l2, num_computed):
                return None, False
        pending.local_tokens = num_computed
        if in_l2 * page <= num_computed:
            pending.hit_pages = 0
            return 0, False
        pending.hit_pages = in_l2
        return in_l2 * page - num_computed, False

    def _l2_avail(self, hashes: list[bytes]) -> list[set[int]]:
        """Per page, the groups L2 holds ready (an entry being filled holds none)."""
        out = []
        for h in hashes:
            e = self.directory.get(h)
            out.append(set(e.held) if e is not None and e.ready else set())
        return out

    def _start_prefetch(self, req_id: str, pending: _Pending, in_l2: int, local: int) -> bool:
        """Read from L3 what the longest hit over L2 + L3 misses in L2 (each group's pages
        that hit needs); True when a read started."""
        assert self.storage is not None
        page = self.plan.page_size
        hashes, tenant, tp = pending.hashes, pending.tenant, self.tp_size
        first = local // page  # pages below are the engine's own
        l2 = self._l2_avail(hashes)
        busy = [(e := self.directory.get(h)) is not None and not e.ready for h in hashes]
        avail = [set(x) for x in l2]
        kv = sorted(self.plan.kv_groups)
        others = [g for g in range(len(self.plan.groups)) if g not in self.plan.kv_groups]

        storage = self.storage

        def ask(pairs: list[tuple[int, int]]) -> None:
            keys = [self.plan.keys(hashes[i], tenant, 0, tp, (g,))[0] for i, g in pairs]
            for (i, g), ok in zip(pairs, storage.exists_each(keys), strict=True):
                if ok:
                    avail[i].add(g)

        n = len(hashes)
        ask([(i, g) for i in range(first, n) if not busy[i] for g in kv if g not in l2[i]])
        run = first
        while run < n and not busy[run] and set(kv) <= avail[run]:
            run += 1
        ask([(i, g) for i in range(first, run) for g in others if g not in l2[i]])
        for i in range(n):
            if busy[i]:
                avail[i] = set()
        target = self.plan.best_hit(avail, first)
        gain = target * page - max(in_l2 * page, local)
        if target <= in_l2 or gain < max(1, self.config.prefetch_threshold):
            return False
        plan: list[tuple[int, tuple[int, ...]]] = []
        for i in range(first, target):
            want = tuple(g for g in self.plan.groups_for(i, target) if g not in l2[i])
            if want:
                plan.append((i, want))
        new = sum(1 for i, _ in plan if self.directory.get(hashes[i]) is None)
        if not plan or self.directory.can_hold(new) < new:
            return False
        for i, groups in plan:
            h = hashes[i]
            entry = self.directory.get(h)
            if entry is None:
                entry = self.directory.add(h, ready=False, from_l3=True, pinned=True)
            else:
                self.directory.pin(entry)
                entry.ready = False
                entry.from_l3 = True
            pending.entries.append(entry)
            pending.prefetching.add(entry.entry_id)
            self._prefetching[entry.entry_id] = (req_id, entry, groups)
            self._orders.prefetches.append(PageOrder(entry.entry_id, h, tenant, (), groups))
        return True

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
            req_id, entry, groups = self._prefetching.pop(entry_id)
            pending = self._pending.get(req_id)
            if pending is not None:
                pending.prefetching.discard(entry_id)
            entry.ready = True
            if all(got):
                entry.held.update(groups)
                self.counters.prefetched_pages += 1
            else:
                self.counters.prefetch_failed_pages += 1
                if not entry.held:
                    self.directory.remove(entry.page_hash)

    def after_alloc(self, request: object, block_ids: tuple[list[int], ...], n_ext: int) -> None:
        """vLLM's ``update_state_after_alloc``: the load orders for the external tokens
        (KV groups of every loaded page, state groups of the last one)."""
        req_id: str = request.request_id  # type: ignore[attr-defined]
        pending = self._pending.get(req_id)
        if pending is None:
            return
        page = self.plan.page_size
        state = tuple(sorted(self.plan.state_groups))
        kv = self.plan.kv_groups
        loaded = 0
        if n_ext > 0:
            first = pending.local_tokens // page
            last = (pending.local_tokens + n_ext) // page
            for i in range(first, last):
                entry = self.directory.get(pending.hashes[i])
                groups = self.plan.groups_for(i, last)
                assert entry is not None and entry.ready and set(groups) <= entry.held, (
                    "a loaded page left L2 before its load"
                )
                ids = tuple(b[i] if i < len(b) else 0 for b in block_ids)
                # vLLM's null block (0) never receives a load: for the pages a hit needs,
                # vLLM allocates a real block in every group (state: the hit's last page;
                # sliding window: the pages inside the window).
                assert all(ids[g] != 0 for g in groups if g not in kv), (
                    f"no block to load page {i} into"
                )
                self._orders.loads.append(
                    PageOrder(entry.entry_id, entry.page_hash, pending.tenant, ids, groups)
                )
                if i == last - 1 and state:
                    # vLLM (align mode) copies the state at the hit's end into the request's
                    # running block (its last) before the connector loads: the state goes
                    # into that block too, the one this step's forward starts from.
                    run = tuple(b[-1] if b else 0 for b in block_ids)
                    if all(run[g] != 0 and run[g] != ids[g] for g in state):
                        self._orders.loads.append(
                            PageOrder(entry.entry_id, entry.page_hash, pending.tenant, run, state)
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
        c = self.counters
        c.requests += 1
        c.prompt_tokens += int(getattr(request, "num_prompt_tokens", 0))
        c.device_hit_tokens += local
        c.unsupported_requests += int(pending.unsupported)
        self.write_stats()

    # -- saves ----------------------------------------------------------------------------

    def request_finished(self, request: object, block_ids: tuple[list[int], ...]) -> bool:
        """Save the request's whole computed pages (KV groups; sliding-window groups where
        vLLM still holds the page) not yet in L2; True when
        vLLM must keep its blocks until the workers copied them. State groups are saved
        as vLLM offers their boundary states (``boundary_states``), not here: at the end
        only the running state is left, not the boundary ones."""
        req_id: str = request.request_id  # type: ignore[attr-defined]
        self._live.pop(req_id, None)
        pending = self._pending.pop(req_id, None)
        if pending is not None:  # finished (or aborted) before its load: release its pages
            for entry in pending.entries:
                if entry.pins:
                    self.directory.unpin(entry)
        kv = tuple(sorted(self.plan.kv_groups))
        window = sorted(self.plan.window_groups)
        if not self.plan.supported or not block_ids or not all(block_ids[g] for g in kv):
            return False
        computed = int(getattr(request, "num_computed_tokens", 0))
        tokens = list(request.all_token_ids)[:computed]  # type: ignore[attr-defined]
        tenant = self.tenant_of(request)
        hashes = self.plan.page_hashes(tokens, tenant)
        n = min(len(hashes), *(len(block_ids[g]) for g in kv))
        saved = False
        for i in range(n):
            h = hashes[i]
            ids = tuple(b[i] if i < len(b) else 0 for b in block_ids)
            # Sliding-window pages: only those vLLM still holds (inside the window).
            groups = kv + tuple(g for g in window if ids[g] != 0)
            held = self.directory.get(h)
            if held is not None and (not held.ready or set(groups) <= held.held):
                self.directory.touch(h)
                continue
            if held is None:
                held = self.directory.add(h, ready=True, from_l3=False, pinned=False)
            groups = tuple(g for g in groups if g not in held.held)
            held.held.update(groups)
            self._orders.saves.append(PageOrder(held.entry_id, h, tenant, ids, groups))
            self.counters.saved_pages += 1
            saved = True
        if saved:
            self._orders.save_request_ids.append(req_id)
        return saved

    def boundary_states(self, offers: dict[str, list[tuple[int, int, int]]]) -> None:
        """vLLM's boundary-state hand-offs of this step (``{request id: [(group, block,
        boundary tokens)]}``, ``align`` mode): save each page-end state that every state
        group offers, copied by the workers after this step's forward."""
        state = self.plan.state_groups
        if not state or not self.plan.supported:
            return
        page = self.plan.page_size
        for req_id, items in offers.items():
            request = self._live.get(req_id)
            if request is None:
                continue
            by_boundary: dict[int, dict[int, int]] = {}
            for group, block, boundary in items:
                if group in state and block != 0 and boundary > 0 and boundary % page == 0:
                    by_boundary.setdefault(boundary, {})[group] = block
            tokens = list(request.all_token_ids)  # type: ignore[attr-defined]
            tenant = self.tenant_of(request)
            for boundary, blocks in sorted(by_boundary.items()):
                if set(blocks) != state or boundary > len(tokens):
                    continue
                h = self.plan.page_hashes(tokens[:boundary], tenant)[-1]
                entry = self.directory.get(h)
                if entry is not None and (not entry.ready or state <= entry.held):
                    self.directory.touch(h)
                    continue
                if entry is None:
                    entry = self.directory.add(h, ready=True, from_l3=False, pinned=False)
                entry.held.update(state)
                ids = tuple(blocks.get(g, 0) for g in range(len(self.plan.groups)))
                order = PageOrder(entry.entry_id, h, tenant, ids, tuple(sorted(state)))
                self._orders.state_saves.append(order)
                self.counters.saved_states += 1

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
        """Ask for the stats file to be rewritten (soon, off this thread)."""
        self._stats.request()

    def close(self) -> None:
        """Write the stats file a last time (synchronously) and close the store."""
        self._stats.close()
        if self.storage is not None:
            self.storage.close()
