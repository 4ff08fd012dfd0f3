"""An OpenAI-compatible HTTP server over the engine and HiCache (aiohttp).

    python -m runtime.server --model DIR --port 8000              # one rank
    torchrun --standalone --nproc-per-node 4 -m runtime.server --model DIR --cp 2 --tp 2

Endpoints, on ``--host`` (default 127.0.0.1) and ``--port`` (0: a free port, printed):

- ``POST /v1/completions`` and ``POST /v1/chat/completions``, with ``"stream": true``
  as server-sent events (``data: {...}`` chunks, then ``data: [DONE]``) and
  ``stream_options.include_usage``;
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text: the cache's
  ``mesh_hicache_*`` counters of rank 0 and the server's ``mesh_hicache_server_*``).

Tokens are picked as vLLM picks them (``runtime/sampling.py``: greedy at
``temperature`` 0, else sampled with the request's own seeded generator, after
``logit_bias`` and the penalties); ``n`` choices per prompt and prompt batches become
one job each. A request ends after ``max_tokens`` tokens (default ``--max-new-tokens``,
clipped to what ``--max-model-len`` leaves; ``finish_reason: "length"``), at the
checkpoint's end-of-sequence token, at a ``stop_token_ids`` token or where its text
contains a ``stop`` string (the text is cut before it; streamed text that could start
one is held back until it cannot): ``finish_reason: "stop"`` with vLLM's
``stop_reason``; the engine stops decoding there, on every rank. A field this server
does not implement (``tools``, ``response_format``, ``suffix``...) or a value outside
vLLM's range is a 400 naming it (``runtime/server/params.py``). ``usage`` reports
``prompt_tokens_details.cached_tokens``: the prompt tokens the cache served. Every
choice carries the answer's ``token_ids``. Text in and out needs the checkpoint's
``tokenizer.json``; chat uses its chat template (see ``runtime/server/text.py``, also
for the presets, which take and return token ids). Access control, limits and the
SIGTERM drain: ``runtime/server/guard.py`` and ``docs/server_security.md``.

Concurrent requests are served in one running batch (``--concurrency N``, default 8):
one engine thread (``runtime/server/batch.py``) takes jobs from the queue in arrival
order while fewer than N are in flight and runs ``runtime.scheduler.Scheduler``'s steps
over them (chunked prefill under ``--token-budget`` beside one batched decode of every
running request), streaming each request's tokens as they come. ``--concurrency 1``
serves one request at a time (``runtime/server/worker.py``). The HTTP loop stays
responsive meanwhile. On a mesh, rank 0 serves HTTP and decides, once per step, which
jobs join and which are aborted; it broadcasts that, so every rank runs the same steps.
A client that disconnects has its request dropped from the queue or aborted at the next
step, and released.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from aiohttp import web

import runtime.serve.main as serve
from mesh_hicache.cache import HiCache
from mesh_hicache.topology import MeshTopology
from runtime.budgets import apply_budgets, budget_line
from runtime.checkpoints import choose_model
from runtime.engine import Engine
from runtime.launch import (
    LaunchError,
    env_api_key,
    exit_process,
    init_mesh,
    launch_rank,
    mesh_failure,
    quiet_parser,
    report_launch_error,
)
from runtime.mesh_config import work_config
from runtime.sampling import TokenLogprobs
from runtime.scheduler import SchedulerConfig
from runtime.serve.checks import check_storage_start, label_rank_logs, storage_requested
from runtime.server.api import Reply, prometheus_text, send_event
from runtime.server.batch import BatchWorker, follow_batched
from runtime.server.flags import (
    PortBusy,
    bind_message,
    build_parser,
    check_port_free,
    check_server_args,
    context_length,
    prompt_limits,
    served_name,
)
from runtime.server.guard import BodyError, Guard, error_response, read_json
from runtime.server.params import MAX_N, ParamError, RequestParams, StopSpec
from runtime.server.stop import AnswerText, answer_of
from runtime.server.text import TextCodec
from runtime.server.worker import (
    EngineWorker,
    FifoQueue,
    Job,
    JobOutcome,
    ServerCounters,
    follow,
)

log = logging.getLogger("runtime.server")


class Server:
    """Model, cache, engine and queue of one rank, and (rank 0) the HTTP app.

    Construction is collective (model, cache, control group). Rank 0 calls
    :meth:`start_worker` and serves :meth:`app`; the others call :meth:`follow`; all
    call :meth:`close` at the end (collective)."""

    def __init__(self, args: argparse.Namespace, topology: MeshTopology) -> None:
        self.args = args
        self.topology = topology
        self.name = served_name(args)
        self.model = serve.build_model(args, topology)
        config = self.model.config
        self.budgets = apply_budgets(args, topology) if args.cache != "off" else ""
        cfg = serve.cache_config(args)
        self.cache = HiCache(topology, config.state_spec(args.page_size), cfg) if cfg else None
        self.engine = Engine(self.model, self.cache, max_new_tokens=args.max_new_tokens)
        checkpoint = choose_model(args.model, config.dtype, model_id=args.model_id).checkpoint
        self.codec = TextCodec.from_checkpoint_dir(
            checkpoint.path if checkpoint else None,
            config.vocab_size,
            checkpoint.eos_token_ids if checkpoint else (),
        )
        self.vocab_size = config.vocab_size
        self.limits = prompt_limits(args, context_length(checkpoint.path if checkpoint else None))
        self.guard = Guard(args.host, args.api_key, args.allowed_host, args.max_body_bytes)
        # Requests between their arrival and their answer; SIGTERM drains them.
        self.in_flight = 0
        self.jobs: set[Job] = set()
        self.draining = False
        self.leader = topology.coords == (0, 0, 0)
        # A gloo group of the whole mesh for rank 0's broadcasts (None on one rank).
        self.group = (
            topology.new_group("pp", "cp", "tp", backend="gloo") if topology.num_ranks > 1 else None
        )
        self.queue = FifoQueue()
        self.counters = ServerCounters()
        # --concurrency 1: one request at a time (EngineWorker); more: one running batch.
        self.batching: SchedulerConfig | None = None
        if args.concurrency > 1:
            self.batching = SchedulerConfig(
                max_running=args.concurrency, token_budget=args.token_budget
            )
        self.worker: EngineWorker | BatchWorker | None = None
        self.created = int(time.time())

    # -- lifecycle ---------------------------------------------------------------------------

    def start_worker(self) -> None:
        """Start rank 0's engine thread."""
        heartbeat = min(5.0, self.args.collective_timeout_s / 4)
        if self.batching is not None:
            self.worker = BatchWorker(
                self.engine,
                self.queue,
                self.group,
                heartbeat,
                self.counters,
                self.batching,
                self.stopper,
            )
        else:
            self.worker = EngineWorker(
                self.engine, self.queue, self.group, heartbeat, self.counters, self.stopper
            )
        self.worker.start()

    def follow(self) -> None:
        """Ranks other than 0: serve rank 0's requests until it stops."""
        assert self.group is not None
        if self.batching is not None:
            follow_batched(self.engine, self.group, self.batching, self.stopper)
        else:
            follow(self.engine, self.group)

    def close(self) -> bool:
        """Stop the engine thread after the queued jobs, flush the cache, check that it
        holds nothing for a request (a leak is logged) and close it. False on a leak."""
        if self.worker is not None:
            self.queue.put(None)
            self.worker.join()
        clean = True
        if self.cache is not None:
            self.cache.flush()
            if self.worker is None or self.worker.failure is None:
                try:
                    self.cache.check_integrity()
                except RuntimeError as err:
                    clean = False
                    log.error("runtime.server: cache integrity at shutdown: %s", err)
            self.cache.close()
        return clean

    def stopper(self, stop: StopSpec) -> Callable[[int], bool]:
        """The engine-side end test of a request (every rank decodes alike)."""
        if stop.simple:
            return stop.token_ids.__contains__
        return AnswerText(self.codec, stop).ends

    @property
    def healthy(self) -> bool:
        return self.worker is not None and self.worker.is_alive()

    # -- HTTP --------------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application (rank 0)."""
        app = web.Application(
            client_max_size=self.guard.max_body_bytes, middlewares=[self.guard.middleware]
        )
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        ok = self.healthy
        body = {"status": "ok" if ok else "engine stopped", "queued": len(self.queue)}
        return web.json_response(body, status=200 if ok else 503)

    async def _models(self, request: web.Request) -> web.Response:
        entry = {"id": self.name, "object": "model", "created": self.created}
        entry["owned_by"] = "mesh_hicache"
        return web.json_response({"object": "list", "data": [entry]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=prometheus_text(self.cache, self.topology, self.counters, len(self.queue)),
            headers={"Content-Type": "text/plain; version=0.0.4"},
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.draining:
            return _shutting_down()
        self.in_flight += 1
        try:
            return await self._answer(request, chat)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await read_json(request, self.guard.max_body_bytes)
        except BodyError as err:
            return err.response
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            return error_response(400, f"'model' must be a string, got {model!r}", param="model")
        if model not in (None, self.name):
            message = f"the model {model!r} does not exist; this one is {self.name!r}"
            return error_response(404, message, "model_not_found", "model")
        try:
            params = RequestParams.parse(
                body, chat, self.args.max_new_tokens, self.args.max_tokens_limit, self.vocab_size
            )
            if params.stop_strings and not self.codec.has_text:
                raise ParamError(
                    "stop",
                    "'stop' strings need a checkpoint with tokenizer.json; this model "
                    "takes 'stop_token_ids'",
                )
            if params.echo and params.logprobs is not None:
                raise ParamError(
                    "echo",
                    "'echo' with 'logprobs' (the prompt's log-probabilities) is not "
                    "supported; ask for one of them",
                )
            if chat:
                encode = lambda: [self.codec.encode_chat(body.get("messages"))]  # noqa: E731
            else:
                encode = lambda: self.codec.encode_prompts(body.get("prompt"))  # noqa: E731
            prompts = await asyncio.to_thread(encode)
            if len(prompts) * params.n > MAX_N:
                raise ParamError(
                    "n", f"{len(prompts)} prompts x n={params.n} choices is more than {MAX_N}"
                )
            budgets = [self.limits.check(len(p), params.max_tokens) for p in prompts]
        except ParamError as err:
            return error_response(400, str(err), param=err.param)
        except ValueError as err:
            return error_response(400, str(err), param="messages" if chat else "prompt")
        if not self.healthy:
            return error_response(503, "the engine has stopped", "server_error")
        stop = params.stop_spec(self.codec.eos_token_ids)
        loop = asyncio.get_running_loop()
        jobs: list[Job] = []
        for prompt, budget in zip(prompts, budgets, strict=True):
            for j in range(params.n):
                sampling = params.sampling(stop, self._seed(params, j))
                jobs.append(Job(prompt, budget, loop, stop, sampling))
        self.jobs.update(jobs)
        try:
            for job in jobs:
                self.queue.put(job)
            reply = Reply(self.name, chat, self.codec)
            echoes = [self.codec.decode(p) if params.echo else "" for p in prompts]
            if params.stream:
                return await self._stream(request, jobs, reply, params, echoes)
            try:
                ends = await asyncio.gather(*(collect(job) for job in jobs))
            except asyncio.CancelledError:  # the client went away
                for job in jobs:
                    job.cancel()
                raise
            except RuntimeError as err:
                for job in jobs:
                    job.cancel()
                if self.draining:
                    return _shutting_down()
                return error_response(400, str(err))
            if any(outcome.aborted for outcome, _ in ends):
                return _shutting_down()
            choices = []
            for index, (outcome, logprobs) in enumerate(ends):
                answer = answer_of(self.codec, stop, outcome.output_ids)
                asked = None if params.logprobs is None else logprobs[: len(answer.ids)]
                echo = echoes[index // params.n]
                choices.append(reply.choice(index, answer, asked, echo))
            usage = self._usage(prompts, [outcome for outcome, _ in ends], params.n)
            return web.json_response(reply.whole(choices, usage))
        finally:
            self.jobs.difference_update(jobs)

    @staticmethod
    def _seed(params: RequestParams, j: int) -> int | None:
        """Choice ``j``'s seed: ``seed + j`` (vLLM's), a fresh random one for a sampled
        request without a seed (sent to every rank with the job), None when greedy."""
        if params.seed is not None:
            return params.seed + j
        if params.temperature == 0.0:
            return None
        return random.getrandbits(63)

    @staticmethod
    def _usage(prompts: list[list[int]], outcomes: list[JobOutcome], n: int) -> dict[str, Any]:
        """vLLM's counts: each prompt once (not per choice), every generated token (the
        end-of-sequence one included)."""
        return Reply.usage(
            sum(len(p) for p in prompts),
            sum(len(o.output_ids) for o in outcomes),
            sum(o.cached_tokens for o in outcomes[::n]),
        )

    async def _stream(
        self,
        request: web.Request,
        jobs: list[Job],
        reply: Reply,
        params: RequestParams,
        echoes: list[str],
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        merged: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()

        async def forward(index: int, job: Job) -> None:
            while True:
                kind, value = await job.events.get()
                await merged.put((index, kind, value))
                if kind != "token":
                    return

        forwards = [asyncio.create_task(forward(i, job)) for i, job in enumerate(jobs)]
        answers = [AnswerText(self.codec, job.stop) for job in jobs]
        sent = [0] * len(jobs)
        outcomes: list[JobOutcome | None] = [None] * len(jobs)
        finished = False
        try:
            await response.prepare(request)
            for index in range(len(jobs)):
                echo = echoes[index // params.n]
                if reply.chat:
                    await send_event(response, reply.chunk(index, {"role": "assistant"}))
                elif echo:
                    await send_event(response, reply.delta(index, echo, []))
                sent[index] = len(echo)
            left = len(jobs)
            while left:
                index, kind, value = await merged.get()
                answer = answers[index]
                if kind == "token":
                    if answer.stopped:
                        continue
                    token, logprobs = value
                    before = len(answer.ids)
                    delta = answer.push(token)
                    ids = answer.ids[before:]
                    if delta or ids:
                        asked = [logprobs] if params.logprobs is not None and ids else None
                        event = reply.delta(index, delta, ids, asked, sent[index])
                        await send_event(response, event)
                        sent[index] += len(delta)
                elif kind == "done" and not value.aborted:
                    rest = answer.finish()
                    if rest:
                        await send_event(response, reply.delta(index, rest, []))
                    await send_event(response, reply.finish(index, answer))
                    outcomes[index] = value
                    left -= 1
                else:
                    message = "the server shut down before the answer was complete"
                    if kind == "error" and not self.draining:
                        message = str(value)
                    await send_event(response, {"error": {"message": message}})
                    finished = True
                    break
            else:
                if params.include_usage:
                    done = [o for o in outcomes if o is not None]
                    prompts = [job.prompt for job in jobs[:: params.n]]
                    usage = self._usage(prompts, done, params.n)
                    await send_event(response, reply.usage_chunk(usage))
                await response.write(b"data: [DONE]\n\n")
                finished = True
        finally:
            for task in forwards:
                task.cancel()
            if not finished:  # disconnect (write failed or the handler was cancelled)
                for job in jobs:
                    job.cancel()
            elif any(o is None for o in outcomes):
                for job in jobs:
                    job.cancel()
        await response.write_eof()
        return response

    async def drain(self, drain_s: float) -> None:
        """Refuse new requests; let the ones in flight finish for up to ``drain_s``
        seconds, then abort the rest (their clients get an error) and wait for them."""
        self.draining = True
        deadline = time.monotonic() + drain_s
        while self.in_flight and time.monotonic() < deadline and self.healthy:
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.warning(
                "runtime.server: --drain-s %.1f elapsed: aborting %d request(s)",
                drain_s,
                self.in_flight,
            )
        for job in list(self.jobs):
            job.cancel()
        # Aborts land at the next step; a stopped engine answers nothing more.
        while self.in_flight and self.healthy:
            await asyncio.sleep(0.05)


def _shutting_down() -> web.Response:
    return error_response(503, "the server is shutting down", "server_shutting_down")


async def collect(job: Job) -> tuple[JobOutcome, list[TokenLogprobs]]:
    """Await a job's end: its outcome (the engine's output, ending token included) and
    the log-probabilities of its tokens (when asked). ``RuntimeError`` with the engine's
    message if it failed."""
    logprobs: list[TokenLogprobs] = []
    while True:
        kind, value = await job.events.get()
        if kind == "token":
            if value[1] is not None:
                logprobs.append(value[1])
        elif kind == "done":
            return value, logprobs
        elif kind == "error":
            raise RuntimeError(str(value))


async def run_http(server: Server, stop: asyncio.Event, on_ready: Callable[[int], None]) -> None:
    """Serve HTTP until ``stop`` is set or the engine thread ends (rank 0); then stop
    listening and drain the requests in flight (``--drain-s``). ``PortBusy`` if the
    port cannot be bound."""
    runner = web.AppRunner(
        server.app(), handler_cancellation=True, access_log=None, shutdown_timeout=2.0
    )
    await runner.setup()
    site = web.TCPSite(runner, server.args.host, server.args.port)
    try:
        await site.start()
    except OSError as err:
        await runner.cleanup()
        raise PortBusy(bind_message(server.args.host, server.args.port, err)) from None
    sockets = getattr(site._server, "sockets", None) or []
    port = sockets[0].getsockname()[1] if sockets else server.args.port
    on_ready(port)
    try:
        while not stop.is_set() and server.healthy:
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass
        await site.stop()  # no new connections
        await server.drain(server.args.drain_s)
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = quiet_parser(build_parser()).parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(message)s")
    if args.api_key is None:
        args.api_key = env_api_key()
    try:
        serve.check_args(args)
        if args.cache == "full" and storage_requested(argv):
            check_storage_start(args.storage, args.storage_root, args.mooncake_master)
        check_server_args(args)
        if launch_rank() == 0:
            check_port_free(args.host, args.port)
        owns_group = not dist.is_initialized()
        topology = init_mesh(
            args.pp, args.cp, args.tp, args.collective_timeout_s, work_config(args)
        )
    except (LaunchError, ValueError, PortBusy) as err:
        return report_launch_error("runtime.server", err)
    label_rank_logs(topology)
    if topology.coords != (0, 0, 0):
        # A signal ends the job through rank 0, whose stop message ends the other ranks'
        # loops (a terminal's Ctrl-C and torchrun's SIGTERM reach every rank). Ignored
        # from here, not only once serving: rank 0 may already be serving, and take a
        # Ctrl-C, while another rank is still finishing its start.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    try:
        server = Server(args, topology)
        if server.leader:
            code = _lead(server)
        else:
            server.follow()
            code = 0
        if not server.close() and code == 0:
            code = 3
    except Exception as err:
        cause = mesh_failure(err)
        if cause is None:
            raise
        print(f"runtime.server: error: rank {topology.coords}: {cause}", file=sys.stderr)
        exit_process(3)
    except KeyboardInterrupt:  # Ctrl-C on rank 0 before it serves (the others ignore it)
        print("runtime.server: interrupted while starting", file=sys.stderr)
        exit_process(130)
    if owns_group:
        dist.destroy_process_group()
    return code


def _lead(server: Server) -> int:
    if server.cache is not None:
        line = budget_line(server.cache, server.args.page_size, server.budgets)
        print(f"runtime.server: {line}", flush=True)
    server.start_worker()
    busy: list[str] = []

    async def main_loop() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def ready(port: int) -> None:
            url = f"http://{server.args.host}:{port}/v1"
            print(f"runtime.server: serving {server.name!r} on {url}", flush=True)

        try:
            await run_http(server, stop, ready)
        except PortBusy as err:
            busy.append(str(err))

    asyncio.run(main_loop())
    if busy:
        print(f"runtime.server: error: {busy[0]}", file=sys.stderr, flush=True)
        return 2
    worker = server.worker
    failed = worker is not None and worker.failure is not None
    counts = server.counters.as_dict()
    print(
        f"runtime.server: {counts['requests']} requests served ({counts['uncached']} uncached), "
        f"{counts['aborted']} aborted, {counts['cached_tokens']} of {counts['prompt_tokens']} "
        "prompt tokens from the cache",
        flush=True,
    )
    return 3 if failed else 0
