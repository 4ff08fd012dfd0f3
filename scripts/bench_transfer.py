"""Transfer engine bandwidth: backup/load of N random pages vs one contiguous copy.

Example: ``python scripts/bench_transfer.py --pages 128 --json out.json``. Defaults: 64-token
pages of an 8-head x 128-dim bf16 KV layer set (4 layers), random device and host pages.
The baseline copies the same number of bytes as one plain contiguous ``copy_`` in the same
run, on the same device pair (CPU: memory to memory; CUDA: device <-> pinned host).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import bench_common
import torch

from mesh_hicache.layout import StateLayout
from mesh_hicache.pools import DevicePools, HostPools
from mesh_hicache.spec import KVSpec, StateSpec
from mesh_hicache.transfer import make_transfer_engine


def timed(fns: dict[str, Callable[[], None]], repeats: int, sync: Callable[[], None]) -> dict:
    """Median seconds of each function; the functions alternate within every repeat so
    that load from other processes hits all of them alike. One warm-up round first."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(repeats + 1):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=128, help="pages per operation")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--pool-factor", type=float, default=1.5, help="pool pages / --pages")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--json", default=None, help="write results to this path")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"

    spec = StateSpec(
        page_size=args.page_size,
        kv=KVSpec(
            layer_ids=tuple(range(args.layers)),
            num_kv_heads=args.heads,
            head_dim=args.head_dim,
            dtype=torch.bfloat16,
        ),
    )
    layout = StateLayout.for_coords(spec, (1, 1, 1), (0, 0, 0))
    pool = int(args.pages * args.pool_factor)
    dev = DevicePools(layout, num_pages=pool, device=device)
    host = HostPools(layout, num_pages=pool)
    engine = make_transfer_engine(dev, host)
    gen = torch.Generator().manual_seed(0)
    dev_pages = torch.randperm(pool, generator=gen)[: args.pages].tolist()
    host_pages = torch.randperm(pool, generator=gen)[: args.pages].tolist()

    nbytes = args.pages * layout.region("kv").row_bytes
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def backup() -> None:
        assert engine.backup((dev_pages, host_pages)).wait()

    def load() -> None:
        assert engine.load((dev_pages, host_pages)).wait()

    fns: dict[str, Callable[[], None]] = {
        "backup": backup,
        "d2h": lambda: dst.copy_(src),
        "load": load,
    }
    if device == "cuda":
        fns["h2d"] = lambda: src.copy_(dst)
    t = timed(fns, args.repeats, sync)
    t_backup, t_load, t_d2h = t["backup"], t["load"], t["d2h"]
    t_h2d = t.get("h2d", t_d2h)
    engine.close()

    gb = nbytes / 1e9
    result = {
        "engine": engine.kind,
        "device": device,
        "pages": args.pages,
        "page_bytes": layout.region("kv").row_bytes,
        "bytes": nbytes,
        "backup_gbps": gb / t_backup,
        "load_gbps": gb / t_load,
        "memcpy_gbps": gb / t_d2h,
        "memcpy_h2d_gbps": gb / t_h2d,
        "backup_ratio": (gb / t_backup) / (gb / t_d2h),
        "load_ratio": (gb / t_load) / (gb / t_h2d),
        "torch_threads": torch.get_num_threads(),
    }
    print(f"{'operation':<22}{'GB/s':>10}{'ratio':>8}")
    print(f"{'backup (dev->host)':<22}{result['backup_gbps']:>10.2f}{result['backup_ratio']:>8.2f}")
    print(f"{'load (host->dev)':<22}{result['load_gbps']:>10.2f}{result['load_ratio']:>8.2f}")
    print(f"{'contiguous d2h':<22}{gb / t_d2h:>10.2f}{1.0:>8.2f}")
    if device == "cuda":
        print(f"{'contiguous h2d':<22}{gb / t_h2d:>10.2f}{1.0:>8.2f}")
    print(
        f"{args.pages} pages x {result['page_bytes']} B = {nbytes / 2**20:.0f} MiB, {engine.kind}"
    )
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        out = bench_common.make_result("transfer", config, result)
        out.update(result)  # the flat keys (backup_gbps, ...) stay at the top too
        bench_common.write_json(out, args.json)


if __name__ == "__main__":
    main()
