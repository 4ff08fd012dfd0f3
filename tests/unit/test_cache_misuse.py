"""Misuse fails fast, at the call that is wrong, with one line that names what to fix:
a storage that cannot be opened at construction, use after ``close``, a hybrid insert
without its state, calls out of order; ``match(leave_one=True)`` always leaves a token
to compute."""

from __future__ import annotations

import threading

import pytest

from mesh_hicache import CacheClosed, HiCache, HiCacheConfig
from mesh_hicache.storage.factory import open_storage
from mesh_hicache.testing import internals
from tests.unit.cache_support import PS, make_config, make_spec, serve


@pytest.fixture
def build(one_rank_topology):
    caches: list[HiCache] = []

    def make(config: HiCacheConfig | None = None) -> HiCache:
        caches.append(HiCache(one_rank_topology, make_spec(), config or make_config()))
        return caches[-1]

    yield make
    for cache in caches:
        cache.close()


# -- construction ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({}, r"needs storage option\(s\) \['root'\]"),
        ({"path": "/tmp/x"}, r"unknown storage option\(s\) \['path'\]"),
        ({"root": "/tmp/x", "max_byte": 5}, r"unknown storage option\(s\) \['max_byte'\]"),
        ({"root": "/tmp/x", "max_bytes": -1}, r"max_bytes must be a positive int"),
    ],
)
def test_bad_storage_options_raise_at_construction(build, options, named):
    config = make_config(storage="file", storage_options=options)
    with pytest.raises(ValueError, match=named) as err:
        build(config)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("HiCacheConfig.storage_options: ")


def test_a_root_that_cannot_be_created_raises_at_construction(build, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    config = make_config(storage="file", storage_options={"root": str(blocker / "l3")})
    with pytest.raises(ValueError, match=r"storage='file' .* could not be opened"):
        build(config)


def test_open_storage_fails_fast_unless_lazy(tmp_path):
    with pytest.raises(ValueError, match="unknown storage option"):
        open_storage("file", path=str(tmp_path))
    blocker = tmp_path / "f"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="could not be opened"):
        open_storage("file", root=str(blocker / "l3"))
    lazy = open_storage("file", root=str(blocker / "l3"), lazy=True)  # degrades on use
    try:
        assert not lazy.degraded
        assert lazy.exists_each([]) == [] and lazy.backend is None
    finally:
        lazy.close()


def test_a_working_store_that_fails_later_still_degrades(build, tmp_path):
    root = tmp_path / "l3"
    cache = build(make_config(root))
    tokens = list(range(3 * PS))
    serve(cache, tokens)
    cache.flush()
    storage = internals(cache).storage
    assert storage is not None and not storage.degraded
    for path in sorted(root.rglob("*"), reverse=True):  # the root vanishes under us
        path.unlink() if path.is_file() else path.rmdir()
    root.rmdir()
    root.write_text("now a file")
    serve(cache, list(range(100, 100 + 3 * PS)))
    cache.flush()
    assert cache.stats().storage_degraded  # served from L1/L2, not raised
    cache.check_integrity()


def test_non_config_arguments_are_refused(one_rank_topology):
    with pytest.raises(TypeError, match="config must be a HiCacheConfig"):
        HiCache(one_rank_topology, make_spec(), {"device_pages": 8})  # type: ignore[arg-type]


# -- after close ---------------------------------------------------------------------------


def test_every_call_after_close_raises_and_close_is_idempotent(build):
    cache = build(make_config())
    tokens = list(range(2 * PS))
    req = cache.match(tokens)
    cache.close()
    cache.close()
    assert cache.closed
    calls = {
        "match": lambda: cache.match(tokens),
        "load": lambda: cache.load(req),
        "finish_load": lambda: cache.finish_load(req),
        "alloc_pages": lambda: cache.alloc_pages(req, 1),
        "alloc_slot": lambda: cache.alloc_slot(req),
        "insert": lambda: cache.insert(req, tokens, [0, 1]),
        "release": lambda: cache.release(req),
        "step": cache.step,
        "flush": cache.flush,
        "digest": cache.digest,
        "check_integrity": cache.check_integrity,
    }
    for name, call in calls.items():
        with pytest.raises(CacheClosed, match=rf"HiCache\.{name} called after close\(\)"):
            call()
    assert cache.stats().requests == 0  # the final counters stay readable


def test_context_manager_closes_and_stops_the_threads(one_rank_topology, tmp_path):
    before = set(threading.enumerate())
    with HiCache(one_rank_topology, make_spec(), make_config(tmp_path / "l3")) as cache:
        serve(cache, list(range(3 * PS)))
        serve(cache, list(range(3 * PS)))
    assert cache.closed
    with pytest.raises(CacheClosed):
        cache.match([1])
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == [], left


# -- hybrid insert, order --------------------------------------------------------------------


def test_hybrid_insert_without_the_state_raises_and_changes_nothing(build):
    cache = build()
    tokens = list(range(2 * PS))
    req = cache.match(tokens)
    cache.load(req)
    cache.finish_load(req)
    pages = cache.alloc_pages(req, 2)
    digest = cache.digest()
    with pytest.raises(ValueError, match=r"without mamba_slot .* after exactly 8 tokens"):
        cache.insert(req, tokens, pages)
    assert cache.digest() == digest
    slot = cache.alloc_slot(req)
    cache.insert(req, tokens, pages, mamba_slot=slot)
    cache.release(req)
    # A boundary whose state the tree already holds may be inserted again without one.
    again = cache.match(tokens + list(range(50, 50 + PS)))
    cache.load(again)
    assert cache.finish_load(again) == 2 * PS
    cache.insert(again, tokens, again.prefix_pages)
    cache.release(again)
    cache.check_integrity()


def test_calls_out_of_order_raise(build):
    cache = build()
    req = cache.match(list(range(2 * PS)))
    with pytest.raises(RuntimeError, match=r"finish_load\(req\) called before load"):
        cache.finish_load(req)
    cache.load(req)
    with pytest.raises(RuntimeError, match="load.req. called twice"):
        cache.load(req)
    cache.finish_load(req)
    with pytest.raises(RuntimeError, match="called twice"):
        cache.finish_load(req)
    cache.release(req)
    with pytest.raises(ValueError, match="was released"):
        cache.alloc_pages(req, 1)
    cache.check_integrity()


# -- the one-token-short rule ---------------------------------------------------------------


def test_leave_one_leaves_a_token_to_compute(build):
    cache = build()
    prompt = list(range(3 * PS))  # page-aligned: fully cached after one serve
    serve(cache, prompt, checkpoints=(2, 3))  # states after 2 and 3 pages
    whole = cache.match(prompt)
    cache.load(whole)
    assert cache.finish_load(whole) == len(prompt)  # nothing left to compute
    cache.release(whole)
    short = cache.match(prompt, leave_one=True)
    cache.load(short)
    assert cache.finish_load(short) == 2 * PS  # the last whole page below len - 1
    assert len(short.key) == len(prompt) - 1
    cache.release(short)
    with pytest.raises(ValueError, match="at least one token"):
        cache.match([], leave_one=True)
    cache.check_integrity()
