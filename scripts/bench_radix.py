"""Benchmark the hybrid radix tree on a multi-turn trace.

Each session starts from one of a few shared system prompts; every turn matches the
session's history plus a new user message, then inserts it with the model's reply and a
Mamba state at the end. Turns are interleaved round-robin across sessions so the tree is
large while it is used. Reports ops/s of match and insert, then of eviction under
pressure (a device pool smaller than the trace, evicting on demand with write-back to a
host pool), and of draining the tree by eviction.

    python scripts/bench_radix.py --sessions 2000 --turns 8 --page-size 64 --json out.json
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import bench_common

from mesh_hicache.radix import RadixKey, RadixTree, TreeNode


def make_trace(args: argparse.Namespace) -> list[list[list[int]]]:
    """Per session, the token list of each turn (history grows turn by turn)."""
    rng = random.Random(args.seed)
    systems = [
        [rng.randrange(32000) for _ in range(args.system_tokens)] for _ in range(args.systems)
    ]
    sessions = []
    for s in range(args.sessions):
        history = list(systems[s % args.systems])
        turns = []
        for _ in range(args.turns):
            history += [rng.randrange(32000) for _ in range(args.user_tokens)]
            turns.append(list(history))
            history += [rng.randrange(32000) for _ in range(args.reply_tokens)]
        sessions.append(turns)
    return sessions


class Pool:
    """A free list of page/slot ids."""

    def __init__(self, capacity: int) -> None:
        self.free = list(range(capacity - 1, -1, -1))

    def take(self, n: int, evict: Callable[[int], None]) -> list[int]:
        if len(self.free) < n:
            evict(n - len(self.free))
        if len(self.free) < n:
            raise RuntimeError(f"pool exhausted: need {n}, have {len(self.free)}")
        return [self.free.pop() for _ in range(n)]

    def give(self, ids: tuple[int, ...] | list[int]) -> None:
        self.free.extend(ids)


def run(args: argparse.Namespace) -> dict[str, float | int]:
    trace = make_trace(args)
    ps = args.page_size
    big = 1 << 40
    tree = RadixTree(ps, has_mamba=True)
    dev, host = Pool(args.device_pages or big // ps), Pool(args.host_pages or big // ps)
    mdev, mhost = Pool(args.mamba_slots or big), Pool(args.mamba_slots * 4 or big)
    t_match = t_insert = t_evict = 0.0
    n_match = n_insert = n_evict_calls = 0
    evicted_pages = 0
    hit_tokens = total_tokens = 0

    def give_all(r) -> None:  # type: ignore[no-untyped-def]
        dev.give(r.device_pages)
        host.give(r.host_pages)
        mdev.give(r.mamba_device_slots)
        mhost.give(r.mamba_host_slots)

    def back_up(node: TreeNode) -> None:
        if len(host.free) >= node.num_pages:
            tree.set_host(node, [host.free.pop() for _ in range(node.num_pages)])
        if node.mamba_device_slot is not None and node.mamba_host_slot is None and mhost.free:
            tree.set_mamba_host(node, mhost.free.pop())

    def evict_device(n: int) -> None:
        nonlocal t_evict, n_evict_calls, evicted_pages
        t0 = time.perf_counter()
        r = tree.evict_device(n, back_up)
        t_evict += time.perf_counter() - t0
        n_evict_calls += 1
        evicted_pages += len(r.device_pages)
        give_all(r)

    def evict_host(n: int) -> None:
        give_all(tree.evict_host(n))

    def evict_mdev(n: int) -> None:
        give_all(tree.evict_mamba_device(n))

    def evict_mhost(n: int) -> None:
        give_all(tree.evict_mamba_host(n))

    for turn in range(args.turns):
        for turns in trace:
            tokens = turns[turn]
            key = RadixKey(tokens, "")
            t0 = time.perf_counter()
            m = tree.match_prefix(key)
            t_match += time.perf_counter() - t0
            n_match += 1
            hit_tokens += m.usable_len
            total_tokens += len(tokens)
            # The request's own pages for the whole key (the duplicates come back).
            num_pages = len(tokens) // ps
            pages = dev.take(num_pages, evict_device)
            slot = mdev.take(1, evict_mdev)[0]
            if args.host_pages:
                # Bound host use too (write-back fills it).
                if len(host.free) < num_pages:
                    evict_host(num_pages - len(host.free))
                if not mhost.free:
                    evict_mhost(1)
            t0 = time.perf_counter()
            r = tree.insert(key, pages, mamba_device_slot=slot)
            t_insert += time.perf_counter() - t0
            n_insert += 1
            dev.give(r.unused_device_indices)
            if not r.mamba_device_taken:
                mdev.give([slot])
    nodes = tree.num_nodes
    if args.check:
        tree.check_integrity()
    # Drain: evict every device page in chunks of one request's worth.
    t0 = time.perf_counter()
    drained = drain_calls = 0
    while True:
        r = tree.evict_device(64)
        give_all(r)
        drain_calls += 1
        if not r.device_pages:
            break
        drained += len(r.device_pages)
    t_drain = time.perf_counter() - t0
    return {
        "sessions": args.sessions,
        "turns": args.turns,
        "page_size": ps,
        "tree_nodes_at_end": nodes,
        "token_hit_rate": hit_tokens / max(total_tokens, 1),
        "match_ops_per_s": n_match / t_match,
        "insert_ops_per_s": n_insert / t_insert,
        "match_us_per_op": 1e6 * t_match / n_match,
        "insert_us_per_op": 1e6 * t_insert / n_insert,
        "pressure_evict_calls": n_evict_calls,
        "pressure_evict_calls_per_s": n_evict_calls / t_evict if t_evict else 0.0,
        "pressure_evicted_pages_per_s": evicted_pages / t_evict if t_evict else 0.0,
        "drain_pages": drained,
        "drain_pages_per_s": drained / t_drain if t_drain else 0.0,
        "drain_calls_per_s": drain_calls / t_drain if t_drain else 0.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sessions", type=int, default=2000)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--systems", type=int, default=16, help="distinct shared system prompts")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=256)
    p.add_argument("--reply-tokens", type=int, default=128)
    p.add_argument(
        "--device-pages",
        type=int,
        default=20000,
        help="device pool size in pages (0: unbounded, no eviction)",
    )
    p.add_argument("--host-pages", type=int, default=60000, help="host pool (0: unbounded)")
    p.add_argument("--mamba-slots", type=int, default=4000, help="device Mamba slots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="run check_integrity at the end")
    p.add_argument("--json", type=str, default=None, help="write the results to this path")
    args = p.parse_args()
    result = run(args)
    for k, v in result.items():
        print(f"{k:32s} {v:.4g}" if isinstance(v, float) else f"{k:32s} {v}")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        bench_common.write_json(bench_common.make_result("radix", config, result), args.json)


if __name__ == "__main__":
    main()
