"""Runtime-level bodies run inside the services' network namespace (in a ``NetnsWorker``).

- ``serve_cli``: ``runtime.serve.main(argv)`` in the worker process (the CLI itself,
  one rank), optionally SIGKILLing the Mooncake master after a given request;
- ``serve_mesh``: the same serving loop (model + ``HiCache`` + ``Engine``) on several
  ranks through ``tests.distributed.harness.run_on_mesh``, reporting per rank what it
  put, what it read and which of its shards' objects the store holds.

Every body limits torch to one thread: the machine has two cores and the ranks would
otherwise oversubscribe them many times over.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch

from mesh_hicache.storage.keys import StorageKey
from mesh_hicache.storage.mooncake import MooncakeStorage

SERVE_LOGGER = "runtime.serve"


class _KillAfter(logging.Handler):
    """Kills the master once ``runtime.serve`` reports ``after`` finished requests.

    ``runtime.serve`` logs ``[done/total] ...`` after every ``--log-every`` requests on
    the scheduling thread, between requests; killing there makes the outage start at a
    known point of the run ("mid-run") without any timing.
    """

    def __init__(self, pid: int, after: int, master: tuple[str, int]) -> None:
        super().__init__()
        self.pid, self.after, self.master = pid, after, master
        self.killed_at: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if self.killed_at is not None or not isinstance(args, tuple) or not args:
            return
        done = args[0]
        if not isinstance(done, int) or done < self.after:
            return
        os.kill(self.pid, signal.SIGKILL)
        # Wait (bounded) until the port refuses: the outage is real before the next request.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(self.master, timeout=0.2).close()
            except OSError:
                break
            time.sleep(0.05)
        self.killed_at = done


def serve_cli(
    argv: Sequence[str],
    json_path: str,
    kill_master_pid: int | None = None,
    kill_after: int = 1,
    master_address: str = "127.0.0.1:50051",
) -> dict[str, Any]:
    """Run ``python -m runtime.serve *argv --json json_path`` in this process; its JSON.

    With ``kill_master_pid`` the master is SIGKILLed once ``kill_after`` requests are
    done (``argv`` must then log progress: no ``--quiet``, ``--log-every 1``); the result
    gets ``killed_at`` (the request count at the kill, None if it never happened).
    """
    from runtime.serve.main import main

    torch.set_num_threads(1)
    handler = None
    logger = logging.getLogger(SERVE_LOGGER)
    if kill_master_pid is not None:
        host, _, port = master_address.rpartition(":")
        handler = _KillAfter(kill_master_pid, kill_after, (host, int(port)))
        logger.addHandler(handler)
    try:
        rc = main([*argv, "--json", json_path])
    finally:
        if handler is not None:
            logger.removeHandler(handler)
    assert rc == 0, f"runtime.serve exited with {rc}"
    with open(json_path) as f:
        out: dict[str, Any] = json.load(f)
    out["killed_at"] = handler.killed_at if handler is not None else None
    return out


def _rank_serve(mesh: Any, argv: list[str]) -> dict[str, Any]:
    """One rank of ``serve_mesh``: the ``runtime.serve`` loop, stats taken before close."""
    from mesh_hicache.cache import HiCache
    from mesh_hicache.radix import RadixKey
    from mesh_hicache.testing import internals
    from mesh_hicache.topology import MeshTopology
    from runtime.engine import Engine
    from runtime.serve.flags import build_parser, cache_config
    from runtime.serve.main import build_model, workload

    topology = MeshTopology.from_mesh(mesh)
    args = build_parser().parse_args(argv)
    model = build_model(args, topology)
    cfg = cache_config(args)
    assert cfg is not None and cfg.storage == "mooncake", "serve_mesh needs --cache full"
    cache = HiCache(topology, model.config.state_spec(args.page_size), cfg)
    trace = workload(args, model.config.vocab_size)
    engine = Engine(model, cache, max_new_tokens=args.max_new_tokens)
    try:
        results = engine.run(trace)
        cache.flush()  # every backup written on every rank before we look at the store
        inner = internals(cache)
        guard = inner.storage
        assert guard is not None
        backend = getattr(guard, "backend", None)
        assert isinstance(backend, MooncakeStorage), f"not a Mooncake backend: {backend!r}"
        # The key listing: every page of every session's full history (prompt + output),
        # for each of this rank's regions; which of those objects does the store hold?
        hashes: set[bytes] = set()
        for history in engine.histories.values():
            hashes.update(RadixKey(tuple(history)).page_hashes(args.page_size))
        regions = {}
        for region in inner.layout.regions:
            if not region.local_layer_ids:
                continue
            keys = [
                StorageKey(inner.namespace, region.name.value, h, region.global_slice)
                for h in sorted(hashes)
            ]
            regions[region.name.value] = {
                "tag": region.global_slice.tag(),
                "writer": region.is_writer,
                "stored": sum(backend.exists_one(k) for k in keys),
            }
        s = backend.stats
        stats = cache.stats()
        return {
            "coords": topology.coords,
            "regions": regions,
            "puts": s.puts,
            "put_attempts": s.puts + s.already_present + s.dropped,
            "storage_put_objects": stats.storage_put_objects,
            "get_hits": s.get_hits,
            "hit_tokens_storage": stats.hit_tokens_storage,
            "storage_resharded_tokens": stats.storage_resharded_tokens,
            "bytes_storage_to_host": stats.bytes_storage_to_host,
            "storage_put_dropped": stats.storage_put_dropped,
            "degraded": stats.storage_degraded,
            "outputs": [r.output_ids for r in results],
            "cached_storage": [r.cached_storage for r in results],
        }
    finally:
        cache.close()


def serve_mesh(
    shape: tuple[int, int, int], argv: Sequence[str], timeout: float = 120.0
) -> list[dict[str, Any]]:
    """``_rank_serve`` on a fresh ``(pp, cp, tp)`` mesh of new processes; results by rank."""
    from tests.distributed import harness
    from tests.distributed.harness import run_on_mesh

    # The rank processes fork from the harness's forkserver: preloading the runtime and
    # Mooncake there saves each of the 4 ranks ~2 s of imports per mesh (2 cores).
    harness.preload("runtime.serve", "mesh_hicache.cache", "mooncake.store", __name__)
    pp, cp, tp = shape
    full = [*argv, "--pp", str(pp), "--cp", str(cp), "--tp", str(tp)]
    return run_on_mesh(shape, _rank_serve, full, timeout=timeout)
