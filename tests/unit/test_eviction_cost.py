"""Cost-aware eviction: CostModel, the GreedyDual-Size aging of the queues and the Marconi
baseline (scripts/baseline_policies.py), the policies a configuration names."""

from __future__ import annotations

import itertools
import math
import os
import random
import sys

import pytest
import torch

from mesh_hicache.cache import HiCache
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.radix import EvictTarget, Family, PoolUsage, RadixKey, RadixTree, Tier
from mesh_hicache.radix.adaptive import AdaptiveCostPolicy
from mesh_hicache.radix.eviction import CostModel, DecayCostPolicy, LRUPolicy, NodeStats
from mesh_hicache.radix.policies import make_policy
from mesh_hicache.spec import KVSpec, MambaSpec, StateSpec
from mesh_hicache.testing import internals

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from baseline_policies import GreedyDualSizePolicy as CostPolicy  # noqa: E402
from baseline_policies import MarconiPolicy  # noqa: E402

PS = 4
#: KV of one page = 4 bytes, a state = 40 bytes: a state costs 10 pages.
COST = CostModel(kv_bytes_per_token=1.0, state_bytes=40.0, flops_per_token=100.0, flops_per_key=1.0)


def key(tokens: list[int] | range) -> RadixKey:
    return RadixKey(tuple(tokens))


class Pools:
    """Fresh indices for pages and slots."""

    def __init__(self) -> None:
        self._pages = itertools.count()
        self._slots = itertools.count()

    def pages(self, n: int) -> list[int]:
        return [next(self._pages) for _ in range(n)]

    def slot(self) -> int:
        return next(self._slots)


def test_cost_model_flops_is_the_per_position_sum():
    for start, end in [(0, 0), (0, 1), (3, 17), (100, 356)]:
        want = sum(COST.flops_per_token + COST.flops_per_key * (t + 1) for t in range(start, end))
        assert COST.flops(start, end) == want
    assert COST.flops(5, 2) == 0.0


def test_cost_model_from_spec_counts_the_spec_bytes():
    kv = KVSpec(layer_ids=(0, 2), num_kv_heads=2, head_dim=8, dtype=torch.float16)
    mamba = MambaSpec(
        layer_ids=(1,), conv_dim=8, conv_kernel=4, num_heads=2, head_dim=4, state_dim=16
    )
    cost = CostModel.from_spec(StateSpec(model_id="test-model", page_size=PS, kv=kv, mamba=mamba))
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 8 * 2  # layers x (K, V) x heads x dim x fp16
    assert cost.state_bytes == (8 * 3 + 2 * 4 * 16) * 4  # conv (kernel - 1) + ssm, fp32
    assert cost.flops_per_token > 0 and cost.flops_per_key > 0


@pytest.mark.parametrize(
    "bad", [dict(kv_bytes_per_token=0.0), dict(flops_per_token=-1.0), dict(state_bytes=-1.0)]
)
def test_cost_model_rejects_bad_numbers(bad):
    fields = dict(kv_bytes_per_token=1.0, state_bytes=1.0, flops_per_token=1.0) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        CostModel(**fields)


