"""An OpenAI-compatible HTTP server over the engine and HiCache (aiohttp).

    python -m runtime.server --model DIR --port 8000              # one rank
    torchrun --standalone --nproc-per-node 4 -m runtime.server --model DIR --cp 2 --tp 2

Endpoints, on ``--host`` (default 127.0.0.1) and ``--port`` (0: a free port, printed):

- ``POST /v1/completions`` and ``POST /v1/chat/completions``, with ``"stream": true``
  as server-sent events (``data: {...}`` chunks, then ``data: [DONE]``) and
  ``stream_options.include_usage``;
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text: the cache's
  ``mesh_hicache_*`` counters of rank 0 and the server's ``mesh_hicache_server_*``).

Decoding is greedy (``temperature``, ``top_p`` and the like are accepted and ignored;
``n`` must be 1); a request ends after ``max_tokens`` tokens (default
``--max-new-tokens``) or at the checkpoint's end-of-sequence token
(``finish_reason: "stop"``; the engine stops decoding there, on every rank). ``usage``
reports ``prompt_tokens_details.cached_tokens``: the prompt tokens the cache served.
Text in and out needs the checkpoint's ``tokenizer.json``; chat uses its chat template
(see ``runtime/server_text.py``, also for the presets, which take token ids).

Concurrent requests are served in one running batch (``--concurrency N``, default 8):
one engine thread (``runtime/server_batch.py``) takes jobs from the queue in arrival
order while fewer than N are in flight and runs ``runtime.scheduler.Scheduler``'s steps
over them (chunked prefill under ``--token-budget`` beside one batched decode of every
running request), streaming each request's tokens as they come. ``--concurrency 1``
serves one request at a time (``runtime/server_worker.py``). The HTTP loop stays
responsive meanwhile. On a mesh, rank 0 serves HTTP and decides, once per step, which
jobs join and which are aborted; it broadcasts that, so every rank runs the same steps.
A client that disconnects has its request dropped from the queue or aborted at the next
step, and released.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.distributed as dist
from aiohttp import web

import runtime.serve as serve
from mesh_hicache.cache import HiCache
from mesh_hicache.topology import MeshTopology
from runtime.checkpoints import choose_model
from runtime.engine import Engine
from runtime.launch import LaunchError, exit_process, init_mesh, mesh_failure
from runtime.scheduler import SchedulerConfig
from runtime.serve_flags import HelpFormatter
from runtime.server_api import Reply, RequestParams, error_response, prometheus_text, send_event
from runtime.server_batch import BatchWorker, follow_batched
from runtime.server_text import StreamDecoder, TextCodec
from runtime.server_worker import (
    EngineWorker,
    FifoQueue,
    Job,
    JobOutcome,
    ServerCounters,
    follow,
)
from runtime.startup_checks import check_storage_start, label_rank_logs, storage_requested

log = logging.getLogger("runtime.server")

# serve.py's flags that pick a workload or write a report: meaningless for a server.
_TRACE_ONLY = (
    "prompts",
    "workload",
    "sessions",
    "turns",
    "first_prompt_len",
    "append_len",
    "json",
    "dump_logits",
    "log_every",
    "quiet",
    "request_rate",
    "think_s",
)


def build_parser() -> argparse.ArgumentParser:
    """``runtime.serve``'s model, mesh and cache flags plus the HTTP ones."""
    p = serve.build_parser()
    p.prog = "runtime.server"
    p.description = __doc__.splitlines()[0]
    p.formatter_class = HelpFormatter
    for action in p._actions:
        if action.dest in _TRACE_ONLY:
            action.help = argparse.SUPPRESS
        elif action.dest == "max_new_tokens":
            action.help = "max_tokens of a request that does not set it"
        elif action.dest == "concurrency":
            action.default = 8
            action.help = (
                "most requests in flight, served in one running batch by runtime.scheduler "
                "(continuous batching); 1: one request at a time (Engine.serve)"
            )
        elif action.dest == "token_budget":
            action.help = "prefill tokens per scheduler step beside the batched decode"
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: pick a free one)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id of /v1/models and requests (default: the --model name)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=1024,
        help="largest max_tokens a request may ask for",
    )
    return p


