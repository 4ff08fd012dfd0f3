"""Stateful property test: RadixTree against a flat oracle.

The oracle maps every page-aligned prefix (namespace, tokens) to its device/host page and
every checkpoint prefix to its device/host Mamba slot. Random inserts, matches, locks,
protections, tier changes and evictions are applied to both; evictions are mirrored
into the oracle from the indices the tree returns, so the oracle also checks that the
tree frees exactly what it stops referencing. After every step ``check_integrity`` holds
with the test's free lists, and every match equals the oracle's answer (the longest
page-aligned common prefix, cut back to the deepest checkpoint with Mamba).
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from mesh_hicache.radix import EvictResult, Family, PoolUsage, RadixKey, RadixTree, Tier, TreeNode

CAPACITY = {"device": 40, "host": 60, "mamba_device": 10, "mamba_host": 10}
Prefix = tuple[str, tuple[int, ...]]

tokens_st = st.lists(st.integers(0, 2), max_size=10)
ns_st = st.sampled_from(["", "t"])


class RadixMachine(RuleBasedStateMachine):
    page_size = 2
    has_mamba = True

    @initialize()
    def setup(self) -> None:
        self.tree = RadixTree(self.page_size, self.has_mamba)
        self.free = {pool: list(range(cap)) for pool, cap in CAPACITY.items()}
        # prefix -> [device page, host page]; prefix -> [device slot, host slot]
        self.pages: dict[Prefix, list[int | None]] = {}
        self.states: dict[Prefix, list[int | None]] = {}
        # (node, kind, snapshot of the indices the protection must keep)
        self.protected: list[tuple[TreeNode, str, dict[Prefix, int]]] = []

    # ---------------------------------------------------------------- helpers

    def alloc(self, pool: str, n: int) -> list[int] | None:
        if len(self.free[pool]) < n:
            return None
        out, self.free[pool] = self.free[pool][:n], self.free[pool][n:]
        return out

    def prefixes(self, ns: str, tokens: tuple[int, ...]) -> list[Prefix]:
        ps = self.page_size
        return [(ns, tokens[: i * ps]) for i in range(1, len(tokens) // ps + 1)]

    def node_prefixes(self, node: TreeNode) -> list[Prefix]:
        full = self.tree.prefix_tokens(node)
        return self.prefixes(node.namespace, full)[-node.num_pages :]

    def pick(self, data: Any) -> TreeNode | None:
        nodes = list(self.tree.iter_nodes())
        return data.draw(st.sampled_from(nodes)) if nodes else None

    def mirror(self, r: EvictResult) -> None:
        """Apply what the tree freed to the oracle, checking each index was referenced."""
        for tier, pool, freed in ((0, "device", r.device_pages), (1, "host", r.host_pages)):
            for i in freed:
                owners = [p for p, e in self.pages.items() if e[tier] == i]
                assert len(owners) == 1, f"freed {pool} page {i} owned by {owners}"
                self.pages[owners[0]][tier] = None
                self.free[pool].append(i)
        for tier, pool, freed in (
            (0, "mamba_device", r.mamba_device_slots),
            (1, "mamba_host", r.mamba_host_slots),
        ):
            for i in freed:
                owners = [p for p, e in self.states.items() if e[tier] == i]
                assert len(owners) == 1, f"freed {pool} slot {i} owned by {owners}"
                self.states[owners[0]][tier] = None
                self.free[pool].append(i)
        self.pages = {p: e for p, e in self.pages.items() if e != [None, None]}
        self.states = {p: e for p, e in self.states.items() if e != [None, None]}
        for p in self.states:
            assert p in self.pages, f"state at {p} outlived its KV"
        for node, kind, snapshot in self.protected:
            assert node.alive, f"protected {node!r} was removed"
            tier = 0 if kind == "lock" else 1
            for p, i in snapshot.items():
                assert self.pages[p][tier] == i, f"{kind}ed page at {p} was evicted"

    # ------------------------------------------------------------------ rules

    @rule(
        tokens=tokens_st,
        ns=ns_st,
        tiers=st.sampled_from(["device", "host", "both"]),
        m_dev=st.booleans(),
        m_host=st.booleans(),
    )
    def insert(self, tokens: list[int], ns: str, tiers: str, m_dev: bool, m_host: bool) -> None:
        prefixes = self.prefixes(ns, tuple(tokens))
        n = len(prefixes)
        dev = self.alloc("device", n) if tiers != "host" else None
        host = self.alloc("host", n) if tiers != "device" else None
        if (tiers != "host" and dev is None) or (tiers != "device" and host is None):
            for pool, got in (("device", dev), ("host", host)):
                self.free[pool].extend(got or [])
            return
        md = self.alloc("mamba_device", 1) if m_dev and self.has_mamba else None
        mh = self.alloc("mamba_host", 1) if m_host and self.has_mamba else None
        r = self.tree.insert(
            RadixKey(tokens, ns),  # type: ignore[arg-type]
            dev,
            host,
            md[0] if md else None,
            mh[0] if mh else None,
        )
        existing = 0
        while existing < n and prefixes[existing] in self.pages:
            existing += 1
        assert r.num_existing_pages == existing
        unused: list[list[int]] = [[], []]
        for i, p in enumerate(prefixes):
            entry = self.pages.setdefault(p, [None, None])
            for tier, given in ((0, dev), (1, host)):
                if given is None:
                    continue
                if entry[tier] is None:
                    entry[tier] = given[i]
                else:
                    unused[tier].append(given[i])
        assert list(r.unused_device_indices) == unused[0]
        assert list(r.unused_host_indices) == unused[1]
        self.free["device"].extend(unused[0])
        self.free["host"].extend(unused[1])
        for tier, pool, slot, taken in (
            (0, "mamba_device", md, r.mamba_device_taken),
            (1, "mamba_host", mh, r.mamba_host_taken),
        ):
            if slot is None:
                assert not taken
                continue
            state = self.states.setdefault(prefixes[-1], [None, None]) if n else None
            expect = state is not None and state[tier] is None
            assert taken == expect
            if taken:
                assert state is not None
                state[tier] = slot[0]
            else:
                self.free[pool].append(slot[0])
        self.states = {p: e for p, e in self.states.items() if e != [None, None]}

    @rule(tokens=tokens_st, ns=ns_st)
    def match(self, tokens: list[int], ns: str) -> None:
        m = self.tree.match_prefix(RadixKey(tokens, ns))  # type: ignore[arg-type]
        prefixes = self.prefixes(ns, tuple(tokens))
        raw = 0
        while raw < len(prefixes) and prefixes[raw] in self.pages:
            raw += 1
        usable = raw
        if self.has_mamba:
            while usable > 0 and prefixes[usable - 1] not in self.states:
                usable -= 1
        device: list[int] = []
        host: list[int] = []
        for p in prefixes[:usable]:
            d, h = self.pages[p]
            if d is not None and not host:
                device.append(d)
            else:
                assert h is not None
                host.append(h)
        ps = self.page_size
        assert m.raw_kv_len == raw * ps
        assert m.usable_len == usable * ps
        assert list(m.device_indices) == device and list(m.host_indices) == host
        assert m.device_len == len(device) * ps and m.host_len == len(host) * ps
        state = self.states.get(prefixes[usable - 1], [None, None]) if usable else [None, None]
        assert (m.mamba_on_device, m.mamba_on_host) == tuple(state)

    @rule(data=st.data(), kind=st.sampled_from(["lock", "host"]))
    def protect(self, data: Any, kind: str) -> None:
        node = self.pick(data)
        if node is None:
            return
        tier = 0 if kind == "lock" else 1
        path = [p for n in self.tree.nodes_on_path(node) for p in self.node_prefixes(n)]
        snapshot: dict[Prefix, int] = {}
        for p in path:
            i = self.pages[p][tier]
            if i is not None:
                snapshot[p] = i
        (self.tree.lock if kind == "lock" else self.tree.protect_host)(node)
        self.protected.append((node, kind, snapshot))

    @rule(data=st.data())
    def unprotect(self, data: Any) -> None:
        if not self.protected:
            return
        i = data.draw(st.integers(0, len(self.protected) - 1))
        node, kind, _ = self.protected.pop(i)
        (self.tree.unlock if kind == "lock" else self.tree.release_host)(node)

    @rule(
        tier=st.sampled_from(["device", "host", "mamba_device", "mamba_host"]),
        n=st.integers(1, 6),
        write_back=st.booleans(),
    )
    def evict(self, tier: str, n: int, write_back: bool) -> None:
        if tier == "device":

            def back_up(node: TreeNode) -> None:
                got = self.alloc("host", node.num_pages)
                if got is not None:
                    self.tree.attach(node, Tier.HOST, Family.KV, got)
                    for p, i in zip(self.node_prefixes(node), got, strict=True):
                        self.pages[p][1] = i

            r = self.tree.evict_device(n, back_up if write_back else None)
        else:
            r = getattr(self.tree, f"evict_{tier}")(n)
        self.mirror(r)

    @rule(data=st.data(), op=st.sampled_from(["set_host", "clear_device", "attach", "clear_host"]))
    def kv_tier_change(self, data: Any, op: str) -> None:
        node = self.pick(data)
        if node is None:
            return
        prefixes = self.node_prefixes(node)
        parent = node.parent
        assert parent is not None
        if op == "set_host" and node.host_indices is None:
            got = self.alloc("host", node.num_pages)
            if got is not None:
                self.tree.attach(node, Tier.HOST, Family.KV, got)
                for p, i in zip(prefixes, got, strict=True):
                    self.pages[p][1] = i
        elif op == "attach" and node.device_indices is None:
            if parent.is_sentinel or parent.device_indices is not None:
                got = self.alloc("device", node.num_pages)
                if got is not None:
                    self.tree.attach(node, Tier.DEVICE, Family.KV, got)
                    for p, i in zip(prefixes, got, strict=True):
                        self.pages[p][0] = i
        elif op == "clear_device":
            if node.host_indices is not None and node.device_indices is not None:
                if node.lock_ref == 0 and node.num_device_children == 0:
                    self.mirror(
                        EvictResult(device_pages=self.tree.detach(node, Tier.DEVICE, Family.KV))
                    )
        elif op == "clear_host":
            if node.host_indices is not None and node.device_indices is not None:
                if node.host_ref == 0:
                    self.mirror(
                        EvictResult(host_pages=self.tree.detach(node, Tier.HOST, Family.KV))
                    )

    @rule(data=st.data(), op=st.sampled_from(["attach_dev", "set_host", "clear_dev", "clear_host"]))
    def mamba_tier_change(self, data: Any, op: str) -> None:
        node = self.pick(data)
        if node is None or not self.has_mamba:
            return
        p = self.node_prefixes(node)[-1]
        if op == "attach_dev" and node.mamba_device_slot is None:
            got = self.alloc("mamba_device", 1)
            if got:
                self.tree.attach(node, Tier.DEVICE, Family.STATE, [got[0]])
                self.states.setdefault(p, [None, None])[0] = got[0]
        elif op == "set_host" and node.mamba_host_slot is None:
            got = self.alloc("mamba_host", 1)
            if got:
                self.tree.attach(node, Tier.HOST, Family.STATE, [got[0]])
                self.states.setdefault(p, [None, None])[1] = got[0]
        elif op == "clear_dev" and node.mamba_device_slot is not None:
            self.mirror(
                EvictResult(mamba_device_slots=self.tree.detach(node, Tier.DEVICE, Family.STATE))
            )
        elif op == "clear_host" and node.mamba_host_slot is not None:
            self.mirror(
                EvictResult(mamba_host_slots=self.tree.detach(node, Tier.HOST, Family.STATE))
            )

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.tree.check_integrity(
            **{
                pool: PoolUsage(capacity=cap, free=self.free[pool])
                for pool, cap in CAPACITY.items()
            }
        )
        assert self.tree.num_device_pages == sum(e[0] is not None for e in self.pages.values())
        assert self.tree.num_host_pages == sum(e[1] is not None for e in self.pages.values())


class PlainMachine(RadixMachine):
    page_size = 1
    has_mamba = False


_settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestRadixHybrid = RadixMachine.TestCase
TestRadixHybrid.settings = _settings
TestRadixPlain = PlainMachine.TestCase
TestRadixPlain.settings = _settings
