"""The scheduler on one rank: batched greedy output equals the sequential engine; the
prefetch policies with a slow store while other requests run; no deadlock on a full L1."""

from __future__ import annotations

import random
import threading

import pytest

from mesh_hicache.cache import HiCache
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.storage.base import StorageBackend
from mesh_hicache.testing import internals
from mesh_hicache.tiers.l3 import PREFETCH_BATCH_PAGES
from runtime.engine import Engine
from runtime.model import HybridModel
from runtime.model.config import preset
from runtime.scheduler import Scheduler, SchedulerConfig
from runtime.workloads.generate import Turn
from tests.engine_cases import PAGE, batched_vs_sequential


def test_config_is_validated():
    for bad in (dict(max_running=0), dict(token_budget=0), dict(max_running=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SchedulerConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["off", "l1", "l1+l2"])
def test_batched_equals_sequential(one_rank_topology, mode):
    c = batched_vs_sequential(one_rank_topology, mode)
    assert c.batched == c.sequential, c.label
    assert c.max_batch > 1, "the scheduler never batched decodes"
    assert c.max_prefill_chunk <= 24  # token_budget
    if mode != "off":
        assert c.batched_cached > 0, "no cache hit in the batched run"


class GatedStore(StorageBackend):
    """A far store: reads wait until the test opens the gate (``opened_by`` says why);
    everything else passes through."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__()
        self.inner = inner
        self.gate = threading.Event()
        self.opened_by: str | None = None

    def open(self, why: str) -> None:
        if not self.gate.is_set():
            self.opened_by = why
            self.gate.set()

    def _wait(self) -> None:
        if not self.gate.wait(120):
            raise TimeoutError("the test never opened the gate")

    def exists(self, keys):
        return self.inner.exists(keys)

    def exists_each(self, keys):
        return self.inner.exists_each(keys)

    def get(self, keys, dst):
        self._wait()
        return self.inner.get(keys, dst)

    def get_ranges(self, keys, dst, ranges):
        self._wait()
        return self.inner.get_ranges(keys, dst, ranges)

    def put(self, keys, src):
        return self.inner.put(keys, src)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("policy", ["wait_complete", "best_effort", "timeout"])
def test_prefetch_policy_with_a_slow_store_while_others_run(one_rank_topology, tmp_path, policy):
    config = preset("tiny")
    model = HybridModel(config, one_rank_topology, page_size=PAGE)
    rng = random.Random(5)
    # 32 pages: two storage read batches (PREFETCH_BATCH_PAGES), then the state at the end.
    long = [rng.randrange(config.vocab_size) for _ in range(2 * PREFETCH_BATCH_PAGES * PAGE)]
    cfg = HiCacheConfig(
        device_pages=48,
        host_pages=96,
        storage="file",
        storage_options={"root": str(tmp_path)},
        prefetch_threshold=16,
        prefetch_policy=policy,
        prefetch_timeout_base_s=0.05,
        prefetch_timeout_per_1k_s=0.0,
    )
    spec = config.state_spec(PAGE)
    cache = HiCache(one_rank_topology, spec, cfg)
    Engine(model, cache, max_new_tokens=2).serve(long)
    cache.flush()
    cache.close()
    # A new cache on the same root: only L3 holds the long prefix, behind a store whose
    # reads arrive when the gate opens: when request 1 finished, or when the prefetching
    # request is loaded (its policy stopped waiting), whichever comes first.
    cache = HiCache(one_rank_topology, spec, cfg)
    l3 = internals(cache).controller.l3
    assert l3 is not None
    store = GatedStore(l3.backend)
    l3.backend = store
    load = cache.load

    def loading(req):
        if req.hit.storage_tokens:
            store.open("load")
        load(req)

    cache.load = loading  # type: ignore[method-assign]
    others = [tuple(rng.randrange(config.vocab_size) for _ in range(20)) for _ in range(2)]
    trace = [Turn(0, 0, 0, tuple(long) + (1, 2, 3))]
    trace += [Turn(1 + i, 1 + i, 0, p, max_new_tokens=48) for i, p in enumerate(others)]
    sched = Scheduler(model, cache, SchedulerConfig(max_running=3), max_new_tokens=4)
    got = sched.run(trace, progress=lambda r: r.request_id == 1 and store.open("finished"))
    want = Engine(model, None, max_new_tokens=4).run(trace)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    x = got[0]
    full = len(long)  # stored with its state at the end (a page boundary)
    assert got[0].cached_storage + got[1].cached_storage + got[2].cached_storage == x.cached_storage
    if policy == "wait_complete":
        # Request 1 ran to its end while the prefetch waited; then every stored page was used.
        assert store.opened_by == "finished"
        assert x.cached_storage == full
    else:
        # Loaded while the others still ran (best_effort: one step after its match;
        # timeout: at its deadline): the batch in flight completes, no state stands at its
        # end, so nothing of it is kept.
        assert store.opened_by == "load"
        assert x.cached_storage < full
        if policy == "timeout":
            assert x.ttft_s >= 0.05
    cache.flush()
    cache.check_integrity()
    cache.close()


def test_l1_full_of_locked_prefixes_does_not_deadlock(one_rank_topology):
    config = preset("tiny")
    model = HybridModel(config, one_rank_topology, page_size=PAGE)
    rng = random.Random(7)
    vocab = config.vocab_size
    cfg = HiCacheConfig(device_pages=9, device_mamba_slots=8, enable_host=False)
    cache = HiCache(one_rank_topology, config.state_spec(PAGE), cfg)
    # Four prompts leave 2 pages each (and the state at 32 tokens) in the tree: 8 of 9.
    warm = [[rng.randrange(vocab) for _ in range(2 * PAGE + 2)] for _ in range(4)]
    engine = Engine(model, cache, max_new_tokens=4)
    for prompt in warm:
        engine.serve(prompt)
    # Four requests on those prefixes, admitted together: they lock all 8 pages, each needs
    # 2 more and 1 is free. The first is served uncached (nothing runs that would free a
    # page), the others wait for pages while it runs, then hit.
    trace = [
        Turn(s, s, 0, tuple(w[: 2 * PAGE]) + tuple(rng.randrange(vocab) for _ in range(20)))
        for s, w in enumerate(warm)
    ]
    sched = Scheduler(model, cache, SchedulerConfig(max_running=4), max_new_tokens=4)
    got = sched.run(trace)
    want = Engine(model, None, max_new_tokens=4).run(trace)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert sched.num_uncached >= 1 and sched.num_waits > 0
    assert all(r.cached == 2 * PAGE for r in got)
    assert internals(cache).num_open == 0
    cache.check_integrity()
    cache.close()


def test_batched_equals_sequential_gdn_checkpoint(one_rank_topology, tmp_path):
    pytest.importorskip("transformers", reason="needs transformers (test extra)")
    from tests.qwen_cases import build

    directory = str(build("qwen3_next", tmp_path))
    c = batched_vs_sequential(one_rank_topology, "l1+l2", checkpoint=directory)
    assert c.batched == c.sequential
    assert c.max_batch > 1 and c.batched_cached > 0


def test_realtime_honours_arrivals_and_think_times(one_rank_topology):
    config = preset("tiny")
    model = HybridModel(config, one_rank_topology, page_size=PAGE)
    trace = [
        Turn(0, 0, 0, tuple(range(3, 30)), arrival_s=0.3),
        Turn(1, 1, 0, tuple(range(5, 25))),
        Turn(2, 0, 1, (7, 8, 9), think_s=0.2),
    ]
    sched = Scheduler(model, None, SchedulerConfig(max_running=2, realtime=True), max_new_tokens=3)
    first, other, second = sched.run(trace)
    want = Engine(model, None, max_new_tokens=3).run(trace)
    assert [r.output_ids for r in (first, other, second)] == [r.output_ids for r in want]
    assert first.arrival_s == pytest.approx(0.3) and first.first_token_s >= 0.3
    assert other.arrival_s == 0.0  # no time: at once
    # The next turn exists only after the answer, and arrives think_s after it.
    assert second.arrival_s >= first.finish_s + 0.2
    assert second.first_token_s >= second.arrival_s
    assert sched.num_agreements == sched.num_steps  # the clock is agreed every step


def test_host_load_overlaps_a_step_of_the_batch(one_rank_topology):
    config = preset("tiny")
    model = HybridModel(config, one_rank_topology, page_size=PAGE)
    rng = random.Random(11)
    vocab = config.vocab_size
    cfg = HiCacheConfig(device_pages=12, host_pages=64)
    cache = HiCache(one_rank_topology, config.state_spec(PAGE), cfg)
    engine = Engine(model, cache, max_new_tokens=2)
    x = [rng.randrange(vocab) for _ in range(4 * PAGE)]
    engine.serve(x)
    for _ in range(2):  # evict x's device pages: x stays on host only
        engine.serve([rng.randrange(vocab) for _ in range(5 * PAGE)])
    cache.flush()
    events: list[str] = []
    load, finish_load, decode_batch = cache.load, cache.finish_load, model.decode_batch

    def logged(name, fn):
        def call(*args):
            events.append(name)
            return fn(*args)

        return call

    cache.load = logged("load", load)  # type: ignore[method-assign]
    cache.finish_load = logged("finish_load", finish_load)  # type: ignore[method-assign]
    model.decode_batch = logged("decode", decode_batch)  # type: ignore[method-assign]
    trace = [
        Turn(0, 0, 0, tuple(rng.randrange(vocab) for _ in range(20)), max_new_tokens=80),
        Turn(1, 1, 0, tuple(x) + (1, 2), arrival_s=0.05),
    ]
    sched = Scheduler(model, cache, SchedulerConfig(max_running=2, realtime=True), max_new_tokens=3)
    got = sched.run(trace)
    model.decode_batch = decode_batch  # type: ignore[method-assign]
    want = Engine(model, None, max_new_tokens=3).run(trace)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert got[1].cached_host > 0
    # Request 1's host -> device copy ran beside a decode step of request 0.
    second_load = [i for i, e in enumerate(events) if e == "load"][1]
    assert events[second_load + 1] == "decode" and "finish_load" in events[second_load + 2 :]
    assert events.index("finish_load", second_load) > second_load + 1
    cache.check_integrity()
    cache.close()
