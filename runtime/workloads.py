"""Deterministic request traces: multi-turn chat, shared system prompt, agent loop.

A trace is a list of ``Turn``s in arrival order. A turn carries only the *new* user
tokens; the engine builds the prompt as the session's history (previous prompt +
previous answer) followed by them, because the answer is whatever the model generated.
Everything is drawn from ``random.Random(seed)``, so a seed names the same trace on
every rank and every run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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
    """Generation ends after this token id (e.g. end of sequence; None: never)."""


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
