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

The whole file is checked before any request is served (types, token ids in the
vocabulary, booleans where numbers belong, lines of at most ``MAX_LINE_BYTES``, nesting);
the first problem is a ``ValueError`` naming ``file:line``. The file is read one line at
a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mesh_hicache.config import TENANT_SEPARATOR
from runtime.workloads.generate import Turn, check_seconds

MAX_LINE_BYTES = 32 << 20
"""The longest line of a prompts file (about 4 million token ids)."""


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
    for number, item in _objects(path):
        where = f"--prompts {path}:{number}"
        unknown = set(item) - {"input_ids", "text", "session", "max_new_tokens", "tenant"}
        unknown -= {"stop_at_eos", "arrival_s", "think_s"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        ids = _token_ids(item, where, vocab_size, tokenizer)
        if "session" in item and isinstance(item["session"], dict | list):
            raise ValueError(f"{where}: session must be a JSON scalar, got {item['session']!r}")
        if "session" in item:
            key = json.dumps(item["session"])
            session = sessions.setdefault(key, len(sessions))
        else:
            session = len(sessions)
            sessions[f"line:{number}"] = session
        max_new = item.get("max_new_tokens")
        if max_new is not None and (not _is_int(max_new) or max_new < 1):
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _objects(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of every non-blank line, read one line at a time (the
    file need not fit in memory; a line may hold at most ``MAX_LINE_BYTES``).
    ``ValueError`` naming ``file:line`` for a line that is not a JSON object."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, also on a generator exit
    except OSError as err:
        raise ValueError(f"--prompts {str(path)!r}: {err.strerror or err}") from None
    with f:
        number = 0
        while True:
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
            except OSError as err:
                raise ValueError(f"--prompts {path}: {err.strerror or err}") from None
            if not raw:
                return
            number += 1
            where = f"--prompts {path}:{number}"
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{where}: the line is longer than {MAX_LINE_BYTES} bytes")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8 ({err.reason})") from None
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except RecursionError:
                raise ValueError(f"{where}: nested too deeply") from None
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not JSON ({err})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{where}: expected an object, got {type(item).__name__}")
            yield number, item


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
        if not isinstance(ids, list):
            raise ValueError(f"{where}: 'input_ids' must be a list of ints")
        wrong = next((i for i in ids if not _is_int(i)), None)
        if wrong is not None or any(not _is_int(i) for i in ids):
            raise ValueError(f"{where}: 'input_ids' must be a list of ints, not {wrong!r}")
    if not ids:
        raise ValueError(f"{where}: the request has no tokens")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{where}: token ids {bad[:5]} not in range({vocab_size})")
    return ids
