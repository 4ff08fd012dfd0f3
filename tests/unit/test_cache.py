"""HiCache on one rank: write policies, load-back, L3 round trips, the Mamba rule,
corrupt/foreign objects, aborted requests, and leak checks after a random run."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from mesh_hicache.cache import HiCache
from mesh_hicache.choices import PrefetchPolicy
from mesh_hicache.layout import RegionName
from mesh_hicache.radix import pack_tokens
from mesh_hicache.storage.keys import HEADER_SIZE
from mesh_hicache.testing import internals
from mesh_hicache.transfer.engine import TransferKind
from tests.unit.cache_support import (
    PS,
    RaisingBackend,
    budget_overrides,
    count_mismatches,
    evict_everything,
    expected_kv,
    expected_state,
    hashes_of,
    make_config,
    make_spec,
    poison_free_device,
    pools_fully_free,
    serve,
    stored_objects,
)

A = list(range(100, 112))  # 3 pages
B = list(range(200, 212))
C = list(range(300, 312))


@pytest.fixture
def make_cache(one_rank_topology):
    caches: list[HiCache] = []

    def build(root: Path | None = None, spec=None, **overrides) -> HiCache:
        cache = HiCache(one_rank_topology, spec or make_spec(), make_config(root, **overrides))
        caches.append(cache)
        return cache

    yield build
    for cache in caches:
        cache.close()


def node_of(cache: HiCache, tokens: list[int]):
    """The tree node ending at ``tokens`` (without touching hit counts or the clock)."""
    node = internals(cache).tree._roots[""]
    pos = 0
    while pos < len(tokens):
        node = node.children[pack_tokens(tokens[pos : pos + PS])]
        pos += node.num_tokens
    assert pos == len(tokens)
    return node


def host_matches(cache: HiCache, tokens: list[int]) -> bool:
    """Whether the node's host pages and host state hold exactly the expected bits."""
    node = node_of(cache, tokens)
    host = internals(cache).host
    assert host is not None and node.host_indices is not None
    assert node.mamba_host_slot is not None
    kv_region = host.region(RegionName.KV)
    hashes = hashes_of(tokens)
    for h, page in zip(hashes, node.host_indices, strict=True):
        row = host.row(RegionName.KV, page)
        for layer in kv_region.local_layer_ids:
            k, v = expected_kv(cache, h, layer)
            r = kv_region.layer_row(layer)
            if not (row[r, 0].equal(k) and row[r, 1].equal(v)):
                return False
    conv_region = host.region(RegionName.MAMBA_CONV)
    for layer in conv_region.local_layer_ids:
        conv, ssm = expected_state(cache, hashes[-1], layer)
        r = conv_region.layer_row(layer)
        if not host.row(RegionName.MAMBA_CONV, node.mamba_host_slot)[r].equal(conv):
            return False
        if not host.row(RegionName.MAMBA_SSM, node.mamba_host_slot)[r].equal(ssm):
            return False
    return True


def kv_page_bytes(cache: HiCache) -> int:
    return internals(cache).layout.page_bytes


def slot_bytes(cache: HiCache) -> int:
    return internals(cache).layout.slot_bytes


# -- write policies ----------------------------------------------------------------------


def test_write_through_backs_up_on_insert(make_cache):
    cache = make_cache(write_policy="write_through")
    assert serve(cache, A).prefix == 0
    cache.flush()
    node = node_of(cache, A)
    assert node.host_indices is not None and node.mamba_host_slot is not None
    assert host_matches(cache, A)
    assert cache.stats().bytes_device_to_host == 3 * kv_page_bytes(cache) + slot_bytes(cache)
    # A repeat hit moves nothing more.
    assert serve(cache, A).served == (12, 0, 0)
    cache.flush()
    assert cache.stats().bytes_device_to_host == 3 * kv_page_bytes(cache) + slot_bytes(cache)
    cache.check_integrity()


def test_write_through_selective_backs_up_on_second_hit(make_cache):
    cache = make_cache(write_policy="write_through_selective")
    serve(cache, A)  # insert
    cache.flush()
    assert node_of(cache, A).host_indices is None
    assert serve(cache, A).served == (12, 0, 0)  # first hit
    cache.flush()
    assert node_of(cache, A).host_indices is None
    assert cache.stats().bytes_device_to_host == 0
    serve(cache, A)  # second hit: backed up now
    cache.flush()
    assert host_matches(cache, A)
    assert cache.stats().bytes_device_to_host == 3 * kv_page_bytes(cache) + slot_bytes(cache)
    cache.check_integrity()


