"""``runtime.server --concurrency N > 1``: concurrent requests served in one running batch
by ``runtime.scheduler.Scheduler`` (its online entry point), in lockstep over the mesh.

Every rank owns a :class:`BatchRun` (a scheduler opened for online requests) and runs
the same loop; one iteration is:

1. rank 0 decides what changes before the step: the jobs that join (taken from the
   :class:`~runtime.server.worker.RequestQueue`, at most ``max_running`` in flight) and
   the running or waiting jobs to abort (their client went away);
2. one int32 broadcast of rank 0's flag (nothing new / news / stop), and only with news
   one ``broadcast_object_list`` of ``(new jobs, aborted keys)``; every rank applies them
   in the same order (``Scheduler.submit`` / ``Scheduler.cancel``);
3. every rank runs ``Scheduler.step`` when anything is in flight.

So each rank runs the identical sequence of steps, and the collectives (the flag every
iteration, the message when the flag says so) are the same on every rank. While nothing
is in flight rank 0 waits for a job at most ``heartbeat_s`` before it sends the flag
anyway: the heartbeat that keeps the other ranks' collective within
``--collective-timeout-s``. A request ends at ``max_tokens`` or where its ``StopSpec`` says,
decided by every rank from its own token (equal on every rank: identical logits, and
a sampled request's seed travels with it; stop strings are decoded on every rank
alike); rank 0's hook also streams each token (and its log-probabilities) to the job.
An aborted job is released at once and the cache's ``check_integrity()`` runs as soon
as no other request has a transfer in flight (a prefetch or load holds host
reservations).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from runtime.engine import Engine
from runtime.request_run import RequestResult, RequestRun, TokenHook
from runtime.sampling import Sampler, SamplingParams
from runtime.scheduler import OnlineRequest, Scheduler, SchedulerConfig
from runtime.server.params import StopSpec
from runtime.server.worker import (
    Job,
    JobOutcome,
    RequestQueue,
    ServerCounters,
    Stopper,
    _Control,
    sampler_of,
    stop_at_ids,
    token_event,
    warn_if_too_long_for_l1,
)

log = logging.getLogger("runtime.server")

# Rank 0's flag of one iteration.
_QUIET, _NEWS, _STOP = 0, 1, 2

NewJob = tuple[int, list[int], int, StopSpec, SamplingParams]
"""What the other ranks learn of a joining job: (key, prompt, max_new_tokens, stop,
sampling)."""


class BatchRun:
    """One rank's scheduler for online requests and the server counters it keeps.

    ``apply`` and ``advance`` are collective: call them with the same arguments in the
    same order on every rank. ``jobs`` (rank 0) are the in-flight jobs by key, which get
    the tokens and the outcome; on the other ranks it stays empty."""

    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig,
        counters: ServerCounters,
        stopper: Stopper = stop_at_ids,
    ) -> None:
        self.stopper = stopper
        self.scheduler = Scheduler(
            engine.model, engine.cache, config, max_new_tokens=engine.max_new_tokens
        )
        self.scheduler.engine.paged = engine.paged
        self.scheduler.open()
        self.cache = engine.cache
        self.counters = counters
        self.jobs: dict[int, Job] = {}
        self._check_pending = False
        self._outbox: list[tuple[Job, str, Any]] = []

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    def apply(self, new: list[NewJob], aborted: list[int]) -> None:
        """Abort ``aborted`` (keys in flight), then queue ``new`` in order."""
        for key in aborted:
            found = self.scheduler.cancel(key)
            assert found, f"abort of job {key}, which is not in flight"
            job = self.jobs.pop(key, None)
            with self.counters.lock:
                self.counters.aborted += 1
            if job is not None:
                self._emit(job, "done", JobOutcome([], 0, True, None))
            self._check_pending = self.cache is not None
        for key, prompt, max_new, stop, sampling in new:
            self._submit(key, prompt, max_new, stop, sampling)
        self._count()
        self.flush()

    def _submit(
        self, key: int, prompt: list[int], max_new: int, stop: StopSpec, sampling: SamplingParams
    ) -> None:
        job = self.jobs.get(key)
        engine = self.scheduler.engine
        try:
            # The same hook on every rank (only rank 0 has a job to stream to): checkpoint
            # placement depends on whether a request has one. Every rank samples alike
            # (identical logits, the same seed).
            sampler = sampler_of(sampling, prompt)
            hook = self._hook(job, self.stopper(stop), sampler)
            run = RequestRun(engine, prompt, "", None, max_new, hook, sampler)
        except ValueError as err:  # the same on every rank (replicated checks)
            self.jobs.pop(key, None)
            with self.counters.lock:
                self.counters.errors += 1
            if job is not None:
                self._emit(job, "error", str(err))
            return
        if job is not None:
            warn_if_too_long_for_l1(engine, len(prompt) + max_new, self.counters)
        self.scheduler.submit(OnlineRequest(key, run, lambda result: self._finished(key, result)))

    def _hook(
        self, job: Job | None, ends: Callable[[int], bool], sampler: Sampler | None
    ) -> TokenHook:
        def on_token(token: int) -> bool:
            if job is not None:
                self._emit(job, "token", token_event(token, sampler))
            return ends(token)

        return on_token

    def _finished(self, key: int, result: RequestResult) -> None:
        with self.counters.lock:
            self.counters.requests += 1
            self.counters.prompt_tokens += result.prompt_len
            self.counters.cached_tokens += result.cached
            self.counters.completion_tokens += len(result.output_ids)
            self.counters.uncached += int(result.cached == 0)
        job = self.jobs.pop(key, None)
        if job is not None:
            self._emit(job, "done", JobOutcome(result.output_ids, result.cached, False, result))

    def _emit(self, job: Job, kind: str, value: Any) -> None:
        # Held until flush(): one wake-up of each HTTP loop per step, not one per token
        # (each call_soon_threadsafe writes to the loop's self-pipe).
        self._outbox.append((job, kind, value))

    def flush(self) -> None:
        """Deliver the events held since the last flush, in order, one hand-off per loop."""
        if not self._outbox:
            return
        by_loop: dict[Any, list[tuple[Job, str, Any]]] = {}
        for item in self._outbox:
            by_loop.setdefault(item[0].loop, []).append(item)
        self._outbox = []
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    def advance(self) -> None:
        """One scheduler step when anything is in flight; the integrity check owed to
        an abort once no transfer holds host reservations."""
        if not self.scheduler.idle:
            try:
                self.scheduler.step()
            finally:
                self.flush()
        self._count()
        if self._check_pending and not self.scheduler.transfers_in_flight:
            self._check_pending = False
            assert self.cache is not None
            try:
                self.cache.check_integrity()
            except RuntimeError as err:
                with self.counters.lock:
                    self.counters.integrity_errors += 1
                log.error("runtime.server: cache integrity after an abort: %s", err)

    def _count(self) -> None:
        with self.counters.lock:
            self.counters.running = self.scheduler.num_in_flight
            self.counters.peak_running = max(self.counters.peak_running, self.scheduler.num_running)


def _deliver(items: list[tuple[Job, str, Any]]) -> None:
    # On the HTTP loop: what Job.emit would have put on each job's queue.
    for job, kind, value in items:
        job.events.put_nowait((kind, value))


class BatchWorker(threading.Thread):
    """Rank 0's engine thread with ``--concurrency N > 1``: the loop of the module
    docstring. ``failure`` is set when it died (a lost peer, an engine bug)."""

    def __init__(
        self,
        engine: Engine,
        queue: RequestQueue,
        group: dist.ProcessGroup | None,
        heartbeat_s: float,
        counters: ServerCounters,
        config: SchedulerConfig,
        stopper: Stopper = stop_at_ids,
    ) -> None:
        super().__init__(name="runtime.server engine", daemon=True)
        self.queue = queue
        self.heartbeat_s = heartbeat_s
        self.config = config
        self.control = _Control(group)
        self.batch = BatchRun(engine, config, counters, stopper)
        self.failure: BaseException | None = None
        self._next_key = 0
        self._stopping = False

    @property
    def jobs(self) -> dict[int, Job]:
        """Jobs taken from the queue and not finished (by key)."""
        return self.batch.jobs

    def run(self) -> None:
        try:
            while True:
                aborted = [key for key, job in self.jobs.items() if job.cancelled.is_set()]
                new = self._take(aborted)
                if self._stopping and not new and not aborted and self.batch.idle:
                    self.control.last(lambda: self.control.agree(_STOP))
                    return
                if new or aborted:
                    self.control.agree(_NEWS)
                    self.control.send((new, aborted))
                    self.batch.apply(new, aborted)
                else:
                    self.control.agree(_QUIET)
                self.batch.advance()
        except BaseException as err:  # a lost peer or an engine bug: the server stops
            self.failure = err
            log.exception("runtime.server: the engine thread failed")
            self.batch.flush()
            for job in list(self.jobs.values()):
                job.emit("error", "the engine has stopped")
            self.jobs.clear()

    def _take(self, aborted: list[int]) -> list[NewJob]:
        """Jobs from the queue while fewer than ``max_running`` are in flight; waits up
        to a heartbeat for the first one when nothing is in flight."""
        new: list[NewJob] = []
        in_flight = self.batch.scheduler.num_in_flight - len(aborted)
        while not self._stopping and in_flight + len(new) < self.config.max_running:
            wait = self.heartbeat_s if in_flight + len(new) == 0 else 0.0
            item = self.queue.get(wait)
            if item is None:
                self._stopping = True
            elif isinstance(item, str):
                break
            else:
                key = self._next_key
                self._next_key += 1
                self.jobs[key] = item
                new.append((key, item.prompt, item.max_new_tokens, item.stop, item.sampling))
        return new


def follow_batched(
    engine: Engine,
    group: dist.ProcessGroup,
    config: SchedulerConfig,
    stopper: Stopper = stop_at_ids,
) -> None:
    """The loop of every rank but 0 with ``--concurrency N > 1``: apply rank 0's news
    and step, until it says stop."""
    control = _Control(group)
    batch = BatchRun(engine, config, ServerCounters(), stopper)
    while True:
        flag = control.agree(_QUIET)
        if flag == _STOP:
            return
        if flag == _NEWS:
            message: tuple[Any, ...] = control.send()
            new, aborted = message
            batch.apply(new, aborted)
        batch.advance()
