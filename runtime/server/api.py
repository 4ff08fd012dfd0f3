"""The OpenAI-shaped parts of ``runtime.server``: the response bodies (whole and
streamed) and the ``/metrics`` text. (Request fields: ``runtime.server.params``; error
bodies: ``runtime.server.guard``.)

Every choice carries ``token_ids``, the answer's token ids (for a model without a
tokenizer, the answer itself: its ``text`` is ""), and ``stop_reason`` as vLLM reports it
(the stop string or ``stop_token_ids`` id that ended it, else null)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from aiohttp import web

from mesh_hicache.cache import HiCache
from mesh_hicache.topology import MeshTopology
from runtime.sampling import TokenLogprobs
from runtime.server.guard import error_response
from runtime.server.stop import AnswerText
from runtime.server.text import TextCodec
from runtime.server.worker import ServerCounters

__all__ = ["Reply", "error_response", "prometheus_text", "send_event"]


class Reply:
    """Builds the OpenAI-shaped bodies of one request: its choices (``index``: prompt
    ``i`` of a batch, sample ``j`` of ``n``: ``i * n + j``), whole or streamed."""

    def __init__(self, model_name: str, chat: bool, codec: TextCodec) -> None:
        self.model_name = model_name
        self.chat = chat
        self.codec = codec
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, streamed: bool) -> dict[str, Any]:
        kind = self.object + (".chunk" if streamed and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    def choice(
        self,
        index: int,
        answer: AnswerText,
        logprobs: Sequence[TokenLogprobs] | None,
        echo: str = "",
    ) -> dict[str, Any]:
        """One whole choice."""
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": answer.finish_reason,
            "stop_reason": answer.stop_reason,
            "token_ids": answer.ids,
        }
        shaped = None if logprobs is None else self.logprobs(logprobs, len(echo))
        if self.chat:
            choice["message"] = {"role": "assistant", "content": answer.text}
        else:
            choice["text"] = echo + answer.text
        choice["logprobs"] = shaped
        return choice

    def whole(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(False), "choices": choices, "usage": usage}

    def chunk(self, index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}

    def delta(
        self,
        index: int,
        text: str,
        ids: list[int],
        logprobs: Sequence[TokenLogprobs] | None = None,
        offset: int = 0,
    ) -> dict[str, Any]:
        """A streamed piece of choice ``index``: its text, the ids it adds and, when asked,
        their log-probabilities (``offset``: the text sent before, for ``text_offset``)."""
        shaped = None if logprobs is None else self.logprobs(logprobs, offset)
        if self.chat:
            out = self.chunk(index, {"content": text})
            out["choices"][0]["logprobs"] = shaped
        else:
            choice = {"index": index, "text": text, "logprobs": shaped, "finish_reason": None}
            out = {**self._head(True), "choices": [choice]}
        out["choices"][0]["token_ids"] = ids
        return out

    def finish(self, index: int, answer: AnswerText) -> dict[str, Any]:
        if self.chat:
            out = self.chunk(index, {}, answer.finish_reason)
        else:
            choice = {"index": index, "text": "", "logprobs": None}
            choice["finish_reason"] = answer.finish_reason
            out = {**self._head(True), "choices": [choice]}
        out["choices"][0]["stop_reason"] = answer.stop_reason
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage}

    def logprobs(self, entries: Sequence[TokenLogprobs], offset: int = 0) -> dict[str, Any]:
        """OpenAI's shapes: completions' four parallel lists, chat's ``content`` list."""
        text = self.codec.token_text
        if self.chat:
            return {
                "content": [
                    {
                        **_chat_logprob(text(e.token), e.logprob),
                        "top_logprobs": [_chat_logprob(text(t), lp) for t, lp in e.top],
                    }
                    for e in entries
                ]
            }
        tokens = [text(e.token) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        tops = []
        for e in entries:
            # Tokens whose texts collide (bytes of one character) keep the likelier one.
            top: dict[str, float] = {}
            for t, lp in ((e.token, e.logprob), *e.top):
                top.setdefault(text(t), _finite(lp))
            tops.append(top)
        return {
            "text_offset": offsets,
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "tokens": tokens,
            "top_logprobs": tops,
        }


def _finite(logprob: float) -> float:
    # JSON has no -inf: vLLM reports an impossible token as -9999.0.
    return max(logprob, -9999.0)


def _chat_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}


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
