"""Server benchmark: what C concurrent HTTP clients get from ``runtime.server``, one request
at a time (A, ``--concurrency 1``) against one running batch (B, ``--concurrency 8``).

Each run starts a fresh ``python -m runtime.server`` subprocess on 127.0.0.1 (port 0,
``OMP_NUM_THREADS=1 --threads 1``, cold cache), sends a few warm-up requests, then lets
``--clients`` threads, each with its own official ``openai`` client, work through the same
conversations: ``--system-prompts`` shared system prompts, each conversation one of them
plus its own user suffix, ``--turns`` turns (a later turn's prompt is the previous prompt,
the answer and a new user suffix). Prompts are token ids (the presets have no tokenizer),
every request streams (``stream_options.include_usage``). The server runs in its own
process so the clients' Python does not share a GIL with the engine thread.

A and B alternate (A, B, then B, A, ...) for ``--repeats`` repetitions, and every ratio is
B over A of the same repetition, then the median of those (the box's load drifts between
repetitions; within one it hits both modes alike).

    python scripts/bench_server.py --json bench_results/server.json
    python scripts/bench_server.py --clients 8 --conversations 16 --turns 2 --repeats 3
    python scripts/bench_server.py --a-concurrency 1 --b-concurrency 4 --cache off

Per run it reports req/s, output tokens/s, TTFT p50/p99 (client side: request sent to the
first streamed token), end-to-end latency p50/p99 (to the end of the stream), the hit rate
(``cached_tokens / prompt_tokens`` of the usage chunks) and the server's
``peak_running``. Greedy outputs of every run must equal the first A run's, request by
request; a mismatch is printed loudly and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bench_common
from bench_common import Column
from bench_server_client import Conversation, RequestRecord, ServerProcess, run_clients

from runtime.serve.main import percentile

RATIO_METRICS = ("requests_per_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s")
"""Metrics compared B over A (for the TTFT ones, below 1 is better)."""


# -- pure pieces (unit-tested) ---------------------------------------------------------------


def make_conversations(
    vocab_size: int,
    system_prompts: int,
    system_len: int,
    conversations: int,
    user_len: int,
    turns: int,
    seed: int,
) -> list[Conversation]:
    """``conversations`` conversations over ``system_prompts`` shared system prompts
    (round robin), each with its own ``user_len``-token suffix per turn. Token ids are in
    ``[1, vocab_size)``; the same arguments give the same conversations."""
    if min(system_prompts, conversations, turns, user_len) < 1 or system_len < 0:
        raise ValueError(
            "system prompts, conversations, turns and user length must be >= 1 "
            f"(got {system_prompts}, {conversations}, {turns}, {user_len}); "
            f"system length >= 0 (got {system_len})"
        )
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1, vocab_size) for _ in range(n))

    systems = [tokens(system_len) for _ in range(system_prompts)]
    return [
        Conversation(
            i,
            systems[i % system_prompts] + tokens(user_len),
            tuple(tokens(user_len) for _ in range(turns - 1)),
        )
        for i in range(conversations)
    ]


def summarize(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Throughput, client-side latencies and hit rate of one run."""
    ttft = [r.ttft_s for r in records]
    latency = [r.latency_s for r in records]
    prompt = sum(r.prompt_tokens for r in records)
    output = sum(len(r.output_ids) for r in records)
    return {
        "requests": len(records),
        "wall_s": wall_s,
        "requests_per_s": len(records) / wall_s if wall_s > 0 else 0.0,
        "output_tokens": output,
        "output_tokens_per_s": output / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "latency_p50_s": percentile(latency, 0.5),
        "latency_p99_s": percentile(latency, 0.99),
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in records),
        "hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
    }


def output_mismatches(
    records: Sequence[RequestRecord], reference: Sequence[RequestRecord], limit: int = 5
) -> list[str]:
    """Lines naming the requests whose outputs differ from ``reference``'s (at most
    ``limit`` of them, then a count); empty when every request's output is equal."""
    ours = {(r.conversation, r.turn): r.output_ids for r in records}
    theirs = {(r.conversation, r.turn): r.output_ids for r in reference}
    lines = []
    for key in sorted(set(ours) | set(theirs)):
        a, b = theirs.get(key), ours.get(key)
        if a != b:
            lines.append(f"conversation {key[0]} turn {key[1]}: reference {a}, got {b}")
    if len(lines) > limit:
        lines = lines[:limit] + [f"... {len(lines) - limit} more"]
    return lines


