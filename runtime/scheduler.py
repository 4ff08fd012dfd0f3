"""Continuous batching over the cache: a waiting queue and a running batch.

Each :meth:`Scheduler.run` loop iteration is one *step*, the same on every rank:

1. agree the clock and the L3 prefetches' progress (one small MIN reduction over the
   mesh, only when a decision needs it: ``realtime``, or a prefetch in flight);
2. arrivals join the waiting queue (a session's next turn only after its previous
   answer, ``think_s`` later when realtime); the oldest are admitted (matched: the L3
   prefetch starts) while fewer than ``max_running`` are admitted;
3. ``load`` the matched requests whose prefetch policy allows it: ``best_effort`` one
   step after its match (the prefetch ran beside that step's compute), ``wait_complete``
   once every rank's prefetch finished, ``timeout`` then or at its deadline (base + per
   1k tokens, from its first agreed step); any of them at once when nothing else can run;
4. ``finish_load`` the requests loaded a step earlier, so the host -> device copies ran
   beside a step of the batch's compute (at once when there is nothing to overlap);
5. pages for the loaded requests, oldest first; on ``CacheFull`` a request waits while
   another one runs (it will release its prefix and pages), else it is served uncached:
   L1 full of locked prefixes cannot deadlock;
6. chunked prefill under ``token_budget`` (oldest first; chunks also end at the Mamba
   checkpoint stops), then one ``decode_batch`` for every request past its prefill;
7. finished requests insert, release and report; ``cache.step()`` consumes finished
   backups (write-through copies and L3 writes run in the background meanwhile).

Every decision derives from the trace, agreed cache results (match hits, allocations,
``finish_load``) and the agreed values of step 1, so the mesh stays in lockstep. The
per-request logic is ``runtime.request_run.RequestRun``, the same as the sequential engine's.

Online use (``runtime.server``): :meth:`Scheduler.open`, then per step any number of
:meth:`Scheduler.submit` (an :class:`OnlineRequest`: a ready run and what to call when it
ends) and :meth:`Scheduler.cancel`, then :meth:`Scheduler.step` while not
:attr:`Scheduler.idle`; :meth:`Scheduler.close` at the end. Submitted requests join the
waiting queue behind what is already there and share the steps above with trace turns;
the caller keeps the mesh in lockstep by making the same calls in the same order on
every rank. :meth:`Scheduler.run` is ``open`` + the trace as the source + ``close``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mesh_hicache.cache import HiCache
from mesh_hicache.choices import PrefetchPolicy
from runtime.engine import Engine
from runtime.model import HybridModel
from runtime.request_run import RequestResult, RequestRun
from runtime.workloads.generate import Turn


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


MATCHED, LOADING, LOADED, RUNNING = "matched", "loading", "loaded", "running"


@dataclass(frozen=True, slots=True)
class OnlineRequest:
    """A request handed to a running scheduler (:meth:`Scheduler.submit`)."""

    key: int
    """The caller's id of the request (for :meth:`Scheduler.cancel`); unique among the
    requests in flight."""
    run: RequestRun
    """Its run, not matched yet (``Engine``'s ``RequestRun(...)``; ``on_token`` must
    decide the same on every rank)."""
    on_finish: Callable[[RequestResult], None]
    """Called with its result after it was inserted and released (``request_id`` is
    ``key``); not called for a cancelled request."""


@dataclass(slots=True)
class _Waiting:
    """A request in the waiting queue: a trace turn or an online request."""

    arrival: float
    order: int
    """Ties between equal arrivals: the trace's request_id, or the submission count."""
    turn: Turn | None = None
    online: OnlineRequest | None = None


@dataclass(slots=True)
class _Active:
    """An admitted request: its run and where it is."""

    turn: Turn | None
    online: OnlineRequest | None
    run: RequestRun
    arrival_s: float
    phase: str
    step: int
    """The step of its last phase change."""
    deadline: float | None = None
    """``timeout`` policy: agreed trace seconds after which it loads what arrived."""


