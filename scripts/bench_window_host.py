"""L2 bytes and hit rate of sliding-window KV at equal host bytes, gpt-oss-shaped.

Replays one seeded trace through the real ``HiCache`` (the engine's cache calls, no
model; ``runtime.workloads.replay``) with a small L1 and an L2 of one byte budget (one
arena, no L3), once per ``--checkpoints`` value of
``HiCacheConfig.window_checkpoint_tokens``. ``0`` keeps every windowed page on host (a
windowed layer treated like a full one: the baseline); larger values keep only the pages
a resume at a node end or at a checkpoint needs, so the same bytes hold more pages.

Per setting: the token hit rate, the share served from L2, and the bytes L2 held per
cached token at the end of the run, priced at gpt-oss-20b's dims (8 KV heads of 64, bf16;
12 sliding layers of 128 tokens alternating with 12 full ones): host pages times the full
layers' row plus window rows times the windowed layers' row. The cache runs with 1 KV head
of 8 (the arena then holds the same number of pages and rows per byte of budget as the
model's, since both layer groups shrink alike) so the run stays small. Ratios are over the
baseline from the same run; settings run one after another on the same trace.

    python scripts/bench_window_host.py --shape chat --seed 0 --device-pages 512 \\
        --host-pages 2048 --checkpoints 0,1024,2048,4096 --json window_host.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import bench_common
from bench_hitrate import one_rank_topology
from bench_window_bytes import GPT_OSS_20B, add_trace_args, trace_of
from bench_window_l3 import LAYERS, WINDOWED, checkpoint_values, replay, small_spec

from mesh_hicache.cache import HiCache
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.layout import StateLayout
from mesh_hicache.testing import internals


def run(args: argparse.Namespace, trace: list[Any], checkpoint: int) -> dict[str, Any]:
    spec = small_spec(args.page_size, args.window, args.sink_tokens)
    layout = StateLayout.for_coords(spec, (1, 1, 1), (0, 0, 0))
    # The budget: --host-pages pages with every windowed page kept (the baseline's page).
    config = HiCacheConfig(
        device_pages=args.device_pages,
        host_bytes=args.host_pages * layout.page_bytes,
        write_policy="write_through",
        transfer="cpu",
        window_checkpoint_tokens=checkpoint,
    )
    t0 = time.perf_counter()
    cache = HiCache(one_rank_topology(), spec, config)
    served = replay(cache, trace)
    cache.flush()
    host = internals(cache).host
    assert host is not None
    pages, rows = host.page_allocator.num_used, host.window_allocator.num_used
    cache.close()
    p = GPT_OSS_20B
    row = args.page_size * 2 * p.num_kv_heads * p.head_dim * p.dtype_bytes  # one layer-page
    held = (pages * (LAYERS - len(WINDOWED)) + rows * len(WINDOWED)) * row
    tokens = pages * args.page_size
    return {
        "checkpoint_tokens": checkpoint,
        "host_pages": pages,
        "host_window_rows": rows,
        "window_pages_held": rows / pages if pages else 0.0,
        "l2_bytes_per_cached_token": held / tokens if tokens else 0.0,
        "served": served,
        "wall_s": time.perf_counter() - t0,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_trace_args(p)
    p.add_argument("--checkpoints", default="0,2048", help="window_checkpoint_tokens values")
    p.add_argument("--device-pages", type=int, default=512, help="L1 pages (a fixed pool)")
    p.add_argument(
        "--host-pages",
        type=int,
        default=2048,
        help="L2 byte budget, in pages that keep every windowed page",
    )
    p.add_argument("--json", default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    trace = trace_of(args)
    values = checkpoint_values(args)
    runs = [run(args, trace, v) for v in values]
    base = runs[values.index(0)]
    for r in runs:
        b = base["l2_bytes_per_cached_token"]
        r["bytes_ratio"] = r["l2_bytes_per_cached_token"] / b if b else 0.0
        h, h2 = base["served"]["token_hit_rate"], base["served"]["host_share"]
        r["hit_ratio"] = r["served"]["token_hit_rate"] / h if h else 0.0
        r["host_ratio"] = r["served"]["host_share"] / h2 if h2 else 0.0
        print(
            f"bench_window_host: checkpoints {r['checkpoint_tokens']}: windowed pages held "
            f"{r['window_pages_held']:.1%}, L2 bytes/token {r['l2_bytes_per_cached_token']:.0f}"
            f" ({r['bytes_ratio']:.3f}x), pages held {r['host_pages']}; hit rate "
            f"{r['served']['token_hit_rate']:.2%} ({r['hit_ratio']:.3f}x), from L2 "
            f"{r['served']['host_share']:.2%} ({r['host_ratio']:.3f}x)",
            file=sys.stderr,
            flush=True,
        )
    config = {**vars(args), "requests": len(trace), "profile": "gpt-oss-20b"}
    result = bench_common.make_result("window_host", config, {"runs": runs})
    print(json.dumps(result["results"], indent=2))
    if args.json:
        bench_common.write_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
