"""The engine side of ``runtime.server``: a request queue and, with ``--concurrency 1``,
the engine thread that serves one request at a time.

The HTTP loop never touches the model or the cache. It puts a :class:`Job` on a
:class:`RequestQueue` and awaits the job's events; one engine thread on rank 0 takes
jobs in queue order: :class:`EngineWorker` (here) runs each through ``Engine.serve``, one
at a time; ``runtime.server.batch.BatchWorker`` (``--concurrency N > 1``) serves up to N
in one running batch. The queue is an interface (``put`` / ``get`` / ``__len__``).

On a mesh, every rank must run the identical sequence of requests (the model and the
cache are collective). Rank 0 broadcasts each job's tokens over a gloo group of the
whole mesh before serving it; the other ranks run :func:`follow`, which serves what it
receives. While idle rank 0 broadcasts a heartbeat every ``heartbeat_s`` so that the
waiting ranks' collective never hits ``--collective-timeout-s``. How a request ends is
agreed the same way, through the engine's per-token hook (``Engine.serve(on_token=)``):
after every generated token rank 0 broadcasts one decision -- go on, end (the token is
the job's end-of-sequence id) or abort (the client went away) -- so all ranks stop at
the same token and release the request together, and no decode step is spent after
the end of sequence.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from runtime.engine import Engine
from runtime.launch import mesh_failure
from runtime.request_run import RequestResult, TokenHook
from runtime.sampling import Sampler, SamplingParams, TokenLogprobs
from runtime.serve.checks import pages_needed, too_long_for_l1
from runtime.server.params import StopSpec

log = logging.getLogger("runtime.server")

_SERVE, _IDLE, _STOP = "serve", "idle", "stop"

Stopper = Callable[[StopSpec], Callable[[int], bool]]
"""Makes a request's engine-side end test from its ``StopSpec``: called once per request,
the result once per generated token (True: the answer ends with this token)."""


def stop_at_ids(stop: StopSpec) -> Callable[[int], bool]:
    """The end test of a model without text: the request's stop token ids only."""
    return stop.token_ids.__contains__


def sampler_of(sampling: SamplingParams, prompt: list[int]) -> Sampler | None:
    """A request's token picker; None for plain greedy (the engine's own argmax)."""
    return None if sampling.plain else Sampler(sampling, prompt)


def token_event(token: int, sampler: Sampler | None) -> tuple[int, TokenLogprobs | None]:
    """What the HTTP side receives per token: the id and, when the request asked for
    them, its log-probabilities."""
    asked = sampler is not None and sampler.params.logprobs is not None
    return token, sampler.logprobs[-1] if asked and sampler is not None else None


# The per-token decision rank 0 broadcasts.
_GO, _END, _ABORT = 0, 1, 2


class Aborted(Exception):
    """Raised inside the engine's decode loop to leave an aborted request (the engine's
    ``finally`` releases it)."""