def test_write_back_backs_up_only_on_device_eviction(make_cache):
    cache = make_cache(write_policy="write_back")
    serve(cache, A)
    serve(cache, B)
    cache.flush()
    assert cache.stats().bytes_device_to_host == 0
    assert node_of(cache, A).host_indices is None
    serve(cache, C)  # needs 3 of 8 pages with 2 free: evicts A (LRU), backing it up first
    cache.flush()
    node = node_of(cache, A)
    assert node.device_indices is None and node.host_indices is not None
    assert host_matches(cache, A)
    assert node_of(cache, B).host_indices is None  # not evicted, not backed up
    stats = cache.stats()
    assert stats.bytes_device_to_host == 3 * kv_page_bytes(cache) + slot_bytes(cache)
    assert stats.evicted_device_pages == 3
    poison_free_device(cache)
    got = serve(cache, A)
    assert got.mismatches == 0 and got.served == (0, 12, 0)
    cache.check_integrity()


@pytest.mark.parametrize("budget", [False, True], ids=["pools", "byte-budget"])
def test_load_back_restores_kv_and_state_bit_exact(make_cache, budget):
    # Two device slots: serving C evicts A's device state too (A keeps its host copy). In
    # one arena the split follows demand: 6 pages + 2 states' bytes hold B and C only.
    pools = dict(device_mamba_slots=2)
    if budget:
        pools = budget_overrides(device_pages=6, device_mamba_slots=2)
    cache = make_cache(write_policy="write_through", **pools)
    serve(cache, A)
    serve(cache, B)
    serve(cache, C)
    cache.flush()
    node = node_of(cache, A)
    assert node.device_indices is None and node.mamba_device_slot is None
    assert node.host_indices is not None and node.mamba_host_slot is not None
    poison_free_device(cache)
    got = serve(cache, A)
    assert got.hit.host_tokens == 12 and got.prefix == 12
    assert got.served == (0, 12, 0) and got.mismatches == 0
    stats = cache.stats()
    assert stats.bytes_host_to_device == 3 * kv_page_bytes(cache) + slot_bytes(cache)
    assert stats.mamba_hits_host == 1
    cache.check_integrity()


def test_failed_load_is_a_miss_and_frees_its_reservation(make_cache):
    cache = make_cache(write_policy="write_through", device_mamba_slots=2)
    for t in (A, B, C):
        serve(cache, t)
    cache.flush()
    engine = internals(cache).engine
    assert engine is not None
    engine.fail_next()
    got = serve(cache, A, abort="alloc")
    assert got.prefix == 0 and got.served == (0, 0, 0)
    assert cache.stats().load_failures == 1
    cache.check_integrity()
    assert serve(cache, A).served == (0, 12, 0)  # the host copy is still there


def test_alloc_waits_for_in_flight_backups_instead_of_failing(make_cache):
    """A node whose backup is still in flight is locked; an allocation that needs its
    pages waits for the backup (agreed flush) instead of raising CacheFull."""
    cache = make_cache(write_policy="write_through")
    ctl = internals(cache).controller
    engine = ctl.engine
    assert engine is not None
    gate = threading.Event()
    steps = engine._steps

    def gated(op):
        if op.handle.kind is TransferKind.BACKUP:
            gate.wait()
        return steps(op)

    flush = ctl.flush

    def open_then_flush():
        gate.set()
        flush()

    engine._steps = gated  # type: ignore[method-assign]
    ctl.flush = open_then_flush  # type: ignore[method-assign]
    serve(cache, A)
    serve(cache, B)
    got = serve(cache, C)  # A's pages are needed while A's backup is still held back
    assert not got.cache_full and gate.is_set()
    assert node_of(cache, A).device_indices is None and node_of(cache, C).device_indices
    cache.flush()
    cache.check_integrity()


