"""Transfer engine bandwidth and fixed cost per operation, against a one-thread memcpy.

Example: ``python scripts/bench_transfer.py --json out.json``. For each page size (default
16 and 64 tokens of an 8-head x 128-dim bf16 KV layer set, 4 layers) and each operation
size (64 KiB .. 64 MiB, as many whole pages as fit), ``backup`` and ``load`` of random
device and host pages are timed against the baseline: ONE contiguous copy of the same
bytes on one thread (CPU: ``ctypes.memmove``, torch pinned to one thread; CUDA: a
``copy_`` between a device tensor and a torch ``pin_memory`` tensor, i.e. a plain pinned
``cudaMemcpy``, in both directions). All functions of one size alternate within every
repeat, so load from other processes hits them alike; medians are reported, of wall time
and (CPU engine) of process CPU time too: on a machine shared with other processes the
CPU-time ratio is the robust one (waiting for a core is not counted, for either side).

Fixed cost per operation, on a 32-layer model with tiny rows (one page = 16 KiB): the
latency of a one-page operation (submit to ``wait()``) minus the baseline's time for its
bytes; the same per operation for a stream of one-page operations submitted back to back;
the process CPU time of a one-page operation minus the baseline's (which does not count
waiting for a core held by other processes); and the best (minimum) latency minus the
baseline's best, what an idle core gives.

``--old REV`` (default ``4301f1e``, the engine before the bulk-address rewrite) extracts
that revision's engine with ``git show`` into a temporary folder and measures it in the
same run, alternating with the current one (skipped with a note when git or the revision
is missing). Nothing of it is kept.

``--seal`` runs only the L3 object-seal section (``bench_seal_cost``): backup (``put``)
and load (``get``) of the same pages through ``FileStorage`` on tmpfs with the default
CRC32 tag and with a storage secret (keyed MAC), and the tag computation alone.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import bench_common
import torch

from mesh_hicache.choices import TransferBackend
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools import DevicePools, HostPools
from mesh_hicache.spec import KVSpec, StateSpec
from mesh_hicache.transfer import make_transfer_engine

KiB, MiB = 1 << 10, 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shuffled(fns: dict[str, Callable[[], None]], rep: int) -> list[tuple[str, Callable[[], None]]]:
    """``fns`` in an order drawn afresh for each repeat (seeded): no function always runs
    right after the same other one (the old engine's worker finishing its last op would
    otherwise always slow down the same successor)."""
    items = list(fns.items())
    random.Random(rep).shuffle(items)
    return items


def timed(
    fns: dict[str, Callable[[], None]], repeats: int, sync: Callable[[], None]
) -> tuple[dict, dict, dict]:
    """(median wall seconds, median process CPU seconds, best wall seconds) of each
    function; the functions alternate within every repeat so that load from other
    processes hits all of them alike, in a shuffled order (see :func:`shuffled`). One
    warm-up round first. CPU time (every thread of this process) does not count waiting
    for a core that other processes hold; the best wall time is what an idle core gives."""
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(repeats + 1):
        for name, fn in shuffled(fns, rep):
            sync()
            c0, start = time.process_time(), time.perf_counter()
            fn()
            sync()
            if rep:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - c0)
    med = {name: statistics.median(ts) for name, ts in wall.items()}
    return (
        med,
        {n: statistics.median(ts) for n, ts in cpu.items()},
        {n: min(ts) for n, ts in wall.items()},
    )


def cpu_seconds(fns: dict[str, Callable[[], None]], repeats: int) -> dict:
    """Median process CPU seconds (every thread of this process) per call, alternating.

    Unlike wall time this does not count waiting for a core that other processes hold,
    so it shows the per-operation work even on a loaded machine."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(repeats + 1):
        for name, fn in shuffled(fns, rep):
            start = time.process_time()
            for _ in range(10):
                fn()
            if rep:
                times[name].append((time.process_time() - start) / 10)
    return {name: statistics.median(ts) for name, ts in times.items()}


