"""The request parameters of ``runtime.server``: which body fields are understood, which
are refused, and how each is checked.

Every field of a request body goes through :data:`PARAMETERS` (name -> handler). A
handler checks the value and records it on :class:`RequestParams`; an unknown field is a
400 naming it (as OpenAI answers an unrecognized argument), and so is a field this server
does not implement, unless it carries its neutral value (``"logprobs": null``,
``"n": 1``, ``"temperature": 0``, ``"tools": []``...): a request is never silently
served differently from what it asked.

To implement a parameter, replace its :func:`unsupported` entry with a handler that
stores it on :class:`RequestParams` (add the field there) and use it where the job is
built (``runtime.server``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_SEQUENCES = 4
"""At most this many ``stop`` strings (OpenAI's limit)."""
MAX_STOP_TOKEN_IDS = 64


class ParamError(ValueError):
    """A bad or unsupported request field; ``param`` names it (the error body's ``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StopSpec:
    """How a request's generation ends early (besides ``max_tokens``): at any of
    ``token_ids`` (the checkpoint's end-of-sequence id and ``stop_token_ids``; the token
    is not part of the answer) or when the answer's text contains any of ``strings``
    (the text is cut before it). Picklable: ranks of a mesh receive it with the job."""

    strings: tuple[str, ...] = ()
    token_ids: frozenset[int] = frozenset()


@dataclass
class RequestParams:
    """The checked generation parameters of one request."""

    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    """Generate ``max_tokens`` past the end-of-sequence ids (vLLM's extension)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(
        cls, body: dict[str, Any], chat: bool, default_max: int, limit: int, vocab_size: int
    ) -> RequestParams:
        """Check every field of ``body`` (``ParamError`` naming the first bad one)."""
        ctx = _Context(chat, limit, vocab_size)
        params = cls(max_tokens=default_max)
        for name in _ordered(body):
            handler = PARAMETERS.get(name)
            if (
                handler is None
                or (name in _CHAT_ONLY and not chat)
                or (name in _COMPLETIONS_ONLY and chat)
            ):
                endpoint = "/v1/chat/completions" if chat else "/v1/completions"
                raise ParamError(name, f"unrecognized request argument {name!r} for {endpoint}")
            handler(name, body[name], params, ctx)
        return params

    def stop_spec(self, eos_token_ids: tuple[int, ...]) -> StopSpec:
        """Where this request ends: its own stops and, unless ``ignore_eos``, the model's
        end-of-sequence ids."""
        eos = () if self.ignore_eos else eos_token_ids
        return StopSpec(self.stop_strings, frozenset(self.stop_token_ids) | frozenset(eos))


@dataclass(frozen=True)
class _Context:
    chat: bool
    max_tokens_limit: int
    vocab_size: int


Handler = Callable[[str, Any, RequestParams, _Context], None]


def _ordered(body: dict[str, Any]) -> list[str]:
    # max_completion_tokens wins over max_tokens: check it last.
    return sorted(body, key=lambda k: k == "max_completion_tokens")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ignore(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    """A field handled elsewhere (``model``, ``prompt``, ``messages``)."""


def _metadata(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    """A field that does not change the answer (``user``, ``seed`` under greedy decoding)."""
    if name == "user" and value is not None and not isinstance(value, str):
        raise ParamError(name, f"'user' must be a string, got {value!r}")
    if name == "seed" and value is not None and not _is_int(value):
        raise ParamError(name, f"'seed' must be an integer, got {value!r}")


def _max_tokens(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    if value is None:
        return
    if not _is_int(value):
        raise ParamError(name, f"'{name}' must be an integer, got {value!r}")
    if not 1 <= value <= ctx.max_tokens_limit:
        raise ParamError(name, f"'{name}' must be in [1, {ctx.max_tokens_limit}], got {value}")
    params.max_tokens = value


def _stream(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    if value is None:
        return
    if not isinstance(value, bool):
        raise ParamError(name, f"'stream' must be a boolean, got {value!r}")
    params.stream = value


def _stream_options(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ParamError(name, "'stream_options' must be an object")
    unknown = set(value) - {"include_usage"}
    if unknown:
        raise ParamError(name, f"'stream_options' has unsupported keys {sorted(unknown)}")
    usage = value.get("include_usage", False)
    if not isinstance(usage, bool | None):
        raise ParamError(name, f"'stream_options.include_usage' must be a boolean, got {usage!r}")
    params.include_usage = bool(usage)


def _stop(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    if value is None:
        return
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise ParamError(
            name, "'stop' must be a string or a list of strings (token ids: 'stop_token_ids')"
        )
    if len(strings) > MAX_STOP_SEQUENCES:
        raise ParamError(name, f"'stop' takes at most {MAX_STOP_SEQUENCES} strings")
    if any(not s for s in strings):
        raise ParamError(name, "'stop' strings must not be empty")
    params.stop_strings = tuple(dict.fromkeys(strings))


def _stop_token_ids(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(_is_int(i) for i in value):
        raise ParamError(name, "'stop_token_ids' must be a list of token ids")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise ParamError(name, f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids")
    bad = [i for i in value if not 0 <= i < ctx.vocab_size]
    if bad:
        raise ParamError(name, f"'stop_token_ids' {bad[:5]} not in range({ctx.vocab_size})")
    params.stop_token_ids = tuple(dict.fromkeys(value))


def _ignore_eos(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    if value is None:
        return
    if not isinstance(value, bool):
        raise ParamError(name, f"'ignore_eos' must be a boolean, got {value!r}")
    params.ignore_eos = value


def _return_token_ids(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    """vLLM's extension; this server always returns ``choices[i].token_ids``."""
    if value is not None and not isinstance(value, bool):
        raise ParamError(name, f"'return_token_ids' must be a boolean, got {value!r}")


def unsupported(*neutral: Any, why: str = "is not supported by this server") -> Handler:
    """The handler of a field this server does not implement: accepted only at one of
    its ``neutral`` values (None always), else a 400 naming it."""

    def check(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
        if value is None or any(_same(value, n) for n in neutral):
            return
        raise ParamError(name, f"'{name}' {why} (got {_short(value)})")

    return check


def _same(value: Any, neutral: Any) -> bool:
    # 1 == True in Python: a bool matches only a bool.
    return (
        type(value) is type(neutral)
        and value == neutral
        or (isinstance(neutral, float) and _is_int(value) and value == neutral)
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


GREEDY = "is not supported: this server decodes greedily"

PARAMETERS: dict[str, Handler] = {
    "model": _ignore,
    "prompt": _ignore,
    "messages": _ignore,
    "max_tokens": _max_tokens,
    "max_completion_tokens": _max_tokens,
    "stream": _stream,
    "stream_options": _stream_options,
    "stop": _stop,
    "stop_token_ids": _stop_token_ids,
    "ignore_eos": _ignore_eos,
    "return_token_ids": _return_token_ids,
    "user": _metadata,
    "seed": _metadata,
    "n": unsupported(1, why="must be 1: one answer per request"),
    "best_of": unsupported(1, why="must be 1: one answer per request"),
    "temperature": unsupported(0.0, why=GREEDY + " (temperature 0)"),
    "top_p": unsupported(1.0, why=GREEDY + " (top_p 1)"),
    "presence_penalty": unsupported(0.0),
    "frequency_penalty": unsupported(0.0),
    "logit_bias": unsupported({}),
    "logprobs": unsupported(False, 0),
    "top_logprobs": unsupported(0),
    "echo": unsupported(False),
    "suffix": unsupported(""),
    "tools": unsupported([]),
    "tool_choice": unsupported("none"),
    "parallel_tool_calls": unsupported(),
    "functions": unsupported([]),
    "function_call": unsupported("none"),
    "response_format": unsupported({"type": "text"}),
    "modalities": unsupported(["text"]),
    "audio": unsupported(),
    "prediction": unsupported(),
    "reasoning_effort": unsupported(),
    "web_search_options": unsupported(),
    "metadata": unsupported({}),
    "store": unsupported(False),
    "service_tier": unsupported("auto", "default"),
}
"""Every request field this server knows: implemented ones and refused ones."""

_CHAT_ONLY = frozenset(
    {
        "messages",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "response_format",
        "modalities",
        "audio",
        "prediction",
        "reasoning_effort",
        "web_search_options",
        "metadata",
        "store",
        "service_tier",
    }
)
_COMPLETIONS_ONLY = frozenset({"prompt", "echo", "suffix", "best_of"})


def unsupported_names() -> list[str]:
    """The fields that are refused unless neutral (for the docs and tests)."""
    return sorted(
        name for name, handler in PARAMETERS.items() if handler.__qualname__.startswith("unsup")
    )


@dataclass(frozen=True)
class PromptLimits:
    """How long a request may be: ``max_prompt_tokens`` prompt tokens, and at most
    ``context`` (the model's context length; None: not stated) prompt plus answer."""

    max_prompt_tokens: int
    context: int | None = None

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """``ParamError`` for a request over a limit (before any work is queued)."""
        if prompt_tokens > self.max_prompt_tokens:
            raise ParamError(
                "prompt",
                f"the prompt has {prompt_tokens} tokens; this server takes at most "
                f"{self.max_prompt_tokens} (--max-prompt-tokens)",
            )
        if self.context is not None and prompt_tokens + max_tokens > self.context:
            raise ParamError(
                "max_tokens",
                f"this model's maximum context length is {self.context} tokens; the request "
                f"asks for {prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, "
                f"{max_tokens} to generate)",
            )