# -- L3 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [False, True], ids=["pools", "byte-budget"])
@pytest.mark.parametrize("policy", PrefetchPolicy.values())
def test_l3_round_trip_into_a_new_cache(make_cache, tmp_path, policy, budget):
    root = tmp_path / "l3"
    pools = budget_overrides() if budget else {}
    first = make_cache(root, **pools)
    serve(first, A, checkpoints=(2, 3))
    first.close()
    assert len(stored_objects(root)) == 3 + 2 * 2  # 3 KV pages, 2 states of 2 regions
    cache = make_cache(root, prefetch_policy=policy, prefetch_timeout_base_s=30.0, **pools)
    poison_free_device(cache)
    req = cache.match(A)
    assert req.hit.storage_tokens == 12 and req.hit.device_tokens == req.hit.host_tokens == 0
    if policy == "best_effort":
        # best_effort takes what arrived when load() runs; let it all arrive first.
        prefetch = internals(cache).prefetch(req)
        assert prefetch is not None
        prefetch.finished.wait()
    cache.load(req)
    assert cache.finish_load(req) == 12 and req.served == (0, 0, 12)
    assert count_mismatches(cache, req, hashes_of(A)) == 0
    cache.release(req)
    stats = cache.stats()
    assert stats.prefetch["completed"] == 1 and stats.hit_tokens_storage == 12
    cache.flush()
    cache.check_integrity()


def test_best_effort_prefetch_takes_what_arrived(make_cache, tmp_path):
    root = tmp_path / "l3"
    store(make_cache(root), A)
    cache = make_cache(root, prefetch_policy="best_effort")
    got = serve(cache, A)  # load() may stop the read before or after it finished
    assert got.mismatches == 0 and got.prefix in (0, 12)
    assert got.served == (0, 0, got.prefix)
    cache.flush()
    cache.check_integrity()


def test_below_threshold_does_not_prefetch(make_cache, tmp_path):
    root = tmp_path / "l3"
    store(make_cache(root), A)
    cache = make_cache(root, prefetch_threshold=16)
    got = serve(cache, A)
    assert got.hit.storage_tokens == 0 and got.prefix == 0
    assert cache.stats().prefetch["below_threshold"] == 1


def store(cache: HiCache, tokens: list[int], **kw) -> None:
    """Serve ``tokens`` in a cache of its own and close it (its L3 writes done)."""
    serve(cache, tokens, **kw)
    cache.close()


def _object_path(root: Path, region: str, page_hash: bytes) -> Path:
    hits = [o for o in stored_objects(root) if o[0] == region and o[1] == page_hash.hex()]
    assert len(hits) == 1
    return root.joinpath("v1", os.listdir(root / "v1")[0], region, hits[0][1], hits[0][2])


def test_mamba_before_kv_stops_at_last_stored_state(make_cache, tmp_path):
    root = tmp_path / "l3"
    writer = make_cache(root)
    serve(writer, A, checkpoints=(2, 3))
    writer.close()
    hashes = hashes_of(A)
    # The state at page 3 is gone (one of its two regions): L3 hit ends at page 2.
    _object_path(root, "mamba_ssm", hashes[2]).unlink()
    cache = make_cache(root)
    poison_free_device(cache)
    got = serve(cache, A)
    assert got.hit.storage_tokens == 8 and got.prefix == 8 and got.mismatches == 0
    assert got.served == (0, 0, 8)
    # No state at all: no L3 hit, although every KV page is stored.
    _object_path(root, "mamba_conv", hashes[1]).unlink()
    other = make_cache(root)
    got = serve(other, A)
    assert got.hit.storage_tokens == 0 and got.prefix == 0


def test_corrupt_object_reads_as_a_miss(make_cache, tmp_path):
    root = tmp_path / "l3"
    store(make_cache(root), A)
    path = _object_path(root, "kv", hashes_of(A)[1])
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    cache = make_cache(root)
    poison_free_device(cache)
    got = serve(cache, A)
    # exists() does not verify, so the prefetch starts; its read fails: nothing is used.
    assert got.hit.storage_tokens == 12
    assert got.prefix == 0 and got.mismatches == 0
    stats = cache.stats()
    assert stats.storage_get_misses >= 1 and stats.prefetch["completed"] == 0
    cache.flush()
    cache.check_integrity()
    assert pools_fully_free(cache) is False  # A was computed and cached again
    evict_everything(cache)
    assert pools_fully_free(cache)


@pytest.mark.parametrize(
    "change",
    [
        {"tenant": "someone-else"},
        {"spec": make_spec(model_id="other/model")},
        {"spec": make_spec(kv_dtype=__import__("torch").bfloat16)},
        {"layout_version": 2},
    ],
    ids=["tenant", "model", "dtype", "layout_version"],
)
def test_other_namespace_misses(make_cache, tmp_path, change):
    root = tmp_path / "l3"
    store(make_cache(root), A)
    cache = make_cache(root, **change)
    got = serve(cache, A)
    assert got.hit.storage_tokens == 0 and got.prefix == 0
    # The same namespace still hits (the objects are there).
    assert serve(make_cache(root), A).hit.storage_tokens == 12


