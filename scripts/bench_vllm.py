"""Side by side on one checkpoint: vLLM's CPU build alone, vLLM with its Mooncake store
connector, vLLM with mesh_hicache's connector (L2; L2+L3; a restarted engine on a warm L3),
and ``runtime.server``.

The workload is ``runtime.workloads``' multi-turn chat (a shared instruction, one session
prefix each, every later turn the previous prompt + its answer + new tokens), sessions
interleaved turn by turn, sent as token-id prompts by ``--clients`` threads with the official
``openai`` client, streaming, greedy (``bench_server_client.run_clients`` per round).
Every mode starts its own server(s) on 127.0.0.1 as subprocesses, pinned to ``--cpus``,
with a cold cache; vLLM runs in the vLLM venv (``scripts/setup_vllm.sh``),
``runtime.server`` in this Python. Modes alternate in one run
(repetition r runs them in order, r+1 reversed) and every ratio is a mode over vLLM alone of
the same repetition, then the median.

    .venv/bin/python scripts/bench_vllm.py --json bench_results/vllm.json
    scripts/mooncake_local.sh -- .venv/bin/python scripts/bench_vllm.py  # with the Mooncake mode
    python scripts/bench_vllm.py --kind llama --wide --modes vllm,runtime

Per mode: token hit rate by tier (vLLM's device prefix cache and its connector's tokens
from vLLM's /metrics; ``runtime.server.main``'s device/host/storage tiers from its /metrics),
TTFT p50/p99 (client side, to the first streamed token), requests/s, output tokens/s.
Greedy outputs of every run must equal vLLM alone's; otherwise the exit status is 1. A mode
that cannot run here (no Mooncake store, the connector not importable, an architecture
``runtime.server`` does not serve) is reported unavailable with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import bench_common
import bench_vllm_servers as servers
from bench_server import output_mismatches, summarize
from bench_server_client import ROOT, Conversation, RequestRecord, run_clients

from runtime.workloads.generate import make_workload

MODES = (
    "vllm", "vllm-mooncake", "mesh-l2", "mesh-l2-sync", "mesh-l2l3", "mesh-restart", "runtime"
)  # fmt: skip
"""``mesh-l2-sync``: ``mesh-l2`` with every layer's loads copied before the forward
(``layerwise_load: false``), the baseline of layer-wise loading."""
BASE = "vllm"
CONNECTOR_MODULE = "mesh_hicache.integrations.vllm"
RATIO_METRICS = ("requests_per_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "hit_rate")
GREEDY = {"temperature": 0.0, "return_token_ids": True, "ignore_eos": True}
"""Request fields past OpenAI's: greedy, ids streamed back (vLLM), no early stop."""


class Unavailable(Exception):
    """A mode that cannot run on this machine; the message says why."""


def conversations_from_workload(
    sessions: int, turns: int, vocab: int, first_len: int, append_len: int, seed: int
) -> list[Conversation]:
    """``runtime.workloads``' multiturn trace as client conversations (a session's first
    turn is its prompt, each later turn the tokens appended after the previous answer)."""
    trace = make_workload(
        "multiturn",
        sessions=sessions,
        turns=turns,
        vocab=vocab,
        seed=seed,
        first_prompt_len=first_len,
        append_len=append_len,
    )
    by_session: dict[int, list[tuple[int, ...]]] = {}
    for t in sorted(trace, key=lambda t: (t.session, t.turn)):
        by_session.setdefault(t.session, []).append(t.user_tokens)
    return [Conversation(s, parts[0], tuple(parts[1:])) for s, parts in sorted(by_session.items())]


def run_rounds(
    url: str,
    conversations: Sequence[Conversation],
    clients: int,
    max_tokens: int,
    body: Mapping[str, Any] = GREEDY,
) -> tuple[list[RequestRecord], float]:
    """The conversations turn by turn, sessions interleaved as in ``runtime.workloads``:
    round t sends every session's turn t (``clients`` at a time) and waits for all of them,
    so between two turns of one session every other session's turn goes through the cache
    (the order under which a device cache smaller than the working set evicts). Returns
    every record (with its turn) and the summed wall time of the rounds."""
    prompts = {c.index: list(c.first_prompt) for c in conversations}
    records: list[RequestRecord] = []
    wall = 0.0
    for turn in range(max(len(c.appends) for c in conversations) + 1):
        live = [c for c in conversations if turn <= len(c.appends)]
        for c in live:
            if turn:
                prompts[c.index] += c.appends[turn - 1]
        batch = [Conversation(c.index, tuple(prompts[c.index]), ()) for c in live]
        got, seconds = run_clients(url, servers.SERVED_NAME, batch, clients, max_tokens, body)
        wall += seconds
        for rec in got:
            prompts[rec.conversation] += rec.output_ids
            records.append(replace(rec, turn=turn))
    return records, wall