def served_name(args: argparse.Namespace) -> str:
    return args.served_model_name or Path(args.model).name or str(args.model)


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
        cfg = serve.cache_config(args)
        self.cache = HiCache(topology, config.state_spec(args.page_size), cfg) if cfg else None
        self.engine = Engine(self.model, self.cache, max_new_tokens=args.max_new_tokens)
        checkpoint = choose_model(args.model, config.dtype).checkpoint
        self.codec = TextCodec.from_checkpoint_dir(
            checkpoint.path if checkpoint else None,
            config.vocab_size,
            checkpoint.eos_token_id if checkpoint else None,
        )
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
                self.engine, self.queue, self.group, heartbeat, self.counters, self.batching
            )
        else:
            self.worker = EngineWorker(
                self.engine, self.queue, self.group, heartbeat, self.counters
            )
        self.worker.start()

    def follow(self) -> None:
        """Ranks other than 0: serve rank 0's requests until it stops."""
        assert self.group is not None
        # A signal ends the job through rank 0, whose stop message ends this loop
        # (torchrun forwards SIGTERM to every rank).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        if self.batching is not None:
            follow_batched(self.engine, self.group, self.batching)
        else:
            follow(self.engine, self.group)

    def close(self) -> None:
        """Stop the engine thread after the queued jobs, flush and close the cache."""
        if self.worker is not None:
            self.queue.put(None)
            self.worker.join()
        if self.cache is not None:
            self.cache.flush()
            self.cache.close()

    @property
    def healthy(self) -> bool:
        return self.worker is not None and self.worker.is_alive()

    # -- HTTP --------------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application (rank 0)."""
        app = web.Application(client_max_size=64 << 20)
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
            body=prometheus_text(self), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        if body.get("model") not in (None, self.name):
            message = f"the model {body.get('model')!r} does not exist; this one is {self.name!r}"
            return error_response(404, message, "model_not_found")
        try:
            params = RequestParams.parse(body, self.args.max_new_tokens, self.args.max_tokens_limit)
            if chat:
                prompt = self.codec.encode_chat(body.get("messages"))
            else:
                prompt = self.codec.encode_prompt(body.get("prompt"))
        except ValueError as err:
            return error_response(400, str(err))
        if not self.healthy:
            return error_response(503, "the engine has stopped", "server_error")
        job = Job(prompt, params.max_tokens, asyncio.get_running_loop(), self.codec.eos_token_id)
        self.queue.put(job)
        reply = Reply(self, chat, len(prompt))
        if params.stream:
            return await self._stream(request, job, reply, params.include_usage)
        try:
            outcome, output = await collect(job, self.codec.eos_token_id)
        except asyncio.CancelledError:  # the client went away
            job.cancel()
            raise
        except RuntimeError as err:
            return error_response(400, str(err))
        return web.json_response(reply.whole(output, outcome))

    async def _stream(
        self, request: web.Request, job: Job, reply: Reply, include_usage: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        finished = False
        try:
            await response.prepare(request)
            if reply.chat:
                await send_event(response, reply.chunk({"role": "assistant", "content": ""}))
            decoder = StreamDecoder(self.codec)
            output: list[int] = []
            stopped = False
            while True:
                kind, value = await job.events.get()
                if kind == "token":
                    if stopped or value == self.codec.eos_token_id:
                        stopped = True
                        continue
                    output.append(value)
                    delta = decoder.push(value)
                    await send_event(response, reply.delta(delta, [value]))
                elif kind == "done":
                    rest = decoder.finish()
                    if rest:
                        await send_event(response, reply.delta(rest, []))
                    finish = "stop" if stopped else "length"
                    await send_event(response, reply.finish(finish))
                    if include_usage:
                        await send_event(response, reply.usage_chunk(output, value))
                    await response.write(b"data: [DONE]\n\n")
                    finished = True
                    break
                else:
                    await send_event(response, {"error": {"message": str(value)}})
                    finished = True
                    break
        finally:
            if not finished:  # disconnect (write failed or the handler was cancelled)
                job.cancel()
        await response.write_eof()
        return response


async def collect(job: Job, eos_token_id: int | None) -> tuple[JobOutcome, list[int]]:
    """Await a job's end: its outcome and its output up to (not including) the end of
    sequence. ``RuntimeError`` with the engine's message if it failed."""
    while True:
        kind, value = await job.events.get()
        if kind == "done":
            ids = list(value.output_ids)
            if eos_token_id is not None and eos_token_id in ids:
                ids = ids[: ids.index(eos_token_id)]
            return value, ids
        if kind == "error":
            raise RuntimeError(str(value))


async def run_http(server: Server, stop: asyncio.Event, on_ready: Callable[[int], None]) -> None:
    """Serve HTTP until ``stop`` is set or the engine thread ends (rank 0)."""
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, server.args.host, server.args.port)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    port = sockets[0].getsockname()[1] if sockets else server.args.port
    on_ready(port)
    try:
        while not stop.is_set() and server.healthy:
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(message)s")
    try:
        serve.check_args(args)
        if args.cache == "full" and storage_requested(argv):
            check_storage_start(args.storage, args.storage_root, args.mooncake_master)
        if not 0 <= args.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {args.port}")
        if args.max_tokens_limit < args.max_new_tokens:
            raise ValueError(
                f"--max-tokens-limit {args.max_tokens_limit} is below --max-new-tokens "
                f"{args.max_new_tokens}"
            )
        owns_group = not dist.is_initialized()
        topology = init_mesh(args.pp, args.cp, args.tp, args.collective_timeout_s)
    except (LaunchError, ValueError) as err:
        print(f"runtime.server: error: {err}", file=sys.stderr)
        return 2
    label_rank_logs(topology)
    try:
        server = Server(args, topology)
        if server.leader:
            code = _lead(server)
        else:
            server.follow()
            code = 0
        server.close()
    except Exception as err:
        cause = mesh_failure(err)
        if cause is None:
            raise
        print(f"runtime.server: error: rank {topology.coords}: {cause}", file=sys.stderr)
        exit_process(3)
    if owns_group:
        dist.destroy_process_group()
    return code


def _lead(server: Server) -> int:
    server.start_worker()

    async def main_loop() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def ready(port: int) -> None:
            url = f"http://{server.args.host}:{port}/v1"
            print(f"runtime.server: serving {server.name!r} on {url}", flush=True)

        await run_http(server, stop, ready)

    asyncio.run(main_loop())
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


if __name__ == "__main__":
    exit_process(main())