def old_engine_factory(rev: str, tmp: str) -> tuple[Callable[..., Any] | None, str]:
    """The CPU and CUDA engine classes of ``rev`` (a factory like ``make_transfer_engine``).

    Files are written under ``tmp`` as package ``old_transfer``; returns (None, reason)
    when they cannot be extracted or imported.
    """
    pkg = os.path.join(tmp, "old_transfer")
    os.makedirs(pkg, exist_ok=True)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    for name in ("engine", "cpu", "cuda"):
        try:
            text = subprocess.run(
                ["git", "-C", REPO, "show", f"{rev}:mesh_hicache/transfer/{name}.py"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        except (OSError, subprocess.CalledProcessError) as exc:
            return None, f"git show {rev} failed: {exc}"
        text = text.replace("mesh_hicache.transfer.engine", "old_transfer.engine")
        with open(os.path.join(pkg, f"{name}.py"), "w") as f:
            f.write(text)
    sys.path.insert(0, tmp)
    try:
        cpu = importlib.import_module("old_transfer.cpu")
    except Exception as exc:  # the old code may no longer fit today's pools
        return None, f"old engine does not import: {type(exc).__name__}: {exc}"

    def make(dev: DevicePools, host: HostPools) -> Any:
        if dev.device.type == "cuda":
            return importlib.import_module("old_transfer.cuda").CudaTransferEngine(dev, host)
        return cpu.CpuTransferEngine(dev, host)

    return make, ""


def pin() -> int | None:
    """Pin this process (the baseline's thread, the caller and the engine's worker, which
    inherits it) to one CPU, the last it may use; returns it. One core for both sides: the
    engine cannot borrow a second core the one-thread baseline does not get."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, {cpu})
    return cpu


def build(page_size: int, layers: int, heads: int, head_dim: int, pages: int, device: str):
    spec = StateSpec(
        model_id="bench-transfer",
        page_size=page_size,
        kv=KVSpec(
            layer_ids=tuple(range(layers)),
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=torch.bfloat16,
        ),
    )
    layout = StateLayout.for_coords(spec, (1, 1, 1), (0, 0, 0))
    dev = DevicePools(layout, num_pages=pages, device=device)
    host = HostPools(layout, num_pages=pages)
    return layout, dev, host


class Baseline:
    """One contiguous copy of ``nbytes`` on one thread, in both directions."""

    def __init__(self, nbytes: int, device: str) -> None:
        self.cuda = device == "cuda"
        self.dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def d2h(self, nbytes: int) -> None:
        if self.cuda:
            self.host[:nbytes].copy_(self.dev[:nbytes], non_blocking=True)
        else:
            ctypes.memmove(self.host.data_ptr(), self.dev.data_ptr(), nbytes)

    def h2d(self, nbytes: int) -> None:
        if self.cuda:
            self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
        else:
            ctypes.memmove(self.dev.data_ptr(), self.host.data_ptr(), nbytes)


def bench_bandwidth(args: argparse.Namespace, device: str, old: Callable | None) -> list[dict]:
    """Rows of (page size, op size): GB/s and ratio to the baseline per engine and direction."""
    rows: list[dict] = []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    for ps in args.page_sizes:
        layout, _, _ = build(ps, args.layers, args.heads, args.head_dim, 0, device)
        page_bytes = layout.region("kv").row_bytes
        sizes = sorted({max(1, int(kib * KiB) // page_bytes) for kib in args.sizes_kib})
        pool = int(max(sizes) * args.pool_factor) + 1
        layout, dev, host = build(ps, args.layers, args.heads, args.head_dim, pool, device)
        engines = {"new": make_transfer_engine(dev, host)}
        if old is not None:
            engines["old"] = old(dev, host)
        base = Baseline(max(sizes) * page_bytes, device)
        for pages in sizes:
            nbytes = pages * page_bytes
            dp = torch.randperm(pool, generator=gen)[:pages].tolist()
            hp = torch.randperm(pool, generator=gen)[:pages].tolist()
            fns: dict[str, Callable[[], None]] = {
                "memcpy_d2h": lambda n=nbytes, b=base: b.d2h(n),
                "memcpy_h2d": lambda n=nbytes, b=base: b.h2d(n),
            }
            for name, eng in engines.items():
                fns[f"{name}_backup"] = lambda e=eng, d=dp, h=hp: _ok(e.backup((d, h)))
                fns[f"{name}_load"] = lambda e=eng, d=dp, h=hp: _ok(e.load((d, h)))
            repeats = min(args.max_repeats, max(args.repeats, args.repeats * (4 * MiB) // nbytes))
            t, c, _ = timed(fns, repeats, sync)
            row: dict[str, Any] = {"page_size": ps, "pages": pages, "op_bytes": nbytes}
            row["memcpy_gbps"] = nbytes / t["memcpy_d2h"] / 1e9
            row["memcpy_h2d_gbps"] = nbytes / t["memcpy_h2d"] / 1e9
            for name in engines:
                for op, ref in (("backup", "memcpy_d2h"), ("load", "memcpy_h2d")):
                    row[f"{name}_{op}_gbps"] = nbytes / t[f"{name}_{op}"] / 1e9
                    row[f"{name}_{op}_ratio"] = t[ref] / t[f"{name}_{op}"]
                    if device != "cuda":  # CPU copies: CPU time is the copy's own work
                        row[f"{name}_{op}_cpu_ratio"] = c[ref] / c[f"{name}_{op}"]
            rows.append(row)
        for eng in engines.values():
            eng.close()
    return rows


def _ok(handle: Any) -> None:
    assert handle.wait(), handle


def bench_fixed_cost(args: argparse.Namespace, device: str, old: Callable | None) -> dict:
    """Per-op fixed cost on a ``--fixed-layers`` model with tiny rows (one page per op)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    layout, dev, host = build(16, args.fixed_layers, 1, 8, 256, device)
    page_bytes = layout.region("kv").row_bytes
    engines = {"new": make_transfer_engine(dev, host)}
    if old is not None:
        engines["old"] = old(dev, host)
    base = Baseline(page_bytes, device)
    stream = args.stream_ops

    def memcpy_stream() -> None:
        for _ in range(stream):
            base.d2h(page_bytes)

    fns: dict[str, Callable[[], None]] = {
        "memcpy": lambda: base.d2h(page_bytes),
        "memcpy_stream": memcpy_stream,
    }
    for name, eng in engines.items():
        fns[f"{name}_backup"] = lambda e=eng: _ok(e.backup(([3], [7])))
        fns[f"{name}_load"] = lambda e=eng: _ok(e.load(([3], [7])))

        def burst(e: Any = eng) -> None:
            handles = [e.load(([i % 256], [(7 * i) % 256])) for i in range(stream)]
            for h in handles:
                _ok(h)

        fns[f"{name}_load_stream"] = burst
    t, _, best = timed(fns, args.fixed_repeats, sync)
    single = {k: f for k, f in fns.items() if k in ("memcpy",) or k.endswith(("backup", "load"))}
    cpu = cpu_seconds(single, max(5, args.fixed_repeats // 10))
    for eng in engines.values():
        eng.close()
    out: dict[str, Any] = {
        "layers": args.fixed_layers,
        "page_bytes": page_bytes,
        "stream_ops": stream,
        "memcpy_us": t["memcpy"] * 1e6,
    }
    for name in engines:
        for op in ("backup", "load"):
            out[f"{name}_{op}_op_us"] = t[f"{name}_{op}"] * 1e6
            out[f"{name}_{op}_fixed_us"] = (t[f"{name}_{op}"] - t["memcpy"]) * 1e6
            out[f"{name}_{op}_best_fixed_us"] = (best[f"{name}_{op}"] - best["memcpy"]) * 1e6
            out[f"{name}_{op}_cpu_us"] = (cpu[f"{name}_{op}"] - cpu["memcpy"]) * 1e6
        per_op = (t[f"{name}_load_stream"] - t["memcpy_stream"]) / stream
        out[f"{name}_load_stream_fixed_us"] = per_op * 1e6
    return out


def print_tables(bandwidth: list[dict], fixed: dict, engines: list[str]) -> None:
    cols = [
        bench_common.Column("page_size", "ps"),
        bench_common.Column("op_bytes", "op", lambda b: f"{b / MiB:.2f} MiB"),
        bench_common.Column("memcpy_gbps", "memcpy GB/s", "{:.2f}"),
    ]
    for name in engines:
        for op in ("backup", "load"):
            cols.append(bench_common.Column(f"{name}_{op}_gbps", f"{name} {op} GB/s", "{:.2f}"))
            cols.append(bench_common.Column(f"{name}_{op}_ratio", "x memcpy", "{:.2f}"))
            if f"{name}_{op}_cpu_ratio" in bandwidth[0]:
                cols.append(bench_common.Column(f"{name}_{op}_cpu_ratio", "x (cpu)", "{:.2f}"))
    print(bench_common.markdown_table(bandwidth, cols))
    print()
    print(bench_common.key_value_table(fixed, "{:.1f}"))


# -- L3 object seal: CRC32 vs keyed MAC ------------------------------------------------------


def bench_seal_cost(args: argparse.Namespace) -> list[dict]:
    """Per page size: GB/s of the L3 backup and load path (``FileStorage.put``/``get`` of
    16 MiB of KV pages on tmpfs, fresh keys every repeat) and of the tag alone, without a
    secret (CRC32) and with one (HMAC-SHA256), alternating within every repeat; medians."""
    from mesh_hicache.layout import GlobalSlice
    from mesh_hicache.storage import FileStorage, KeyNamespace, StorageKey
    from mesh_hicache.storage.keys import PLAIN_CODEC, ObjectCodec, key_digest, tensor_bytes

    secret = b"bench-transfer-seal-secret"
    codecs = {"crc32": PLAIN_CODEC, "mac": ObjectCodec(secret)}
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None  # CPU cost, not the disk's
    rows = []
    for page_size in args.page_sizes:
        page_bytes = 2 * page_size * args.layers * args.heads * args.head_dim * 2  # K+V, bf16
        pages = max(1, 16 * MiB // page_bytes)
        g = torch.Generator().manual_seed(page_size)
        pool = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, generator=g)
        src = list(pool)  # distinct rows: no page is re-read from a warm cache
        dst = [torch.empty_like(t) for t in src]
        times: dict[str, list[float]] = {
            f"{c}_{op}": [] for c in codecs for op in ("tag", "put", "get")
        }
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            stores = {
                "crc32": FileStorage(os.path.join(tmp, "crc32")),
                "mac": FileStorage(os.path.join(tmp, "mac"), secret=secret),
            }
            digest = key_digest("bench")
            for rep in range(args.repeats):
                ns = KeyNamespace("bench/seal", "bfloat16", rep)
                sl = GlobalSlice((0, args.layers), (0, args.heads), (0, page_size))
                keys = [StorageKey(ns, "kv", i.to_bytes(8, "little"), sl) for i in range(pages)]
                for name, codec in codecs.items():
                    views = [tensor_bytes(t) for t in src]
                    t0 = time.perf_counter()
                    for v in views:
                        codec.tag(digest, v)
                    t1 = time.perf_counter()
                    assert all(stores[name].put(keys, src))
                    t2 = time.perf_counter()
                    assert all(stores[name].get(keys, dst))
                    t3 = time.perf_counter()
                    times[f"{name}_tag"].append(t1 - t0)
                    times[f"{name}_put"].append(t2 - t1)
                    times[f"{name}_get"].append(t3 - t2)
                    shutil.rmtree(os.path.join(tmp, name, "v1"))
            for store in stores.values():
                store.close()
        total = pages * page_bytes
        med = {k: statistics.median(v) for k, v in times.items()}
        row: dict[str, Any] = {"page_size": page_size, "page_bytes": page_bytes, "pages": pages}
        row.update({f"{k}_gbps": total / t / 1e9 for k, t in med.items()})
        for op in ("tag", "put", "get"):
            row[f"mac_{op}_slowdown"] = med[f"mac_{op}"] / med[f"crc32_{op}"]
        rows.append(row)
    return rows


def print_seal_table(rows: list[dict]) -> None:
    cols = [bench_common.Column("page_size", "page tokens"), bench_common.Column("page_bytes")]
    for op in ("tag", "put", "get"):
        for codec in ("crc32", "mac"):
            cols.append(bench_common.Column(f"{codec}_{op}_gbps", f"{op} {codec} GB/s", "{:.2f}"))
        cols.append(bench_common.Column(f"mac_{op}_slowdown", f"{op} MAC/CRC", "{:.2f}x"))
    print(bench_common.markdown_table(rows, cols))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--page-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64]
    )
    parser.add_argument(
        "--sizes-kib",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[64, 256, 1024, 4096, 16384, 65536],
        help="operation sizes in KiB (rounded down to whole pages, at least one)",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--pool-factor", type=float, default=1.5, help="pool pages / op pages")
    parser.add_argument("--repeats", type=int, default=9, help="repeats at >= 4 MiB")
    parser.add_argument("--max-repeats", type=int, default=60, help="repeats of small ops")
    parser.add_argument("--fixed-layers", type=int, default=32)
    parser.add_argument("--fixed-repeats", type=int, default=200)
    parser.add_argument("--stream-ops", type=int, default=32)
    parser.add_argument("--old", default="4301f1e", help="git revision to compare ('' = none)")
    parser.add_argument(
        "--device", default=TransferBackend.AUTO.value, choices=TransferBackend.values()
    )
    parser.add_argument("--json", default=None, help="write results to this path")
    parser.add_argument(
        "--seal", action="store_true", help="only the L3 seal section (CRC32 vs keyed MAC)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # the baseline is ONE thread; the CPU engine uses one worker
    pinned = pin()
    if args.seal:
        seal = bench_seal_cost(args)
        print_seal_table(seal)
        if args.json:
            config = {k: v for k, v in vars(args).items() if k != "json"}
            bench_common.write_json(
                bench_common.make_result("storage_seal", config, {"seal": seal}), args.json
            )
        return
    device = str(TransferBackend(args.device))
    if device == TransferBackend.AUTO:
        device = str(TransferBackend.CUDA if torch.cuda.is_available() else TransferBackend.CPU)
    with tempfile.TemporaryDirectory() as tmp:
        old, why = old_engine_factory(args.old, tmp) if args.old else (None, "not asked")
        if old is None:
            print(f"old engine skipped: {why}")
        bandwidth = bench_bandwidth(args, device, old)
        fixed = bench_fixed_cost(args, device, old)
    engines = ["new"] + (["old"] if old is not None else [])
    print_tables(bandwidth, fixed, engines)
    big = [r for r in bandwidth if r["op_bytes"] >= 4 * MiB]
    summary = {
        "engine": str(TransferBackend(device)),
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "pinned_cpu": pinned,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "min_ratio_at_4mib_plus": min(
            (min(r["new_backup_ratio"], r["new_load_ratio"]) for r in big), default=None
        ),
        "min_cpu_ratio_at_4mib_plus": min(
            (min(r.get("new_backup_cpu_ratio", 0), r.get("new_load_cpu_ratio", 0)) for r in big),
            default=None,
        ),
        "fixed_cost_us": max(fixed["new_backup_fixed_us"], fixed["new_load_fixed_us"]),
        "best_fixed_cost_us": max(
            fixed["new_backup_best_fixed_us"], fixed["new_load_best_fixed_us"]
        ),
        "stream_fixed_cost_us": fixed["new_load_stream_fixed_us"],
        "fixed_cpu_us": max(fixed["new_backup_cpu_us"], fixed["new_load_cpu_us"]),
        "old_compared": old is not None,
    }
    print()
    print(bench_common.key_value_table(summary, "{:.3f}"))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        results = {"summary": summary, "bandwidth": bandwidth, "fixed_cost": fixed}
        out = bench_common.make_result("transfer", config, results)
        out.update(summary)  # flat keys at the top too, as before
        bench_common.write_json(out, args.json)


if __name__ == "__main__":
    main()
