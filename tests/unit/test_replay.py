"""runtime.workloads.replay agrees with the real engine request by request; byte budgets
-> pools."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mesh_hicache.cache import HiCache
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.pools.arena import ArenaPlan, mesh_plan
from mesh_hicache.radix.eviction import CostModel
from mesh_hicache.testing import internals
from mesh_hicache.topology import MeshTopology
from runtime.engine import Engine
from runtime.model import HybridModel
from runtime.model.config import preset
from runtime.workloads.profiles import profile
from runtime.workloads.replay import (
    Replayer,
    arena_spec,
    budget_config,
    fixed_split,
    share_split,
    tiny_spec,
)
from runtime.workloads.traces import TraceRequest, make_trace, trace_shape

PAGE = 16


@pytest.fixture(scope="module")
def topology(one_rank_topology):
    return one_rank_topology


# Small versions of the three shapes: short enough for the tiny model on CPU, long
# enough to cross pages while decoding, hit, branch (agent) and evict in a 16-page L1.
SMALL = {
    "chat": trace_shape(
        "chat", sessions=8, turns_mean=2.5, user_median=16, reply_median=12, max_len=40
    ),
    "long-replies": trace_shape(
        "long-replies", sessions=4, turns_mean=2.5, user_median=8, reply_median=36, max_len=48
    ),
    "agent": trace_shape(
        "agent",
        sessions=4,
        turns_mean=5.0,
        user_median=12,
        reply_median=6,
        obs_median=20,
        max_len=40,
        system_len=56,
        keep_observations=1,
    ),
}
# LRU here (the default is "cost"): the engine's and the replay's specs differ, so a cost
# ranking needs one CostModel for both (``_with_cost``, the cost-policy test below).
CONFIGS = {
    "l1": HiCacheConfig(
        device_pages=16,
        device_mamba_slots=4,
        enable_host=False,
        transfer="cpu",
        eviction_policy="lru",
    ),
    "l1+l2": HiCacheConfig(
        device_pages=16,
        device_mamba_slots=4,
        host_pages=64,
        host_mamba_slots=16,
        transfer="cpu",
        eviction_policy="lru",
    ),
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model decodes token by token: threads only add contention here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _engine_trace(
    topology: MeshTopology, shape: str, config: HiCacheConfig, layer_pattern: str = "SSASSSAS"
) -> tuple[list[TraceRequest], list[tuple[int, int, int]], HiCache]:
    """The trace with the engine's own greedy replies, and what the engine reused."""
    model_config = preset("tiny", layer_pattern=layer_pattern)
    model = HybridModel(model_config, topology, page_size=PAGE)
    cache = HiCache(topology, model_config.state_spec(PAGE), config)
    engine = Engine(model, cache)
    reused: list[tuple[int, int, int]] = []

    def respond(prompt: tuple[int, ...], n: int) -> list[int]:
        engine.max_new_tokens = n
        result = engine.serve(list(prompt))
        cache.flush()  # what Replayer(flush_each=True) does between requests
        reused.append((result.cached_device, result.cached_host, result.cached_storage))
        return result.output_ids

    trace = make_trace(SMALL[shape], seed=3, vocab=model_config.vocab_size, respond=respond)
    return trace, reused, cache


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("shape", sorted(SMALL))
def test_replay_reuses_what_the_engine_reuses(topology, shape, config_name):
    config = CONFIGS[config_name]
    trace, want, engine_cache = _engine_trace(topology, shape, config)
    replay_cache = HiCache(topology, tiny_spec(PAGE, has_mamba=True), config)
    player = Replayer(replay_cache)
    got = [player.serve(r.input_tokens, r.output_tokens).reused for r in trace]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"request {i} (session {trace[i].session_id} turn {trace[i].turn})"
    # Same calls, same decisions: the trees (pages, slots, clocks) are identical too.
    assert replay_cache.digest() == engine_cache.digest()
    # The comparison means something: prefixes were reused and L1 had to evict.
    assert sum(sum(w) for w in want) > 0
    stats = engine_cache.stats()
    assert stats.evicted_device_pages + stats.evicted_device_slots > 0
    if config_name == "l1+l2" and shape != "long-replies":  # (4 sessions: L2 rarely needed)
        assert stats.hit_tokens_host > 0
    for cache in (engine_cache, replay_cache):
        cache.check_integrity()
        cache.close()


def test_replay_without_ssm_layers_reuses_what_the_engine_reuses(topology):
    # An attention-only model: no checkpoints, the engine inserts whole pages instead.
    config = CONFIGS["l1"]
    trace, want, engine_cache = _engine_trace(topology, "chat", config, layer_pattern="AA")
    replay_cache = HiCache(topology, tiny_spec(PAGE, has_mamba=False), config)
    player = Replayer(replay_cache)
    got = [player.serve(r.input_tokens, r.output_tokens).reused for r in trace]
    assert got == want and sum(sum(w) for w in want) > 0
    assert replay_cache.digest() == engine_cache.digest()
    assert engine_cache.stats().evicted_device_pages > 0
    for cache in (engine_cache, replay_cache):
        cache.close()


