"""Write a seeded hit-rate trace (JSONL) of one shape: chat, long-replies or agent.

    python scripts/make_trace.py chat --seed 0 --out chat.jsonl
    python scripts/make_trace.py agent --seed 1 --set sessions=80 --set keep_observations=5 \\
        --out agent.jsonl

``--set FIELD=VALUE`` overrides a ``runtime.workloads.traces.TraceShape`` field; ``--session-rate``
(sessions started per second, Poisson) and ``--think-s`` (mean seconds between a
session's turns) are the arrival fields by name. Every line carries ``arrival_s`` (planned
arrival, trace seconds) and a later turn ``think_s`` (its gap); ``--no-times`` leaves
both out. Prints the request count, prompt tokens, the longest prompt and the trace's
span in seconds. Same arguments, same file.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace

from runtime.workloads.traces import SHAPES, TraceShape, make_trace, trace_shape, write_jsonl


def _override(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    types = {f.name: f.type for f in fields(TraceShape)}
    if not sep or name not in types:
        raise argparse.ArgumentTypeError(
            f"--set {text!r}: expected FIELD=VALUE with FIELD in {sorted(types)}"
        )
    kind = str(types[name])
    try:
        if kind == "int":
            return name, int(value)
        if kind == "float":
            return name, float(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--set {text!r}: {err}") from err
    return name, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--set", type=_override, action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--session-rate", type=float, help="sessions started per second (Poisson)")
    p.add_argument("--think-s", type=float, help="mean seconds between a session's turns")
    p.add_argument("--no-times", action="store_true", help="write no arrival_s / think_s")
    p.add_argument("--out", required=True, help="JSONL file to write")
    args = p.parse_args(argv)
    overrides = dict(args.set)
    for name in ("session_rate", "think_s"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    try:
        shape = trace_shape(args.shape, **overrides)
        trace = make_trace(shape, seed=args.seed, vocab=args.vocab)
    except ValueError as err:
        print(f"make_trace: error: {err}", file=sys.stderr)
        return 2
    if args.no_times:
        trace = [replace(r, arrival_s=None, think_s=0.0) for r in trace]
    write_jsonl(trace, args.out)
    lengths = [len(r.input_tokens) for r in trace]
    span = max((r.arrival_s or 0.0) for r in trace)
    print(
        f"{args.out}: {len(trace)} requests, {len({r.session_id for r in trace})} sessions, "
        f"{sum(lengths)} prompt tokens, longest prompt {max(lengths)}, last arrival "
        f"{span:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
