"""HiCache on a mesh: identical trees under a random workload, elected L3 writers only,
L3 hits in a second run on every rank, and agreement under one-rank faults."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from mesh_hicache.cache import HiCache
from mesh_hicache.radix import pack_tokens
from mesh_hicache.testing import internals
from mesh_hicache.topology import MeshTopology
from tests.distributed.harness import run_on_mesh
from tests.unit.cache_support import (
    PS,
    RaisingBackend,
    hashes_of,
    make_config,
    make_spec,
    registry_entries,
    serve,
    stored_objects,
)


def _prompts(seed: int, count: int) -> list[tuple[list[int], str | None]]:
    """A workload with shared prefixes: (tokens, abort stage). Same seed -> same list."""
    rng = random.Random(seed)
    stems = [[rng.randrange(40) for _ in range(PS * rng.randint(1, 2))] for _ in range(4)]
    out = []
    for _ in range(count):
        tail = [rng.randrange(3) for _ in range(PS * rng.randint(0, 2))]
        abort = rng.choice([None, None, None, None, "match", "load", "alloc"])
        out.append((rng.choice(stems) + tail, abort))
    return out


def _checkpoints(tokens: list[int]) -> tuple[int, ...]:
    n = len(tokens) // PS
    return (max(1, n - 1), n)


def _workload_body(
    mesh: Any, root: str, seed: int, prefetch_policy: str, count: int
) -> dict[str, Any]:
    topo = MeshTopology.from_mesh(mesh)
    spec = make_spec()
    config = make_config(root, host_pages=12, host_mamba_slots=6, prefetch_policy=prefetch_policy)
    cache = HiCache(topo, spec, config)
    digests, mismatches, integrity = [], 0, True
    work = _prompts(seed, count)
    for i, (tokens, abort) in enumerate(work):
        mismatches += serve(cache, tokens, checkpoints=_checkpoints(tokens), abort=abort).mismatches
        if i % 8 == 7:
            cache.step()
            digests.append(cache.digest())
    cache.flush()
    try:
        cache.check_integrity()
    except RuntimeError:
        integrity = False
    digests.append(cache.digest())
    stats = cache.stats()
    storage = internals(cache).storage
    assert storage is not None
    backend = storage.stats
    layout = internals(cache).layout
    regions = [(r.name.value, r.global_slice.tag(), r.is_writer) for r in layout.held_regions()]
    cache.close()
    dist.barrier()

    # Second run: empty L1/L2, same root. Every distinct prompt of the first run again.
    second = HiCache(topo, spec, make_config(root, prefetch_policy="wait_complete"))
    l3_tokens = 0
    seen: set[tuple[int, ...]] = set()
    for tokens, _ in work:
        if tuple(tokens) in seen:
            continue
        seen.add(tuple(tokens))
        got = serve(second, tokens, checkpoints=_checkpoints(tokens))
        mismatches += got.mismatches
        l3_tokens += got.served[2]
    second.flush()
    second_storage = internals(second).storage
    assert second_storage is not None
    puts = backend.puts + second_storage.stats.puts
    try:
        second.check_integrity()
    except RuntimeError:
        integrity = False
    digests.append(second.digest())
    second.close()
    return {
        "digests": digests,
        "mismatches": mismatches,
        "integrity": integrity,
        "regions": regions,
        "puts": puts,
        "l3_tokens": l3_tokens,
        "hit_tokens": stats.hit_tokens,
        "evicted_device": stats.evicted_device_pages,
    }


@pytest.mark.parametrize(
    ("shape", "prefetch_policy", "count"),
    [((1, 2, 2), "best_effort", 32), ((2, 1, 2), "timeout", 32), ((2, 2, 2), "wait_complete", 16)],
    ids=["1x2x2", "2x1x2", "2x2x2"],
)
def test_random_workload_agrees_and_only_writers_write(tmp_path, shape, prefetch_policy, count):
    root = tmp_path / "l3"
    out = run_on_mesh(shape, _workload_body, str(root), 11, prefetch_policy, count, timeout=120)
    assert all(o["digests"] == out[0]["digests"] for o in out)
    assert all(o["integrity"] and o["mismatches"] == 0 for o in out)
    assert out[0]["hit_tokens"] > 0 and out[0]["evicted_device"] > 0
    # Second run: L3 hits, the same on every rank (agreed).
    assert out[0]["l3_tokens"] > 0 and all(o["l3_tokens"] == out[0]["l3_tokens"] for o in out)

    # Elected writers: each (region, slice) has exactly one writer over the mesh; the
    # files are exactly those slices, and each rank wrote exactly the files of its slices.
    writers: dict[tuple[str, str], int] = {}
    for o in out:
        for region, tag, is_writer in o["regions"]:
            writers.setdefault((region, tag), 0)
            writers[(region, tag)] += is_writer
    assert all(count == 1 for count in writers.values()), writers
    files = stored_objects(root)
    assert {(r, t) for r, _, t in files} == set(writers)
    # Besides its slices, one rank records the mesh's layout once (tiers/discovery.py).
    layouts = registry_entries(root)
    assert layouts == 1
    for o in out:
        mine = {(r, t) for r, t, w in o["regions"] if w}
        assert o["puts"] - sum((r, t) in mine for r, _, t in files) in (0, layouts)
    assert sum(o["puts"] for o in out) == len(files) + layouts


# -- faults on one rank ------------------------------------------------------------------


FAULTY = 3
"""The rank that fails (pp0/cp1/tp1 on 1x2x2: a reader of tp slice 1, writer of nothing)."""


def _faults_body(mesh: Any, root: str) -> dict[str, Any]:
    topo = MeshTopology.from_mesh(mesh)
    spec = make_spec()
    me = dist.get_rank()
    out: dict[str, Any] = {"digests": [], "mismatches": 0}
    p = list(range(100, 112))
    q = list(range(200, 212))

    def record(cache: HiCache) -> None:
        out["digests"].append(cache.digest())
        cache.check_integrity()

    # 1. The host allocation of a backup fails on one rank: skipped on every rank.
    cache = HiCache(topo, spec, make_config(root))
    host = internals(cache).host
    assert host is not None
    if me == FAULTY:
        host.page_allocator.can_allocate = lambda n: False  # type: ignore[method-assign]
    serve(cache, q, checkpoints=(2, 3))
    cache.flush()
    record(cache)
    out["backed_up_while_failing"] = _node(cache, q).host_indices is not None
    out["skipped"] = cache.stats().backup_skipped_host_full
    if me == FAULTY:
        del host.page_allocator.can_allocate
    serve(cache, p, checkpoints=(2, 3))  # backed up (and stored) again
    cache.flush()
    record(cache)
    out["backed_up_after"] = _node(cache, p).host_indices is not None
    cache.close()
    dist.barrier()

    # 2. One rank's storage reads fail: the agreed prefetch result is nothing, no wrong data.
    cache = HiCache(topo, spec, make_config(root))
    storage = internals(cache).storage
    assert storage is not None
    if me == FAULTY:
        storage.get = lambda keys, dst: [False] * len(keys)  # type: ignore[method-assign]
    got = serve(cache, p, checkpoints=(2, 3))
    out["read_fail"] = (got.hit.storage_tokens, got.prefix, got.served)
    out["mismatches"] += got.mismatches
    record(cache)
    cache.close()
    dist.barrier()

    # 3. One slice's object of the last page is gone: the agreed L3 hit is the minimum
    #    (the state boundary at page 2 on the ranks that miss page 3), read bit-exact.
    if me == 0:
        tag = [t for r, h, t in stored_objects(root) if r == "kv" and ".H1-2." in t][0]
        victim = hashes_of(p)[2].hex()
        for path in Path(root).rglob(f"kv/{victim}/{tag}"):
            path.unlink()
    dist.barrier()
    cache = HiCache(topo, spec, make_config(root))
    got = serve(cache, p, checkpoints=(2, 3))
    out["partial"] = (got.hit.storage_tokens, got.prefix, got.served)
    out["mismatches"] += got.mismatches
    record(cache)

    cache.close()
    dist.barrier()

    # 4. The host reservation of a prefetch fails on one rank: no prefetch on any rank.
    cache = HiCache(topo, spec, make_config(root))
    host = internals(cache).host
    assert host is not None
    if me == FAULTY:
        host.page_allocator.can_allocate = lambda n: False  # type: ignore[method-assign]
    got = serve(cache, p, checkpoints=(2, 3))
    out["prefetch_host_fail"] = (got.hit.storage_tokens, got.prefix)
    out["prefetch_skipped"] = cache.stats().prefetch_skipped_host_full
    out["mismatches"] += got.mismatches
    if me == FAULTY:
        del host.page_allocator.can_allocate
    cache.flush()
    record(cache)
    cache.close()
    dist.barrier()

    # 5. One rank's backend raises on every call: L3 reads as a miss everywhere, the cache
    #    keeps serving from L1 + L2.
    cache = HiCache(topo, spec, make_config(root))
    storage = internals(cache).storage
    assert storage is not None
    if me == FAULTY:
        storage._backend = RaisingBackend()  # type: ignore[attr-defined]
        storage._connect = None  # type: ignore[attr-defined]
    first = serve(cache, p, checkpoints=(2, 3))
    again = serve(cache, p, checkpoints=(2, 3))
    out["raising"] = (first.hit.storage_tokens, first.prefix, again.served)
    out["mismatches"] += first.mismatches + again.mismatches
    out["degraded"] = cache.stats().storage_degraded
    cache.flush()
    record(cache)
    cache.close()
    return out


def _node(cache: HiCache, tokens: list[int]):
    """The tree node ending at ``tokens`` (read-only walk: no clock or hit count change)."""
    node = internals(cache).tree._roots[""]
    pos = 0
    while pos < len(tokens):
        node = node.children[pack_tokens(tokens[pos : pos + PS])]
        pos += node.num_tokens
    return node


def test_one_rank_faults_are_agreed(tmp_path):
    out = run_on_mesh((1, 2, 2), _faults_body, str(tmp_path / "l3"), timeout=120)
    assert all(o["digests"] == out[0]["digests"] for o in out)
    assert all(o["mismatches"] == 0 for o in out)
    for o in out:
        assert o["skipped"] == 2 and not o["backed_up_while_failing"] and o["backed_up_after"]
        assert o["read_fail"] == (12, 0, (0, 0, 0))
        assert o["partial"] == (8, 8, (0, 0, 8))
        assert o["prefetch_host_fail"] == (0, 0) and o["prefetch_skipped"] == 1
        assert o["raising"] == (0, 0, (12, 0, 0))
    assert [o["degraded"] for o in out] == [r == FAULTY for r in range(4)]


# -- misuse is refused on every rank together ----------------------------------------------


def _misuse_body(mesh: Any, root: str) -> dict[str, Any]:
    """Every rank makes the same mistakes; each must raise on every rank (checks read only
    replicated state), and the mesh must go on serving in lockstep afterwards."""
    cache = HiCache(MeshTopology.from_mesh(mesh), make_spec(), make_config(root))
    a = list(range(100, 112))
    serve(cache, a)
    raised = []
    req = cache.match(a + list(range(500, 508)))
    cache.load(req)
    cache.finish_load(req)
    pages = req.prefix_pages + cache.alloc_pages(req, 2)
    for bad in ([pages[0]] * len(pages), pages[:-1] + [10**6]):
        try:
            cache.insert(req, a + list(range(500, 508)), bad)
        except ValueError:
            raised.append(True)
    try:
        cache.alloc_pages(req, -1)
    except ValueError:
        raised.append(True)
    cache.release(req)
    try:
        cache.alloc_slot(req)
    except ValueError:
        raised.append(True)
    got = serve(cache, a)
    cache.flush()
    cache.check_integrity()
    out = {"raised": raised, "prefix": got.prefix, "digest": cache.digest()}
    cache.close()
    return out


def test_misuse_raises_on_every_rank_and_the_mesh_goes_on(tmp_path):
    out = run_on_mesh((2, 1, 2), _misuse_body, str(tmp_path / "l3"), timeout=120)
    assert all(o["raised"] == [True] * 4 for o in out)
    assert all(o["prefix"] == 12 and o["digest"] == out[0]["digest"] for o in out)
