"""The serving engine: match -> load -> prefill the suffix -> insert -> decode -> insert.

One request's path is a :class:`RequestRun` driven step by step: ``Engine.serve`` runs
one request at a time through it (the sequential reference), ``runtime.scheduler`` runs
many at once (chunked prefill beside batched decode). Every rank of the mesh drives the
same requests through the same steps in the same order: the model and the cache are
collective.

Per-token hook: ``serve(..., on_token=f)`` calls ``f(token_id)`` after each generated
token; a true result ends the request after that token (e.g. at end of sequence), and an
exception leaves it (the request is released). On a mesh ``f`` must decide the same on
every rank (the caller agrees on it, e.g. by a broadcast from rank 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mesh_hicache.cache import HiCache
from runtime.model import HybridModel
from runtime.request_run import RequestResult, RequestRun, TokenHook, stop_at
from runtime.sampling import Sampler
from runtime.workloads.generate import Turn


@dataclass(slots=True)
class Engine:
    """Runs requests through ``model`` with ``cache`` (None = recompute everything), one
    at a time: the sequential reference of ``runtime.scheduler``."""

    model: HybridModel
    cache: HiCache | None
    max_new_tokens: int = 8
    keep_logits: bool = False
    histories: dict[int, list[int]] = field(default_factory=dict)
    paged: bool = True
    """Run requests that hold device pages on paged states (``HybridModel.paged_state``)
    where the model has them; False: always a contiguous copy (the old path, for A/B)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def start(self, turn: Turn) -> RequestRun:
        """The run of ``turn`` (nothing matched yet): its prompt is its session's history +
        its user tokens; a ``stop_token`` (or any of ``stop_tokens``) ends it after that
        token."""
        prompt = self.histories.get(turn.session, []) + list(turn.user_tokens)
        stops = set(turn.stop_tokens)
        if turn.stop_token is not None:
            stops.add(turn.stop_token)
        hook = stop_at(*stops) if stops else None
        num_new = self.max_new_tokens if turn.max_new_tokens is None else turn.max_new_tokens
        return RequestRun(self, prompt, turn.namespace, turn.tenant, num_new, hook)

    def finish(self, turn: Turn, run: RequestRun) -> RequestResult:
        """``run.finish()`` labelled with ``turn``; the session's history grows by its answer."""
        result = run.finish()
        result.request_id, result.session, result.turn = turn.request_id, turn.session, turn.turn
        self.histories[turn.session] = run.prompt + result.output_ids
        return result

    def run(
        self, trace: Sequence[Turn], progress: Callable[[RequestResult], None] | None = None
    ) -> list[RequestResult]:
        """Serve a whole trace; each turn's prompt is its session's history + user tokens.
        A turn with a ``stop_token`` ends after it (every rank sees the same greedy
        tokens, so every rank stops at the same one)."""
        t0 = time.perf_counter()
        results = []
        for turn in trace:
            run = self.start(turn)
            arrival = time.perf_counter() - t0
            try:
                self._drive(run)
                result = self.finish(turn, run)
            finally:
                run.release()
            result.arrival_s = arrival
            result.first_token_s = run.t_first - t0
            result.finish_s = time.perf_counter() - t0
            results.append(result)
            if progress is not None:
                progress(result)
        return results

    def serve(
        self,
        prompt: Sequence[int],
        namespace: str = "",
        *,
        max_new_tokens: int | None = None,
        tenant: str | None = None,
        on_token: TokenHook | None = None,
        sampler: Sampler | None = None,
    ) -> RequestResult:
        """Generate (greedy unless ``sampler``) up to ``max_new_tokens`` (default: the
        engine's) after ``prompt`` (at least 1 token). Without ``on_token`` exactly that
        many tokens; with it, ``on_token(id)`` is called after each generated token and a
        true result stops there (that token is the last of ``output_ids``; no decode step
        is spent after it). ``tenant``: the request's cache tenant (None: the cache's; see
        ``HiCache.match``). ``sampler``: picks the tokens instead of the greedy argmax
        (``runtime.sampling``)."""
        num_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        run = RequestRun(self, prompt, namespace, tenant, num_new, on_token, sampler)
        try:
            self._drive(run)
            return run.finish()
        finally:
            run.release()

    def _drive(self, run: RequestRun) -> None:
        run.match()
        run.load()
        run.finish_load()
        run.alloc(wait=False)
        while not run.prefilled:
            run.prefill_chunk()
        while not run.done:
            assert run.state is not None and run.next_token is not None
            run.decoded(self.model.decode(run.next_token, run.state))
