"""The connector's worker side: vLLM's KV tensors as the device tier, L2 host copies, L3.

Each worker applies the scheduler's orders for its own shard: copies between vLLM's
paged blocks (KV blocks, and the blocks holding Mamba / GDN boundary states) and host
pages with plain torch indexing along the block dim, writes and
reads L3 objects under keys that carry its global slice (from the mesh), and reports
which prefetches arrived. An object that is missing or does not verify is reported as a
failed prefetch: the scheduler drops the page and vLLM recomputes those tokens.

Loads of KV pages run layer by layer on a loader thread, in the model's layer order,
while the forward runs: vLLM calls ``wait_for_layer_load`` before each attention layer,
which waits for that layer only (full and sliding-window attention). Recurrent states
(one block per request, read by layers vLLM does not stop at) are copied before the
forward.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from mesh_hicache.integrations.vllm.layout import KeyPlan
from mesh_hicache.integrations.vllm.orders import PageOrder, StepOrders, WorkerReport
from mesh_hicache.integrations.vllm.stats import StatsWriter, WorkerCounters, as_dict
from mesh_hicache.storage.base import StorageBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LayerCache:
    """One paged tensor of a layer and the dim that indexes vLLM blocks."""

    name: str
    tensor: torch.Tensor
    block_dim: int
    layer: str = ""
    """vLLM's name of the layer (``name`` adds ``[j]`` for a layer with several tensors)."""

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


def layer_index(name: str) -> int:
    """The model layer number in a vLLM layer name (``model.layers.3.self_attn.attn``);
    -1 when it has none."""
    found = re.search(r"\.(\d+)\.", f".{name}.")
    return int(found.group(1)) if found else -1


