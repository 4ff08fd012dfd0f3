"""The connector's counters, written as JSON for tests, benchmarks and operators."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass


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
