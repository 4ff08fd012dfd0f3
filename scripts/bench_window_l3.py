"""L3 bytes and restart hit rate of sliding-window KV, gpt-oss-shaped, as the cache stores it.

Replays one seeded trace through the real ``HiCache`` with a file L3 (the engine's cache
calls, no model; ``runtime.workloads.replay``), once per ``--checkpoints`` value of
``HiCacheConfig.window_checkpoint_tokens`` (``0`` stores every windowed page: the
baseline), each in a fresh store:

1. **write**: the trace into an empty cache, every node written through to L3; then the
   objects stored per region are counted (``kv``: the 12 full layers, ``kv_window``: the
   12 windowed ones);
2. **restart**: a new cache (empty L1/L2) on that store replays the trace again, the
   latest sessions first; its token hit rate and the part served from L3.

``--cap-fraction F`` also runs every setting with the file store capped at ``F`` times
the baseline's bytes (its own oldest-first cleanup): the restart hit rate at equal L3
bytes.

Bytes are reported at gpt-oss-20b's dims (8 KV heads of 64, bf16): the objects counted
times each region's row bytes, per cached token (``kv`` objects x page size). The cache
runs with 1 KV head of 8 (the counts do not depend on the head dims) so the store stays
small.

    python scripts/bench_window_l3.py --shape chat --seed 0 --checkpoints 0,1024,2048,4096 \\
        --json window_l3.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import bench_common
import torch
from bench_hitrate import one_rank_topology
from bench_window_bytes import GPT_OSS_20B, add_trace_args, trace_of

from mesh_hicache.cache import HiCache
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.spec import KVSpec, StateSpec, WindowSpec
from mesh_hicache.storage.keys import KeyNamespace
from mesh_hicache.tiers.discovery import MAX_LAYOUTS, entry_key
from runtime.workloads.replay import Replayer

LAYERS = GPT_OSS_20B.attention_layers
WINDOWED = tuple(range(0, LAYERS, 2))  # gpt-oss alternates sliding and full layers


def small_spec(page_size: int, window: int, sinks: int) -> StateSpec:
    kv = KVSpec(layer_ids=tuple(range(LAYERS)), num_kv_heads=1, head_dim=8, dtype=torch.float32)
    win = WindowSpec(layer_ids=WINDOWED, window=window, sink_tokens=sinks)
    return StateSpec(page_size=page_size, kv=kv, windows=(win,), model_id="gpt-oss-shape")


def region_objects(root: str) -> dict[str, int]:
    """Stored objects per region under a file store (``v1/<ns>/<region>/<hash>/<slice>``),
    the mesh-layout registry entries (``tiers/discovery.py``) left out."""
    any_ns = KeyNamespace(model_id="m", dtype="float32", layout_version=1)
    registry = {entry_key(any_ns, i).page_hash.hex() for i in range(MAX_LAYOUTS)}
    counts: dict[str, int] = {}
    for dirpath, _dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root).split(os.sep)
        if len(rel) == 4 and rel[0] == "v1" and rel[3] not in registry:
            n = sum(not f.startswith(".tmp-") for f in files)
            counts[rel[2]] = counts.get(rel[2], 0) + n
    return counts


def replay(cache: HiCache, trace: list[Any]) -> dict[str, float]:
    """The trace through ``cache``: its token hit rate and the share of the input tokens
    served from each tier."""
    player = Replayer(cache)
    inputs = reused = 0
    tiers = [0, 0, 0]
    for req in trace:
        served = player.serve(req.input_tokens, req.output_tokens)
        inputs += served.input_tokens
        reused += served.reused_tokens
        tiers = [t + r for t, r in zip(tiers, served.reused, strict=True)]
    share = [t / inputs if inputs else 0.0 for t in tiers]
    return {
        "token_hit_rate": reused / inputs if inputs else 0.0,
        "device_share": share[0],
        "host_share": share[1],
        "storage_share": share[2],
    }


def latest_first(trace: list[Any]) -> list[Any]:
    """The restart's order: sessions from the last one to end to the first, each in turn
    order. What a capped store kept (its oldest objects go first) is asked for first, so
    the restart measures how much of the trace the store held, not an LRU scan."""
    last: dict[Any, int] = {}
    for i, req in enumerate(trace):
        last[req.session_id] = i
    order = sorted(last, key=lambda sid: -last[sid])
    by_session: dict[Any, list[Any]] = {sid: [] for sid in order}
    for req in trace:
        by_session[req.session_id].append(req)
    return [req for sid in order for req in sorted(by_session[sid], key=lambda r: r.turn)]


def store_bytes(root: str) -> int:
    """Bytes of every file under ``root`` (object headers included)."""
    return sum(
        os.path.getsize(os.path.join(d, f)) for d, _dirs, files in os.walk(root) for f in files
    )


def run(
    args: argparse.Namespace, trace: list[Any], checkpoint: int, cap: int | None = None
) -> dict[str, Any]:
    """One setting: write the trace, count, restart. ``cap``: the file store's byte cap
    (its own oldest-first cleanup keeps it under), None for none."""
    spec = small_spec(args.page_size, args.window, args.sink_tokens)
    with tempfile.TemporaryDirectory(prefix="window_l3_") as root:
        config = HiCacheConfig(
            device_pages=args.device_pages,
            host_pages=args.device_pages * 2,
            storage="file",
            storage_options={"root": root, "max_bytes": cap},
            write_policy="write_through",
            prefetch_threshold=args.page_size,
            transfer="cpu",
            window_checkpoint_tokens=checkpoint,
        )
        topo = one_rank_topology()
        t0 = time.perf_counter()
        writer = HiCache(topo, spec, config)
        replay(writer, trace)
        writer.close()
        objects = region_objects(root)
        stored = store_bytes(root)
        reader = HiCache(topo, spec, config)
        restart = replay(reader, latest_first(trace))
        reader.close()
    p = GPT_OSS_20B
    row = args.page_size * 2 * p.num_kv_heads * p.head_dim * p.dtype_bytes  # one layer-page
    full_layers = LAYERS - len(WINDOWED)
    kv, win = objects.get("kv", 0), objects.get("kv_window", 0)
    tokens = kv * args.page_size
    return {
        "checkpoint_tokens": checkpoint,
        "store_cap": cap,
        "store_bytes": stored,
        "kv_objects": kv,
        "kv_window_objects": win,
        "window_pages_stored": win / kv if kv else 0.0,
        "l3_bytes_per_cached_token": (kv * full_layers + win * len(WINDOWED)) * row / tokens
        if tokens
        else 0.0,
        "restart": restart,
        "wall_s": time.perf_counter() - t0,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_trace_args(p)
    p.add_argument("--checkpoints", default="0,2048", help="window_checkpoint_tokens values")
    p.add_argument("--device-pages", type=int, default=4096)
    p.add_argument(
        "--cap-fraction",
        type=float,
        default=0.0,
        help="also run every setting with the store capped at this fraction of the "
        "baseline's bytes (the restart hit rate at equal L3 bytes); 0: no capped runs",
    )
    p.add_argument("--json", default=None, help="write the results here")
    return p


def checkpoint_values(args: argparse.Namespace) -> list[int]:
    """The ``--checkpoints`` values, with ``0`` (every windowed page kept: the baseline)."""
    values = [int(v) for v in args.checkpoints.split(",")]
    return values if 0 in values else [0, *values]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    trace = trace_of(args)
    values = checkpoint_values(args)
    runs = [run(args, trace, v) for v in values]
    base = runs[values.index(0)]
    if args.cap_fraction > 0:
        cap = int(args.cap_fraction * base["store_bytes"])
        capped = [run(args, trace, v, cap) for v in values]
        report(capped, capped[values.index(0)])
    else:
        capped = []
    report(runs, base)
    config = {**vars(args), "requests": len(trace), "profile": "gpt-oss-20b"}
    result = bench_common.make_result("window_l3", config, {"runs": runs, "capped": capped})
    print(json.dumps(result["results"], indent=2))
    if args.json:
        bench_common.write_json(result, args.json)
    return 0


def report(runs: list[dict[str, Any]], base: dict[str, Any]) -> None:
    """Add each run's ratios over ``base`` (same run) and print one line per run."""
    for r in runs:
        b = base["l3_bytes_per_cached_token"]
        r["bytes_ratio"] = r["l3_bytes_per_cached_token"] / b if b else 0.0
        h = base["restart"]["token_hit_rate"]
        r["restart_hit_ratio"] = r["restart"]["token_hit_rate"] / h if h else 0.0
        h3 = base["restart"]["storage_share"]
        r["restart_l3_ratio"] = r["restart"]["storage_share"] / h3 if h3 else 0.0
        print(
            f"bench_window_l3: checkpoints {r['checkpoint_tokens']} cap {r['store_cap']}: "
            f"windowed pages stored "
            f"{r['window_pages_stored']:.1%}, L3 bytes/token {r['l3_bytes_per_cached_token']:.0f}"
            f" ({r['bytes_ratio']:.3f}x); restart hit rate {r['restart']['token_hit_rate']:.2%}"
            f" ({r['restart_hit_ratio']:.3f}x), from L3 {r['restart']['storage_share']:.2%} "
            f"({r['restart_l3_ratio']:.3f}x)",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    raise SystemExit(main())
