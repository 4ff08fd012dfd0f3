"""Read-only checks of a radix tree: ``check_integrity`` and ``digest`` (docs/DESIGN.md section 5).

Nothing here mutates the tree (lazily computed page hashes are recomputed locally, never
stored), so a check can run between any two operations without changing what follows.
Both walk the whole tree: O(tree tokens); for tests and debugging.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from mesh_hicache.radix.hashing import packed_page_hashes
from mesh_hicache.radix.node import PoolUsage, TreeNode
from mesh_hicache.radix.queues import candidacy

if TYPE_CHECKING:
    from mesh_hicache.radix.core import TreeCore

_POOLS = ("device", "host", "mamba_device", "mamba_host")


def _fail(msg: str) -> None:
    raise RuntimeError(f"radix integrity: {msg}")


def digest(tree: TreeCore) -> str:
    """SHA-256 hex of the structure and tier state; equal on trees fed the same calls."""
    h = hashlib.sha256()
    h.update(f"ps={tree.page_size};mamba={tree.has_mamba};clock={tree.clock}\n".encode())
    for ns in sorted(tree._roots):
        h.update(f"ns={ns!r}\n".encode())
        stack: list[tuple[TreeNode, int]] = [(tree._roots[ns], 0)]
        while stack:
            node, depth = stack.pop()
            if not node.is_sentinel:
                h.update(node.data)
                h.update(
                    (
                        f"|{depth}|{node.id}|{node.num_pages}|"
                        f"{node.device_indices}|{node.host_indices}|"
                        f"{node.mamba_device_slot}|{node.mamba_host_slot}|"
                        f"{node.lock_ref}|{node.host_ref}|{node.hit_count}|"
                        f"{node.last_access}\n"
                    ).encode()
                )
                if node.window_missing:
                    h.update(f"gaps={sorted(node.window_missing)}\n".encode())
                if node.host_window_missing:
                    h.update(f"host_gaps={sorted(node.host_window_missing)}\n".encode())
            for k in sorted(node.children, reverse=True):
                stack.append((node.children[k], depth + 1))
    return h.hexdigest()


def _check_node(tree: TreeCore, node: TreeNode, parent: TreeNode, key: bytes, ns: str) -> None:
    ps = tree.page_size
    if node.is_sentinel or not node.alive or node.parent is not parent:
        _fail(f"{node!r} is a sentinel, dead, or has a wrong parent link")
    if node.namespace != ns:
        _fail(f"{node!r} is under namespace {ns!r}")
    if not node.num_tokens or node.num_tokens % ps:
        _fail(f"{node!r} holds {node.num_tokens} tokens (page size {ps})")
    if node.first_page(ps) != key:
        _fail(f"{node!r} is keyed by {key!r} but starts with {node.first_page(ps)!r}")
    if node.device_indices is None and node.host_indices is None:
        _fail(f"{node!r} holds no KV on any tier")
    for name, idx in (("device", node.device_indices), ("host", node.host_indices)):
        if idx is not None and len(idx) != node.num_pages:
            _fail(f"{node!r} has {len(idx)} {name} pages for {node.num_pages} pages")
    if node.device_indices is not None and not (
        parent.is_sentinel or parent.device_indices is not None
    ):
        _fail(f"{node!r} is on device but its parent is not")
    if node.lock_ref < 0 or node.host_ref < 0:
        _fail(f"{node!r} has a negative protection count")
    if not parent.is_sentinel and (
        parent.lock_ref < node.lock_ref or parent.host_ref < node.host_ref
    ):
        _fail(f"{node!r} is protected more than its parent {parent!r}")
    if not tree.has_mamba and node.has_mamba_state:
        _fail(f"{node!r} holds a Mamba state in a tree without Mamba")
    for name, gaps in (("", node.window_missing), ("host ", node.host_window_missing)):
        if gaps and not tree.windows:
            _fail(f"{node!r} lacks {name}windowed pages in a tree without windows")
        if any(not 0 <= p < node.num_pages for p in gaps):
            _fail(f"{node!r} lacks {name}windowed pages {sorted(gaps)} outside its pages")
    if node.host_window_missing and node.host_indices is None:
        _fail(
            f"{node!r} lacks host windowed pages {sorted(node.host_window_missing)} "
            "without a host copy"
        )
    if node.device_indices is None and node.window_missing != node.host_window_missing:
        _fail(
            f"{node!r} is host-only but its gaps {sorted(node.window_missing)} are not its "
            f"host copy's {sorted(node.host_window_missing)}"
        )
    for problem in tree._queues.problems(node):
        _fail(f"{node!r}: {problem}")
    if node.hashes_known:
        if not (parent.is_sentinel or parent.hashes_known):
            _fail(f"{node!r} knows its page hashes but its parent does not")
        expected = packed_page_hashes(node.data, ps, ns, parent.last_hash)
        if node.hashes != tuple(expected):
            _fail(f"{node!r} has wrong page hashes")


def _check_pools(owners: dict[str, dict[int, int]], pools: dict[str, PoolUsage | None]) -> None:
    for pool, usage in pools.items():
        if usage is None:
            continue
        used = set(owners[pool])
        seen: set[int] = set()
        for label, group in (("free", list(usage.free)), ("held", list(usage.held))):
            for i in group:
                if i in used:
                    _fail(f"{pool} index {i} is {label} but owned by node {owners[pool][i]}")
                if i in seen:
                    _fail(f"{pool} index {i} is listed twice in free/held")
                seen.add(i)
        everything = used | seen
        if everything != set(range(usage.capacity)):
            missing = sorted(set(range(usage.capacity)) - everything)[:5]
            extra = sorted(everything - set(range(usage.capacity)))[:5]
            _fail(f"{pool} pool leaks {missing} / has out-of-range {extra}")


def check_integrity(tree: TreeCore, pools: dict[str, PoolUsage | None]) -> None:
    """Verify every invariant of ``tree``; ``RuntimeError`` naming the first violation.

    ``pools`` maps "device", "host", "mamba_device", "mamba_host" to the allocator's view
    (or None to skip that pool). See ``RadixTree.check_integrity``.
    """
    owners: dict[str, dict[int, int]] = {pool: {} for pool in _POOLS}

    def own(pool: str, index: int, node: TreeNode) -> None:
        if index in owners[pool]:
            _fail(f"{pool} index {index} owned by nodes {owners[pool][index]} and {node.id}")
        owners[pool][index] = node.id

    num_nodes = num_candidates = 0
    for ns, root in tree._roots.items():
        if not root.is_sentinel or root.parent is not None or root.num_tokens:
            _fail(f"namespace root {ns!r} is not a bare sentinel: {root!r}")
        if root.namespace != ns or not root.alive:
            _fail(f"namespace root {ns!r} is inconsistent: {root!r}")
        if not root.children:
            _fail(f"namespace root {ns!r} has no children (should have been dropped)")
        stack = [root]
        while stack:
            parent = stack.pop()
            device_children = 0
            for key, node in parent.children.items():
                num_nodes += 1
                _check_node(tree, node, parent, key, ns)
                num_candidates += sum(candidacy(node))
                stack.append(node)
                if node.device_indices is not None:
                    device_children += 1
                    for i in node.device_indices:
                        own("device", i, node)
                for i in node.host_indices or ():
                    own("host", i, node)
                if node.mamba_device_slot is not None:
                    own("mamba_device", node.mamba_device_slot, node)
                if node.mamba_host_slot is not None:
                    own("mamba_host", node.mamba_host_slot, node)
            if device_children != parent.num_device_children:
                _fail(
                    f"{parent!r} counts {parent.num_device_children} device children, "
                    f"has {device_children}"
                )
    totals = {
        "num_nodes": (tree.num_nodes, num_nodes),
        "queued candidates": (len(tree._queues), num_candidates),
        "num_device_pages": (tree.num_device_pages, len(owners["device"])),
        "num_host_pages": (tree.num_host_pages, len(owners["host"])),
        "num_mamba_device_slots": (tree.num_mamba_device_slots, len(owners["mamba_device"])),
        "num_mamba_host_slots": (tree.num_mamba_host_slots, len(owners["mamba_host"])),
    }
    for name, (cached, actual) in totals.items():
        if cached != actual:
            _fail(f"cached {name}={cached} but the tree holds {actual}")
    for problem in tree._queues.order_problems():
        _fail(problem)
    _check_pools(owners, pools)