def test_traversal_strings_in_namespace_stay_under_root(make_cache, tmp_path):
    root = tmp_path / "sub" / "l3"
    spec = make_spec(model_id="../../escape")
    cache = make_cache(root, spec=spec, tenant="../../../tenant")
    serve(cache, A, namespace="../..")
    cache.flush()
    assert sorted(os.listdir(tmp_path)) == ["sub"]
    assert sorted(os.listdir(tmp_path / "sub")) == ["l3"]
    assert len(stored_objects(root)) == 5


# -- aborts and leaks --------------------------------------------------------------------


@pytest.mark.parametrize("abort", ["match", "load", "alloc"])
def test_aborted_requests_leak_nothing(make_cache, tmp_path, abort):
    root = tmp_path / "l3"
    store(make_cache(root), A)
    cache = make_cache(root, device_mamba_slots=2)
    for t in (B, C):
        serve(cache, t)
    cache.flush()
    got = serve(cache, A, abort=abort)  # from L3: a prefetch is in flight after match
    assert got.hit.storage_tokens == 12
    hit = serve(cache, B, abort=abort).hit  # from L1 or L2 (A's load may evict it)
    assert hit.device_tokens + hit.host_tokens == 12
    cache.flush()
    assert internals(cache).num_open == 0
    cache.check_integrity()
    outcomes = cache.stats().prefetch
    assert outcomes["aborted"] == (abort == "match") and outcomes["completed"] == (abort != "match")
    evict_everything(cache)
    assert internals(cache).tree.num_nodes == 0 and pools_fully_free(cache)


@pytest.mark.parametrize("budget", [False, True], ids=["pools", "byte-budget"])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_random_run_leaks_nothing(make_cache, tmp_path, policy, budget):
    rng = random.Random(7)
    pools = budget_overrides() if budget else {}
    cache = make_cache(tmp_path / "l3", write_policy=policy, prefetch_policy="best_effort", **pools)
    stems = [[rng.randrange(50) for _ in range(PS * rng.randint(1, 2))] for _ in range(4)]
    mismatches = 0
    for i in range(60):
        tokens = rng.choice(stems) + [rng.randrange(3) for _ in range(PS * rng.randint(0, 3))]
        if not tokens:
            continue
        n = len(tokens) // PS
        abort = rng.choice([None, None, None, "match", "load", "alloc"])
        got = serve(cache, tokens, checkpoints=(max(1, n - 1), n), abort=abort)
        mismatches += got.mismatches
        if i % 7 == 0:
            cache.step()
        if i % 13 == 0:
            cache.flush()
            cache.check_integrity()
    assert mismatches == 0
    cache.flush()
    cache.check_integrity()
    stats = cache.stats()
    assert stats.evicted_device_pages > 0 and stats.hit_tokens > 0
    evict_everything(cache)
    assert internals(cache).tree.num_nodes == 0 and pools_fully_free(cache)


# -- a failing backend -------------------------------------------------------------------


def test_raising_backend_degrades_to_l1_l2(make_cache, tmp_path):
    cache = make_cache(tmp_path / "l3", device_mamba_slots=2, write_policy="write_through")
    storage = internals(cache).storage
    assert storage is not None
    storage._backend = RaisingBackend()  # GuardedStorage's wrapped backend
    storage._connect = None
    results = [serve(cache, t) for t in (A, B, C, A, B)]
    cache.flush()
    assert all(r.mismatches == 0 for r in results)
    assert results[3].served == (0, 12, 0) and results[4].served[0] + results[4].served[1] == 12
    stats = cache.stats()
    assert stats.storage_degraded and stats.storage_errors >= 1
    assert stats.hit_tokens_storage == 0
    cache.check_integrity()


def test_partial_prefetch_stops_at_the_deepest_stored_state(make_cache, tmp_path):
    # KV of page 3 is unreadable (corrupt): the read stops after page 2, where a state
    # is stored, so the prefetch keeps 8 tokens instead of nothing.
    root = tmp_path / "l3"
    writer = make_cache(root)
    serve(writer, A, checkpoints=(2, 3))
    writer.close()
    path = _object_path(root, "kv", hashes_of(A)[2])
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    cache = make_cache(root)
    poison_free_device(cache)
    got = serve(cache, A)
    assert got.hit.storage_tokens == 12  # existence said 3 pages...
    assert got.prefix == 8 and got.served == (0, 0, 8) and got.mismatches == 0  # ...2 arrived
    assert cache.stats().prefetch["partial"] == 1
    cache.flush()
    cache.check_integrity()


