"""The OpenAI-shaped parts of ``runtime.server``: a request body's generation parameters,
the response bodies (whole and streamed), error bodies, and the ``/metrics`` text."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from runtime.server_worker import JobOutcome

if TYPE_CHECKING:
    from runtime.server import Server


class RequestParams:
    """The generation parameters of a request body (``ValueError`` naming a bad one)."""

    def __init__(
        self, max_tokens: int, stream: bool, include_usage: bool, ignore_eos: bool = False
    ) -> None:
        self.max_tokens = max_tokens
        self.stream = stream
        self.include_usage = include_usage
        self.ignore_eos = ignore_eos
        """Generate ``max_tokens`` whatever the tokens (vLLM's extension)."""

    @classmethod
    def parse(cls, body: dict[str, Any], default: int, limit: int) -> RequestParams:
        n = body.get("n", 1)
        if n not in (None, 1):
            raise ValueError(f"'n' must be 1 (greedy decoding), got {n!r}")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = default
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise ValueError(f"'max_tokens' must be an integer, got {max_tokens!r}")
        if not 1 <= max_tokens <= limit:
            raise ValueError(f"'max_tokens' must be in [1, {limit}], got {max_tokens}")
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise ValueError(f"'stream' must be a boolean, got {stream!r}")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ValueError("'stream_options' must be an object")
        ignore_eos = body.get("ignore_eos") or False
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"'ignore_eos' must be a boolean, got {ignore_eos!r}")
        return cls(max_tokens, stream, bool(options.get("include_usage")), ignore_eos)


class Reply:
    """Builds the OpenAI-shaped bodies of one request."""

    def __init__(self, server: Server, chat: bool, prompt_tokens: int) -> None:
        self.server = server
        self.chat = chat
        self.prompt_tokens = prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, streamed: bool) -> dict[str, Any]:
        kind = self.object + (".chunk" if streamed and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.name}

    def usage(self, output: list[int], outcome: JobOutcome) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(output),
            "total_tokens": self.prompt_tokens + len(output),
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
        }

    def whole(self, output: list[int], outcome: JobOutcome) -> dict[str, Any]:
        text = self.server.codec.decode(output)
        finish = "stop" if len(output) < len(outcome.output_ids) else "length"
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": output}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {**self._head(False), "choices": [choice], "usage": self.usage(output, outcome)}

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}

    def delta(self, text: str, ids: list[int]) -> dict[str, Any]:
        if self.chat:
            out = self.chunk({"content": text})
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
            out = {**self._head(True), "choices": [choice]}
        out["choices"][0]["token_ids"] = ids
        return out

    def finish(self, reason: str) -> dict[str, Any]:
        if self.chat:
            return self.chunk({}, reason)
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, output: list[int], outcome: JobOutcome) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": self.usage(output, outcome)}


async def send_event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


def error_response(status: int, message: str, code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status)


def prometheus_text(server: Server) -> bytes:
    """The ``/metrics`` body: the cache's exporter and the server's counters."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from mesh_hicache.metrics import CacheStatsCollector, topology_labels

    registry = CollectorRegistry()
    if server.cache is not None:
        registry.register(
            CacheStatsCollector(server.cache.stats, labels=topology_labels(server.topology))
        )
    counts = server.counters.as_dict()
    queued = len(server.queue)

    class _ServerCollector:
        def collect(self) -> Iterator[Any]:
            docs = {
                "requests": "Requests served to the end.",
                "aborted": "Requests aborted (the client went away mid-request).",
                "errors": "Requests the engine refused.",
                "uncached": "Requests served with no prompt token from the cache.",
                "prompt_tokens": "Prompt tokens of the served requests.",
                "cached_tokens": "Prompt tokens the cache served.",
                "completion_tokens": "Tokens generated.",
                "integrity_errors": "Cache integrity failures found after aborts.",
            }
            for name, doc in docs.items():
                yield CounterMetricFamily(f"mesh_hicache_server_{name}", doc, value=counts[name])
            yield GaugeMetricFamily(
                "mesh_hicache_server_running", "Requests in the engine.", value=counts["running"]
            )
            yield GaugeMetricFamily(
                "mesh_hicache_server_peak_running",
                "Most requests admitted at once (in one running batch) so far.",
                value=counts["peak_running"],
            )
            yield GaugeMetricFamily(
                "mesh_hicache_server_queued", "Requests waiting for the engine.", value=queued
            )

        def describe(self) -> list[Any]:
            return []

    registry.register(_ServerCollector())  # type: ignore[arg-type]
    return bytes(generate_latest(registry))
