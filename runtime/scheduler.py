"""Continuous batching over the cache (issue 14): a waiting queue and a running batch.

First version: admits one request at a time (the sequential engine), with the final API.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mesh_hicache.cache import HiCache
from runtime.engine import Engine, RequestResult, stop_at
from runtime.model import HybridModel
from runtime.workloads import Turn


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How the scheduler batches (``runtime.serve --concurrency / --token-budget``)."""

    max_running: int = 8
    """Most requests admitted at once (matched in the cache, holding pages)."""
    token_budget: int = 256
    """Prefill tokens computed per step, besides the batched decode of running requests."""
    realtime: bool = False
    """True: honour ``Turn.arrival_s`` / ``think_s`` against the wall clock (agreed over the
    mesh); False: every request is available as soon as its session's previous turn ended."""

    def __post_init__(self) -> None:
        for name in ("max_running", "token_budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class Scheduler:
    """Serves a trace with up to ``config.max_running`` requests in flight."""

    def __init__(
        self,
        model: HybridModel,
        cache: HiCache | None,
        config: SchedulerConfig,
        *,
        max_new_tokens: int = 8,
        keep_logits: bool = False,
    ) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.engine = Engine(model, cache, max_new_tokens=max_new_tokens, keep_logits=keep_logits)

    def run(
        self, trace: Sequence[Turn], progress: Callable[[RequestResult], None] | None = None
    ) -> list[RequestResult]:
        """Serve ``trace``; results in trace order (request_id order)."""
        t0 = time.perf_counter()
        results = []
        for turn in trace:
            arrival = time.perf_counter() - t0
            prompt = self.engine.histories.get(turn.session, []) + list(turn.user_tokens)
            result = self.engine.serve(
                prompt,
                turn.namespace,
                max_new_tokens=turn.max_new_tokens,
                tenant=turn.tenant,
                on_token=None if turn.stop_token is None else stop_at(turn.stop_token),
            )
            result.request_id, result.session, result.turn = (
                turn.request_id,
                turn.session,
                turn.turn,
            )
            result.arrival_s = arrival
            result.first_token_s = arrival + result.ttft_s
            result.finish_s = result.first_token_s + result.decode_s
            self.engine.histories[turn.session] = prompt + result.output_ids
            results.append(result)
            if progress is not None:
                progress(result)
        return results
