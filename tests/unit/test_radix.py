"""RadixTree: matching, the hybrid hit rule, tiers, eviction, integrity, determinism."""

from __future__ import annotations

import itertools
import random

import pytest

from mesh_hicache.radix import (
    EvictionPolicy,
    EvictTarget,
    Family,
    LRUPolicy,
    NodeStats,
    PoolUsage,
    RadixKey,
    RadixTree,
    Tier,
    TreeNode,
    page_hashes,
)
from mesh_hicache.radix.queues import is_candidate


class _LFUPolicy(EvictionPolicy):
    """Least frequently used first, then least recently used: a second monotone policy
    for the interface (the library ships LRU as its only plain recency policy)."""

    def priority(self, stats: NodeStats, target: EvictTarget) -> tuple[int | float, ...]:
        return (stats.hit_count, stats.last_access)


class Pages:
    """A counter that hands out fresh indices."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def take(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


def key(tokens: list[int] | range, ns: str = "") -> RadixKey:
    return RadixKey(tuple(tokens), ns)


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_match_insert_split_page_sizes(ps: int) -> None:
    tree = RadixTree(ps, has_mamba=False)
    pages = Pages()
    a = list(range(3 * ps + ps // 2))  # unaligned: the partial page is ignored
    dev = pages.take(3)
    r = tree.insert(key(a), dev)
    assert r.num_existing_pages == 0 and r.unused_device_indices == ()
    assert r.node.num_tokens == 3 * ps
    m = tree.match_prefix(key(a + [7, 7]))
    assert m.device_indices == tuple(dev) and m.device_len == m.usable_len == 3 * ps
    assert m.raw_kv_len == 3 * ps and m.host_len == 0 and m.last_node is r.node

    # A key diverging inside the node's second page: the match splits after page 1.
    b = a[: ps + ps // 2] + [10**6] * (2 * ps)
    m = tree.match_prefix(key(b))
    assert m.usable_len == ps and m.device_indices == (dev[0],)
    assert m.last_node.num_tokens == ps and len(list(tree.iter_nodes())) == 2
    assert m.last_node.children  # the rest of a hangs below the split point
    tree.check_integrity(device=PoolUsage(capacity=3, free=[]))

    # Inserting b takes only the pages after the shared one.
    dev_b = pages.take(len(b) // ps)
    r = tree.insert(key(b), dev_b)
    assert r.num_existing_pages == 1 and r.unused_device_indices == (dev_b[0],)
    assert tree.num_device_pages == 3 + len(dev_b) - 1
    assert tree.match_prefix(key(b)).device_indices == (dev[0], *dev_b[1:])
    tree.check_integrity()
    # A key shorter than a page matches nothing.
    assert tree.match_prefix(key(a[: ps - 1])).usable_len == 0


def test_insert_validates() -> None:
    tree = RadixTree(4, has_mamba=False)
    with pytest.raises(ValueError, match="one per whole page"):
        tree.insert(key(range(9)), [0, 1, 2])
    with pytest.raises(ValueError, match="neither"):
        tree.insert(key(range(8)))
    with pytest.raises(ValueError, match="has_mamba=False"):
        tree.insert(key(range(8)), [0, 1], mamba_device_slot=0)
    with pytest.raises(TypeError, match="RadixKey"):
        tree.match_prefix((1, 2, 3, 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="page_size"):
        RadixTree(0, has_mamba=False)


def test_hit_rule_cuts_back_to_checkpoint() -> None:
    ps = 2
    tree = RadixTree(ps, has_mamba=True)
    a = list(range(8))  # 4 pages
    tree.insert(key(a), [0, 1, 2, 3], mamba_device_slot=0)
    # KV for 3 pages, but no state at page 3 (nor at 1 or 2): usable is empty.
    m = tree.match_prefix(key(a[:6] + [99, 99]))
    assert m.raw_kv_len == 6 and m.usable_len == 0 and m.device_indices == ()
    assert m.last_node.is_sentinel and m.mamba_on_device is None
    # The whole key: usable up to the state at its end.
    m = tree.match_prefix(key(a + [5]))
    assert m.usable_len == 8 and m.mamba_on_device == 0 and m.device_indices == (0, 1, 2, 3)
    # A checkpoint at page 2 (taken through a split; its pages already exist).
    r = tree.insert(key(a[:4]), [10, 11], mamba_device_slot=1)
    assert r.unused_device_indices == (10, 11) and r.mamba_device_taken
    m = tree.match_prefix(key(a[:6] + [99, 99]))
    assert m.raw_kv_len == 6 and m.usable_len == 4 and m.device_indices == (0, 1)
    assert m.mamba_on_device == 1 and m.last_node is r.node
    # A second state for the same boundary on the same tier is not taken.
    r2 = tree.insert(key(a[:4]), [10, 11], mamba_device_slot=5)
    assert not r2.mamba_device_taken and r2.node is r.node
    tree.check_integrity(mamba_device=PoolUsage(capacity=2, free=[]))


def test_state_on_host_only_and_host_tail() -> None:
    tree = RadixTree(1, has_mamba=True)
    r = tree.insert(key([1, 2]), [0, 1], host_indices=[0, 1], mamba_host_slot=3)
    assert not r.mamba_device_taken and r.mamba_host_taken
    tree.insert(key([1, 2, 3, 4]), host_indices=[5, 6, 7, 8], mamba_device_slot=4)
    m = tree.match_prefix(key([1, 2]))
    assert m.usable_len == 2 and m.mamba_on_device is None and m.mamba_on_host == 3
    # Host-only insert under a device prefix: the tail is host-only.
    m = tree.match_prefix(key([1, 2, 3, 4]))
    assert m.device_indices == (0, 1) and m.device_len == 2
    assert m.host_indices == (7, 8) and m.host_len == 2 and m.mamba_on_device == 4
    # Re-inserting with device pages re-attaches the host-only node's device copy.
    r = tree.insert(key([1, 2, 3, 4]), [20, 21, 22, 23])
    assert r.unused_device_indices == (20, 21)
    assert tree.match_prefix(key([1, 2, 3, 4])).device_indices == (0, 1, 22, 23)
    tree.check_integrity()


def test_tombstone_and_cascade_removal() -> None:
    tree = RadixTree(2, has_mamba=True)
    a = tree.insert(key([1, 1, 2, 2]), [0, 1], host_indices=[0, 1], mamba_device_slot=0).node
    b = tree.insert(key([1, 1, 2, 2, 3, 3]), [0, 1, 2], mamba_device_slot=1).node
    # Same access time; ties break by creation id: a (older) loses its state first.
    r = tree.evict_mamba_device(1)
    assert r.mamba_device_slots == (0,) and r.device_pages == ()
    assert tree.is_tombstone(a) and a.alive and not tree.is_tombstone(b)
    # The tombstone is not a hit boundary any more.
    m = tree.match_prefix(key([1, 1, 2, 2, 9, 9]))
    assert m.raw_kv_len == 4 and m.usable_len == 0
    # b loses its state: childless tombstone -> removed, and a (tombstone) follows.
    r = tree.evict_mamba_device(1)
    assert r.mamba_device_slots == (1,)
    assert sorted(r.device_pages) == [0, 1, 2] and r.host_pages == (0, 1)
    assert not a.alive and not b.alive and tree.num_nodes == 0
    assert list(tree.iter_nodes()) == []
    tree.check_integrity(device=PoolUsage(capacity=3, free=r.device_pages))


def test_cascade_stops_at_locked_or_stateful_ancestor() -> None:
    tree = RadixTree(1, has_mamba=True)
    root_state = tree.insert(key([1]), [0], mamba_host_slot=0).node
    mid = tree.insert(key([1, 2]), [0, 1]).node  # tombstone: no state
    leaf = tree.insert(key([1, 2, 3]), [0, 1, 2], mamba_device_slot=0).node
    tree.lock(mid)
    r = tree.evict_mamba_device(1)
    assert r.device_pages == (2,) and not leaf.alive and mid.alive  # mid is locked
    tree.unlock(mid)
    r = tree.evict_device(1)  # the childless tombstone goes first-come through eviction
    assert r.device_pages == (1,) and not mid.alive and root_state.alive
    tree.check_integrity()


def test_namespaces_isolate() -> None:
    tree = RadixTree(2, has_mamba=False)
    tree.insert(key([1, 2, 3, 4], "a"), [0, 1])
    assert tree.match_prefix(key([1, 2, 3, 4], "b")).usable_len == 0
    assert tree.match_prefix(key([1, 2, 3, 4])).usable_len == 0
    r = tree.insert(key([1, 2, 3, 4], "b"), [2, 3])
    assert r.num_existing_pages == 0 and r.unused_device_indices == ()
    na = tree.match_prefix(key([1, 2, 3, 4], "a")).last_node
    nb = tree.match_prefix(key([1, 2, 3, 4], "b")).last_node
    assert na is not nb and na.hashes != nb.hashes
    assert tree.match_prefix(key([1, 2, 3, 4], "b")).device_indices == (2, 3)
    tree.check_integrity(device=PoolUsage(capacity=4, free=[]))


def test_device_eviction_keeps_host_copy_then_host_eviction_removes() -> None:
    tree = RadixTree(1, has_mamba=False)
    n = tree.insert(key([1, 2]), [0, 1], host_indices=[5, 6]).node
    r = tree.evict_device(2)
    assert r.device_pages == (0, 1) and r.host_pages == ()
    assert n.alive and n.device_indices is None and n.host_indices == (5, 6)
    m = tree.match_prefix(key([1, 2]))
    assert m.device_len == 0 and m.host_indices == (5, 6) and m.usable_len == 2
    # Load back: attach device pages again.
    tree.attach(n, Tier.DEVICE, Family.KV, [7, 8])
    assert tree.match_prefix(key([1, 2])).device_indices == (7, 8)
    # Host eviction of a node also on device keeps it device-only.
    r = tree.evict_host(2)
    assert r.host_pages == (5, 6) and n.alive and n.host_indices is None
    # Last copy: removal.
    r = tree.evict_device(2)
    assert r.device_pages == (7, 8) and not n.alive
    tree.check_integrity()


def test_eviction_skips_locked_and_host_protected() -> None:
    tree = RadixTree(1, has_mamba=False)
    a = tree.insert(key([1, 1]), [0, 1], host_indices=[0, 1]).node
    b = tree.insert(key([2, 2]), [2, 3], host_indices=[2, 3]).node
    tree.lock(a)
    tree.protect_host(b)
    r = tree.evict_device(10)
    assert r.device_pages == (2, 3)  # only b's device copy; a is locked
    r = tree.evict_host(10)
    assert r.host_pages == (0, 1)  # only a's host copy; b is host-protected
    assert a.alive and b.alive
    with pytest.raises(ValueError, match="without a matching"):
        tree.unlock(b)
    tree.unlock(a)
    tree.release_host(b)
    r = tree.evict_host(10)
    assert r.host_pages == (2, 3) and not b.alive
    r = tree.evict_device(10)
    assert r.device_pages == (0, 1) and not a.alive and tree.num_nodes == 0
    tree.check_integrity()


def test_lock_protects_whole_path() -> None:
    tree = RadixTree(1, has_mamba=False)
    tree.insert(key([1, 2]), [0, 1])
    leaf = tree.insert(key([1, 2, 3]), [0, 1, 2]).node
    tree.lock(leaf)
    assert [n.lock_ref for n in tree.nodes_on_path(leaf)] == [1, 1]
    assert tree.evict_device(10).device_pages == ()
    tree.unlock(leaf)
    assert tree.evict_device(10).device_pages == (2, 0, 1)


def test_write_back_callback() -> None:
    tree = RadixTree(1, has_mamba=True)
    a = tree.insert(key([1, 2]), [0, 1], mamba_device_slot=0).node
    b = tree.insert(key([3]), [2], mamba_device_slot=1).node
    host = iter(range(100))
    seen: list[int] = []

    def back_up(node: TreeNode) -> None:
        seen.append(node.id)
        if node is a:  # the controller backs up a only (host full for b, say)
            tree.attach(node, Tier.HOST, Family.KV, [next(host) for _ in range(node.num_pages)])

    r = tree.evict_device(3, before_evict=back_up)
    assert seen == [a.id, b.id]
    assert r.device_pages == (0, 1, 2) and r.mamba_device_slots == (1,)
    assert a.alive and a.host_indices == (0, 1) and not b.alive
    m = tree.match_prefix(key([1, 2]))
    assert m.host_indices == (0, 1) and m.mamba_on_device == 0
    tree.check_integrity()


def test_device_only_parent_with_host_child_is_skipped_not_lost() -> None:
    tree = RadixTree(1, has_mamba=False)
    parent = tree.insert(key([1]), [0]).node
    child = tree.insert(key([1, 2]), [0, 1]).node
    tree.attach(child, Tier.HOST, Family.KV, [9])
    assert tree.evict_device(1).device_pages == (1,)
    # The parent has no host copy and a host-only child: it cannot go without write-back.
    assert tree.evict_device(1).device_pages == ()
    assert parent.alive and child.alive
    tree.check_integrity()
    # Once the child's host copy is evicted the parent is a plain leaf again.
    assert tree.evict_host(1).host_pages == (9,)
    assert tree.evict_device(1).device_pages == (0,)
    assert tree.num_nodes == 0


def test_lru_order_and_policy() -> None:
    tree = RadixTree(1, has_mamba=False)
    for t in range(4):
        tree.insert(key([t]), [t])
    tree.match_prefix(key([0]))
    tree.match_prefix(key([2]))
    assert tree.evict_device(2).device_pages == (1, 3)
    lfu = RadixTree(1, has_mamba=False, policy=_LFUPolicy())
    for t in range(3):
        lfu.insert(key([t]), [t])
    for _ in range(2):
        lfu.match_prefix(key([0]))
    lfu.match_prefix(key([1]))
    assert lfu.evict_device(3).device_pages == (2, 1, 0)
    assert _LFUPolicy().priority(NodeStats(5, 2, 1, False), EvictTarget.HOST_KV) == (2, 5)


def test_eviction_head_names_the_next_victim_without_evicting() -> None:
    tree = RadixTree(1, has_mamba=True)
    for t in range(3):
        tree.insert(key([t]), [t], mamba_device_slot=10 + t)
    tree.match_prefix(key([0]))  # touched: its stored key is stale until re-keyed
    digest = tree.digest()
    head = tree.eviction_head(EvictTarget.DEVICE_KV)
    assert head is not None and head[-1] is tree.node_at(key([1]))
    assert tree.eviction_head(EvictTarget.MAMBA_HOST) is None  # no host states
    assert tree.digest() == digest and tree.num_device_pages == 3
    tree.check_integrity()
    assert tree.evict_device(1).device_pages == (1,)
    head = tree.eviction_head(EvictTarget.DEVICE_KV)
    assert head is not None and head[-1] is tree.node_at(key([2]))


def test_eviction_key_is_the_head_key_and_reads_nothing_else() -> None:
    for policy in (LRUPolicy(), _LFUPolicy()):
        tree = RadixTree(1, has_mamba=True, policy=policy)
        for t in range(3):
            tree.insert(key([t]), [t], mamba_device_slot=10 + t)
        tree.match_prefix(key([0]))  # touched after its entry was stored
        digest = tree.digest()
        head = tree.eviction_head(EvictTarget.DEVICE_KV)
        assert head is not None
        assert tree.eviction_key(head[-1], EvictTarget.DEVICE_KV) == head[:-1]
        first = tree.node_at(key([0]))
        assert first is not None
        k0 = tree.eviction_key(first, EvictTarget.MAMBA_HOST)  # not a candidate there
        assert k0[-1] == first.id and k0 > head[:-1]  # touched: ranked after the head
        assert tree.digest() == digest
        tree.check_integrity()
    with pytest.raises(ValueError, match="live non-sentinel"):
        tree.eviction_key(tree.match_prefix(key([9])).last_node, EvictTarget.DEVICE_KV)


def test_mamba_tier_transitions() -> None:
    tree = RadixTree(1, has_mamba=True)
    n = tree.insert(key([1]), [0], mamba_device_slot=3).node
    tree.attach(n, Tier.HOST, Family.STATE, [4])
    assert tree.detach(n, Tier.DEVICE, Family.STATE)[0] == 3 and tree.num_mamba_device_slots == 0
    assert tree.match_prefix(key([1])).mamba_on_host == 4
    tree.attach(n, Tier.DEVICE, Family.STATE, [5])
    with pytest.raises(ValueError, match="already"):
        tree.attach(n, Tier.DEVICE, Family.STATE, [6])
    assert tree.evict_mamba_host(1).mamba_host_slots == (4,)
    assert not tree.is_tombstone(n)
    tree.check_integrity(mamba_device=PoolUsage(capacity=6, free=[0, 1, 2, 3, 4]))


def test_tier_transition_errors() -> None:
    tree = RadixTree(1, has_mamba=False)
    top = tree.insert(key([1]), [0], host_indices=[0]).node
    leaf = tree.insert(key([1, 2]), [0, 1], host_indices=[0, 1]).node
    with pytest.raises(ValueError, match="children on device"):
        tree.detach(top, Tier.DEVICE, Family.KV)
    assert tree.detach(leaf, Tier.DEVICE, Family.KV) == (1,)
    assert tree.detach(top, Tier.DEVICE, Family.KV) == (0,)
    with pytest.raises(ValueError, match="parent"):
        tree.attach(leaf, Tier.DEVICE, Family.KV, [3])
    with pytest.raises(ValueError, match="already has a host"):
        tree.attach(leaf, Tier.HOST, Family.KV, [3])
    with pytest.raises(ValueError, match="both"):
        tree.detach(leaf, Tier.HOST, Family.KV)
    with pytest.raises(ValueError, match="has_mamba=False"):
        tree.attach(leaf, Tier.DEVICE, Family.STATE, [0])
    tree.attach(top, Tier.DEVICE, Family.KV, [4])
    tree.attach(leaf, Tier.DEVICE, Family.KV, [5])
    assert tree.match_prefix(key([1, 2])).device_indices == (4, 5)
    tree.check_integrity()


def test_integrity_detects_corruption_and_leaks() -> None:
    tree = RadixTree(1, has_mamba=False)
    a = tree.insert(key([1]), [0]).node
    b = tree.insert(key([2]), [1]).node
    tree.check_integrity(device=PoolUsage(capacity=3, free=[2]))
    with pytest.raises(RuntimeError, match="leaks"):
        tree.check_integrity(device=PoolUsage(capacity=4, free=[2]))
    with pytest.raises(RuntimeError, match="free but owned"):
        tree.check_integrity(device=PoolUsage(capacity=3, free=[1, 2]))
    tree.check_integrity(device=PoolUsage(capacity=4, free=[2], held=[3]))
    b.device_indices = (0,)
    with pytest.raises(RuntimeError, match="owned by nodes"):
        tree.check_integrity()
    b.device_indices = (1,)
    a.lock_ref = -1
    with pytest.raises(RuntimeError, match="negative"):
        tree.check_integrity()
    a.lock_ref = 0
    tree.num_device_pages += 1
    with pytest.raises(RuntimeError, match="num_device_pages"):
        tree.check_integrity()


def _random_ops(tree: RadixTree, seed: int) -> None:
    rng = random.Random(seed)
    nxt = itertools.count()
    slots = itertools.count()
    for _ in range(300):
        op = rng.random()
        toks = [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
        if op < 0.5:
            n = len(toks) // tree.page_size
            tree.insert(key(toks), [next(nxt) for _ in range(n)], mamba_device_slot=next(slots))
        elif op < 0.8:
            tree.match_prefix(key(toks))
        elif op < 0.9:
            tree.evict_device(rng.randrange(1, 4))
        else:
            tree.evict_mamba_device(1)


def test_determinism_same_ops_same_digest() -> None:
    t1, t2, t3 = (RadixTree(2, has_mamba=True) for _ in range(3))
    _random_ops(t1, 7)
    _random_ops(t2, 7)
    _random_ops(t3, 8)
    assert t1.digest() == t2.digest()
    assert t1.digest() != t3.digest()
    assert [n.id for n in t1.iter_nodes()] == [n.id for n in t2.iter_nodes()]
    t1.check_integrity()
    t1.match_prefix(key([0, 1]))
    assert t1.digest() != t2.digest()


def test_host_tail_insert_for_prefetch() -> None:
    tree = RadixTree(1, has_mamba=True)
    tree.insert(key([1, 2, 3]), [0, 1, 2], mamba_device_slot=0)
    # Pages 2.. come from L3 onto host: the existing node is split at page 2.
    r = tree.insert(key([1, 2, 3, 4]), host_indices=[7, 8], mamba_host_slot=1, host_first_page=2)
    # Page 2 existed on device only, so it takes host page 7 (a backup for free).
    assert r.num_existing_pages == 3 and r.unused_host_indices == ()
    assert r.mamba_host_taken and r.node.host_indices == (8,)
    m = tree.match_prefix(key([1, 2, 3, 4]))
    assert m.device_indices == (0, 1, 2) and m.host_indices == (8,) and m.mamba_on_host == 1
    # Pages before host_first_page got no host copy: the node was split at page 2.
    assert [n.host_indices for n in tree.nodes_on_path(r.node)] == [None, (7,), (8,)]
    # A missing prefix: nothing is taken.
    r = tree.insert(key([5, 6, 7]), host_indices=[9], mamba_host_slot=2, host_first_page=2)
    assert r.unused_host_indices == (9,) and not r.mamba_host_taken and r.node.is_sentinel
    with pytest.raises(ValueError, match="host-only"):
        tree.insert(key([1, 2]), [0, 1], host_indices=[3], host_first_page=1)
    tree.check_integrity()


def test_untouched_match_reads_without_counting():
    tree = RadixTree(2, has_mamba=True)
    key = RadixKey((1, 2, 3, 4))
    tree.insert(key, device_indices=[0, 1], mamba_device_slot=0)
    counted = tree.match_prefix(key)
    before = (tree.clock, counted.last_node.hit_count, counted.last_node.last_access)
    again = tree.match_prefix(key, touch=False)
    assert again.usable_len == counted.usable_len == 4 and again.last_node is counted.last_node
    assert (tree.clock, again.last_node.hit_count, again.last_node.last_access) == before
    tree.match_prefix(key)
    assert again.last_node.hit_count == before[1] + 1


def test_attach_detach_by_tier_and_family() -> None:
    tree = RadixTree(2, has_mamba=True)
    n = tree.insert(key([1, 2, 3, 4]), [0, 1], mamba_device_slot=5).node
    tree.attach(n, Tier.HOST, Family.KV, [7, 8])
    tree.attach(n, Tier.HOST, Family.STATE, [9])
    assert (n.host_indices, n.mamba_host_slot) == ((7, 8), 9)
    assert tree.num_host_pages == 2 and tree.num_mamba_host_slots == 1
    assert tree.detach(n, Tier.DEVICE, Family.STATE) == (5,)
    assert tree.detach(n, Tier.DEVICE, Family.KV) == (0, 1) and n.device_indices is None
    tree.attach(n, Tier.DEVICE, Family.KV, [3, 4])
    with pytest.raises(ValueError, match="already has a device copy"):
        tree.attach(n, Tier.DEVICE, Family.KV, [5, 6])
    with pytest.raises(ValueError, match="one slot"):
        tree.attach(n, Tier.DEVICE, Family.STATE, [1, 2])
    other = tree.insert(key([5, 5]), [10], mamba_device_slot=6).node
    with pytest.raises(ValueError, match="must hold 1 pages"):
        tree.attach(other, Tier.HOST, Family.KV, [1, 2])
    tree.protect_host(n)
    with pytest.raises(ValueError, match="host-protected"):
        tree.detach(n, Tier.HOST, Family.KV)
    assert tree.detach(n, Tier.HOST, Family.KV, invalid=True) == (7, 8)
    tree.release_host(n)
    with pytest.raises(ValueError, match="no device state"):
        tree.detach(n, Tier.DEVICE, Family.STATE)
    with pytest.raises(ValueError):
        tree.attach(n, "disk", Family.KV, [1, 2])  # type: ignore[arg-type]
    m = tree.match_prefix(key([1, 2, 3, 4]))
    assert m.device_indices == (3, 4) and m.mamba_on_host == 9
    tree.check_integrity(device=PoolUsage(capacity=11, free=[0, 1, 2, *range(5, 10)]))


def test_unlock_without_lock_names_the_undo() -> None:
    tree = RadixTree(1, has_mamba=False)
    n = tree.insert(key([1, 2]), [0, 1]).node
    with pytest.raises(ValueError, match="unlock"):
        tree.unlock(n)
    with pytest.raises(ValueError, match="release_host"):
        tree.release_host(n)
    tree.lock(n)
    tree.unlock(n)
    assert n.lock_ref == 0
    tree.check_integrity()


def test_page_hashes_are_lazy_and_chained() -> None:
    tree = RadixTree(2, has_mamba=False)
    a = tree.insert(key([1, 2, 3, 4, 5, 6]), [0, 1, 2]).node
    b = tree.insert(key([1, 2, 3, 4, 7, 8]), [0, 1, 3]).node  # splits a after 2 pages
    assert not any(n.hashes_known for n in tree.iter_nodes())  # insert never hashes
    assert b.last_hash == page_hashes([1, 2, 3, 4, 7, 8], 2)[-1]
    upper = b.parent
    assert upper is not None and upper.hashes_known and not a.hashes_known
    assert upper.hashes == tuple(page_hashes([1, 2, 3, 4], 2))
    assert a.hashes == tuple(page_hashes([1, 2, 3, 4, 5, 6], 2)[2:])
    tree.check_integrity()
    # A split of a node whose hashes are known splits them too.
    c = tree.insert(key([1, 2, 3, 4, 5, 6, 9, 9]), [0, 1, 2, 4]).node
    tree.insert(key([1, 2, 3, 4, 5, 6, 9, 9, 1, 1]), [0, 1, 2, 4, 5])
    assert c.last_hash == page_hashes([1, 2, 3, 4, 5, 6, 9, 9], 2)[-1]
    tree.check_integrity()
    a._hashes = (bytes(32),)
    with pytest.raises(RuntimeError, match="wrong page hashes"):
        tree.check_integrity()


def test_node_at_is_a_read_only_exact_lookup() -> None:
    tree = RadixTree(2, has_mamba=False)
    n = tree.insert(key([1, 2, 3, 4]), [0, 1]).node
    clock = tree.clock
    assert tree.node_at(key([1, 2, 3, 4, 5])) is n
    assert tree.node_at(key([1, 2])) is None  # inside a node: no split
    assert tree.node_at(key([1, 2, 3, 4], "other")) is None
    assert tree.clock == clock and tree.num_nodes == 1


class _MRUPolicy(EvictionPolicy):
    """Most recently used first: a touch makes a node an earlier victim (not monotone)."""

    monotone = False

    def priority(self, stats: NodeStats, target: EvictTarget) -> tuple[int | float, ...]:
        return (-stats.last_access,)


@pytest.mark.parametrize("policy", [LRUPolicy(), _LFUPolicy(), _MRUPolicy()])
def test_eviction_order_equals_brute_force_min(policy: EvictionPolicy) -> None:
    # The queues re-rank touched nodes lazily; every victim must still be the candidate
    # with the smallest (priority, id) over the whole tree at the time of the call.
    tree = RadixTree(1, has_mamba=True, policy=policy)
    rng = random.Random(3)
    pages = itertools.count()
    slots = itertools.count()
    for step in range(400):
        toks = [rng.randrange(3) for _ in range(rng.randrange(1, 7))]
        op = rng.random()
        if op < 0.4:
            tree.insert(key(toks), [next(pages) for _ in toks], mamba_device_slot=next(slots))
        elif op < 0.7:
            tree.match_prefix(key(toks))
        else:
            target = EvictTarget.DEVICE_KV if op < 0.85 else EvictTarget.MAMBA_DEVICE
            cands = [n for n in tree.iter_nodes() if is_candidate(n, target)]
            if not cands:
                continue
            stats = [
                NodeStats(n.last_access, n.hit_count, n.num_tokens, n.has_mamba_state)
                for n in cands
            ]
            want = min(
                zip(cands, stats, strict=True),
                key=lambda c: (*policy.priority(c[1], target), c[0].id),
            )[0]
            if target is EvictTarget.DEVICE_KV:
                expected = want.device_indices
                assert tree.evict_device(1).device_pages[: len(expected)] == expected, step
            else:
                slot = want.mamba_device_slot
                assert tree.evict_mamba_device(1).mamba_device_slots[0] == slot, step
        if step % 20 == 0:
            tree.check_integrity()
    tree.check_integrity()


def test_sorted_queue_runs_split_and_drain() -> None:
    # Many entries: runs split (more than 2 * _RUN) and empty runs go; order always holds.
    from mesh_hicache.radix.queues import _RUN, _SortedEntries

    rng = random.Random(5)
    queue = _SortedEntries()
    held: list[tuple[int, int, None]] = []
    for i in range(6 * _RUN):
        entry = (rng.randrange(50), i, None)
        queue.add(entry)
        held.append(entry)
    assert len(queue.runs) > 2 and queue.size == len(held)
    assert list(queue) == sorted(held)
    for entry in rng.sample(held, len(held) // 2):
        queue.remove(entry)
        held.remove(entry)
    assert list(queue) == sorted(held) and queue.maxes == [run[-1] for run in queue.runs]
    while (first := queue.first()) is not None:
        assert first == min(held)
        queue.remove(first)
        held.remove(first)
    assert queue.size == 0 and queue.runs == [] and queue.maxes == []
