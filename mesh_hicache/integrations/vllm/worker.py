"""The connector's worker side: vLLM's KV tensors as the device tier, L2 host copies, L3.

Each worker applies the scheduler's orders for its own shard: copies between vLLM's
paged blocks and host pages with plain torch indexing along the block dim, writes and
reads L3 objects under keys that carry its global slice (from the mesh), and reports
which prefetches arrived. An object that is missing or does not verify is reported as a
failed prefetch: the scheduler drops the page and vLLM recomputes those tokens.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mesh_hicache.integrations.vllm.layout import KeyPlan
from mesh_hicache.integrations.vllm.orders import PageOrder, StepOrders, WorkerReport
from mesh_hicache.integrations.vllm.stats import WorkerCounters, as_dict, write_json
from mesh_hicache.storage.base import StorageBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LayerCache:
    """One layer's paged tensor and the dim that indexes vLLM blocks."""

    name: str
    tensor: torch.Tensor
    block_dim: int

    @property
    def row_bytes(self) -> int:
        t = self.tensor
        return t.numel() // t.shape[self.block_dim] * t.element_size()

    def block(self, block_id: int) -> torch.Tensor:
        return self.tensor.select(self.block_dim, block_id)


def find_block_dim(tensor: torch.Tensor, num_blocks: int, name: str) -> int:
    """The dim of ``tensor`` that indexes blocks (its size is ``num_blocks``)."""
    for dim, size in enumerate(tensor.shape):
        if size == num_blocks:
            return dim
    raise ValueError(f"KV cache of {name} {tuple(tensor.shape)} has no dim of {num_blocks} blocks")


class ConnectorWorker:
    """Worker-side state of one tensor-parallel rank."""

    def __init__(
        self,
        plan: KeyPlan,
        storage: StorageBackend | None,
        *,
        tp_coord: int,
        tp_size: int,
        stats_file: str | None,
    ) -> None:
        self.plan = plan
        self.storage = storage
        self.tp_coord = tp_coord
        self.tp_size = tp_size
        self.stats_file = stats_file
        self.groups: list[list[LayerCache]] = []
        self.host: dict[int, list[torch.Tensor]] = {}
        self.counters = WorkerCounters()
        self._lock = threading.Lock()
        self._report = WorkerReport()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mhc-l3")
        self._finished_saves: set[str] = set()
        self._entry_orders: dict[int, PageOrder] = {}
        self._dropped: set[int] = set()
        self._inflight: set[int] = set()
        """Entries dropped while their prefetch may still run (never stored afterwards)."""

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Take vLLM's per-layer KV tensors, grouped like the plan's groups."""
        self.groups = []
        for group in self.plan.groups:
            layers = []
            for name in group.layer_names:
                t = kv_caches[name]
                layers.append(LayerCache(name, t, find_block_dim(t, num_blocks, name)))
            self.groups.append(layers)

    # -- one step -------------------------------------------------------------------------

    def apply(self, orders: StepOrders) -> None:
        """Saves, then loads, then drops (in that order: a load may read a page saved in
        the same step; a drop never precedes a load of the same step)."""
        for order in orders.saves:
            pages = [
                self._gather(layers, bid)
                for layers, bid in zip(self.groups, order.block_ids, strict=True)
            ]
            self.host[order.entry_id] = pages
            self.counters.saved_pages += 1
            if orders.write_l3:
                self._io.submit(self._put, order, pages)
            elif orders.drops_to_l3:
                self._entry_orders[order.entry_id] = order
        self._finished_saves.update(orders.save_request_ids)
        for order in orders.loads:
            held = self.host.get(order.entry_id)
            assert held is not None, f"L2 entry {order.entry_id} is not held by this worker"
            for layers, bid, page in zip(self.groups, order.block_ids, held, strict=True):
                self._scatter(layers, bid, page)
            self.counters.loaded_pages += 1
        for entry_id in orders.drops:
            with self._lock:
                dropped = self.host.pop(entry_id, [])
                if entry_id in self._inflight:
                    self._dropped.add(entry_id)
            backup = self._entry_orders.pop(entry_id, None)
            if dropped and backup is not None:
                self._io.submit(self._put, backup, dropped)
        for order in orders.prefetches:
            with self._lock:
                self._inflight.add(order.entry_id)
            self._io.submit(self._prefetch, order)
        self.counters.host_pages = len(self.host)
        if not orders.empty():
            self.write_stats()

    def take_finished_saves(self) -> set[str]:
        out, self._finished_saves = self._finished_saves, set()
        return out

    def take_report(self) -> WorkerReport | None:
        with self._lock:
            report, self._report = self._report, WorkerReport()
        return report if report.prefetched else None

    # -- copies ---------------------------------------------------------------------------

    @staticmethod
    def _gather(layers: list[LayerCache], block_id: int) -> torch.Tensor:
        out = torch.empty(sum(lc.row_bytes for lc in layers), dtype=torch.uint8)
        offset = 0
        for lc in layers:
            row = lc.block(block_id)
            n = lc.row_bytes
            out[offset : offset + n].view(row.dtype).view(row.shape).copy_(row)
            offset += n
        return out

    @staticmethod
    def _scatter(layers: list[LayerCache], block_id: int, page: torch.Tensor) -> None:
        offset = 0
        for lc in layers:
            row = lc.block(block_id)
            n = lc.row_bytes
            row.copy_(page[offset : offset + n].view(row.dtype).view(row.shape))
            offset += n

    def _page_bytes(self) -> list[int]:
        return [sum(lc.row_bytes for lc in layers) for layers in self.groups]

    # -- L3 (on the I/O thread) -----------------------------------------------------------

    def _keys(self, order: PageOrder) -> list:
        return self.plan.keys(order.page_hash, order.tenant, self.tp_coord, self.tp_size)

    def _put(self, order: PageOrder, pages: list[torch.Tensor]) -> None:
        assert self.storage is not None
        ok = self.storage.put(self._keys(order), pages)
        with self._lock:
            self.counters.l3_put_objects += sum(ok)
            self.counters.l3_put_failed += len(ok) - sum(ok)

    def _prefetch(self, order: PageOrder) -> None:
        assert self.storage is not None
        pages = [torch.empty(n, dtype=torch.uint8) for n in self._page_bytes()]
        try:
            ok = self.storage.get(self._keys(order), pages)
        except Exception as err:  # a failed read is a miss, never an error of the engine
            logger.warning("L3 read failed: %s", err)
            ok = [False] * len(pages)
        good = all(ok)
        with self._lock:
            self.counters.l3_get_objects += sum(ok)
            self.counters.l3_get_failed += len(ok) - sum(ok)
            if good and order.entry_id not in self._dropped:
                self.host[order.entry_id] = pages
            self._dropped.discard(order.entry_id)
            self._inflight.discard(order.entry_id)
            self._report.prefetched.setdefault(order.entry_id, []).append(good)

    def write_stats(self) -> None:
        if self.stats_file:
            try:
                with self._lock:
                    payload = {"worker": as_dict(self.counters)}
                write_json(f"{self.stats_file}.worker{self.tp_coord}", payload)
            except OSError as err:
                logger.warning("cannot write connector stats: %s", err)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self.write_stats()
        if self.storage is not None:
            self.storage.close()
