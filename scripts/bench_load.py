"""``bench_serving.py --mode load``: throughput and latency under load, per cache mode.

The multi-turn workload is replayed in real time by the batching scheduler
(``runtime.scheduler``) at three session rates, light to saturating, under each cache
mode (off, L1, L1+L2, L1+L2+L3), each run on a fresh cache, in one process:

1. **Service rate**: the trace is served once cache-off, one request at a time
   (``Engine.run``). That run is the output reference, and its rate ``mu`` (requests per
   second; ``mu / turns`` sessions per second) sizes the load: the session rates are
   ``--rate-factors`` x ``mu / turns`` (default 0.5x, 2x, 8x: below what cache-off can
   serve one by one, above it, far above it) unless ``--rates`` names them. The mean
   think time between an answer and the session's next turn is ``1 / mu`` (one request's
   sequential service time) unless ``--think-s`` is given.
2. **Load runs**: for every repetition, rate and mode, the timed trace (Poisson session
   starts at the rate, exponential think times, seeded: the same trace in every mode) is
   served with ``--concurrency`` requests in flight. Repetitions alternate the modes'
   order (forward, reversed), so a drift of the shared machine's load does not favour
   one mode; every ratio against cache-off is taken within one repetition and rate, then
   the median over repetitions is reported. Every repetition also serves the trace
   sequentially cache-off once (the run of step 1 for the first; before its modes for
   even, after them for odd ones): ``vs sequential off`` is taken against that
   repetition's run, in req/s and in process CPU seconds (``CPU vs sequential off``:
   sequential CPU / the run's: on the shared box the same sequential run took 115 s and
   52 s of wall time in one session, for 38 and 40 CPU seconds).
3. **Hit TTFT**: a prompt of N + 1 tokens is served once (cold), then again: the second
   is a full-prefix L1 hit of N tokens. Reported per N (``--hit-lengths``, default 512,
   2048, 8192): the hit's TTFT (median of ``--hit-repeats``) next to the cold one.

Default workload: 4 sessions x 3 turns, 384-token first prompts, 64-token appends, 8 new
tokens, 4 in flight. On the shared 2-core box (load average 15-25) one repetition took
about 12 minutes, half of it the light rate (its wall time is the arrival span, by
design), and the hit probe about 4 (the 8192-token cold prefill).

Metrics (``runtime.serve.main.summarize``): ``throughput_rps`` (requests per wall second of
the run: from the first arrival to the last answer), ``throughput_tps`` (prompt tokens,
cached or computed, plus generated tokens, per wall second), TTFT p50 / p99 (from the
request's arrival, queueing included), ``decode_tokens_per_s`` (tokens after the first
per second of a request's decode, i.e. per-request decode speed), hit rate; and whether
every request's ``output_ids`` equal the reference's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import bench_common
import torch.distributed as dist
from bench_load_report import (
    LABELS,
    LOAD_MODES,
    METRICS,
    acceptance,
    add_sequential_ratios,
    aggregate,
)

from mesh_hicache.cache import HiCache
from mesh_hicache.topology import MeshTopology
from runtime.engine import Engine, RequestResult
from runtime.model import HybridModel
from runtime.serve.flags import build_parser as serve_parser
from runtime.serve.flags import cache_config
from runtime.serve.main import build_model, serve_trace, summarize, workload
from runtime.workloads.generate import Turn, with_arrivals

MODE_TO_CACHE = {"off": "off", "device": "device", "host": "host", "storage": "full"}
RATE_FACTORS = (0.5, 2.0, 8.0)
HIT_LENGTHS = (512, 2048, 8192)
LOAD_DEFAULTS = {"sessions": 4, "turns": 3, "first_prompt_len": 384}
"""``--mode load``'s workload when not given (the other mode keeps runtime.serve's 8 x 4):
a few minutes on a shared 2-core box."""


def add_load_args(p: argparse.ArgumentParser) -> None:
    """The ``--mode load`` flags."""
    p.add_argument(
        "--load-modes", default=",".join(LOAD_MODES), help=f"comma list from {LOAD_MODES}"
    )
    p.add_argument(
        "--rates", default="", help="session rates per second, comma list (default: measured)"
    )
    p.add_argument(
        "--rate-factors",
        default=",".join(str(f) for f in RATE_FACTORS),
        help="session rates as multiples of the measured sequential cache-off session rate",
    )
    p.add_argument("--repeats", type=int, default=1, help="repetitions (modes' order alternates)")
    p.add_argument(
        "--hit-lengths",
        default=",".join(str(n) for n in HIT_LENGTHS),
        help="cached tokens of the full-prefix L1 hit TTFT probe (empty: skip it)",
    )
    p.add_argument("--hit-repeats", type=int, default=3, help="hits measured per length")


def fill_workload_defaults(args: argparse.Namespace, defaults: Mapping[str, int]) -> None:
    """Set every workload flag left at None (not given) from ``defaults``."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def parse_numbers(text: str, what: str, kind: type = float) -> list[Any]:
    """The comma-separated positive numbers of ``text`` (empty: none); ``ValueError``
    naming ``what`` and the bad entry."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value = kind(part)
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not a number") from None
        if not (value > 0 and value < float("inf")):
            raise ValueError(f"{what}: {part!r} must be > 0")
        out.append(value)
    return out


def parse_load_modes(text: str) -> tuple[str, ...]:
    """The load modes named in ``text`` in run order; ``off`` is always run."""
    names = {m.strip() for m in text.split(",") if m.strip()}
    unknown = names - set(LOAD_MODES)
    if unknown:
        raise ValueError(f"unknown --load-modes {sorted(unknown)}; choose from {LOAD_MODES}")
    names.add("off")
    return tuple(m for m in LOAD_MODES if m in names)


def check_load_args(args: argparse.Namespace) -> None:
    """``ValueError`` for bad ``--mode load`` flags, before any work."""
    parse_load_modes(args.load_modes)
    parse_numbers(args.rates, "--rates")
    if not parse_numbers(args.rate_factors, "--rate-factors") and not args.rates:
        raise ValueError("--rate-factors names no rate")
    parse_numbers(args.hit_lengths, "--hit-lengths", int)
    for flag, value in (("--repeats", args.repeats), ("--hit-repeats", args.hit_repeats)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.think_s is not None and not 0 <= args.think_s < float("inf"):
        raise ValueError(f"--think-s must be >= 0 seconds, got {args.think_s}")


def choose_rates(service_rps: float, turns: int, factors: Sequence[float]) -> list[float]:
    """Session rates ``factor * service_rps / turns``: ``service_rps`` is the measured
    sequential cache-off request rate, a session brings ``turns`` requests."""
    if not service_rps > 0 or turns < 1:
        raise ValueError(f"need a positive service rate and turns >= 1, got {service_rps}, {turns}")
    return [f * service_rps / turns for f in factors]


def mode_order(modes: Sequence[str], repeat: int) -> list[str]:
    """Repetition ``repeat``'s order: as given for even, reversed for odd ones."""
    return list(modes) if repeat % 2 == 0 else list(reversed(modes))