def test_value_counts_tokens_back_to_the_nearest_state_and_the_bytes_freed():
    policy = CostPolicy(COST)
    leaf = NodeStats(0, 0, 8, True, prefix_len=24, anchor_len=16, num_children=0, serves=True)
    # A leaf frees its pages and its state for either target.
    want = COST.flops(16, 24) / (8 + 40)
    assert policy.value(leaf, EvictTarget.DEVICE_KV) == pytest.approx(want)
    assert policy.value(leaf, EvictTarget.MAMBA_DEVICE) == pytest.approx(want)
    # An inner node's state eviction frees only the state. At a branch point (two
    # children) requests diverge there: it saves what it saves.
    branch = leaf._replace(num_children=2)
    assert policy.value(branch, EvictTarget.MAMBA_DEVICE) == pytest.approx(COST.flops(16, 24) / 40)
    # With one child only requests ending exactly there use it (a chat's older turn):
    # ``lone_state`` can discount it (default: not).
    lone = leaf._replace(num_children=1)
    discounted = CostPolicy(COST, lone_state=0.1)
    assert discounted.value(lone, EvictTarget.MAMBA_DEVICE) == pytest.approx(
        0.1 * COST.flops(16, 24) / 40
    )
    assert policy.value(lone, EvictTarget.MAMBA_DEVICE) == policy.value(
        branch, EvictTarget.MAMBA_DEVICE
    )
    # A leaf below stateless nodes frees their pages too when it goes (run_bytes).
    deep = leaf._replace(anchor_len=4)
    assert policy.value(deep, EvictTarget.DEVICE_KV) == pytest.approx(COST.flops(4, 24) / (20 + 40))
    # A node no hit can end at (a tombstone) saves nothing.
    assert (
        policy.value(leaf._replace(serves=False, has_mamba_state=False), EvictTarget.DEVICE_KV) == 0
    )
    # Priority: the clock at the last access plus the value.
    aged = leaf._replace(inflation=7.5)
    assert policy.priority(aged, EvictTarget.DEVICE_KV)[0] == pytest.approx(7.5 + want)


