"""The request stream and the tree drivers of ``bench_radix.py``: a multi-turn chat
workload, one side (OLD or NEW tree) driven the way ``HiCache`` drives it, and the
statistics of its timings."""

from __future__ import annotations

import argparse
import random
import time
from array import array
from types import ModuleType
from typing import Any


class Workload:
    """The request stream: (session id, prompt tokens, reply tokens) per request."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.rng = random.Random(args.seed)
        self.vocab = list(range(32000))  # shared int objects, like a tokenizer's output
        self.args = args
        self.systems = [self._tokens(args.system_tokens) for _ in range(args.systems)]
        self.sessions: list[tuple[list[int], int]] = []  # (history, turns done)
        self.next_session = 0

    def _tokens(self, n: int) -> list[int]:
        return self.rng.choices(self.vocab, k=n)

    def next(self) -> tuple[list[int], list[int]]:
        """The next request: a turn of one of the sessions in flight, picked at random."""
        a = self.args
        while len(self.sessions) < a.active:
            self.sessions.append((list(self.systems[self.next_session % a.systems]), 0))
            self.next_session += 1
        i = self.rng.randrange(len(self.sessions))
        history, done = self.sessions[i]
        prompt = history + self._tokens(a.user_tokens)
        reply = self._tokens(a.reply_tokens)
        if done + 1 >= a.turns:
            self.sessions.pop(i)
        else:
            self.sessions[i] = (prompt + reply, done + 1)
        return prompt, reply


def tokenizer_output(tokens: list[int]) -> list[int]:
    """A new list of new int objects with the values of ``tokens`` (like a tokenizer's)."""
    return array("q", tokens).tolist()


class Pool:
    """A free list of page/slot ids."""

    def __init__(self, capacity: int) -> None:
        self.free = list(range(capacity - 1, -1, -1))

    def take(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]


class Side:
    """One tree (OLD or NEW) with its pools, driven the way the cache drives it."""

    def __init__(self, name: str, mod: ModuleType, args: argparse.Namespace) -> None:
        self.name = name
        self.mod = mod
        self.ps = args.page_size
        self.mamba = args.mamba
        self.tree = mod.RadixTree(self.ps, has_mamba=args.mamba)
        self.pages = Pool(args.pages)
        # Twice the states of the turns that fit in the pages: the page pool binds first.
        turn_tokens = args.user_tokens + args.reply_tokens
        self.slots = Pool(max(4, 2 * args.pages * self.ps // turn_tokens))
        self.times: dict[str, list[int]] = {
            op: [] for op in ("match", "match_key", "insert", "evict", "evict_m")
        }
        self.hit_tokens = 0
        self.evict_calls = 0
        self.pages_evicted = 0  # device pages freed by evictions, timed or not
        self.warmup_requests = 0
        self.removed = {"evict": 0, "evict_m": 0}  # nodes removed by timed evictions
        self.per_node: dict[str, list[int]] = {"evict": [], "evict_m": []}
        # Per timed call: nodes it removed, device pages it freed.
        self.victims: dict[str, list[int]] = {"evict": [], "evict_m": []}
        self.freed: dict[str, list[int]] = {"evict": [], "evict_m": []}
        # The facade's key building of 4301f1e (token ints into a tuple) where the
        # package predates packed keys.
        self.old = not hasattr(mod, "pack_tokens")
        # --flush-mb: caches are flushed (a copy of that many MiB) before each eviction call.
        mb = getattr(args, "flush_mb", 0)
        self.flush = (bytearray(mb << 20), bytes(mb << 20)) if mb else None
        self.hicache_alloc = not getattr(args, "alloc_full", False)
        # CPU time of this thread: time spent descheduled on a loaded machine is not counted.
        self.clock = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns

    def key(self, tokens: list[int]) -> Any:
        # What each version's facade does with a request's tokens.
        if self.old:
            return self.mod.RadixKey(tuple(int(t) for t in tokens), "")
        return self.mod.RadixKey(tokens, "")

    def _free(self, r: Any) -> None:
        self.pages_evicted += len(r.device_pages)
        self.pages.free.extend(r.device_pages)
        self.slots.free.extend(r.mamba_device_slots)

    def _evict(self, what: str, n: int, record: bool) -> None:
        self.evict_calls += 1
        clock = self.clock
        nodes = self.tree.num_nodes
        if self.flush is not None and record:
            self.flush[0][:] = self.flush[1]  # every cache level cold, whatever the tree size
        t0 = clock()
        if what == "evict":
            r = self.tree.evict_device(n)
        else:
            r = self.tree.evict_mamba_device(n)
        t1 = clock()
        if record:
            self.times[what].append(t1 - t0)
            self.removed[what] += nodes - self.tree.num_nodes
            # Per removed node: the calls of a small tree remove fewer, larger victims.
            self.per_node[what].append((t1 - t0) // max(1, nodes - self.tree.num_nodes))
            self.victims[what].append(nodes - self.tree.num_nodes)
            self.freed[what].append(len(r.device_pages))
        self._free(r)

    def request(self, prompt: list[int], reply: list[int], record: bool) -> None:
        # Each side gets the token lists as a tokenizer hands them over: fresh int objects.
        prompt, reply = tokenizer_output(prompt), tokenizer_output(reply)
        clock = self.clock
        t0 = clock()
        key = self.key(prompt)
        tk = clock()
        m = self.tree.match_prefix(key)
        t1 = clock()
        self.hit_tokens += m.usable_len
        full = prompt + reply
        n = len(full) // self.ps
        if self.hicache_alloc:
            # As HiCache: the matched prefix is locked while the request runs, and pages
            # are allocated for the tokens after it only (``alloc_pages(req, n_new)``).
            prefix = m.device_indices
            self.tree.lock(m.last_node)
        else:
            prefix = ()  # --alloc-full: pages for every token, the unused ones freed after
        need = n - len(prefix)
        while len(self.pages.free) < need:
            self._evict("evict", need - len(self.pages.free), record)
        pages = [*prefix, *self.pages.take(need)]
        slot = None
        if self.mamba:
            while not self.slots.free:
                self._evict("evict_m", 1, record)
            slot = self.slots.take(1)[0]
        tokens = full[: n * self.ps]
        t2 = clock()
        r = self.tree.insert(self.key(tokens), pages, mamba_device_slot=slot)
        t3 = clock()
        unused = r.unused_device_indices
        # The tree holds the (locked) prefix pages: they come back first as not taken.
        assert tuple(unused[: len(prefix)]) == tuple(prefix)
        self.pages.free.extend(unused[len(prefix) :])
        if self.hicache_alloc:
            self.tree.unlock(m.last_node)
        if slot is not None and not r.mamba_device_taken:
            self.slots.free.append(slot)
        if record:
            self.times["match"].append(t1 - t0)
            self.times["match_key"].append(tk - t0)
            self.times["insert"].append(t3 - t2)


def summary(ns: list[int]) -> dict[str, float]:
    """Mean, median and p99 of nanosecond samples, in microseconds."""
    if not ns:
        return {"n": 0}
    s = sorted(ns)
    return {
        "n": len(s),
        "mean_us": sum(s) / len(s) / 1e3,
        "p50_us": s[len(s) // 2] / 1e3,
        "p99_us": s[min(len(s) - 1, int(0.99 * len(s)))] / 1e3,
    }


def counts(xs: list[int]) -> dict[str, float]:
    """Mean and p99 of per-call counts."""
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {"mean": sum(s) / len(s), "p99": s[min(len(s) - 1, int(0.99 * len(s)))]}


def by_victims(times: list[int], victims: list[int]) -> dict[int, list[int]]:
    """Call times grouped by the number of nodes each call removed."""
    out: dict[int, list[int]] = {}
    for t, v in zip(times, victims, strict=True):
        out.setdefault(v, []).append(t)
    return out


def equal_work(groups: dict[int, list[int]], ref: dict[int, list[int]]) -> dict[str, float]:
    """Mean and p99 per call (us) of ``groups``' calls weighted to ``ref``'s mix of victims
    per call: what this tree's calls cost if they did the reference tree's work (victim
    counts that only one side has are left out). Every call is kept, none is re-timed."""
    common = [v for v in groups if v in ref]
    total = sum(len(ref[v]) for v in common)
    if not total:
        return {"n": 0}
    weighted = sorted((t, len(ref[v]) / len(groups[v]) / total) for v in common for t in groups[v])
    mean = sum(t * w for t, w in weighted)
    acc, p99 = 0.0, weighted[-1][0]
    for t, w in weighted:
        acc += w
        if acc >= 0.99:
            p99 = t
            break
    return {"n": len(weighted), "mean_us": mean / 1e3, "p99_us": p99 / 1e3}
