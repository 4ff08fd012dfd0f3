"""The OpenAI-shaped parts of ``runtime.server``: the response bodies (whole and
streamed) and the ``/metrics`` text. (Request fields: ``runtime.server.params``; error
bodies: ``runtime.server.guard``.)

Every choice carries ``token_ids``, the answer's token ids (for a model without a
tokenizer, the answer itself: its ``text`` is "")."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from mesh_hicache.cache import HiCache
from mesh_hicache.topology import MeshTopology
from runtime.server.guard import error_response
from runtime.server.stop import AnswerText
from runtime.server.worker import JobOutcome, ServerCounters

__all__ = ["Reply", "error_response", "prometheus_text", "send_event"]


class Reply:
    """Builds the OpenAI-shaped bodies of one request."""

    def __init__(self, model_name: str, chat: bool, prompt_tokens: int) -> None:
        self.model_name = model_name
        self.chat = chat
        self.prompt_tokens = prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, streamed: bool) -> dict[str, Any]:
        kind = self.object + (".chunk" if streamed and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}

    def usage(self, output: list[int], outcome: JobOutcome) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(output),
            "total_tokens": self.prompt_tokens + len(output),
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
        }

    def whole(self, answer: AnswerText, outcome: JobOutcome) -> dict[str, Any]:
        text = answer.text
        output = answer.ids
        finish = answer.finish_reason
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


def prometheus_text(
    cache: HiCache | None, topology: MeshTopology, counters: ServerCounters, queued: int
) -> bytes:
    """The ``/metrics`` body: the cache's exporter (``cache``'s stats labelled with the
    ``topology``) and the server's ``counters`` with the ``queued`` count."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from mesh_hicache.metrics import CacheStatsCollector, topology_labels

    registry = CollectorRegistry()
    if cache is not None:
        registry.register(CacheStatsCollector(cache.stats, labels=topology_labels(topology)))
    counts = counters.as_dict()

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
