"""The request API under misuse: exception-safe ``match``, lock accounting in
``check_integrity``, ``insert`` validated before anything changes, released and foreign
requests refused, token and count validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh_hicache.cache import HiCache
from mesh_hicache.testing import internals
from tests.unit.cache_support import (
    PS,
    RaisingBackend,
    hashes_of,
    make_config,
    make_spec,
    serve,
    write_pages,
    write_state,
)

A = list(range(100, 112))  # 3 pages
LONGER = A + list(range(600, 608))  # A plus 2 pages


@pytest.fixture
def make_cache(one_rank_topology):
    caches: list[HiCache] = []

    def build(root: Path | None = None, **overrides) -> HiCache:
        cache = HiCache(one_rank_topology, make_spec(), make_config(root, **overrides))
        caches.append(cache)
        return cache

    yield build
    for cache in caches:
        cache.close()


def no_protection_left(cache: HiCache) -> bool:
    return all(n.lock_ref == 0 and n.host_ref == 0 for n in internals(cache).tree.iter_nodes())


def snapshot(cache: HiCache) -> tuple:
    """Tree digest plus every allocator's free count: equal before and after a refused call."""
    dev = cache.device
    host = internals(cache).host
    assert host is not None
    frees = (dev.page_allocator, dev.slot_allocator, host.page_allocator, host.slot_allocator)
    return (cache.digest(), tuple(a.num_free for a in frees))


def loaded(cache: HiCache, tokens: list[int]):
    """A request for ``tokens`` after match, load and finish_load."""
    req = cache.match(tokens)
    cache.load(req)
    cache.finish_load(req)
    return req


# -- match: no lock left behind ----------------------------------------------------------


def test_match_leaves_no_lock_when_storage_raises_inside(make_cache, tmp_path):
    cache = make_cache(tmp_path / "l3")
    serve(cache, A)
    cache.flush()
    l3 = internals(cache).controller.l3
    guarded, l3.backend = l3.backend, RaisingBackend()  # an unguarded, failing store
    with pytest.raises(ConnectionError):
        cache.match(LONGER)  # A is held, then the L3 query of the 2 pages beyond raises
    l3.backend = guarded
    assert no_protection_left(cache)
    assert internals(cache).num_open == 0
    cache.check_integrity()


def test_match_frees_the_prefetch_reservation_when_starting_it_raises(make_cache, tmp_path):
    root = tmp_path / "l3"
    writer = make_cache(root)
    serve(writer, A)
    writer.flush()
    cache = make_cache(root)
    before = snapshot(cache)
    reader = internals(cache).controller.l3._reader
    reader.shutdown()  # submit now raises RuntimeError, after the host pages were reserved
    with pytest.raises(RuntimeError):
        cache.match(A)
    assert snapshot(cache) == before
    assert no_protection_left(cache) and internals(cache).num_open == 0
    cache.check_integrity()


@pytest.mark.parametrize(
    "bad, error",
    [
        (2**70, ValueError),
        (2**63, ValueError),
        (-1, ValueError),
        (True, TypeError),
        (1.0, TypeError),
    ],
    ids=["2**70", "2**63", "negative", "bool", "float"],
)
def test_match_refuses_bad_tokens_and_holds_nothing(make_cache, bad, error):
    cache = make_cache()
    serve(cache, A)
    cache.flush()
    with pytest.raises(error, match="position 12"):
        cache.match(A + [bad])
    assert no_protection_left(cache) and internals(cache).num_open == 0
    cache.check_integrity()


def test_float_token_never_hits_the_int_tokens_cache(make_cache):
    cache = make_cache()
    serve(cache, A)
    with pytest.raises(TypeError):
        cache.match([t + 0.7 for t in A])


# -- check_integrity counts protections --------------------------------------------------


@pytest.mark.parametrize("kind", ["lock", "protect_host"])
def test_check_integrity_fails_on_a_leaked_protection(make_cache, kind):
    cache = make_cache()
    serve(cache, A)
    cache.flush()
    cache.check_integrity()
    tree = internals(cache).tree
    node = tree.node_at(internals(cache).lease(cache.match(A)).key)
    assert node is not None
    getattr(tree, kind)(node)  # a protection no request or backup holds
    with pytest.raises(RuntimeError, match="lock_ref|host_ref"):
        cache.check_integrity()


def test_check_integrity_accepts_the_protections_of_open_requests(make_cache):
    cache = make_cache()
    serve(cache, A)
    reqs = [loaded(cache, A), loaded(cache, A), cache.match(LONGER)]
    cache.flush()
    cache.check_integrity()
    for req in reqs:
        cache.release(req)
    cache.check_integrity()


# -- insert validates before mutating ----------------------------------------------------


