"""RadixTree with pages whose windowed K/V is absent (``TreeNode.window_missing``): a hit
never ends at a boundary whose needed windowed pages are absent; splits and copies keep
the per-node sets; trees without gaps behave exactly as trees without windows."""

from __future__ import annotations

import itertools
import random

import pytest

from mesh_hicache.radix import Family, MatchResult, RadixKey, RadixTree, Tier, TreeNode
from mesh_hicache.radix.window import boundary_pages, deepest_window_end, resumable
from mesh_hicache.spec import WindowSpec

PS = 4


def key(tokens: list[int] | range, ns: str = "") -> RadixKey:
    return RadixKey(tuple(tokens), ns)


def group(window: int, sinks: int = 0) -> WindowSpec:
    return WindowSpec(layer_ids=(0,), window=window, sink_tokens=sinks)


def tree_with(window: int = 8, sinks: int = 0, has_mamba: bool = False) -> RadixTree:
    return RadixTree(PS, has_mamba, windows=(group(window, sinks),))


def pages(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


A = list(range(100, 132))  # 8 pages


def test_match_end_inside_a_node_splits_there_when_resumable() -> None:
    tree = tree_with(window=8)
    tree.insert(key(A), pages(0, 8), window_missing=[7])
    # Ends inside the node after 6 pages: the window [17, 24) lies in pages 4-5, present.
    m = tree.match_prefix(key(A[:24] + [1] * 8))
    assert m.usable_len == m.raw_kv_len == 24 and m.device_indices == tuple(pages(0, 6))
    assert m.last_node.num_tokens == 24 and m.window_missing == frozenset()
    assert [n.window_missing for n in tree.iter_nodes()] == [frozenset(), {1}]
    # The whole key needs pages 6-7 (page 7 absent): cut back to the deepest page
    # boundary that has its window, 28 (pages 5-6), splitting the node there.
    m = tree.match_prefix(key(A))
    assert m.raw_kv_len == 32 and m.usable_len == 28 and m.nodes[-1].num_tokens == 4
    assert m.window_missing == frozenset()
    tree.check_integrity()


def test_cut_back_to_a_node_end() -> None:
    tree = tree_with(window=8)
    tree.insert(key(A[:16]), pages(0, 4))
    # The second node lacks every windowed page: 28 down to 20 each need one of them.
    tree.insert(key(A), pages(10, 8), window_missing=[4, 5, 6, 7])
    m = tree.match_prefix(key(A + [5]))
    assert m.raw_kv_len == 32 and m.usable_len == 16 and m.device_indices == tuple(pages(0, 4))
    assert m.last_node is tree.node_at(key(A[:16]))
    tree.check_integrity()


def test_cut_to_a_miss_without_splitting() -> None:
    tree = tree_with(window=8)
    tree.insert(key(A), pages(0, 8), window_missing=list(range(8)))
    # Ends at the node's end, and inside it: no page boundary has its window.
    for probe, raw in ((A, 32), (A[:28] + [1] * 4, 28)):
        m = tree.match_prefix(key(probe))
        assert m.usable_len == 0 and m.last_node.is_sentinel and m.nodes == ()
        assert m.device_indices == () and m.window_missing == frozenset()
        assert m.raw_kv_len == raw
        assert tree.num_nodes == 1  # no split at a point that is not used
    tree.check_integrity()


@pytest.mark.parametrize(("window", "usable"), [(9, 24), (10, 12)])
def test_window_edge_on_a_page_edge_and_one_token_past(window: int, usable: int) -> None:
    # b = 24: window 9 reads from token 16 (page 4's first), window 10 from token 15
    # (page 3's last), which is absent; so do 20 and 16, and 12 reads pages 0-2.
    tree = tree_with(window=window)
    tree.insert(key(A), pages(0, 8), window_missing=[3])
    m = tree.match_prefix(key(A[:24] + [1] * 4))
    assert m.raw_kv_len == 24 and m.usable_len == usable
    assert m.window_missing == (frozenset({3}) if usable > 12 else frozenset())


@pytest.mark.parametrize(
    ("sinks", "missing", "usable"), [(0, 0, 32), (2, 0, 0), (4, 0, 0), (4, 1, 32), (5, 1, 4)]
)
def test_sink_pages_absent(sinks: int, missing: int, usable: int) -> None:
    # Window 4 at b = 32 reads page 7 only; the sinks read tokens [0, sinks) (at b = 4,
    # five sinks read page 0 only).
    tree = tree_with(window=4, sinks=sinks)
    tree.insert(key(A), pages(0, 8), window_missing=[missing])
    m = tree.match_prefix(key(A))
    assert m.usable_len == usable
    assert m.window_missing == ({missing} if usable > 4 * (missing + 1) else frozenset())


def test_sinks_present_allow_the_hit() -> None:
    tree = tree_with(window=4, sinks=4)
    tree.insert(key(A), pages(0, 8), window_missing=[1, 2, 3, 4, 5, 6])
    m = tree.match_prefix(key(A))
    assert m.usable_len == 32 and m.window_missing == frozenset(range(1, 7))


def test_mamba_only_state_holding_node_ends() -> None:
    tree = tree_with(window=8, has_mamba=True)
    tree.insert(key(A[:16]), pages(0, 4), mamba_device_slot=0)
    tree.insert(key(A), pages(10, 8), mamba_device_slot=1, window_missing=[7])
    # A node end at 24 without a state (resumable by the window rule, not by Mamba's).
    tree.insert(key(A[:24]), pages(20, 6))
    assert [n.num_tokens for n in tree.iter_nodes()] == [16, 8, 8]
    m = tree.match_prefix(key(A))
    assert m.raw_kv_len == 32 and m.usable_len == 16 and m.mamba_on_device == 0
    # A match ending inside a node never splits it with Mamba.
    m = tree.match_prefix(key(A[:28] + [1] * 4))
    assert m.usable_len == 16 and tree.num_nodes == 3
    # Without the state at 16 nothing is usable.
    tree.evict_mamba_device(2)
    assert tree.match_prefix(key(A)).usable_len == 0
    tree.check_integrity()


def test_mamba_deepest_state_is_kept_when_resumable() -> None:
    tree = tree_with(window=8, has_mamba=True)
    tree.insert(key(A), pages(0, 8), mamba_device_slot=0, window_missing=[2])
    m = tree.match_prefix(key(A))
    assert m.usable_len == 32 and m.mamba_on_device == 0 and m.window_missing == {2}


def test_split_partitions_the_set() -> None:
    tree = tree_with(window=8)
    tree.insert(key(A), pages(0, 8), window_missing=[1, 6])
    b = A[:16] + list(range(500, 516))
    r = tree.insert(key(b), pages(10, 8))
    assert r.num_existing_pages == 4 and r.node.window_missing == frozenset()
    upper = tree.node_at(key(A[:16]))
    lower = tree.node_at(key(A))
    assert upper is not None and lower is not None
    assert upper.window_missing == {1} and lower.window_missing == {2}
    m = tree.match_prefix(key(A))  # 32 and 28 need page 6: back to 24 (pages 4-5)
    assert m.usable_len == 24 and m.window_missing == {1}
    m = tree.match_prefix(key(b))
    assert m.usable_len == 32 and m.window_missing == {1}
    tree.check_integrity()


def test_copy_attached_by_insert_keeps_its_gaps_per_tier() -> None:
    tree = tree_with(window=8)
    tree.insert(key(A[:16]), pages(0, 4))
    # A host copy of the whole key with gaps: the device-only node takes it (host gap 1,
    # its device copy stays complete), the new host-only node gets its own offsets
    # (page 5 -> offset 1) on both names.
    r = tree.insert(key(A), host_indices=pages(10, 8), window_missing=[1, 5])
    assert r.unused_host_indices == ()
    node = tree.node_at(key(A[:16]))
    assert node is not None
    assert node.window_missing == set() and node.host_window_missing == {1}
    assert r.node.window_missing == r.node.host_window_missing == {1}
    # Given indices not taken change nothing.
    r = tree.insert(key(A), pages(20, 8), host_indices=pages(30, 8), window_missing=[0, 7])
    assert r.unused_host_indices == tuple(pages(30, 8))
    assert r.unused_device_indices == tuple(pages(20, 4))
    assert node.window_missing == set() and node.host_window_missing == {1}
    # The host-only node took the device copy: its gaps (page 7 -> offset 3) replace the
    # host copy's for a match; the host copy keeps its own.
    assert r.node.window_missing == {3} and r.node.host_window_missing == {1}
    tree.check_integrity()


def test_host_tail_insert_gaps_are_pages_of_the_key() -> None:
    tree = tree_with(window=8)
    tree.insert(key(A[:16]), pages(0, 4))
    r = tree.insert(key(A), host_indices=pages(10, 4), host_first_page=4, window_missing=[6])
    assert r.node.window_missing == {2}
    with pytest.raises(ValueError, match=r"\[4, 8\)"):
        tree.insert(key(A), host_indices=pages(10, 4), host_first_page=4, window_missing=[3])


def test_validation() -> None:
    with pytest.raises(ValueError, match="without windows"):
        RadixTree(PS, False).insert(key(A), pages(0, 8), window_missing=[1])
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        tree_with().insert(key(A), pages(0, 8), window_missing=[8])
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        tree_with().insert(key(A), pages(0, 8), window_missing=[-1])
    with pytest.raises(TypeError, match="WindowSpec"):
        RadixTree(PS, False, windows=(8,))  # type: ignore[arg-type]
    tree = RadixTree(PS, False, windows=[group(8)])
    assert tree.windows == (group(8),)
    assert tree.insert(key(A), pages(0, 8), window_missing=()).node.window_missing == set()


def test_integrity_checks_the_sets() -> None:
    tree = tree_with()
    r = tree.insert(key(A), pages(0, 8), window_missing=[2])
    tree.check_integrity()
    r.node.window_missing = frozenset({8})
    with pytest.raises(RuntimeError, match="outside its pages"):
        tree.check_integrity()
    plain = RadixTree(PS, False)
    r = plain.insert(key(A), pages(0, 8))
    r.node.window_missing = frozenset({2})
    with pytest.raises(RuntimeError, match="without windows"):
        plain.check_integrity()


def test_digest_covers_the_sets() -> None:
    t1, t2 = tree_with(), tree_with()
    t1.insert(key(A), pages(0, 8), window_missing=[2])
    t2.insert(key(A), pages(0, 8))
    assert t1.digest() != t2.digest()
    t3 = RadixTree(PS, False)
    t3.insert(key(A), pages(0, 8))
    assert t2.digest() == t3.digest()


def test_deepest_window_end_rule() -> None:
    g = (group(8),)
    # Nodes at pages 0 and 4; the second lacks its offset 3 (page 7).
    assert deepest_window_end([0, 4], [set(), {3}], [32, 16], PS, g) == (16, frozenset())
    assert deepest_window_end([0, 4], [{1}, {3}], [32, 16], PS, g) == (16, {1})
    assert deepest_window_end([0, 4], [set(), {1}], [32, 16], PS, g) == (32, {5})
    assert deepest_window_end([0], [{3}], [16], PS, g) == (0, frozenset())


# ------------------------------------------------------------ gaps kept per tier


def test_backup_with_gaps_keeps_device_hits_then_host_gaps_rule() -> None:
    tree = tree_with(window=8)
    node = tree.insert(key(A), pages(0, 8)).node
    # The host copy keeps only what a resume at the node's end needs (pages 6-7).
    tree.attach(node, Tier.HOST, Family.KV, pages(10, 8), window_missing=range(6))
    assert node.window_missing == set() and node.host_window_missing == set(range(6))
    tree.check_integrity()
    # The device copy is complete: a hit at 24 (needs pages 4-5) is served from it.
    m = tree.match_prefix(key(A[:24] + [1] * 4))
    assert m.usable_len == 24 and m.device_len == 24 and m.window_missing == set()
    upper, lower = tree.iter_nodes()
    assert upper.host_window_missing == set(range(6)) and lower.host_window_missing == set()
    assert tree.match_prefix(key(A)).usable_len == 32
    # Without the device copies a match reads the host copies: 24 needs absent pages.
    assert tree.evict_device(8).device_pages == tuple(pages(6, 2)) + tuple(pages(0, 6))
    assert upper.window_missing == set(range(6)) and lower.window_missing == set()
    tree.check_integrity()
    m = tree.match_prefix(key(A[:24] + [1] * 4))
    assert m.raw_kv_len == 24 and m.usable_len == 0
    m = tree.match_prefix(key(A))
    assert m.usable_len == m.host_len == 32 and m.window_missing == set(range(6))


def test_load_adds_the_host_gaps_to_the_device_copy() -> None:
    tree = tree_with(window=8)
    node = tree.insert(key(A), host_indices=pages(0, 8), window_missing=[2]).node
    assert node.window_missing == node.host_window_missing == {2}
    tree.attach(node, Tier.DEVICE, Family.KV, pages(10, 8), window_missing=[5])
    assert node.window_missing == {2, 5} and node.host_window_missing == {2}
    tree.check_integrity()
    assert tree.detach(node, Tier.DEVICE, Family.KV) == tuple(pages(10, 8))
    assert node.window_missing == {2}
    tree.attach(node, Tier.DEVICE, Family.KV, pages(10, 8))
    assert node.window_missing is node.host_window_missing
    tree.check_integrity()


def test_insert_recomputing_a_host_only_node_gives_a_complete_device_copy() -> None:
    tree = tree_with(window=8)
    node = tree.insert(key(A), host_indices=pages(0, 8), window_missing=range(6)).node
    assert tree.match_prefix(key(A)).host_len == 32
    assert tree.match_prefix(key(A[:24] + [1] * 4)).usable_len == 0
    r = tree.insert(key(A), pages(10, 8))
    assert r.node is node and r.unused_device_indices == ()
    assert node.window_missing == set() and node.host_window_missing == set(range(6))
    m = tree.match_prefix(key(A[:24] + [1] * 4))
    assert m.usable_len == m.device_len == 24 and m.window_missing == set()
    tree.check_integrity()


def test_dropping_the_host_copy_clears_its_gaps() -> None:
    tree = tree_with(window=8)
    node = tree.insert(key(A), pages(0, 8), window_missing=[3]).node
    tree.attach(node, Tier.HOST, Family.KV, pages(10, 8), window_missing=[1, 3])
    assert tree.evict_host(8).host_pages == tuple(pages(10, 8))
    assert node.window_missing == {3} and node.host_window_missing == set()
    tree.check_integrity()
    # A backup that failed (``invalid``) even while host-protected.
    tree.attach(node, Tier.HOST, Family.KV, pages(10, 8), window_missing=[0])
    tree.protect_host(node)
    tree.detach(node, Tier.HOST, Family.KV, invalid=True)
    assert node.window_missing == {3} and node.host_window_missing == set()
    tree.release_host(node)
    tree.check_integrity()
    # Both copies given to insert lack the same pages; evicting the host keeps the device's.
    b = tree.insert(key(list(range(700, 716))), pages(20, 4), pages(30, 4), window_missing=[2])
    assert b.node.window_missing == b.node.host_window_missing == {2}
    tree.evict_host(8)
    assert b.node.window_missing == {2} and b.node.host_window_missing == set()
    tree.check_integrity()


def test_split_divides_both_sets() -> None:
    tree = tree_with(window=8)
    node = tree.insert(key(A), pages(0, 8), window_missing=[7]).node
    tree.attach(node, Tier.HOST, Family.KV, pages(10, 8), window_missing=[1, 6])
    tree.insert(key(A[:16] + list(range(500, 516))), pages(20, 8))
    upper = tree.node_at(key(A[:16]))
    assert upper is not None and upper.host_window_missing == {1}
    assert upper.window_missing == set()
    assert node.window_missing == {3} and node.host_window_missing == {2}
    # A host-only node: both names stay one set on each part.
    c = list(range(800, 832))
    host_only = tree.insert(key(c), host_indices=pages(40, 8), window_missing=[1, 6]).node
    tree.insert(key(c[:16]), host_indices=pages(50, 4))
    top = tree.node_at(key(c[:16]))
    assert top is not None and top.window_missing == {1} and host_only.window_missing == {2}
    for n in (top, host_only):
        assert n.window_missing is n.host_window_missing
    tree.check_integrity()


def test_attach_validation() -> None:
    tree = tree_with(window=8, has_mamba=True)
    node = tree.insert(key(A), pages(0, 8)).node
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        tree.attach(node, Tier.HOST, Family.KV, pages(10, 8), window_missing=[8])
    with pytest.raises(ValueError, match="KV copies"):
        tree.attach(node, Tier.HOST, Family.STATE, [0], window_missing=[1])
    assert node.host_indices is None and node.mamba_host_slot is None
    plain = RadixTree(PS, False)
    node = plain.insert(key(A), pages(0, 8)).node
    with pytest.raises(ValueError, match="without windows"):
        plain.attach(node, Tier.HOST, Family.KV, pages(10, 8), window_missing=[1])
    plain.attach(node, Tier.HOST, Family.KV, pages(10, 8), window_missing=())
    plain.check_integrity()


def test_integrity_checks_the_host_sets() -> None:
    tree = tree_with()
    dev_only = tree.insert(key(A), pages(0, 8)).node
    both = tree.insert(key(range(200, 216)), pages(10, 4), pages(20, 4)).node
    host_only = tree.insert(key(range(300, 316)), host_indices=pages(30, 4)).node
    tree.check_integrity()
    cases = [
        (both, "host_window_missing", {4}, "outside its pages"),
        (dev_only, "host_window_missing", {1}, "without a host copy"),
        (host_only, "window_missing", {1}, "host-only"),
        (host_only, "host_window_missing", {1}, "host-only"),
    ]
    for node, attr, value, message in cases:
        setattr(node, attr, frozenset(value))
        with pytest.raises(RuntimeError, match=message):
            tree.check_integrity()
        setattr(node, attr, frozenset())
        tree.check_integrity()
    plain = RadixTree(PS, False)
    r = plain.insert(key(A), pages(0, 8), pages(10, 8))
    r.node.host_window_missing = frozenset({2})
    with pytest.raises(RuntimeError, match="host windowed pages in a tree without windows"):
        plain.check_integrity()


def test_digest_covers_the_host_sets() -> None:
    t1, t2, t3 = tree_with(), tree_with(), RadixTree(PS, False)
    for t, gaps in ((t1, [2]), (t2, []), (t3, [])):
        node = t.insert(key(A), pages(0, 8)).node
        t.attach(node, Tier.HOST, Family.KV, pages(10, 8), window_missing=gaps)
    assert t1.digest() != t2.digest() == t3.digest()


# ------------------------------------------------------------------ random operations


def _summary(m: MatchResult) -> tuple:
    return (
        m.device_indices,
        m.host_indices,
        m.device_len,
        m.host_len,
        m.raw_kv_len,
        m.mamba_on_device,
        m.mamba_on_host,
        tuple(n.id for n in m.nodes),
        m.window_missing,
    )


class Driver:
    """Random inserts, matches, backups, loads and evictions on one tree, over keys
    sharing prefixes.

    ``gaps``: whether inserts, backups and loads declare absent windowed pages. Every
    physical page handed out, per tier, is recorded as lacking windowed K/V or not (a
    backup often keeps only a few windowed pages; a load lacks what the host page lacked).
    After each step every node's ``window_missing`` must be exactly the lacking pages of
    the copy a match reads (device, else host) and ``host_window_missing`` those of its
    host copy; every match is checked from the pages it returns: its usable end must be
    resumable given those of its pages that lack windowed K/V (``window.resumable``), and
    ``window_missing`` must name exactly them."""

    def __init__(self, tree: RadixTree, seed: int, gaps: bool) -> None:
        self.tree = tree
        self.rng = random.Random(seed)
        self.gaps = gaps
        self.next_page = itertools.count()
        self.next_slot = itertools.count()
        self.lacking: dict[tuple[str, int], bool] = {}  # (tier, page) -> lacks windowed KV
        docs = random.Random(1000 + seed)
        self.docs = [[docs.randrange(4) for _ in range(12 * PS)] for _ in range(3)]

    def tokens(self) -> list[int]:
        rng = self.rng
        doc = rng.choice(self.docs)
        n = rng.randrange(1, len(doc) + 1)
        tail = [rng.randrange(4, 6) for _ in range(rng.randrange(0, 2 * PS))]
        return doc[:n] + tail

    def take(self, tier: str, n: int, missing: set[int], first: int = 0) -> list[int]:
        out = [next(self.next_page) for _ in range(n)]
        for i, p in enumerate(out):
            self.lacking[(tier, p)] = first + i in missing
        return out

    def insert(self) -> None:
        rng, tree = self.rng, self.tree
        toks = self.tokens()
        n = len(toks) // PS
        first = rng.randrange(n + 1) if n and rng.random() < 0.2 else 0
        missing = {i for i in range(first, n) if self.gaps and rng.random() < 0.1}
        tiers = rng.choice([("device",), ("host",), ("device", "host")]) if not first else ()
        dev = self.take("device", n, missing) if "device" in tiers else None
        host = self.take("host", n - first, missing, first) if first or "host" in tiers else None
        slot = next(self.next_slot) if tree.has_mamba and rng.random() < 0.6 else None
        tree.insert(
            key(toks),
            dev,
            host,
            mamba_device_slot=slot if dev is not None else None,
            mamba_host_slot=slot if dev is None else None,
            host_first_page=first,
            window_missing=missing,
        )

    def backup(self) -> None:
        """A host copy of a device-only node that, like L2, often keeps only the windowed
        pages a resume at the node's end needs."""
        nodes = [n for n in self.tree.iter_nodes() if n.host_indices is None]
        if nodes:
            node = self.rng.choice(nodes)
            start = node.prefix_len // PS - node.num_pages
            keep = {p - start for g in GROUPS for p in boundary_pages(node.prefix_len, PS, g)}
            missing = {
                i
                for i in range(node.num_pages)
                if self.gaps and i not in keep and self.rng.random() < 0.7
            }
            host = self.take("host", node.num_pages, missing)
            self.tree.attach(node, Tier.HOST, Family.KV, host, window_missing=missing)

    def load(self) -> None:
        """A device copy of a host-only node below the device part of the tree."""
        nodes = [
            n
            for n in self.tree.iter_nodes()
            if n.device_indices is None
            and (n.parent is None or n.parent.is_sentinel or n.parent.on_device)
        ]
        if nodes:
            node = self.rng.choice(nodes)
            assert node.host_indices is not None
            extra = {i for i in range(node.num_pages) if self.gaps and self.rng.random() < 0.1}
            dev = self.take("device", node.num_pages, extra)
            for d, h in zip(dev, node.host_indices, strict=True):
                self.lacking[("device", d)] |= self.lacking[("host", h)]
            self.tree.attach(node, Tier.DEVICE, Family.KV, dev, window_missing=extra)

    def check_nodes(self) -> None:
        for node in self.tree.iter_nodes():
            per_tier = {}
            for tier, idx in (("device", node.device_indices), ("host", node.host_indices)):
                gaps = {i for i, p in enumerate(idx or ()) if self.lacking[(tier, p)]}
                per_tier[tier] = gaps
            read = "device" if node.device_indices is not None else "host"
            assert node.window_missing == per_tier[read]
            assert node.host_window_missing == per_tier["host"]

    def match(self) -> MatchResult:
        m = self.tree.match_prefix(key(self.tokens()))
        returned = [("device", p) for p in m.device_indices]
        returned += [("host", p) for p in m.host_indices]
        assert len(returned) * PS == m.usable_len
        lacking = {i for i, page in enumerate(returned) if self.lacking[page]}
        present = set(range(len(returned))) - lacking
        assert resumable(m.usable_len, present, PS, self.tree.windows)
        assert lacking == m.window_missing
        if not self.gaps:
            assert m.window_missing == frozenset()
        return m

    def step(self) -> MatchResult | None:
        rng, tree = self.rng, self.tree
        op = rng.random()
        if op < 0.3:
            self.insert()
        elif op < 0.65:
            return self.match()
        elif op < 0.72:
            self.backup()
        elif op < 0.78:
            self.load()
        elif op < 0.87:
            tree.evict_device(rng.randrange(1, 6))
        elif op < 0.96:
            tree.evict_host(rng.randrange(1, 6))
        elif tree.has_mamba:
            tree.evict_mamba_device(1)
        tree.check_integrity()
        self.check_nodes()
        return None


GROUPS = (group(6), group(9, sinks=2))


@pytest.mark.parametrize("has_mamba", [False, True])
def test_random_operations_only_resumable_hits(has_mamba: bool) -> None:
    hits = gaps = over_host_gaps = host_gaps = 0
    for seed in range(4):
        driver = Driver(RadixTree(PS, has_mamba, windows=GROUPS), seed, gaps=True)
        for _ in range(400):
            m = driver.step()
            if m is not None:
                hits += m.usable_len > 0
                gaps += m.window_missing != frozenset()
                over_host_gaps += any(n.on_device and n.host_window_missing for n in m.nodes)
                host_gaps += any(not n.on_device and n.window_missing for n in m.nodes)
    # Hits, hits over absent pages, device hits a union over the tiers would have cut,
    # and hits read from host copies with gaps were all reached.
    assert hits > 100 and gaps > 20 and over_host_gaps > 20 and host_gaps > 0


@pytest.mark.parametrize("has_mamba", [False, True])
def test_no_gaps_behaves_as_without_windows(has_mamba: bool) -> None:
    plain = Driver(RadixTree(PS, has_mamba), 5, gaps=False)
    windowed = Driver(RadixTree(PS, has_mamba, windows=GROUPS), 5, gaps=False)
    for _ in range(400):
        a, b = plain.step(), windowed.step()
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert _summary(a) == _summary(b)
    assert plain.tree.digest() == windowed.tree.digest()
    assert all(n.window_missing == frozenset() for n in windowed.tree.iter_nodes())


def test_empty_sets_are_shared() -> None:
    tree = tree_with()
    tree.insert(key(A), pages(0, 8), window_missing=[3])
    tree.insert(key(A[:8] + [1] * 8), pages(10, 4))
    empties = [n.window_missing for n in tree.iter_nodes() if not n.window_missing]
    empties.append(TreeNode(0, "", None, b"", 0).window_missing)
    assert len(empties) >= 2 and all(e is empties[0] for e in empties)
