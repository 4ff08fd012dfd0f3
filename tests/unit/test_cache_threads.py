"""A ``HiCache`` is not thread-safe and says so: a second thread calling in while one is
inside gets ``ConcurrentUse`` before anything changes; calls one at a time from several
threads work; ``stats()`` may be read from any thread."""

from __future__ import annotations

import threading

import pytest

from mesh_hicache import ConcurrentUse, HiCache
from mesh_hicache.testing import internals
from tests.unit.cache_support import PS, make_config, make_spec, serve


@pytest.fixture
def make_cache(one_rank_topology):
    caches: list[HiCache] = []

    def build() -> HiCache:
        caches.append(HiCache(one_rank_topology, make_spec(), make_config()))
        return caches[-1]

    yield build
    for cache in caches:
        cache.close()


def test_a_second_thread_inside_is_refused_naming_both_calls(make_cache, monkeypatch):
    cache = make_cache()
    tokens = list(range(2 * PS))
    assert serve(cache, tokens).prefix == 0
    inside, leave = threading.Event(), threading.Event()
    real_step = cache._ctl.step

    def slow_step() -> None:
        inside.set()
        assert leave.wait(30)
        real_step()

    monkeypatch.setattr(cache._ctl, "step", slow_step)
    worker = threading.Thread(target=cache.step)
    worker.start()
    try:
        assert inside.wait(30)
        for call in (lambda: cache.match(tokens), cache.flush, cache.check_integrity):
            with pytest.raises(ConcurrentUse, match=r"HiCache\.\w+ was called .* HiCache\.step"):
                call()
        assert internals(cache).num_open == 0  # the refused match locked nothing
        assert cache.stats().requests == 1  # a snapshot is fine from any thread
    finally:
        leave.set()
        worker.join(30)
    monkeypatch.undo()
    assert serve(cache, tokens).prefix == 2 * PS  # still cached, still served
    cache.check_integrity()


def test_threads_taking_turns_share_one_cache(make_cache):
    # Four threads, 20 requests each, one at a time under the caller's lock; the three
    # shared first pages hit across threads and the cache checks clean.
    cache = make_cache()
    turn = threading.Lock()
    results: list[int] = []

    def run(t: int) -> None:
        for i in range(20):
            tokens = [t % 3 + 1] * PS + list(range(1000 * t + i, 1000 * t + i + PS))
            with turn:
                results.append(serve(cache, tokens, checkpoints=(1, 2)).prefix)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads) and len(results) == 80
    # Most hit a first page another thread wrote (the small test pools evict some).
    assert sum(1 for p in results if p >= PS) >= 60, results
    cache.check_integrity()
