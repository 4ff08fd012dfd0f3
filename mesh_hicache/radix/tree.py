"""The hybrid radix tree: KV pages and Mamba checkpoints per tier (DESIGN.md section 5).

Structure: one sentinel root per namespace; below it, nodes that each hold a run of whole
pages (``page_size`` tokens each), keyed in their parent by the tokens of their first page.

Invariants (``check_integrity`` verifies them):

- every non-sentinel node holds a KV copy on device, on host, or on both, for all its pages;
- device copies are prefix-closed: a node on device has its parent on device (or the
  parent is a sentinel), so a path reads "device nodes, then host-only nodes";
- a Mamba state (device and/or host slot) belongs to the node's last token; on a split it
  stays with the deeper part;
- ``lock_ref`` / ``host_ref`` count protections of the whole path to the root, so a parent's
  count is at least each child's.

Hit rule: with ``has_mamba`` the usable prefix of a match ends at the deepest node on the
KV path that holds a Mamba state on some tier (length 0, the zero state, when none does).
Without Mamba the usable prefix is the whole page-aligned KV match.

Determinism: the tree never reads the wall clock, never uses ``hash()`` or set order for
decisions. Accesses advance a logical clock; eviction order comes from the policy with the
node creation id as tie-breaker. Trees fed the same calls reach the same ``digest()``.

Cost: match and insert walk the key's pages (dict lookup per node, tuple compares per
page) and touch only the path. Eviction pops from per-target lazy heaps: each state
change of a node pushes a fresh entry; stale entries are skipped on pop, and a heap is
compacted when it grows past twice the node count.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Iterator, Sequence

from mesh_hicache.radix.eviction import EvictionPolicy, EvictTarget, LRUPolicy, NodeStats
from mesh_hicache.radix.hashing import RadixKey, page_hashes
from mesh_hicache.radix.node import (
    EvictResult,
    InsertResult,
    MatchResult,
    PoolUsage,
    TreeNode,
)

_HeapEntry = tuple[tuple[int | float, ...], int, int, TreeNode]


class _Freed:
    """Accumulates what one eviction call frees."""

    __slots__ = ("device", "host", "mamba_device", "mamba_host")

    def __init__(self) -> None:
        self.device: list[int] = []
        self.host: list[int] = []
        self.mamba_device: list[int] = []
        self.mamba_host: list[int] = []

    def result(self) -> EvictResult:
        return EvictResult(
            tuple(self.device), tuple(self.host), tuple(self.mamba_device), tuple(self.mamba_host)
        )


class RadixTree:
    """A prefix tree of page-aligned token keys with per-tier KV pages and Mamba slots.

    ``page_size``: tokens per page. ``has_mamba``: whether the model has Mamba layers
    (enables the hit rule and tombstones; without it, Mamba slot arguments are errors).
    ``policy``: eviction ranking (LRU by default). All indices are plain ints owned by the
    caller's allocators; the tree never allocates, it only records and returns them.
    Not thread-safe: one thread (the scheduler) drives it.
    """

    def __init__(
        self, page_size: int, has_mamba: bool, policy: EvictionPolicy | None = None
    ) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if not isinstance(has_mamba, bool):
            raise TypeError(f"has_mamba must be a bool, got {has_mamba!r}")
        if policy is not None and not isinstance(policy, EvictionPolicy):
            raise TypeError(f"policy must be an EvictionPolicy or None, got {policy!r}")
        self.page_size = page_size
        self.has_mamba = has_mamba
        self.policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        #: Logical clock: advanced once per match/insert; stamps ``last_access``.
        self.clock = 0
        self._next_id = 0
        self._roots: dict[str, TreeNode] = {}
        # Returned as ``last_node`` on a miss in a namespace the tree has never seen.
        self._miss_root = TreeNode(-1, "", None, (), (), is_sentinel=True)
        self.num_nodes = 0
        self.num_device_pages = 0
        self.num_host_pages = 0
        self.num_mamba_device_slots = 0
        self.num_mamba_host_slots = 0
        self._heaps: dict[EvictTarget, list[_HeapEntry]] = {t: [] for t in EvictTarget}

    # ------------------------------------------------------------------ lookup

    def match_prefix(self, key: RadixKey, touch: bool = True) -> MatchResult:
        """The usable cached prefix of ``key`` (truncated to whole pages).

        Mutates: with ``touch``, the logical clock, ``last_access`` and ``hit_count`` of
        the matched KV path (``touch=False`` re-reads a prefix already counted); without
        Mamba, a node is split where the match ends inside it (splits keep every tier
        consistent). With Mamba no split is needed: a usable prefix always ends at a
        node's end. A miss returns lengths 0 and a sentinel ``last_node``.
        """
        key = self._check_key(key)
        ps = self.page_size
        tokens = key.tokens
        root = self._roots.get(key.namespace)
        if root is None:
            return MatchResult((), (), self._miss_root, 0, 0, 0, 0, None, None, ())
        path, pos, partial = self._walk(root, tokens)
        raw_kv_len = pos + (partial[1] if partial is not None else 0)
        if partial is not None and not self.has_mamba:
            path.append(self._split(partial[0], partial[1]))
        if touch:
            self.clock += 1
            for node in path:
                node.last_access = self.clock
                node.hit_count += 1
                self._refresh(node)
        usable = path
        if self.has_mamba:
            end = len(path)
            while end > 0 and not path[end - 1].has_mamba_state:
                end -= 1
            usable = path[:end]
        device: list[int] = []
        host: list[int] = []
        device_len = host_len = 0
        for node in usable:
            if node.device_indices is not None and not host:
                device.extend(node.device_indices)
                device_len += node.num_tokens
            else:
                assert node.host_indices is not None, "node without KV on any tier"
                host.extend(node.host_indices)
                host_len += node.num_tokens
        assert len(device) * ps == device_len and len(host) * ps == host_len
        last = usable[-1] if usable else root
        return MatchResult(
            device_indices=tuple(device),
            host_indices=tuple(host),
            last_node=last,
            device_len=device_len,
            host_len=host_len,
            usable_len=device_len + host_len,
            raw_kv_len=raw_kv_len,
            mamba_on_device=last.mamba_device_slot,
            mamba_on_host=last.mamba_host_slot,
            nodes=tuple(usable),
        )

    def insert(
        self,
        key: RadixKey,
        device_indices: Sequence[int] | None = None,
        host_indices: Sequence[int] | None = None,
        mamba_device_slot: int | None = None,
        mamba_host_slot: int | None = None,
        host_first_page: int = 0,
    ) -> InsertResult:
        """Insert ``key`` (truncated to whole pages) with its pages on device and/or host.

        ``device_indices`` / ``host_indices``: one page per whole page of the key (at least
        one of them given). For pages already in the tree, a given index is taken only if
        that page's node lacks a copy on that tier (a host-only node gets its device copy
        back); every index not taken is listed in the result for the caller to free.
        ``mamba_*_slot``: the state at the key's end, attached per tier when the end node
        has none on that tier. Mutates the tree; may split a node at the key's end or at
        the divergence point.

        ``host_first_page`` (L3 prefetch of a tail): ``host_indices`` then covers only pages
        ``host_first_page ..`` of the key, and ``device_indices`` must be None. The pages
        before it must already be in the tree; if they are not (evicted meanwhile), nothing
        is taken: every host index and slot comes back unused.
        """
        key = self._check_key(key)
        ps = self.page_size
        num_pages = len(key.tokens) // ps
        dev = self._check_indices("device_indices", device_indices, num_pages)
        first = host_first_page
        if not isinstance(first, int) or not 0 <= first <= num_pages:
            raise ValueError(f"host_first_page must be in [0, {num_pages}], got {first!r}")
        if first and device_indices is not None:
            raise ValueError("host_first_page > 0 is only for host-only inserts")
        hst = self._check_indices("host_indices", host_indices, num_pages - first)
        if dev is None and hst is None:
            raise ValueError("insert needs device_indices or host_indices, got neither")
        if not self.has_mamba and (mamba_device_slot is not None or mamba_host_slot is not None):
            raise ValueError("mamba slots given to a RadixTree built with has_mamba=False")
        tokens = key.tokens
        if num_pages == 0:
            # Nothing to cache (the zero state at length 0 needs no slot).
            root = self._roots.get(key.namespace, self._miss_root)
            return InsertResult(0, root, (), (), False, False)
        self.clock += 1
        node = self._roots.get(key.namespace)
        if node is None:
            node = self._new_node(key.namespace, None, (), (), sentinel=True)
            self._roots[key.namespace] = node
        unused_dev: list[int] = []
        unused_host: list[int] = []
        pos = 0
        n = len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                break
            m = self._match_len(child.tokens, tokens, pos)
            if pos < first * ps < pos + m:
                m = first * ps - pos  # split where the given host pages start
            if m < child.num_tokens:
                child = self._split(child, m)
            lo, hi = pos // ps, (pos + m) // ps
            if dev is not None:
                if child.device_indices is not None:
                    unused_dev.extend(dev[lo:hi])
                else:
                    self._set_device(child, dev[lo:hi])
            if hst is not None and lo >= first:
                if child.host_indices is not None:
                    unused_host.extend(hst[lo - first : hi - first])
                else:
                    self._set_host(child, hst[lo - first : hi - first])
            child.last_access = self.clock
            self._refresh(child)
            node = child
            pos += m
        num_existing = pos // ps
        if num_existing < first:
            # The prefix before the given host pages is gone: nothing can hang below it.
            assert hst is not None and not unused_host
            return InsertResult(num_existing, node, (), hst, False, False)
        if pos < n:
            new = self._new_node(
                key.namespace,
                node,
                tokens[pos:],
                tuple(page_hashes(tokens[pos:], ps, key.namespace, node.last_hash)),
            )
            new.last_access = self.clock
            node.children[new.tokens[:ps]] = new
            if dev is not None:
                self._set_device(new, dev[num_existing:])
            if hst is not None:
                self._set_host(new, hst[num_existing - first :])
            self._refresh(node)
            node = new
        dev_taken = host_taken = False
        if not node.is_sentinel:
            if mamba_device_slot is not None and node.mamba_device_slot is None:
                node.mamba_device_slot = int(mamba_device_slot)
                self.num_mamba_device_slots += 1
                dev_taken = True
            if mamba_host_slot is not None and node.mamba_host_slot is None:
                node.mamba_host_slot = int(mamba_host_slot)
                self.num_mamba_host_slots += 1
                host_taken = True
            self._refresh(node)
        return InsertResult(
            num_existing_pages=num_existing,
            node=node,
            unused_device_indices=tuple(unused_dev),
            unused_host_indices=tuple(unused_host),
            mamba_device_taken=dev_taken,
            mamba_host_taken=host_taken,
        )

    # ------------------------------------------------------------- protection

    def lock(self, node: TreeNode) -> None:
        """Protect the device copies of ``node``'s path to the root from eviction."""
        for n in self._up(node):
            n.lock_ref += 1
            if n.lock_ref == 1:
                self._refresh(n)

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``. ValueError if the path is not locked."""
        path = list(self._up(node))
        if any(n.lock_ref <= 0 for n in path):
            raise ValueError(f"unlock of {node!r} without a matching lock")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._refresh(n)

    def protect_host(self, node: TreeNode) -> None:
        """Protect the host copies (and the nodes) of ``node``'s path from eviction."""
        for n in self._up(node):
            n.host_ref += 1
            if n.host_ref == 1:
                self._refresh(n)

    def release_host(self, node: TreeNode) -> None:
        """Undo one ``protect_host(node)``. ValueError if the path is not protected."""
        path = list(self._up(node))
        if any(n.host_ref <= 0 for n in path):
            raise ValueError(f"release_host of {node!r} without a matching protect_host")
        for n in path:
            n.host_ref -= 1
            if n.host_ref == 0:
                self._refresh(n)

    # --------------------------------------------------------------- eviction

    def evict_device(
        self, num_pages: int, before_evict: Callable[[TreeNode], None] | None = None
    ) -> EvictResult:
        """Free at least ``num_pages`` device pages if possible (fewer if not enough are
        evictable). Victims are device leaves (no child on device), unlocked, in policy
        order. A victim with a host copy becomes host-only; one without is first offered
        to ``before_evict(node)`` (write-back: the callback backs it up and calls
        ``set_host``), and if it still has no host copy it is removed when childless and
        unprotected (all its slots freed), else skipped. Mutates the tree.
        """
        freed = _Freed()
        skipped: list[TreeNode] = []
        while len(freed.device) < num_pages:
            node = self._pop(EvictTarget.DEVICE_KV)
            if node is None:
                break
            if node.host_indices is None and before_evict is not None:
                before_evict(node)
                if not (node.alive and self._is_candidate(node, EvictTarget.DEVICE_KV)):
                    continue
            if node.host_indices is not None:
                freed.device.extend(self._clear_device(node))
            elif not node.children and node.host_ref == 0:
                self._remove(node, freed)
            else:
                skipped.append(node)
        for node in skipped:
            self._refresh(node)
        return freed.result()

    def evict_host(self, num_pages: int) -> EvictResult:
        """Free at least ``num_pages`` host pages if possible. Victims are unprotected
        nodes with a host copy that either also have a device copy (they become
        device-only) or are childless and unlocked (they are removed). Mutates the tree.
        """
        freed = _Freed()
        while len(freed.host) < num_pages:
            node = self._pop(EvictTarget.HOST_KV)
            if node is None:
                break
            if node.device_indices is not None:
                freed.host.extend(self._clear_host(node))
            else:
                self._remove(node, freed)
        return freed.result()

    def evict_mamba_device(
        self, num_slots: int, before_evict: Callable[[TreeNode], None] | None = None
    ) -> EvictResult:
        """Free at least ``num_slots`` device Mamba slots of unlocked nodes if possible.
        A victim whose state has no host copy is first offered to ``before_evict(node)``
        (write-back: the callback backs it up and calls ``set_mamba_host``). A node left
        without a state on any tier is a tombstone; a childless one is removed with its
        pages, and so are childless tombstone ancestors. Mutates.
        """
        freed = _Freed()
        while len(freed.mamba_device) < num_slots:
            node = self._pop(EvictTarget.MAMBA_DEVICE)
            if node is None:
                break
            if node.mamba_host_slot is None and before_evict is not None:
                before_evict(node)
                if not (node.alive and self._is_candidate(node, EvictTarget.MAMBA_DEVICE)):
                    continue
            freed.mamba_device.append(self.clear_mamba_device(node))
            self._after_state_loss(node, freed)
        return freed.result()

    def evict_mamba_host(self, num_slots: int) -> EvictResult:
        """Like ``evict_mamba_device`` for host slots of host-unprotected nodes."""
        freed = _Freed()
        while len(freed.mamba_host) < num_slots:
            node = self._pop(EvictTarget.MAMBA_HOST)
            if node is None:
                break
            freed.mamba_host.append(self.clear_mamba_host(node))
            self._after_state_loss(node, freed)
        return freed.result()

    # -------------------------------------------------------- tier transitions

    def set_host(self, node: TreeNode, host_indices: Sequence[int]) -> None:
        """Record the host copy of ``node`` (after a backup). ValueError if it has one."""
        self._check_node(node)
        if node.host_indices is not None:
            raise ValueError(f"set_host: {node!r} already has a host copy")
        idx = self._check_indices("host_indices", host_indices, node.num_pages)
        assert idx is not None
        self._set_host(node, idx)

    def clear_host(self, node: TreeNode, invalid: bool = False) -> tuple[int, ...]:
        """Drop the host copy of a node that also has a device copy; returns its pages.

        ValueError if the node is host-protected, unless ``invalid``: the host copy never
        held valid data (its backup failed), so no reader can be relying on it.
        """
        self._check_node(node)
        if node.host_indices is None or node.device_indices is None:
            raise ValueError(f"clear_host: {node!r} needs both a host and a device copy")
        if node.host_ref > 0 and not invalid:
            raise ValueError(f"clear_host: {node!r} is host-protected")
        return self._clear_host(node)

    def attach_device(self, node: TreeNode, device_indices: Sequence[int]) -> None:
        """Record a device copy of a host-only node (after a load). The parent must be on
        device already (load a path top-down). ValueError otherwise."""
        self._check_node(node)
        if node.device_indices is not None:
            raise ValueError(f"attach_device: {node!r} already has a device copy")
        parent = node.parent
        assert parent is not None
        if not parent.is_sentinel and parent.device_indices is None:
            raise ValueError(f"attach_device: the parent of {node!r} is not on device")
        idx = self._check_indices("device_indices", device_indices, node.num_pages)
        assert idx is not None
        self._set_device(node, idx)

    def clear_device(self, node: TreeNode) -> tuple[int, ...]:
        """Drop the device copy of an unlocked host-backed node with no child on device;
        returns its device pages. ValueError otherwise."""
        self._check_node(node)
        if node.device_indices is None or node.host_indices is None:
            raise ValueError(f"clear_device: {node!r} needs both a device and a host copy")
        if node.lock_ref > 0 or node.num_device_children > 0:
            raise ValueError(f"clear_device: {node!r} is locked or has children on device")
        return self._clear_device(node)

    def attach_mamba_device(self, node: TreeNode, slot: int) -> None:
        """Record the device Mamba state of ``node``. ValueError if it has one."""
        self._check_mamba_node(node)
        if node.mamba_device_slot is not None:
            raise ValueError(f"attach_mamba_device: {node!r} already has a device state")
        node.mamba_device_slot = int(slot)
        self.num_mamba_device_slots += 1
        self._refresh(node)

    def set_mamba_host(self, node: TreeNode, slot: int) -> None:
        """Record the host Mamba state of ``node`` (after a backup)."""
        self._check_mamba_node(node)
        if node.mamba_host_slot is not None:
            raise ValueError(f"set_mamba_host: {node!r} already has a host state")
        node.mamba_host_slot = int(slot)
        self.num_mamba_host_slots += 1
        self._refresh(node)

    def clear_mamba_device(self, node: TreeNode) -> int:
        """Drop the device Mamba state of ``node`` and return its slot. Never removes the
        node (a childless tombstone is removed by a later eviction)."""
        self._check_mamba_node(node)
        slot = node.mamba_device_slot
        if slot is None:
            raise ValueError(f"clear_mamba_device: {node!r} has no device state")
        node.mamba_device_slot = None
        self.num_mamba_device_slots -= 1
        self._refresh(node)
        return slot

    def clear_mamba_host(self, node: TreeNode) -> int:
        """Drop the host Mamba state of ``node`` and return its slot (see above)."""
        self._check_mamba_node(node)
        slot = node.mamba_host_slot
        if slot is None:
            raise ValueError(f"clear_mamba_host: {node!r} has no host state")
        node.mamba_host_slot = None
        self.num_mamba_host_slots -= 1
        self._refresh(node)
        return slot

    # --------------------------------------------------------------- accessors

    def iter_nodes(self) -> Iterator[TreeNode]:
        """All non-sentinel nodes, depth-first, namespaces in sorted order."""
        for ns in sorted(self._roots):
            stack = list(reversed(list(self._roots[ns].children.values())))
            while stack:
                node = stack.pop()
                yield node
                stack.extend(reversed(list(node.children.values())))

    def nodes_on_path(self, node: TreeNode) -> list[TreeNode]:
        """Non-sentinel nodes from the root down to ``node`` (inclusive)."""
        path = list(self._up(node))
        path.reverse()
        return path

    def prefix_tokens(self, node: TreeNode) -> tuple[int, ...]:
        """All tokens from the root to the end of ``node``."""
        out: list[int] = []
        for n in self.nodes_on_path(node):
            out.extend(n.tokens)
        return tuple(out)

    def is_tombstone(self, node: TreeNode) -> bool:
        """A node with KV but no Mamba state on any tier (only with ``has_mamba``)."""
        return self.has_mamba and not node.is_sentinel and not node.has_mamba_state

    def digest(self) -> str:
        """SHA-256 hex of the structure and tier state; equal on trees fed the same calls."""
        h = hashlib.sha256()
        h.update(f"ps={self.page_size};mamba={self.has_mamba};clock={self.clock}\n".encode())
        for ns in sorted(self._roots):
            h.update(f"ns={ns!r}\n".encode())
            stack: list[tuple[TreeNode, int]] = [(self._roots[ns], 0)]
            while stack:
                node, depth = stack.pop()
                if not node.is_sentinel:
                    last = node.last_hash
                    assert last is not None
                    h.update(
                        (
                            f"{depth}|{node.id}|{node.num_pages}|{last.hex()}|"
                            f"{node.device_indices}|{node.host_indices}|"
                            f"{node.mamba_device_slot}|{node.mamba_host_slot}|"
                            f"{node.lock_ref}|{node.host_ref}|{node.hit_count}|"
                            f"{node.last_access}\n"
                        ).encode()
                    )
                for k in sorted(node.children, reverse=True):
                    stack.append((node.children[k], depth + 1))
        return h.hexdigest()

    def check_integrity(
        self,
        device: PoolUsage | None = None,
        host: PoolUsage | None = None,
        mamba_device: PoolUsage | None = None,
        mamba_host: PoolUsage | None = None,
    ) -> None:
        """Verify every invariant; raise RuntimeError naming the first violation.

        Checks structure (child keys, parent links, page counts, chained hashes, one KV
        copy at least, device prefix-closure), protections (counts >= 0, parent >= child),
        that every page/slot is referenced by exactly one node, cached totals, and that
        every eviction candidate has a live heap entry. For each pool given, also that
        tree-owned + free + held indices are exactly ``range(capacity)``, disjointly.
        O(tree tokens); for tests and debugging.
        """

        def fail(msg: str) -> None:
            raise RuntimeError(f"radix integrity: {msg}")

        owners: dict[str, dict[int, int]] = {
            "device": {},
            "host": {},
            "mamba_device": {},
            "mamba_host": {},
        }

        def own(pool: str, index: int, node: TreeNode) -> None:
            if index in owners[pool]:
                fail(f"{pool} index {index} owned by nodes {owners[pool][index]} and {node.id}")
            owners[pool][index] = node.id

        live = {(target, e[1], e[2]) for target, heap in self._heaps.items() for e in heap}
        ps = self.page_size
        num_nodes = 0
        for ns, root in self._roots.items():
            if not root.is_sentinel or root.parent is not None or root.tokens or root.hashes:
                fail(f"namespace root {ns!r} is not a bare sentinel: {root!r}")
            if root.namespace != ns or not root.alive:
                fail(f"namespace root {ns!r} is inconsistent: {root!r}")
            if not root.children:
                fail(f"namespace root {ns!r} has no children (should have been dropped)")
            stack = [root]
            while stack:
                parent = stack.pop()
                device_children = 0
                for k, node in parent.children.items():
                    stack.append(node)
                    num_nodes += 1
                    self._check_one(node, parent, k, ns, fail)
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
                    for target in EvictTarget:
                        if self._is_candidate(node, target) and (
                            (target, node.id, node.version) not in live
                        ):
                            fail(f"{node!r} is a {target.value} candidate without heap entry")
                    if node.hashes != tuple(page_hashes(node.tokens, ps, ns, parent.last_hash)):
                        fail(f"{node!r} has wrong page hashes")
                if device_children != parent.num_device_children:
                    fail(
                        f"{parent!r} counts {parent.num_device_children} device children, "
                        f"has {device_children}"
                    )
        totals = {
            "num_nodes": (self.num_nodes, num_nodes),
            "num_device_pages": (self.num_device_pages, len(owners["device"])),
            "num_host_pages": (self.num_host_pages, len(owners["host"])),
            "num_mamba_device_slots": (self.num_mamba_device_slots, len(owners["mamba_device"])),
            "num_mamba_host_slots": (self.num_mamba_host_slots, len(owners["mamba_host"])),
        }
        for name, (cached, actual) in totals.items():
            if cached != actual:
                fail(f"cached {name}={cached} but the tree holds {actual}")
        pools = {"device": device, "host": host, "mamba_device": mamba_device}
        pools["mamba_host"] = mamba_host
        for pool, usage in pools.items():
            if usage is None:
                continue
            used = set(owners[pool])
            free = list(usage.free)
            held = list(usage.held)
            seen: set[int] = set()
            for label, group in (("free", free), ("held", held)):
                for i in group:
                    if i in used:
                        fail(f"{pool} index {i} is {label} but owned by node {owners[pool][i]}")
                    if i in seen:
                        fail(f"{pool} index {i} is listed twice in free/held")
                    seen.add(i)
            everything = used | seen
            if everything != set(range(usage.capacity)):
                missing = sorted(set(range(usage.capacity)) - everything)[:5]
                extra = sorted(everything - set(range(usage.capacity)))[:5]
                fail(f"{pool} pool leaks {missing} / has out-of-range {extra}")

    # ---------------------------------------------------------------- helpers

    def _check_one(
        self,
        node: TreeNode,
        parent: TreeNode,
        k: tuple[int, ...],
        ns: str,
        fail: Callable[[str], None],
    ) -> None:
        ps = self.page_size
        if node.is_sentinel or not node.alive or node.parent is not parent:
            fail(f"{node!r} is a sentinel, dead, or has a wrong parent link")
        if node.namespace != ns:
            fail(f"{node!r} is under namespace {ns!r}")
        if not node.tokens or len(node.tokens) % ps or len(node.hashes) * ps != len(node.tokens):
            fail(f"{node!r} holds {len(node.tokens)} tokens / {len(node.hashes)} hashes")
        if node.tokens[:ps] != k:
            fail(f"{node!r} is keyed by {k} but starts with {node.tokens[:ps]}")
        if node.device_indices is None and node.host_indices is None:
            fail(f"{node!r} holds no KV on any tier")
        for name, idx in (("device", node.device_indices), ("host", node.host_indices)):
            if idx is not None and len(idx) != node.num_pages:
                fail(f"{node!r} has {len(idx)} {name} pages for {node.num_pages} pages")
        if node.device_indices is not None and not (
            parent.is_sentinel or parent.device_indices is not None
        ):
            fail(f"{node!r} is on device but its parent is not")
        if node.lock_ref < 0 or node.host_ref < 0:
            fail(f"{node!r} has a negative protection count")
        if not parent.is_sentinel and (
            parent.lock_ref < node.lock_ref or parent.host_ref < node.host_ref
        ):
            fail(f"{node!r} is protected more than its parent {parent!r}")
        if not self.has_mamba and node.has_mamba_state:
            fail(f"{node!r} holds a Mamba state in a tree without Mamba")

    def _check_key(self, key: RadixKey) -> RadixKey:
        if not isinstance(key, RadixKey):
            raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")
        return key.page_aligned(self.page_size)

    @staticmethod
    def _check_indices(
        name: str, indices: Sequence[int] | None, num_pages: int
    ) -> tuple[int, ...] | None:
        if indices is None:
            return None
        out = tuple(int(i) for i in indices)
        if len(out) != num_pages:
            raise ValueError(
                f"{name} must hold {num_pages} pages (one per whole page), got {len(out)}"
            )
        return out

    def _check_node(self, node: TreeNode) -> None:
        if not isinstance(node, TreeNode) or node.is_sentinel or not node.alive:
            raise ValueError(f"expected a live non-sentinel node of this tree, got {node!r}")

    def _check_mamba_node(self, node: TreeNode) -> None:
        self._check_node(node)
        if not self.has_mamba:
            raise ValueError("Mamba state operation on a RadixTree built with has_mamba=False")

    def _new_node(
        self,
        namespace: str,
        parent: TreeNode | None,
        tokens: tuple[int, ...],
        hashes: tuple[bytes, ...],
        sentinel: bool = False,
    ) -> TreeNode:
        node = TreeNode(self._next_id, namespace, parent, tokens, hashes, is_sentinel=sentinel)
        self._next_id += 1
        if not sentinel:
            self.num_nodes += 1
        return node

    @staticmethod
    def _up(node: TreeNode) -> Iterator[TreeNode]:
        n: TreeNode | None = node
        while n is not None and not n.is_sentinel:
            yield n
            n = n.parent

    def _match_len(self, node_tokens: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
        """Matched tokens of ``node_tokens`` against ``tokens[pos:]`` (whole pages; the
        first page is known to match)."""
        ps = self.page_size
        end = min(len(node_tokens), len(tokens) - pos)
        if tokens[pos : pos + end] == node_tokens[:end]:
            return end
        i = ps
        while i < end and tokens[pos + i : pos + i + ps] == node_tokens[i : i + ps]:
            i += ps
        return i

    def _walk(
        self, root: TreeNode, tokens: tuple[int, ...]
    ) -> tuple[list[TreeNode], int, tuple[TreeNode, int] | None]:
        """Fully matched nodes, their token count, and (node, tokens) of a partial match."""
        ps = self.page_size
        path: list[TreeNode] = []
        node = root
        pos = 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                break
            m = self._match_len(child.tokens, tokens, pos)
            if m < child.num_tokens:
                return path, pos, (child, m)
            path.append(child)
            pos += m
            node = child
        return path, pos, None

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` tokens; returns the new upper node. The Mamba state
        stays with ``child`` (the deeper part), protections and stats are copied up."""
        ps = self.page_size
        j = m // ps
        parent = child.parent
        assert parent is not None and 0 < m < child.num_tokens and m % ps == 0
        upper = self._new_node(child.namespace, parent, child.tokens[:m], child.hashes[:j])
        if child.device_indices is not None:
            upper.device_indices = child.device_indices[:j]
            child.device_indices = child.device_indices[j:]
            upper.num_device_children = 1
        if child.host_indices is not None:
            upper.host_indices = child.host_indices[:j]
            child.host_indices = child.host_indices[j:]
        upper.lock_ref = child.lock_ref
        upper.host_ref = child.host_ref
        upper.hit_count = child.hit_count
        upper.last_access = child.last_access
        parent.children[upper.tokens[:ps]] = upper
        child.tokens = child.tokens[m:]
        child.hashes = child.hashes[j:]
        child.parent = upper
        upper.children[child.tokens[:ps]] = child
        self._refresh(upper)
        self._refresh(child)
        return upper

    def _set_device(self, node: TreeNode, indices: tuple[int, ...]) -> None:
        assert node.device_indices is None
        node.device_indices = indices
        self.num_device_pages += len(indices)
        assert node.parent is not None
        node.parent.num_device_children += 1
        self._refresh(node)
        self._refresh(node.parent)

    def _clear_device(self, node: TreeNode) -> tuple[int, ...]:
        pages = node.device_indices
        assert pages is not None and node.parent is not None
        node.device_indices = None
        self.num_device_pages -= len(pages)
        node.parent.num_device_children -= 1
        self._refresh(node)
        self._refresh(node.parent)
        return pages

    def _set_host(self, node: TreeNode, indices: tuple[int, ...]) -> None:
        assert node.host_indices is None
        node.host_indices = indices
        self.num_host_pages += len(indices)
        self._refresh(node)

    def _clear_host(self, node: TreeNode) -> tuple[int, ...]:
        pages = node.host_indices
        assert pages is not None
        node.host_indices = None
        self.num_host_pages -= len(pages)
        self._refresh(node)
        return pages

    def _after_state_loss(self, node: TreeNode, freed: _Freed) -> None:
        """Remove ``node`` if it became a childless, unprotected tombstone."""
        if (
            self.has_mamba
            and not node.has_mamba_state
            and not node.children
            and node.lock_ref == 0
            and node.host_ref == 0
        ):
            self._remove(node, freed)

    def _remove(self, node: TreeNode, freed: _Freed) -> None:
        """Remove a childless unprotected node, freeing everything it holds, then its
        ancestors that became childless tombstones."""
        while True:
            assert not node.children and node.lock_ref == 0 and node.host_ref == 0
            parent = node.parent
            assert parent is not None and not node.is_sentinel
            if node.device_indices is not None:
                freed.device.extend(self._clear_device(node))
            if node.host_indices is not None:
                freed.host.extend(self._clear_host(node))
            if node.mamba_device_slot is not None:
                freed.mamba_device.append(node.mamba_device_slot)
                node.mamba_device_slot = None
                self.num_mamba_device_slots -= 1
            if node.mamba_host_slot is not None:
                freed.mamba_host.append(node.mamba_host_slot)
                node.mamba_host_slot = None
                self.num_mamba_host_slots -= 1
            del parent.children[node.tokens[: self.page_size]]
            node.alive = False
            self.num_nodes -= 1
            if parent.is_sentinel:
                if not parent.children:
                    del self._roots[parent.namespace]
                return
            if (
                self.has_mamba
                and not parent.children
                and not parent.has_mamba_state
                and parent.lock_ref == 0
                and parent.host_ref == 0
            ):
                node = parent
                continue
            self._refresh(parent)
            return

    # ------------------------------------------------------------------ heaps

    @staticmethod
    def _is_candidate(node: TreeNode, target: EvictTarget) -> bool:
        if node.is_sentinel or not node.alive:
            return False
        if target is EvictTarget.DEVICE_KV:
            return (
                node.device_indices is not None
                and node.lock_ref == 0
                and node.num_device_children == 0
            )
        if target is EvictTarget.HOST_KV:
            return (
                node.host_indices is not None
                and node.host_ref == 0
                and (node.device_indices is not None or (not node.children and node.lock_ref == 0))
            )
        if target is EvictTarget.MAMBA_DEVICE:
            return node.mamba_device_slot is not None and node.lock_ref == 0
        return node.mamba_host_slot is not None and node.host_ref == 0

    def _refresh(self, node: TreeNode) -> None:
        """Invalidate ``node``'s heap entries and push fresh ones where it is a candidate."""
        if node.is_sentinel or not node.alive:
            return
        node.version += 1
        stats: NodeStats | None = None
        for target, heap in self._heaps.items():
            if not self._is_candidate(node, target):
                continue
            if stats is None:
                stats = NodeStats(
                    node.last_access, node.hit_count, node.num_tokens, node.has_mamba_state
                )
            heapq.heappush(heap, (self.policy.priority(stats, target), node.id, node.version, node))
            if len(heap) > 2 * self.num_nodes + 64:
                self._compact(target)

    def _compact(self, target: EvictTarget) -> None:
        heap = [
            e
            for e in self._heaps[target]
            if e[3].alive and e[2] == e[3].version and self._is_candidate(e[3], target)
        ]
        heapq.heapify(heap)
        self._heaps[target] = heap

    def _pop(self, target: EvictTarget) -> TreeNode | None:
        heap = self._heaps[target]
        while heap:
            _, _, version, node = heapq.heappop(heap)
            if node.alive and version == node.version and self._is_candidate(node, target):
                return node
        return None
