"""The command-line flags of ``runtime.serve`` (shared with ``runtime.server`` and the
serving benchmarks): the parser, the ``HiCacheConfig`` the flags describe, and the checks
that reject a bad flag before any process group or work starts."""

from __future__ import annotations

import argparse
import os
import tempfile

from mesh_hicache import __version__
from mesh_hicache.choices import CpKvMode, PrefetchPolicy, StorageKind, WritePolicy
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.storage.base import load_secret
from runtime.launch import add_mesh_args, check_collective_timeout, env_storage_secret_file
from runtime.model.config import DTYPES, PRESETS
from runtime.serve.checks import default_storage_root
from runtime.workloads.generate import WORKLOADS

DESCRIPTION = (
    "Serve a workload or a prompts file with a hybrid model (preset or HF checkpoint) on HiCache."
)
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
        "--model-id",
        metavar="ID",
        default=None,
        help="with a checkpoint directory: identify its weights in the cache's storage keys "
        "by ID (e.g. a hub repo@revision) instead of hashing its files. Your responsibility: "
        "ID must change whenever the weights do, or one model reads another's cached state "
        "(docs/model_identity.md)",
    )
    p.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help="serve these requests instead of --workload (see runtime/serve/prompts.py)",
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


def add_cache_args(p: argparse.ArgumentParser, machine_sized: bool = False) -> None:
    """Pool sizes and policies (shared with ``scripts/bench_serving.py``). With
    ``machine_sized`` (``runtime.serve`` / ``runtime.server``), no size flag sizes L1 and
    L2 from the machine (``runtime.budgets``); else L1 is 64 pages by default."""
    p.add_argument(
        "--device-pages",
        type=int,
        default=None if machine_sized else 64,
        help="L1 pages per rank"
        + (
            " (default, with no --device-bytes either: sized from the machine, "
            "see docs/performance_server.md)"
            if machine_sized
            else ""
        ),
    )
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
    p.add_argument(
        "--window-checkpoint-tokens",
        type=int,
        default=2048,
        help="sliding-window models: L2 and L3 keep a windowed layer's pages only before node "
        "ends and every multiple of this many tokens (a multiple of the page size; 0: every "
        "page)",
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` only where the help text does not already say what the
    default is, and never ``(default: None)`` (a flag that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default is None:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="runtime.serve",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    add_mesh_args(p)
    add_run_args(p)
    add_cache_args(p, machine_sized=True)
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
    """The ``HiCacheConfig`` for ``--cache`` (None for ``off``). Budgets no flag gave are
    sized from this machine (``runtime.budgets``; a run agrees on them over the mesh first)."""
    if args.cache == "off":
        return None
    if args.device_pages is None:
        from runtime.budgets import Machine, size_from_machine

        args = argparse.Namespace(**vars(args))
        size_from_machine(args, Machine.detect())
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
        window_checkpoint_tokens=args.window_checkpoint_tokens,
        cp_kv=args.cp_kv,
        tenant=args.tenant,
        collective_timeout_s=args.collective_timeout_s,
    )


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


def check_size_flags(args: argparse.Namespace) -> None:
    """``ValueError`` naming the flag for the page size, the L1 page count and the
    collective timeout, checked before the model and cache configs would reject them in
    their own words."""
    check_collective_timeout(args.collective_timeout_s)
    if args.page_size < 1:
        raise ValueError(f"--page-size must be >= 1 (tokens per page), got {args.page_size}")
    pages = args.device_pages  # None: sized from the machine
    if args.cache != "off" and not args.device_bytes and pages is not None and pages < 1:
        raise ValueError(
            f"--device-pages must be >= 1 (L1 pages per rank), got {args.device_pages}; "
            "or give an L1 byte budget with --device-bytes"
        )


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
        "--window-checkpoint-tokens": (args.window_checkpoint_tokens, 0),
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
