"""Sliding-window layers under a seeded random workload across L1, L2 and file L3.

Requests take prefixes of a few base prompts (which share prefixes among themselves),
ending anywhere: inside a node, at a node end, at a window checkpoint or one page past
it, a window's reach past a node end; then a random tail, sometimes a partial page. Two
to four requests are open at once, their phases interleaved; some abort. Free device and
host rows are NaN before each lookup and load. Every hit must load bit-exact
full-attention K/V, the windowed K/V a resume at its end reads, the sinks and (hybrid)
the state (``count_mismatches``), checked after ``finish_load`` and again before the
insert. Every ``RESTART_EVERY`` requests the cache is closed and rebuilt over the same L3
directory with fresh L1/L2 (some cases change ``window_checkpoint_tokens`` then), after
a few stored objects are lost and one corrupted, so hits come back from L3 with windowed
gaps and prefetches stop part way. Before each close: tree integrity, no storage, backup
or load errors, per-tier hit tokens equal to the stats, everything evicted, pools empty,
no temporary files. Each tier serves hits in every run (the run cannot pass vacuously).

Specs (pages of ``PS`` = 4 tokens), KV layers 1 and 3 full: ``plain``: layers 0 and 2
windowed (9 tokens: a resume reads exactly the two pages before it); ``sinks``: layer 0
windowed (6 tokens, 5 sinks), layer 2 another group (9 tokens); ``hybrid``: ``sinks``
plus a Mamba layer 4 (a hit also ends at a state).

The last test is the smallest case of what the hybrid ``write_through`` run once found:
a recurrent state written to L3 before its host copy ran.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mesh_hicache.cache import CachedRequest, CacheFull, HiCache
from mesh_hicache.choices import RegionName
from mesh_hicache.spec import KVSpec, MambaSpec, StateSpec, WindowSpec
from mesh_hicache.testing import internals
from mesh_hicache.transfer import CpuTransferEngine
from tests.unit.cache_support import (
    PS,
    count_mismatches,
    evict_everything,
    hashes_of,
    make_config,
    poison_free_device,
    pools_fully_free,
    serve,
    stored_objects,
    write_pages,
    write_state,
)

REQUESTS = 400
RESTART_EVERY = 40
POOLS = dict(device_pages=40, device_mamba_slots=12, host_pages=32, host_mamba_slots=24)
"""Small enough that L1 and L2 both evict within a few requests."""
CASES = [  # (spec, write policy, window_checkpoint_tokens of each cache in turn, seed)
    ("plain", "write_through_selective", (12,), 1),
    ("sinks", "write_through", (12, 8, 0), 2),
    ("sinks", "write_through", (12, 8, 0), 112),  # a backup evicts an ancestor it fills
    ("hybrid", "write_back", (12,), 4),
    ("hybrid", "write_through", (12,), 3),
]


def window_spec(kind: str) -> StateSpec:
    if kind == "plain":
        windows = (WindowSpec(layer_ids=(0, 2), window=9),)
    else:
        windows = (
            WindowSpec(layer_ids=(0,), window=6, sink_tokens=5),
            WindowSpec(layer_ids=(2,), window=9),
        )
    mamba = None
    if kind == "hybrid":
        mamba = MambaSpec(
            layer_ids=(4,), conv_dim=4, conv_kernel=3, num_heads=2, head_dim=2, state_dim=2
        )
    return StateSpec(
        page_size=PS,
        kv=KVSpec(layer_ids=(0, 1, 2, 3), num_kv_heads=2, head_dim=2),
        mamba=mamba,
        windows=windows,
        model_id=f"test/window-{kind}",
    )


@pytest.fixture
def make_cache(one_rank_topology):
    caches: list[HiCache] = []

    def build(root: Path, kind: str, **overrides) -> HiCache:
        config = make_config(root, **{**POOLS, **overrides})
        cache = HiCache(one_rank_topology, window_spec(kind), config)
        caches.append(cache)
        return cache

    yield build
    for cache in caches:
        cache.close()


def base_prompts(rng: random.Random) -> list[list[int]]:
    """Four prompts of 10 to 16 pages; the second and fourth share a prefix with the
    first and third (a page count that is no checkpoint multiple, then one that is)."""

    def fresh(pages: int) -> list[int]:
        return [rng.randrange(1000, 10**6) for _ in range(pages * PS)]

    a, c = fresh(14), fresh(12)
    return [a, a[: 5 * PS] + fresh(9), c, c[: 6 * PS] + fresh(10)]


def prefix_pages(rng: random.Random, size: int, step: int, ends: set[int], spec: StateSpec) -> int:
    """A prefix of a base prompt of ``size`` pages: anywhere, at a checkpoint (every
    ``step`` pages) or one page past it, at a node end seen so far, a window's reach past
    one, or the whole prompt."""
    kind = rng.randrange(6)
    if kind == 0:
        n = rng.randint(0, size)
    elif kind == 1:
        n = step * rng.randint(1, size // step)
    elif kind == 2:
        n = step * rng.randint(0, size // step) + 1
    elif kind == 3 and ends:
        n = rng.choice(sorted(ends))
    elif kind == 4 and ends:
        reach = (rng.choice(spec.windows).window - 1) / PS
        n = rng.choice(sorted(ends)) + rng.choice((math.floor(reach), math.ceil(reach)))
    else:
        n = size
    return min(n, size)


def poison_free_host(cache: HiCache) -> None:
    """Fill every free host page and window row with NaN: a prefetch must overwrite each
    row a load may copy to device."""
    host = internals(cache).host
    assert host is not None
    for region in host.layout.regions:
        if region.paged:
            window = region.name is RegionName.KV_WINDOW  # indexed by window rows
            ids = host.window_allocator if window else host.page_allocator
            free = [i for i in range(ids.capacity) if ids.is_free(i)]
            host.local(region.name)[free] = float("nan")


@dataclass
class Flight:
    """One open request: its whole-page tokens and their hashes, the page counts it
    inserts at, and how far it got (``matched``, ``loading``, ``loaded``, ``written``)."""

    req: CachedRequest
    tokens: list[int]
    hashes: list[bytes]
    cuts: tuple[int, ...]
    stage: str = "matched"
    pages: list[int] = field(default_factory=list)


class Workload:
    """Drives one seeded run over a sequence of caches sharing ``root`` (module docstring)."""

    def __init__(
        self, make_cache, root: Path, kind: str, policy: str, periods: tuple[int, ...], seed: int
    ) -> None:
        self.make_cache, self.root, self.kind = make_cache, root, kind
        self.policy, self.periods = policy, periods
        self.spec = window_spec(kind)
        self.rng = random.Random(seed)
        self.bases = base_prompts(self.rng)
        self.ends: list[set[int]] = [set() for _ in self.bases]
        self.open: list[Flight] = []
        self.hits: Counter[str] = Counter()
        self.served = [0, 0, 0]  # tokens per tier served by the current cache
        self.cache = self.build()

    def build(self) -> HiCache:
        period = self.periods[self.hits["restarts"] % len(self.periods)]
        return self.make_cache(
            self.root, self.kind, window_checkpoint_tokens=period, write_policy=self.policy
        )

    # -- one request ----------------------------------------------------------------------

    def start(self) -> None:
        rng = self.rng
        which = rng.randrange(len(self.bases))
        base = self.bases[which]
        step = self.cache.config.window_checkpoint_tokens // PS or 3
        n = prefix_pages(rng, len(base) // PS, step, self.ends[which], self.spec)
        tail = [rng.randrange(3) for _ in range(PS * rng.randint(0, 3))]
        tokens = base[: n * PS] + tail
        if not tokens:
            tokens = [rng.randrange(3) for _ in range(PS)]
        pages = len(tokens) // PS
        cuts = {pages} | {rng.randint(1, pages) for _ in range(rng.randint(0, 2))}
        if pages >= step and rng.random() < 0.5:
            cuts.add(step * rng.randint(1, pages // step))
        for b in cuts:
            if b <= n:
                self.ends[which].add(b)
        # Some lookups end inside a page (only whole pages can hit or be inserted).
        partial = [rng.randrange(3) for _ in range(rng.choice((0, 0, 0, 1, 3)))]
        poison_free_host(self.cache)
        req = self.cache.match(tokens + partial)
        self.open.append(Flight(req, tokens, hashes_of(tokens), tuple(sorted(cuts))))

    def advance(self, f: Flight) -> None:
        """One phase of ``f``; an occasional abort releases it early."""
        cache = self.cache
        if f.stage != "written" and self.rng.random() < 0.05:
            self.finish(f)
        elif f.stage == "matched":
            poison_free_device(cache)
            cache.load(f.req)
            f.stage = "loading"
        elif f.stage == "loading":
            cache.finish_load(f.req)
            self.check(f, "after finish_load")
            self.count_hit(f.req)
            f.stage = "loaded"
        elif f.stage == "loaded":
            done = f.req.prefix_len // PS
            try:
                new = cache.alloc_pages(f.req, len(f.hashes) - done)
            except CacheFull:
                self.hits["cache_full"] += 1
                return self.finish(f)
            write_pages(cache, f.hashes[done:], new)
            f.pages = f.req.prefix_pages[:done] + new
            f.stage = "written"
        else:
            self.check(f, "before insert")
            self.insert(f)
            self.finish(f)

    def insert(self, f: Flight) -> None:
        cache, done = self.cache, f.req.prefix_len // PS
        for b in f.cuts:
            if b <= done:
                continue
            slot = None
            try:
                if self.spec.has_mamba:
                    slot = cache.alloc_slot(f.req)
                    write_state(cache, f.hashes[b - 1], slot)
            except CacheFull:
                self.hits["cache_full"] += 1
                return
            cache.insert(f.req, f.tokens[: b * PS], f.pages[:b], mamba_slot=slot)

    def finish(self, f: Flight) -> None:
        self.cache.release(f.req)
        if f.stage == "loading":  # release finished the load: counted as served
            self.served = [a + b for a, b in zip(self.served, f.req.served, strict=True)]
        self.open.remove(f)
        self.hits["requests"] += 1

    def check(self, f: Flight, when: str) -> None:
        bad = count_mismatches(self.cache, f.req, f.hashes)
        assert bad == 0, (
            f"{bad} mismatching tensors {when}: {len(f.tokens)} tokens, "
            f"hit {f.req.hit}, prefix {f.req.prefix_len}, served {tuple(f.req.served)}"
        )

    def count_hit(self, req: CachedRequest) -> None:
        for i, (tier, tokens) in enumerate(zip(("L1", "L2", "L3"), req.served, strict=True)):
            self.hits[tier] += tokens > 0
            self.served[i] += tokens
        if req.served[2] and (req.served[0] or req.served[1]):
            self.hits["L1/L2 then L3"] += 1
        inner = internals(self.cache)
        path = inner.tree.nodes_on_path(inner.lease(req).locked[-1])
        if req.served[2] and any(n.window_missing for n in path):
            self.hits["L3 with gaps"] += 1

    # -- the run --------------------------------------------------------------------------

    def run(self) -> Counter[str]:
        """``REQUESTS`` requests, 2-4 open at once; after every ``RESTART_EVERY`` the open
        ones finish and the cache is rebuilt."""
        started, limit = 0, RESTART_EVERY
        while started < REQUESTS or self.open:
            if started == limit and not self.open:
                self.restart()
                limit += RESTART_EVERY
            if started < min(limit, REQUESTS) and len(self.open) < self.rng.randint(2, 4):
                self.start()
                started += 1
            else:
                self.advance(self.rng.choice(self.open))
            roll = self.rng.random()
            if roll < 0.1:
                self.cache.step()
            elif roll < 0.15:
                self.cache.flush()
                if not any(internals(self.cache).prefetch(f.req) for f in self.open):
                    self.cache.check_integrity()  # host reservations in flight are unlisted
        self.settle()
        return self.hits

    def restart(self) -> None:
        self.settle()
        self.damage()
        self.hits["restarts"] += 1
        self.cache = self.build()

    def damage(self) -> None:
        """Lose a few stored objects and corrupt one (its read fails after the existence
        query said present): hits only get shorter, and prefetches stop part way."""
        objects = sorted(stored_objects(self.root))
        for i, (region, page_hash, tag) in enumerate(self.rng.sample(objects, 4)):
            (path,) = self.root.glob(f"v1/*/{region}/{page_hash}/{tag}")
            if i:
                path.unlink()
            else:
                data = bytearray(path.read_bytes())
                data[-1] ^= 0xFF
                path.write_bytes(bytes(data))

    def settle(self) -> None:
        """Flush, check, evict everything, find the pools empty, close: nothing leaked."""
        cache = self.cache
        cache.flush()
        cache.check_integrity()
        stats = cache.stats()
        assert internals(cache).num_open == 0
        assert stats.storage_errors == stats.storage_write_errors == 0
        assert stats.backup_failures == stats.load_failures == 0
        tiers = [stats.hit_tokens_device, stats.hit_tokens_host, stats.hit_tokens_storage]
        assert tiers == self.served
        self.served = [0, 0, 0]
        self.hits["evicted L1 pages"] += stats.evicted_device_pages
        self.hits["evicted L2 pages"] += stats.evicted_host_pages
        self.hits["partial prefetches"] += stats.prefetch["partial"]
        evict_everything(cache)
        assert internals(cache).tree.num_nodes == 0 and pools_fully_free(cache)
        cache.close()
        leftovers = [n for _, _, files in os.walk(self.root) for n in files if ".tmp-" in n]
        assert not leftovers


@pytest.mark.parametrize(("kind", "policy", "periods", "seed"), CASES)
def test_random_window_run_is_exact_and_leaks_nothing(
    make_cache, tmp_path, kind, policy, periods, seed
):
    workload = Workload(make_cache, tmp_path / "l3", kind, policy, periods, seed)
    try:
        hits = workload.run()
    except Exception as err:
        err.add_note(f"case {kind}/{policy}/seed {seed}, so far: {dict(workload.hits)}")
        raise
    print(kind, policy, seed, dict(hits))
    assert hits["L1"] > 0 and hits["L2"] > 0 and hits["L3"] > 0
    assert hits["L3 with gaps"] > 0 and hits["L1/L2 then L3"] > 0
    assert hits["evicted L1 pages"] > 0 and hits["evicted L2 pages"] > 0
    assert hits["restarts"] == REQUESTS // RESTART_EVERY - 1


def test_a_state_backed_up_after_its_pages_reaches_l3_exact(make_cache, tmp_path, monkeypatch):
    """A node holds host pages from one backup and a host slot from a later one not run
    yet: consuming the first must not write the node's state to L3 from that slot (stale
    bytes, and L3 keeps the first object it gets); the second backup writes it, with the
    windowed pages its boundary needs."""
    # No worker thread: a copy runs only when someone waits for it (in submission order).
    monkeypatch.setattr(CpuTransferEngine, "_wake_worker", lambda self, grace=0.0: None)
    root = tmp_path / "l3"
    cache = make_cache(root, "hybrid")
    tokens = list(range(100, 156))  # 14 pages
    hashes = hashes_of(tokens)
    assert serve(cache, tokens).prefix == 0  # backup 1 (its pages, the state at 56) queued
    req = cache.match(tokens[:44])  # nothing consumed: backup 1 has not run
    cache.load(req)
    assert cache.finish_load(req) == 0
    assert internals(cache).engine.load().wait()  # runs backup 1 (queued first)
    pages = cache.alloc_pages(req, 11)
    write_pages(cache, hashes[:11], pages)
    slot = cache.alloc_slot(req)
    write_state(cache, hashes[10], slot)
    # Splits the node at 44: its first part holds backup 1's host pages and gets the new
    # state, whose host copy is backup 2 (queued, not run).
    cache.insert(req, tokens[:44], pages, mamba_slot=slot)
    before = cache.stats().storage_put_objects
    cache.release(req)  # consumes backup 1: its L3 write takes the node at 44 and its state
    deadline = time.monotonic() + 10
    while cache.stats().storage_put_objects == before and time.monotonic() < deadline:
        time.sleep(0.01)
    cache.flush()
    cache.close()
    reader = make_cache(root, "hybrid")
    poison_free_device(reader)
    got = serve(reader, tokens[:44])
    assert got.served == (0, 0, 44)
    assert got.mismatches == 0  # not the stale conv and SSM state
