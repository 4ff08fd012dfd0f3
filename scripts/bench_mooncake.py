"""Benchmark: MooncakeStorage put/get of host pages vs raw Mooncake zero-copy batch calls.

Both sides move the same pages (rows of one registered host pool) in the same run:
``MooncakeStorage.put/get`` (existence check, 64-byte header with checksum per object,
scatter/gather from the pool row) against ``batch_put_from`` / ``batch_get_into`` of the
bare rows under other keys. Prints GB/s for each and the backend/raw ratio.

Needs a running master and client, e.g.::

    scripts/mooncake_local.sh -- .venv/bin/python scripts/bench_mooncake.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mesh_hicache.layout import GlobalSlice
from mesh_hicache.storage.keys import KeyNamespace, StorageKey
from mesh_hicache.storage.mooncake import MooncakeStorage

_R = TypeVar("_R")


def _timed(fn: Callable[..., list[_R]], *args: Any) -> tuple[float, list[_R]]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, list(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--master", default=os.environ.get("MOONCAKE_MASTER", "127.0.0.1:50051"))
    parser.add_argument("--pages", type=int, default=64, help="pages per batch")
    parser.add_argument("--page-kib", type=int, default=256, help="bytes per page, KiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results to this path")
    args = parser.parse_args()

    storage = MooncakeStorage(args.master)
    raw = storage._store  # the same client: both sides share connection and transport
    page_bytes = args.page_kib << 10
    pool = torch.randint(0, 256, (args.pages, page_bytes), dtype=torch.uint8)
    back = torch.zeros_like(pool)
    storage.register_buffer(pool)
    storage.register_buffer(back)
    rows = [pool[i] for i in range(args.pages)]
    back_rows = [back[i] for i in range(args.pages)]
    ptrs = [r.data_ptr() for r in rows]
    back_ptrs = [r.data_ptr() for r in back_rows]
    sizes = [page_bytes] * args.pages
    ns = KeyNamespace(model_id="bench", dtype="uint8", layout_version=1)
    sl = GlobalSlice(layers=(0, 1), heads=(0, 1), tokens=(0, 16))

    times: dict[str, list[float]] = {"put": [], "get": [], "raw_put": [], "raw_get": []}
    for _ in range(args.rounds):
        tag = uuid.uuid4().bytes
        keys = [StorageKey(ns, "kv", tag + i.to_bytes(4, "little"), sl) for i in range(args.pages)]
        raw_keys = [f"bench-raw/{tag.hex()}/{i}" for i in range(args.pages)]
        t, put_flags = _timed(storage.put, keys, rows)
        times["put"].append(t)
        t, get_flags = _timed(storage.get, keys, back_rows)
        times["get"].append(t)
        assert all(put_flags + get_flags) and torch.equal(pool, back), "backend round trip"
        back.zero_()
        t, put_codes = _timed(raw.batch_put_from, raw_keys, ptrs, sizes)
        times["raw_put"].append(t)
        t, get_codes = _timed(raw.batch_get_into, raw_keys, back_ptrs, sizes)
        times["raw_get"].append(t)
        assert all(c >= 0 for c in put_codes + get_codes), "raw round trip failed"
        assert torch.equal(pool, back), "raw round trip returned other bytes"
        for name in [k.to_str() for k in keys] + raw_keys:
            raw.remove(name, True)

    nbytes = args.pages * page_bytes
    gbps = {op: nbytes / statistics.median(t) / 1e9 for op, t in times.items()}
    result = {
        "pages": args.pages,
        "page_bytes": page_bytes,
        "rounds": args.rounds,
        "gb_per_s": gbps,
        "put_ratio": gbps["put"] / gbps["raw_put"],
        "get_ratio": gbps["get"] / gbps["raw_get"],
    }
    for op in ("put", "get"):
        print(
            f"{op}: backend {gbps[op]:.2f} GB/s, raw {gbps['raw_' + op]:.2f} GB/s, "
            f"ratio {result[op + '_ratio']:.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    storage.close()


if __name__ == "__main__":
    main()