class LayerLoads:
    """One step's KV loads as copies per layer, run in order by ``run`` (on the loader
    thread); ``wait(layer)`` returns once that layer's blocks hold their pages."""

    def __init__(self, copies: list[tuple[str, Callable[[], None]]]) -> None:
        self._copies = copies
        self._done = {layer: threading.Event() for layer, _ in copies}
        self._finished = threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            for layer, copy in self._copies:
                copy()
                self._done[layer].set()
        except BaseException as err:  # raised to the forward by wait()
            self._error = err
            for event in self._done.values():
                event.set()
        finally:
            self._finished.set()

    def wait(self, layer: str) -> None:
        """Until ``layer``'s copies are done (at once for a layer with no loads)."""
        event = self._done.get(layer)
        if event is not None:
            event.wait()
        self._raise()

    def wait_all(self) -> None:
        self._finished.wait()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError("loading KV pages into vLLM's blocks failed") from self._error


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
        layerwise_load: bool = True,
    ) -> None:
        self.plan = plan
        self.layerwise_load = layerwise_load
        self.storage = storage
        self.tp_coord = tp_coord
        self.tp_size = tp_size
        self.stats_file = stats_file
        self._stats = StatsWriter(
            f"{stats_file}.worker{tp_coord}" if stats_file else None, self._stats_payload
        )
        self.groups: list[list[LayerCache]] = []
        self.host: dict[int, list[torch.Tensor | None]] = {}
        """L2: entry id -> one host copy per group (None: that group's object not held)."""
        self.counters = WorkerCounters()
        self._lock = threading.Lock()
        self._report = WorkerReport()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mhc-l3")
        self._finished_saves: set[str] = set()
        self._entry_names: dict[int, tuple[bytes, str]] = {}
        """write_back: entry id -> (page hash, tenant), to write the entry when dropped."""
        self._dropped: set[int] = set()
        self._inflight: set[int] = set()
        """Entries dropped while their prefetch may still run (never stored afterwards)."""
        self._after_forward: StepOrders | None = None
        self._step_drops: set[int] = set()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mhc-load")
        self._loads: LayerLoads | None = None
        self._kv_layers: list[tuple[str, list[tuple[int, LayerCache, int]]]] = []
        """Attention layers (full and sliding window) in model order: (vLLM layer
        name, its (group, tensor, offset in the group's page) parts)."""

    def register(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        """Take vLLM's per-layer cache tensors (a tensor, or a list of them for a layer
        with several state tensors), grouped like the plan's groups."""
        self.groups = []
        for group in self.plan.groups:
            layers = []
            for name in group.layer_names:
                value = kv_caches[name]
                parts = list(value) if isinstance(value, list | tuple) else [value]
                for j, t in enumerate(parts):
                    label = name if len(parts) == 1 else f"{name}[{j}]"
                    dim = find_block_dim(t, num_blocks, label)
                    layers.append(LayerCache(label, t, dim, name))
            self.groups.append(layers)
        by_layer: dict[str, list[tuple[int, LayerCache, int]]] = {}
        for g in sorted(self.plan.attention_groups):
            offset = 0
            for lc in self.groups[g]:
                by_layer.setdefault(lc.layer, []).append((g, lc, offset))
                offset += lc.row_bytes
        order = sorted(by_layer, key=layer_index)  # stable: vLLM's order within a number
        self._kv_layers = [(layer, by_layer[layer]) for layer in order]

    # -- one step -------------------------------------------------------------------------

    def apply(self, orders: StepOrders) -> None:
        """Before the forward: saves, then loads, then drops (in that order: a load may
        read a page saved in the same step; a drop never precedes a load of the same
        step). State saves wait for ``after_forward``."""
        self.wait_for_loads()  # the previous step's, if its forward did not wait
        for order in orders.saves:
            self._save(order, orders)
        self._finished_saves.update(orders.save_request_ids)
        kv_groups, by_layer = self.plan.kv_groups, self.plan.attention_groups
        layer_pages: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for order in orders.loads:
            held = self.host.get(order.entry_id)
            assert held is not None, f"L2 entry {order.entry_id} is not held by this worker"
            for g in order.groups:
                page = held[g]
                assert page is not None, f"L2 entry {order.entry_id} lacks group {g}"
                if g in by_layer:
                    layer_pages.setdefault(g, []).append((order.block_ids[g], page))
                else:
                    self._scatter(self.groups[g], order.block_ids[g], page)
            if not kv_groups.isdisjoint(order.groups):
                self.counters.loaded_pages += 1
        if layer_pages:
            self._load_by_layer(layer_pages)
        self._step_drops = set(orders.drops)
        for entry_id in orders.drops:
            with self._lock:
                dropped = self.host.pop(entry_id, None)
                if entry_id in self._inflight:
                    self._dropped.add(entry_id)
            name = self._entry_names.pop(entry_id, None)
            if dropped and name is not None:
                groups = tuple(g for g, t in enumerate(dropped) if t is not None)
                backup = PageOrder(entry_id, name[0], name[1], (), groups)
                self._io.submit(self._put, backup, [dropped[g] for g in groups])  # type: ignore[misc]
        for order in orders.prefetches:
            with self._lock:
                self._inflight.add(order.entry_id)
            self._io.submit(self._prefetch, order)
        self._after_forward = orders if orders.state_saves else None
        self.counters.host_pages = len(self.host)
        if not orders.empty():
            self.write_stats()

    def _load_by_layer(self, pages: dict[int, list[tuple[int, torch.Tensor]]]) -> None:
        """Copy KV ``pages`` (group -> (block id, host page)) into vLLM's blocks: layer
        by layer on the loader thread, or all of them now."""

        def copy_layer(parts: list[tuple[int, LayerCache, int]]) -> None:
            for g, lc, offset in parts:
                n = lc.row_bytes
                for block_id, page in pages.get(g, ()):
                    row = lc.block(block_id)
                    row.copy_(page[offset : offset + n].view(row.dtype).view(row.shape))

        copies: list[tuple[str, Callable[[], None]]] = [
            (layer, partial(copy_layer, parts)) for layer, parts in self._kv_layers
        ]
        loads = LayerLoads(copies)
        if not self.layerwise_load:
            loads.run()
            loads.wait_all()
            return
        self._loads = loads
        self._loader.submit(loads.run)

    def wait_for_layer_load(self, layer: str) -> None:
        """Before ``layer``'s attention runs: until its loaded pages are in place."""
        if self._loads is not None:
            self._loads.wait(layer)

    def wait_for_loads(self) -> None:
        """Until every layer of the last loads is in place."""
        loads, self._loads = self._loads, None
        if loads is not None:
            loads.wait_all()

    def after_forward(self) -> None:
        """After the forward (vLLM's ``wait_for_save``): wait for any load still
        running, then copy the boundary states this step's forward wrote."""
        self.wait_for_loads()
        orders, self._after_forward = self._after_forward, None
        if orders is None:
            return
        for order in orders.state_saves:
            self._save(order, orders, keep=order.entry_id not in self._step_drops)
            self.counters.saved_states += 1
        self.write_stats()

    def _save(self, order: PageOrder, orders: StepOrders, keep: bool = True) -> None:
        pages = [self._gather(self.groups[g], order.block_ids[g]) for g in order.groups]
        if keep:
            with self._lock:
                held = self.host.setdefault(order.entry_id, [None] * len(self.groups))
                for g, page in zip(order.groups, pages, strict=True):
                    held[g] = page
        if not set(order.groups).isdisjoint(self.plan.kv_groups):
            self.counters.saved_pages += 1
        if orders.write_l3 or (orders.drops_to_l3 and not keep):
            self._io.submit(self._put, order, pages)
        elif orders.drops_to_l3:
            self._entry_names[order.entry_id] = (order.page_hash, order.tenant)

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

    def _group_bytes(self, group: int) -> int:
        return sum(lc.row_bytes for lc in self.groups[group])

    # -- L3 (on the I/O thread) -----------------------------------------------------------

    def _keys(self, order: PageOrder) -> list:
        return self.plan.keys(
            order.page_hash, order.tenant, self.tp_coord, self.tp_size, order.groups
        )

    def _put(self, order: PageOrder, pages: list[torch.Tensor]) -> None:
        assert self.storage is not None
        ok = self.storage.put(self._keys(order), pages)
        with self._lock:
            self.counters.l3_put_objects += sum(ok)
            self.counters.l3_put_failed += len(ok) - sum(ok)
        self.write_stats()

    def _prefetch(self, order: PageOrder) -> None:
        assert self.storage is not None
        pages = [torch.empty(self._group_bytes(g), dtype=torch.uint8) for g in order.groups]
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
                held = self.host.setdefault(order.entry_id, [None] * len(self.groups))
                for g, page in zip(order.groups, pages, strict=True):
                    held[g] = page
            self._dropped.discard(order.entry_id)
            self._inflight.discard(order.entry_id)
            self._report.prefetched.setdefault(order.entry_id, []).append(good)
        self.write_stats()

    def _stats_payload(self) -> dict:
        with self._lock:
            return {"worker": as_dict(self.counters)}

    def write_stats(self) -> None:
        """Ask for the stats file to be rewritten (soon, off the step's thread)."""
        self._stats.request()

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._stats.close()
        if self.storage is not None:
            self.storage.close()