@dataclass(eq=False)
class Job:
    """One request on its way through the engine.

    ``events`` receives, on ``loop``, ``("token", (id, logprobs or None))`` per generated
    token, then
    ``("done", JobOutcome)`` or ``("error", message)``. Generation ends after
    ``max_new_tokens`` or where ``stop`` says (the ending token is included in the
    output; the engine side's :data:`Stopper` decides).
    ``cancel()`` may be called from any thread; a cancelled job still queued is dropped,
    a running one is aborted after the next token (batched: at the next step)."""

    prompt: list[int]
    max_new_tokens: int
    loop: asyncio.AbstractEventLoop
    stop: StopSpec = field(default_factory=StopSpec)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    events: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_s: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, kind: str, value: Any) -> None:
        """Deliver an event to the HTTP side (thread-safe)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """What a finished (or aborted) job produced."""

    output_ids: list[int]
    cached_tokens: int
    aborted: bool
    result: RequestResult | None


class RequestQueue(Protocol):
    """Where the HTTP side leaves jobs and the engine thread takes them."""

    def put(self, job: Job | None) -> None:
        """Enqueue ``job``; None asks the worker to stop after the jobs before it."""

    def get(self, timeout_s: float) -> Job | None | str:
        """The next job, None for the stop request, or ``"idle"`` after ``timeout_s``."""

    def __len__(self) -> int:
        """Jobs waiting (not counting the running one)."""


class FifoQueue:
    """First come, first served; cancelled jobs are skipped when they reach the head."""

    def __init__(self) -> None:
        self._items: collections.deque[Job | None] = collections.deque()
        self._ready = threading.Condition()

    def put(self, job: Job | None) -> None:
        with self._ready:
            self._items.append(job)
            self._ready.notify()

    def get(self, timeout_s: float) -> Job | None | str:
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while True:
                while self._items:
                    job = self._items.popleft()
                    if job is None or not job.cancelled.is_set():
                        return job
                    job.emit("error", "cancelled")
                left = deadline - time.monotonic()
                if left <= 0:
                    return _IDLE
                self._ready.wait(left)

    def __len__(self) -> int:
        with self._ready:
            return len(self._items)


class _Control:
    """Rank 0's messages to the other ranks (no-ops on one rank)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def send(self, message: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
        if self.group is None:
            assert message is not None
            return message
        box = [message]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        assert box[0] is not None
        return box[0]

    def last(self, say: Callable[[], object]) -> None:
        """Rank 0's stop message (``say``). The other ranks may have left already (a
        signal that reached them first); a stop that was asked for is not a failure
        then, so a lost peer gets one line, not the engine thread's traceback."""
        try:
            say()
        except Exception as err:
            cause = mesh_failure(err)
            if cause is None:
                raise
            log.warning("runtime.server: the stop message did not reach every rank: %s", cause)

    def agree(self, decision: int) -> int:
        """Rank 0's per-token decision, the same on every rank (``decision`` of the
        other ranks is ignored)."""
        if self.group is None:
            return decision
        flag = torch.tensor([decision], dtype=torch.int32)
        dist.broadcast(flag, group=self.group, group_src=0)
        return int(flag.item())


def token_hook(
    control: _Control,
    emit: Callable[[int], None] | None = None,
    ends: Callable[[int], bool] | None = None,
    cancelled: Callable[[], bool] = lambda: False,
) -> TokenHook:
    """The engine's per-token hook for one request: streams the token (``emit``), then
    agrees with the other ranks whether to go on, end (``ends(token)``) or abort
    (``cancelled()``; raises :class:`Aborted`). Only rank 0's view counts."""

    def on_token(token: int) -> bool:
        if emit is not None:
            emit(token)
        end = ends is not None and ends(token)
        decision = _ABORT if cancelled() else _END if end else _GO
        decision = control.agree(decision)
        if decision == _ABORT:
            raise Aborted
        return decision == _END

    return on_token


class ServerCounters:
    """Server-level counts (read by ``/metrics``; updated under a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.aborted = 0
        self.errors = 0
        self.uncached = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.integrity_errors = 0
        self.running = 0
        self.peak_running = 0
        self.warned_l1 = False

    def as_dict(self) -> dict[str, int]:
        with self.lock:
            return {k: v for k, v in vars(self).items() if k not in ("lock", "warned_l1")}


class EngineWorker(threading.Thread):
    """Rank 0's engine thread: takes jobs from ``queue`` and serves them one at a time."""

    def __init__(
        self,
        engine: Engine,
        queue: RequestQueue,
        group: dist.ProcessGroup | None,
        heartbeat_s: float,
        counters: ServerCounters,
        stopper: Stopper = stop_at_ids,
    ) -> None:
        super().__init__(name="runtime.server engine", daemon=True)
        self.engine = engine
        self.stopper = stopper
        self.queue = queue
        self.heartbeat_s = heartbeat_s
        self.counters = counters
        self.control = _Control(group)
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            while True:
                job = self.queue.get(self.heartbeat_s)
                if job is None:
                    self.control.last(lambda: self.control.send((_STOP,)))
                    return
                if isinstance(job, str):
                    if self.control.group is not None:
                        self.control.send((_IDLE,))
                    continue
                self.control.send((_SERVE, job.prompt, job.max_new_tokens, job.sampling))
                self._serve(job)
        except BaseException as err:  # a lost peer or an engine bug: the server stops
            self.failure = err
            log.exception("runtime.server: the engine thread failed")

    def _serve(self, job: Job) -> None:
        sampler = sampler_of(job.sampling, job.prompt)
        emit = lambda t: job.emit("token", token_event(t, sampler))  # noqa: E731
        hook = token_hook(self.control, emit, self.stopper(job.stop), job.cancelled.is_set)
        with self.counters.lock:
            self.counters.running += 1
            self.counters.peak_running = max(self.counters.peak_running, 1)
        try:
            outcome = serve_one(
                self.engine, job.prompt, job.max_new_tokens, self.counters, hook, sampler
            )
        except ValueError as err:
            with self.counters.lock:
                self.counters.errors += 1
            job.emit("error", str(err))
            return
        finally:
            with self.counters.lock:
                self.counters.running -= 1
        job.emit("done", outcome)