@pytest.mark.parametrize(
    ("prompt_len", "output_len"),
    [(15, 1), (16, 1), (17, 15), (17, 16), (20, 12), (20, 13), (20, 14), (31, 2), (33, 31)],
)
def test_checkpoint_boundaries_match_the_engine(topology, prompt_len, output_len):
    # Prompts and replies that end just before, at and just after page boundaries, then
    # the next turn: where the engine put the prompt and decode checkpoints decides it.
    model_config = preset("tiny")
    model = HybridModel(model_config, topology, page_size=PAGE)
    config = CONFIGS["l1"]
    engine_cache = HiCache(topology, model_config.state_spec(PAGE), config)
    engine = Engine(model, engine_cache, max_new_tokens=output_len)
    replay_cache = HiCache(topology, tiny_spec(PAGE, has_mamba=True), config)
    player = Replayer(replay_cache)
    prompt = [(7 * i + 3) % model_config.vocab_size for i in range(prompt_len)]
    for turn in range(2):
        want = engine.serve(prompt)
        got = player.serve(prompt, want.output_ids)
        assert got.reused == (want.cached_device, want.cached_host, want.cached_storage), turn
        prompt = prompt + want.output_ids + [1, 2, 3]
    assert replay_cache.digest() == engine_cache.digest()
    for cache in (engine_cache, replay_cache):
        cache.close()


def test_a_request_longer_than_l1_is_served_uncached(topology):
    config = HiCacheConfig(device_pages=4, enable_host=False, transfer="cpu")
    cache = HiCache(topology, tiny_spec(PAGE, has_mamba=True), config)
    served = Replayer(cache).serve(list(range(1, 101)), [1, 2, 3, 4])
    assert not served.paged and served.reused_tokens == 0 and served.checkpoints == 0
    assert internals(cache).tree.num_nodes == 0
    cache.close()


def test_replay_rejects_empty_requests(topology):
    cache = HiCache(topology, tiny_spec(PAGE, has_mamba=True), CONFIGS["l1"])
    player = Replayer(cache)
    with pytest.raises(ValueError, match="prompt"):
        player.serve([], [1])
    with pytest.raises(ValueError, match="output"):
        player.serve([1, 2], [])
    cache.close()


@pytest.mark.parametrize("budget", [10**9, 2 * 10**9, 5 * 10**9, 12_345_678_901])
def test_fixed_split_is_the_largest_pool_within_budget(budget):
    p = profile("hybrid-7b")
    pb, sb = p.page_bytes(PAGE), p.state_bytes
    pages, slots = fixed_split(budget, pb, sb)

    def rule(n: int) -> int:
        return HiCacheConfig(device_pages=n).mamba_device_slots()

    assert slots == rule(pages)
    assert pages * pb + slots * sb <= budget
    assert (pages + 1) * pb + rule(pages + 1) * sb > budget


def test_fixed_split_without_states_and_too_small_budgets():
    assert fixed_split(10 * 2**20, 2**20, 0) == (10, 0)
    with pytest.raises(ValueError, match="not even one page"):
        fixed_split(2**20, 2**20, 10**6)  # one page fits, its 8 states do not


def test_budget_config_tiers():
    p = profile("hybrid-7b")
    l1 = budget_config(p, PAGE, 2 * 10**9, split="rule")
    assert not l1.enable_host
    both = budget_config(p, PAGE, 2 * 10**9, 8 * 10**9, split="rule")
    assert both.enable_host and both.device_pages == l1.device_pages
    assert (both.host_pages, both.host_mamba_slots) == fixed_split(
        8 * 10**9, p.page_bytes(PAGE), p.state_bytes
    )
    assert both.num_host_pages() == both.host_pages


@pytest.mark.parametrize("page_size", [16, 64])
def test_arena_replay_holds_the_blocks_of_the_model_arena(page_size):
    p = profile("hybrid-7b")
    spec, scale = arena_spec(p, page_size)
    config = budget_config(p, page_size, 5 * 10**9, 20 * 10**9)
    assert config.device_bytes == int(5 * 10**9 * scale) and config.device_pages == 0
    assert config.host_bytes == int(20 * 10**9 * scale)
    # The small arena and the model's arena: the same blocks per page, per state, in all.
    small = mesh_plan(spec, (1, 1, 1), "replicate", config.device_bytes)
    real = ArenaPlan.for_budget(5 * 10**9, p.page_bytes(page_size), p.state_bytes)
    assert (small.blocks_per_page, small.blocks_per_slot) == (
        real.blocks_per_page,
        real.blocks_per_slot,
    )
    assert abs(small.num_blocks - real.num_blocks) <= 1
    with pytest.raises(ValueError, match="split"):
        budget_config(p, page_size, 10**9, split="halves")


