"""Serve a workload or a prompts file with a hybrid model (preset or HF checkpoint) on HiCache.

    python -m runtime.serve                                  # one rank, embedded defaults
    torchrun --standalone --nproc-per-node 4 -m runtime.serve --cp 2 --tp 2
    python -m runtime.serve --cache off --json off.json      # recompute baseline
    python -m runtime.serve --concurrency 8 --request-rate 2 # batched, real-time arrivals

Rank 0 prints progress and a summary table; ``--json`` writes per-request results.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mesh_hicache import __version__
from mesh_hicache.cache import HiCache
from mesh_hicache.choices import CpKvMode, PrefetchPolicy, StorageKind, WritePolicy
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.pools.arena import mesh_plan
from mesh_hicache.storage.base import load_secret
from mesh_hicache.topology import MeshTopology
from runtime.checkpoints import choose_model
from runtime.engine import Engine, RequestResult
from runtime.launch import (
    LaunchError,
    add_mesh_args,
    check_collective_timeout,
    env_storage_secret_file,
    exit_process,
    init_mesh,
    mesh_failure,
)
from runtime.model import HybridModel
from runtime.model.config import DTYPES, PRESETS
from runtime.prompts import load_prompts, load_tokenizer
from runtime.startup_checks import (
    ProgressBar,
    StorageWatch,
    check_storage_start,
    default_storage_root,
    fit_warnings,
    l3_warmth,
    label_rank_logs,
    storage_requested,
    too_long_for_l1,
)
from runtime.workloads import WORKLOADS, Turn, make_workload, with_arrivals

CACHE_MODES = ("off", "device", "host", "full")
# Per user, persistent: $XDG_CACHE_HOME/mesh_hicache/l3, else ~/.cache/mesh_hicache/l3.
DEFAULT_STORAGE_ROOT = default_storage_root()


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Model and workload flags (shared with ``scripts/bench_serving.py``)."""
    p.add_argument(
        "--model",
        default="tiny",
        help=f"a preset {sorted(PRESETS)} or a Hugging Face checkpoint directory "
        "(config.json + *.safetensors; runtime.checkpoints lists the architectures)",
    )
    p.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help="serve these requests instead of --workload (see runtime/prompts.py)",
    )
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="weights and activations"
    )
    p.add_argument("--workload", choices=WORKLOADS, default="multiturn", help="the generated trace")
    p.add_argument("--sessions", type=int, default=8, help="sessions of the trace")
    p.add_argument("--turns", type=int, default=4, help="turns per session")
    p.add_argument(
        "--first-prompt-len", type=int, default=512, help="tokens of a session's first prompt"
    )
    p.add_argument("--append-len", type=int, default=64, help="new user tokens of every later turn")
    p.add_argument("--seed", type=int, default=0, help="trace and preset weights seed")
    p.add_argument(
        "--max-new-tokens", type=int, default=8, help="tokens generated per request (greedy)"
    )
    p.add_argument(
        "--page-size", type=int, default=16, help="tokens per KV page (and Mamba checkpoint)"
    )
    p.add_argument(
        "--cp-kv",
        choices=CpKvMode.values(),
        default=CpKvMode.REPLICATE.value,
        help="with --cp > 1: replicate full KV pages on every cp rank, or shard their tokens",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per rank (0: torch's default; torchrun already sets 1)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="most requests in flight (continuous batching); 1 without arrival times: "
        "one request at a time (Engine.run)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="sessions arriving per second (Poisson first turns, replayed in real time); "
        "default: all at once",
    )
    p.add_argument(
        "--think-s",
        type=float,
        default=0.0,
        help="mean seconds (exponential) between an answer and its session's next turn "
        "(with --request-rate)",
    )
    p.add_argument(
        "--token-budget",
        type=int,
        default=256,
        help="prefill tokens computed per scheduler step beside the batched decode",
    )


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """Pool sizes and policies (shared with ``scripts/bench_serving.py``)."""
    p.add_argument("--device-pages", type=int, default=64, help="L1 pages per rank")
    p.add_argument("--host-pages", type=int, default=0, help="L2 pages; 0 = 4 x device pages")
    p.add_argument(
        "--device-bytes",
        type=int,
        default=0,
        help="L1 byte budget per rank, one arena shared by KV pages and recurrent states "
        "(replaces --device-pages; 0: use --device-pages)",
    )
    p.add_argument(
        "--host-bytes",
        type=int,
        default=0,
        help="L2 byte budget per rank, one arena (0: 4 x --device-bytes with a byte "
        "budget, else --host-pages)",
    )
    p.add_argument(
        "--write-policy",
        choices=WritePolicy.values(),
        default=WritePolicy.WRITE_THROUGH.value,
        help="when L1 pages are copied to L2 (and on to L3): at once, on a second hit, "
        "or on eviction",
    )
    p.add_argument(
        "--prefetch-policy",
        choices=PrefetchPolicy.values(),
        default=PrefetchPolicy.WAIT_COMPLETE.value,
        help="how long a request waits for its L3 prefetch",
    )
    p.add_argument(
        "--prefetch-threshold",
        type=int,
        default=256,
        help="prefetch from L3 only when it holds at least this many more tokens",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="runtime.serve",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_mesh_args(p)
    add_run_args(p)
    add_cache_args(p)
    p.add_argument(
        "--cache",
        choices=CACHE_MODES,
        default="full",
        help="off: recompute; device: L1 radix cache; host: L1+L2; full: L1+L2+L3",
    )
    p.add_argument(
        "--storage",
        choices=StorageKind.backends(),
        default=StorageKind.FILE.value,
        help="the L3 backend (--cache full); named explicitly, one that cannot start is an error",
    )
    p.add_argument(
        "--storage-root",
        default=DEFAULT_STORAGE_ROOT,
        help="file backend root (per user; a second run on it starts with a warm L3)",
    )
    p.add_argument("--mooncake-master", default="127.0.0.1:50051", help="master HOST:PORT")
    p.add_argument(
        "--mooncake-protocol", choices=("tcp", "rdma"), default="tcp", help="Mooncake transport"
    )
    p.add_argument(
        "--mooncake-metadata-server", default="P2PHANDSHAKE", help="Mooncake metadata server"
    )
    p.add_argument("--mooncake-rdma-devices", default="", help="e.g. mlx5_0 (rdma only)")
    p.add_argument(
        "--mooncake-segment-bytes",
        type=int,
        default=0,
        help="store memory this process contributes (0: objects live in mooncake_client)",
    )
    p.add_argument(
        "--mooncake-buffer-bytes",
        type=int,
        default=16 << 20,
        help="Mooncake client's local transfer buffer",
    )
    p.add_argument(
        "--storage-retry-s",
        type=float,
        default=30.0,
        help="while L3 is down, retry it this often (requests are served from L1+L2)",
    )
    p.add_argument(
        "--storage-max-bytes",
        type=int,
        default=None,
        help="file backend: cap on the bytes under --storage-root (LRU); default unbounded",
    )
    p.add_argument(
        "--storage-secret-file",
        default=env_storage_secret_file(),
        metavar="PATH",
        help="seal L3 objects with a keyed MAC under this secret (default: "
        "$MESH_HICACHE_STORAGE_SECRET_FILE; unset: CRC32 integrity only)",
    )
    p.add_argument(
        "--tenant",
        default="",
        metavar="NAME",
        help="cache tenant of every request (a --prompts line may name its own): tenants "
        "share no cache entry in L1, L2 or L3",
    )
    p.add_argument("--json", metavar="PATH", help="write config, per-request results, summary")
    p.add_argument("--dump-logits", action="store_true", help="add last-prompt logits to --json")
    p.add_argument("--log-every", type=int, default=8, help="a progress line every N requests")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--log-level",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default="INFO",
        help="progress is INFO (a bar on a terminal); ranks other than 0 log errors only "
        "(their warnings repeat rank 0's), prefixed with their (pp, cp, tp)",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


def cache_config(args: argparse.Namespace) -> HiCacheConfig | None:
    """The ``HiCacheConfig`` for ``--cache`` (None for ``off``)."""
    if args.cache == "off":
        return None
    storage, options = StorageKind.NONE, {}
    if args.cache == "full":
        storage = StorageKind(args.storage)
        if storage is StorageKind.FILE:
            options = {"root": args.storage_root}
            if args.storage_max_bytes is not None:
                options["max_bytes"] = args.storage_max_bytes
        else:
            options = {
                "master_address": args.mooncake_master,
                "protocol": args.mooncake_protocol,
                "metadata_server": args.mooncake_metadata_server,
                "rdma_devices": args.mooncake_rdma_devices,
                "global_segment_size": args.mooncake_segment_bytes,
                "local_buffer_size": args.mooncake_buffer_bytes,
            }
        options["retry_interval_s"] = args.storage_retry_s
        if args.storage_secret_file:
            options["secret_file"] = args.storage_secret_file
    return HiCacheConfig(
        device_pages=0 if args.device_bytes else args.device_pages,
        device_bytes=args.device_bytes,
        host_pages=args.host_pages,
        host_bytes=args.host_bytes,
        enable_host=args.cache != "device",
        write_policy=args.write_policy if args.cache != "device" else WritePolicy.WRITE_THROUGH,
        storage=storage,
        storage_options=options,
        prefetch_policy=args.prefetch_policy,
        prefetch_threshold=args.prefetch_threshold,
        cp_kv=args.cp_kv,
        tenant=args.tenant,
    )


def build_model(args: argparse.Namespace, topology: MeshTopology) -> HybridModel:
    """The model the flags describe, on this rank's shard (a checkpoint: its slices only).
    Collective."""
    choice = choose_model(args.model, DTYPES[args.dtype], args.seed)
    return HybridModel(
        choice.config,
        topology,
        cp_kv=args.cp_kv,
        page_size=args.page_size,
        weights=choice.weights,
    )


def workload(args: argparse.Namespace, vocab: int) -> list[Turn]:
    """The trace the flags describe (deterministic from ``--seed``)."""
    return make_workload(
        args.workload,
        sessions=args.sessions,
        turns=args.turns,
        vocab=vocab,
        seed=args.seed,
        first_prompt_len=args.first_prompt_len,
        append_len=args.append_len,
    )


def timed_trace(args: argparse.Namespace, trace: Sequence[Turn]) -> list[Turn]:
    """``trace`` with ``--request-rate`` / ``--think-s`` arrival times (seeded by
    ``--seed``); unchanged without ``--request-rate``. ``ValueError`` when the trace
    already carries times (a ``--prompts`` file with ``arrival_s`` / ``think_s``)."""
    if args.request_rate is None:
        return list(trace)
    if any(t.timed for t in trace):
        raise ValueError("--request-rate: the --prompts file already gives arrival_s / think_s")
    return with_arrivals(trace, args.request_rate, seed=args.seed, think_s=args.think_s)


def scheduler_config(args: argparse.Namespace, trace: Sequence[Turn]) -> Any:
    """The ``SchedulerConfig`` when the flags ask for the scheduler (``--concurrency`` > 1,
    or a trace with arrival times), else None (``Engine.run``, one request at a time)."""
    realtime = any(t.timed for t in trace)
    if args.concurrency == 1 and not realtime:
        return None
    from runtime.scheduler import SchedulerConfig  # noqa: PLC0415 - only on this path

    return SchedulerConfig(
        max_running=args.concurrency, token_budget=args.token_budget, realtime=realtime
    )


def serve_trace(
    engine: Engine,
    trace: Sequence[Turn],
    progress: Callable[[RequestResult], None] | None = None,
    scheduler: Any = None,
) -> tuple[list[RequestResult], float, dict[str, object] | None]:
    """Serve ``trace``, then flush and close the engine's cache.

    ``scheduler``: a ``runtime.scheduler.SchedulerConfig`` to serve it batched by a
    ``Scheduler`` on the engine's model and cache (None: ``engine.run``, sequential).
    Returns the results, the wall time of serving, and the cache's counters (None
    without a cache). Collective."""
    t0 = time.perf_counter()
    if scheduler is None:
        results = engine.run(trace, progress)
    else:
        from runtime.scheduler import Scheduler  # noqa: PLC0415

        batched = Scheduler(
            engine.model,
            engine.cache,
            scheduler,
            max_new_tokens=engine.max_new_tokens,
            keep_logits=engine.keep_logits,
        )
        results = batched.run(trace, progress)
    wall = time.perf_counter() - t0
    stats = None
    if engine.cache is not None:
        engine.cache.flush()
        stats = engine.cache.stats().as_dict()
        engine.cache.close()
    return results, wall, stats


def check_args(args: argparse.Namespace) -> None:
    """``ValueError`` for any bad flag, before a process group exists."""
    choice = choose_model(args.model, DTYPES[args.dtype])
    config = choice.config
    if args.prompts:
        tokenizer_path = choice.checkpoint.tokenizer_path if choice.checkpoint else None
        eos = choice.checkpoint.eos_token_id if choice.checkpoint else None
        prompts = load_prompts(args.prompts, config.vocab_size, load_tokenizer(tokenizer_path), eos)
    config.check_mesh(
        tp=args.tp, cp=args.cp, pp=args.pp, page_size=args.page_size, cp_kv=args.cp_kv
    )
    spec = config.state_spec(args.page_size)
    cfg = cache_config(args)
    if cfg is not None:  # a byte budget must hold a page and a state on every rank
        shape = (args.pp, args.cp, args.tp)
        for budget in (cfg.device_bytes, cfg.host_arena_bytes() if cfg.enable_host else 0):
            if budget:
                mesh_plan(spec, shape, args.cp_kv, budget, cfg.block_bytes)
    trace = workload(args, config.vocab_size)
    if args.prompts:
        trace = prompts
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_load_flags(args)
    try:
        scheduler_config(args, timed_trace(args, trace))
    except ImportError as err:
        raise ValueError(f"--concurrency / arrival times need runtime.scheduler: {err}") from None
    check_run_flags(args)


def check_load_flags(args: argparse.Namespace) -> None:
    """``ValueError`` naming the flag for a bad ``--concurrency``, ``--request-rate``,
    ``--think-s`` or ``--token-budget``."""
    for flag, value in (("--concurrency", args.concurrency), ("--token-budget", args.token_budget)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    rate = args.request_rate
    if rate is not None and not (0 < rate < float("inf")):
        raise ValueError(f"--request-rate must be > 0 requests per second, got {rate}")
    if not 0 <= args.think_s < float("inf"):
        raise ValueError(f"--think-s must be >= 0 seconds, got {args.think_s}")
    if args.think_s and rate is None:
        raise ValueError(f"--think-s {args.think_s} needs --request-rate (real-time arrivals)")


def check_run_flags(args: argparse.Namespace) -> None:
    """``ValueError`` naming the flag for the flags that only matter later in a run
    (logging, output, storage), so a bad one fails before any work starts."""
    at_least = {
        "--log-every": (args.log_every, 1),
        "--threads": (args.threads, 0),
        "--host-pages": (args.host_pages, 0),
        "--device-bytes": (args.device_bytes, 0),
        "--host-bytes": (args.host_bytes, 0),
        "--prefetch-threshold": (args.prefetch_threshold, 0),
        "--mooncake-segment-bytes": (args.mooncake_segment_bytes, 0),
        "--mooncake-buffer-bytes": (args.mooncake_buffer_bytes, 0),
    }
    for flag, (value, low) in at_least.items():
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if not 0 <= args.storage_retry_s < float("inf"):
        raise ValueError(f"--storage-retry-s must be >= 0 seconds, got {args.storage_retry_s}")
    if not args.storage_root:
        raise ValueError("--storage-root must not be empty")
    if args.storage_max_bytes is not None and args.storage_max_bytes < 1:
        raise ValueError(f"--storage-max-bytes must be >= 1, got {args.storage_max_bytes}")
    if args.storage_secret_file is not None:
        try:
            load_secret(secret_file=args.storage_secret_file)
        except (TypeError, ValueError) as err:
            raise ValueError(f"--storage-secret-file: {err}") from None
    check_collective_timeout(args.collective_timeout_s)
    if args.json:
        check_writable_file(args.json, "--json")


def check_writable_file(path: str, flag: str) -> None:
    """``ValueError`` unless ``path`` can be created or replaced (its directory exists and
    takes a new file); nothing is left behind."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory, expected a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path!r}: directory {parent!r} does not exist")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {path!r}: directory {parent!r} is not writable: {err}") from None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Totals and latency percentiles of a run.

    ``throughput_rps``: requests per wall second; ``throughput_tps``: every prompt token
    (cached or computed) plus every generated token, per wall second of the whole run
    (queueing and idle time between arrivals included). TTFT is from the request's
    arrival (the scheduler's ``ttft_s``: queueing included; sequential: from its start)."""
    prompt = sum(r.prompt_len for r in results)
    cached = [
        sum(getattr(r, f"cached_{t}") for r in results) for t in ("device", "host", "storage")
    ]
    ttft = [r.ttft_s for r in results]
    decode_tokens = sum(max(len(r.output_ids) - 1, 0) for r in results)
    decode_s = sum(r.decode_s for r in results)
    generated = sum(len(r.output_ids) for r in results)
    return {
        "requests": len(results),
        "prompt_tokens": prompt,
        "cached_device": cached[0],
        "cached_host": cached[1],
        "cached_storage": cached[2],
        "prefill_tokens_computed": prompt - sum(cached),
        "hit_rate": sum(cached) / prompt if prompt else 0.0,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p95_s": percentile(ttft, 0.95),
        "ttft_p99_s": percentile(ttft, 0.99),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
        "wall_s": wall_s,
        "requests_per_s": len(results) / wall_s if wall_s > 0 else 0.0,
        "generated_tokens": generated,
        "throughput_rps": len(results) / wall_s if wall_s > 0 else 0.0,
        "throughput_tps": (prompt + generated) / wall_s if wall_s > 0 else 0.0,
    }


def format_summary(summary: dict[str, Any]) -> str:
    rows = [
        ("requests", f"{summary['requests']}"),
        ("prompt tokens", f"{summary['prompt_tokens']}"),
        ("served from device (L1)", f"{summary['cached_device']}"),
        ("served from host (L2)", f"{summary['cached_host']}"),
        ("served from storage (L3)", f"{summary['cached_storage']}"),
        ("L3 tokens read resharded", f"{summary.get('storage_resharded_tokens', 0)}"),
        ("prefill tokens computed", f"{summary['prefill_tokens_computed']}"),
        ("hit rate", f"{summary['hit_rate']:.1%}"),
        (
            "TTFT p50 / p95",
            f"{summary['ttft_p50_s'] * 1e3:.1f} / {summary['ttft_p95_s'] * 1e3:.1f} ms",
        ),
        ("decode tokens/s", f"{summary['decode_tokens_per_s']:.1f}"),
        (
            "throughput",
            f"{summary['throughput_rps']:.2f} req/s, {summary['throughput_tps']:.0f} tokens/s",
        ),
        ("wall time", f"{summary['wall_s']:.1f} s"),
    ]
    if "requests_uncached_l1" in summary:
        rows.insert(
            1, ("requests too long for L1 (uncached)", f"{summary['requests_uncached_l1']}")
        )
        rows.insert(2, ("requests with no cache hit", f"{summary['requests_no_hit']}"))
    if "l3" in summary:
        rows.append(("L3", str(summary["l3"])))
    if "l3_start_objects" in summary:
        warm = f"{summary['l3_start_objects']} objects, {summary['l3_start_bytes']} bytes"
        rows.append(("L3 at start", warm))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def run(args: argparse.Namespace, topology: MeshTopology) -> dict[str, Any]:
    """Build model, cache and engine on this rank and serve the workload. Collective."""
    model = build_model(args, topology)
    config = model.config
    cfg = cache_config(args)
    leader = topology.coords == (0, 0, 0)
    # How warm L3 is before this run writes to it (rank 0 reads the file root).
    warm = None
    if leader and cfg is not None and cfg.storage is StorageKind.FILE:
        warm = l3_warmth(args.storage_root)
    cache = HiCache(topology, config.state_spec(args.page_size), cfg) if cfg else None
    checkpoint = choose_model(args.model, config.dtype).checkpoint
    tokenizer = load_tokenizer(checkpoint.tokenizer_path if checkpoint else None)
    if args.prompts:
        eos = checkpoint.eos_token_id if checkpoint else None
        trace = load_prompts(args.prompts, config.vocab_size, tokenizer, eos)
    else:
        trace = workload(args, config.vocab_size)
    trace = timed_trace(args, trace)
    engine = Engine(model, cache, max_new_tokens=args.max_new_tokens, keep_logits=args.dump_logits)
    log = logging.getLogger("runtime.serve")
    l1_pages = cache.device.max_pages if cache is not None else 0  # an empty L1's pages
    if leader and cache is not None:
        flag = "--device-bytes" if args.device_bytes else "--device-pages"
        for warning in fit_warnings(trace, args.max_new_tokens, args.page_size, l1_pages, flag):
            log.warning("runtime.serve: warning: %s", warning)
    done: list[RequestResult] = []
    watch = StorageWatch()
    bar = ProgressBar(log, sys.stderr)  # a bar on a terminal, INFO lines otherwise

    def progress(result: RequestResult) -> None:
        done.append(result)
        if leader and cache is not None and cfg is not None and cfg.storage is not StorageKind.NONE:
            watch.observe(cache.stats().storage_degraded, len(done))
        last = len(done) == len(trace)
        if leader and not args.quiet and (bar.live or len(done) % args.log_every == 0 or last):
            part = summarize(done, time.perf_counter() - t0)
            bar.update(
                len(done),
                len(trace),
                f"hit rate {part['hit_rate']:.1%} (L1 {part['cached_device']}, "
                f"L2 {part['cached_host']}, L3 {part['cached_storage']} tokens), "
                f"TTFT p50 {1e3 * part['ttft_p50_s']:.1f} ms",
            )

    t0 = time.perf_counter()
    with watch:
        results, wall, stats = serve_trace(engine, trace, progress, scheduler_config(args, trace))
    summary = summarize(results, wall)
    summary["requests_uncached_l1"] = sum(
        cache is None or too_long_for_l1(r.prompt_len + len(r.output_ids), args.page_size, l1_pages)
        for r in results
    )
    summary["requests_no_hit"] = sum(r.cached == 0 for r in results)
    summary["l3"] = _l3_state(cfg, watch, stats)
    if warm is not None:
        summary["l3_start_objects"], summary["l3_start_bytes"] = warm
    # Rank 0's count: L3 tokens assembled from objects written under another mesh.
    summary["storage_resharded_tokens"] = stats.get("storage_resharded_tokens", 0) if stats else 0
    return {
        "config": {k: v for k, v in vars(args).items()},
        "requests": [_with_text(r.as_json(), tokenizer) for r in results],
        "summary": summary,
        "cache_stats": stats,
        "leader": leader,
    }


def _l3_state(cfg: HiCacheConfig | None, watch: StorageWatch, stats: dict | None) -> str:
    """The summary's L3 line: off, on, or since when and why it was degraded."""
    if cfg is None or cfg.storage is StorageKind.NONE:
        return "off"
    outage = watch.outage
    if outage is None:
        return "on" if not (stats and stats.get("storage_degraded")) else "degraded"
    state = "degraded" if stats and stats.get("storage_degraded") else "recovered, was down"
    return (
        f"{state} since request {outage.after_requests} ({outage.after_s:.1f} s): {outage.reason}"
    )


def _with_text(request: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    # Decoded output next to the ids when the checkpoint has a tokenizer.
    if tokenizer is not None:
        request["output_text"] = tokenizer.decode(request["output_ids"])
    return request


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(message)s")
    try:
        check_args(args)
        if args.cache == "full" and storage_requested(argv):
            # Asked for by name: a backend that cannot start is an error, not a warning.
            check_storage_start(args.storage, args.storage_root, args.mooncake_master)
        owns_group = not dist.is_initialized()  # an embedding caller keeps its own group
        topology = init_mesh(args.pp, args.cp, args.tp, args.collective_timeout_s)
    except (LaunchError, ValueError) as err:
        print(f"runtime.serve: error: {err}", file=sys.stderr)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    label_rank_logs(topology)
    try:
        out = run(args, topology)
    except Exception as err:
        cause = mesh_failure(err)
        if cause is None:
            raise
        # One line, then leave at once: the mesh is gone, so shutting down cleanly
        # (flushes, worker joins, destroy_process_group) could block on the lost peer.
        print(f"runtime.serve: error: rank {dist.get_rank()}: {cause}", file=sys.stderr)
        exit_process(3)
    if out.pop("leader"):
        print(f"mesh (pp, cp, tp) = {topology.shape}, cache = {args.cache}, model = {args.model}")
        print(format_summary(out["summary"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f)
    if owns_group:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())