@dataclass
class ModeRun:
    repeat: int
    mode: str
    records: list[RequestRecord]
    wall_s: float
    tiers: dict[str, float] = field(default_factory=dict)
    connector_metrics: list[str] = field(default_factory=list)


def tier_rates(before: Mapping[str, float], after: Mapping[str, float], prompt: int) -> dict:
    """Hit tokens per tier over the measured window, as shares of its prompt tokens."""
    out: dict[str, float] = {}
    for key in after:
        if key.endswith("_hits"):
            out[key.removesuffix("_hits") + "_hit_rate"] = (
                (after[key] - before.get(key, 0.0)) / prompt if prompt else 0.0
            )
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, model: str, vocab: int) -> None:
        self.args = args
        self.model = model
        self.hybrid = servers.ckpt_is_hybrid(model)
        self.cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else None
        self.conversations = conversations_from_workload(
            args.sessions, args.turns, vocab, args.first_len, args.append_len, args.seed
        )
        warm = conversations_from_workload(
            max(1, args.warmup), 1, vocab, args.first_len, args.append_len, args.seed + 1
        )
        self.warmup = warm[: args.warmup]
        longest = args.first_len + (args.turns - 1) * (args.append_len + args.max_tokens)
        self.max_model_len = -(-(longest + args.max_tokens + 1) // 128) * 128
        self.tmp = Path(tempfile.mkdtemp(prefix="bench_vllm_"))
        self.logs = Path(tempfile.mkdtemp(prefix="bench_vllm_logs_"))
        self.starts = 0
        config = json.loads((Path(model) / "config.json").read_text())
        self.block_bytes = servers.block_bytes(config, 128 if self.hybrid else servers.DENSE_BLOCK)
        self.blocks = args.device_bytes // self.block_bytes if args.device_bytes else 0

    # -- vLLM ----------------------------------------------------------------------------

    def _vllm(self, kv_transfer: Mapping[str, Any] | None, env_extra: Mapping[str, str]):
        a = self.args
        argv = servers.vllm_argv(
            self.model, self.hybrid, a.clients, self.blocks, self.max_model_len, kv_transfer
        )
        env = servers.vllm_env(self.cpus, a.connector_path, 1)
        env.update(env_extra)
        self.starts += 1
        log = self.logs / f"vllm-{self.starts}.log"
        return servers.VllmServer(a.vllm_python, argv, env, self.cpus, log)

    def _mesh_config(
        self, storage_root: Path, policy: str, stats: Path, layerwise: bool = True
    ) -> dict[str, Any]:
        """The connector with an L2 of ``--host-bytes`` over a file L3 at ``storage_root``
        (the connector always has one). ``write_back`` writes L3 only when L2 evicts: with an
        L2 that holds the workload, the L2-only mode."""
        extra: dict[str, Any] = {
            "host_bytes": self.args.host_bytes,
            "storage_root": str(storage_root),
            "write_policy": policy,
            "stats_file": str(stats),
            "layerwise_load": layerwise,
        }
        return {
            "kv_connector": "MeshHiCacheConnector",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }

    def _drive_vllm(
        self, server: Any, rep: int, mode: str, stats: Path | None, body: Mapping[str, Any]
    ) -> ModeRun:
        if self.warmup:
            run_clients(server.url, servers.SERVED_NAME, self.warmup, 1, self.args.max_tokens, body)
        before = servers.counter_sums(servers.scrape(server.url), servers.VLLM_METRICS)
        before |= servers.connector_counters(stats)
        records, wall = run_rounds(
            server.url, self.conversations, self.args.clients, self.args.max_tokens, body
        )
        text = servers.scrape(server.url)
        after = servers.counter_sums(text, servers.VLLM_METRICS)
        after |= servers.connector_counters(stats)
        prompt = sum(r.prompt_tokens for r in records)
        return ModeRun(
            rep, mode, records, wall, tier_rates(before, after, prompt),
            servers.connector_lines(text),
        )  # fmt: skip

    def _serve(
        self,
        rep: int,
        mode: str,
        kv: Mapping[str, Any] | None,
        env: Mapping[str, str],
        stats: Path | None = None,
        body: Mapping[str, Any] = GREEDY,
    ) -> ModeRun:
        server = self._vllm(kv, env)
        try:
            return self._drive_vllm(server, rep, mode, stats, body)
        finally:
            server.stop()

    def run_mode(self, rep: int, mode: str) -> ModeRun:
        run_dir = Path(tempfile.mkdtemp(dir=self.tmp, prefix=f"{mode}-{rep}-"))
        try:
            if mode == "vllm":
                return self._serve(rep, mode, None, {})
            if mode == "vllm-mooncake":
                master = os.environ.get("MOONCAKE_MASTER")
                if not master:
                    raise Unavailable(
                        "no Mooncake store: run the bench under scripts/mooncake_local.sh"
                    )
                run_id = f"bench-{uuid.uuid4().hex[:12]}"
                config = servers.mooncake_config(
                    run_dir / "mooncake.json", master, 256 << 20, run_id
                )
                kv = {
                    "kv_connector": "MooncakeStoreConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {},
                }
                # The store outlives the run and its tenant_id does not separate keys (a
                # second repetition found the first one's pages): a fresh cache_salt (part
                # of vLLM's block hashes, so of the store's keys) starts each run cold.
                body = {**GREEDY, "cache_salt": run_id}
                env = {"MOONCAKE_CONFIG_PATH": str(config)}
                return self._serve(rep, mode, kv, env, body=body)
            l3, stats = run_dir / "l3", run_dir / "stats.json"
            if mode in ("mesh-l2", "mesh-l2-sync", "mesh-l2l3"):
                policy = "write_through" if mode == "mesh-l2l3" else "write_back"
                kv = self._mesh_config(l3, policy, stats, layerwise=mode != "mesh-l2-sync")
                return self._serve(rep, mode, kv, {}, stats)
            if mode == "mesh-restart":
                # A first engine fills L3 with the whole workload, then a new one is measured.
                first = run_dir / "stats-writer.json"
                self._serve(rep, mode, self._mesh_config(l3, "write_through", first), {}, first)
                kv = self._mesh_config(l3, "write_through", stats)
                return self._serve(rep, mode, kv, {}, stats)
            assert mode == "runtime"
            return self._runtime(rep)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    # -- runtime.server ------------------------------------------------------------------

    def _runtime(self, rep: int) -> ModeRun:
        a = self.args
        argv = ["--model", self.model, "--host", "127.0.0.1", "--port", "0"]
        argv += ["--served-model-name", servers.SERVED_NAME, "--log-level", "WARNING"]
        argv += ["--threads", str(len(self.cpus) if self.cpus else 1)]
        argv += ["--concurrency", str(a.clients), "--max-new-tokens", str(a.max_tokens)]
        argv += ["--cache", "host", "--host-bytes", str(a.host_bytes)]
        if a.device_bytes:
            argv += ["--device-bytes", str(a.device_bytes)]
        argv += a.runtime_args.split()
        try:
            server = servers.runtime_server(argv, self.cpus)
        except RuntimeError as err:
            if "is not supported" in str(err):
                last = [ln for ln in str(err).splitlines() if "not supported" in ln]
                raise Unavailable(f"runtime.server: {last[-1].strip()}") from err
            raise
        try:
            if self.warmup:
                run_clients(server.url, servers.SERVED_NAME, self.warmup, 1, a.max_tokens, GREEDY)
            before = servers.counter_sums(servers.scrape(server.url), servers.RUNTIME_METRICS)
            records, wall = run_rounds(server.url, self.conversations, a.clients, a.max_tokens)
            after = servers.counter_sums(servers.scrape(server.url), servers.RUNTIME_METRICS)
        finally:
            code = server.stop()
        if code not in (0, None):
            raise RuntimeError(f"runtime.server exited {code}:\n" + "".join(server.lines[-30:]))
        prompt = sum(r.prompt_tokens for r in records)
        return ModeRun(rep, "runtime", records, wall, tier_rates(before, after, prompt))


def ratios(summaries: Sequence[Mapping[str, Any]], modes: Sequence[str]) -> dict[str, Any]:
    """Each mode over vLLM alone, per repetition, then the median (min-max)."""
    by_rep: dict[int, dict[str, Mapping[str, Any]]] = {}
    for s in summaries:
        by_rep.setdefault(s["repeat"], {})[s["mode"]] = s
    out: dict[str, Any] = {}
    for mode in modes:
        if mode == BASE:
            continue
        cells: dict[str, Any] = {}
        for m in RATIO_METRICS:
            vals = [
                pair[mode][m] / pair[BASE][m]
                for pair in by_rep.values()
                if mode in pair and BASE in pair and pair[BASE][m]
            ]
            cells[m] = (
                {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
                if vals
                else None
            )
        out[mode] = cells
    return out


def medians(summaries: Sequence[Mapping[str, Any]], mode: str) -> dict[str, Any]:
    mine = [s for s in summaries if s["mode"] == mode]
    keys = [k for k in mine[0] if all(isinstance(s.get(k), int | float) for s in mine)]
    return {k: statistics.median(s[k] for s in mine) for k in keys if k != "repeat"}


def report(results: Mapping[str, Any]) -> str:
    lines = [
        "| mode | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | hit rate | by tier |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, row in results["modes"].items():
        if "unavailable" in row:
            lines.append(f"| {mode} | unavailable: {row['unavailable']} | | | | | |")
            continue
        tiers = ", ".join(
            f"{k.removesuffix('_hit_rate')} {v:.1%}"
            for k, v in row.items()
            if k.endswith("_hit_rate")
        )
        lines.append(
            f"| {mode} | {row['requests_per_s']:.2f} | {row['output_tokens_per_s']:.1f} | "
            f"{row['ttft_p50_s'] * 1e3:.1f} | {row['ttft_p99_s'] * 1e3:.1f} | "
            f"{row['hit_rate']:.1%} | {tiers} |"
        )
    lines += ["", f"ratios over {BASE} alone, median of per-repetition ratios (min-max):"]
    for mode, cells in results["ratios"].items():
        parts = [
            f"{m} {c['median']:.2f}x ({c['min']:.2f}-{c['max']:.2f})"
            for m, c in cells.items()
            if c is not None
        ]
        lines.append(f"  {mode}: " + ("; ".join(parts) if parts else "-"))
    ok = results["outputs_match"]
    lines.append(f"greedy outputs of every run equal {BASE} alone's: {'yes' if ok else 'NO'}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_vllm.py",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--kind", choices=("granite", "llama"), default="granite")
    p.add_argument("--wide", action="store_true", help="about 100M parameters (else hidden 128)")
    p.add_argument("--model", help="an existing checkpoint directory (instead of --kind)")
    p.add_argument(
        "--checkpoints",
        default=str(ROOT / "bench_results" / "vllm_checkpoints"),
        help="where the --kind checkpoints are built (once)",
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    p.add_argument("--sessions", type=int, default=16, help="conversations")
    p.add_argument("--turns", type=int, default=3, help="requests per conversation")
    p.add_argument("--first-len", type=int, default=512, help="first prompt tokens")
    p.add_argument("--append-len", type=int, default=64, help="new tokens of a later turn")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request")
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    p.add_argument("--repeats", type=int, default=2, help="repetitions (order alternates)")
    p.add_argument("--warmup", type=int, default=2, help="throwaway requests per server")
    p.add_argument(
        "--device-bytes",
        type=int,
        default=8 << 20,
        help="the device cache of every server in bytes (vLLM: --num-gpu-blocks-override of "
        "that many bytes; runtime.server: --device-bytes); smaller than the working set so "
        "prefixes are evicted; 0: each server's default",
    )
    p.add_argument("--host-bytes", type=int, default=256 << 20, help="L2 of the connector/runtime")
    p.add_argument("--cpus", default="0", help="cores the servers are pinned to ('' = none)")
    p.add_argument(
        "--vllm-python",
        default=str(ROOT / ".venv-vllm" / "bin" / "python"),
        help="the vLLM venv's Python (scripts/setup_vllm.sh)",
    )
    p.add_argument(
        "--connector-path",
        action="append",
        default=[],
        help="a folder put before this tree on the vLLM servers' PYTHONPATH (repeatable)",
    )
    p.add_argument("--runtime-args", default="", help="more runtime.server flags, one string")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the shared result format here")
    return p


def make_checkpoint(args: argparse.Namespace) -> str:
    """``--model``, or the ``--kind`` checkpoint under ``--checkpoints`` (built once: a
    fixed path lets vLLM reuse its compiled graphs across starts)."""
    if args.model:
        return str(Path(args.model).resolve())  # the vLLM servers run in another cwd
    out = Path(args.checkpoints) / f"{args.kind}{'-wide' if args.wide else ''}"
    cmd = [args.vllm_python, str(ROOT / "scripts" / "bench_vllm_models.py"), str(out), args.kind]
    subprocess.run(cmd + (["--wide"] if args.wide else []), check=True, timeout=900)
    return str(out)


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or BASE not in modes:
        raise ValueError(f"--modes must name {BASE!r} and only {MODES}, got {modes}")
    bench: Bench | None = None
    if not Path(args.vllm_python).exists():
        raise ValueError(f"no vLLM venv at {args.vllm_python}: run scripts/setup_vllm.sh")
    try:
        model = make_checkpoint(args)
        vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
        bench = Bench(args, model, vocab)
        print(
            f"vLLM: {bench.blocks} blocks of {bench.block_bytes} bytes; logs in {bench.logs}",
            file=sys.stderr,
            flush=True,
        )
        unavailable: dict[str, str] = {}
        if any(m.startswith("mesh-") for m in modes):
            why = servers.module_available(args.vllm_python, CONNECTOR_MODULE, args.connector_path)
            if why is not None:
                for m in modes:
                    if m.startswith("mesh-"):
                        unavailable[m] = f"import {CONNECTOR_MODULE} fails: {why}"
                print(f"mesh_hicache connector modes unavailable: {why}", file=sys.stderr)
        runs: list[ModeRun] = []
        mismatches: list[str] = []
        reference: list[RequestRecord] | None = None
        for rep in range(args.repeats):
            order = modes if rep % 2 == 0 else modes[::-1]
            for mode in order:
                if mode in unavailable:
                    continue
                print(f"[repeat {rep + 1}/{args.repeats}] {mode}", file=sys.stderr, flush=True)
                try:
                    r = bench.run_mode(rep, mode)
                except Unavailable as why:
                    unavailable[mode] = str(why)
                    print(f"  {mode} unavailable: {why}", file=sys.stderr, flush=True)
                    continue
                except RuntimeError as err:
                    if mode == BASE:
                        raise
                    unavailable[mode] = "failed: " + " | ".join(str(err).splitlines()[-6:])
                    print(f"  {mode} FAILED:\n{err}", file=sys.stderr, flush=True)
                    continue
                s = summarize(r.records, r.wall_s)
                print(
                    f"  {s['requests']} requests, {s['requests_per_s']:.2f} req/s, TTFT p50 "
                    f"{s['ttft_p50_s'] * 1e3:.1f} ms, hit rate {s['hit_rate']:.1%}, {r.tiers}",
                    file=sys.stderr,
                    flush=True,
                )
                runs.append(r)
                if mode == BASE and reference is None:
                    reference = r.records
            for r in runs:
                if r.repeat == rep and reference is not None:
                    for line in output_mismatches(r.records, reference):
                        mismatches.append(f"repeat {rep} {r.mode} vs {BASE}: {line}")
        summaries = [
            {"repeat": r.repeat, "mode": r.mode, **summarize(r.records, r.wall_s), **r.tiers}
            for r in runs
        ]
        mode_rows: dict[str, Any] = {}
        for m in modes:
            if any(s["mode"] == m for s in summaries):
                mode_rows[m] = medians(summaries, m)
            else:
                mode_rows[m] = {"unavailable": unavailable.get(m, "did not run")}
        results: dict[str, Any] = {
            "model": {"kind": args.kind, "wide": args.wide, "hybrid": bench.hybrid},
            "vllm_blocks": bench.blocks,
            "vllm_block_bytes": bench.block_bytes,
            "server_logs": str(bench.logs),
            "runs": summaries,
            "modes": mode_rows,
            "ratios": ratios(summaries, [m for m in modes if "unavailable" not in mode_rows[m]]),
            "connector_metrics": {r.mode: r.connector_metrics for r in runs if r.connector_metrics},
            "ttft": "client side, streaming: request sent to the first token chunk",
            "hit_rate": "client side: usage cached_tokens / prompt_tokens; *_hit_rate: the "
            "servers' /metrics over the measured window, hit tokens of that tier / prompt tokens",
            "outputs_match": not mismatches,
            "mismatches": mismatches,
            "requests": [asdict(rec) for rec in (reference or [])],
        }
        return results, mismatches
    finally:
        if bench is not None:
            shutil.rmtree(bench.tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        results, mismatches = run(args)
    except ValueError as err:
        print(f"bench_vllm: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # vLLM alone did not run: nothing to compare with
        print(f"bench_vllm: error: {err}", file=sys.stderr)
        return 3
    config = {k: v for k, v in vars(args).items() if k != "json"}
    out = bench_common.make_result("vllm", config, results)
    print(
        f"{args.kind}{' wide' if args.wide else ''}: {args.sessions} sessions x {args.turns} "
        f"turns (first {args.first_len}, +{args.append_len}), max_tokens {args.max_tokens}, "
        f"{args.clients} clients, device {args.device_bytes} bytes, {args.repeats} repetitions"
    )
    print(report(out["results"]))
    if args.json:
        bench_common.write_json(out, args.json)
    if mismatches:
        print("FAILED: greedy outputs differ from vLLM alone's:", file=sys.stderr)
        for line in mismatches:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
