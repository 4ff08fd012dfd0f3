"""The storage tier's windowed-page rules (``tiers/window_rule.py``), against an oracle
written from the definition: a query at ``p`` sees keys ``p - window < k <= p`` and
``k < sinks``, so a resume at ``b`` reads tokens ``[b - window + 1, b)`` and the sinks."""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from mesh_hicache.spec import WindowSpec
from mesh_hicache.tiers.window_rule import WindowRule

PS = 4


def oracle_needed(b: int, groups: tuple[WindowSpec, ...]) -> set[int]:
    """Pages a resume at ``b`` tokens reads, token by token."""
    tokens = {t for g in groups for t in range(b) if t > b - g.window or t < g.sink_tokens}
    return {t // PS for t in tokens}


def node(first_page: int, pages: int, missing: frozenset[int] = frozenset()) -> SimpleNamespace:
    end = (first_page + pages) * PS
    return SimpleNamespace(
        prefix_len=end, num_tokens=pages * PS, num_pages=pages, window_missing=missing
    )


def resume_point(
    rule: WindowRule, start: int, n: int, present: Callable[[int], bool], missing: frozenset[int]
) -> int:
    """The deepest L3 hit the storage tier takes (without Mamba): within the limit, the
    deepest end that resumes."""
    ends = range(rule.limit(start, n, present), 0, -1)
    return next((k for k in ends if rule.resumes(start, k, present, missing)), 0)


GROUPS = {
    "window6": (WindowSpec(layer_ids=(0,), window=6),),
    "sinks": (WindowSpec(layer_ids=(0,), window=6, sink_tokens=5),),
    "two_windows": (WindowSpec(layer_ids=(0,), window=6), WindowSpec(layer_ids=(2,), window=11)),
}


def test_one_node_writes_its_end_and_the_checkpoints() -> None:
    rule = WindowRule(GROUPS["window6"], PS, checkpoint_tokens=16)
    # End 40 needs tokens 35..39 (pages 8, 9); checkpoints 16 and 32 pages 2, 3 and 6, 7.
    assert rule.write_offsets(node(0, 10)) == (2, 3, 6, 7, 8, 9)
    # Every page when checkpoint_tokens is 0; never a page the copy lacks.
    assert WindowRule(GROUPS["window6"], PS, 0).write_offsets(node(0, 10)) == tuple(range(10))
    assert rule.write_offsets(node(0, 10, frozenset({2, 8}))) == (3, 6, 7, 9)


@pytest.mark.parametrize("case", sorted(GROUPS))
@pytest.mark.parametrize("every", [0, 8, 16, 28])
def test_checkpoints_survive_any_split(case: str, every: int) -> None:
    """Whatever nodes a path was written as, each node end and each checkpoint up to the
    path's end finds every page it needs stored."""
    groups = GROUPS[case]
    rule = WindowRule(groups, PS, every)
    rng = random.Random(every)
    for _ in range(40):
        total = rng.randrange(1, 30)
        cuts = sorted(rng.sample(range(1, total), rng.randrange(0, min(5, total - 1) + 1)))
        stored: set[int] = set()
        for a, b in zip([0, *cuts], [*cuts, total], strict=True):
            stored |= {a + o for o in rule.write_offsets(node(a, b - a))}
        ends = [*cuts, total]
        step = every or PS
        checkpoints = range(step, total * PS + 1, step)
        for b in [e * PS for e in ends] + list(checkpoints):
            assert oracle_needed(b, groups) <= stored, (total, cuts, b)
        if every == 0:
            assert stored == set(range(total))


def chain(cuts: list[int], total: int) -> list[SimpleNamespace]:
    """The nodes of one path split at ``cuts`` (pages), each linked to its parent."""
    parent = SimpleNamespace(is_sentinel=True, parent=None)
    out = []
    for a, b in zip([0, *cuts], [*cuts, total], strict=True):
        n = node(a, b - a)
        n.parent, n.is_sentinel = parent, False
        out.append(n)
        parent = n
    return out


@pytest.mark.parametrize("case", sorted(GROUPS))
@pytest.mark.parametrize("every", [0, 8, 16, 28])
def test_a_branch_point_is_stored_with_the_node_below_it(case: str, every: int) -> None:
    """A path written as some nodes and later split elsewhere: writing each later node's
    ``start_pages`` as well stores what a resume at every later node end needs; a start
    page is one the checkpoints and sinks do not store, located in its owner."""
    groups = GROUPS[case]
    rule = WindowRule(groups, PS, every)
    rng = random.Random(100 + every)

    def random_cuts(total: int) -> list[int]:
        return sorted(rng.sample(range(1, total), rng.randrange(0, min(5, total - 1) + 1)))

    for _ in range(40):
        total = rng.randrange(1, 30)
        stored: set[int] = set()
        for n in chain(random_cuts(total), total):
            first = n.prefix_len // PS - n.num_pages
            stored |= {first + o for o in rule.write_offsets(n)}
        cuts = random_cuts(total)
        nodes = chain(cuts, total)
        firsts = {id(n): n.prefix_len // PS - n.num_pages for n in nodes}
        sinks = {t // PS for g in groups for t in range(g.sink_tokens)}
        kept = rule.checkpoint_pages(0, total, total * PS + 12) | sinks
        for n in nodes:
            start = n.prefix_len - n.num_tokens
            got = {firsts[id(owner)] + o for owner, o in rule.start_pages(n)}
            for owner, o in rule.start_pages(n):
                assert 0 <= o < owner.num_pages
            assert got == oracle_needed(start, groups) - kept, (cuts, start)
            stored |= got
        for b in cuts:
            assert oracle_needed(b * PS, groups) <= stored, (cuts, b)


def test_deepest_falls_back_to_a_checkpoint() -> None:
    rule = WindowRule(GROUPS["window6"], PS, checkpoint_tokens=16)
    stored = {2, 3, 6, 7, 8, 9}  # the one node [0, 40) above

    def deepest(start: int, n: int, missing: frozenset[int] = frozenset()) -> int:
        return resume_point(rule, start, n, lambda i: start + i in stored, missing)

    assert deepest(0, 10) == 10  # the node end: pages 8, 9
    assert deepest(0, 9) == 9  # 36 needs pages 7, 8
    assert deepest(0, 7) == 4  # 28, 24, 20 need page 5 or 4: back to the checkpoint 16
    assert deepest(0, 3) == 0  # 12, 8 and 4 need page 0 or 1
    # Past the start, pages come from L3; before it from the tree unless missing there.
    assert deepest(5, 2) == 0  # 28 and 24 need page 5, not stored
    assert deepest(6, 1) == 1  # 28 needs 5 (tree) and 6 (L3)
    assert deepest(6, 1, frozenset({5})) == 0


def test_deepest_stops_before_a_lost_checkpoint_page() -> None:
    rule = WindowRule(GROUPS["window6"], PS, checkpoint_tokens=16)
    stored = {0, 1, 2, 6, 7, 8, 9}  # page 3, needed by the checkpoint at 16, was lost
    # The end (40) alone would resume; the rule stops before the checkpoint at 16, so a
    # prefetch never marks page 3 present in the tree.
    assert rule.resumes(0, 10, lambda i: i in stored, frozenset())
    assert rule.limit(0, 10, lambda i: i in stored) == 3  # ends before 16
    assert resume_point(rule, 0, 10, lambda i: i in stored, frozenset()) == 3


def test_kept_missing_keeps_the_end_and_the_checkpoints() -> None:
    rule = WindowRule(GROUPS["window6"], PS, checkpoint_tokens=16)
    assert rule.kept_missing(0, 10) == (0, 1, 4, 5)
    assert rule.kept_missing(5, 4) == (5,)  # end 36 keeps 7, 8; checkpoint 32 keeps 6, 7
    assert WindowRule(GROUPS["window6"], PS, 0).kept_missing(0, 10) == ()
    sinks = WindowRule(GROUPS["sinks"], PS, checkpoint_tokens=16)
    assert sinks.kept_missing(0, 10) == (4, 5)  # sinks: tokens 0..4 are pages 0, 1


@pytest.mark.parametrize("every", [-4, 6])
def test_checkpoint_must_be_a_multiple_of_the_page(every: int) -> None:
    with pytest.raises(ValueError, match="multiple of the page size"):
        WindowRule(GROUPS["window6"], PS, every)
