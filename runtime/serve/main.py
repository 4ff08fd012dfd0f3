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
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mesh_hicache.cache import HiCache
from mesh_hicache.choices import StorageKind
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.pools.arena import mesh_plan
from mesh_hicache.topology import MeshTopology
from runtime.budgets import Machine, apply_budgets, budget_line, check_budgets
from runtime.checkpoints import choose_model
from runtime.engine import Engine, RequestResult
from runtime.launch import (
    LaunchError,
    exit_process,
    init_mesh,
    mesh_failure,
    quiet_parser,
    report_launch_error,
)
from runtime.mesh_config import work_config
from runtime.model import HybridModel
from runtime.model.config import DTYPES
from runtime.serve.checks import (
    ProgressBar,
    StorageWatch,
    check_storage_start,
    fit_warnings,
    l3_warmth,
    label_rank_logs,
    storage_requested,
    too_long_for_l1,
)
from runtime.serve.flags import (
    build_parser,
    cache_config,
    check_load_flags,
    check_run_flags,
    check_size_flags,
)
from runtime.serve.prompts import load_prompts, load_tokenizer
from runtime.workloads.generate import Turn, make_workload, with_arrivals


def _hash_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build_model(args: argparse.Namespace, topology: MeshTopology) -> HybridModel:
    """The model the flags describe, on this rank's shard (a checkpoint: its slices only).
    Collective."""
    choice = choose_model(args.model, DTYPES[args.dtype], args.seed, model_id=args.model_id)
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
    check_size_flags(args)
    choice = choose_model(
        args.model, DTYPES[args.dtype], model_id=args.model_id, progress=_hash_progress
    )
    config = choice.config
    if args.prompts:
        tokenizer_path = choice.checkpoint.tokenizer_path if choice.checkpoint else None
        eos = choice.checkpoint.eos_token_ids if choice.checkpoint else ()
        prompts = load_prompts(args.prompts, config.vocab_size, load_tokenizer(tokenizer_path), eos)
    config.check_mesh(
        tp=args.tp, cp=args.cp, pp=args.pp, page_size=args.page_size, cp_kv=args.cp_kv
    )
    spec = config.state_spec(args.page_size)
    check_budgets(args, Machine.detect())
    cfg = cache_config(args)
    if cfg is not None:  # a byte budget must hold a page and a state on every rank
        shape = (args.pp, args.cp, args.tp)
        host = cfg.host_arena_bytes() if cfg.enable_host else 0
        for budget, separate_windows in ((cfg.device_bytes, False), (host, True)):
            if budget:  # the host arena keeps windowed pages apart (pools/host.py)
                mesh_plan(spec, shape, args.cp_kv, budget, cfg.block_bytes, separate_windows)
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


def human_bytes(n: int) -> str:
    """``n`` bytes for a reader: ``"512 B"``, ``"1.5 KiB"``, ``"3.2 GiB"`` (powers of 1024)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def format_summary(summary: dict[str, Any]) -> str:
    rows = [
        ("requests", f"{summary['requests']}"),
        ("prompt tokens", f"{summary['prompt_tokens']}"),
        ("served from device (L1)", f"{summary['cached_device']}"),
        ("served from host (L2)", f"{summary['cached_host']}"),
        ("served from storage (L3)", f"{summary['cached_storage']}"),
        ("served from L3, resharded", f"{summary.get('storage_resharded_tokens', 0)}"),
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
        size = human_bytes(summary["l3_start_bytes"])
        warm = f"{summary['l3_start_objects']} objects, {size}"
        rows.append(("L3 at start", warm))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def run(args: argparse.Namespace, topology: MeshTopology) -> dict[str, Any]:
    """Build model, cache and engine on this rank and serve the workload. Collective."""
    model = build_model(args, topology)
    config = model.config
    budgets = apply_budgets(args, topology) if args.cache != "off" else ""
    cfg = cache_config(args)
    leader = topology.coords == (0, 0, 0)
    # How warm L3 is before this run writes to it (rank 0 reads the file root).
    warm = None
    if leader and cfg is not None and cfg.storage is StorageKind.FILE:
        warm = l3_warmth(args.storage_root)
    cache = HiCache(topology, config.state_spec(args.page_size), cfg) if cfg else None
    checkpoint = choose_model(args.model, config.dtype, model_id=args.model_id).checkpoint
    tokenizer = load_tokenizer(checkpoint.tokenizer_path if checkpoint else None)
    if args.prompts:
        eos = checkpoint.eos_token_ids if checkpoint else ()
        trace = load_prompts(args.prompts, config.vocab_size, tokenizer, eos)
    else:
        trace = workload(args, config.vocab_size)
    trace = timed_trace(args, trace)
    engine = Engine(model, cache, max_new_tokens=args.max_new_tokens, keep_logits=args.dump_logits)
    log = logging.getLogger("runtime.serve")
    if leader and cache is not None:
        log.info("runtime.serve: %s", budget_line(cache, args.page_size, budgets))
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
        # The flush after the last request writes the last backups; a failure there
        # shows only in the final counters.
        watch.observe(bool(stats and stats.get("storage_degraded")), len(done))
    summary = summarize(results, wall)
    if cache is not None:  # with --cache off nothing is cached, by choice: no such rows
        summary["requests_uncached_l1"] = sum(
            too_long_for_l1(r.prompt_len + len(r.output_ids), args.page_size, l1_pages)
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
        return "on"
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
    args = quiet_parser(build_parser()).parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(message)s")
    try:
        check_args(args)
        if args.cache == "full" and storage_requested(argv):
            # Asked for by name: a backend that cannot start is an error, not a warning.
            check_storage_start(args.storage, args.storage_root, args.mooncake_master)
        owns_group = not dist.is_initialized()  # an embedding caller keeps its own group
        topology = init_mesh(
            args.pp, args.cp, args.tp, args.collective_timeout_s, work_config(args)
        )
    except (LaunchError, ValueError) as err:
        return report_launch_error("runtime.serve", err)
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
