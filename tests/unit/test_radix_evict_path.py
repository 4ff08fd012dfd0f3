"""The radix tree's eviction fast paths: only-child removal, plain-LRU pop, queue ends."""

from __future__ import annotations

import random

from mesh_hicache.radix import (
    EvictTarget,
    LRUPolicy,
    NodeStats,
    PoolUsage,
    RadixKey,
    RadixTree,
    TreeNode,
)
from mesh_hicache.radix.queues import _RUN, _SortedEntries


def key(tokens: list[int], ns: str = "") -> RadixKey:
    return RadixKey(tuple(tokens), ns)


def test_removing_one_of_two_children_keeps_the_sibling_then_only_children_go() -> None:
    tree = RadixTree(2, has_mamba=False)
    tree.insert(key([1, 1, 2, 2, 5, 5]), [0, 1, 2])
    unused = tree.insert(key([1, 1, 3, 3]), [3, 4]).unused_device_indices
    assert unused == (3,) and tree.num_nodes == 3  # split: [1, 1] -> {[2, 2, 5, 5], [3, 3]}
    r = tree.evict_device(1)  # the older leaf; its parent still has the other child
    assert sorted(r.device_pages) == [1, 2] and tree.num_nodes == 2
    tree.check_integrity(device=PoolUsage(capacity=5, free=r.device_pages + unused))
    m = tree.match_prefix(key([1, 1, 3, 3]), touch=False)
    assert m.device_indices == (0, 4) and m.usable_len == 4
    assert tree.match_prefix(key([1, 1, 2, 2]), touch=False).usable_len == 2
    # [3, 3] is now its parent's only child, and [1, 1] the namespace root's only child.
    r2 = tree.evict_device(1)
    assert r2.device_pages == (4,) and tree.num_nodes == 1
    r3 = tree.evict_device(1)
    assert r3.device_pages == (0,) and tree.num_nodes == 0
    assert tree.match_prefix(key([1, 1])).usable_len == 0
    freed = r.device_pages + r2.device_pages + r3.device_pages + unused
    tree.check_integrity(device=PoolUsage(capacity=5, free=freed))
    # The tree is usable again under the same first page.
    tree.insert(key([1, 1, 7, 7]), [0, 1])
    assert tree.match_prefix(key([1, 1, 7, 7])).device_indices == (0, 1)
    tree.check_integrity()


def test_mamba_chain_cascade_clears_parents() -> None:
    tree = RadixTree(1, has_mamba=True)
    tree.insert(key([1, 2]), [0, 1])  # no state: a tombstone that the chain hangs below
    tree.insert(key([1, 2, 3]), [0, 1, 2], mamba_device_slot=0)
    tree.insert(key([1, 2, 3, 4]), [0, 1, 2, 3], mamba_device_slot=1)
    tree.insert(key([1, 5]), [0, 4], mamba_device_slot=2)  # splits [1, 2] -> [1] + [2]
    # The oldest state goes first: [3] becomes a tombstone (it still has the child [4]).
    r = tree.evict_mamba_device(1)
    assert r.mamba_device_slots == (0,) and r.device_pages == ()
    # [4] loses its state and goes; the tombstones [3] and [2] above it, each an only
    # child, follow; [1] stays (it has the child [5]).
    r = tree.evict_mamba_device(1)
    assert r.mamba_device_slots == (1,) and r.device_pages == (3, 2, 1)
    assert tree.num_nodes == 2 and tree.match_prefix(key([1, 5])).usable_len == 2
    tree.check_integrity()
    # [5] is [1]'s only child; then [1], a childless tombstone, goes too.
    r = tree.evict_device(1)
    assert r.device_pages == (4, 0) and r.mamba_device_slots == (2,)
    assert tree.num_nodes == 0
    tree.check_integrity()


def test_plain_lru_pop_rekeys_a_touched_head() -> None:
    tree = RadixTree(1, has_mamba=False)
    assert tree._queues._fast_pop  # plain LRU takes the written-out pop
    tree.insert(key([1]), [0])
    tree.insert(key([2]), [1])
    tree.insert(key([3]), [2])
    tree.match_prefix(key([1]))  # [1]'s stored key is now stale at the queue's head
    assert tree.evict_device(1).device_pages == (1,)
    assert tree.evict_device(1).device_pages == (2,)
    tree.check_integrity()
    assert tree.evict_device(1).device_pages == (0,)
    assert tree.evict_device(1).device_pages == ()


def test_lru_policy_with_on_evict_is_told_every_victim() -> None:
    seen: list[tuple[int, EvictTarget]] = []

    class Watching(LRUPolicy):
        def on_evict(  # type: ignore[override]
            self, node: TreeNode, target: EvictTarget, stats: NodeStats, now: int
        ) -> None:
            seen.append((node.id, target))

    tree = RadixTree(1, has_mamba=False, policy=Watching())
    assert not tree._queues._fast_pop
    a = tree.insert(key([1]), [0]).node
    b = tree.insert(key([2]), [1]).node
    tree.match_prefix(key([1]))
    assert tree.evict_device(2).device_pages == (1, 0)
    assert seen == [(b.id, EvictTarget.DEVICE_KV), (a.id, EvictTarget.DEVICE_KV)]


def test_queue_adds_and_removes_at_both_ends_and_inside() -> None:
    rng = random.Random(3)
    queue = _SortedEntries()
    held: list[tuple[int, int, None]] = []
    n = 0
    for step in range(6 * _RUN):
        lo = held[0][0] if held else 0
        hi = held[-1][0] if held else 0
        where = step % 3
        value = lo - 1 if where == 0 else hi + 1 if where == 1 else rng.randint(lo, hi)
        entry = (value, n, None)
        n += 1
        queue.add(entry)
        held.append(entry)
        held.sort()
        if step % 7 == 0:  # take one near the front (where eviction works), not the first
            victim = held[min(3, len(held) - 1)]
            queue.remove(victim)
            held.remove(victim)
    assert len(queue.runs) > 2
    assert list(queue) == held and queue.size == len(held)
    assert queue.maxes == [run[-1] for run in queue.runs]
    for victim in [held[-1], held[0], held[len(held) // 2]]:
        queue.remove(victim)
        held.remove(victim)
    assert list(queue) == held and queue.maxes == [run[-1] for run in queue.runs]
