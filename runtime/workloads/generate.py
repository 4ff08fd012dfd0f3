"""Deterministic request traces: multi-turn chat, shared system prompt, agent loop.

A trace is a list of ``Turn``s in arrival order. A turn carries only the *new* user
tokens; the engine builds the prompt as the session's history (previous prompt +
previous answer) followed by them, because the answer is whatever the model generated.
Everything is drawn from ``random.Random(seed)``, so a seed names the same trace on
every rank and every run.

Arrival times (``with_arrivals``): a session's first turn carries ``arrival_s`` (trace
seconds; sessions start as a Poisson process at a rate), each later turn ``think_s`` (it
arrives that long after the session's previous answer, since its prompt contains that
answer). A scheduler replaying in real time honours them; ``Engine.run`` ignores them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

WORKLOADS = ("multiturn", "shared-prefix", "agent")


@dataclass(frozen=True, slots=True)
class Turn:
    """One request: ``session``'s turn ``turn`` appends ``user_tokens`` to its history."""

    request_id: int
    session: int
    turn: int
    user_tokens: tuple[int, ...]
    namespace: str = ""
    max_new_tokens: int | None = None
    """Tokens to generate for this turn (None: the engine's default)."""
    tenant: str | None = None
    """The request's cache tenant (None: the cache's ``HiCacheConfig.tenant``)."""
    stop_token: int | None = None
    """Generation ends after this token id (None: never)."""
    stop_tokens: tuple[int, ...] = ()
    """Generation also ends after any of these (the checkpoint's end-of-sequence ids)."""
    arrival_s: float | None = None
    """Trace seconds at which the request arrives (None: at once for a first turn, and
    for a later turn its previous answer plus ``think_s``; on a later turn a time means
    "not before")."""
    think_s: float = 0.0
    """A later turn arrives this many seconds after its session's previous answer."""

    def __post_init__(self) -> None:
        if self.arrival_s is not None:
            check_seconds("Turn.arrival_s", self.arrival_s)
        check_seconds("Turn.think_s", self.think_s)

    @property
    def timed(self) -> bool:
        """True when the turn carries an arrival time or a think time."""
        return self.arrival_s is not None or self.think_s > 0


def check_seconds(what: str, value: object) -> float:
    """``value`` as seconds: a finite int or float >= 0 (not a bool); ``ValueError``
    (``TypeError`` for a non-number) naming ``what`` and the value otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def with_arrivals(
    trace: Sequence[Turn], rate: float | None, *, seed: int = 0, think_s: float = 0.0
) -> list[Turn]:
    """``trace`` with arrival times: the first session's first turn arrives at 0, each
    next session's (in trace order) an exponential gap with mean ``1 / rate`` after the
    previous one's (a Poisson process of ``rate`` sessions per second; ``rate=None``:
    every first turn at 0), and each later turn ``think_s`` after its previous answer, drawn
    exponential with mean ``think_s`` (0: at once). Seeded: the same times on every rank.
    Times already in ``trace`` are replaced."""
    if rate is not None:
        check_seconds("rate", rate)
        if not rate > 0:
            raise ValueError(f"rate must be > 0 requests per second, got {rate!r}")
    check_seconds("think_s", think_s)
    rng = random.Random(seed * 1_000_003 + 7919)  # own stream: the tokens stay as they are
    clock = 0.0
    seen: set[int] = set()
    out: list[Turn] = []
    for turn in trace:
        if turn.session not in seen:
            seen.add(turn.session)
            if rate is not None and seen != {turn.session}:
                clock += rng.expovariate(rate)
            out.append(replace(turn, arrival_s=clock, think_s=0.0))
        else:
            think = rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0
            out.append(replace(turn, arrival_s=None, think_s=think))
    return out


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(n))


def make_workload(
    name: str,
    *,
    sessions: int,
    turns: int,
    vocab: int,
    seed: int = 0,
    first_prompt_len: int = 512,
    append_len: int = 64,
) -> list[Turn]:
    """Build a trace.

    - ``multiturn``: ``sessions`` chats of ``turns`` turns; each first prompt is a shared
      32-token instruction plus ``first_prompt_len - 32`` session tokens; later turns
      append ``append_len`` tokens. Sessions are interleaved turn by turn, the order
      under which a small L1 is evicted between a session's turns.
    - ``shared-prefix``: ``sessions * turns`` single-turn requests that share one
      ``first_prompt_len``-token system prompt followed by ``append_len`` own tokens.
    - ``agent``: ``sessions`` long contexts (``2 * first_prompt_len``) extended by small
      appends (``append_len // 4`` tokens) for ``turns`` turns each, sessions interleaved.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    for field_name, value in (("sessions", sessions), ("turns", turns), ("vocab", vocab)):
        if value < 1:
            raise ValueError(f"{field_name} must be >= 1, got {value}")
    if first_prompt_len < 33 or append_len < 4:
        raise ValueError(
            f"first_prompt_len must be >= 33 and append_len >= 4, got "
            f"{first_prompt_len} and {append_len}"
        )
    rng = random.Random(seed)
    trace: list[Turn] = []
    if name == "shared-prefix":
        system = _tokens(rng, first_prompt_len, vocab)
        for i in range(sessions * turns):
            own = _tokens(rng, append_len, vocab)
            trace.append(Turn(i, session=i, turn=0, user_tokens=system + own))
        return trace
    if name == "multiturn":
        instruction = _tokens(rng, 32, vocab)
        first = [instruction + _tokens(rng, first_prompt_len - 32, vocab) for _ in range(sessions)]
        step = append_len
    else:
        first = [_tokens(rng, 2 * first_prompt_len, vocab) for _ in range(sessions)]
        step = max(append_len // 4, 1)
    for t in range(turns):
        for s in range(sessions):
            tokens = first[s] if t == 0 else _tokens(rng, step, vocab)
            trace.append(Turn(len(trace), session=s, turn=t, user_tokens=tokens))
    return trace
