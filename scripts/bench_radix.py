"""Benchmark the radix tree as the cache drives it, against an older version, in one run.

Workload (multi-turn chat): sessions start from one of a few shared system prompts
(``--system-tokens``, 1,000 by default); each turn adds a user message (250 tokens) and
the model's reply (130 tokens), so prompts are not page aligned. ``--active`` sessions
are in flight; each request is a turn of one of them picked at random (``--turns`` turns
each, then a new session starts).
``--active`` and ``--systems`` are counts per 10,000 pages of the pool (64 and 16 at 10k,
6 and 2 at 1k, 640 and 160 at 100k): every size holds the same shape of tree (nodes of one
turn under shared system prompts), so its eviction calls free the same pages in the same
number of victims and per-call times compare like with like. ``--fixed-workload`` uses the
two counts as given at every size instead (the workload of earlier results: a 1k-page pool
then holds 6 nodes, and its calls remove fewer, larger victims). A 1k pool still holds
only 6 sessions: at page size 16 its calls remove fewer victims than 10k/100k ones (1.63
vs 1.77-1.80 mean, p99 8 vs 9: an active session's history is evicted less often among 6
random picks than among 640), so flatness is also reported at equal work (below).

Per request, exactly what ``HiCache`` issues, timed from the caller's token list (a
fresh list of fresh ints per request and tree, as a tokenizer returns them):

- **match**: build the key from the request's tokens, then ``match_prefix``;
- **insert**: build the key from prompt + reply truncated to whole pages, then ``insert``
  with the matched prefix's device pages followed by new pages (and a Mamba slot at the
  end with ``--mamba``); the matched prefix is locked from the match to the insert, and
  pages are allocated only for the tokens after it (``alloc_pages(req, n_new)``);
- **evict**: each ``evict_device`` / ``evict_mamba_device`` call the device pools need
  (a pool of ``--pages`` pages: the tree is held at that size), timed per call.

Earlier versions of this bench allocated a page for every token of the request and left the
prefix unlocked (``--alloc-full``): not what HiCache does, and the per-request transient
it held (up to 250 pages at page size 16) was a quarter of a 1k pool, so the 1k tree had
larger nodes (41.5 pages per node vs 30) and fewer victims per call than the larger ones.

Both trees (OLD: the radix package at ``--old-rev``, extracted from git into a temp dir at
run time; NEW: this checkout) see the same requests, alternating A/B in blocks of
``--block`` requests (which one goes first flips every block), so load on the machine hits
both alike while one tree's memory traffic does not evict the other's working set at
every operation (``--block 1`` alternates op by op). The
process is pinned to one CPU, ops are timed in thread CPU time by default (``--clock``), and
the trees are filled to their size, then warmed up until evictions have freed
``--warmup-turnover`` times the pool (1 by default: a 100k-page tree needs ~5,000 requests
at page size 16, ~17,000 at 64), so every size is timed in its steady state (earlier
versions timed the 100k tree was timed 200 requests after its first eviction, while it was
still evicting the fill's nodes: 2.76 victims per call vs 2.50 at 10k); then the state is frozen
(``gc.freeze()``) and the collector runs between requests, never inside a timed op (an
allocation by one tree must not bill a collection to the other).

Eviction is also reported per removed node (mean and p99 of call time / nodes the call
removed), with the victims and pages each call freed (mean and p99), so a reader can see
whether two sizes did the same work per call.

Flatness (``--flat-requests``, NEW only): one tree per size of ``--pages``, each filled
with its own (scaled) workload, then driven in blocks of ``--block`` requests that rotate
over the sizes, so load on the machine hits every size alike; eviction per call (mean,
p50, p99) per size and the p99 ratio of each size to the smallest; per victims-per-call
count (``evict_by_victims``); and at equal work (``evict_equal_work``: every call kept,
each weighted so that the size's mix of victims per call is the smallest tree's; victim
counts only one size has are left out): what a size's calls cost for the same work.
``--flat-old`` drives OLD trees in the same rotation.

Also measured: chained page hashing per page (NEW: from packed bytes; OLD: ``page_hashes``
over token ints) against SGLang's native page hash approach (its key's ints into a uint32
array, then one native call hashing every page with OpenSSL; rebuilt here in C from its
description, compiled at run time) and against a native hash of the same page bytes
(``hashlib.sha256`` and Python's built-in ``hash``), alternated the same way, at
``--hash-page-sizes``.

    python scripts/bench_radix.py --json out.json            # 1k/10k/100k pages, ps 16/64
    python scripts/bench_radix.py --pages 1000 --page-sizes 16 --requests 300   # quick
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from types import ModuleType
from typing import Any

import bench_common
from bench_radix_drive import Side, Workload, by_victims, counts, equal_work, summary
from bench_radix_hash import bench_hashing, build_sglang_like_hash

from mesh_hicache import radix as new_radix

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_PKG = "old_radix_bench"
OLD_REV = "4301f1e"
"""The OLD tree by default: the radix package before its flat-array rewrite."""


def load_old_radix(rev: str, folder: str) -> ModuleType:
    """The radix package at git ``rev``, imported under another name from ``folder``."""
    names = subprocess.run(
        ["git", "-C", REPO, "ls-tree", "--name-only", f"{rev}:mesh_hicache/radix"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    pkg = os.path.join(folder, OLD_PKG)
    os.makedirs(pkg)
    for name in names:
        if not name.endswith(".py"):
            continue
        src = subprocess.run(
            ["git", "-C", REPO, "show", f"{rev}:mesh_hicache/radix/{name}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        with open(os.path.join(pkg, name), "w") as f:
            f.write(src.replace("mesh_hicache.radix", OLD_PKG))
    sys.path.insert(0, folder)
    return importlib.import_module(OLD_PKG)


def scaled(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``--active`` / ``--systems`` per 10,000 pages of the pool (unless
    ``--fixed-workload``): the same shape of tree at every size."""
    if args.fixed_workload:
        return args
    k = args.pages / 10000
    active, systems = max(1, round(args.active * k)), max(1, round(args.systems * k))
    return argparse.Namespace(**{**vars(args), "active": active, "systems": systems})