def test_cost_policy_keeps_what_saves_more_per_byte_where_lru_keeps_the_newest():
    # Root -> long (8 pages, state) and short (1 page, state), short touched last: LRU
    # evicts long, the cost policy evicts short (its hit saves 4 tokens for 44 bytes).
    victims = {}
    for policy in (LRUPolicy(), CostPolicy(COST)):
        tree = RadixTree(PS, has_mamba=True, policy=policy)
        pools = Pools()
        long_key, short_key = list(range(1, 33)), [99, 98, 97, 96]
        tree.insert(key(long_key), pools.pages(8), mamba_device_slot=pools.slot())
        tree.insert(key(short_key), pools.pages(1), mamba_device_slot=pools.slot())
        tree.evict_device(1)
        victims[type(policy).__name__] = [len(n.data) // 8 for n in tree.iter_nodes()]
        tree.check_integrity()
    assert victims == {"LRUPolicy": [4], "GreedyDualSizePolicy": [32]}


def test_decay_policy_key_is_recency_plus_horizon_times_log_value():
    policy = DecayCostPolicy(COST, horizon=50.0)
    unit = COST.flops_per_token / COST.kv_bytes_per_token
    leaf = NodeStats(7, 0, 8, True, prefix_len=24, anchor_len=16, num_children=0, serves=True)
    # The value is GreedyDual-Size's without run_bytes: a leaf counts its own bytes only.
    deep = leaf._replace(anchor_len=4)
    want = COST.flops(4, 24) / (8 + 40)
    assert policy.value(deep, EvictTarget.DEVICE_KV) == pytest.approx(want)
    key = policy.priority(deep, EvictTarget.DEVICE_KV)
    assert key[0] == pytest.approx(7 + 50.0 * math.log(want / unit)) and key[1] == 7
    # Twice the value buys horizon * ln 2 ticks, whatever the size; a touch only raises it.
    lone = leaf._replace(num_children=1)
    v_lone = policy.value(lone, EvictTarget.MAMBA_DEVICE)
    assert v_lone == pytest.approx(COST.flops(16, 24) / 40)
    double = (
        policy.priority(lone, EvictTarget.MAMBA_DEVICE)[0]
        - policy.priority(leaf, EvictTarget.MAMBA_DEVICE)[0]
    )
    assert double == pytest.approx(
        50.0 * math.log(v_lone / policy.value(leaf, EvictTarget.DEVICE_KV))
    )
    later = policy.priority(leaf._replace(last_access=8), EvictTarget.DEVICE_KV)
    assert later > policy.priority(leaf, EvictTarget.DEVICE_KV)
    # A node no hit can end at ranks as if -ln(1e-6) horizons older, not -inf.
    dead = leaf._replace(serves=False, has_mamba_state=False)
    assert policy.priority(dead, EvictTarget.DEVICE_KV)[0] == pytest.approx(
        7 + 50.0 * math.log(1e-6)
    )
    with pytest.raises(ValueError, match="horizon"):
        DecayCostPolicy(COST, horizon=0)
    with pytest.raises(TypeError, match="CostModel"):
        DecayCostPolicy({"flops_per_token": 1.0})  # type: ignore[arg-type]


@pytest.mark.parametrize("horizon,kept", [(1000.0, 32), (0.01, 4)])
def test_decay_policy_trades_value_for_recency_by_its_horizon(horizon, kept):
    # As in the test above: long (8 pages) then short (1 page), short touched last. A long
    # horizon keeps what saves more per byte (evicts short); a short one is LRU (long).
    tree = RadixTree(PS, has_mamba=True, policy=DecayCostPolicy(COST, horizon=horizon))
    pools = Pools()
    tree.insert(key(range(1, 33)), pools.pages(8), mamba_device_slot=pools.slot())
    tree.insert(key([99, 98, 97, 96]), pools.pages(1), mamba_device_slot=pools.slot())
    tree.evict_device(1)
    assert [len(n.data) // 8 for n in tree.iter_nodes()] == [kept]
    tree.check_integrity()


def test_anchor_is_the_nearest_ancestor_with_a_state():
    tree = RadixTree(PS, has_mamba=True, policy=CostPolicy(COST))
    pools = Pools()
    base = list(range(1, 17))  # 4 pages, with a state
    tree.insert(key(base), pools.pages(4), mamba_device_slot=pools.slot())
    mid = base + [50] * 8  # 2 pages, no state
    tree.insert(key(mid), pools.pages(6))
    leaf = mid + [60] * 4
    r = tree.insert(key(leaf), pools.pages(7), mamba_device_slot=pools.slot())
    queues = internals_queues(tree)
    stats = queues.stats(r.node, EvictTarget.DEVICE_KV)
    assert (stats.prefix_len, stats.anchor_len, stats.num_children) == (28, 16, 0)
    # Without a state at ``base`` the leaf would fall back to the zero state at 0.
    base_node = tree.node_at(key(base))
    assert base_node is not None
    tree.detach(base_node, Tier.DEVICE, Family.STATE)
    assert not base_node.has_mamba_state and r.node.has_mamba_state
    queues.update(r.node)
    assert queues.stats(r.node, EvictTarget.DEVICE_KV).anchor_len == 0
    # Without Mamba the parent serves instead.
    plain = RadixTree(PS, has_mamba=False, policy=CostPolicy(COST))
    plain.insert(key(base), pools.pages(4))
    r = plain.insert(key(mid), pools.pages(6))
    assert internals_queues(plain).stats(r.node, EvictTarget.DEVICE_KV).anchor_len == 16
    tree.check_integrity()
    plain.check_integrity()


def internals_queues(tree: RadixTree):
    return tree._queues  # the tree's queues (read-only use in these tests)


def test_the_clock_ages_untouched_nodes():
    # GreedyDual: each victim's priority becomes the device clock; a node touched after
    # that carries it, so a valuable node that is never touched again goes eventually.
    tree = RadixTree(PS, has_mamba=True, policy=CostPolicy(COST))
    queues = internals_queues(tree)
    pools = Pools()
    old = tree.insert(key(range(1000, 1032)), pools.pages(8), mamba_device_slot=pools.slot()).node
    clocks = []
    evicted_old_at = None
    for i in range(40):
        tree.insert(key([i + 1] * 8), pools.pages(2), mamba_device_slot=pools.slot())
        head = queues.head(EvictTarget.DEVICE_KV)
        assert head is not None
        victim = head[-1]
        res = tree.evict_device(1)
        assert res.device_pages  # something went: the head
        clocks.append(queues._steps[0][1][-1])
        if victim is old:
            evicted_old_at = i
            break
        tree.check_integrity()
    assert clocks == sorted(clocks) and clocks[-1] > 0
    assert evicted_old_at is not None and evicted_old_at > 0


def test_head_is_what_pop_takes_and_keys_compare_across_families():
    tree = RadixTree(PS, has_mamba=True, policy=CostPolicy(COST))
    queues = internals_queues(tree)
    pools = Pools()
    rng = random.Random(5)
    for _ in range(30):
        toks = [rng.randrange(3)] * 4 + [rng.randrange(6) for _ in range(4 * rng.randrange(1, 4))]
        m = tree.match_prefix(key(toks))
        del m
        tree.insert(key(toks), pools.pages(len(toks) // PS), mamba_device_slot=pools.slot())
    for target in (EvictTarget.DEVICE_KV, EvictTarget.MAMBA_DEVICE):
        head = queues.head(target)
        assert head is not None
        assert isinstance(head[0], float)  # the same unit for both targets
        assert queues.pop(target) is head[-1]
        queues.update(head[-1])  # back in (the tree would have evicted it)
    tree.check_integrity()


def _stress(policy_factory, seed: int) -> tuple[str, list[int]]:
    """Random matches, inserts, locks and evictions on both tiers; returns the digest
    and the order of the slots freed, checking every invariant on the way."""
    tree = RadixTree(PS, has_mamba=True, policy=policy_factory())
    rng = random.Random(seed)
    free_dev, free_host = list(range(60)), list(range(200))
    free_slots, free_hslots = list(range(12)), list(range(40))
    freed_order: list[int] = []
    locked = []
    for step in range(300):
        toks = [rng.randrange(4)] * 8 + [rng.randrange(5) for _ in range(4 * rng.randrange(1, 5))]
        tree.match_prefix(key(toks))
        for target in (EvictTarget.DEVICE_KV, EvictTarget.MAMBA_DEVICE, EvictTarget.HOST_KV):
            internals_queues(tree).head(target)  # what an arena compares (re-keys heads)
        need = len(toks) // PS
        if len(free_dev) < need:
            r = tree.evict_device(need - len(free_dev))
            free_dev += r.device_pages
            free_host += r.host_pages
            free_slots += r.mamba_device_slots
            free_hslots += r.mamba_host_slots
            freed_order += r.mamba_device_slots
        if not free_slots:
            r = tree.evict_mamba_device(1)
            free_dev += r.device_pages
            free_host += r.host_pages
            free_slots += r.mamba_device_slots
            free_hslots += r.mamba_host_slots
            freed_order += r.mamba_device_slots
        if len(free_host) < need or not free_hslots:
            r = tree.evict_host(max(need - len(free_host), 1))
            r2 = tree.evict_mamba_host(1)
            for res in (r, r2):
                free_dev += res.device_pages
                free_host += res.host_pages
                free_slots += res.mamba_device_slots
                free_hslots += res.mamba_host_slots
        if len(free_dev) < need or not free_slots or len(free_host) < need or not free_hslots:
            continue
        dev = [free_dev.pop() for _ in range(need)]
        host = [free_host.pop() for _ in range(need)]
        slot, hslot = free_slots.pop(), free_hslots.pop()
        r = tree.insert(key(toks), dev, host, mamba_device_slot=slot, mamba_host_slot=hslot)
        free_dev += r.unused_device_indices
        free_host += r.unused_host_indices
        if not r.mamba_device_taken:
            free_slots.append(slot)
        if not r.mamba_host_taken:
            free_hslots.append(hslot)
        if rng.random() < 0.2:
            tree.lock(r.node)
            locked.append(r.node)
        if locked and rng.random() < 0.3:
            tree.unlock(locked.pop(0))
        if step % 5 == 0:
            tree.check_integrity(
                device=PoolUsage(capacity=60, free=free_dev),
                host=PoolUsage(capacity=200, free=free_host),
                mamba_device=PoolUsage(capacity=12, free=free_slots),
                mamba_host=PoolUsage(capacity=40, free=free_hslots),
            )
    tree.check_integrity()
    return tree.digest(), freed_order


@pytest.mark.parametrize(
    "factory",
    [
        lambda: CostPolicy(COST),
        lambda: DecayCostPolicy(COST, horizon=3.0),
        lambda: AdaptiveCostPolicy(COST, scale=2.0, horizon=30.0),
        lambda: MarconiPolicy(COST, 1.0),
        lambda: MarconiPolicy(COST, 0.0),
    ],
    ids=["gds", "decay", "adaptive", "marconi", "marconi-alpha0"],
)
def test_random_operations_keep_invariants_and_are_deterministic(factory):
    a = _stress(factory, seed=11)
    assert a == _stress(factory, seed=11)
    assert a[1], "the run must evict states"
    assert a != _stress(lambda: LRUPolicy(), seed=11)  # the policy decided something


def test_marconi_selects_by_normalized_recency_and_efficiency():
    policy = MarconiPolicy(COST, alpha=2.0)
    # (last_access, value, id, node): the oldest has the best value, the newest the worst.
    entries = [(1, 10.0, 0, None), (5, 5.0, 1, None), (9, 0.0, 2, None)]
    # scores: 0 + 2*1 = 2, 0.5 + 2*0.5 = 1.5, 1 + 0 = 1 -> the newest goes
    assert policy.select(entries, EvictTarget.DEVICE_KV) == 2
    assert MarconiPolicy(COST, alpha=0.1).select(entries, EvictTarget.DEVICE_KV) == 0
    with pytest.raises(ValueError, match="alpha"):
        MarconiPolicy(COST, alpha=-1)


def test_config_selects_the_policy(one_rank_topology):
    kv = KVSpec(layer_ids=(0,), num_kv_heads=1, head_dim=2)
    mamba = MambaSpec(
        layer_ids=(1,), conv_dim=2, conv_kernel=2, num_heads=1, head_dim=2, state_dim=2
    )
    spec = StateSpec(model_id="test-model", page_size=PS, kv=kv, mamba=mamba)
    kinds = (("lru", LRUPolicy), ("cost", DecayCostPolicy), ("adaptive", AdaptiveCostPolicy))
    for name, kind in kinds:
        config = HiCacheConfig(device_pages=8, enable_host=False, eviction_policy=name)
        cache = HiCache(one_rank_topology, spec, config)
        assert type(internals(cache).tree.policy) is kind
        cache.close()
    given = MarconiPolicy(COST, 0.5)
    config = HiCacheConfig(device_pages=8, enable_host=False, eviction_policy=given)
    assert make_policy(config.eviction_policy, COST) is given
    assert isinstance(make_policy("cost", COST), DecayCostPolicy)
    for gone in ("fifo", "lfu"):
        with pytest.raises(ValueError, match="eviction_policy"):
            HiCacheConfig(device_pages=8, eviction_policy=gone)
    with pytest.raises(TypeError, match="cost_model"):
        HiCacheConfig(device_pages=8, cost_model={"flops_per_token": 1})


def test_an_inner_state_ages_from_its_last_use_as_a_resume_point():
    tree = RadixTree(PS, has_mamba=True, policy=CostPolicy(COST))
    pools = Pools()
    base = list(range(1, 9))
    tree.insert(key(base), pools.pages(2), mamba_device_slot=pools.slot())
    node = tree.node_at(key(base))
    assert node is not None and node.state_access == tree.clock  # a new checkpoint
    leaf = base + [40, 41, 42, 43]
    tree.insert(key(leaf), pools.pages(3), mamba_device_slot=pools.slot())
    created = node.state_access
    # Matches through ``base`` to the leaf's state touch the node, not its state...
    tree.match_prefix(key(leaf + [1]))
    assert node.last_access == tree.clock and node.state_access == created
    # ...a match that resumes from it does.
    tree.match_prefix(key(base + [7, 7, 7, 7]))
    assert node.state_access == tree.clock
    tree.check_integrity()


@pytest.mark.parametrize("policy", ["cost", "adaptive"])
def test_exact_resume_from_every_tier_under_the_cost_policy(
    one_rank_topology, tmp_path, monkeypatch, policy
):
    # The engine's resume scenarios (tests/engine_cases.py) with a cost-aware policy.
    import functools

    import tests.engine_cases as cases

    monkeypatch.setattr(
        cases, "HiCacheConfig", functools.partial(HiCacheConfig, eviction_policy=policy)
    )
    assert cases.HiCacheConfig(device_pages=1).eviction_policy == policy
    checks = cases.resume_scenarios(one_rank_topology, root=str(tmp_path))
    for c in checks:
        assert c.cached > 0, f"{c.label}: expected a {c.tier} hit"
        assert c.max_diff < cases.ATOL and c.tokens_equal, c.label
    assert {c.tier for c in checks} == {"device", "host", "storage"}


def _gate_cache(
    one_rank_topology, older_host_node: bool, gate: bool = True
) -> tuple[HiCache, list[int]]:
    """LRU, write-back, 8 device pages / 16 host pages (tests/unit/cache_support). With
    ``older_host_node`` the host holds a copy of a node older than A; otherwise of B,
    newer than A. Then C makes the device evict A (its oldest): is A worth host bytes?"""
    from tests.unit.cache_support import make_config, make_spec, serve

    config = make_config(write_policy="write_back", eviction_policy="lru")
    cache = HiCache(one_rank_topology, make_spec(), config)
    a, b, c, z = (list(range(k, k + 12)) for k in (100, 200, 300, 400))
    ints = internals(cache)
    ints.controller.backups.value_gate = gate
    if older_host_node:
        ints.set_write_policy("write_through")
        serve(cache, z)  # host copy of Z, older than A
        ints.set_write_policy("write_back")
        serve(cache, a)
        serve(cache, b)  # evicts Z from device (it has its host copy)
    else:
        serve(cache, a)
        ints.set_write_policy("write_through")
        serve(cache, b)  # host copy of B, newer than A
        ints.set_write_policy("write_back")
    cache.flush()
    serve(cache, c)  # 3 pages with 2 free: A goes from device
    cache.flush()
    return cache, a


@pytest.mark.parametrize("older_host_node", [True, False], ids=["worth-it", "not-worth-it"])
def test_write_back_only_when_worth_its_host_bytes(one_rank_topology, older_host_node):
    # A device victim goes to host only if the policy ranks it at or above the host's own
    # next victim: above an older host copy it is written back; below B's newer copy it
    # would displace something the policy values more, so it is dropped.
    from tests.unit.cache_support import serve

    cache, a = _gate_cache(one_rank_topology, older_host_node)
    backups = internals(cache).controller.backups
    got = serve(cache, a)
    assert got.mismatches == 0
    if older_host_node:
        assert backups.refused_write_backs == 0
        assert got.served == (0, 12, 0)  # off device, back from host
    else:
        assert backups.refused_write_backs == 1
        assert got.served == (0, 0, 0)
    cache.check_integrity()
    cache.close()


def test_without_the_value_gate_every_device_victim_is_written_back(one_rank_topology):
    # The default (value_gate off): the victim the gate refuses above goes to host.
    from tests.unit.cache_support import serve

    cache, a = _gate_cache(one_rank_topology, older_host_node=False, gate=False)
    backups = internals(cache).controller.backups
    assert backups.refused_write_backs == 0
    got = serve(cache, a)
    assert got.mismatches == 0 and got.served == (0, 12, 0)
    cache.check_integrity()
    cache.close()
