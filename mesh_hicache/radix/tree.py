"""The hybrid radix tree: KV pages and Mamba checkpoints per tier (docs/DESIGN.md section 5).

Structure: one sentinel root per namespace; below it, nodes that each hold a run of whole
pages (``page_size`` tokens each) packed as int64 bytes, keyed in their parent by the
bytes of their first page. The invariants are listed in core.py; ``check_integrity``
(integrity.py) verifies them.

Hit rule: with ``has_mamba`` the usable prefix of a match ends at the deepest node on the
KV path that holds a Mamba state on some tier (length 0, the zero state, when none does).
Without Mamba the usable prefix is the whole page-aligned KV match. With sliding-window
groups (``windows``) and pages whose windowed K/V the copy a match reads lacks
(``TreeNode.window_missing``; the gaps are kept per tier), the usable prefix ends where
those rules allow and every windowed page a resume needs is present (window.py).

Determinism: the tree never reads the wall clock, never uses ``hash()`` or set order for
decisions. Accesses advance a logical clock; eviction order comes from the policy with the
node creation id as tie-breaker. Trees fed the same calls reach the same ``digest()``.

Cost: match and insert do one dict lookup and one bytes comparison per node of the path
(plus a binary search over pages where a key ends or diverges inside a node) and never
hash a page; a tree with ``windows`` adds one scan of the matched path, and the window
rule's few set tests per boundary only where the path lacks windowed pages. Touching a
node stores its clock value; eviction takes the first entry of sorted queues that hold
only live candidates (queues.py): a few C bisects per victim, never O(tree).
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence

from mesh_hicache.radix import integrity
from mesh_hicache.radix.core import Freed, TreeCore, common_bytes
from mesh_hicache.radix.eviction import EvictTarget
from mesh_hicache.radix.hashing import RadixKey, unpack_tokens
from mesh_hicache.radix.node import (
    NO_PAGES,
    EvictResult,
    Family,
    InsertResult,
    MatchResult,
    PoolUsage,
    Tier,
    TreeNode,
)
from mesh_hicache.radix.window import deepest_window_end


class RadixTree(TreeCore):
    """A prefix tree of page-aligned token keys with per-tier KV pages and Mamba slots.

    ``page_size``: tokens per page. ``has_mamba``: whether the model has Mamba layers
    (enables the hit rule and tombstones; without it, Mamba slot arguments are errors).
    ``policy``: eviction ranking (LRU by default). ``windows``: the model's sliding-window
    layer groups (enables ``window_missing`` and the window rule). All indices are plain
    ints owned by the caller's allocators; the tree never allocates, it only records and
    returns them.
    Not thread-safe: one thread (the scheduler) drives it.
    """

    # ------------------------------------------------------------------ lookup

    def match_prefix(self, key: RadixKey, touch: bool = True) -> MatchResult:
        """The usable cached prefix of ``key`` (truncated to whole pages).

        Mutates: with ``touch``, the logical clock, ``last_access`` and ``hit_count`` of
        the matched KV path (``touch=False`` re-reads a prefix already counted); without
        Mamba, a node is split where the match ends inside it (splits keep every tier
        consistent). With Mamba no split is needed: a usable prefix always ends at a
        node's end. A miss returns lengths 0 and a sentinel ``last_node``.

        Window rule (a tree with ``windows`` whose path has nodes with ``window_missing``):
        the usable prefix ends at the deepest boundary that would be usable without the
        rule (any page boundary of the match without Mamba, a node end holding a state
        with it) at which every windowed page a resume needs is present
        (``window.resumable``); a node is split where that boundary lies inside it.
        """
        end = self._key_end(key)
        root = self._roots.get(key.namespace)
        if root is None:
            return MatchResult((), (), self._miss_root, 0, 0, 0, 0, None, None, ())
        path, pos, partial = self._walk(root, key.data, end)
        raw_kv_len = (pos + (partial[1] if partial is not None else 0)) >> 3
        cut = self._window_cut(path, pos, partial) if self.windows else None
        missing = NO_PAGES
        if cut is not None:
            partial, num_usable, missing = cut
            if partial is not None:
                del path[num_usable - 1 :]  # the node split below and what lies under it
        if partial is not None and not self.has_mamba:
            path.append(self._split(partial[0], partial[1]))
        if touch:
            self.clock += 1
            clock = self.clock
            if self._on_match is not None:
                self._on_match(key.data, path, pos, end, self._page_bytes, clock)
            for node in path:  # a touch is a timestamp store (queues re-rank lazily)
                node.last_access = clock
                node.hit_count += 1
            if self._rekey_on_touch:
                for node in path:
                    self._queues.update(node)
        usable = path
        if cut is not None:
            usable = path[:num_usable]
        elif self.has_mamba:
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
                device_len += len(node.data)
            else:
                assert node.host_indices is not None, "node without KV on any tier"
                host.extend(node.host_indices)
                host_len += len(node.data)
        last = usable[-1] if usable else root
        if touch and usable:
            last.state_access = self.clock  # the state a request resumes from (eviction.py)
        return MatchResult(
            device_indices=tuple(device),
            host_indices=tuple(host),
            last_node=last,
            device_len=device_len >> 3,
            host_len=host_len >> 3,
            usable_len=(device_len + host_len) >> 3,
            raw_kv_len=raw_kv_len,
            mamba_on_device=last.mamba_device_slot,
            mamba_on_host=last.mamba_host_slot,
            nodes=tuple(usable),
            window_missing=missing,
        )

    def _window_cut(
        self, path: list[TreeNode], pos: int, partial: tuple[TreeNode, int] | None
    ) -> tuple[tuple[TreeNode, int] | None, int, frozenset[int]] | None:
        """The window rule on a walk (``_walk``'s result): the partial match to split at
        (None: no split), how many nodes of the path (the split part included) are
        usable, and the absent windowed pages before that end. None, after one scan of
        the path, when no node the usable prefix may reach lacks windowed pages."""
        tail = partial[0] if partial is not None and not self.has_mamba else None
        if not any(n.window_missing for n in path) and not (
            tail is not None and tail.window_missing
        ):
            return None
        pb = self._page_bytes
        nodes = list(path)
        starts: list[int] = []
        ends: list[int] = []
        candidates: list[int] = []  # the ends the other rules allow, shallowest first
        at = 0
        for node in path:
            starts.append(at // pb)
            at += len(node.data)
            ends.append(at >> 3)
            if self.has_mamba and node.has_mamba_state:
                candidates.append(at >> 3)
        if tail is not None:
            assert partial is not None
            nodes.append(tail)
            starts.append(pos // pb)
            ends.append((pos + partial[1]) >> 3)
        if not self.has_mamba:  # every page boundary of the match, deepest first
            candidates = list(range(0, ends[-1] + 1, self.page_size)) if ends else []
        b, missing = deepest_window_end(
            starts,
            [n.window_missing for n in nodes],
            reversed(candidates),
            self.page_size,
            self.windows,
        )
        if b == 0:
            return None, 0, missing
        k = bisect.bisect_left(ends, b)  # the node the boundary lies in or ends
        if k < len(path) and ends[k] == b:
            return None, k + 1, missing
        # Inside node k of the path, or in the partial match: split there.
        return (nodes[k], (b - starts[k] * self.page_size) << 3), k + 1, missing

    def insert(
        self,
        key: RadixKey,
        device_indices: Sequence[int] | None = None,
        host_indices: Sequence[int] | None = None,
        mamba_device_slot: int | None = None,
        mamba_host_slot: int | None = None,
        host_first_page: int = 0,
        window_missing: Iterable[int] = (),
    ) -> InsertResult:
        """Insert ``key`` (truncated to whole pages) with its pages on device and/or host.

        ``device_indices`` / ``host_indices``: one page per whole page of the key (at least
        one of them given). For pages already in the tree, a given index is taken only if
        that page's node lacks a copy on that tier (a host-only node gets its device copy
        back); every index not taken is listed in the result for the caller to free.
        ``mamba_*_slot``: the state at the key's end, attached per tier when the end node
        has none on that tier. Mutates the tree; may split a node at the key's end or at
        the divergence point. Never computes a page hash.

        ``host_first_page`` (L3 prefetch of a tail): ``host_indices`` then covers only pages
        ``host_first_page ..`` of the key, and ``device_indices`` must be None. The pages
        before it must already be in the tree; if they are not (evicted meanwhile), nothing
        is taken: every host index and slot comes back unused.

        ``window_missing`` (a tree with ``windows``): page indices of the key (0 = its first
        page, each among the pages given) whose windowed K/V the given copies lack. The
        gaps are kept per tier and replace the node's: a node that takes the given device
        pages gets those of its pages as ``TreeNode.window_missing`` (the device copy is
        what a match reads: a host-only node with gaps whose pages a request recomputed
        gets a complete device copy); a node that takes the given host pages gets them as
        ``host_window_missing``, and as ``window_missing`` too when it has no device copy.
        """
        n = self._key_end(key)
        pb = self._page_bytes
        data = key.data
        num_pages = n // pb
        dev = self._check_indices("device_indices", device_indices, num_pages)
        first = host_first_page
        if not isinstance(first, int) or not 0 <= first <= num_pages:
            raise ValueError(f"host_first_page must be in [0, {num_pages}], got {first!r}")
        if first and device_indices is not None:
            raise ValueError("host_first_page > 0 is only for host-only inserts")
        hst = self._check_indices("host_indices", host_indices, num_pages - first)
        miss = self._check_missing(window_missing, first, num_pages)
        if dev is None and hst is None:
            raise ValueError("insert needs device_indices or host_indices, got neither")
        if not self.has_mamba and (mamba_device_slot is not None or mamba_host_slot is not None):
            raise ValueError("mamba slots given to a RadixTree built with has_mamba=False")
        if num_pages == 0:
            # Nothing to cache (the zero state at length 0 needs no slot).
            root = self._roots.get(key.namespace, self._miss_root)
            return InsertResult(0, root, (), (), False, False)
        self.clock += 1
        node = self._roots.get(key.namespace)
        if node is None:
            if first:  # no prefix to hang the given host pages below: nothing is taken
                assert hst is not None
                return InsertResult(0, self._miss_root, (), hst, False, False)
            node = self._new_node(key.namespace, None, b"", sentinel=True)
            self._roots[key.namespace] = node
        unused_dev: list[int] = []
        unused_host: list[int] = []
        pos = 0
        split_at = first * pb
        while pos < n:
            child = node.children.get(data[pos : pos + pb])
            if child is None:
                break
            cd = child.data
            m = len(cd) if data.startswith(cd, pos, n) else -1
            if m < 0:
                m = common_bytes(data, pos, cd, pb, n)
            if pos < split_at < pos + m:
                m = split_at - pos  # split where the given host pages start
            if m < len(cd):
                child = self._split(child, m)
            lo, hi = pos // pb, (pos + m) // pb
            if dev is not None:
                if child.device_indices is not None:
                    unused_dev.extend(dev[lo:hi])
                else:
                    self._attach(child, Tier.DEVICE, Family.KV, dev[lo:hi])
                    child.window_missing = self._pages_in(miss, lo, hi) if miss else NO_PAGES
            if hst is not None and lo >= first:
                if child.host_indices is not None:
                    unused_host.extend(hst[lo - first : hi - first])
                else:
                    self._attach(child, Tier.HOST, Family.KV, hst[lo - first : hi - first])
                    gaps = self._pages_in(miss, lo, hi) if miss else NO_PAGES
                    child.host_window_missing = gaps
                    if child.device_indices is None:
                        child.window_missing = gaps
            self._touch(child, hit=False)
            node = child
            pos += m
        num_existing = pos // pb
        if num_existing < first:
            # The prefix before the given host pages is gone: nothing can hang below it.
            assert hst is not None and not unused_host
            return InsertResult(num_existing, node, (), hst, False, False)
        if pos < n:
            new = self._new_node(key.namespace, node, data[pos:n])
            new.last_access = self.clock
            node.children[data[pos : pos + pb]] = new
            if dev is not None:
                self._attach(new, Tier.DEVICE, Family.KV, dev[num_existing:])
            if hst is not None:
                self._attach(new, Tier.HOST, Family.KV, hst[num_existing - first :])
            if miss:  # every copy of a new node is a given one: the same gaps on each tier
                gaps = self._pages_in(miss, num_existing, num_pages)
                new.window_missing = gaps
                if hst is not None:
                    new.host_window_missing = gaps
            self._queues.update(node)
            node = new
        dev_taken = host_taken = False
        if not node.is_sentinel and (mamba_device_slot is not None or mamba_host_slot is not None):
            node.state_access = self.clock  # a new checkpoint counts as used now (eviction.py)
        if not node.is_sentinel:
            if mamba_device_slot is not None and node.mamba_device_slot is None:
                self._attach(node, Tier.DEVICE, Family.STATE, operator.index(mamba_device_slot))
                dev_taken = True
            if mamba_host_slot is not None and node.mamba_host_slot is None:
                self._attach(node, Tier.HOST, Family.STATE, operator.index(mamba_host_slot))
                host_taken = True
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
        self._add_ref(node, "lock_ref", 1, "")

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``. ValueError if the path is not locked."""
        self._add_ref(node, "lock_ref", -1, "unlock")

    def protect_host(self, node: TreeNode) -> None:
        """Protect the host copies (and the nodes) of ``node``'s path from eviction."""
        self._add_ref(node, "host_ref", 1, "")

    def release_host(self, node: TreeNode) -> None:
        """Undo one ``protect_host(node)``. ValueError if the path is not protected."""
        self._add_ref(node, "host_ref", -1, "release_host")

    # --------------------------------------------------------------- eviction

    def evict_device(
        self, num_pages: int, before_evict: Callable[[TreeNode], None] | None = None
    ) -> EvictResult:
        """Free at least ``num_pages`` device pages if possible (fewer if not enough are
        evictable). Victims are device leaves (no child on device), unlocked, in policy
        order. A victim with a host copy becomes host-only (its ``window_missing`` the host
        copy's); one without is first offered to ``before_evict(node)`` (write-back: the
        callback backs it up and attaches the host copy), and if it still has no host copy
        it is removed when childless and unprotected (all its slots freed), else skipped.
        Mutates the tree.
        """
        freed = Freed()
        skipped: list[TreeNode] = []
        queues = self._queues
        while len(freed.device) < num_pages:
            node = queues.pop(EvictTarget.DEVICE_KV)
            if node is None:
                break
            if node.host_indices is None and before_evict is not None:
                before_evict(node)
                queues.update(node)  # the callback may have changed what the node holds
                if not (node.alive and queues.holds(node, EvictTarget.DEVICE_KV)):
                    continue
            if node.host_indices is not None:
                freed.device.extend(self._detach(node, Tier.DEVICE, Family.KV))
            elif not node.children and node.host_ref == 0:
                self._remove(node, freed)
            else:
                skipped.append(node)
                queues.discard(node, EvictTarget.DEVICE_KV)  # not again in this call
        for node in skipped:
            queues.update(node)
        return freed.result()

    def evict_host(self, num_pages: int) -> EvictResult:
        """Free at least ``num_pages`` host pages if possible. Victims are unprotected
        nodes with a host copy that either also have a device copy (they become
        device-only) or are childless and unlocked (they are removed). Mutates the tree.
        """
        freed = Freed()
        while len(freed.host) < num_pages:
            node = self._queues.pop(EvictTarget.HOST_KV)
            if node is None:
                break
            if node.device_indices is not None:
                freed.host.extend(self._detach(node, Tier.HOST, Family.KV))
            else:
                self._remove(node, freed)
        return freed.result()

    def evict_mamba_device(
        self, num_slots: int, before_evict: Callable[[TreeNode], None] | None = None
    ) -> EvictResult:
        """Free at least ``num_slots`` device Mamba slots of unlocked nodes if possible.
        A victim whose state has no host copy is first offered to ``before_evict(node)``
        (write-back: the callback backs it up and attaches the host state). A node left
        without a state on any tier is a tombstone; a childless one is removed with its
        pages, and so are childless tombstone ancestors. Mutates.
        """
        freed = Freed()
        while len(freed.mamba_device) < num_slots:
            node = self._queues.pop(EvictTarget.MAMBA_DEVICE)
            if node is None:
                break
            if node.mamba_host_slot is None and before_evict is not None:
                before_evict(node)
                self._queues.update(node)
                if not (node.alive and self._queues.holds(node, EvictTarget.MAMBA_DEVICE)):
                    continue
            freed.mamba_device.extend(self._detach(node, Tier.DEVICE, Family.STATE))
            self._after_state_loss(node, freed)
        return freed.result()

    def evict_mamba_host(self, num_slots: int) -> EvictResult:
        """Like ``evict_mamba_device`` for host slots of host-unprotected nodes."""
        freed = Freed()
        while len(freed.mamba_host) < num_slots:
            node = self._queues.pop(EvictTarget.MAMBA_HOST)
            if node is None:
                break
            freed.mamba_host.extend(self._detach(node, Tier.HOST, Family.STATE))
            self._after_state_loss(node, freed)
        return freed.result()

    def eviction_head(self, target: EvictTarget) -> tuple | None:
        """The current first entry of ``target``'s eviction queue (``(*priority, node.id,
        node)``), or None when there is no candidate. Read-only for the tree's state:
        evicts nothing (lazily re-keyed entries move to their place first). One arena
        holding KV pages and states compares the heads of its targets to pick which to evict."""
        return self._queues.head(target)

    def eviction_key(self, node: TreeNode, target: EvictTarget) -> tuple:
        """``(*priority, node.id)``: the key the policy gives ``node`` for ``target`` now,
        comparable with ``eviction_head(target)[:-1]`` (whether or not the node is a
        candidate there; path stats as last refreshed). Read-only."""
        self._check_node(node)
        return self._queues.entry(node, EvictTarget(target))[:-1]

    # --------------------------------------------------------------- accessors

    def iter_nodes(self) -> Iterator[TreeNode]:
        """All non-sentinel nodes, depth-first, namespaces in sorted order."""
        for ns in sorted(self._roots):
            stack = list(reversed(list(self._roots[ns].children.values())))
            while stack:
                node = stack.pop()
                yield node
                stack.extend(reversed(list(node.children.values())))

    def node_at(self, key: RadixKey) -> TreeNode | None:
        """The node ending exactly at ``key``'s last whole page, or None. Read-only: no
        split, no touch (for tests and tools)."""
        end = self._key_end(key)
        root = self._roots.get(key.namespace)
        if root is None or not end:
            return None
        path, pos, partial = self._walk(root, key.data, end)
        return path[-1] if path and partial is None and pos == end else None

    def kv_path(self, key: RadixKey) -> tuple[TreeNode, ...]:
        """The nodes ``key``'s whole pages run through, top-down, the last one possibly
        only partly (where the key ends or diverges inside it): the nodes an insert of
        ``key`` would give copies to. Read-only: no split, no touch."""
        end = self._key_end(key)
        root = self._roots.get(key.namespace)
        if root is None:
            return ()
        path, _pos, partial = self._walk(root, key.data, end)
        if partial is not None:
            path.append(partial[0])
        return tuple(path)

    def nodes_on_path(self, node: TreeNode) -> list[TreeNode]:
        """Non-sentinel nodes from the root down to ``node`` (inclusive)."""
        path = list(self._up(node))
        path.reverse()
        return path

    def prefix_tokens(self, node: TreeNode) -> tuple[int, ...]:
        """All tokens from the root to the end of ``node``."""
        return unpack_tokens(b"".join(n.data for n in self.nodes_on_path(node)))

    def is_tombstone(self, node: TreeNode) -> bool:
        """A node with KV but no Mamba state on any tier (only with ``has_mamba``)."""
        return self.has_mamba and not node.is_sentinel and not node.has_mamba_state

    def digest(self) -> str:
        """SHA-256 hex of the structure and tier state; equal on trees fed the same calls."""
        return integrity.digest(self)

    def check_integrity(
        self,
        device: PoolUsage | None = None,
        host: PoolUsage | None = None,
        mamba_device: PoolUsage | None = None,
        mamba_host: PoolUsage | None = None,
    ) -> None:
        """Verify every invariant; raise RuntimeError naming the first violation.

        Checks structure (child keys, parent links, page counts, chained hashes where
        computed, one KV copy at least, device prefix-closure, ``window_missing`` and
        ``host_window_missing`` inside the node and per tier), protections (counts >= 0,
        parent >= child), that every page/slot is referenced by exactly one node, cached
        totals, and that the eviction queues hold exactly the candidates, in order.
        For each pool given, also that tree-owned + free + held indices are exactly
        ``range(capacity)``, disjointly. Read-only; O(tree tokens); for tests and debugging.
        """
        pools = {"device": device, "host": host, "mamba_device": mamba_device}
        pools["mamba_host"] = mamba_host
        integrity.check_integrity(self, pools)
