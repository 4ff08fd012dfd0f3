"""ReusePolicy: labels from later matches (live nodes and evicted ghosts), the model learns
which nodes come back, victims follow it, runs are deterministic."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from mesh_hicache.radix import EvictTarget, RadixKey, RadixTree, reuse
from mesh_hicache.radix.adaptive import AdaptiveCostPolicy
from mesh_hicache.radix.eviction import CostModel
from mesh_hicache.radix.policies import make_policy
from mesh_hicache.radix.reuse import NUM_FEATURES, ReusePolicy

PS = 4
COST = CostModel(kv_bytes_per_token=1.0, state_bytes=8.0, flops_per_token=100.0, flops_per_key=1.0)
DEV = EvictTarget.DEVICE_KV
LONG = 16  # pages of a prompt that never comes back
LAG = 2  # iterations after which a short prompt comes back


class Cache:
    """A device-only tree with page and slot free lists; evicts as inserts need."""

    def __init__(self, policy: ReusePolicy | AdaptiveCostPolicy, pages: int, slots: int) -> None:
        self.tree = RadixTree(PS, has_mamba=True, policy=policy)
        ids = itertools.count()
        self.pages = [next(ids) for _ in range(pages)]
        self.slots = list(range(slots))
        self.victims: list[int] = []

    def request(self, toks: list[int]) -> int:
        """Match (touching) then insert ``toks`` with a state at its end; the hit length."""
        tree = self.tree
        hit = tree.match_prefix(RadixKey(tuple(toks))).usable_len
        need = len(toks) // PS
        if len(self.pages) < need:
            before = {n.id for n in tree.iter_nodes()}
            r = tree.evict_device(need - len(self.pages))
            self.pages += r.device_pages
            self.slots += r.mamba_device_slots
            self.victims += sorted(before - {n.id for n in tree.iter_nodes()})
        if not self.slots:
            r = tree.evict_mamba_device(1)
            self.pages += r.device_pages
            self.slots += r.mamba_device_slots
        if len(self.pages) < need or not self.slots:
            return hit
        dev = [self.pages.pop() for _ in range(need)]
        slot = self.slots.pop()
        r = tree.insert(RadixKey(tuple(toks)), dev, mamba_device_slot=slot)
        self.pages += r.unused_device_indices
        if not r.mamba_device_taken:
            self.slots.append(slot)
        tree.check_integrity()
        return hit


def test_arguments_registration_and_the_untrained_model_decays_with_age():
    assert isinstance(make_policy("reuse", COST), ReusePolicy)
    for bad in (dict(window=0), dict(lr=-1), dict(samples=-1), dict(scan=1), dict(scan=2.5)):
        with pytest.raises(ValueError):
            ReusePolicy(COST, **bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CostModel"):
        ReusePolicy({"flops_per_token": 1.0})  # type: ignore[arg-type]
    policy = ReusePolicy(COST)
    assert len(policy.weights) == NUM_FEATURES
    cache = Cache(policy, pages=64, slots=8)
    cache.request([1, 2, 3, 4, 5, 6, 7, 8])
    node = next(iter(cache.tree.iter_nodes()))
    # Before any label the weight on age is adaptive's: older is less likely reused.
    probs = [policy.probability(node, DEV, node.last_access + a) for a in (0, 5, 50, 500)]
    assert probs == sorted(probs, reverse=True) and probs[0] > probs[-1]


def test_a_match_through_an_evicted_leaf_labels_its_sample_and_moves_the_weights():
    policy = ReusePolicy(COST, window=1000.0, samples=4)
    cache = Cache(policy, pages=6, slots=8)
    a = [100 + i for i in range(3 * PS)]
    b = [200 + i for i in range(3 * PS)]
    cache.request(a)
    cache.request(b)
    cache.request([300 + i for i in range(3 * PS)])  # no room: evicts a or b
    assert cache.victims and policy.labels == [0, 0]
    gone = a if cache.tree.match_prefix(RadixKey(tuple(a)), touch=False).usable_len == 0 else b
    before = list(policy.weights)
    cache.request(gone)  # its prefix extends through the evicted leaf's last page
    assert policy.ghost_hits == 1 and policy.labels[1] >= 1
    assert policy.weights != before
    # A label is given once: the same prefix again adds nothing.
    labels = list(policy.labels)
    cache.request(gone)
    assert policy.ghost_hits == 1 and policy.labels[1] == labels[1]


def test_samples_nobody_uses_are_labelled_0_after_the_window():
    policy = ReusePolicy(COST, window=0.5, samples=8)
    cache = Cache(policy, pages=8, slots=8)
    rng = random.Random(1)
    for _ in range(60):  # fresh prompts only: nothing is ever used again
        cache.request([rng.randrange(10**6) for _ in range(2 * PS)])
    assert policy.labels[1] == 0 and policy.labels[0] > 10
    assert policy.weights[0] < -2.0  # the bias fell from its start


#: Every token saves the same per byte: only the learnt reuse tells the nodes apart.
FLAT = CostModel(kv_bytes_per_token=1.0, flops_per_token=100.0)


def _train(lr: float, seed: int) -> tuple[ReusePolicy, Cache, int]:
    """A short (1-page) prompt, then a long (``LONG`` pages) one; the short one comes back
    (extended by a page) ``LAG`` iterations later, the long one never. Returns the policy,
    the cache and the tokens the returning prompts hit."""
    rng = random.Random(seed)
    policy = ReusePolicy(FLAT, window=4.0, samples=8, lr=lr)
    cache = Cache(policy, pages=40, slots=64)
    back: list[list[int]] = []
    hits = 0
    for i in range(400):
        short = [rng.randrange(10**6) for _ in range(PS)]
        cache.request(short)
        back.append(short)
        cache.request([rng.randrange(10**6) for _ in range(LONG * PS)])
        if i >= LAG:
            hits += cache.request(back[i - LAG] + [rng.randrange(10**6) for _ in range(PS)])
    return policy, cache, hits


def test_the_model_learns_which_leaves_come_back_and_victims_follow_it():
    policy, cache, hits = _train(lr=0.05, seed=4)
    assert policy.labels[0] > 50 and policy.labels[1] > 50
    # Fresh probes of each kind (first-turn leaves), compared at equal age.
    probes = []
    for n in (PS, LONG * PS):
        toks = [7_000_000 + 10 * n + i for i in range(n)]
        cache.request(toks)
        probes.append(cache.tree.match_prefix(RadixKey(tuple(toks)), touch=False).last_node)
    s, lg = probes
    assert s.num_tokens == PS and lg.num_tokens == LONG * PS
    # At equal age a short first-turn leaf is predicted more likely to be reused.
    assert policy.probability(s, DEV, s.last_access + 3) > 1.25 * policy.probability(
        lg, DEV, lg.last_access + 3
    )
    # Untrained (lr 0) the weights stay where they started and the two are alike.
    frozen, _, frozen_hits = _train(lr=0.0, seed=4)
    assert frozen.weights == ReusePolicy(FLAT).weights
    assert frozen.probability(s, DEV, s.last_access + 3) == pytest.approx(
        frozen.probability(lg, DEV, lg.last_access + 3)
    )
    # The learnt victims serve more of the returning prompts than the frozen ones.
    assert hits > 1.2 * frozen_hits


def test_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(reuse, "_GAP_PRUNE", 32)
    policy, cache, _ = _train(lr=0.05, seed=2)
    pending, ghosts, gaps = policy.held()
    # A sample waits at most W ticks and a ghost only while its sample does.
    assert ghosts <= pending <= policy.labels[0] + policy.labels[1]
    assert pending <= max(int(policy.window * policy.mean_age), 1) * (policy.samples + 1)
    # Gaps are kept for live nodes only (dropped with a leaf victim, pruned of dead
    # nodes once past the bound).
    alive = sum(1 for _ in cache.tree.iter_nodes())
    assert gaps <= max(32, alive) + 8


def test_two_identical_runs_agree():
    a, ca, ha = _train(lr=0.05, seed=9)
    b, cb, hb = _train(lr=0.05, seed=9)
    assert a.weights == b.weights and a.labels == b.labels and ha == hb
    assert ca.victims == cb.victims and ca.tree.digest() == cb.tree.digest()
    assert ca.victims, "the run must evict"


def test_exact_resume_from_every_tier_under_the_reuse_policy(
    one_rank_topology, tmp_path, monkeypatch
):
    # The engine's resume scenarios (tests/engine_cases.py) with the learnt policy.
    import functools

    import tests.engine_cases as cases
    from mesh_hicache.config import HiCacheConfig

    monkeypatch.setattr(
        cases, "HiCacheConfig", functools.partial(HiCacheConfig, eviction_policy="reuse")
    )
    assert cases.HiCacheConfig(device_pages=1).eviction_policy == "reuse"
    checks = cases.resume_scenarios(one_rank_topology, root=str(tmp_path))
    for c in checks:
        assert c.cached > 0, f"{c.label}: expected a {c.tier} hit"
        assert c.max_diff < cases.ATOL and c.tokens_equal, c.label


def test_without_mamba_every_node_serves_and_is_valued():
    # In a KV-only tree a hit needs no state, so a node without one still saves compute:
    # its score carries its value (the floor would make every node's value alike).
    for has_mamba, valued in ((False, True), (True, False)):
        policy = ReusePolicy(COST)
        tree = RadixTree(PS, has_mamba=has_mamba, policy=policy)
        assert policy.has_mamba is has_mamba
        tree.insert(RadixKey(tuple(range(3 * PS))), list(range(3)))  # no state
        node = tree.match_prefix(RadixKey(tuple(range(3 * PS))), touch=False).last_node
        now = node.last_access
        logp = math.log(policy.probability(node, DEV, now))
        assert (policy.score(node, DEV, now) > logp + math.log(reuse._FLOOR) + 1) is valued