def ratios(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """B over A per repetition for ``RATIO_METRICS``, and their median, min and max.

    ``runs`` are per-run summaries with ``repeat`` and ``mode`` ("A" or "B"); a
    repetition without both modes, or with A's value 0, is left out of that metric."""
    by_repeat: dict[int, dict[str, Mapping[str, Any]]] = {}
    for r in runs:
        by_repeat.setdefault(r["repeat"], {})[r["mode"]] = r
    per_repeat = []
    for rep in sorted(by_repeat):
        pair = by_repeat[rep]
        if "A" not in pair or "B" not in pair:
            continue
        row: dict[str, Any] = {"repeat": rep}
        for m in RATIO_METRICS:
            a, b = pair["A"][m], pair["B"][m]
            row[m] = b / a if a > 0 else None
        per_repeat.append(row)
    out: dict[str, Any] = {"per_repeat": per_repeat}
    for m in RATIO_METRICS:
        values = [row[m] for row in per_repeat if row[m] is not None]
        out[m] = {
            "median": statistics.median(values) if values else None,
            "min": min(values) if values else None,
            "max": max(values) if values else None,
        }
    return out


def mode_medians(runs: Sequence[Mapping[str, Any]], mode: str) -> dict[str, Any]:
    """The median over repetitions of every numeric metric of ``mode``'s runs."""
    mine = [r for r in runs if r["mode"] == mode]
    keys = [
        k for k in mine[0] if k != "repeat" and all(isinstance(r[k], int | float) for r in mine)
    ]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in mine) for k in keys}
    out.update(mode=mode, concurrency=mine[0]["concurrency"], repeats=len(mine))
    return out


def _ms(value: float) -> str:
    return f"{value * 1e3:.1f}"


def _ratio(cell: Mapping[str, Any] | None) -> str:
    if not cell or cell["median"] is None:
        return "-"
    return f"{cell['median']:.2f}x ({cell['min']:.2f}-{cell['max']:.2f})"


MODE_COLUMNS = (
    Column("mode", "mode", align="left"),
    Column("concurrency", "--concurrency"),
    Column("requests_per_s", "req/s", "{:.2f}"),
    Column("output_tokens_per_s", "out tok/s", "{:.1f}"),
    Column("ttft_p50_s", "TTFT p50 ms", _ms),
    Column("ttft_p99_s", "TTFT p99 ms", _ms),
    Column("latency_p50_s", "e2e p50 ms", _ms),
    Column("latency_p99_s", "e2e p99 ms", _ms),
    Column("hit_rate", "hit rate", "{:.1%}"),
    Column("peak_running", "peak running"),
)


def report(results: Mapping[str, Any]) -> str:
    """The per-mode table (medians over repetitions) and the B/A ratio lines."""
    rows = [results["modes"]["A"], results["modes"]["B"]]
    lines = [bench_common.markdown_table(rows, MODE_COLUMNS), ""]
    rat = results["ratios"]
    lines.append("B/A, median of per-repetition ratios (min-max):")
    for m in RATIO_METRICS:
        lines.append(f"  {m}: {_ratio(rat[m])}")
    ok = results["outputs_match"]
    lines.append(f"greedy outputs of every run equal the first A run's: {'yes' if ok else 'NO'}")
    return "\n".join(lines)


# -- running ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModeRun:
    """One run of one mode: its records, wall time and the server's peak batch."""

    repeat: int
    mode: str
    concurrency: int
    records: list[RequestRecord]
    wall_s: float
    peak_running: int | None


def vocab_size(model: str) -> int:
    """The vocabulary of a preset or of a checkpoint directory's ``config.json``."""
    path = Path(model) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        return int(config.get("text_config", config)["vocab_size"])
    from runtime.model.config import PRESETS

    if model not in PRESETS:
        raise ValueError(f"--model {model!r} is neither a preset {sorted(PRESETS)} nor a directory")
    return PRESETS[model].vocab_size


def server_argv(args: argparse.Namespace, concurrency: int, storage_root: str) -> list[str]:
    argv = ["--model", args.model, "--host", "127.0.0.1", "--port", "0", "--threads", "1"]
    argv += ["--concurrency", str(concurrency), "--cache", args.cache]
    argv += ["--device-pages", str(args.device_pages), "--max-new-tokens", str(args.max_tokens)]
    argv += ["--log-level", "WARNING"]
    if args.cache == "full":
        argv += ["--storage-root", storage_root]
    return argv + shlex.split(args.server_args)


