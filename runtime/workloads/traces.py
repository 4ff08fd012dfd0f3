"""Seeded hit-rate traces: multi-turn chat, long-reply chat, an agent loop (JSONL files).

A trace is a list of ``TraceRequest``s in arrival order. Unlike ``runtime.workloads``
(turns that carry only the new tokens; the engine builds the prompt), a trace request
carries the *full* prompt (``input_tokens``, history included) and the reply
(``output_tokens``), so a cache simulator can replay it without a model. That is the
format of ``scripts/bench_hitrate.py``: one JSON object per line with ``session_id``,
``turn``, ``input_tokens`` and ``output_tokens``.

Shapes (``SHAPES``):

- ``chat``: sessions of a few turns; each prompt is the session's history (previous
  prompt + previous reply) plus a new user message. Message and reply lengths are
  log-normal (medians ``user_median`` / ``reply_median``), long-tailed like ShareGPT.
- ``long-replies``: the same with long replies (median 1,000 tokens), so most of the
  history is model output and the decode-boundary checkpoint carries the reuse.
- ``agent``: every session starts with one shared ``system_len``-token system prompt
  (4k) and its own task; each step's reply is an action, followed by an observation
  (a tool result) in the next prompt. Only the last ``keep_observations`` observations
  are kept verbatim; older ones are collapsed into a short marker, so every step
  rewrites the prompt from the first newly collapsed observation on (the prefix diverges
  in the middle of the cached path: a branch point).

Arrivals: sessions start as a Poisson process (``session_rate`` per second) and a
session's next turn comes ``think_s`` (exponential) after the previous one, so turns of
many sessions interleave and the reuse distance grows with the number of live sessions.
Every request carries its planned ``arrival_s`` (trace seconds) and a later turn its drawn
gap ``think_s``; the JSONL lines hold both (optional when read: a file without them is a
trace without times). A model-free replay reads ``arrival_s``; a serving replay, where a
later turn can only start once its previous answer exists, reads ``think_s`` as the time
after that answer and ``arrival_s`` as "not before".

Determinism: everything is drawn from ``random.Random(seed)`` before any reply is known,
in a fixed order; ``respond`` (e.g. a real model) may replace the drawn replies (same
lengths) without changing anything else, which is how the engine-agreement test builds
a trace whose replies are the engine's own greedy tokens.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields, replace

from runtime.workloads.generate import check_seconds

Respond = Callable[[tuple[int, ...], int], Sequence[int]]
"""``respond(input_tokens, num_output)``: the reply to a prompt, exactly ``num_output`` ids."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: the full prompt and the reply, in token ids."""

    session_id: int | str
    """Generated traces number sessions 0, 1, ...; other traces may name them."""
    turn: int
    input_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    arrival_s: float | None = None
    """Planned arrival, trace seconds (None: no time; generated traces always set it)."""
    think_s: float = 0.0
    """A later turn: seconds after the session's previous request (0 for a first turn)."""

    def __post_init__(self) -> None:
        if self.arrival_s is not None:
            check_seconds("TraceRequest.arrival_s", self.arrival_s)
        check_seconds("TraceRequest.think_s", self.think_s)

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "session_id": self.session_id,
            "turn": self.turn,
            "input_tokens": list(self.input_tokens),
            "output_tokens": list(self.output_tokens),
        }
        if self.arrival_s is not None:
            out["arrival_s"] = self.arrival_s
        if self.think_s:
            out["think_s"] = self.think_s
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceShape:
    """The knobs of one trace shape (``SHAPES`` holds the defaults of each)."""

    kind: str
    """``chat`` (history + user message per turn) or ``agent`` (system + task + steps)."""
    sessions: int = 100
    """Number of sessions (conversations or agent episodes)."""
    turns_mean: float = 5.0
    """Mean turns (agent: steps) per session; 1 + geometric, capped at ``4 * turns_mean``."""
    user_median: int = 80
    """Median tokens of a user message (agent: of the task description)."""
    reply_median: int = 200
    """Median tokens of a reply (agent: of an action)."""
    sigma: float = 0.8
    """Log-normal spread of message, reply and observation lengths."""
    max_len: int = 4096
    """Cap on any one drawn length (message, reply, observation)."""
    system_len: int = 0
    """Tokens of the system prompt shared by every session (0: none)."""
    obs_median: int = 600
    """Agent: median tokens of an observation."""
    keep_observations: int = 3
    """Agent: the last this many observations stay verbatim; older ones are collapsed."""
    collapsed_len: int = 8
    """Agent: tokens of the marker that replaces a collapsed observation."""
    session_rate: float = 1.0
    """Sessions started per second (Poisson)."""
    think_s: float = 20.0
    """Mean seconds between a session's turns (exponential)."""

    def __post_init__(self) -> None:
        if self.kind not in ("chat", "agent"):
            raise ValueError(f"TraceShape.kind={self.kind!r}; choose from ('chat', 'agent')")
        for name in ("sessions", "user_median", "reply_median", "max_len", "obs_median"):
            if getattr(self, name) < 1:
                raise ValueError(f"TraceShape.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("system_len", "keep_observations", "collapsed_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"TraceShape.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("turns_mean", "session_rate", "think_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TraceShape.{name} must be > 0, got {getattr(self, name)}")
        if self.turns_mean < 1 or self.sigma < 0:
            raise ValueError(
                f"TraceShape.turns_mean must be >= 1 and sigma >= 0, got "
                f"{self.turns_mean} and {self.sigma}"
            )


SHAPES: dict[str, TraceShape] = {
    "chat": TraceShape(kind="chat"),
    "long-replies": TraceShape(kind="chat", user_median=60, reply_median=1000, max_len=8192),
    "agent": TraceShape(
        kind="agent",
        sessions=40,
        turns_mean=12.0,
        user_median=300,
        reply_median=80,
        system_len=4096,
        obs_median=600,
    ),
}


def trace_shape(name: str, **overrides: object) -> TraceShape:
    """The named shape (``chat``, ``long-replies``, ``agent``) with field overrides."""
    if name not in SHAPES:
        raise ValueError(f"unknown trace shape {name!r}; choose from {sorted(SHAPES)}")
    known = {f.name for f in fields(TraceShape)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown TraceShape fields {unknown}; valid: {sorted(known)}")
    return replace(SHAPES[name], **overrides)  # type: ignore[arg-type]


# -- generation ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Step:
    """One planned request of a session: what it appends and when it arrives."""

    arrival: float
    think: float
    """Seconds after the session's previous step (0 for its first)."""
    session: int
    turn: int
    new_tokens: tuple[int, ...]
    """chat: the user message; agent: the observation after the previous action."""
    reply: tuple[int, ...]
    """The drawn reply (``respond`` may replace it; its length is kept)."""


class _Draw:
    """Token ids and lengths from one seeded ``random.Random``."""

    def __init__(self, seed: int, vocab: int, shape: TraceShape) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.shape = shape

    def tokens(self, n: int) -> tuple[int, ...]:
        rng, vocab = self.rng, self.vocab
        return tuple(rng.randrange(vocab) for _ in range(n))

    def length(self, median: int) -> int:
        n = round(median * math.exp(self.rng.gauss(0.0, self.shape.sigma)))
        return min(max(n, 1), self.shape.max_len)

    def turns(self) -> int:
        # 1 + geometric with mean turns_mean - 1 (p = 1 / turns_mean), capped.
        p = 1.0 / self.shape.turns_mean
        n = 1
        while n < 4 * self.shape.turns_mean and self.rng.random() > p:
            n += 1
        return n


def _plan(shape: TraceShape, draw: _Draw) -> tuple[list[tuple[int, ...]], list[_Step]]:
    """Per session its opening (system + task for an agent, system for chat) and steps."""
    rng = draw.rng
    system = draw.tokens(shape.system_len)
    openings: list[tuple[int, ...]] = []
    steps: list[_Step] = []
    start = 0.0
    for s in range(shape.sessions):
        start += rng.expovariate(shape.session_rate)
        t = start
        if shape.kind == "agent":
            openings.append(system + draw.tokens(draw.length(shape.user_median)))
        else:
            openings.append(system)
        for turn in range(draw.turns()):
            gap = rng.expovariate(1.0 / shape.think_s) if turn else 0.0
            t += gap
            if shape.kind == "agent":
                new = draw.tokens(draw.length(shape.obs_median)) if turn else ()
            else:
                new = draw.tokens(draw.length(shape.user_median))
            reply = draw.tokens(draw.length(shape.reply_median))
            steps.append(_Step(t, gap, s, turn, new, reply))
    steps.sort(key=lambda st: (st.arrival, st.session, st.turn))
    return openings, steps


def make_trace(
    shape: str | TraceShape,
    *,
    seed: int = 0,
    vocab: int = 32000,
    respond: Respond | None = None,
) -> list[TraceRequest]:
    """Build a trace of ``shape`` (a name from ``SHAPES`` or a ``TraceShape``).

    Token ids are in ``range(vocab)``. ``respond`` (called in arrival order, before the
    next request is built) replaces each drawn reply with its own tokens of the same
    length. Same arguments (and the same ``respond`` behaviour), same trace.
    """
    if isinstance(shape, str):
        shape = trace_shape(shape)
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {vocab}")
    draw = _Draw(seed, vocab, shape)
    marker = draw.tokens(shape.collapsed_len)
    openings, steps = _plan(shape, draw)
    # chat: the history; agent: the (action, observation) pairs so far.
    history: dict[int, tuple[int, ...]] = {}
    pairs: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    trace: list[TraceRequest] = []
    for st in steps:
        s = st.session
        if shape.kind == "chat":
            prompt = history.get(s, openings[s]) + st.new_tokens
        else:
            done = pairs.setdefault(s, [])
            if done:
                action, _ = done[-1]
                done[-1] = (action, st.new_tokens)
            keep_from = len(done) - shape.keep_observations
            parts = [openings[s]]
            for i, (action, obs) in enumerate(done):
                parts += [action, obs if i >= keep_from else marker]
            prompt = tuple(t for part in parts for t in part)
        reply = st.reply
        if respond is not None:
            reply = tuple(int(t) for t in respond(prompt, len(st.reply)))
            if len(reply) != len(st.reply):
                raise ValueError(
                    f"respond returned {len(reply)} tokens for session {s} turn "
                    f"{st.turn}; expected {len(st.reply)}"
                )
        if shape.kind == "chat":
            history[s] = prompt + reply
        else:
            pairs[s].append((reply, ()))
        trace.append(TraceRequest(s, st.turn, prompt, reply, st.arrival, st.think))
    return trace


# -- files -----------------------------------------------------------------------------------


def write_jsonl(trace: Iterable[TraceRequest], path: str) -> int:
    """Write ``trace`` to ``path``, one JSON object per line; returns the request count."""
    n = 0
    with open(path, "w") as f:
        for req in trace:
            f.write(json.dumps(req.as_json(), separators=(",", ":")))
            f.write("\n")
            n += 1
    return n


def _ids(value: object, what: str, line: int) -> tuple[int, ...]:
    # type() is exact: bools (and floats) are not token ids.
    if (
        not isinstance(value, list)
        or not all(type(t) is int for t in value)
        or (value and min(value) < 0)
    ):
        raise ValueError(f"line {line}: {what} must be a list of non-negative ints")
    return tuple(value)


def read_jsonl(path: str) -> Iterator[TraceRequest]:
    """The requests of a JSONL trace, in file order.

    Required keys: ``session_id`` (an int or a string), ``input_tokens`` (non-empty),
    ``output_tokens`` (non-empty); ``turn`` is optional (0), so are ``arrival_s`` (None) and
    ``think_s`` (0; both numbers >= 0). ``ValueError`` names the bad line.
    """
    with open(path) as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i}: not JSON ({e})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path} line {i}: expected an object, got {type(obj).__name__}")
            missing = [k for k in ("session_id", "input_tokens", "output_tokens") if k not in obj]
            if missing:
                raise ValueError(f"{path} line {i}: missing keys {missing}")
            inputs = _ids(obj["input_tokens"], "input_tokens", i)
            outputs = _ids(obj["output_tokens"], "output_tokens", i)
            if not inputs or not outputs:
                raise ValueError(
                    f"{path} line {i}: input_tokens and output_tokens must be non-empty"
                )
            session = obj["session_id"]
            if type(session) not in (int, str):
                raise ValueError(f"{path} line {i}: session_id must be an int or a string")
            times: list[float | None] = []
            for key, default in (("arrival_s", None), ("think_s", 0.0)):
                value = obj.get(key, default)
                try:
                    times.append(None if value is None else check_seconds(key, value))
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{path} line {i}: {e}") from None
            arrival, think = times
            yield TraceRequest(
                session, int(obj.get("turn", 0)), inputs, outputs, arrival, think or 0.0
            )
