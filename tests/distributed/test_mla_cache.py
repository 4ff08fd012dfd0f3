"""Writer election for a replicated and a rank-local family in one backup, on a mesh.

The spec has MLA layers (a keys-only latent KV and indexer keys, both replicated over tp)
AND Mamba layers (tp-sharded) at once. Every rank runs the same requests; each backup
writes the latent and indexer pages from one elected rank per distinct shard and the
recurrent state from every tp rank. Counted on the stored objects: every distinct
shard written for every page / state, by exactly one rank; a second cache on the same
root reads everything back bit-exact on every rank (tp rank 1 reads the latent that tp
rank 0 wrote).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch.distributed as dist

from mesh_hicache.cache import HiCache
from mesh_hicache.testing import internals
from mesh_hicache.topology import MeshTopology
from tests.distributed.harness import run_on_mesh
from tests.unit.cache_support import (
    PS,
    make_config,
    make_mla_spec,
    registry_entries,
    serve,
    stored_objects,
)

PROMPTS = [list(range(100, 100 + 3 * PS)), list(range(200, 200 + 2 * PS))]
"""Two prompts: 5 distinct pages, states stored at pages 2 and 3 of the first and 2 of
the second (3 boundary states)."""
PAGES, STATES = 5, 3


def _body(mesh: Any, root: str, cp_kv: str, recurrent: bool) -> dict[str, Any]:
    topo = MeshTopology.from_mesh(mesh)
    spec = make_mla_spec(recurrent=recurrent)
    cache = HiCache(topo, spec, make_config(root, cp_kv=cp_kv, write_policy="write_through"))
    mismatches = 0
    for tokens in PROMPTS:
        checkpoints = tuple(sorted({2, len(tokens) // PS}))
        mismatches += serve(cache, tokens, checkpoints=checkpoints).mismatches
    cache.flush()
    storage = internals(cache).storage
    assert storage is not None
    puts = storage.stats.puts
    layout = internals(cache).layout
    regions = [(r.name.value, r.global_slice.tag(), r.is_writer) for r in layout.held_regions()]
    cache.check_integrity()
    cache.close()
    dist.barrier()
    second = HiCache(topo, spec, make_config(root, cp_kv=cp_kv, prefetch_policy="wait_complete"))
    served = []
    for tokens in PROMPTS:
        got = serve(second, tokens)
        mismatches += got.mismatches
        served.append(tuple(got.served))
    second.check_integrity()
    second.close()
    return {
        "coords": topo.coords,
        "regions": regions,
        "puts": puts,
        "served": served,
        "mismatches": mismatches,
    }


CASES = [
    ((1, 1, 2), "replicate", True),
    ((1, 2, 2), "replicate", True),
    ((1, 2, 2), "shard", True),
    ((2, 1, 2), "replicate", True),
    ((2, 2, 2), "shard", True),
    ((1, 2, 2), "shard", False),
]


@pytest.mark.parametrize(
    ("shape", "cp_kv", "recurrent"),
    CASES,
    ids=[f"{'x'.join(map(str, s))}-{m}-{'mixed' if r else 'mla'}" for s, m, r in CASES],
)
def test_one_writer_per_distinct_shard_and_every_rank_local_shard(
    tmp_path, shape, cp_kv, recurrent
):
    root = tmp_path / "l3"
    out = run_on_mesh(shape, _body, str(root), cp_kv, recurrent, timeout=180)
    assert all(o["mismatches"] == 0 for o in out)
    # Everything read back from L3 on every rank (cold L1/L2), the same everywhere.
    want = [(0, 0, len(t)) for t in PROMPTS]
    assert all(o["served"] == want for o in out), [o["served"] for o in out]

    writers: Counter[tuple[str, str]] = Counter()
    for o in out:
        for region, tag, is_writer in o["regions"]:
            writers[(region, tag)] += is_writer
    assert all(n == 1 for n in writers.values()), writers
    pp, cp, tp = shape
    sharded = cp_kv == "shard" and cp > 1
    distinct = Counter(region for region, _ in writers)
    assert distinct["kv"] == distinct["indexer"] == pp * (cp if sharded else 1)
    if recurrent:
        assert distinct["mamba_conv"] == distinct["mamba_ssm"] == pp * tp

    # The stored objects: per distinct shard, one object per page (latent, indexer) or
    # per boundary state (conv, ssm) -- every shard written, the rank-local ones too.
    files = Counter((region, tag) for region, _, tag in stored_objects(root))
    assert set(files) == set(writers)
    for (region, _tag), n in files.items():
        assert n == (PAGES if region in ("kv", "indexer") else STATES), (region, _tag, n)
    # Who wrote them: each rank exactly the objects of the shards it was elected for
    # (plus rank 0's one layout-registry entry); tp rank 1 wrote only rank-local state.
    layouts = registry_entries(root)
    assert layouts == 1
    for o in out:
        mine = sum(files[(r, t)] for r, t, w in o["regions"] if w)
        extra = 1 if o["coords"] == (0, 0, 0) else 0
        assert o["puts"] == mine + extra, (o["coords"], o["puts"], mine)
        if o["coords"][2] > 0:
            wrote = {r for r, _, w in o["regions"] if w}
            assert not wrote & {"kv", "indexer"}, (o["coords"], wrote)
            assert ("mamba_ssm" in wrote) == (recurrent and o["coords"][1] == 0), o["coords"]
    assert sum(o["puts"] for o in out) == sum(files.values()) + layouts


# -- reshard on read: the replicated and rank-local families across meshes ---------------


def _write(mesh: Any, root: str, cp_kv: str) -> None:
    cache = HiCache(
        MeshTopology.from_mesh(mesh), make_mla_spec(recurrent=True), make_config(root, cp_kv=cp_kv)
    )
    for tokens in PROMPTS:
        serve(cache, tokens, checkpoints=tuple(sorted({2, len(tokens) // PS})))
    cache.flush()
    cache.close()


def _read(mesh: Any, root: str, cp_kv: str) -> dict[str, Any]:
    cfg = make_config(root, cp_kv=cp_kv, prefetch_policy="wait_complete")
    cache = HiCache(MeshTopology.from_mesh(mesh), make_mla_spec(recurrent=True), cfg)
    got = [serve(cache, tokens) for tokens in PROMPTS]
    cache.check_integrity()
    out = {
        "served": [tuple(g.served) for g in got],
        "mismatches": sum(g.mismatches for g in got),
        "resharded": cache.stats().storage_resharded_tokens,
    }
    cache.close()
    return out


RESHARD = [
    ((1, 1, 2), "replicate", (1, 2, 1), "shard"),
    ((1, 2, 2), "shard", (2, 1, 1), "replicate"),
]


@pytest.mark.parametrize(
    ("writer", "w_kv", "reader", "r_kv"),
    RESHARD,
    ids=[f"{'x'.join(map(str, w))}{a[0]}->{'x'.join(map(str, r))}{b[0]}" for w, a, r, b in RESHARD],
)
def test_mixed_spec_is_read_bit_exact_under_another_mesh(tmp_path, writer, w_kv, reader, r_kv):
    root = str(tmp_path / "l3")
    run_on_mesh(writer, _write, root, w_kv, timeout=120)
    out = run_on_mesh(reader, _read, root, r_kv, timeout=120)
    want = [(0, 0, len(t)) for t in PROMPTS]
    for o in out:
        assert o["mismatches"] == 0 and o["served"] == want, o
        assert o["resharded"] == sum(len(t) for t in PROMPTS), o
