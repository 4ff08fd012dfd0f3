"""The radix tree's structure and the mutations that keep its invariants (docs/DESIGN.md section 5).

``TreeCore`` owns the nodes, the per-tier totals and the eviction queues, and offers the
one verb pair for tier transitions (``attach`` / ``detach``, keyed by ``Tier`` and
``Family``); ``RadixTree`` (tree.py) builds match, insert, protection and eviction on top
of it. Every mutation here keeps:

- every non-sentinel node holds a KV copy on device, on host, or on both, for all its pages;
- device copies are prefix-closed: a node on device has its parent on device (or the
  parent is a sentinel);
- a Mamba state belongs to the node's last token; on a split it stays with the deeper part;
- ``lock_ref`` / ``host_ref`` count protections of the whole path to the root;
- ``window_missing`` / ``host_window_missing`` offsets lie inside the node and follow its
  pages on a split; ``host_window_missing`` is empty without a host copy, and a node
  without a device copy has ``window_missing == host_window_missing`` (the gaps are kept
  per tier: ``window_missing`` is always the gaps of the copy a match reads);
- a node is in an eviction queue exactly when it is a candidate for that target.

Positions inside packed data are byte offsets (8 bytes per token); ``self._page_bytes`` is
the bytes of one page.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence

from mesh_hicache.radix.eviction import EvictionPolicy, LRUPolicy
from mesh_hicache.radix.hashing import TOKEN_BYTES, RadixKey
from mesh_hicache.radix.node import NO_PAGES, EvictResult, Family, Tier, TreeNode
from mesh_hicache.radix.queues import EvictionQueues
from mesh_hicache.spec import WindowSpec

#: (tier, family) -> (node attribute, tree total).
_FIELDS = {
    (Tier.DEVICE, Family.KV): ("device_indices", "num_device_pages"),
    (Tier.HOST, Family.KV): ("host_indices", "num_host_pages"),
    (Tier.DEVICE, Family.STATE): ("mamba_device_slot", "num_mamba_device_slots"),
    (Tier.HOST, Family.STATE): ("mamba_host_slot", "num_mamba_host_slots"),
}


class Freed:
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


def page_set(pages: Iterable[int]) -> frozenset[int]:
    """``pages`` as a frozenset (the shared ``NO_PAGES`` when empty)."""
    return frozenset(pages) or NO_PAGES


def common_bytes(
    data: bytes, pos: int, other: bytes, page_bytes: int, stop: int | None = None
) -> int:
    """Bytes of ``other`` that equal ``data[pos:stop]``, in whole pages; the first page is
    known to match. A binary search over pages: O(log pages) native comparisons, O(bytes)
    copied."""
    end = min(len(other), (len(data) if stop is None else stop) - pos)
    if data[pos : pos + end] == other[:end]:
        return end
    lo, hi = 1, end // page_bytes  # pages: the first ``lo`` match, the first ``hi`` do not
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        a, b = lo * page_bytes, mid * page_bytes
        if data[pos + a : pos + b] == other[a:b]:
            lo = mid
        else:
            hi = mid
    return lo * page_bytes


class TreeCore:
    """Nodes, totals and queues of a radix tree, and its invariant-keeping mutations."""

    def __init__(
        self,
        page_size: int,
        has_mamba: bool,
        policy: EvictionPolicy | None = None,
        *,
        windows: Sequence[WindowSpec] = (),
    ) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if not isinstance(has_mamba, bool):
            raise TypeError(f"has_mamba must be a bool, got {has_mamba!r}")
        if policy is not None and not isinstance(policy, EvictionPolicy):
            raise TypeError(f"policy must be an EvictionPolicy or None, got {policy!r}")
        windows = tuple(windows)
        if not all(isinstance(g, WindowSpec) for g in windows):
            raise TypeError(f"windows must be WindowSpec groups, got {windows!r}")
        self.page_size = page_size
        self.has_mamba = has_mamba
        #: Sliding-window layer groups; with none, ``window_missing`` stays empty.
        self.windows = windows
        self.policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        #: Logical clock: advanced once per match/insert; stamps ``last_access``.
        self.clock = 0
        self._page_bytes = page_size * TOKEN_BYTES
        self._next_id = 0
        self._roots: dict[str, TreeNode] = {}
        # Returned as ``last_node`` on a miss in a namespace the tree has never seen.
        self._miss_root = TreeNode(-1, "", None, b"", 0, is_sentinel=True)
        self._queues = EvictionQueues(self.policy, clock=lambda: self.clock, has_mamba=has_mamba)
        self._rekey_on_touch = not self.policy.monotone
        self._on_match = self.policy.on_match  # None unless the policy learns from requests
        self.num_nodes = 0
        self.num_device_pages = 0
        self.num_host_pages = 0
        self.num_mamba_device_slots = 0
        self.num_mamba_host_slots = 0

    # ---------------------------------------------------------------- checks

    def _key_end(self, key: RadixKey) -> int:
        """Bytes of ``key.data`` in whole pages (nothing is copied, no token is looked at)."""
        if type(key) is not RadixKey and not isinstance(key, RadixKey):
            raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")
        n = len(key.data)
        return n - n % self._page_bytes

    @staticmethod
    def _check_indices(
        name: str, indices: Sequence[int] | None, num_pages: int
    ) -> tuple[int, ...] | None:
        if indices is None:
            return None
        out = tuple(map(operator.index, indices))
        if len(out) != num_pages:
            raise ValueError(
                f"{name} must hold {num_pages} pages (one per whole page), got {len(out)}"
            )
        return out

    def _check_missing(self, pages: Iterable[int], first: int, num_pages: int) -> frozenset[int]:
        """``window_missing`` of an insert or attach: page indices in ``[first, num_pages)``
        (the pages given), only in a tree with ``windows``."""
        out = page_set(map(operator.index, pages))
        if out and not self.windows:
            raise ValueError("window_missing given to a RadixTree built without windows")
        bad = sorted(p for p in out if not first <= p < num_pages)
        if bad:
            raise ValueError(f"window_missing pages must lie in [{first}, {num_pages}), got {bad}")
        return out

    def cached_device_pages(self, key: RadixKey) -> tuple[int, ...]:
        """The device pages the tree holds for the leading whole pages of ``key``, in order:
        exactly the positions where ``insert(key, device_indices=...)`` would not take the
        given page (device copies are prefix-closed). Read-only: no split, no touch."""
        end = self._key_end(key)
        root = self._roots.get(key.namespace)
        if root is None:
            return ()
        path, _pos, partial = self._walk(root, key.data, end)
        out: list[int] = []
        for node in path:
            if node.device_indices is None:
                return tuple(out)
            out.extend(node.device_indices)
        if partial is not None and partial[0].device_indices is not None:
            out.extend(partial[0].device_indices[: partial[1] // self._page_bytes])
        return tuple(out)

    def _check_node(self, node: TreeNode) -> None:
        if not isinstance(node, TreeNode) or node.is_sentinel or not node.alive:
            raise ValueError(f"expected a live non-sentinel node of this tree, got {node!r}")

    # ------------------------------------------------------------- structure

    def _new_node(
        self, namespace: str, parent: TreeNode | None, data: bytes, sentinel: bool = False
    ) -> TreeNode:
        num_pages = len(data) // self._page_bytes
        node = TreeNode(self._next_id, namespace, parent, data, num_pages, is_sentinel=sentinel)
        self._next_id += 1
        if not sentinel:
            self.num_nodes += 1
        return node

    def _touch(self, node: TreeNode, hit: bool) -> None:
        """Stamp an access (a timestamp store; queues re-rank lazily, see queues.py)."""
        node.last_access = self.clock
        if hit:
            node.hit_count += 1
        if self._rekey_on_touch:
            self._queues.update(node)

    @staticmethod
    def _up(node: TreeNode) -> Iterator[TreeNode]:
        n: TreeNode | None = node
        while n is not None and not n.is_sentinel:
            yield n
            n = n.parent

    def _walk(
        self, root: TreeNode, data: bytes, end: int
    ) -> tuple[list[TreeNode], int, tuple[TreeNode, int] | None]:
        """Fully matched nodes, their byte count, and (node, bytes) of a partial match,
        over ``data[:end]`` (``end`` a whole number of pages)."""
        pb = self._page_bytes
        path: list[TreeNode] = []
        append = path.append
        children = root.children
        pos = 0
        while pos < end:
            child = children.get(data[pos : pos + pb])
            if child is None:
                break
            cd = child.data
            if not data.startswith(cd, pos, end):
                return path, pos, (child, common_bytes(data, pos, cd, pb, end))
            append(child)
            pos += len(cd)
            children = child.children
        return path, pos, None

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` bytes; returns the new upper node. The Mamba state
        stays with ``child`` (the deeper part), protections and stats are copied up,
        ``window_missing`` and ``host_window_missing`` are divided between the parts."""
        pb = self._page_bytes
        j = m // pb
        parent = child.parent
        assert parent is not None and 0 < m < len(child.data) and m % pb == 0
        upper = self._new_node(child.namespace, parent, child.data[:m])
        if child.device_indices is not None:
            upper.device_indices = child.device_indices[:j]
            child.device_indices = child.device_indices[j:]
            upper.num_device_children = 1
        if child.host_indices is not None:
            upper.host_indices = child.host_indices[:j]
            child.host_indices = child.host_indices[j:]
        if child._hashes is not None:
            upper._hashes, child._hashes = child._hashes[:j], child._hashes[j:]
        missing, host_missing = child.window_missing, child.host_window_missing
        if missing:
            upper.window_missing = page_set(p for p in missing if p < j)
            child.window_missing = page_set(p - j for p in missing if p >= j)
        if host_missing:
            if host_missing is missing:  # a host-only node: one set serves both names
                upper.host_window_missing = upper.window_missing
                child.host_window_missing = child.window_missing
            else:
                upper.host_window_missing = page_set(p for p in host_missing if p < j)
                child.host_window_missing = page_set(p - j for p in host_missing if p >= j)
        upper.lock_ref = child.lock_ref
        upper.host_ref = child.host_ref
        upper.hit_count = child.hit_count
        upper.last_access = child.last_access
        parent.children[upper.data[:pb]] = upper
        child.data = child.data[m:]
        child.num_pages -= j
        child.parent = upper
        upper.children[child.data[:pb]] = child
        self._queues.update(upper)
        self._queues.update(child)
        return upper

    @staticmethod
    def _pages_in(missing: frozenset[int], lo: int, hi: int) -> frozenset[int]:
        """The pages ``missing`` of a key that lie in ``[lo, hi)``, as offsets from ``lo``
        (the gaps of a node holding the key's pages ``[lo, hi)``)."""
        return page_set(p - lo for p in missing if lo <= p < hi)

    # -------------------------------------------------------- tier transitions

    def attach(
        self,
        node: TreeNode,
        tier: Tier,
        family: Family,
        indices: Sequence[int],
        window_missing: Iterable[int] = (),
    ) -> None:
        """Record a copy of ``node`` on ``tier``: its KV pages (``indices``: one page per page
        of the node) or its recurrent state (``indices``: one slot). After a backup
        (host) or a load (device). ValueError if the node already has that copy, if a
        device KV copy would hang below a parent that is not on device (load a path
        top-down), or for a state in a tree without Mamba.

        ``window_missing`` (KV, a tree with ``windows``): offsets of the node's pages
        (0 = its first) whose windowed K/V the new copy lacks. A host copy (a backup,
        which may keep only the windowed pages a resume needs) records them as
        ``host_window_missing``; a match keeps reading the device copy's gaps. A device
        copy (a load from the host copy) lacks them and the host copy's gaps too: the
        device rows of pages the host never held are not valid.
        """
        self._check_node(node)
        tier, family = Tier(tier), Family(family)
        what = f"attach({tier.value}, {family.value})"
        missing = self._check_missing(window_missing, 0, node.num_pages)
        if family is Family.STATE:
            if missing:
                raise ValueError(f"{what}: window_missing is for KV copies, got {sorted(missing)}")
            self._check_state_family()
            if len(indices) != 1:
                raise ValueError(f"{what}: a state takes one slot, got {indices!r}")
            if (
                node.mamba_device_slot if tier is Tier.DEVICE else node.mamba_host_slot
            ) is not None:
                raise ValueError(f"{what}: {node!r} already has a {tier.value} state")
            self._attach(node, tier, family, operator.index(indices[0]))
            return
        if (node.device_indices if tier is Tier.DEVICE else node.host_indices) is not None:
            raise ValueError(f"{what}: {node!r} already has a {tier.value} copy")
        if tier is Tier.DEVICE:
            parent = node.parent
            assert parent is not None
            if not parent.is_sentinel and parent.device_indices is None:
                raise ValueError(f"{what}: the parent of {node!r} is not on device")
        idx = self._check_indices(f"{tier.value} indices", indices, node.num_pages)
        self._attach(node, tier, family, idx)
        if tier is Tier.HOST:
            node.host_window_missing = missing
            if node.device_indices is None:
                node.window_missing = missing
        else:
            host_missing = node.host_window_missing
            node.window_missing = host_missing.union(missing) if missing else host_missing

    def fill_window(self, node: TreeNode, tier: Tier, offsets: Iterable[int]) -> None:
        """Record that ``node``'s copy on ``tier`` now holds the windowed K/V of its pages
        ``offsets`` (copied there later: a branch point's window backed up to host, or a
        request's recomputed pages into a device copy that lacked them). Offsets the copy
        held already are fine. ValueError without that copy or for offsets outside the
        node."""
        self._check_node(node)
        tier = Tier(tier)
        if (node.device_indices if tier is Tier.DEVICE else node.host_indices) is None:
            raise ValueError(f"fill_window: {node!r} has no {tier.value} copy")
        filled = self._check_missing(offsets, 0, node.num_pages)
        if tier is Tier.HOST:
            node.host_window_missing = page_set(node.host_window_missing - filled)
        if tier is Tier.DEVICE or node.device_indices is None:
            gaps = node.host_window_missing if tier is Tier.HOST else node.window_missing
            node.window_missing = page_set(gaps - filled)

    def detach(
        self, node: TreeNode, tier: Tier, family: Family, invalid: bool = False
    ) -> tuple[int, ...]:
        """Drop the copy of ``node`` on ``tier``; returns its pages (KV) or ``(slot,)``.

        KV device: the node must be unlocked, host-backed and have no child on device;
        its ``window_missing`` becomes the host copy's (what a match reads now).
        KV host: the node must also have a device copy and not be host-protected, unless
        ``invalid`` (the host copy never held valid data, its backup failed, so no reader
        can rely on it); ``host_window_missing`` is cleared. State: never removes the
        node (a childless tombstone goes at a later eviction). ValueError otherwise.
        """
        self._check_node(node)
        tier, family = Tier(tier), Family(family)
        what = f"detach({tier.value}, {family.value})"
        if family is Family.STATE:
            self._check_state_family()
            if (node.mamba_device_slot if tier is Tier.DEVICE else node.mamba_host_slot) is None:
                raise ValueError(f"{what}: {node!r} has no {tier.value} state")
        elif node.host_indices is None or node.device_indices is None:
            raise ValueError(f"{what}: {node!r} needs both a host and a device copy")
        elif tier is Tier.DEVICE and (node.lock_ref > 0 or node.num_device_children > 0):
            raise ValueError(f"{what}: {node!r} is locked or has children on device")
        elif tier is Tier.HOST and node.host_ref > 0 and not invalid:
            raise ValueError(f"{what}: {node!r} is host-protected")
        return self._detach(node, tier, family)

    def _check_state_family(self) -> None:
        if not self.has_mamba:
            raise ValueError("Mamba state operation on a RadixTree built with has_mamba=False")

    # ---------------------------------------------------- tier state, counts

    def _attach(self, node: TreeNode, tier: Tier, family: Family, value: object) -> None:
        """Record ``value`` (a page tuple, or a slot int) at (tier, family). Unchecked."""
        attr, total = _FIELDS[(tier, family)]
        assert getattr(node, attr) is None
        setattr(node, attr, value)
        size = len(value) if family is Family.KV else 1  # type: ignore[arg-type]
        setattr(self, total, getattr(self, total) + size)
        if tier is Tier.DEVICE and family is Family.KV:
            parent = node.parent
            assert parent is not None
            parent.num_device_children += 1
            self._queues.update(parent)
        self._queues.update(node)

    def _detach(
        self, node: TreeNode, tier: Tier, family: Family, requeue: bool = True
    ) -> tuple[int, ...]:
        """Drop (tier, family) of ``node``; returns the pages, or the one slot. Unchecked.
        ``requeue=False``: the caller updates the queues itself (a node being removed).
        Dropping a KV copy drops its windowed-K/V gaps: without the device copy a match
        reads the host copy's."""
        attr, total = _FIELDS[(tier, family)]
        value = getattr(node, attr)
        assert value is not None
        setattr(node, attr, None)
        out: tuple[int, ...] = value if family is Family.KV else (value,)
        setattr(self, total, getattr(self, total) - len(out))
        if family is Family.KV:
            if tier is Tier.DEVICE:
                node.window_missing = node.host_window_missing
                parent = node.parent
                assert parent is not None
                parent.num_device_children -= 1
                if requeue:
                    self._queues.update(parent)
            else:
                node.host_window_missing = NO_PAGES
        if requeue:
            self._queues.update(node)
        return out

    def _add_ref(self, node: TreeNode, attr: str, delta: int, undo_of: str) -> None:
        """Add ``delta`` to the ``attr`` count (lock_ref / host_ref) of ``node``'s path.

        Candidacy changes only when a count crosses zero. ValueError when undoing
        (``delta < 0``) a protection the path does not hold.
        """
        path = list(self._up(node))
        if delta < 0 and any(getattr(n, attr) <= 0 for n in path):
            raise ValueError(f"{undo_of} of {node!r} without a matching protection")
        for n in path:
            count = getattr(n, attr) + delta
            setattr(n, attr, count)
            if count == 0 or count == delta:
                self._queues.update(n)

    def _after_state_loss(self, node: TreeNode, freed: Freed) -> None:
        """Remove ``node`` if it became a childless, unprotected tombstone."""
        if (
            self.has_mamba
            and not node.has_mamba_state
            and not node.children
            and node.lock_ref == 0
            and node.host_ref == 0
        ):
            self._remove(node, freed)

    def _remove(self, node: TreeNode, freed: Freed) -> None:
        """Remove a childless unprotected node, freeing everything it holds, then its
        ancestors that became childless tombstones."""
        pb = self._page_bytes
        while True:
            assert not node.children and node.lock_ref == 0 and node.host_ref == 0
            parent = node.parent
            assert parent is not None and not node.is_sentinel
            # What ``_detach(..., requeue=False)`` does for each copy, written out (no
            # (tier, family) lookups: this runs once per removed node).
            pages = node.device_indices
            if pages is not None:
                node.device_indices = None
                self.num_device_pages -= len(pages)
                parent.num_device_children -= 1
                freed.device.extend(pages)
            pages = node.host_indices
            if pages is not None:
                node.host_indices = None
                self.num_host_pages -= len(pages)
                freed.host.extend(pages)
            slot = node.mamba_device_slot
            if slot is not None:
                node.mamba_device_slot = None
                self.num_mamba_device_slots -= 1
                freed.mamba_device.append(slot)
            slot = node.mamba_host_slot
            if slot is not None:
                node.mamba_host_slot = None
                self.num_mamba_host_slots -= 1
                freed.mamba_host.append(slot)
            children = parent.children
            if len(children) == 1:  # the only child: no key to cut, hash and compare
                assert next(iter(children.values())) is node
                children.clear()
            else:
                del children[node.data[:pb]]
            node.alive = False
            self._queues.remove(node)
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
            self._queues.update(parent)
            return
