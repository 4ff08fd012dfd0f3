"""The scheduler on one rank: batched greedy output equals the sequential engine."""

from __future__ import annotations

import pytest

from mesh_hicache.cache import HiCache
from mesh_hicache.config import HiCacheConfig
from runtime.engine import Engine
from runtime.model import HybridModel
from runtime.model.config import preset
from runtime.scheduler import Scheduler, SchedulerConfig
from runtime.workloads import make_workload
from tests.engine_cases import PAGE


def test_config_is_validated():
    for bad in (dict(max_running=0), dict(token_budget=0), dict(max_running=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SchedulerConfig(**bad)  # type: ignore[arg-type]


def test_scheduler_equals_sequential_engine(one_rank_topology):
    config = preset("tiny")
    model = HybridModel(config, one_rank_topology, page_size=PAGE)
    trace = make_workload(
        "multiturn",
        sessions=3,
        turns=2,
        vocab=config.vocab_size,
        first_prompt_len=40,
        append_len=8,
    )
    want = Engine(model, None, max_new_tokens=5).run(trace)
    cache = HiCache(one_rank_topology, config.state_spec(PAGE), HiCacheConfig(device_pages=32))
    got = Scheduler(model, cache, SchedulerConfig(max_running=3), max_new_tokens=5).run(trace)
    assert [r.request_id for r in got] == [t.request_id for t in trace]
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    for r in got:
        assert r.arrival_s <= r.first_token_s <= r.finish_s
    cache.check_integrity()
    cache.close()
