"""Byte budgets on a mesh: every rank derives the same arena from agreed numbers, a
budgeted cache makes the same decisions everywhere, and host DTensor views over an
arena still assemble the global reference."""

from __future__ import annotations

import random

import pytest
import torch

from mesh_hicache.cache import HiCache
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.consensus import Consensus
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools import HostPools
from mesh_hicache.pools.arena import ArenaPlan, agreed_plan, mesh_plan
from mesh_hicache.testing import internals
from mesh_hicache.topology import MeshTopology
from tests.distributed.harness import run_on_mesh
from tests.distributed.test_host_pool import _codes, _grids, _layer_table, fill_local, make_spec
from tests.engine_cases import ATOL, resume_scenarios
from tests.unit.cache_support import PS, serve
from tests.unit.cache_support import make_spec as cache_spec


class _Scratch:
    """Stands in for HostPools in ``fill_local``: one contiguous tensor per region."""

    def __init__(self, layout: StateLayout, counts: dict[bool, int]) -> None:
        self.tensors = {
            r.name: torch.zeros((counts[r.paged], *r.local_shape), dtype=r.dtype)
            for r in layout.regions
        }

    def local(self, name):
        return self.tensors[name]


def _dtensor_body(mesh, kv_heads: int, cp_kv: str):
    topo = MeshTopology.from_mesh(mesh)
    spec = make_spec(kv_heads)
    layout = StateLayout(spec, topo, cp_kv)
    agree = Consensus.over(topo, "pp", "cp", "tp")
    page, slot, _ = ArenaPlan.item_bytes(layout)
    # Budgets differ per rank: the agreed plan uses the smallest, so all hold the same.
    plan = agreed_plan(layout, 6 * page + 3 * slot + 977 * sum(topo.coords), agree)
    host = HostPools(layout, topology=topo, pinned=False, arena=plan)
    pages = host.page_allocator.allocate(3)
    slots = host.slot_allocator.allocate(2)
    scratch = _Scratch(layout, {True: host.num_pages, False: host.num_slots})
    fill_local(scratch, layout)  # code(id, layer, ...) of this rank's slice, every id
    for region in layout.regions:
        ids = pages if region.paged else slots
        host.local(region.name)[ids] = scratch.tensors[region.name][ids]
    checked = []
    for region in layout.regions:
        ids = pages if region.paged else slots
        dt = host.dtensor(region.name)
        assert dt.to_local().data_ptr() == host.local(region.name).data_ptr()  # zero-copy
        full = dt.full_tensor()[ids]
        count = max(ids) + 1
        grids = _grids((count, *region.global_shape))
        grids[1] = grids[1].long()
        if region.name.value == "kv" and kv_heads < topo.size("tp"):
            grids[4] = torch.div(grids[4], topo.size("tp") // kv_heads, rounding_mode="floor")
        layers = _layer_table(region, layout, region.global_shape[0])
        ref = _codes(region, grids, layers)[ids]
        assert torch.equal(full, ref), region.name
        checked.append(region.name.value)
    offline = mesh_plan(spec, topo.shape, cp_kv, 6 * page + 3 * slot)
    return checked, plan, offline


@pytest.mark.parametrize(
    "shape,kv_heads,cp_kv", [((1, 1, 2), 2, "replicate"), ((2, 1, 1), 1, "replicate")]
)
def test_arena_host_dtensors_match_the_global_reference(shape, kv_heads, cp_kv):
    out = run_on_mesh(shape, _dtensor_body, kv_heads, cp_kv, timeout=120)
    plans = {plan for _, plan, _ in out}
    assert len(plans) == 1  # every rank: the same blocks, block size, page and slot blocks
    for checked, plan, offline in out:
        assert checked == ["kv", "indexer", "mamba_conv", "mamba_ssm"]
        assert plan == offline  # the offline plan (no process group) is the agreed one


def _cache_body(mesh):
    topo = MeshTopology.from_mesh(mesh)
    spec = cache_spec()
    page, slot, _ = ArenaPlan.item_bytes(StateLayout(spec, topo, "replicate"))
    config = HiCacheConfig(
        device_bytes=6 * page + 2 * slot,
        host_bytes=20 * page + 8 * slot,
        transfer="cpu",
        prefetch_threshold=PS,
    )
    cache = HiCache(topo, spec, config)
    rng = random.Random(11)  # the same trace on every rank
    stems = [[rng.randrange(40) for _ in range(PS * rng.randint(1, 2))] for _ in range(3)]
    log = []
    for _ in range(25):
        tokens = rng.choice(stems) + [rng.randrange(3) for _ in range(PS * rng.randint(0, 4))]
        n = len(tokens) // PS
        got = serve(cache, tokens, checkpoints=(max(1, n - 1), n))
        log.append((got.prefix, tuple(got.served), got.cache_full, got.mismatches))
    cache.flush()
    cache.check_integrity()
    inner = internals(cache)
    ids = [(n.id, n.device_indices, n.host_indices, n.mamba_device_slot, n.mamba_host_slot)
           for n in inner.tree.iter_nodes()]  # fmt: skip
    stats = cache.stats()
    out = (log, ids, cache.digest(), cache.device.arena.plan, stats.evicted_device_pages,
           stats.evicted_device_slots)  # fmt: skip
    cache.close()
    return out


@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 1, 1)])
def test_a_budgeted_cache_agrees_on_every_rank(shape):
    out = run_on_mesh(shape, _cache_body, timeout=180)
    first = out[0]
    for other in out[1:]:
        assert other == first  # requests, node ids, pages, slots, digest, plan, evictions
    log = first[0]
    assert sum(prefix for prefix, *_ in log) > 0  # it hits
    assert all(mismatches == 0 for *_, mismatches in log)
    assert first[4] + first[5] > 0  # and evicts


def _resume_body(mesh, root):
    return resume_scenarios(MeshTopology.from_mesh(mesh), root=root, budget=True)


def test_exact_resume_on_a_mesh_with_byte_budgets(tmp_path):
    out = run_on_mesh((1, 1, 2), _resume_body, str(tmp_path), timeout=300)
    for rank_checks in out:
        assert rank_checks == out[0], "ranks disagree on hits or tokens"
        for c in rank_checks:
            assert c.cached > 0, f"{c.label}: expected a {c.tier} hit"
            assert c.max_diff < ATOL, f"{c.label}: logits differ by {c.max_diff}"
            assert c.tokens_equal, c.label
    assert {c.tier for c in out[0]} == {"device", "host", "storage"}
