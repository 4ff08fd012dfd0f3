"""The request parameters of ``runtime.server``: which body fields are understood, which
are refused, and how each is checked.

Every field of a request body goes through :data:`PARAMETERS` (name -> handler). A
handler checks the value and records it on :class:`RequestParams`; an unknown field is a
400 naming it (as OpenAI answers an unrecognized argument), and so is a field this server
does not implement, unless it carries its neutral value (``"logprobs": null``,
``"n": 1``, ``"temperature": 0``, ``"tools": []``...): a request is never silently
served differently from what it asked.

Ranges and messages follow vLLM's (``temperature`` in [0, 2], ``top_p`` in (0, 1],
``logprobs`` at most 20...); a mistyped value is a 400 as well. To implement a refused
parameter, replace its :func:`unsupported` entry with a handler that stores it on
:class:`RequestParams` (add the field there) and use it where the job is built
(``runtime.server``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.sampling import MAX_LOGPROBS, SamplingParams

MAX_STOP_SEQUENCES = 4
"""At most this many ``stop`` strings (OpenAI's limit)."""
MAX_STOP_TOKEN_IDS = 64
MAX_N = 64
"""The most choices one request may ask (``n`` times the prompts of a batch)."""


class ParamError(ValueError):
    """A bad or unsupported request field; ``param`` names it (the error body's ``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StopSpec:
    """How a request's generation ends early (besides ``max_tokens``): at any of
    ``token_ids`` (the checkpoint's end-of-sequence ids ``eos_ids`` and
    ``stop_token_ids``; the token is not part of the answer) or when the answer's text
    contains any of ``strings`` (the text is cut before it), but not before
    ``min_tokens`` tokens. ``include_stop``: the stop string (or the ``stop_token_ids``
    token) stays in the answer. Picklable: ranks of a mesh receive it with the job."""

    strings: tuple[str, ...] = ()
    token_ids: frozenset[int] = frozenset()
    eos_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    include_stop: bool = False

    @property
    def simple(self) -> bool:
        """Ends only at ``token_ids``, from the first token on."""
        return not self.strings and not self.min_tokens and not self.include_stop


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
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    n: int = 1
    temperature: float = 0.0
    """A request that does not set it decodes greedily (OpenAI's and vLLM's default is
    1: the docs state the difference)."""
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    """Completions: the N most likely per position; chat: 0 with ``logprobs: true``, then
    ``top_logprobs``."""
    echo: bool = False
    stream_options_set: bool = False
    max_tokens_set: bool = False
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
        params._check_together(body, chat)
        return params

    def _check_together(self, body: dict[str, Any], chat: bool) -> None:
        if self.stream_options_set and not self.stream:
            raise ParamError(
                "stream_options", "'stream_options' can only be set when 'stream' is true"
            )
        top = self.extra.get("top_logprobs")
        if chat and top is not None:
            if self.logprobs is None and top > 0:
                raise ParamError(
                    "top_logprobs", "when using 'top_logprobs', 'logprobs' must be set to true"
                )
            if self.logprobs is not None:
                self.logprobs = top
        if self.min_tokens > self.max_tokens:
            raise ParamError(
                "min_tokens",
                f"'min_tokens' must be at most max_tokens={self.max_tokens}, got {self.min_tokens}",
            )

    def sampling(self, stop: StopSpec, seed: int | None) -> SamplingParams:
        """How one choice picks its tokens (``seed``: that choice's)."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple(sorted(self.logit_bias.items())),
            min_tokens=self.min_tokens,
            stop_ids=stop.token_ids if self.min_tokens else frozenset(),
            logprobs=self.logprobs,
        )

    def stop_spec(self, eos_token_ids: tuple[int, ...]) -> StopSpec:
        """Where this request ends: its own stops and, unless ``ignore_eos``, the model's
        end-of-sequence ids."""
        eos = frozenset(() if self.ignore_eos else eos_token_ids)
        ids = frozenset(self.stop_token_ids) | eos
        return StopSpec(
            self.stop_strings,
            ids,
            eos - frozenset(self.stop_token_ids),
            self.min_tokens,
            self.include_stop_str_in_output,
        )


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
    """A field that does not change the answer (``user``)."""
    if value is not None and not isinstance(value, str):
        raise ParamError(name, f"'{name}' must be a string, got {value!r}")


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ParamError(name, f"'{name}' must be a number, got {_short(value)}")
    if not math.isfinite(value):
        raise ParamError(name, f"'{name}' must be a finite number, got {value}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if not _is_int(value):
        raise ParamError(name, f"'{name}' must be an integer, got {_short(value)}")
    return int(value)


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ParamError(name, f"'{name}' must be a boolean, got {_short(value)}")
    return value


def _ranged(low: float, high: float, *, open_low: bool = False, text: str | None = None) -> Handler:
    """A number in [low, high] ((low, high] with ``open_low``), stored as the field."""

    def check(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
        if value is None:
            return
        x = _number(name, value)
        if x < low or x > high or (open_low and x == low):
            shown = text or f"{'(' if open_low else '['}{low:g}, {high:g}]"
            raise ParamError(name, f"'{name}' must be in {shown}, got {x:g}")
        setattr(params, name, x)

    return check


def _whole(
    low: int, high: int | None = None, text: str | None = None, *, extra: bool = False
) -> Handler:
    """An integer in [low, high] (no upper bound: None), stored as the field of the same
    name (``extra``: in ``params.extra``)."""

    def check(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
        if value is None:
            return
        v = _integer(name, value)
        if v < low or (high is not None and v > high):
            shown = text or (f"in [{low}, {high}]" if high is not None else f"at least {low}")
            raise ParamError(name, f"'{name}' must be {shown}, got {v}")
        if extra:
            params.extra[name] = v
        else:
            setattr(params, name, v)

    return check


def _repetition_penalty(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    if value is None:
        return
    x = _number(name, value)
    if x <= 0:
        raise ParamError(name, f"'{name}' must be greater than zero, got {x:g}")
    params.repetition_penalty = x


def _top_k(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    if value is None:
        return
    k = _integer(name, value)
    if k < -1:
        raise ParamError(name, f"'top_k' must be -1 or 0 (disable), or at least 1, got {k}")
    params.top_k = max(k, 0)


def _flag(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    """A boolean stored as the field of the same name."""
    if value is not None:
        setattr(params, name, _boolean(name, value))


def _logit_bias(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    """Token id (a string or an int) -> bias; biases clamped to [-100, 100] as vLLM does."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ParamError(name, "'logit_bias' must be an object mapping token ids to numbers")
    bias: dict[int, float] = {}
    for key, raw in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ParamError(name, f"'logit_bias' key {key!r} is not a token id") from None
        if not 0 <= token < ctx.vocab_size:
            raise ParamError(
                name, f"'logit_bias' token id {token} is out of vocabulary range({ctx.vocab_size})"
            )
        bias[token] = min(100.0, max(-100.0, _number(name, raw)))
    params.logit_bias = bias


def _logprobs(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    if value is None:
        return
    if ctx.chat:  # a boolean; the count is top_logprobs
        if _boolean(name, value):
            params.logprobs = 0
        return
    count = _integer(name, value)
    if not 0 <= count <= MAX_LOGPROBS:
        raise ParamError(name, f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {count}")
    params.logprobs = count


def _max_tokens(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    if value is None:
        return
    if not _is_int(value):
        raise ParamError(name, f"'{name}' must be an integer, got {value!r}")
    if not 1 <= value <= ctx.max_tokens_limit:
        raise ParamError(name, f"'{name}' must be in [1, {ctx.max_tokens_limit}], got {value}")
    params.max_tokens = value
    params.max_tokens_set = True


def _stream(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    if value is None:
        return
    if not isinstance(value, bool):
        raise ParamError(name, f"'stream' must be a boolean, got {value!r}")
    params.stream = value


def _stream_options(name: str, value: Any, params: RequestParams, ctx: _Context) -> None:
    if value is None:
        return
    params.stream_options_set = True
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


GRAMMAR = "is not supported: this server has no grammar-constrained decoding"
TOOLS = "is not supported: this server has no tool-call parser"

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
    "min_tokens": _whole(0),
    "include_stop_str_in_output": _flag,
    "user": _metadata,
    "seed": _whole(-(2**63), 2**63 - 1, "fit in 64 bits"),
    "n": _whole(1, MAX_N),
    "temperature": _ranged(0.0, 2.0),
    "top_p": _ranged(0.0, 1.0, open_low=True),
    "top_k": _top_k,
    "min_p": _ranged(0.0, 1.0),
    "presence_penalty": _ranged(-2.0, 2.0),
    "frequency_penalty": _ranged(-2.0, 2.0),
    "repetition_penalty": _repetition_penalty,
    "logit_bias": _logit_bias,
    "logprobs": _logprobs,
    "top_logprobs": _whole(0, MAX_LOGPROBS, extra=True),
    "echo": _flag,
    "best_of": unsupported(1, why="must be 1 (as in vLLM's V1 engine)"),
    "suffix": unsupported("", why="is not supported (no fill-in-the-middle)"),
    "tools": unsupported([], why=TOOLS),
    "tool_choice": unsupported("none", why=TOOLS),
    "parallel_tool_calls": unsupported(),
    "functions": unsupported([], why=TOOLS),
    "function_call": unsupported("none", why=TOOLS),
    "response_format": unsupported({"type": "text"}, why=GRAMMAR),
    "structured_outputs": unsupported(why=GRAMMAR),
    "guided_json": unsupported(why=GRAMMAR),
    "guided_regex": unsupported(why=GRAMMAR),
    "guided_choice": unsupported(why=GRAMMAR),
    "guided_grammar": unsupported(why=GRAMMAR),
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
