"""AdaptiveCostPolicy: the horizon follows the victims' mean age, keys stay monotone and
deterministic, metadata stays bounded."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from mesh_hicache.radix import EvictTarget, RadixKey, RadixTree, adaptive
from mesh_hicache.radix.adaptive import AdaptiveCostPolicy
from mesh_hicache.radix.eviction import CostModel, DecayCostPolicy, NodeStats
from mesh_hicache.radix.policies import make_policy

PS = 4
COST = CostModel(kv_bytes_per_token=1.0, state_bytes=40.0, flops_per_token=100.0, flops_per_key=1.0)
DEV = EvictTarget.DEVICE_KV


def leaf(last_access: int, anchor: int = 16) -> NodeStats:
    return NodeStats(last_access, 0, 8, True, prefix_len=24, anchor_len=anchor, serves=True)


def test_key_is_recency_plus_horizon_times_clipped_log_value():
    policy = AdaptiveCostPolicy(COST, horizon=50.0, clip=8.0)
    decay = DecayCostPolicy(COST, horizon=50.0)
    unit = COST.flops_per_token / COST.kv_bytes_per_token
    s = leaf(7, anchor=4)
    want = math.log(decay.value(s, DEV) / unit)
    assert policy.log_value(s, DEV) == pytest.approx(want)
    # Before any victim the horizon is the initial one: the same key as DecayCostPolicy.
    assert policy.priority(s, DEV) == pytest.approx(decay.priority(s, DEV))
    # A node that saves nothing is clipped to -clip (not ln 1e-6).
    dead = s._replace(serves=False, has_mamba_state=False)
    assert policy.priority(dead, DEV)[0] == pytest.approx(7 - 50.0 * 8.0)
    for bad in (dict(scale=0), dict(clip=-1), dict(horizon=-1), dict(mean_decay=2.0)):
        with pytest.raises(ValueError):
            AdaptiveCostPolicy(COST, **bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CostModel"):
        AdaptiveCostPolicy({"flops_per_token": 1.0})  # type: ignore[arg-type]
    assert isinstance(make_policy("adaptive", COST), AdaptiveCostPolicy)


def test_horizon_moves_towards_scale_times_the_mean_victim_age_at_a_bounded_slope():
    policy = AdaptiveCostPolicy(COST, scale=3.0, horizon=100.0, clip=4.0, mean_decay=0.5)
    # Victims last used at 0, evicted at clock 10 and 20: ages 10 and 20, mean 10 then 15.
    policy.on_evict(None, DEV, leaf(0), 10)  # type: ignore[arg-type]
    assert policy.mean_age == 10 and policy.horizon == 30.0
    policy.on_evict(None, DEV, leaf(0), 20)  # type: ignore[arg-type]
    assert policy.mean_age == 15 and policy.horizon == 45.0
    # The past is fixed: up to the first retarget (after clock 10) H stays 100; then it
    # falls at slope 0.999 / clip towards the target 30, then 45 from clock 21 on.
    assert policy.horizon_at(0) == policy.horizon_at(11) == 100.0
    rate = 0.999 / 4.0
    assert policy.horizon_at(15) == pytest.approx(100.0 - 4 * rate)
    h21 = 100.0 - 10 * rate
    assert policy.horizon_at(21) == pytest.approx(h21)
    assert policy.horizon_at(31) == pytest.approx(h21 - 10 * rate)
    assert policy.horizon_at(10**6) == 45.0
    # A small drift (under 2 % + 1 tick) does not add a knot.
    knots = policy.knots()
    policy.on_evict(None, DEV, leaf(5), 20)  # type: ignore[arg-type]
    assert policy.knots() == knots and policy.horizon == 45.0


def test_touching_never_lowers_a_key_and_the_past_never_changes():
    rng = random.Random(3)
    policy = AdaptiveCostPolicy(COST, scale=20.0, horizon=300.0, clip=6.0, mean_decay=0.3)
    clock, seen = 0, {}
    for _ in range(400):
        clock += rng.randint(1, 5)
        policy.on_evict(None, DEV, leaf(max(clock - rng.randint(0, 60), 0)), clock)  # type: ignore[arg-type]
        for t in rng.sample(range(clock + 1), min(5, clock + 1)):
            h = policy.horizon_at(t)
            assert seen.setdefault(t, h) == h  # H at a time already reached never changes
        # key(t) = t + H(t) * l never decreases in t, for every l in [-clip, clip]
        t1 = rng.randint(0, clock)
        t2 = t1 + rng.randint(1, 40)
        for ell in (-6.0, -1.0, 0.0, 2.5, 6.0):
            assert t2 + policy.horizon_at(t2) * ell >= t1 + policy.horizon_at(t1) * ell
    assert 0.0 <= policy.horizon <= policy.max_horizon


def test_metadata_is_bounded(monkeypatch):
    monkeypatch.setattr(adaptive, "_MAX_KNOTS", 16)
    policy = AdaptiveCostPolicy(COST, scale=1.0, mean_decay=1.0)
    for i in range(1, 200):
        # Alternating ages force a new target (and a knot) on every eviction.
        policy.on_evict(None, DEV, leaf(10 * i - (1 if i % 2 else 300)), 10 * i)  # type: ignore[arg-type]
        assert policy.knots() <= 16
    assert policy.victims == 199
    assert policy.horizon_at(0) >= 0.0  # a time before the oldest kept knot still ranks


def _run(policy_factory, seed: int) -> tuple[list[int], str, list[float]]:
    """Random prompts sharing prefixes through a small device-only tree; evictions as needed."""
    rng = random.Random(seed)
    policy = policy_factory()
    tree = RadixTree(PS, has_mamba=True, policy=policy)
    pages, slots = itertools.count(), itertools.count()
    free_pages: list[int] = [next(pages) for _ in range(40)]
    free_slots: list[int] = [next(slots) for _ in range(6)]
    order: list[int] = []
    prefixes = [[rng.randrange(1000) for _ in range(PS * rng.randint(1, 4))] for _ in range(5)]
    for _ in range(300):
        toks = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(PS * rng.randint(0, 3))]
        if not toks:
            continue
        tree.match_prefix(RadixKey(tuple(toks)))
        need = len(toks) // PS
        if len(free_pages) < need:
            r = tree.evict_device(need - len(free_pages))
            free_pages += r.device_pages
            free_slots += r.mamba_device_slots
            order += r.device_pages
        if not free_slots:
            r = tree.evict_mamba_device(1)
            free_pages += r.device_pages
            free_slots += r.mamba_device_slots
            order += r.mamba_device_slots
        if len(free_pages) < need or not free_slots:
            continue
        dev = [free_pages.pop() for _ in range(need)]
        slot = free_slots.pop()
        r = tree.insert(RadixKey(tuple(toks)), dev, mamba_device_slot=slot)
        free_pages += r.unused_device_indices
        if not r.mamba_device_taken:
            free_slots.append(slot)
        tree.check_integrity()  # includes: no stored key ahead of its current key
    return order, tree.digest(), list(getattr(policy, "_h", []))


def test_two_identical_runs_agree_and_the_horizon_learnt_something():
    def factory():
        return AdaptiveCostPolicy(COST, scale=2.0, horizon=400.0, clip=8.0)

    a = _run(factory, seed=5)
    assert a == _run(factory, seed=5)  # what each rank would compute
    assert a[0], "the run must evict"
    assert len(a[2]) > 1, "the horizon must have been retargeted"
    assert a[0] != _run(lambda: DecayCostPolicy(COST, horizon=400.0), seed=5)[0]