def outputs_equal(results: Sequence[RequestResult], reference: Sequence[RequestResult]) -> bool:
    """Same requests, identical ``output_ids``."""
    ours = {r.request_id: r.output_ids for r in results}
    return ours == {r.request_id: r.output_ids for r in reference}


# -- running (collective) --------------------------------------------------------------------


def _agreed_root(parent: str | None) -> str:
    box: list[str | None] = [None]
    if dist.get_rank() == 0:
        base = parent or tempfile.gettempdir()
        os.makedirs(base, exist_ok=True)
        box[0] = tempfile.mkdtemp(prefix="bench_load_l3_", dir=base)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def _new_cache(
    args: argparse.Namespace,
    topology: MeshTopology,
    model: HybridModel,
    mode: str,
    root: str,
    device_pages: int,
    host_pages: int = 0,
) -> HiCache | None:
    if mode == "off":
        return None
    flags = {
        "--cache": MODE_TO_CACHE[mode],
        "--storage": "file",
        "--storage-root": root,
        "--device-pages": device_pages,
        "--host-pages": host_pages or args.host_pages,
        "--write-policy": args.write_policy,
        "--prefetch-policy": args.prefetch_policy,
        "--prefetch-threshold": args.prefetch_threshold,
        "--cp-kv": args.cp_kv,
    }
    parsed = serve_parser().parse_args([str(x) for kv in flags.items() for x in kv])
    cfg = cache_config(parsed)
    assert cfg is not None
    if cfg.enable_host:
        slots = max(1, (host_pages or args.host_pages) // 4)
        cfg = dataclasses.replace(cfg, host_mamba_slots=slots)
    return HiCache(topology, model.config.state_spec(args.page_size), cfg)


def _scheduler_config(args: argparse.Namespace, realtime: bool) -> Any:
    from runtime.scheduler import SchedulerConfig

    return SchedulerConfig(
        max_running=args.concurrency, token_budget=args.token_budget, realtime=realtime
    )


def load_pages(args: argparse.Namespace, trace: Sequence[Turn]) -> tuple[int, int]:
    """(L1, L2) pages for the load runs. L1: ``--device-pages``, raised to hold
    ``--concurrency`` + 1 of the longest session's final history (the running batch and
    a little cache), less than the working set when there are more sessions than that;
    L2: ``--host-pages``, raised to twice the working set (every session's history), so
    L1+L2 can keep all of it."""
    ps = args.page_size
    per_session: dict[int, int] = {}
    for t in trace:
        tokens = len(t.user_tokens) + args.max_new_tokens
        per_session[t.session] = per_session.get(t.session, 0) + tokens
    pages = [-(-n // ps) + 1 for n in per_session.values()]
    device = max(args.device_pages, (args.concurrency + 1) * max(pages))
    return device, max(args.host_pages, 2 * sum(pages))


def _hit_engines(model: HybridModel, cache: HiCache | None, max_new: int) -> dict[str, Engine]:
    """The engines to time a hit with: ``paged=True`` and ``paged=False`` (the contiguous
    copy of the prefix) where ``Engine`` has the choice, else the one engine."""
    if "paged" not in {f.name for f in dataclasses.fields(Engine)}:
        return {"engine": Engine(model, cache, max_new_tokens=max_new)}
    return {
        name: Engine(model, cache, max_new_tokens=max_new, paged=paged)  # type: ignore[call-arg]
        for name, paged in (("paged", True), ("copy", False))
    }


def hit_ttft(
    args: argparse.Namespace, topology: MeshTopology, model: HybridModel, lengths: Sequence[int]
) -> list[dict[str, Any]]:
    """TTFT of a full-prefix L1 hit of N cached tokens, for each N in ``lengths`` and each
    engine path (``_hit_engines``): the prompt (N + 1 tokens) is served once cold, then
    ``--hit-repeats`` times per path, alternating paths. Collective."""
    ps = args.page_size
    rng = random.Random(args.seed + 17)
    out = []
    for n in lengths:
        n = -(-n // ps) * ps  # whole pages: all of it can be cached
        pages = 2 * (-(-(n + 1 + args.max_new_tokens) // ps)) + 8
        cache = _new_cache(args, topology, model, "device", "", pages)
        engines = _hit_engines(model, cache, args.max_new_tokens)
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(n + 1)]
        cold = next(iter(engines.values())).serve(prompt)
        hits: dict[str, list[RequestResult]] = {name: [] for name in engines}
        for i in range(args.hit_repeats):
            for name in mode_order(list(engines), i):
                hits[name].append(engines[name].serve(prompt))
        assert cache is not None
        cache.close()
        for name, done in hits.items():
            hit = statistics.median(h.ttft_s for h in done)
            out.append(
                {
                    "cached_tokens": n,
                    "path": name,
                    "cold_ttft_s": cold.ttft_s,
                    "hit_ttft_s": hit,
                    "hit_ttft_all_s": [h.ttft_s for h in done],
                    "hit_cached": min(h.cached_device for h in done),
                    "hit_vs_cold": hit / cold.ttft_s,
                    "outputs_match": all(h.output_ids == cold.output_ids for h in done),
                }
            )
    return out


def run_load(args: argparse.Namespace, topology: MeshTopology) -> dict[str, Any]:
    """Service rate, the load runs and the hit probe; the shared result format.
    Collective."""
    modes = parse_load_modes(args.load_modes)
    model = build_model(args, topology)
    plain = workload(args, model.config.vocab_size)
    leader = topology.coords == (0, 0, 0)
    say = print if leader and not args.quiet else (lambda *a, **k: None)
    # Warm-up (first-call costs), then the sequential cache-off reference.
    warm = Engine(model, None, max_new_tokens=args.max_new_tokens)
    warm.serve(list(plain[0].user_tokens))

    def sequential_run(rep: int) -> tuple[list[RequestResult], dict[str, Any]]:
        cpu0 = time.process_time()
        results, wall, _ = serve_trace(Engine(model, None, args.max_new_tokens), plain)
        cpu = time.process_time() - cpu0
        sample = {"repeat": rep, "throughput_rps": len(plain) / wall, "wall_s": wall}
        return results, {**sample, "cpu_s": cpu}

    reference, first = sequential_run(0)
    seq_wall = first["wall_s"]
    service_rps = first["throughput_rps"]
    # One sequential cache-off run per repetition, next to that repetition's first (even
    # repetitions, before) or last (odd, after) mode: "vs sequential off" compares runs
    # of the same stretch of the shared machine's load, not with the run that started it.
    sequential = {0: {**first, "outputs_match": True}}
    say(f"[service] sequential cache-off: {service_rps:.3f} requests/s ({seq_wall:.1f} s)")
    rates = parse_numbers(args.rates, "--rates") or choose_rates(
        service_rps, args.turns, parse_numbers(args.rate_factors, "--rate-factors")
    )
    think = args.think_s if args.think_s is not None else 1.0 / service_rps
    timed = [with_arrivals(plain, r, seed=args.seed, think_s=think) for r in rates]
    pages, host_pages = load_pages(args, plain)
    samples: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for rep in range(args.repeats):
        if rep and rep % 2 == 0:
            results, sequential[rep] = sequential_run(rep)
            sequential[rep]["outputs_match"] = outputs_equal(results, reference)
        for ri, rate in enumerate(rates):
            for mode in mode_order(modes, rep):
                root = _agreed_root(args.storage_root) if mode == "storage" else ""
                try:
                    cache = _new_cache(args, topology, model, mode, root, pages, host_pages)
                    engine = Engine(model, cache, max_new_tokens=args.max_new_tokens)
                    cpu0 = time.process_time()
                    results, wall, _ = serve_trace(
                        engine, timed[ri], None, _scheduler_config(args, True)
                    )
                    cpu = time.process_time() - cpu0
                finally:
                    if topology.num_ranks > 1:
                        dist.barrier()
                    if root and leader:
                        shutil.rmtree(root, ignore_errors=True)
                s = summarize(results, wall)
                s["cpu_s"] = cpu
                sample = {k: s[k] for k in METRICS}
                sample.update(
                    repeat=rep,
                    rate_index=ri,
                    rate=rate,
                    mode=mode,
                    outputs_match=outputs_equal(results, reference),
                )
                samples.append(sample)
                say(
                    f"[rep {rep} rate {rate:.3f}/s {LABELS[mode]}] {s['throughput_rps']:.3f} "
                    f"req/s, TTFT p50 {s['ttft_p50_s'] * 1e3:.0f} ms, wall {wall:.1f} s",
                    flush=True,
                )
        if rep % 2 == 1:
            results, sequential[rep] = sequential_run(rep)
            sequential[rep]["outputs_match"] = outputs_equal(results, reference)
    load_s = time.perf_counter() - t_start
    lengths = parse_numbers(args.hit_lengths, "--hit-lengths", int)
    hits = hit_ttft(args, topology, model, lengths) if lengths else []
    rows = aggregate(samples)
    add_sequential_ratios(rows, samples, sequential)
    results_out = {
        "service_rps": service_rps,
        "sequential_wall_s": seq_wall,
        "sequential": [sequential[rep] for rep in sorted(sequential)],
        "rates": rates,
        "think_s": think,
        "device_pages": pages,
        "host_pages": host_pages,
        "rows": rows,
        "samples": samples,
        "acceptance": acceptance(rows),
        "hit_ttft": hits,
        "load_runs_s": load_s,
        "load_average": list(os.getloadavg()),
        "mesh": list(topology.shape),
    }
    config = {k: v for k, v in vars(args).items() if k not in ("json", "plot", "quiet")}
    return bench_common.make_result("serving-load", config, results_out)
