"""L3 file backend: put / whole get / ranged get, object format 1 vs format 2, one run.

Example: ``python scripts/bench_storage.py --json out.json``. For each row kind (``kv``:
bf16 KV page rows ``[L, 2, 16, 2, 128]``, the last dim one 256-byte head; ``ssm``: f32
Mamba SSM rows ``[L, 8, 64, 128]``) and row size (default 64 KiB .. 4 MiB), a batch of
distinct random rows (about 16 MiB, at least 4 rows) is

- ``put`` under fresh keys (a new namespace every repeat, so nothing is already present),
- read back whole (``get``), and
- read back ranged (``get_ranges``: half the heads of every row, what a tp 1 -> 2 reader
  keeps; a format 1 object is read whole, as the backend does for old objects),

once by each writer: ``v1`` writes format 1 objects (header + payload, the format before
chunk tables; ``FileStorage`` with ``_chunk_bytes`` returning None, the hook the backend
keeps for this) and ``v2`` the backend as it is (header, chunk table, payload). Both read
with today's reader. The two alternate within every repeat (the order flips each repeat),
the process is pinned to one CPU (``--cpu``), and every operation records wall time and
the thread's CPU time (``time.thread_time``: waiting for a core held by another process is
not counted, so the CPU-time ratio is the robust one on a shared machine). Reported:
medians over repeats, GB/s of wall time, and the v2 / v1 ratios of both.

``--root`` picks the folder (default: the temp dir, i.e. the disk the serving default
root lives on; ``/dev/shm`` measures the CPU path without the file system's write
cost). Reads hit the page cache (the rows were just written). ``--secret`` seals both with
a keyed MAC (v1: HMAC-SHA256 of the payload; v2: SipHash-2-4 per chunk under the MAC'd
table, ``storage/native_mac.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import bench_common
import torch

from mesh_hicache.layout import GlobalSlice
from mesh_hicache.storage import FileStorage, KeyNamespace, StorageKey
from mesh_hicache.tiers.reshard import box_ranges

KiB, MiB = 1 << 10, 1 << 20
OPS = ("put", "get", "get_ranges")
WRITERS = ("v1", "v2")


class V1FileStorage(FileStorage):
    """The file backend writing object format 1 (header + payload, no chunk table), as
    every version before chunk tables did; reads are the backend's own (they accept 1)."""

    def _chunk_bytes(self, src: torch.Tensor) -> int | None:
        return None


