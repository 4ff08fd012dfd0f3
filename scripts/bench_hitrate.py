"""Token hit rate and FLOPs saved of the cache on a trace, at the byte budget of a model.

Replays a JSONL trace (``scripts/make_trace.py``; one request per line with
``session_id``, ``input_tokens`` = the full prompt, ``output_tokens``, in arrival order)
through the real ``HiCache`` on a one-rank CPU mesh, with the engine's cache calls and
checkpoint placement (``runtime.workloads.replay``) and no model compute. Tiers use small tensors
sized from the byte budgets and the model profile (bytes per KV page and per state
checkpoint): by default each tier is one arena shared by pages and states
(``--split arena``, the cache's ``device_bytes`` / ``host_bytes``), or fixed pools by
``HiCacheConfig``'s slot rule (``--split rule``) or with ``--state-share F`` of each
budget for states. ``--policy`` picks the eviction policy (``cost``, the default, and
``gds`` rank by the profile's FLOPs and bytes); ``--baselines 0.5,1,2`` also replays
LRU and the Marconi baseline at each alpha on the same trace and reports the best alpha.

    python scripts/make_trace.py chat --seed 0 --out chat.jsonl
    python scripts/bench_hitrate.py chat.jsonl --profile hybrid-7b --device-bytes 2GB \\
        --host-bytes 8GB --page-size 16 --policy cost --baselines 0.5,1,2 --json chat_2g.json

Byte sizes take an optional unit: ``K``/``M``/``G`` (powers of 1000, also ``KB`` etc.) or
``KiB``/``MiB``/``GiB``. ``token_hit_rate`` is reused prompt tokens / prompt tokens (a
fraction); ``flops_saved`` sums ``profile.flops(0, reused)`` over requests (attention
with its per-position term, MLP and recurrent FLOPs; ``runtime.workloads.profiles``). Both are also
reported per tier the reused prefix came from. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

import bench_common
import torch.distributed as dist
from baseline_policies import GreedyDualSizePolicy, MarconiPolicy
from torch.distributed.device_mesh import init_device_mesh

from mesh_hicache.radix import eviction
from mesh_hicache.testing import internals
from mesh_hicache.topology import MeshTopology
from runtime.workloads.profiles import ModelProfile, profile
from runtime.workloads.profiles_hf import load_hf_config
from runtime.workloads.replay import SPLITS, TIERS, Replayer, budget_cache
from runtime.workloads.traces import TraceRequest, read_jsonl

POLICIES = ("lru", "cost", "adaptive", "reuse", "gds", "marconi")
DEFAULT_POLICY = "cost"
_UNITS = {
    "": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"1.5GiB"``, ``"123"``; ``argparse`` type."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a byte size (a number with an optional unit from "
            f"K, M, G, T, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 0:
        raise argparse.ArgumentTypeError(f"byte size must be >= 0, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="JSONL trace (scripts/make_trace.py writes one)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--profile", default=None, help="built-in model profile (hybrid-7b)")
    model.add_argument(
        "--model-config",
        default=None,
        help="a Hugging Face config.json: Mamba-2 hybrids (nemotron_h, granitemoehybrid, "
        "bamba), Gated DeltaNet (qwen3_next, qwen3_5*), MLA (deepseek_v3, deepseek_v32)",
    )
    p.add_argument("--device-bytes", type=parse_bytes, required=True, help="L1 budget")
    p.add_argument("--host-bytes", type=parse_bytes, default=0, help="L2 budget (0: L1 only)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=DEFAULT_POLICY,
        help="eviction policy: cost (this bench's default; opt-in in the cache: saved "
        "FLOPs per byte, decaying exponentially with age), adaptive (cost with its horizon "
        "scaled online to the victims' mean age), reuse (adaptive's order, the victim in a "
        "queue by an online learnt reuse probability times value), lru, gds (GreedyDual-Size over "
        "saved FLOPs per byte), "
        "marconi (the paper's recency + alpha x FLOP efficiency baseline, --alpha)",
    )
    p.add_argument("--alpha", type=float, default=1.0, help="marconi: weight of FLOP efficiency")
    p.add_argument(
        "--baselines",
        default=None,
        metavar="ALPHAS",
        help="also replay lru and marconi at each comma-separated alpha on the same trace "
        "(results under 'baselines'; 'marconi_best' is the best alpha by hit rate)",
    )
    p.add_argument(
        "--split",
        choices=SPLITS,
        default="arena",
        help="arena: one byte budget per tier shared by pages and states (the cache's "
        "device_bytes/host_bytes); rule: fixed pools by HiCacheConfig's slot rule; "
        "share: fixed pools with --state-share of each budget for states",
    )
    p.add_argument(
        "--write-policy",
        choices=("write_back", "write_through"),
        default="write_back",
        help="with --host-bytes: L1 victims go to L2 (write_back) or every insert does",
    )
    p.add_argument(
        "--write-back-gate",
        action="store_true",
        help="with write_back: an L1 victim goes to L2 only when the policy ranks it at or "
        "above L2's own next victim (BackupQueue.value_gate; off by default)",
    )
    p.add_argument(
        "--state-share",
        type=float,
        default=None,
        help="fraction of each budget for state checkpoints (fixed pools; implies --split share)",
    )
    p.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    p.add_argument("--progress-s", type=float, default=5.0, help="seconds between progress lines")
    p.add_argument("--json", default=None, metavar="OUT", help="write the result here")
    return p


def make_policy(name: str, prof: ModelProfile, alpha: float) -> str | eviction.EvictionPolicy:
    """What ``HiCacheConfig.eviction_policy`` gets for ``--policy name``."""
    if name == "marconi":
        return MarconiPolicy(prof.cost_model(), alpha)
    if name == "gds":
        return GreedyDualSizePolicy(prof.cost_model())
    if name not in POLICIES:
        raise ValueError(f"--policy {name!r}; choose from {POLICIES}")
    return name


def model_profile(args: argparse.Namespace) -> ModelProfile:
    if args.model_config is not None:
        return load_hf_config(args.model_config)
    return profile(args.profile or "hybrid-7b")


def one_rank_topology() -> MeshTopology:
    """A 1x1x1 CPU mesh on a one-rank gloo group (created here if none exists)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "cp", "tp"))
    return MeshTopology.from_mesh(mesh)


