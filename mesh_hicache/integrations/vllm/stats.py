"""The connector's counters, written as JSON for tests, benchmarks and operators."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerCounters:
    """Prompt tokens by where they came from (scheduler side, one engine)."""

    requests: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    """vLLM's own prefix cache."""
    l2_hit_tokens: int = 0
    l3_hit_tokens: int = 0
    unsupported_requests: int = 0
    """Requests of a model with a KV cache group the connector cannot restore (no hit)."""
    saved_pages: int = 0
    """Pages whose KV groups were saved."""
    saved_states: int = 0
    """Page-end states (every state group of a hybrid) saved from vLLM's hand-offs."""
    prefetched_pages: int = 0
    prefetch_failed_pages: int = 0
    """Pages an L3 read could not deliver (missing, corrupt, forged): recomputed."""
    l2_evicted_pages: int = 0


@dataclass(slots=True)
class WorkerCounters:
    """Copies and storage traffic of one worker."""

    saved_pages: int = 0
    saved_states: int = 0
    loaded_pages: int = 0
    l3_put_objects: int = 0
    l3_put_failed: int = 0
    l3_get_objects: int = 0
    l3_get_failed: int = 0
    host_pages: int = 0


def write_json(path: str | None, payload: dict) -> None:
    """Atomically replace ``path`` with ``payload`` as JSON (no-op without a path)."""
    if not path:
        return
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, sort_keys=True)
    os.replace(tmp, path)


def as_dict(counters: SchedulerCounters | WorkerCounters) -> dict:
    return asdict(counters)


class StatsWriter:
    """Writes ``payload()`` to ``path`` off the caller's thread, coalesced: ``request`` is
    cheap (called on vLLM's step path as often as counters change); the file is
    rewritten at most once per ``delay_s`` after a request, with the counters of that
    moment. Replacing the file costs milliseconds, which per scheduler call or per step
    would be a share of a small model's step. ``close`` writes once more, synchronously.
    Without a path every call is a no-op."""

    def __init__(self, path: str | None, payload: Callable[[], dict], delay_s: float = 0.2) -> None:
        self.path = path
        self._payload = payload
        self._delay_s = delay_s
        self._queued = False
        self._lock = threading.Lock()
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="mhc-stats") if path else None
        )

    def request(self) -> None:
        if self._pool is None:
            return
        with self._lock:
            if self._queued:
                return
            self._queued = True
        self._pool.submit(self._write, self._delay_s)

    def _write(self, delay_s: float) -> None:
        if delay_s:
            time.sleep(delay_s)
        with self._lock:
            self._queued = False
        try:
            write_json(self.path, self._payload())
        except OSError as err:  # statistics never stop serving
            logger.warning("cannot write connector stats: %s", err)

    def close(self) -> None:
        if self._pool is None:
            return
        self._pool.shutdown(wait=True)
        self._pool = None
        self._write(0.0)