def test_write_back_keeps_states_evicted_from_device(make_cache):
    # One device state slot: serving B evicts A's device state; write-back copies it to
    # host first, so A still hits (KV and state from host) instead of losing its state.
    cache = make_cache(write_policy="write_back", device_mamba_slots=1)
    serve(cache, A)
    serve(cache, B)
    cache.flush()
    node = node_of(cache, A)
    assert node.mamba_device_slot is None and node.mamba_host_slot is not None
    poison_free_device(cache)
    got = serve(cache, A)
    assert got.prefix == 12 and got.mismatches == 0
    cache.flush()
    cache.check_integrity()


def test_failed_backup_drops_its_host_copies_under_an_open_request(make_cache):
    # A is on device only (write-back). A request extending A matches (and host-protects)
    # A's path; under write-through its insert backs up A and the extension, and that
    # copy fails. Consuming the failure while the request is still open must drop the
    # half-written host copies without tripping over the request's protection.
    cache = make_cache(write_policy="write_back")
    serve(cache, A)
    internals(cache).set_write_policy("write_through")
    longer = A + list(range(500, 504))
    req = cache.match(longer)
    cache.load(req)
    assert cache.finish_load(req) == 12
    pages = req.prefix_pages + cache.alloc_pages(req, 1)
    slot = cache.alloc_slot(req)  # a hybrid insert carries the state at its end
    internals(cache).engine.fail_next()
    cache.insert(req, longer, pages, slot)
    cache.flush()  # consumes the failed backup while req holds A's path
    assert node_of(cache, A).host_indices is None
    assert node_of(cache, longer).host_indices is None
    assert cache.stats().backup_failures == 1
    cache.release(req)
    cache.check_integrity()


# -- misuse ------------------------------------------------------------------------------


def test_cached_request_is_read_only(make_cache):
    cache = make_cache()
    req = cache.match(A)
    for name, value in [("prefix_len", 12), ("prefix_pages", [0]), ("mamba_slot", 0)]:
        with pytest.raises(AttributeError):
            setattr(req, name, value)
    req.prefix_pages.append(7)  # a copy: the request's pages are unchanged
    assert req.prefix_pages == []
    cache.release(req)
    cache.check_integrity()


def test_finish_load_before_load_or_twice_raises(make_cache):
    cache = make_cache()
    req = cache.match(A)
    with pytest.raises(RuntimeError, match="before load"):
        cache.finish_load(req)
    cache.load(req)
    assert cache.finish_load(req) == 0
    with pytest.raises(RuntimeError, match="twice"):
        cache.finish_load(req)
    cache.release(req)
    cache.check_integrity()


_UNDER_O = """
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from mesh_hicache import HiCache, MeshTopology
from tests.unit.cache_support import make_config, make_spec
assert not __debug__
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "cp", "tp"))
cache = HiCache(MeshTopology.from_mesh(mesh), make_spec(), make_config())
req = cache.match(list(range(8)))
try:
    cache.finish_load(req)
except RuntimeError as e:
    print("raised:", e)
cache.close()
"""


def test_finish_load_misuse_raises_under_python_O():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-O", "-c", _UNDER_O],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert "raised: finish_load(req) called before load(req)" in out.stdout


def test_write_thread_errors_are_counted_and_logged_once(make_cache, tmp_path, caplog):
    # A write that raises on the write thread (here: the guard's own put fails) once
    # vanished with its future; now it is counted and logged once.
    cache = make_cache(tmp_path / "l3", write_policy="write_through")
    storage = internals(cache).storage
    assert storage is not None
    storage.put = RaisingBackend().put  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="mesh_hicache.tiers.l3"):
        results = [serve(cache, t) for t in (A, B, C)]
        cache.flush()
    assert all(r.mismatches == 0 for r in results)
    assert cache.stats().storage_write_errors == 3
    logged = [r for r in caplog.records if "failed on the write thread" in r.getMessage()]
    assert len(logged) == 1 and "ConnectionError" in logged[0].getMessage()
    again = serve(cache, A).served  # still served, from L1/L2
    assert again.device + again.host == 12 and again.storage == 0
    cache.check_integrity()