def replay(
    args: argparse.Namespace,
    prof: ModelProfile,
    trace: list[TraceRequest],
    policy: str | None = None,
    alpha: float | None = None,
) -> dict[str, Any]:
    """Replay ``trace`` and return the result numbers (see the module docstring);
    ``policy`` / ``alpha`` override ``args.policy`` / ``args.alpha``."""
    name = policy or args.policy
    cache = budget_cache(
        one_rank_topology(),
        prof,
        args.page_size,
        args.device_bytes,
        args.host_bytes,
        args.state_share,
        make_policy(name, prof, args.alpha if alpha is None else alpha),
        args.split,
        args.write_policy,
    )
    cfg = cache.config
    internals(cache).controller.backups.value_gate = bool(getattr(args, "write_back_gate", False))
    player = Replayer(cache)
    input_tokens = reused_total = uncached = checkpoints = 0
    flops_total = 0
    tier_tokens = dict.fromkeys(TIERS, 0)
    tier_flops = dict.fromkeys(TIERS, 0)
    t0 = last = time.perf_counter()
    for i, req in enumerate(trace, start=1):
        served = player.serve(req.input_tokens, req.output_tokens)
        input_tokens += served.input_tokens
        flops_total += prof.flops(0, served.input_tokens)
        pos = 0
        for tier, n in zip(TIERS, served.reused, strict=True):
            tier_tokens[tier] += n
            tier_flops[tier] += prof.flops(pos, pos + n)
            pos += n
        reused_total += served.reused_tokens
        uncached += not served.paged
        checkpoints += served.checkpoints
        now = time.perf_counter()
        if now - last >= args.progress_s or i == len(trace):
            last = now
            print(
                f"bench_hitrate: {i}/{len(trace)} requests, hit rate "
                f"{reused_total / input_tokens:.2%}, {now - t0:.1f}s",
                file=sys.stderr,
                flush=True,
            )
    wall = time.perf_counter() - t0
    stats = cache.stats()
    cache.check_integrity()
    tree = internals(cache).tree
    pb, sb = prof.page_bytes(args.page_size), prof.state_bytes
    end_kv, end_states = tree.num_device_pages * pb, tree.num_mamba_device_slots * sb
    pools: dict[str, Any] = {
        "split": cfg_split(cfg, args),
        "page_bytes": pb,
        "state_bytes": sb,
        "device_arena_blocks": cache.device.arena.num_blocks if cache.device.arena else 0,
        "device_pages": cache.device.num_pages,
        "device_slots": cache.device.num_slots,
        "end_device_state_fraction": end_states / (end_kv + end_states) if end_kv else 0.0,
    }
    refused = internals(cache).controller.backups.refused_write_backs
    host = internals(cache).host
    if host is not None:
        pools["host_arena_blocks"] = host.arena.num_blocks if host.arena else 0
        pools["host_pages"] = host.num_pages
        pools["host_slots"] = host.num_slots
    cache.close()
    flops_saved = sum(tier_flops.values())
    return {
        "policy": name if name != "marconi" else f"marconi(alpha={alpha})",
        "token_hit_rate": reused_total / input_tokens if input_tokens else 0.0,
        "flops_saved": flops_saved,
        "flops_saved_fraction": flops_saved / flops_total if flops_total else 0.0,
        "flops_total": flops_total,
        "requests": len(trace),
        "input_tokens": input_tokens,
        "reused_tokens": reused_total,
        "uncached_requests": uncached,
        "checkpoints_inserted": checkpoints,
        "per_tier": {
            tier: {
                "reused_tokens": tier_tokens[tier],
                "token_hit_rate": tier_tokens[tier] / input_tokens if input_tokens else 0.0,
                "flops_saved": tier_flops[tier],
            }
            for tier in TIERS
        },
        "pools": pools,
        "evictions": {
            "device_pages": stats.evicted_device_pages,
            "device_slots": stats.evicted_device_slots,
            "host_pages": stats.evicted_host_pages,
            "host_slots": stats.evicted_host_slots,
            "refused_write_backs": refused,
        },
        "wall_s": wall,
    }


