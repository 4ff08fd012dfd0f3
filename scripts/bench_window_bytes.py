"""Bytes per cached token and hit rate at equal bytes of sliding-window KV, gpt-oss-shaped.

Replays one seeded trace through the real ``HiCache`` (``runtime.workloads.replay``, the
engine's cache calls, no model) twice per L1 budget, alternating:

- ``full``: every attention layer cached as full attention (what the cache does for a
  windowed model without the window rule): 24 layers of K/V per cached token;
- ``window``: the full layers' K/V per cached token, and per resumable boundary the
  windowed layers' K/V of the last ``window`` tokens (``ceil((window - 1) / page) ``
  pages plus the sink pages), held like a recurrent state at that boundary (the tree's
  hybrid hit rule: a hit only where the boundary's window is held, the engine's
  checkpoint admission).

It reports, per budget: the token hit rate of each, their ratio (at equal bytes), and
the KV bytes L1 holds per cached token (mean over the requests of bytes held / tokens
held). For the page-level rule (``mesh_hicache.radix.window``: a windowed page kept
while any boundary's window needs it, with the leaves as the boundaries) it also reports
``held_bytes``'s ratio on the ``full`` run's final tree.

    python scripts/bench_window_bytes.py --shape chat --seed 0 \\
        --device-bytes 1GB,2GB,5GB --page-size 16 --json window_bytes.json

``--host-bytes`` adds an L2 of that budget to both (write-back).

The profile is gpt-oss-20b's shape (24 layers alternating 128-token sliding-window and
full attention, 8 KV heads of 64, bf16, 32 experts top-4); ``--window`` and
``--sink-tokens`` change the window group.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import bench_common
import torch
from bench_hitrate import one_rank_topology, parse_bytes

from mesh_hicache.radix.window import boundary_pages, held_bytes
from mesh_hicache.spec import KVSpec, StateSpec, WindowSpec
from mesh_hicache.testing import internals
from runtime.workloads.profiles import ModelProfile
from runtime.workloads.replay import Replayer, budget_cache
from runtime.workloads.traces import make_trace, trace_shape

GPT_OSS_20B = ModelProfile(
    name="gpt-oss-20b",
    d_model=2880,
    attention_layers=24,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    ssm_layers=0,
    moe_layers=24,
    num_experts=32,
    experts_per_token=4,
    expert_hidden=2880,
    dtype_bytes=2,
)
WINDOW_LAYERS = 12
WINDOW = 128


@dataclass(frozen=True, kw_only=True)
class WindowedProfile(ModelProfile):
    """``base`` with its windowed layers' K/V held per boundary (``window_pages`` pages)
    instead of per token: page bytes of the full layers only, a "state" of the window."""

    window_layers: int = 0
    window_pages: int = 0
    page_size: int = 16

    @property
    def has_ssm(self) -> bool:
        return True

    def page_bytes(self, page_size: int) -> int:
        full = self.attention_layers - self.window_layers
        return page_size * full * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def state_bytes(self) -> int:
        per_token = self.window_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes
        return self.window_pages * self.page_size * per_token


def window_pages(page_size: int, window: int, sinks: int) -> int:
    """Pages a page-aligned boundary far from the start needs of one window group."""
    g = WindowSpec(layer_ids=(0,), window=window, sink_tokens=sinks)
    far = page_size * (window + sinks + 2 * page_size)
    return len(boundary_pages(far, page_size, g))


def gpt_oss_spec(page_size: int, window: int, sinks: int) -> StateSpec:
    p = GPT_OSS_20B
    kv = KVSpec(
        layer_ids=tuple(range(p.attention_layers)),
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        dtype=torch.bfloat16,
    )
    win = WindowSpec(layer_ids=tuple(range(0, 24, 2)), window=window, sink_tokens=sinks)
    return StateSpec(page_size=page_size, kv=kv, windows=(win,), model_id="gpt-oss-shape")


def run(
    args: argparse.Namespace, prof: ModelProfile, trace: list[Any], budget: int, windowed: bool
) -> dict[str, Any]:
    host = parse_bytes(args.host_bytes) if args.host_bytes else 0
    cache = budget_cache(
        one_rank_topology(), prof, args.page_size, budget, host, policy=args.policy, split="arena"
    )
    player = Replayer(cache)
    tree = internals(cache).tree
    ps = args.page_size
    pb, sb = prof.page_bytes(ps), prof.state_bytes if windowed else 0
    inputs = reused = 0
    ratios: list[float] = []
    t0 = time.perf_counter()
    for req in trace:
        served = player.serve(req.input_tokens, req.output_tokens)
        inputs += served.input_tokens
        reused += served.reused_tokens
        pages = tree.num_device_pages
        if pages:
            held = pages * pb + tree.num_mamba_device_slots * sb
            ratios.append(held / (pages * ps))
    result: dict[str, Any] = {
        "token_hit_rate": reused / inputs if inputs else 0.0,
        "bytes_per_cached_token": sum(ratios) / len(ratios) if ratios else 0.0,
        "end_device_pages": tree.num_device_pages,
        "end_device_states": tree.num_mamba_device_slots,
        "wall_s": time.perf_counter() - t0,
    }
    if not windowed:
        spec = gpt_oss_spec(ps, args.window, args.sink_tokens)
        rule = held_bytes(tree.iter_nodes(), spec)
        result["page_rule_ratio_end"] = rule.ratio
    cache.close()
    return result


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """The trace and window group flags this script shares with ``bench_window_l3.py``."""
    p.add_argument("--shape", default="chat", help="trace shape (chat, long-replies, agent)")
    p.add_argument("--sessions", type=int, default=None, help="default: the shape's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--window", type=int, default=WINDOW)
    p.add_argument("--sink-tokens", type=int, default=0)


def trace_of(args: argparse.Namespace) -> list[Any]:
    """The seeded trace that :func:`add_trace_args`' flags name."""
    overrides = {} if args.sessions is None else {"sessions": args.sessions}
    return make_trace(trace_shape(args.shape, **overrides), seed=args.seed)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_trace_args(p)
    p.add_argument("--device-bytes", default="1GB,2GB,5GB", help="comma-separated L1 budgets")
    p.add_argument("--host-bytes", default="", help="L2 budget (default: no L2)")
    p.add_argument("--policy", default="lru")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    trace = trace_of(args)
    budgets = [parse_bytes(b) for b in args.device_bytes.split(",")]
    ps = args.page_size
    wp = window_pages(ps, args.window, args.sink_tokens)
    windowed = WindowedProfile(
        **{f: getattr(GPT_OSS_20B, f) for f in GPT_OSS_20B.__dataclass_fields__},
        window_layers=WINDOW_LAYERS,
        window_pages=wp,
        page_size=ps,
    )
    windowed = replace(windowed, name="gpt-oss-20b-windowed")
    config = {**vars(args), "requests": len(trace), "window_pages": wp, "profile": "gpt-oss-20b"}
    results: dict[str, Any] = {
        "full_bytes_per_token": GPT_OSS_20B.kv_bytes_per_token,
        "window_state_bytes": windowed.state_bytes,
        "budgets": {},
    }
    for budget in budgets:
        full = run(args, GPT_OSS_20B, trace, budget, windowed=False)
        win = run(args, windowed, trace, budget, windowed=True)
        base = full["token_hit_rate"]
        cell = {
            "full": full,
            "window": win,
            "hit_rate_ratio": win["token_hit_rate"] / base if base else 0.0,
            "bytes_per_token_ratio": win["bytes_per_cached_token"] / full["bytes_per_cached_token"],
        }
        results["budgets"][str(budget)] = cell
        print(
            f"bench_window_bytes: {budget / 1e9:g} GB: hit rate full {base:.2%} window "
            f"{win['token_hit_rate']:.2%} ({cell['hit_rate_ratio']:.3f}x); bytes/token "
            f"full {full['bytes_per_cached_token']:.0f} window {win['bytes_per_cached_token']:.0f}"
            f" ({cell['bytes_per_token_ratio']:.3f}x); page rule at end "
            f"{full['page_rule_ratio_end']:.3f}x",
            file=sys.stderr,
            flush=True,
        )
    result = bench_common.make_result("window_bytes", config, results)
    print(json.dumps(result["results"], indent=2))
    if args.json:
        bench_common.write_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