class Scheduler:
    """Serves a trace with up to ``config.max_running`` requests in flight (see the
    module docstring). Collective: every rank runs the same trace."""

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
        self.model = model
        self.cache = cache
        self.engine = Engine(model, cache, max_new_tokens=max_new_tokens, keep_logits=keep_logits)
        self.policy = PrefetchPolicy(cache.config.prefetch_policy) if cache else None
        #: Of the last ``run`` (tests read them): steps, agreement collectives, times a
        #: request waited for pages, requests served uncached (CacheFull with none running).
        self.num_steps = self.num_agreements = self.num_waits = self.num_uncached = 0

    # -- the loop -----------------------------------------------------------------------------

    def run(
        self, trace: Sequence[Turn], progress: Callable[[RequestResult], None] | None = None
    ) -> list[RequestResult]:
        """Serve ``trace``; results in trace order (request_id order). Each turn's prompt
        is its session's history + its user tokens, so a session's turns run in order."""
        self.open(progress)
        for turn in trace:
            self._sessions.setdefault(turn.session, deque()).append(turn)
        for queue in self._sessions.values():
            self._released.append((None, queue.popleft()))
        try:
            while not self.idle:
                self.step()
        finally:
            self.close()
        return [self._results[t.request_id] for t in trace]

    def open(self, progress: Callable[[RequestResult], None] | None = None) -> None:
        """Start serving: empty queues, the clock and the counters from zero. ``progress``
        is called with each finished trace turn's result."""
        self._t0 = time.perf_counter()
        self._sessions: dict[int, deque[Turn]] = {}
        # Available turns (their session's previous turn finished): (arrival_s, turn).
        self._pending: list[tuple[float, Turn]] = []
        self._released: list[tuple[float | None, Turn]] = []
        self._waiting: list[_Waiting] = []
        self._active: list[_Active] = []
        self._results: dict[int, RequestResult] = {}
        self._progress = progress
        self._num_submitted = 0
        self.num_steps = self.num_agreements = self.num_waits = self.num_uncached = 0

    def close(self) -> None:
        """Release every admitted request (idempotent; also after an error)."""
        for a in self._active:
            a.run.release()
        self._active = []

    @property
    def idle(self) -> bool:
        """Nothing to serve: no request released, pending, waiting or admitted."""
        return not (self._released or self._pending or self._waiting or self._active)

    @property
    def num_in_flight(self) -> int:
        """Requests waiting or admitted (not counting trace turns not yet arrived)."""
        return len(self._waiting) + len(self._active)

    @property
    def num_running(self) -> int:
        """Admitted requests (matched, holding or about to hold pages)."""
        return len(self._active)

    def submit(self, request: OnlineRequest) -> None:
        """Queue ``request`` behind the waiting ones; admitted by the next :meth:`step`
        when fewer than ``max_running`` are admitted. Collective in effect: call it in the
        same order on every rank. Its arrival (reports, and the order among trace turns
        that arrive later) is this rank's clock: on a mesh, do not mix online requests
        with a trace, whose arrivals re-sort the queue."""
        self._num_submitted += 1
        self._waiting.append(_Waiting(self._clock(), self._num_submitted, online=request))

    def cancel(self, key: int) -> bool:
        """Drop the online request ``key``: out of the waiting queue, or released if
        admitted (collective: every rank cancels the same requests between the same
        steps). False when no such request is in flight."""
        for w in self._waiting:
            if w.online is not None and w.online.key == key:
                self._waiting.remove(w)
                return True
        for a in self._active:
            if a.online is not None and a.online.key == key:
                self._active.remove(a)
                a.run.release()
                return True
        return False

    @property
    def transfers_in_flight(self) -> bool:
        """An admitted request may have an L3 prefetch or a host -> device load in flight
        (matched or loading): the host pools hold reservations until it is loaded."""
        return any(a.phase in (MATCHED, LOADING) for a in self._active)

    def _clock(self) -> float:
        return time.perf_counter() - self._t0

    def step(self) -> None:
        """One step of the module docstring (collective)."""
        self.num_steps += 1
        step = self.num_steps
        now, prefetched = self._agree(step)
        self._arrive(now)
        self._admit(step)
        busy = any(a.phase != MATCHED for a in self._active)
        for a in [a for a in self._active if a.phase == MATCHED and a.step < step]:
            if self._may_load(a, now, prefetched, busy):
                a.run.load()
                a.phase, a.step = LOADING, step
        for a in [a for a in self._active if a.phase == LOADING]:
            if a.step < step or not busy or not a.run.has_host_part:
                a.run.finish_load()
                a.phase, a.step = LOADED, step
        for a in [a for a in self._active if a.phase == LOADED]:
            others_run = any(b.phase == RUNNING for b in self._active if b is not a)
            if not a.run.alloc(wait=others_run):
                self.num_waits += 1
                continue
            a.phase, a.step = RUNNING, step
            self.num_uncached += self.cache is not None and a.run.pages is None
        self._compute()
        for a in [a for a in self._active if a.run.done]:
            self._finish(a)
        if self.cache is not None:
            self.cache.step()
        if not self._active and not self._waiting and self._pending and self.config.realtime:
            nxt = min(arrival for arrival, _ in self._pending)
            time.sleep(max(0.0, nxt - now))

    # -- agreement, arrivals, admission -------------------------------------------------------

    def _agree(self, step: int) -> tuple[float, dict[int, bool]]:
        """The trace clock and, per matched request with an L3 prefetch, whether it
        finished on every rank: one MIN reduction over the mesh when a decision needs it
        (realtime arrivals, a prefetch policy); else the local clock (reports only)."""
        waiting = [a for a in self._active if a.phase == MATCHED and a.run.has_storage_hit]
        waiting = [a for a in waiting if a.step < step]
        local = self._clock()
        if not self.config.realtime and not waiting:
            return local, {}
        values = [-int(local * 1e6)] + [int(a.run.prefetch_done) for a in waiting]
        agreed = self._min_over_mesh(values)
        self.num_agreements += 1
        now = -agreed[0] / 1e6
        return now, {id(a): bool(v) for a, v in zip(waiting, agreed[1:], strict=True)}

    def _min_over_mesh(self, values: list[int]) -> list[int]:
        # The model's three axis groups span the mesh (tp, then cp, then pp): an
        # element-wise MIN over each in turn is the MIN over every rank. Works without a
        # cache; a one-rank axis costs nothing.
        comms = self.model.comms
        buf = torch.tensor(values, dtype=torch.int64, device=self.model.device)
        for axis in (comms.tp, comms.cp, comms.pp):
            buf = axis.all_reduce(buf, op=dist.ReduceOp.MIN)
        return [int(v) for v in buf.tolist()]

    def _arrive(self, now: float) -> None:
        for after, turn in self._released:
            arrival = turn.arrival_s or 0.0
            if after is None and not self.config.realtime:
                arrival = now
            elif after is not None:
                # Released by its previous turn's answer: the first agreed clock after it.
                arrival = max(arrival, now + turn.think_s) if self.config.realtime else now
            self._pending.append((arrival, turn))
        self._released = []
        due: list[tuple[float, Turn]] = []
        later: list[tuple[float, Turn]] = []
        for p in self._pending:
            (due if not self.config.realtime or p[0] <= now else later).append(p)
        if due:
            self._pending = later
            self._waiting.extend(_Waiting(arrival, t.request_id, turn=t) for arrival, t in due)
            self._waiting.sort(key=lambda w: (w.arrival, w.order))

    def _admit(self, step: int) -> None:
        while self._waiting and len(self._active) < self.config.max_running:
            w = self._waiting.pop(0)
            if w.online is not None:
                run = w.online.run
            else:
                assert w.turn is not None
                run = self.engine.start(w.turn)
            self._active.append(_Active(w.turn, w.online, run, w.arrival, MATCHED, step))
            run.match()
            if not run.has_storage_hit:
                # Nothing to prefetch: it may load in this very step.
                self._active[-1].step = step - 1

    def _may_load(self, a: _Active, now: float, prefetched: dict[int, bool], busy: bool) -> bool:
        if not a.run.has_storage_hit or not busy:
            return True  # nothing to wait for, or nothing else to do than wait in load
        if self.policy is PrefetchPolicy.BEST_EFFORT:
            return True
        if prefetched[id(a)]:
            return True
        if self.policy is PrefetchPolicy.TIMEOUT:
            if a.deadline is None:
                assert self.cache is not None and a.run.req is not None
                cfg = self.cache.config
                tokens = a.run.req.hit.storage_tokens
                budget = cfg.prefetch_timeout_base_s + cfg.prefetch_timeout_per_1k_s * tokens / 1e3
                a.deadline = now + budget
            return now >= a.deadline
        return False

    # -- compute and finish -------------------------------------------------------------------

    def _compute(self) -> None:
        budget = self.config.token_budget
        running = [a.run for a in self._active if a.phase == RUNNING]
        for run in running:
            while budget > 0 and not run.prefilled:
                budget -= run.prefill_chunk(budget)
        batch = [r for r in running if r.next_token is not None]
        if batch:
            tokens, states = [], []
            for r in batch:
                assert r.next_token is not None and r.state is not None
                tokens.append(r.next_token)
                states.append(r.state)
            logits = self.model.decode_batch(tokens, states)
            for i, r in enumerate(batch):
                r.decoded(logits[i])

    def _finish(self, a: _Active) -> None:
        self._active.remove(a)
        try:
            if a.turn is not None:
                result = self.engine.finish(a.turn, a.run)
            else:
                assert a.online is not None
                result = a.run.finish()
                result.request_id = a.online.key
        finally:
            a.run.release()
        result.arrival_s = a.arrival_s
        result.first_token_s = a.run.t_first - self._t0
        result.finish_s = self._clock()
        result.ttft_s = result.first_token_s - result.arrival_s
        result.decode_s = result.finish_s - result.first_token_s
        if a.online is not None:
            a.online.on_finish(result)
            return
        assert a.turn is not None
        self._results[a.turn.request_id] = result
        queue = self._sessions[a.turn.session]
        if queue:
            self._released.append((result.finish_s, queue.popleft()))
        if self._progress is not None:
            self._progress(result)
