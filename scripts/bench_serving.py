"""Serving benchmark: the runtime on one trace under every cache mode, side by side.

Modes, in order, each on a fresh cache built in this process:

- ``off``: no cache, every prompt token is computed (the baseline);
- ``device``: L1 only (a plain radix cache on device pages);
- ``host``: L1 + L2 (host pages, write-through);
- ``storage``: L1 + L2 + L3 (file backend on a fresh storage root);
- ``restart``: a new cache, cold L1 and L2, on the storage root ``storage`` just wrote,
  serving the same trace again (what a restarted server sees).

The device pool is sized so the trace's working set does not fit in L1 (the default is
64 pages of 16 tokens against 8 sessions x 4 turns of 512+ tokens); the host pool holds it.

    python scripts/bench_serving.py --json bench_results/serving.json --plot ttft.png
    python scripts/bench_serving.py --model tiny --sessions 2 --turns 2 --first-prompt-len 64
    python scripts/bench_serving.py --mode load --json load.json --plot load.png
    torchrun --standalone --nproc-per-node 4 scripts/bench_serving.py --cp 2 --tp 2

Per mode it reports TTFT p50/p95, prefill tokens computed, tokens hit per tier,
requests/s, hit rate, the achieved TTFT speedup over ``off`` (p50 over p50) and the ideal
speedup ``1 / (1 - hit_rate)`` a free load would give, and whether every request's
output equals ``off``'s. On a small model the fixed per-request costs (decode of the
first token, load copies, Python) weigh more than prefill, so the achieved/ideal ratio
is only meaningful on a model whose prefill compute dominates.

``--mode load`` measures throughput and TTFT under load instead (real-time arrivals at
three rates, the batching scheduler, modes off / L1 / L1+L2 / L1+L2+L3, and the TTFT of a
full-prefix L1 hit by cached length): see ``scripts/bench_load.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import bench_common
import bench_load
import bench_load_report
import torch
import torch.distributed as dist
from bench_common import Column

from mesh_hicache.cache import HiCache
from mesh_hicache.topology import MeshTopology
from runtime.engine import Engine, RequestResult
from runtime.launch import LaunchError, add_mesh_args, init_mesh
from runtime.model import HybridModel
from runtime.serve.flags import add_cache_args, add_run_args, cache_config
from runtime.serve.flags import build_parser as serve_parser
from runtime.serve.main import build_model, serve_trace, summarize, workload

MODES = ("off", "device", "host", "storage", "restart")
SERVE_DEFAULTS = {"sessions": 8, "turns": 4, "first_prompt_len": 512}
"""The workload of the default mode when not given (runtime.serve's defaults)."""
MODE_TO_CACHE = {
    "off": "off",
    "device": "device",
    "host": "host",
    "storage": "full",
    "restart": "full",
}
WARMUP_NAMESPACE = "bench-warmup"
SPEEDUP_TARGET = 0.7
"""Acceptance: the host mode's achieved speedup is at least this share of its ideal."""


# -- pure pieces (unit-tested) ---------------------------------------------------------------


def ideal_speedup(hit_rate: float) -> float:
    """TTFT speedup if loading cached tokens were free: ``1 / (1 - hit_rate)``.

    ``math.inf`` for a hit rate of 1; ``ValueError`` outside ``[0, 1]``.
    """
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit_rate must be in [0, 1], got {hit_rate}")
    return math.inf if hit_rate == 1.0 else 1.0 / (1.0 - hit_rate)


def speedup(baseline_s: float, value_s: float) -> float:
    """``baseline_s / value_s``; 0 when either time is not positive (nothing measured)."""
    return baseline_s / value_s if baseline_s > 0 and value_s > 0 else 0.0


def outputs_match(results: Sequence[RequestResult], reference: Sequence[RequestResult]) -> bool:
    """True when both runs served the same requests with identical ``output_ids``."""
    ours = {r.request_id: r.output_ids for r in results}
    theirs = {r.request_id: r.output_ids for r in reference}
    return ours == theirs


def ttft_by_turn(results: Sequence[RequestResult]) -> list[float]:
    """Mean TTFT (seconds) of each turn index ``0..max_turn`` over its sessions."""
    turns: dict[int, list[float]] = {}
    for r in results:
        turns.setdefault(r.turn, []).append(r.ttft_s)
    if not turns:
        return []
    return [statistics.fmean(turns[t]) if t in turns else 0.0 for t in range(max(turns) + 1)]


def add_comparisons(modes: Mapping[str, dict[str, Any]]) -> None:
    """Add ``speedup``, ``speedup_mean``, ``ideal_speedup`` and ``speedup_vs_ideal`` to
    every mode's metrics, relative to ``modes["off"]`` (mutates the dicts).

    ``speedup`` is TTFT p50 of off over this mode's; ``speedup_mean`` uses mean TTFT
    (the one that the token hit rate predicts when prefill time is linear in tokens).
    ``speedup_vs_ideal`` is ``speedup / ideal_speedup`` (None when the ideal is infinite).
    """
    if "off" not in modes:
        raise ValueError(f"comparisons need the 'off' mode; got modes {sorted(modes)}")
    off = modes["off"]
    for m in modes.values():
        ideal = ideal_speedup(m["hit_rate"])
        m["speedup"] = speedup(off["ttft_p50_s"], m["ttft_p50_s"])
        m["speedup_mean"] = speedup(off["ttft_mean_s"], m["ttft_mean_s"])
        m["ideal_speedup"] = ideal if math.isfinite(ideal) else None
        m["speedup_vs_ideal"] = m["speedup"] / ideal if math.isfinite(ideal) else None


def acceptance(modes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Issue-8 acceptance checks over the modes that ran (a check whose modes did not run
    is absent)."""
    out: dict[str, Any] = {}
    if "host" in modes and "device" in modes:
        out["host_fewer_prefill_than_device"] = (
            modes["host"]["prefill_tokens_computed"] < modes["device"]["prefill_tokens_computed"]
        )
    if "host" in modes and modes["host"].get("speedup_vs_ideal") is not None:
        ratio = modes["host"]["speedup_vs_ideal"]
        out["host_speedup_vs_ideal"] = ratio
        out["host_speedup_vs_ideal_ok"] = ratio >= SPEEDUP_TARGET
    if "restart" in modes and "off" in modes:
        out["restart_fewer_prefill_than_off"] = (
            modes["restart"]["prefill_tokens_computed"] < modes["off"]["prefill_tokens_computed"]
        )
        out["restart_outputs_match"] = bool(modes["restart"]["outputs_match"])
    return out


def _ms(value: float) -> str:
    return f"{value * 1e3:.1f}"


def _ratio(value: float) -> str:
    return f"{value:.2f}x"


TABLE_COLUMNS = (
    Column("mode", "mode", align="left"),
    Column("ttft_p50_s", "TTFT p50 ms", _ms),
    Column("ttft_p95_s", "TTFT p95 ms", _ms),
    Column("prefill_tokens_computed", "prefill computed"),
    Column("cached_device", "hit L1"),
    Column("cached_host", "hit L2"),
    Column("cached_storage", "hit L3"),
    Column("hit_rate", "hit rate", "{:.1%}"),
    Column("requests_per_s", "req/s", "{:.2f}"),
    Column("speedup", "speedup", _ratio),
    Column("ideal_speedup", "ideal", _ratio),
    Column("speedup_vs_ideal", "achieved/ideal", "{:.0%}"),
    Column("outputs_match", "outputs = off", lambda v: "yes" if v else "NO"),
)


def render_table(modes: Mapping[str, Mapping[str, Any]]) -> str:
    """The per-mode Markdown table (modes in run order)."""
    return bench_common.markdown_table(
        [{"mode": name, **m} for name, m in modes.items()], TABLE_COLUMNS
    )


# -- running ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_serving.py",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_mesh_args(p)
    add_run_args(p)
    add_cache_args(p)
    # Bigger than serve's defaults: compute must dominate, and L2 must hold the trace.
    p.set_defaults(model="small", host_pages=1024)
    # Load mode: 4 in flight; think time None = one sequential service time.
    p.set_defaults(concurrency=4, think_s=None)
    # Not given: filled per --mode (bench_load.LOAD_DEFAULTS / SERVE_DEFAULTS).
    p.set_defaults(**{name: None for name in bench_load.LOAD_DEFAULTS})
    p.add_argument(
        "--mode",
        choices=("modes", "load"),
        default="modes",
        help="modes: the trace served one request at a time under every --modes cache mode; "
        "load: throughput/TTFT at three request rates (scripts/bench_load.py)",
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list from {MODES}")
    bench_load.add_load_args(p)
    p.add_argument(
        "--host-mamba-slots", type=int, default=0, help="L2 Mamba slots; 0 = host pages / 4"
    )
    p.add_argument(
        "--storage-root",
        default=None,
        help="folder for a fresh L3 root (a new subfolder is made and removed); default: tmp",
    )
    p.add_argument("--keep-storage", action="store_true", help="leave the L3 files behind")
    p.add_argument("--no-warmup", action="store_true", help="skip the throwaway request")
    p.add_argument("--json", metavar="PATH", help="write the shared result format here")
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="PNG: mean TTFT per turn per mode (--mode load: throughput and TTFT by rate)",
    )
    p.add_argument("--quiet", action="store_true", help="no per-mode progress lines")
    return p


def parse_modes(text: str) -> tuple[str, ...]:
    """The modes named in ``text`` (comma separated), in run order; ``off`` is always run.

    ``ValueError`` for an unknown name or ``restart`` without ``storage``.
    """
    names = {m.strip() for m in text.split(",") if m.strip()}
    unknown = names - set(MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    if "restart" in names and "storage" not in names:
        raise ValueError("mode 'restart' re-reads what 'storage' wrote; add 'storage'")
    names.add("off")
    return tuple(m for m in MODES if m in names)


def _cache_args(args: argparse.Namespace, mode: str, root: str) -> argparse.Namespace:
    """The ``runtime.serve`` flags of ``mode``, parsed by its own parser (one set of defaults)."""
    flags = {
        "--cache": MODE_TO_CACHE[mode],
        "--storage": "file",
        "--storage-root": root,
        "--device-pages": args.device_pages,
        "--host-pages": args.host_pages,
        "--write-policy": args.write_policy,
        "--prefetch-policy": args.prefetch_policy,
        "--prefetch-threshold": args.prefetch_threshold,
        "--cp-kv": args.cp_kv,
    }
    return serve_parser().parse_args([str(x) for kv in flags.items() for x in kv])


@dataclass(frozen=True, slots=True)
class ModeRun:
    """One mode's per-request results, wall time and (cached modes) cache counters."""

    mode: str
    results: list[RequestResult]
    wall_s: float
    cache_stats: dict[str, object] | None


def _agreed_storage_root(args: argparse.Namespace) -> str:
    """A fresh folder, the same on every rank (rank 0 makes it and broadcasts the path)."""
    box: list[str | None] = [None]
    if dist.get_rank() == 0:
        parent = args.storage_root or tempfile.gettempdir()
        os.makedirs(parent, exist_ok=True)
        box[0] = tempfile.mkdtemp(prefix="bench_serving_l3_", dir=parent)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def serve_mode(
    mode: str,
    args: argparse.Namespace,
    topology: MeshTopology,
    model: HybridModel,
    trace: Sequence[Any],
    root: str,
    warmup: Sequence[int],
) -> ModeRun:
    """Serve ``trace`` with a new cache for ``mode`` (None for ``off``). Collective.

    A throwaway request (``warmup``, in its own namespace so it never hits the trace's
    prefixes) goes first so first-call costs do not land in one mode's numbers.
    """
    cache = None
    if mode != "off":
        cfg = cache_config(_cache_args(args, mode, root))
        assert cfg is not None
        if cfg.enable_host:
            slots = args.host_mamba_slots or max(1, args.host_pages // 4)
            cfg = dataclasses.replace(cfg, host_mamba_slots=slots)
        cache = HiCache(topology, model.config.state_spec(args.page_size), cfg)
    engine = Engine(model, cache, max_new_tokens=args.max_new_tokens)
    if warmup:
        engine.serve(warmup, WARMUP_NAMESPACE)
    results, wall, stats = serve_trace(engine, trace)
    return ModeRun(mode, results, wall, stats)


def mode_metrics(run: ModeRun, reference: ModeRun | None) -> dict[str, Any]:
    """``summarize`` of the run plus per-turn TTFT, output check and cache counters."""
    out = summarize(run.results, run.wall_s)
    out["ttft_by_turn_s"] = ttft_by_turn(run.results)
    out["outputs_match"] = outputs_match(run.results, reference.results) if reference else True
    out["cache_stats"] = run.cache_stats
    return out


def write_plot(modes: Mapping[str, Mapping[str, Any]], path: str) -> bool:
    """Mean TTFT per turn per mode as a PNG; False (and a message) without matplotlib."""
    plt = bench_common.pyplot(path)
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, m in modes.items():
        per_turn = m["ttft_by_turn_s"]
        ax.plot(range(len(per_turn)), [1e3 * t for t in per_turn], marker="o", label=name)
    ax.set_xlabel("turn")
    ax.set_xticks(range(max((len(v["ttft_by_turn_s"]) for v in modes.values()), default=0)))
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title("TTFT per turn by cache mode")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(args: argparse.Namespace, topology: MeshTopology) -> dict[str, Any]:
    """Every requested mode on one trace; returns the shared-format result. Collective."""
    modes_to_run = parse_modes(args.modes)
    model = build_model(args, topology)
    config = model.config
    trace = workload(args, config.vocab_size)
    rng = random.Random(args.seed + 1)
    warmup = (
        []
        if args.no_warmup
        else [rng.randrange(config.vocab_size) for _ in range(args.first_prompt_len)]
    )
    leader = topology.coords == (0, 0, 0)
    root = _agreed_storage_root(args)
    runs: dict[str, ModeRun] = {}
    try:
        for mode in modes_to_run:
            runs[mode] = serve_mode(mode, args, topology, model, trace, root, warmup)
            if leader and not args.quiet:
                s = summarize(runs[mode].results, runs[mode].wall_s)
                print(
                    f"[{mode}] {s['requests']} requests in {s['wall_s']:.1f} s, "
                    f"hit rate {s['hit_rate']:.1%}, TTFT p50 {s['ttft_p50_s'] * 1e3:.1f} ms",
                    flush=True,
                )
    finally:
        if topology.num_ranks > 1:
            dist.barrier()
        if leader and not args.keep_storage:
            shutil.rmtree(root, ignore_errors=True)
    reference = runs["off"]
    modes = {name: mode_metrics(r, reference) for name, r in runs.items()}
    add_comparisons(modes)
    results = {
        "modes": modes,
        "outputs_match": all(m["outputs_match"] for m in modes.values()),
        "acceptance": acceptance(modes),
        "mesh": list(topology.shape),
        "storage_root": root if args.keep_storage else None,
    }
    config_out = {k: v for k, v in vars(args).items() if k not in ("json", "plot", "quiet")}
    out = bench_common.make_result("serving", config_out, results)
    # The issue-8 contract reads modes at the top level; the shared format has them under
    # "results". Both point at the same numbers.
    out["modes"] = out["results"]["modes"]
    return out


def report(out: Mapping[str, Any]) -> str:
    """The Markdown table and the acceptance lines, as printed."""
    res = out["results"]
    lines = [render_table(res["modes"]), ""]
    lines.append(f"outputs of every mode equal off's: {'yes' if res['outputs_match'] else 'NO'}")
    for key, value in res["acceptance"].items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{key}: {shown}")
    return "\n".join(lines)


def _workload_line(args: argparse.Namespace) -> str:
    return (
        f"workload = {args.workload} ({args.sessions} sessions x {args.turns} turns, first "
        f"prompt {args.first_prompt_len}, append {args.append_len}, {args.max_new_tokens} new "
        f"tokens), concurrency {args.concurrency}, token budget {args.token_budget}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bench_load.fill_workload_defaults(
        args, bench_load.LOAD_DEFAULTS if args.mode == "load" else SERVE_DEFAULTS
    )
    owns_group = not dist.is_initialized()
    try:
        parse_modes(args.modes)
        if args.mode == "load":
            bench_load.check_load_args(args)
        topology = init_mesh(args.pp, args.cp, args.tp)
    except (LaunchError, ValueError) as err:
        print(f"bench_serving: error: {err}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        out = bench_load.run_load(args, topology) if args.mode == "load" else run(args, topology)
    except ValueError as err:
        print(f"bench_serving: error: {err}", file=sys.stderr)
        return 2
    finally:
        # main() also runs inside other processes (tests): leave their setting as found.
        torch.set_num_threads(threads)
    if topology.coords == (0, 0, 0) and args.mode == "load":
        print(f"mesh (pp, cp, tp) = {topology.shape}, model = {args.model}, {_workload_line(args)}")
        print(bench_load_report.report_load(out))
        if args.json:
            bench_common.write_json(out, args.json)
        if args.plot:
            bench_load_report.write_load_plot(out["results"]["rows"], args.plot)
    elif topology.coords == (0, 0, 0):
        print(
            f"mesh (pp, cp, tp) = {topology.shape}, model = {args.model}, workload = "
            f"{args.workload} ({args.sessions} sessions x {args.turns} turns), L1 = "
            f"{args.device_pages} x {args.page_size}-token pages, L2 = {args.host_pages} pages"
        )
        print(report(out))
        if args.json:
            bench_common.write_json(out, args.json)
        if args.plot:
            write_plot(out["results"]["modes"], args.plot)
    if owns_group:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