def warming(side: Side, done: int, args: argparse.Namespace) -> bool:
    """Whether the untimed warm-up after the fill goes on: ``--warmup`` requests at least,
    and until evictions freed ``--warmup-turnover`` times the pool (every node filled
    before the first eviction is gone: the tree is in its steady state, not the fill's
    shape, at every size; a 100k-page tree needs ~100x the requests of a 1k one)."""
    return done < args.warmup or side.pages_evicted < args.warmup_turnover * args.pages


def run_config(old: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    """Fill both trees to ``args.pages`` pages, then time ``args.requests`` requests."""
    args = scaled(args)
    sides = [Side("old", old, args), Side("new", new_radix, args)]
    work = Workload(args)
    gc.unfreeze()
    gc.collect()
    fill = 0
    # Fill until the device pool is full (the first eviction), then a warm-up.
    while not sides[1].evict_calls:
        prompt, reply = work.next()
        for side in sides:
            side.request(prompt, reply, record=False)
        fill += 1
    warm = 0
    while warming(sides[1], warm, args):
        prompt, reply = work.next()
        for side in sides:
            side.request(prompt, reply, record=False)
        warm += 1
    gc.collect()
    gc.freeze()
    gc.disable()  # collections run between requests (below), never inside a timed op
    for s in sides:
        s.hit_tokens = 0
    done = 0
    while done < args.requests:
        block = [work.next() for _ in range(min(args.block, args.requests - done))]
        order = sides if (done // args.block) % 2 == 0 else sides[::-1]
        for side in order:
            for prompt, reply in block:
                side.request(prompt, reply, record=True)
            gc.collect(1)
        done += len(block)
    gc.enable()
    out: dict[str, Any] = {
        "page_size": args.page_size,
        "pages": args.pages,
        "active_sessions": args.active,
        "systems": args.systems,
        "fill_requests": fill,
        "warmup_requests": warm,
    }
    for side in sides:
        out[side.name] = {op: summary(t) for op, t in side.times.items()}
        out[side.name]["tree_nodes"] = side.tree.num_nodes
        out[side.name]["tree_device_pages"] = side.tree.num_device_pages
        out[side.name]["hit_tokens"] = side.hit_tokens
        for what in ("evict", "evict_m"):
            removed = side.removed[what]
            spent = sum(side.times[what]) / 1e3
            out[side.name][what]["nodes_removed"] = removed
            out[side.name][what]["us_per_removed_node"] = spent / removed if removed else None
            per_node = summary(side.per_node[what])
            out[side.name][what]["per_removed_node_p99_us"] = per_node.get("p99_us")
            out[side.name][what]["victims_per_call"] = counts(side.victims[what])
            out[side.name][what]["pages_freed_per_call"] = counts(side.freed[what])
    o, n = out["old"], out["new"]
    # Both trees saw the same calls: equal hits and sizes say they behave the same.
    out["same_hits"] = all(o[k] == n[k] for k in ("hit_tokens", "tree_nodes", "tree_device_pages"))
    ops = [
        op for op in ("match", "match_key", "insert", "evict") if o[op].get("n") and n[op].get("n")
    ]
    out["speedup_old_over_new"] = {op: o[op]["mean_us"] / n[op]["mean_us"] for op in ops}
    out["speedup_old_over_new_p50"] = {op: o[op]["p50_us"] / n[op]["p50_us"] for op in ops}
    if args.check:
        sides[1].tree.check_integrity()
    return out


def run_flatness(args: argparse.Namespace, old: ModuleType | None = None) -> dict[str, Any]:
    """NEW trees (and OLD ones too when ``old`` is given: same workloads, in the same
    rotation) at every size of ``args.pages`` (scaled workloads), timed requests in blocks
    rotating over the trees; eviction per call per size."""
    sides: list[Side] = []
    works: list[Workload] = []
    names: list[str] = []
    for version, mod in (("new", new_radix), ("old", old)):
        if mod is None:
            continue
        for pages in args.pages:
            cfg = scaled(argparse.Namespace(**{**vars(args), "pages": pages}))
            side, work = Side(version, mod, cfg), Workload(cfg)
            while not side.evict_calls:
                side.request(*work.next(), record=False)
            warm = 0
            while warming(side, warm, cfg):
                side.request(*work.next(), record=False)
                warm += 1
            side.warmup_requests = warm
            sides.append(side)
            works.append(work)
            names.append(str(pages) if version == "new" else f"old_{pages}")
    gc.collect()
    gc.freeze()
    gc.disable()
    done, turn = 0, 0
    while done < args.flat_requests:
        n = min(args.block, args.flat_requests - done)
        k = turn % len(sides)
        for i in [*range(k, len(sides)), *range(k)]:  # each size leads in turn
            for _ in range(n):
                sides[i].request(*works[i].next(), record=True)
            gc.collect(1)
        done += n
        turn += 1
    gc.enable()
    out: dict[str, Any] = {"page_size": args.page_size, "requests": args.flat_requests}
    for name, side in zip(names, sides, strict=True):
        out[name] = {
            "evict": summary(side.times["evict"]),
            "evict_m": summary(side.times["evict_m"]),
            "evict_per_removed_node": summary(side.per_node["evict"]),
            "victims_per_call": counts(side.victims["evict"]),
            "pages_freed_per_call": counts(side.freed["evict"]),
            "tree_nodes": side.tree.num_nodes,
            "hit_tokens": side.hit_tokens,
            "warmup_requests": side.warmup_requests,
        }
    groups = {
        name: by_victims(side.times["evict"], side.victims["evict"])
        for name, side in zip(names, sides, strict=True)
    }
    for name in names:
        out[name]["evict_by_victims"] = {
            str(v): summary(ts) for v, ts in sorted(groups[name].items())
        }
    for prefix in ("", "old_") if old is not None else ("",):
        small = out[f"{prefix}{args.pages[0]}"]["evict"]
        ref = groups[f"{prefix}{args.pages[0]}"]
        for pages in args.pages:
            e = out[f"{prefix}{pages}"]["evict"]
            if e.get("n") and small.get("n"):
                e["p99_over_smallest"] = e["p99_us"] / small["p99_us"]
                e["mean_over_smallest"] = e["mean_us"] / small["mean_us"]
            # The same per size with every tree's calls weighted to the smallest tree's
            # victims per call (a small tree's workload cannot have exactly the shape of
            # a large one's: see the module docstring).
            eq = out[f"{prefix}{pages}"]["evict_equal_work"] = equal_work(
                groups[f"{prefix}{pages}"], ref
            )
            small_eq = out[f"{prefix}{args.pages[0]}"].get("evict_equal_work", eq)
            if eq.get("n") and small_eq.get("n"):
                eq["p99_over_smallest"] = eq["p99_us"] / small_eq["p99_us"]
                eq["mean_over_smallest"] = eq["mean_us"] / small_eq["mean_us"]
    return out


def pin() -> int | None:
    """Pin this process to one CPU (the last one it may use); returns it."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, {cpu})
    return cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pages", type=int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    p.add_argument("--hash-page-sizes", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--requests", type=int, default=1500, help="timed requests per config")
    p.add_argument("--warmup", type=int, default=200, help="untimed requests after the fill")
    p.add_argument(
        "--warmup-turnover",
        type=float,
        default=1.0,
        help="the warm-up also runs until evictions freed this many times the pool's pages",
    )
    p.add_argument(
        "--alloc-full",
        action="store_true",
        help="pages for every token of a request, the prefix unlocked (the old bench's way: "
        "not what HiCache does)",
    )
    p.add_argument(
        "--block",
        type=int,
        default=64,
        help="A/B unit: both trees run the same block of requests, in alternating order",
    )
    p.add_argument(
        "--systems", type=int, default=16, help="distinct shared system prompts (per 10k pages)"
    )
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--user-tokens", type=int, default=250)
    p.add_argument("--reply-tokens", type=int, default=130)
    p.add_argument("--turns", type=int, default=8, help="turns per session")
    p.add_argument(
        "--active", type=int, default=64, help="sessions in flight (per 10k pages, see above)"
    )
    p.add_argument(
        "--fixed-workload",
        action="store_true",
        help="--active and --systems as given at every size (not per 10k pages)",
    )
    p.add_argument(
        "--flat-requests",
        type=int,
        default=1500,
        help="timed requests per size of the NEW-only flatness run (0: skip it)",
    )
    p.add_argument(
        "--flat-only", action="store_true", help="only the flatness run (no OLD/NEW configs)"
    )
    p.add_argument(
        "--flat-old",
        action="store_true",
        help="the flatness run also drives OLD trees (--old-rev) in the same rotation",
    )
    p.add_argument(
        "--flush-mb",
        type=int,
        default=0,
        help="copy this many MiB before each eviction call (flushes the CPU caches: shows "
        "what eviction costs when no size keeps its working set cached)",
    )
    p.add_argument("--no-mamba", dest="mamba", action="store_false", help="KV-only trees")
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of the OLD tree")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="time ops by thread CPU time (default: robust on a shared machine) or wall time",
    )
    p.add_argument("--check", action="store_true", help="check_integrity of NEW at the end")
    p.add_argument("--json", type=str, default=None, help="write the results to this path")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cpu = pin()
    results: dict[str, Any] = {"pinned_cpu": cpu, "configs": [], "hashing": {}}
    results["load_average_start"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory() as tmp:
        old = load_old_radix(args.old_rev, tmp)
        sgl, why = build_sglang_like_hash(tmp)
        if sgl is None:
            print(f"SGLang-approach hash skipped: {why}")
        results["sglang_hash_baseline"] = why or "built"
        for ps in [] if args.flat_only else args.hash_page_sizes:
            results["hashing"][str(ps)] = h = bench_hashing(old, sgl, ps, 200)
            print(
                f"ps={ps:3d} hash us/page: new {h['new_chained']:.3f} old {h['old_chained']:.3f}"
                f" sglang-native {h.get('sglang_native', float('nan')):.3f}"
                f" sha256(bytes) {h['sha256_page_bytes']:.3f}"
                f" hash(tuple) {h['builtin_hash_page_tuple']:.3f}"
                f" -> new/sglang {h.get('new_over_sglang_native', float('nan')):.2f}"
            )
        for ps in [] if args.flat_only else args.page_sizes:
            for pages in args.pages:
                cfg = argparse.Namespace(**{**vars(args), "page_size": ps, "pages": pages})
                t0 = time.perf_counter()
                r = run_config(old, cfg)
                r["seconds"] = time.perf_counter() - t0
                results["configs"].append(r)
                line = [f"ps={ps:3d} pages={pages:6d}"]
                for op in ("match", "match_key", "insert", "evict"):
                    o, n = r["old"][op], r["new"][op]
                    if n.get("n"):
                        line.append(
                            f"{op} old {o.get('mean_us', 0):.1f}/{o.get('p99_us', 0):.1f}"
                            f" new {n['mean_us']:.1f}/{n['p99_us']:.1f} us (mean/p99)"
                        )
                line.append(
                    " ".join(f"{k}_x={v:.1f}" for k, v in r["speedup_old_over_new"].items())
                )
                e = r["new"]["evict"]
                if e.get("n"):
                    line.append(
                        f"new evict per removed node {e['us_per_removed_node']:.1f}/"
                        f"{e['per_removed_node_p99_us']:.1f} us (mean/p99)"
                    )
                    v = e["victims_per_call"]
                    line.append(f"victims/call {v['mean']:.2f}/{v['p99']}")
                line.append(f"same_hits={r['same_hits']}")
                print("  ".join(line), flush=True)
        results["flatness"] = []
        for ps in args.page_sizes if args.flat_requests > 0 else []:
            cfg = argparse.Namespace(**{**vars(args), "page_size": ps})
            f = run_flatness(cfg, old if args.flat_old else None)
            results["flatness"].append(f)
            names = [str(p) for p in args.pages]
            names += [f"old_{p}" for p in args.pages] if args.flat_old else []
            for pages in names:
                e, v = f[pages]["evict"], f[pages]["victims_per_call"]
                pn = f[pages]["evict_per_removed_node"]
                eq = f[pages]["evict_equal_work"]
                print(
                    f"flat ps={ps:3d} pages={pages:>10} evict {e['mean_us']:.1f}/{e['p50_us']:.1f}"
                    f"/{e['p99_us']:.1f} us (mean/p50/p99) p99/smallest"
                    f" {e.get('p99_over_smallest', float('nan')):.2f}"
                    f" victims/call {v['mean']:.2f}/{v['p99']}"
                    f" pages/call {f[pages]['pages_freed_per_call']['mean']:.1f}"
                    f" per removed node {pn['mean_us']:.1f}/{pn['p99_us']:.1f} us"
                    f" | equal work {eq.get('mean_us', float('nan')):.1f}/"
                    f"{eq.get('p99_us', float('nan')):.1f} us p99/smallest"
                    f" {eq.get('p99_over_smallest', float('nan')):.2f}",
                    flush=True,
                )
    results["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"load average: start {results['load_average_start']} end {results['load_average_end']}")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        bench_common.write_json(bench_common.make_result("radix", config, results), args.json)


if __name__ == "__main__":
    main()
