"""``MeshHiCacheConnector``: the cache as a vLLM KV connector (``KVConnectorBase_V1`` with
hybrid-allocator support), enabled with::

    kv_transfer_config={
        "kv_connector": "MeshHiCacheConnector",
        "kv_connector_module_path": "mesh_hicache.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"storage_root": "/path/to/l3", ...},
    }

The scheduler side (``scheduler.py``) decides hits, L2 placement and L3 prefetches; the
worker side (``worker.py``) copies between vLLM's blocks, host pages and storage. The one
object ties both to vLLM's interface.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from mesh_hicache.integrations.vllm.config import ConnectorConfig
from mesh_hicache.integrations.vllm.identity import connector_model_id
from mesh_hicache.integrations.vllm.layout import KeyPlan, group_layouts
from mesh_hicache.integrations.vllm.orders import StepOrders, WorkerReport
from mesh_hicache.integrations.vllm.scheduler import ConnectorScheduler
from mesh_hicache.integrations.vllm.worker import ConnectorWorker
from mesh_hicache.storage.base import StorageBackend
from mesh_hicache.storage.factory import open_storage
from mesh_hicache.topology import MeshAxis, MeshTopology

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput

logger = logging.getLogger(__name__)


class MeshHiCacheMetadata(KVConnectorMetadata):
    """Scheduler -> workers: one step's orders."""

    def __init__(self, orders: StepOrders) -> None:
        self.orders = orders


class MeshHiCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: finished prefetches (merged over workers)."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, MeshHiCacheWorkerMetadata)
        return MeshHiCacheWorkerMetadata(self.report.merge(other.report))


def _open_storage(config: ConnectorConfig) -> StorageBackend:
    options = dict(config.storage_options)
    if config.secret_file:
        options["secret_file"] = config.secret_file
    return open_storage(config.storage, **options)


def _key_plan(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, version: int) -> KeyPlan:
    model = vllm_config.model_config
    model_id = connector_model_id(model.model, model.revision, model.dtype)
    groups = group_layouts(kv_cache_config, model.get_total_num_kv_heads())
    return KeyPlan(model_id, str(model.dtype).removeprefix("torch."), version, groups)


def vllm_topology() -> MeshTopology:
    """A ``MeshTopology`` over vLLM's pipeline- and tensor-parallel layout (collective
    over vLLM's world: every worker calls it at registration)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    # A pp-major x tp mesh of vLLM's own groups (DeviceMesh refuses a world of another
    # size); the coordinates are then checked against vLLM's ranks in those groups.
    ranks = torch.arange(pp.world_size * tp.world_size).view(pp.world_size, tp.world_size)
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("pp", "tp"))
    topo = MeshTopology.from_mesh(mesh)
    if (topo.coord(MeshAxis.PP), topo.coord(MeshAxis.TP)) != (pp.rank_in_group, tp.rank_in_group):
        raise ValueError(
            f"vLLM's rank order differs from pp-major x tp: mesh {topo.coords} vs vLLM "
            f"pp {pp.rank_in_group} tp {tp.rank_in_group}"
        )
    return topo


class MeshHiCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """The hierarchical prefix cache behind vLLM's own (device) prefix cache."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        if kv_cache_config is None:
            raise ValueError("MeshHiCacheConnector needs vLLM's kv_cache_config")
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config  # type: ignore[union-attr]
        self.config = ConnectorConfig.from_extra(extra)
        self.plan = _key_plan(vllm_config, kv_cache_config, self.config.layout_version)
        if not self.plan.supported:
            logger.warning(
                "MeshHiCacheConnector: groups %s are not all restorable at one boundary; "
                "the connector reports no hits for this model",
                [(g.spec_kind, g.role or "unsupported") for g in self.plan.groups],
            )
        self._num_blocks = kv_cache_config.num_blocks
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        parallel = vllm_config.parallel_config
        if role == KVConnectorRole.SCHEDULER:
            page_bytes = sum(
                g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                for g in kv_cache_config.kv_cache_groups
            )
            self._scheduler = ConnectorScheduler(
                self.config,
                self.plan,
                _open_storage(self.config),
                page_bytes=page_bytes,
                num_workers=parallel.world_size,
                tp_size=parallel.tensor_parallel_size,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later miss, never a wrong token

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        assert self._scheduler is not None
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        # Mamba / GDN "align" mode: the exact blocks holding this step's boundary states.
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None)
        if offers:
            self._scheduler.boundary_states(offers)
        return MeshHiCacheMetadata(self._scheduler.take_orders())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, MeshHiCacheWorkerMetadata):
            self._scheduler.worker_report(meta.report)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        assert self._scheduler is not None
        delay = self._scheduler.request_finished(request, block_ids)
        self._scheduler.write_stats()
        return delay, None

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        topo = vllm_topology()
        self._worker = ConnectorWorker(
            self.plan,
            _open_storage(self.config),
            tp_coord=topo.coord(MeshAxis.TP),
            tp_size=topo.size(MeshAxis.TP),
            stats_file=self.config.stats_file,
            layerwise_load=self.config.layerwise_load,
        )
        if self.plan.supported:
            self._worker.register(kv_caches, self._num_blocks)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer-wise loads run Python between layers, which a whole-model CUDA graph skips.
        return bool((extra_config or {}).get("layerwise_load", True))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, MeshHiCacheMetadata)
        self._worker.apply(meta.orders)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return  # pages are saved when their request finishes (see request_finished_all_groups)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.after_forward()  # boundary states this step's forward wrote

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        done = self._worker.take_finished_saves()
        return (done or None), None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        report = self._worker.take_report()
        return MeshHiCacheWorkerMetadata(report) if report is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._scheduler is not None:
            self._scheduler.close()
