"""Eviction candidate queues of the radix tree (docs/DESIGN.md section 5).

One sorted queue per ``EvictTarget`` holds exactly the nodes that are candidates for that
target right now, each once (its entry lives in ``node.queue_entry``), so a queue never
holds a stale entry and no operation walks the tree:

- ``DEVICE_KV``: it has a device copy, is unlocked and has no child on device;
- ``HOST_KV``: it has a host copy, is not host-protected, and either also has a device
  copy (it becomes device-only) or is a childless unlocked leaf (it is removed);
- ``MAMBA_DEVICE``: it has a device state and is unlocked;
- ``MAMBA_HOST``: it has a host state and is not host-protected.

An entry is ``(*policy.priority(stats, target), node.id, node)`` (ids are unique, so two
entries never compare their nodes). A queue is a list of sorted runs of at most
``2 * _RUN`` entries with each run's last entry in ``maxes``: add, remove and first are a
C bisect plus a memmove of at most one run, so their cost stays flat as the tree grows
(a Python binary heap pays one interpreted step per level instead).

A touch (match or insert through a node) only stores the node's new ``last_access`` /
``hit_count``: for a policy whose priority never decreases on a touch
(``EvictionPolicy.monotone``, true for LRU and LFU) a stored key is a lower bound of the
node's current key, so ``pop`` re-keys the first entry until its stored key is current,
which makes it the true minimum. The tree calls ``update(node)`` after every other change
that may alter candidacy or priority; under LRU (whose key only a touch changes) it only
adds and drops candidates and never re-keys a queued one.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mesh_hicache.radix.eviction import (
    EvictionPolicy,
    EvictTarget,
    LRUPolicy,
    NodeStats,
    path_stats,
)

if TYPE_CHECKING:
    from mesh_hicache.radix.node import TreeNode

Entry = tuple[Any, ...]
#: Queue order: ``node.queue_entry[i]`` is the node's entry in the queue of ``TARGETS[i]``.
TARGETS = (
    EvictTarget.DEVICE_KV,
    EvictTarget.HOST_KV,
    EvictTarget.MAMBA_DEVICE,
    EvictTarget.MAMBA_HOST,
)


#: The tier (0 device, 1 host) whose GreedyDual clock ages each target.
_TIER = {
    EvictTarget.DEVICE_KV: 0,
    EvictTarget.MAMBA_DEVICE: 0,
    EvictTarget.HOST_KV: 1,
    EvictTarget.MAMBA_HOST: 1,
}


_STATE = (EvictTarget.MAMBA_DEVICE, EvictTarget.MAMBA_HOST)


def candidacy(node: TreeNode) -> tuple[bool, bool, bool, bool]:
    """Whether ``node`` is a candidate for each of ``TARGETS`` (see the module docstring)."""
    if node.is_sentinel or not node.alive:
        return (False, False, False, False)
    unlocked = node.lock_ref == 0
    on_device = node.device_indices is not None
    host_free = node.host_ref == 0
    return (
        on_device and unlocked and not node.num_device_children,
        node.host_indices is not None
        and host_free
        and (on_device or (not node.children and unlocked)),
        node.mamba_device_slot is not None and unlocked,
        node.mamba_host_slot is not None and host_free,
    )


def is_candidate(node: TreeNode, target: EvictTarget) -> bool:
    """Whether ``node`` may be evicted for ``target`` now."""
    return candidacy(node)[TARGETS.index(target)]


_RUN = 256


class _SortedEntries:
    """Entries in ascending order, as sorted runs (``runs``) with their last entries
    (``maxes``): bisect to the run, bisect inside it."""

    __slots__ = ("runs", "maxes", "size")

    def __init__(self) -> None:
        self.runs: list[list[Entry]] = []
        self.maxes: list[Entry] = []
        self.size = 0

    def _run_of(self, entry: Entry) -> int:
        """Index of the run ``entry`` belongs in (``len(maxes)`` past the last one): the
        first and last runs are checked before a bisect, since eviction adds and removes
        near the front (a parent queued after its child) and touches re-add at the back
        (the bisect's reads across a large queue miss the CPU cache)."""
        maxes = self.maxes
        if entry <= maxes[0]:
            return 0
        if entry > maxes[-1]:
            return len(maxes)
        return bisect_left(maxes, entry)

    def add(self, entry: Entry) -> None:
        runs, maxes = self.runs, self.maxes
        self.size += 1
        if not maxes:
            runs.append([entry])
            maxes.append(entry)
            return
        i = self._run_of(entry)
        if i == len(maxes):
            i -= 1
            run = runs[i]
            run.append(entry)
            maxes[i] = entry
        else:
            run = runs[i]
            run.insert(bisect_left(run, entry), entry)
        if len(run) > 2 * _RUN:
            runs.insert(i + 1, run[_RUN:])
            del run[_RUN:]
            maxes.insert(i + 1, maxes[i])
            maxes[i] = run[-1]

    def remove(self, entry: Entry) -> None:
        maxes = self.maxes
        i = self._run_of(entry)
        run = self.runs[i]
        j = bisect_left(run, entry)
        assert run[j] is entry, "queue entry missing"
        del run[j]
        self.size -= 1
        if not run:
            del self.runs[i]
            del maxes[i]
        elif j == len(run):
            maxes[i] = run[-1]

    def first(self) -> Entry | None:
        return self.runs[0][0] if self.runs else None

    def pop_first(self) -> None:
        """Remove the first entry (no search: the entries a bisect would read are the
        coldest of the queue)."""
        run = self.runs[0]
        del run[0]
        self.size -= 1
        if not run:
            del self.runs[0]
            del self.maxes[0]

    def __iter__(self) -> Iterator[Entry]:
        for run in self.runs:
            yield from run


class EvictionQueues:
    """The four candidate queues of one tree, ranked by ``policy``.

    ``clock``: the tree's logical clock (``aging`` policies date each clock step by it;
    without it the latest ``last_access`` seen stands in). ``has_mamba``: whether hits
    need a state (``path_stats``: which ancestor could serve instead of a node).
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        clock: Callable[[], int] | None = None,
        has_mamba: bool = True,
    ) -> None:
        self.policy = policy
        policy.has_mamba = has_mamba
        self._queues = tuple(_SortedEntries() for _ in TARGETS)
        self._clock = clock
        self._has_mamba = has_mamba
        self._path = policy.path_stats
        self._aging = policy.aging
        self._select = type(policy).select is not EvictionPolicy.select
        self._on_evict = policy.on_evict  # None unless the policy learns from its victims
        # LRU's key is (last_access, id, node) for every target: built directly, once per
        # update, without a NodeStats (the same entries the generic path would build), and
        # a queued node is not re-keyed by an update (``_update_lru``).
        self._lru = type(policy).priority is LRUPolicy.priority and not self._aging
        # ``pop`` for plain LRU (no path stats, no select, no on_evict): ``_pop_lru``.
        self._fast_pop = (
            self._lru and not self._path and not self._select and self._on_evict is None
        )
        self._seen = 0
        # Per tier (0 device, 1 host): GreedyDual clock steps (from logical time, value).
        self._steps: tuple[tuple[list[int], list[float]], ...] = (([0], [0.0]), ([0], [0.0]))

    def stats(self, node: TreeNode, target: EvictTarget) -> NodeStats:
        """What the policy sees of ``node`` for ``target`` (``anchor_len`` as last refreshed)."""
        if not self._path and not self._aging:
            n = node
            return NodeStats(n.last_access, n.hit_count, n.num_tokens, n.has_mamba_state)
        inflation = 0.0
        if self._aging:
            times, values = self._steps[_TIER[target]]
            # An inner node's state ages from its last use as a resume point, not from
            # the matches that only passed through it.
            t = node.last_access
            if target in _STATE and node.children:
                t = node.state_access
            inflation = values[bisect_right(times, t) - 1]
        return path_stats(node, self._has_mamba, inflation)

    def entry(self, node: TreeNode, target: EvictTarget) -> Entry:
        """The node's current queue entry for ``target``."""
        if self._lru:
            return (node.last_access, node.id, node)
        return (*self.policy.priority(self.stats(node, target), target), node.id, node)

    def _refresh(self, node: TreeNode) -> None:
        """Re-derive the node's ``anchor_len`` (a walk up to the nearest state)."""
        if node.last_access > self._seen:
            self._seen = node.last_access
        if not self._path:
            return
        parent = node.parent
        if self._has_mamba:
            while parent is not None and not parent.is_sentinel and not parent.has_mamba_state:
                parent = parent.parent
        node.anchor_len = parent.prefix_len if parent is not None and not parent.is_sentinel else 0

    def _now(self) -> int:
        """The tree's logical clock (the latest ``last_access`` seen without one)."""
        return self._clock() if self._clock is not None else self._seen

    def _age(self, target: EvictTarget, key: Entry) -> None:
        """GreedyDual: the tier's clock becomes the victim's priority (never decreases);
        nodes touched from the next logical time on see the new value."""
        times, values = self._steps[_TIER[target]]
        level = float(key[0])
        if level <= values[-1]:
            return
        now = (self._clock() if self._clock is not None else self._seen) + 1
        if times[-1] >= now:
            values[-1] = level
        else:
            times.append(now)
            values.append(level)

    def update(self, node: TreeNode) -> None:
        """Make ``node``'s membership and keys match its current state (after a change)."""
        if self._lru:
            self._update_lru(node)
            return
        held = node.queue_entry
        queues = self._queues
        refreshed = False
        stats: NodeStats | None = None
        for q, wanted in enumerate(candidacy(node)):
            old = held[q]
            if wanted:
                if not refreshed:
                    self._refresh(node)
                    refreshed = True
                target = TARGETS[q]
                if stats is None or self._aging:  # the tier's clock enters the stats
                    stats = self.stats(node, target)
                new = (*self.policy.priority(stats, target), node.id, node)
                if old is not None:
                    if old == new:
                        continue
                    queues[q].remove(old)
                queues[q].add(new)
                held[q] = new
            elif old is not None:
                queues[q].remove(old)
                held[q] = None

    def _update_lru(self, node: TreeNode) -> None:
        """``update`` for LRU: a node already queued keeps its entry. Its key is its
        ``last_access``, which only a touch changes and only upwards, so the stored key
        stays a lower bound that ``head`` re-keys once it reaches the front: no queue
        work here for a node that only changed its neighbours (an evicted child, a lock),
        and none at all for nodes removed before they reach the front."""
        held = node.queue_entry
        new: Entry | None = None
        for q, wanted in enumerate(candidacy(node)):
            old = held[q]
            if wanted:
                if old is None:
                    if new is None:
                        if node.last_access > self._seen:
                            self._seen = node.last_access
                        new = (node.last_access, node.id, node)
                    self._queues[q].add(new)
                    held[q] = new
            elif old is not None:
                self._queues[q].remove(old)
                held[q] = None

    def remove(self, node: TreeNode) -> None:
        """Take ``node`` out of every queue (it is being removed from the tree)."""
        held = node.queue_entry
        for q, old in enumerate(held):
            if old is not None:
                self._queues[q].remove(old)
                held[q] = None

    def discard(self, node: TreeNode, target: EvictTarget) -> None:
        """Take ``node`` out of the ``target`` queue if it is there."""
        q = TARGETS.index(target)
        old = node.queue_entry[q]
        if old is not None:
            self._queues[q].remove(old)
            node.queue_entry[q] = None

    def holds(self, node: TreeNode, target: EvictTarget) -> bool:
        """Whether ``node`` is in the ``target`` queue."""
        return node.queue_entry[TARGETS.index(target)] is not None

    def pop(self, target: EvictTarget) -> TreeNode | None:
        """Remove and return the first candidate for ``target`` in policy order (ties by
        creation id); None when there is none. An ``aging`` policy's tier clock takes the
        victim's priority; a policy with ``select`` picks among all candidates."""
        q = TARGETS.index(target)
        if self._fast_pop:
            return self._pop_lru(q)
        queue = self._queues[q]
        if self._select and queue.size > 1:
            entries = list(queue)
            i = self.policy.select(entries, target)
            if i is not None:
                chosen = entries[i]
                node = chosen[-1]
                queue.remove(chosen)
                node.queue_entry[q] = None
                if self._on_evict is not None:
                    self._on_evict(node, target, self.stats(node, target), self._now())
                return node
        first = self.head(target)
        if first is None:
            return None
        node = first[-1]
        queue.pop_first()  # ``head`` left ``first`` at the front
        node.queue_entry[q] = None
        if self._aging:
            self._age(target, first)
        if self._on_evict is not None:
            self._on_evict(node, target, self.stats(node, target), self._now())
        return node

    def _pop_lru(self, q: int) -> TreeNode | None:
        """``pop`` under plain LRU, written out: the first entry is re-keyed (moved back)
        until its stored ``last_access`` is the node's current one, then taken."""
        queue = self._queues[q]
        runs = queue.runs
        while runs:
            run = runs[0]
            first = run[0]
            node: TreeNode = first[-1]
            last = node.last_access
            if last != first[0]:  # touched since it was keyed: a later place
                queue.pop_first()
                current = (last, node.id, node)
                queue.add(current)
                node.queue_entry[q] = current
                continue
            del run[0]
            queue.size -= 1
            if not run:
                del runs[0]
                del queue.maxes[0]
            node.queue_entry[q] = None
            if last > self._seen:
                self._seen = last
            return node
        return None

    def head(self, target: EvictTarget) -> Entry | None:
        """The exact first entry of the ``target`` queue (lazily re-keyed entries moved to
        their place first), without removing it; None when the queue is empty. Keys of
        different targets are comparable for the built-in policies (one arena can pick
        the family to evict by comparing heads)."""
        q = TARGETS.index(target)
        queue = self._queues[q]
        while True:
            first = queue.first()
            if first is None:
                return None
            node: TreeNode = first[-1]
            anchor = node.anchor_len
            self._refresh(node)
            if node.anchor_len != anchor:
                self.update(node)  # the anchor keys every queue of the node: re-key them all
                continue
            current = self.entry(node, target)
            if current == first:
                return first
            queue.remove(first)
            queue.add(current)  # touched since it was keyed: a later place
            node.queue_entry[q] = current

    def __len__(self) -> int:
        return sum(queue.size for queue in self._queues)

    def problems(self, node: TreeNode) -> list[str]:
        """What is wrong with ``node``'s queue state (for ``check_integrity``)."""
        out = []
        for q, wanted in enumerate(candidacy(node)):
            held = node.queue_entry[q]
            target = TARGETS[q].value
            if wanted != (held is not None):
                out.append(f"{target} candidate={wanted} but queue entry {held!r}")
            elif held is not None:
                current = self.entry(node, TARGETS[q])
                if current < held or (not self.policy.monotone and current != held):
                    out.append(f"{target} queue key {held[:-1]} is ahead of {current[:-1]}")
        return out

    def order_problems(self) -> list[str]:
        """Queues out of order, or holding entries of dead nodes (for ``check_integrity``)."""
        out = []
        for target, queue in zip(TARGETS, self._queues, strict=True):
            entries = list(queue)
            if entries != sorted(entries) or len(entries) != queue.size:
                out.append(f"{target.value} queue is out of order")
            if [run[-1] for run in queue.runs] != queue.maxes or not all(queue.runs):
                out.append(f"{target.value} queue runs are inconsistent")
            q = TARGETS.index(target)
            if any(e[-1].queue_entry[q] is not e or not e[-1].alive for e in entries):
                out.append(f"{target.value} queue holds an entry its node does not know")
        return out

    def sizes(self) -> dict[EvictTarget, int]:
        """Number of candidates per target."""
        return {t: q.size for t, q in zip(TARGETS, self._queues, strict=True)}