def serve_one(
    engine: Engine,
    prompt: list[int],
    max_new_tokens: int,
    counters: ServerCounters,
    on_token: TokenHook,
    sampler: Sampler | None = None,
) -> JobOutcome:
    """Run one request through ``engine`` (collective) with the per-token hook
    ``on_token``; an abort releases it, and the cache's integrity is checked after every
    abort (a failure is counted and logged). A request L1 cannot hold is served
    uncached, with one warning per server."""
    warn_if_too_long_for_l1(engine, len(prompt) + max_new_tokens, counters)
    try:
        result = engine.serve(
            prompt, max_new_tokens=max_new_tokens, on_token=on_token, sampler=sampler
        )
    except Aborted:
        outcome = JobOutcome([], 0, True, None)
        with counters.lock:
            counters.aborted += 1
        if engine.cache is not None:
            try:
                engine.cache.check_integrity()
            except RuntimeError as err:
                with counters.lock:
                    counters.integrity_errors += 1
                log.error("runtime.server: cache integrity after an abort: %s", err)
        return outcome
    with counters.lock:
        counters.requests += 1
        counters.prompt_tokens += result.prompt_len
        counters.cached_tokens += result.cached
        counters.completion_tokens += len(result.output_ids)
        counters.uncached += int(result.cached == 0)
    return JobOutcome(result.output_ids, result.cached, False, result)


def warn_if_too_long_for_l1(engine: Engine, num_tokens: int, counters: ServerCounters) -> None:
    """Warn once per server when a request of ``num_tokens`` (prompt + max_tokens) does
    not fit L1: it is served uncached."""
    cache = engine.cache
    if cache is None or not too_long_for_l1(num_tokens, cache.page_size, cache.device.max_pages):
        return
    with counters.lock:
        first = not counters.warned_l1
        counters.warned_l1 = True
    if first:
        log.warning(
            "runtime.server: warning: a request of %d tokens (prompt + max_tokens) does "
            "not fit L1 (--device-pages %d x --page-size %d): served uncached; raise "
            "--device-pages to at least %d (further ones are counted as uncached)",
            num_tokens,
            cache.device.max_pages,
            cache.page_size,
            pages_needed(num_tokens, cache.page_size),
        )


def follow(engine: Engine, group: dist.ProcessGroup) -> None:
    """The loop of every rank but 0: serve what rank 0 broadcasts until it says stop."""
    control = _Control(group)
    hook = token_hook(control)  # takes part in rank 0's per-token decision
    counters = ServerCounters()
    while True:
        message = control.send()
        if message[0] == _STOP:
            return
        if message[0] == _SERVE:
            _, prompt, max_new, sampling = message
            try:
                serve_one(engine, prompt, max_new, counters, hook, sampler_of(sampling, prompt))
            except ValueError:
                pass  # rank 0 raised the same error (replicated checks) and reported it
