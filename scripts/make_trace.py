"""Write a seeded hit-rate trace (JSONL) of one shape: chat, long-replies or agent.

    python scripts/make_trace.py chat --seed 0 --out chat.jsonl
    python scripts/make_trace.py agent --seed 1 --set sessions=80 --set keep_observations=5 \\
        --out agent.jsonl

``--set FIELD=VALUE`` overrides a ``runtime.traces.TraceShape`` field. Prints the
request count, prompt tokens and the longest prompt. Same arguments, same file.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from runtime.traces import SHAPES, TraceShape, make_trace, trace_shape, write_jsonl


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
    p.add_argument("--out", required=True, help="JSONL file to write")
    args = p.parse_args(argv)
    try:
        shape = trace_shape(args.shape, **dict(args.set))
        trace = make_trace(shape, seed=args.seed, vocab=args.vocab)
    except ValueError as err:
        print(f"make_trace: error: {err}", file=sys.stderr)
        return 2
    write_jsonl(trace, args.out)
    lengths = [len(r.input_tokens) for r in trace]
    print(
        f"{args.out}: {len(trace)} requests, {len({r.session_id for r in trace})} sessions, "
        f"{sum(lengths)} prompt tokens, longest prompt {max(lengths)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
