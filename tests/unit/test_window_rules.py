"""Windowed-KV rules (mesh_hicache.radix.window) and the WindowSpec declaration: the pages
a boundary needs at and inside a window edge, sinks, freeable pages on a path with several
boundaries, the hit rule, and the per-node needs and bytes over a real radix tree."""

from __future__ import annotations

import pytest
import torch

from mesh_hicache.radix import RadixKey, RadixTree
from mesh_hicache.radix.window import (
    boundary_pages,
    deepest_resumable,
    freeable_pages,
    held_bytes,
    live_pages,
    needed_tokens,
    resumable,
    tree_window_pages,
)
from mesh_hicache.spec import KVSpec, StateSpec, WindowSpec


def group(window: int, sinks: int = 0, layers: tuple[int, ...] = (0,)) -> WindowSpec:
    return WindowSpec(layer_ids=layers, window=window, sink_tokens=sinks)


def brute_pages(boundary: int, ps: int, window: int, sinks: int) -> set[int]:
    """From the attention mask itself: the cached key positions any query at a position
    >= boundary can see (query q sees q - window < k <= q, and k < sinks)."""
    seen = set()
    for q in range(boundary, boundary + 3 * window + 3):
        for k in range(boundary):
            if q - window < k <= q or k < sinks:
                seen.add(k // ps)
    return seen


@pytest.mark.parametrize("ps", [1, 3, 4, 16])
@pytest.mark.parametrize("window", [1, 2, 7, 8, 9, 16])
@pytest.mark.parametrize("sinks", [0, 1, 4, 5])
def test_boundary_pages_equal_the_mask(ps: int, window: int, sinks: int) -> None:
    for b in range(0, 5 * ps + window + 2):
        assert boundary_pages(b, ps, group(window, sinks)) == brute_pages(b, ps, window, sinks)


def test_window_edge_exact_and_inside() -> None:
    ps = 4
    # b=12, W=9: the first needed key is 12 - 9 + 1 = 4, exactly page 1's start.
    assert boundary_pages(12, ps, group(9)) == {1, 2}
    # W=10: the first key 3 lies inside page 0, which is then needed whole.
    assert boundary_pages(12, ps, group(10)) == {0, 1, 2}
    # A boundary inside a page (b=9, W=8): positions 2..8 -> pages 0, 1, 2.
    assert boundary_pages(9, ps, group(8)) == {0, 1, 2}
    # A boundary shorter than the window needs everything before it.
    assert boundary_pages(8, ps, group(128)) == {0, 1}
    assert boundary_pages(0, ps, group(8)) == frozenset()


def test_sinks() -> None:
    ps = 4
    assert needed_tokens(16, group(8, sinks=2)) == ((0, 2), (9, 16))
    assert boundary_pages(16, ps, group(8, sinks=2)) == {0, 2, 3}
    # Sinks reaching into the window: one range.
    assert needed_tokens(8, group(4, sinks=6)) == ((0, 8),)
    # Sinks longer than the boundary.
    assert needed_tokens(3, group(2, sinks=10)) == ((0, 3),)


def test_freeable_pages_on_a_path_with_two_boundaries() -> None:
    ps, g = 4, group(8)
    assert live_pages([8, 24], ps, g) == {0, 1, 4, 5}
    assert freeable_pages(6, [8, 24], ps, g) == (2, 3)
    # Dropping the boundary at 8 frees its pages too.
    assert freeable_pages(6, [24], ps, g) == (0, 1, 2, 3)
    # With a sink token, page 0 stays for every boundary.
    assert freeable_pages(6, [24], ps, group(8, sinks=1)) == (1, 2, 3)


def test_hit_needs_every_group() -> None:
    ps = 4
    local, wide = group(4, layers=(0,)), group(14, layers=(2,))
    present = {3, 4, 5}
    assert resumable(24, present, ps, [local])  # needs [21, 24) -> page 5
    assert not resumable(24, present, ps, [local, wide])  # wide needs [11, 24): pages 2..5
    assert resumable(24, present | {2}, ps, [wide])
    assert not resumable(24, present, ps, [group(4, sinks=1)])  # sink page 0 missing


def test_deepest_resumable_boundary_on_a_path() -> None:
    ps, g = 4, group(8)
    # Pages 0..7 of a path; the windowed rows of pages 2, 3 were freed (no boundary at 16).
    present = {0, 1, 4, 5, 6, 7}
    assert deepest_resumable([8, 16, 24, 32], present, ps, [g]) == 32
    # Without page 7, 32 is out (needs [25, 32): pages 6, 7); 24 needs 4, 5: held.
    assert deepest_resumable([8, 16, 24, 32], present - {7}, ps, [g]) == 24
    # 16 needs pages 2, 3: never resumable here; 8 needs 0, 1.
    assert deepest_resumable([8, 16], present, ps, [g]) == 8
    assert deepest_resumable([16], present, ps, [g]) == 0


def test_window_spec_validation() -> None:
    kv = KVSpec(layer_ids=(0, 1, 2, 3), num_kv_heads=2, head_dim=4)
    spec = StateSpec(page_size=4, kv=kv, windows=(group(8, layers=(0, 2)),), model_id="window-test")
    assert spec.layer_window(2) == group(8, layers=(0, 2))
    assert spec.layer_window(1) is None
    with pytest.raises(ValueError, match="kv"):
        StateSpec(page_size=4, kv=kv, windows=(group(8, layers=(4,)),), model_id="x")
    with pytest.raises(ValueError, match="overlap"):
        StateSpec(
            page_size=4,
            kv=kv,
            windows=(group(8, layers=(0,)), group(4, layers=(0, 1))),
            model_id="x",
        )
    with pytest.raises(ValueError, match="window"):
        WindowSpec(layer_ids=(0,), window=0)
    with pytest.raises(ValueError, match="sink_tokens"):
        WindowSpec(layer_ids=(0,), window=4, sink_tokens=-1)


def test_tree_needs_and_bytes() -> None:
    ps = 4
    tree = RadixTree(ps, has_mamba=False)
    a = list(range(100, 132))  # 8 pages
    b = a[:16] + list(range(500, 508))  # shares 4 pages, then 2 of its own
    tree.insert(RadixKey(tuple(a)), device_indices=list(range(8)))
    tree.insert(RadixKey(tuple(b)), device_indices=list(range(8, 14)))
    nodes = {n.prefix_len: n for n in tree.iter_nodes()}
    assert sorted(nodes) == [16, 24, 32]
    g = group(8)
    need = tree_window_pages(tree.iter_nodes(), ps, g)
    # Leaf at 32 needs [25, 32) -> its pages 2, 3 (offsets in the node starting at 16);
    # leaf at 24 needs [17, 24) -> its pages 0, 1 (node starting at 16); the shared node
    # [0, 16) is behind both windows.
    assert need[nodes[32].id] == {2, 3}
    assert need[nodes[24].id] == {0, 1}
    assert need[nodes[16].id] == frozenset()
    # The shared node becomes a boundary too (e.g. it holds a state): its last 7 tokens.
    inner = tree_window_pages(tree.iter_nodes(), ps, g, lambda n: n.prefix_len in (16, 32))
    assert inner[nodes[16].id] == {2, 3}
    kv = KVSpec(layer_ids=(0, 1), num_kv_heads=2, head_dim=4, dtype=torch.float16)
    spec = StateSpec(page_size=ps, kv=kv, windows=(group(8, layers=(1,)),), model_id="w")
    held = held_bytes(tree.iter_nodes(), spec)
    per_layer_page = ps * 2 * 2 * 4 * 2
    # 10 pages held (b's first 4 pages are the shared node's): the full layer keeps all
    # 10, the windowed layer the 4 its two leaves need.
    assert held.tokens == 10 * ps
    assert held.full_bytes == 10 * 2 * per_layer_page
    assert held.window_bytes == (10 + 4) * per_layer_page
    assert held.ratio == pytest.approx(14 / 20)