def _new_request(cache: HiCache, tokens: list[int]):
    """A request for ``tokens`` with its pages allocated and written, nothing inserted."""
    req = loaded(cache, tokens)
    pages = cache.alloc_pages(req, len(tokens) // PS)
    write_pages(cache, hashes_of(tokens), pages)
    return req, pages


@pytest.mark.parametrize(
    "misuse",
    ["never_allocated", "duplicated", "other_request", "out_of_range", "negative", "free_slot"],
)
def test_insert_misuse_is_refused_with_the_tree_unchanged(make_cache, misuse):
    cache = make_cache()
    serve(cache, list(range(700, 708)))
    req, pages = _new_request(cache, A)
    other, other_pages = _new_request(cache, list(range(800, 812)))
    slot = cache.alloc_slot(req)
    write_state(cache, hashes_of(A)[-1], slot)
    free_pages = [
        i for i in range(cache.device.num_pages) if cache.device.page_allocator.is_free(i)
    ]
    bad_pages, bad_slot = list(pages), slot
    if misuse == "never_allocated":
        bad_pages[1] = free_pages[0] if free_pages else other_pages[0]
    elif misuse == "duplicated":
        bad_pages[2] = bad_pages[0]
    elif misuse == "other_request":
        bad_pages[1] = other_pages[1]
    elif misuse == "out_of_range":
        bad_pages[2] = cache.device.num_pages
    elif misuse == "negative":
        bad_pages[0] = -1
    else:
        free_slots = [
            i for i in range(cache.device.num_slots) if cache.device.slot_allocator.is_free(i)
        ]
        assert free_slots
        bad_slot = free_slots[0]
    before = snapshot(cache)
    with pytest.raises(ValueError):
        cache.insert(req, A, bad_pages, mamba_slot=bad_slot)
    assert snapshot(cache) == before
    cache.check_integrity()
    # The request is still usable: the right pages go in.
    cache.insert(req, A, pages, mamba_slot=slot)
    for r in (req, other):
        cache.release(r)
    cache.flush()
    cache.check_integrity()
    assert serve(cache, A).prefix == 12


def test_insert_with_the_same_pages_at_two_checkpoints(make_cache):
    # The engine inserts at several checkpoints with one page list; pages a first insert
    # gave the tree are named again by the second.
    cache = make_cache()
    req, pages = _new_request(cache, A)
    for n in (2, 3):
        slot = cache.alloc_slot(req)
        write_state(cache, hashes_of(A)[n - 1], slot)
        cache.insert(req, A[: n * PS], pages[:n], mamba_slot=slot)
    cache.release(req)
    cache.flush()
    cache.check_integrity()
    assert serve(cache, A).prefix == 12


def test_insert_over_pages_another_request_inserted_frees_the_duplicates(make_cache):
    cache = make_cache()
    first, pages1 = _new_request(cache, A)
    second, pages2 = _new_request(cache, A)
    for req, pages in ((first, pages1), (second, pages2)):
        slot = cache.alloc_slot(req)
        write_state(cache, hashes_of(A)[-1], slot)
        assert cache.insert(req, A, pages, mamba_slot=slot) == (0 if req is first else 3)
    for req in (first, second):
        cache.release(req)
    cache.flush()
    cache.check_integrity()


# -- released and foreign requests -------------------------------------------------------


@pytest.mark.parametrize("call", ["load", "finish_load", "alloc_pages", "alloc_slot", "insert"])
def test_calls_on_a_released_request_raise(make_cache, call):
    cache = make_cache()
    req, pages = _new_request(cache, A)
    cache.release(req)
    before = snapshot(cache)
    args = {"alloc_pages": (1,), "insert": (A, pages)}.get(call, ())
    with pytest.raises(ValueError, match="released"):
        getattr(cache, call)(req, *args)
    assert snapshot(cache) == before
    cache.release(req)  # release stays idempotent
    cache.check_integrity()


@pytest.mark.parametrize(
    "call", ["load", "finish_load", "alloc_pages", "alloc_slot", "insert", "release"]
)
def test_a_request_of_another_cache_is_refused(make_cache, call):
    mine, theirs = make_cache(), make_cache()
    serve(mine, A)
    serve(theirs, A)
    req, pages = _new_request(mine, LONGER)
    before = (snapshot(mine), snapshot(theirs))
    args = {"alloc_pages": (1,), "insert": (LONGER, pages)}.get(call, ())
    with pytest.raises(ValueError, match="another cache"):
        getattr(theirs, call)(req, *args)
    assert (snapshot(mine), snapshot(theirs)) == before
    theirs.check_integrity()
    mine.release(req)
    mine.check_integrity()
    assert serve(theirs, A).prefix == 12


def test_load_twice_raises_and_leaks_nothing(make_cache):
    cache = make_cache()
    serve(cache, A)
    cache.flush()
    req = cache.match(A)
    cache.load(req)
    with pytest.raises(RuntimeError, match="twice"):
        cache.load(req)
    cache.finish_load(req)
    cache.release(req)
    cache.flush()
    cache.check_integrity()


@pytest.mark.parametrize("n, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_alloc_pages_refuses_bad_counts(make_cache, n, error):
    cache = make_cache()
    req = loaded(cache, A)
    before = snapshot(cache)
    with pytest.raises(error):
        cache.alloc_pages(req, n)
    assert snapshot(cache) == before
    cache.release(req)
    cache.check_integrity()
