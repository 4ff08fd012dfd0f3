"""A stateful test of the scheduler on one cache (hypothesis ``RuleBasedStateMachine``).

Batches of requests whose prompts share prefixes (a few page-aligned stems, cut at any
page, plus a short own tail) are served while those prefixes sit on device, on host
only, in storage only or split over the tiers: evictions of device pages, device states
and host pages, and restarts on the same storage root, come between batches in any
order. Some batches cancel a request after a few scheduler steps (mid-prefetch or
mid-load). Every answer equals a recompute without a cache (greedy tokens, and the
last-prompt logits within ``ATOL``: float32 reduction order only), and the cache passes
``check_integrity`` after every rule.

No shrinking: one example runs the model for seconds, so shrinking a failure takes
minutes; the failing sequence is printed as found.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from typing import Any

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)

from mesh_hicache.cache import HiCache
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.testing import internals
from runtime.engine import Engine
from runtime.model import HybridModel
from runtime.model.config import preset
from runtime.request_run import RequestResult, RequestRun
from runtime.scheduler import OnlineRequest, Scheduler, SchedulerConfig
from tests.engine_cases import ATOL, PAGE

NEW_TOKENS = 2
TIERS = ("device", "host", "storage")
STEM_PAGES = 5
_WORLD: dict[str, Any] = {}


def _world() -> dict[str, Any]:
    """The model, its recompute engine and the stems, built once per process (the machine
    only reads them) on the topology the test put there."""
    if "model" not in _WORLD:
        topology = _WORLD["topology"]
        model = HybridModel(preset("tiny"), topology, page_size=PAGE)
        rng = random.Random(11)
        vocab = model.config.vocab_size
        stems = [[rng.randrange(vocab) for _ in range(STEM_PAGES * PAGE)] for _ in range(3)]
        _WORLD.update(
            model=model,
            ref=Engine(model, None, max_new_tokens=NEW_TOKENS, keep_logits=True),
            stems=stems,
            expected={},
        )
    return _WORLD


# A prompt: (stem, whole pages of it, tail id, tail length). Equal stems and cuts give
# overlapping prefixes; the tails make the prompts differ after them.
PROMPT = st.tuples(
    st.integers(0, 2), st.integers(1, STEM_PAGES), st.integers(0, 3), st.integers(1, 9)
)
BATCH = st.lists(PROMPT, min_size=2, max_size=4)


def _prompt(spec: tuple[int, int, int, int]) -> tuple[int, ...]:
    stem, pages, tail, length = spec
    head = _world()["stems"][stem][: pages * PAGE]
    return tuple(head) + tuple((200 + 7 * tail + i) % 256 for i in range(length))


class SchedulerMachine(RuleBasedStateMachine):
    """One cache with small tiers and a file L3; see the module docstring."""

    @initialize()
    def setup(self) -> None:
        world = _world()
        self.model: HybridModel = world["model"]
        self.root = tempfile.mkdtemp(prefix="mh_sched_state_")
        # L1: about two requests; L2: about five. Requests wait for pages or run uncached
        # when a batch does not fit, and loads evict what earlier loads brought.
        self.config = HiCacheConfig(
            device_pages=16,
            device_mamba_slots=6,
            host_pages=40,
            host_mamba_slots=24,
            storage="file",
            storage_options={"root": self.root},
            prefetch_threshold=PAGE,
        )
        self.cache = self._open()

    def _open(self) -> HiCache:
        spec = self.model.config.state_spec(PAGE)
        return HiCache(_world()["topology"], spec, self.config)

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.cache.close()
            shutil.rmtree(self.root, ignore_errors=True)

    # -- checks ----------------------------------------------------------------------------

    def _check(self, prompt: tuple[int, ...], result: RequestResult) -> None:
        expected = _world()["expected"]
        if prompt not in expected:
            expected[prompt] = _world()["ref"].serve(list(prompt))
        want = expected[prompt]
        assert result.output_ids == want.output_ids, prompt
        assert result.last_logits is not None and want.last_logits is not None
        diff = (torch.tensor(result.last_logits) - torch.tensor(want.last_logits)).abs().max()
        assert float(diff) < ATOL, (float(diff), prompt)
        tiers = (result.cached_device, result.cached_host, result.cached_storage)
        _WORLD["tiers"].update({name for name, n in zip(TIERS, tiers, strict=True) if n})
        if sum(n > 0 for n in tiers) > 1:
            _WORLD["tiers"].add("mixed")

    def _settled(self) -> None:
        """Wait for the backups, then every invariant with no request open."""
        self.cache.flush()
        assert internals(self.cache).num_open == 0
        self.cache.check_integrity()

    def _scheduler(self) -> Scheduler:
        config = SchedulerConfig(max_running=4, token_budget=32)
        return Scheduler(self.model, self.cache, config, keep_logits=True)

    @staticmethod
    def _submit(
        sched: Scheduler, prompts: list[tuple[int, ...]], results: dict[int, RequestResult]
    ) -> None:
        for key, prompt in enumerate(prompts):
            run = RequestRun(sched.engine, prompt, "", None, NEW_TOKENS, None)
            sched.submit(OnlineRequest(key, run, lambda r, k=key: results.__setitem__(k, r)))

    # -- rules -----------------------------------------------------------------------------

    @rule(batch=BATCH)
    def serve_batch(self, batch: list[tuple[int, int, int, int]]) -> None:
        """Every prompt of ``batch`` in flight at once; each answer equals a recompute."""
        sched = self._scheduler()
        prompts = [_prompt(p) for p in batch]
        results: dict[int, RequestResult] = {}
        sched.open()
        try:
            self._submit(sched, prompts, results)
            while not sched.idle:
                sched.step()
                if not sched.transfers_in_flight:  # host reservations are not counted
                    self.cache.check_integrity()  # with requests holding pages and locks
        finally:
            sched.close()
        assert sorted(results) == list(range(len(prompts)))
        for key, prompt in enumerate(prompts):
            self._check(prompt, results[key])
        self._settled()

    @rule(batch=BATCH, victim=st.integers(0, 3), steps=st.integers(1, 3))
    def serve_and_cancel(
        self, batch: list[tuple[int, int, int, int]], victim: int, steps: int
    ) -> None:
        """As ``serve_batch``, cancelling one request after ``steps`` scheduler steps
        (mid-prefetch or mid-load when its prefix is on host or in storage)."""
        sched = self._scheduler()
        prompts = [_prompt(p) for p in batch]
        victim %= len(prompts)
        results: dict[int, RequestResult] = {}
        sched.open()
        try:
            self._submit(sched, prompts, results)
            for _ in range(steps):
                if not sched.idle:
                    sched.step()
            cancelled = sched.cancel(victim)
            while not sched.idle:
                sched.step()
        finally:
            sched.close()
        assert cancelled == (victim not in results)
        for key, prompt in enumerate(prompts):
            if key in results:
                self._check(prompt, results[key])
        self._settled()

    @rule(pages=st.integers(1, 16), slots=st.integers(0, 6))
    def evict_device(self, pages: int, slots: int) -> None:
        """Make room on device as a new request would: prefixes become host only."""
        self.cache.flush()
        alloc = internals(self.cache).allocator
        got = alloc.alloc_device_pages(pages)
        got_slots = [alloc.alloc_device_slot() for _ in range(slots)]
        alloc.free_device(got, got_slots)
        self._settled()

    @rule(pages=st.integers(1, 40), slots=st.integers(0, 24))
    def evict_host(self, pages: int, slots: int) -> None:
        """Make room on host: prefixes not on device are left in storage only."""
        self.cache.flush()
        alloc = internals(self.cache).allocator
        got = alloc.try_alloc_host(pages, slots)
        if got is not None:
            alloc.free_host(got.pages, got.slots)
        self._settled()

    @rule()
    def restart(self) -> None:
        """A new cache on the same storage root: every prefix is in storage only."""
        self._settled()
        self.cache.close()
        self.cache = self._open()
        self._settled()


def test_one_batch_after_a_restart_loads_each_shared_node_once(one_rank_topology):
    """The first case found: three requests on one stem cut at 5, 2 and 3 pages, served
    from storage only together (their prefetches split each other's nodes in flight)."""
    _WORLD["topology"] = one_rank_topology
    _WORLD["tiers"] = set()
    machine = SchedulerMachine()
    machine.setup()
    try:
        machine.serve_batch([(0, 5, 0, 1), (0, 2, 1, 1), (0, 3, 2, 2)])
        machine.restart()
        machine.serve_batch([(0, 5, 0, 3), (0, 2, 1, 4), (0, 3, 2, 5)])
        machine.evict_host(40, 24)
        machine.serve_batch([(0, 4, 0, 3), (0, 2, 1, 6), (0, 5, 2, 5)])
    finally:
        machine.teardown()
    assert "storage" in _WORLD["tiers"]


def test_overlapping_requests_through_every_tier_state(one_rank_topology):
    _WORLD["topology"] = one_rank_topology
    _WORLD["tiers"] = set()
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(
            max_examples=25,
            stateful_step_count=8,
            derandomize=True,  # the same examples every run: the tier check below is stable
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            phases=(Phase.explicit, Phase.generate),
        ),
    )
    # The prefixes served came from every tier, and some from several at once.
    assert _WORLD["tiers"] == {*TIERS, "mixed"}, _WORLD["tiers"]