def run_mode(
    args: argparse.Namespace,
    repeat: int,
    mode: str,
    concurrency: int,
    conversations: Sequence[Conversation],
    warmup: Sequence[Conversation],
) -> ModeRun:
    """Start a fresh server for ``mode``, warm it up, run the clients, stop it."""
    storage_root = tempfile.mkdtemp(prefix="bench_server_l3_")
    try:
        server = ServerProcess(server_argv(args, concurrency, storage_root))
    except BaseException:
        shutil.rmtree(storage_root, ignore_errors=True)
        raise
    try:
        if warmup:
            run_clients(server.url, args.model, warmup, len(warmup), args.max_tokens)
        records, wall = run_clients(
            server.url, args.model, conversations, args.clients, args.max_tokens
        )
        peak = server.peak_running()
    finally:
        code = server.stop()
        shutil.rmtree(storage_root, ignore_errors=True)
    if code != 0:
        raise RuntimeError(f"the server exited {code}:\n" + "".join(server.lines[-30:]))
    return ModeRun(repeat, mode, concurrency, records, wall, peak)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_server.py",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="a preset or a checkpoint directory")
    p.add_argument("--a-concurrency", type=int, default=1, help="mode A's --concurrency")
    p.add_argument("--b-concurrency", type=int, default=8, help="mode B's --concurrency")
    p.add_argument("--clients", type=int, default=8, help="concurrent client threads")
    p.add_argument("--conversations", type=int, default=32, help="conversations per run")
    p.add_argument("--turns", type=int, default=2, help="requests per conversation")
    p.add_argument("--system-prompts", type=int, default=4, help="distinct shared prefixes")
    p.add_argument("--system-len", type=int, default=256, help="tokens of a system prompt")
    p.add_argument("--user-len", type=int, default=32, help="new user tokens of every turn")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request")
    p.add_argument("--repeats", type=int, default=3, help="A/B repetitions (alternating order)")
    p.add_argument("--warmup", type=int, default=2, help="throwaway requests per server")
    p.add_argument("--cache", choices=("off", "device", "host", "full"), default="host")
    p.add_argument("--device-pages", type=int, default=512, help="the servers' L1 pages")
    p.add_argument(
        "--server-args",
        default="",
        help="more runtime.server flags for both modes, one string: "
        "--server-args='--token-budget 128'",
    )
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--json", metavar="PATH", help="write the shared result format here")
    return p


def check_args(args: argparse.Namespace) -> None:
    for name in ("a_concurrency", "b_concurrency", "clients", "repeats", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Every repetition of A and B; the results and the output mismatch lines."""
    vocab = vocab_size(args.model)
    conversations = make_conversations(
        vocab,
        args.system_prompts,
        args.system_len,
        args.conversations,
        args.user_len,
        args.turns,
        args.seed,
    )
    # Own seed and length: a warm-up prompt shares no page with the measured ones.
    warm = make_conversations(
        vocab, 1, 0, max(1, args.warmup), args.system_len + args.user_len, 1, args.seed + 1
    )
    warmup = warm[: args.warmup]
    flags = {"A": args.a_concurrency, "B": args.b_concurrency}
    runs: list[ModeRun] = []
    mismatches: list[str] = []
    for rep in range(args.repeats):
        for mode in ("A", "B") if rep % 2 == 0 else ("B", "A"):
            print(
                f"[repeat {rep + 1}/{args.repeats}] {mode} (--concurrency {flags[mode]}): "
                "starting a server",
                file=sys.stderr,
                flush=True,
            )
            r = run_mode(args, rep, mode, flags[mode], conversations, warmup)
            runs.append(r)
            s = summarize(r.records, r.wall_s)
            print(
                f"[repeat {rep + 1}/{args.repeats}] {mode}: {s['requests']} requests in "
                f"{r.wall_s:.2f} s, {s['requests_per_s']:.2f} req/s, "
                f"{s['output_tokens_per_s']:.1f} tok/s, TTFT p50 {s['ttft_p50_s'] * 1e3:.1f} ms, "
                f"hit rate {s['hit_rate']:.1%}, peak running {r.peak_running}",
                file=sys.stderr,
                flush=True,
            )
            # Repetition 0 runs A first: runs[0] is the reference of every later run.
            for line in output_mismatches(r.records, runs[0].records):
                mismatches.append(f"repeat {rep} {mode} vs first A: {line}")
    summaries = [
        {
            "repeat": r.repeat,
            "mode": r.mode,
            "concurrency": r.concurrency,
            "peak_running": r.peak_running,
            **summarize(r.records, r.wall_s),
        }
        for r in runs
    ]
    results: dict[str, Any] = {
        "runs": summaries,
        "modes": {m: mode_medians(summaries, m) for m in ("A", "B")},
        "ratios": ratios(summaries),
        "ttft": "client side, streaming: request sent to the first token chunk",
        "outputs_match": not mismatches,
        "mismatches": mismatches,
        "requests": [
            asdict(rec) for rec in sorted(runs[0].records, key=lambda r: (r.conversation, r.turn))
        ],
    }
    return results, mismatches


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        results, mismatches = run(args)
    except ValueError as err:
        print(f"bench_server: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # a server that did not start or failed
        print(f"bench_server: error: {err}", file=sys.stderr)
        return 3
    config = {k: v for k, v in vars(args).items() if k != "json"}
    out = bench_common.make_result("server", config, results)
    print(
        f"model = {args.model}, cache = {args.cache}, {args.clients} clients, "
        f"{args.conversations} conversations x {args.turns} turns over {args.system_prompts} "
        f"system prompts of {args.system_len} tokens (+{args.user_len} per turn), "
        f"max_tokens {args.max_tokens}, {args.repeats} repetitions"
    )
    print(report(out["results"]))
    if args.json:
        bench_common.write_json(out, args.json)
    if mismatches:
        bar = "!" * 72
        print(
            f"{bar}\nFAILED: greedy outputs differ from the first A run's (B must equal A)",
            file=sys.stderr,
        )
        for line in mismatches:
            print(f"  {line}", file=sys.stderr)
        print(bar, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