def row_shape(kind: str, nbytes: int) -> tuple[tuple[int, ...], torch.dtype, int]:
    """Shape and dtype of a ``kind`` row of ``nbytes`` bytes, and the head dim of the shape."""
    if kind == "kv":
        per_layer = 2 * 16 * 2 * 128 * 2
        if nbytes % per_layer:
            raise ValueError(f"kv rows come in {per_layer}-byte layers, got --sizes {nbytes}")
        return (nbytes // per_layer, 2, 16, 2, 128), torch.bfloat16, 3
    if kind == "ssm":
        per_head = 64 * 128 * 4
        if nbytes % per_head:
            raise ValueError(f"ssm rows come in {per_head}-byte heads, got --sizes {nbytes}")
        heads = nbytes // per_head
        layers = max(1, heads // 8)
        if heads % layers:
            raise ValueError(f"ssm rows of {nbytes} bytes do not split into layers of 8 heads")
        return (layers, heads // layers, 64, 128), torch.float32, 1
    raise ValueError(f"unknown row kind {kind!r}; expected kv or ssm")


def half_heads(shape: tuple[int, ...], head_dim: int, itemsize: int) -> list[tuple[int, int]]:
    """Byte ranges of the first half of the heads of a row (a tp 1 -> 2 reader's part)."""
    box = tuple(slice(0, n) for n in shape)
    h = max(shape[head_dim] // 2, 1)
    box = box[:head_dim] + (slice(0, h),) + box[head_dim + 1 :]
    return list(box_ranges(shape, (box,), itemsize))


def bench_case(args: argparse.Namespace, kind: str, nbytes: int, base: str) -> dict[str, Any]:
    shape, dtype, head_dim = row_shape(kind, nbytes)
    count = max(4, args.batch_bytes // nbytes)
    g = torch.Generator().manual_seed(nbytes)
    src = [torch.randn(shape, generator=g).to(dtype) for _ in range(count)]
    dst = [torch.empty_like(t) for t in src]
    ranges = half_heads(shape, head_dim, src[0].element_size())
    secret = b"bench-storage-secret-0123" if args.secret else None
    times: dict[str, list[float]] = {
        f"{w}_{op}_{c}": [] for w in WRITERS for op in OPS for c in ("wall", "cpu")
    }
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        stores = {
            "v1": V1FileStorage(os.path.join(tmp, "v1"), secret=secret),
            "v2": FileStorage(os.path.join(tmp, "v2"), secret=secret),
        }
        sl = GlobalSlice((0, shape[0]), (0, 1), (0, 16))
        for rep in range(args.warmup + args.repeats):
            order = WRITERS if rep % 2 == 0 else WRITERS[::-1]
            for w in order:
                ns = KeyNamespace(f"bench/storage/{w}", str(dtype), rep)
                region = "kv" if kind == "kv" else "mamba_ssm"
                keys = [StorageKey(ns, region, i.to_bytes(8, "little"), sl) for i in range(count)]
                store = stores[w]
                calls = {
                    "put": lambda s=store, k=keys: s.put(k, src),
                    "get": lambda s=store, k=keys: s.get(k, dst),
                    "get_ranges": lambda s=store, k=keys: s.get_ranges(k, dst, [ranges] * count),
                }
                for op in OPS:
                    c0, t0 = time.thread_time(), time.perf_counter()
                    ok = calls[op]()
                    t1, c1 = time.perf_counter(), time.thread_time()
                    if not all(ok):
                        raise RuntimeError(f"{w} {op} of {kind} {nbytes}-byte rows missed")
                    if rep >= args.warmup:
                        times[f"{w}_{op}_wall"].append(t1 - t0)
                        times[f"{w}_{op}_cpu"].append(c1 - c0)
                    if op == "get" and not all(
                        torch.equal(a, b) for a, b in zip(src, dst, strict=True)
                    ):
                        raise RuntimeError(f"{w} get of {kind} rows returned other bytes")
                shutil.rmtree(os.path.join(tmp, w, "v1"), ignore_errors=True)
        for store in stores.values():
            store.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    row: dict[str, Any] = {"kind": kind, "row_bytes": nbytes, "rows": count, "shape": shape}
    total = count * nbytes
    for op in OPS:
        for w in WRITERS:
            row[f"{w}_{op}_gbps"] = total / med[f"{w}_{op}_wall"] / 1e9
            row[f"{w}_{op}_cpu_us"] = med[f"{w}_{op}_cpu"] / count * 1e6
        row[f"{op}_wall_ratio"] = med[f"v2_{op}_wall"] / med[f"v1_{op}_wall"]
        row[f"{op}_cpu_ratio"] = med[f"v2_{op}_cpu"] / med[f"v1_{op}_cpu"]
    row["samples"] = {k: v for k, v in times.items()}
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [bench_common.Column("kind", "row", align="left"), bench_common.Column("row_bytes")]
    for op in OPS:
        cols += [
            bench_common.Column(f"v1_{op}_gbps", f"{op} v1 GB/s", "{:.2f}"),
            bench_common.Column(f"v2_{op}_gbps", f"{op} v2 GB/s", "{:.2f}"),
            bench_common.Column(f"{op}_wall_ratio", f"{op} wall v2/v1", "{:.2f}"),
            bench_common.Column(f"{op}_cpu_ratio", f"{op} cpu v2/v1", "{:.2f}"),
        ]
    print(bench_common.markdown_table(rows, cols))


def parse_size(text: str) -> int:
    units = {"K": KiB, "M": MiB}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="kv,ssm", help="row kinds: kv, ssm (comma separated)")
    p.add_argument("--sizes", default="64K,256K,1M,4M", help="row sizes (comma separated)")
    p.add_argument("--batch-bytes", type=parse_size, default=16 * MiB)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--root", default=None, help="parent folder of the stores (default: temp)")
    p.add_argument("--cpu", type=int, default=None, help="CPU to pin to (default: first)")
    p.add_argument("--secret", action="store_true", help="seal objects with a keyed MAC")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[0] if args.cpu is None else args.cpu
    if cpu not in cpus:
        raise ValueError(f"--cpu {cpu} is not one of this process's CPUs {cpus}")
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    base = args.root or tempfile.gettempdir()
    load0 = os.getloadavg()
    rows = [
        bench_case(args, kind, parse_size(size), base)
        for kind in args.kinds.split(",")
        for size in args.sizes.split(",")
    ]
    load1 = os.getloadavg()
    print_table(rows)
    print(f"load average before {load0[0]:.2f}, after {load1[0]:.2f}; root {base}; cpu {cpu}")
    if args.json:
        config = dict(vars(args), cpu=cpu, root=base, load_before=load0, load_after=load1)
        bench_common.write_json(
            bench_common.make_result("storage", config, {"rows": rows}), args.json
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