def cfg_split(cfg: Any, args: argparse.Namespace) -> str:
    """How the budgets were turned into tiers (``runtime.workloads.replay.budget_config``)."""
    if cfg.device_bytes:
        return "arena"
    return "share" if args.state_share is not None else "rule"


def parse_alphas(text: str) -> list[float]:
    """``"0.5,1,2"`` -> [0.5, 1.0, 2.0]; ValueError naming the text otherwise."""
    try:
        alphas = [float(a) for a in text.split(",") if a.strip()]
    except ValueError:
        raise ValueError(f"--baselines {text!r}: expected comma-separated numbers") from None
    if not alphas or min(alphas) < 0:
        raise ValueError(f"--baselines {text!r}: expected alphas >= 0")
    return alphas


def baselines(
    args: argparse.Namespace, prof: ModelProfile, trace: list[TraceRequest], alphas: list[float]
) -> dict[str, Any]:
    """LRU and Marconi at every alpha on the same trace and budgets: the headline numbers
    of each, and ``marconi_best`` (the alpha with the best hit rate, ties: more FLOPs)."""
    keys = ("token_hit_rate", "flops_saved", "uncached_requests", "wall_s")
    out: dict[str, Any] = {"lru": {k: replay(args, prof, trace, "lru")[k] for k in keys}}
    marconi = {}
    for alpha in alphas:
        r = replay(args, prof, trace, "marconi", alpha)
        marconi[str(alpha)] = {k: r[k] for k in keys}
    out["marconi"] = marconi
    best = max(marconi, key=lambda a: (marconi[a]["token_hit_rate"], marconi[a]["flops_saved"]))
    out["marconi_best"] = dict(marconi[best], alpha=float(best))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {args.page_size}")
        alphas = parse_alphas(args.baselines) if args.baselines is not None else None
        prof = model_profile(args)
        trace = list(read_jsonl(args.trace))
        if args.limit > 0:
            trace = trace[: args.limit]
        if not trace:
            raise ValueError(f"{args.trace}: no requests")
        results = replay(args, prof, trace)
        if alphas is not None:
            results["baselines"] = baselines(args, prof, trace, alphas)
    except (ValueError, OSError) as err:
        print(f"bench_hitrate: error: {err}", file=sys.stderr)
        return 2
    config = dict(vars(args), profile=prof.name)
    result = bench_common.make_result("hitrate", config, results)
    flat = {k: v for k, v in results.items() if not isinstance(v, dict)}
    for tier, values in results["per_tier"].items():
        flat[f"{tier}_token_hit_rate"] = values["token_hit_rate"]
    if "baselines" in results:
        base = results["baselines"]
        flat["lru_token_hit_rate"] = base["lru"]["token_hit_rate"]
        flat["lru_flops_saved"] = base["lru"]["flops_saved"]
        flat["marconi_best_alpha"] = base["marconi_best"]["alpha"]
        flat["marconi_best_token_hit_rate"] = base["marconi_best"]["token_hit_rate"]
        flat["marconi_best_flops_saved"] = base["marconi_best"]["flops_saved"]
    print(bench_common.key_value_table(flat))
    if args.json:
        bench_common.write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