def test_share_split_gives_states_their_share():
    p = profile("hybrid-7b")
    pb, sb = p.page_bytes(PAGE), p.state_bytes
    pages, slots = share_split(10**10, pb, sb, 0.2)
    assert slots == int(0.2 * 10**10) // sb
    assert pages == (10**10 - slots * sb) // pb
    config = budget_config(p, PAGE, 10**10, 4 * 10**10, state_share=0.2)
    assert (config.device_pages, config.device_mamba_slots) == (pages, slots)
    assert config.host_mamba_slots == int(0.2 * 4 * 10**10) // sb
    with pytest.raises(ValueError, match="state_share"):
        share_split(10**10, pb, sb, 1.0)
    with pytest.raises(ValueError, match="0 states"):
        share_split(10**9, pb, sb, 0.01)


def test_a_request_that_cannot_fit_keeps_the_cache(topology):
    config = HiCacheConfig(device_pages=8, device_mamba_slots=4, enable_host=False)
    first = list(range(1, 61))
    cache = HiCache(topology, tiny_spec(PAGE, has_mamba=True), config)
    player = Replayer(cache)
    player.serve(first, [61, 62, 63, 64])
    huge = player.serve(list(range(1000, 1200)), [1])  # 13 pages > 8: never fits
    assert not huge.paged
    # Fit before evict (tiers/alloc.py): the hopeless request evicted nothing.
    assert player.serve(first + [61, 62, 63, 64, 65], [1]).reused_tokens == 48
    cache.close()


def test_admission_writes_the_prompt_end_checkpoint_only_without_a_decode_one(topology):
    prompt, output = list(range(1, 41)), list(range(100, 130))  # decode reaches 48 and 64
    cache = HiCache(topology, tiny_spec(PAGE, has_mamba=True), CONFIGS["l1"])
    player = Replayer(cache)
    assert player.serve(prompt, output).checkpoints == 1  # only the decode one (at 64)
    # The next turn resumes from the decode checkpoint.
    assert player.serve(prompt + output + [7, 8], [1]).reused_tokens == 64
    cache.close()
    # Without a decode boundary ahead the prompt-end checkpoint stays.
    cache = HiCache(topology, tiny_spec(PAGE, has_mamba=True), CONFIGS["l1"])
    player = Replayer(cache)
    assert player.serve(prompt, [1, 2]).checkpoints == 1
    assert player.serve(prompt + [1, 2, 3], [1]).reused_tokens == 32
    cache.close()
    # A repeat of the prompt (not a continuation) branches off the cached path at 32,
    # where there is no state: that branch checkpoint serves the repeat after it.
    cache = HiCache(topology, tiny_spec(PAGE, has_mamba=True), CONFIGS["l1"])
    player = Replayer(cache)
    player.serve(prompt, output)
    assert player.serve(prompt, output).reused_tokens == 0
    assert player.serve(prompt, output).reused_tokens == 32
    cache.close()


def _with_cost(config: HiCacheConfig, spec_of: str = "SSASSSAS") -> HiCacheConfig:
    # The engine's and the replay's specs differ (tiny tensors): both rank by the model's
    # numbers, as the runtime passes them.
    cost = CostModel.from_spec(preset("tiny", layer_pattern=spec_of).state_spec(PAGE))
    return dataclasses.replace(config, eviction_policy="cost", cost_model=cost)


ARENAS = {
    # One arena per tier (the tiny model: a page is 4 KiB, a state 42 KiB, 2 KiB blocks).
    "l1-arena": HiCacheConfig(
        device_bytes=160 * 1024, enable_host=False, transfer="cpu", eviction_policy="lru"
    ),
    "l1+l2-arena": HiCacheConfig(
        device_bytes=160 * 1024, host_bytes=640 * 1024, transfer="cpu", eviction_policy="lru"
    ),
}


@pytest.mark.parametrize("config_name", sorted(CONFIGS) + sorted(ARENAS))
@pytest.mark.parametrize("shape", ["agent", "chat"])
def test_replay_under_the_cost_policy_reuses_what_the_engine_reuses(topology, shape, config_name):
    config = _with_cost(CONFIGS.get(config_name) or ARENAS[config_name])
    trace, want, engine_cache = _engine_trace(topology, shape, config)
    # An arena's blocks come from the spec's bytes: the replay takes the engine's spec then.
    spec = preset("tiny").state_spec(PAGE) if config.device_bytes else tiny_spec(PAGE, True)
    replay_cache = HiCache(topology, spec, config)
    player = Replayer(replay_cache)
    got = [player.serve(r.input_tokens, r.output_tokens).reused for r in trace]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"request {i} (session {trace[i].session_id} turn {trace[i].turn})"
    assert replay_cache.digest() == engine_cache.digest()
    assert sum(sum(w) for w in want) > 0
    stats = engine_cache.stats()
    assert stats.evicted_device_pages + stats.evicted_device_slots > 0
    for cache in (engine_cache, replay_cache):
        cache.check_integrity()
        cache.close()
