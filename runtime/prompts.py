"""Requests from a JSON-lines file (``runtime.serve --prompts FILE.jsonl``).

One request per line, an object with exactly one of

- ``"input_ids"``: a list of token ids, or
- ``"text"``: a string, tokenized with the checkpoint's ``tokenizer.json`` (the
  ``tokenizers`` package; special tokens as the tokenizer's post-processor adds them),

and optionally ``"session"`` (any JSON scalar: later lines of the same session are its
next turns, the prompt being the session's history, i.e. previous prompt + answer, then
this line's tokens), ``"max_new_tokens"`` (default: ``--max-new-tokens``) and
``"tenant"`` (a string: the request's cache tenant, default ``--tenant``; tenants share
no cache entry in any tier) and ``"stop_at_eos"`` (a boolean, default false: end the
answer at any of the checkpoint's end-of-sequence ids, included in the output, instead
of always generating ``max_new_tokens``), ``"arrival_s"`` (a number >= 0: trace seconds at which a
session's first turn arrives; on a later turn "not before") and ``"think_s"`` (a number
>= 0: a later turn arrives this long after its session's previous answer). Times are
honoured by ``runtime.serve``'s scheduler path (real-time replay). Blank lines are
skipped. Requests are served in file order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mesh_hicache.config import TENANT_SEPARATOR
from runtime.workloads import Turn, check_seconds


def load_tokenizer(path: Path | None) -> Any:
    """A ``tokenizers.Tokenizer`` from ``path`` (None: no tokenizer)."""
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError as err:  # pragma: no cover - the hf extra installs it
        raise ValueError("text prompts need tokenizers: pip install -e '.[hf]'") from err
    return Tokenizer.from_file(str(path))


def load_prompts(
    path: str | Path,
    vocab_size: int,
    tokenizer: Any = None,
    eos_token_ids: Sequence[int] = (),
) -> list[Turn]:
    """The trace of ``path``; ``ValueError`` naming the line of any bad request.
    ``eos_token_ids``: the checkpoint's end-of-sequence ids (``stop_at_eos`` needs one)."""
    turns: list[Turn] = []
    sessions: dict[str, int] = {}
    next_turn: dict[int, int] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise ValueError(f"--prompts {str(path)!r}: {err}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"--prompts {path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected an object, got {type(item).__name__}")
        unknown = set(item) - {"input_ids", "text", "session", "max_new_tokens", "tenant"}
        unknown -= {"stop_at_eos", "arrival_s", "think_s"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        ids = _token_ids(item, where, vocab_size, tokenizer)
        if "session" in item:
            key = json.dumps(item["session"])
            session = sessions.setdefault(key, len(sessions))
        else:
            session = len(sessions)
            sessions[f"line:{number}"] = session
        max_new = item.get("max_new_tokens")
        if max_new is not None and (not isinstance(max_new, int) or max_new < 1):
            raise ValueError(f"{where}: max_new_tokens must be an int >= 1, got {max_new!r}")
        tenant = item.get("tenant")
        if tenant is not None and (not isinstance(tenant, str) or TENANT_SEPARATOR in tenant):
            raise ValueError(
                f"{where}: tenant must be a string without {TENANT_SEPARATOR!r}, got {tenant!r}"
            )
        stop_at_eos = item.get("stop_at_eos", False)
        if not isinstance(stop_at_eos, bool):
            raise ValueError(f"{where}: stop_at_eos must be a boolean, got {stop_at_eos!r}")
        if stop_at_eos and not eos_token_ids:
            raise ValueError(f"{where}: stop_at_eos, but the model names no eos_token_id")
        times: dict[str, float] = {}
        for key in ("arrival_s", "think_s"):
            if key in item:
                try:
                    times[key] = check_seconds(key, item[key])
                except (TypeError, ValueError) as err:
                    raise ValueError(f"{where}: {err}") from None
        turn = next_turn.get(session, 0)
        next_turn[session] = turn + 1
        if turn == 0 and times.get("think_s"):
            raise ValueError(
                f"{where}: think_s={times['think_s']!r} on a session's first turn (it has no "
                "previous answer); give arrival_s"
            )
        stops = tuple(eos_token_ids) if stop_at_eos else ()
        turns.append(
            Turn(
                len(turns),
                session,
                turn,
                tuple(ids),
                max_new_tokens=max_new,
                tenant=tenant,
                stop_tokens=stops,
                arrival_s=times.get("arrival_s"),
                think_s=times.get("think_s", 0.0),
            )
        )
    if not turns:
        raise ValueError(f"--prompts {str(path)!r} holds no requests")
    return turns


def _token_ids(item: dict, where: str, vocab_size: int, tokenizer: Any) -> list[int]:
    if ("input_ids" in item) == ("text" in item):
        raise ValueError(f"{where}: give exactly one of 'input_ids' and 'text'")
    if "text" in item:
        if tokenizer is None:
            raise ValueError(f"{where}: a 'text' prompt needs a checkpoint with tokenizer.json")
        if not isinstance(item["text"], str):
            raise ValueError(f"{where}: 'text' must be a string")
        ids = list(tokenizer.encode(item["text"]).ids)
    else:
        ids = item["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError(f"{where}: 'input_ids' must be a list of ints")
    if not ids:
        raise ValueError(f"{where}: the request has no tokens")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{where}: token ids {bad[:5]} not in range({vocab_size})")
    return ids
