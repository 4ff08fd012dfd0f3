"""The engine on one rank: cached prefill equals recompute from every tier.

docs/DESIGN.md section 10.
"""

from __future__ import annotations

import pytest

from mesh_hicache.cache import HiCache
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.testing import internals
from runtime.engine import Engine
from runtime.model import HybridModel
from runtime.model.config import preset
from runtime.workloads.generate import Turn
from tests.engine_cases import ATOL, PAGE, resume_scenarios


@pytest.mark.parametrize("budget", [False, True], ids=["pools", "byte-budget"])
def test_resume_from_every_tier_equals_recompute(one_rank_topology, tmp_path, budget):
    checks = resume_scenarios(one_rank_topology, root=str(tmp_path), budget=budget)
    for c in checks:
        assert c.cached > 0, f"{c.label}: expected a {c.tier} hit"
        assert c.max_diff < ATOL, f"{c.label}: logits differ by {c.max_diff}"
        assert c.tokens_equal, c.label
    assert {c.tier for c in checks} == {"device", "host", "storage"}


def test_prompt_longer_than_l1_is_served_uncached(one_rank_topology):
    topology = one_rank_topology
    # 4 device pages hold 64 tokens; a 100-token prompt cannot be paged, so the engine
    # serves it without the cache (agreed CacheFull) and the output still matches.
    config = preset("tiny")
    model = HybridModel(config, topology, page_size=PAGE)
    cache = HiCache(topology, config.state_spec(PAGE), HiCacheConfig(device_pages=4))
    prompt = list(range(1, 101))
    got = Engine(model, cache, max_new_tokens=4, keep_logits=True).serve(prompt)
    want = Engine(model, None, max_new_tokens=4, keep_logits=True).serve(prompt)
    assert got.output_ids == want.output_ids and got.cached == 0
    assert internals(cache).tree.num_nodes == 0  # nothing was inserted
    cache.check_integrity()
    cache.close()


def test_on_token_sees_every_token_and_stops_early(one_rank_topology):
    config = preset("tiny")
    model = HybridModel(config, one_rank_topology, page_size=PAGE)
    prompt = list(range(3, 40))
    full = Engine(model, None).serve(prompt, max_new_tokens=10).output_ids
    decode = model.decode
    calls: list[int] = []

    def counting(token, state):
        calls.append(token)
        return decode(token, state)

    model.decode = counting  # type: ignore[method-assign]
    cache = HiCache(one_rank_topology, config.state_spec(PAGE), HiCacheConfig(device_pages=32))
    for engine in (Engine(model, None), Engine(model, cache)):
        for stop_after in (4, 10, 1):
            seen: list[int] = []

            def hook(token: int, seen=seen, stop_after=stop_after) -> bool:
                seen.append(token)
                return len(seen) == stop_after

            calls.clear()
            got = engine.serve(prompt, max_new_tokens=10, on_token=hook)
            assert got.output_ids == seen == full[:stop_after]
            assert len(calls) == stop_after - 1  # no decode step after the last token
    assert internals(cache).num_open == 0

    # A hook that raises leaves the request, which is released.
    def boom(token: int) -> bool:
        raise KeyError(token)

    with pytest.raises(KeyError):
        Engine(model, cache).serve(prompt + [1], max_new_tokens=10, on_token=boom)
    assert internals(cache).num_open == 0
    cache.check_integrity()
    cache.close()


def test_a_turn_with_a_stop_token_ends_after_it(one_rank_topology):
    model = HybridModel(preset("tiny"), one_rank_topology, page_size=PAGE)
    prompt = tuple(range(3, 40))
    full = Engine(model, None).serve(list(prompt), max_new_tokens=10).output_ids
    stop = next(i for i in range(1, 10) if full[i] not in full[:i])
    trace = [Turn(0, 0, 0, prompt, max_new_tokens=10, stop_token=full[stop])]
    trace.append(Turn(1, 0, 1, (5, 6), max_new_tokens=3))
    engine = Engine(model, None)
    first, second = engine.run(trace)
    assert first.output_ids == full[: stop + 1]
    assert len(second.output_ids) == 3
    # The next turn's history is the shortened answer.
    assert engine.histories[0] == list(prompt) + first.output_ids + [5, 6] + second.output_ids
