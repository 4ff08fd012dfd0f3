"""Eviction candidate queues of the radix tree (DESIGN.md section 5).

One indexed min-heap per ``EvictTarget`` holds exactly the nodes that are candidates for
that target right now, each once (its position lives in ``node.queue_pos``), so a queue
never holds a stale entry and every operation is O(log candidates):

- ``DEVICE_KV``: it has a device copy, is unlocked and has no child on device;
- ``HOST_KV``: it has a host copy, is not host-protected, and either also has a device
  copy (it becomes device-only) or is a childless unlocked leaf (it is removed);
- ``MAMBA_DEVICE``: it has a device state and is unlocked;
- ``MAMBA_HOST``: it has a host state and is not host-protected.

The key of an entry is ``(*policy.priority(stats, target), node.id)``. A touch (match or
insert through a node) only stores the node's new ``last_access``/``hit_count``: for a
policy whose priority never decreases on a touch (``EvictionPolicy.monotone``, true for
LRU and LFU) a stored key is a lower bound of the node's current key, so ``pop`` re-keys
the top until the top's stored key is current, which makes it the true minimum. The tree
calls ``update(node)`` after every other change that may alter candidacy or priority.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mesh_hicache.radix.eviction import EvictionPolicy, EvictTarget, NodeStats

if TYPE_CHECKING:
    from mesh_hicache.radix.node import TreeNode

Key = tuple[int | float, ...]
#: Queue order: ``node.queue_pos[i]`` is the position in the queue of ``TARGETS[i]``.
TARGETS = (
    EvictTarget.DEVICE_KV,
    EvictTarget.HOST_KV,
    EvictTarget.MAMBA_DEVICE,
    EvictTarget.MAMBA_HOST,
)


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


class _Heap:
    """An indexed binary min-heap of nodes; positions are kept in ``node.queue_pos[q]``."""

    __slots__ = ("q", "nodes", "keys")

    def __init__(self, q: int) -> None:
        self.q = q
        self.nodes: list[TreeNode] = []
        self.keys: list[Key] = []

    def push(self, node: TreeNode, key: Key) -> None:
        self.nodes.append(node)
        self.keys.append(key)
        self._up(len(self.nodes) - 1)

    def rekey(self, node: TreeNode, key: Key) -> None:
        i = node.queue_pos[self.q]
        old = self.keys[i]
        self.keys[i] = key
        if key < old:
            self._up(i)
        elif old < key:
            self._down(i)

    def remove(self, node: TreeNode) -> None:
        q = self.q
        i = node.queue_pos[q]
        node.queue_pos[q] = -1
        last_node, last_key = self.nodes.pop(), self.keys.pop()
        if i == len(self.nodes):
            return
        self.nodes[i] = last_node
        self.keys[i] = last_key
        last_node.queue_pos[q] = i
        self._up(i)
        self._down(last_node.queue_pos[q])

    def _up(self, i: int) -> None:
        nodes, keys, q = self.nodes, self.keys, self.q
        node, key = nodes[i], keys[i]
        while i:
            p = (i - 1) >> 1
            if not key < keys[p]:
                break
            moved = nodes[p]
            nodes[i], keys[i] = moved, keys[p]
            moved.queue_pos[q] = i
            i = p
        nodes[i], keys[i] = node, key
        node.queue_pos[q] = i

    def _down(self, i: int) -> None:
        nodes, keys, q = self.nodes, self.keys, self.q
        n = len(nodes)
        node, key = nodes[i], keys[i]
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            if c + 1 < n and keys[c + 1] < keys[c]:
                c += 1
            if not keys[c] < key:
                break
            moved = nodes[c]
            nodes[i], keys[i] = moved, keys[c]
            moved.queue_pos[q] = i
            i = c
        nodes[i], keys[i] = node, key
        node.queue_pos[q] = i


class EvictionQueues:
    """The four candidate queues of one tree, ranked by ``policy``."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._heaps = tuple(_Heap(q) for q in range(len(TARGETS)))

    def key(self, node: TreeNode, target: EvictTarget) -> Key:
        """The node's current queue key for ``target``."""
        stats = NodeStats(node.last_access, node.hit_count, node.num_tokens, node.has_mamba_state)
        return (*self.policy.priority(stats, target), node.id)

    def update(self, node: TreeNode) -> None:
        """Make ``node``'s membership and keys match its current state (after a change)."""
        pos = node.queue_pos
        stats: NodeStats | None = None
        for q, wanted in enumerate(candidacy(node)):
            if wanted:
                if stats is None:
                    stats = NodeStats(
                        node.last_access, node.hit_count, node.num_tokens, node.has_mamba_state
                    )
                key = (*self.policy.priority(stats, TARGETS[q]), node.id)
                if pos[q] < 0:
                    self._heaps[q].push(node, key)
                else:
                    self._heaps[q].rekey(node, key)
            elif pos[q] >= 0:
                self._heaps[q].remove(node)

    def remove(self, node: TreeNode) -> None:
        """Take ``node`` out of every queue (it is being removed from the tree)."""
        for q, p in enumerate(node.queue_pos):
            if p >= 0:
                self._heaps[q].remove(node)

    def discard(self, node: TreeNode, target: EvictTarget) -> None:
        """Take ``node`` out of the ``target`` queue if it is there."""
        q = TARGETS.index(target)
        if node.queue_pos[q] >= 0:
            self._heaps[q].remove(node)

    def pop(self, target: EvictTarget) -> TreeNode | None:
        """Remove and return the first candidate for ``target`` in policy order (ties by
        creation id); None when there is none."""
        heap = self._heaps[TARGETS.index(target)]
        while heap.nodes:
            node = heap.nodes[0]
            key = self.key(node, target)
            if key == heap.keys[0]:
                heap.remove(node)
                return node
            heap.rekey(node, key)  # touched since it was keyed: a larger key, sift down
        return None

    def __len__(self) -> int:
        return sum(len(h.nodes) for h in self._heaps)

    def problems(self, node: TreeNode) -> list[str]:
        """What is wrong with ``node``'s queue state (for ``check_integrity``)."""
        out = []
        for q, wanted in enumerate(candidacy(node)):
            heap, i = self._heaps[q], node.queue_pos[q]
            held = 0 <= i < len(heap.nodes) and heap.nodes[i] is node
            target = TARGETS[q].value
            if wanted != held or (i >= 0 and not held):
                out.append(f"{target} candidate={wanted} but queue position {i}")
            elif held:
                key = self.key(node, TARGETS[q])
                if key < heap.keys[i] or (not self.policy.monotone and key != heap.keys[i]):
                    out.append(f"{target} queue key {heap.keys[i]} is ahead of {key}")
                if i and heap.keys[i] < heap.keys[(i - 1) >> 1]:
                    out.append(f"{target} queue order broken at position {i}")
        return out

    def sizes(self) -> dict[EvictTarget, int]:
        """Number of candidates per target."""
        return {t: len(h.nodes) for t, h in zip(TARGETS, self._heaps, strict=True)}
