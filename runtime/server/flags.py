"""``runtime.server``'s command line: ``runtime.serve``'s model, mesh and cache flags plus
the HTTP ones, their checks (before any work), the prompt limits they set, and the check
that the port is free."""

from __future__ import annotations

import argparse
import errno
import json
import socket
from dataclasses import dataclass
from pathlib import Path

import runtime.serve.main as serve
from runtime.launch import API_KEY_ENV
from runtime.serve.flags import HelpFormatter
from runtime.server.guard import DEFAULT_MAX_BODY_BYTES
from runtime.server.params import ParamError

# serve.py's flags that pick a workload or write a report: meaningless for a server.
_TRACE_ONLY = (
    "prompts",
    "workload",
    "sessions",
    "turns",
    "first_prompt_len",
    "append_len",
    "json",
    "dump_logits",
    "log_every",
    "quiet",
    "request_rate",
    "think_s",
)


def build_parser() -> argparse.ArgumentParser:
    """``runtime.serve``'s model, mesh and cache flags plus the HTTP ones."""
    p = serve.build_parser()
    p.prog = "runtime.server"
    p.description = "An OpenAI-compatible HTTP server over the engine and HiCache."
    p.formatter_class = HelpFormatter
    for action in p._actions:
        if action.dest in _TRACE_ONLY:
            action.help = argparse.SUPPRESS
        elif action.dest == "max_new_tokens":
            action.default = 16
            action.help = "max_tokens of a request that does not set it (vLLM's 16)"
        elif action.dest == "concurrency":
            action.default = 8
            action.help = (
                "most requests in flight, served in one running batch by runtime.scheduler "
                "(continuous batching); 1: one request at a time (Engine.serve)"
            )
        elif action.dest == "token_budget":
            action.help = "prefill tokens per scheduler step beside the batched decode"
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: pick a free one)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id of /v1/models and requests (default: the --model name)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=1024,
        help="largest max_tokens a request may ask for",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longest prompt (tokens) a request may send, checked before any work "
        f"(default: the checkpoint's context length, {PRESET_PROMPT_TOKENS} for a preset)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="most tokens of prompt plus answer; a longer prompt is refused, max_tokens is "
        "clipped to what is left (default: the checkpoint's positions; none for a preset)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body; a larger one is refused (413) before it is read",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
        f"${API_KEY_ENV}, else none); prefer the variable: a flag shows in the process list",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host/Origin name a loopback-bound server also answers (repeatable; "
        "default: loopback names only)",
    )
    p.add_argument(
        "--drain-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds the requests in flight may take to finish before "
        "they are aborted",
    )
    return p


PRESET_PROMPT_TOKENS = 32768
"""``--max-prompt-tokens`` of a model that states no context length (a preset)."""


def context_length(checkpoint_dir: Path | None) -> int | None:
    """The context length a checkpoint's ``config.json`` states (None: none)."""
    if checkpoint_dir is None:
        return None
    try:
        config = json.loads((checkpoint_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def prompt_limits(args: argparse.Namespace, context: int | None) -> PromptLimits:
    """The limits of ``args`` for a checkpoint of ``context`` positions (None: not
    stated). ``ValueError`` for a ``--max-model-len`` past the checkpoint's positions."""
    if args.max_model_len is not None:
        if context is not None and args.max_model_len > context:
            raise ValueError(
                f"--max-model-len {args.max_model_len} is past the checkpoint's {context} positions"
            )
        context = args.max_model_len
    limit = args.max_prompt_tokens
    if limit is None:
        limit = context if context is not None else PRESET_PROMPT_TOKENS
    return PromptLimits(limit, context)


def served_name(args: argparse.Namespace) -> str:
    return args.served_model_name or Path(args.model).name or str(args.model)


class PortBusy(Exception):
    """The HTTP port cannot be bound (in use, or a bad address)."""


def check_port_free(host: str, port: int) -> None:
    """``PortBusy`` naming the address when ``host:port`` cannot be bound now (before
    the model is built; the real bind still checks)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as err:
        raise PortBusy(f"--host {host!r}: {err.strerror or err}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as err:
                raise PortBusy(bind_message(host, port, err)) from None


def bind_message(host: str, port: int, err: OSError) -> str:
    if err.errno == errno.EADDRINUSE:
        return f"{host}:{port} is already in use; pick another --port (0: a free one)"
    return f"cannot listen on {host}:{port}: {err.strerror or err}"


def check_server_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming a bad HTTP flag."""
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_tokens_limit < args.max_new_tokens:
        raise ValueError(
            f"--max-tokens-limit {args.max_tokens_limit} is below --max-new-tokens "
            f"{args.max_new_tokens}"
        )
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ValueError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    if not args.drain_s >= 0:
        raise ValueError(f"--drain-s must be >= 0 seconds, got {args.drain_s}")


@dataclass(frozen=True)
class PromptLimits:
    """How long a request may be: ``max_prompt_tokens`` prompt tokens, and at most
    ``context`` (``--max-model-len``; None: not stated) prompt plus answer."""

    max_prompt_tokens: int
    context: int | None = None

    def check(self, prompt_tokens: int, max_tokens: int) -> int:
        """``max_tokens`` clipped to the context, as vLLM does; ``ParamError`` for a
        request over a limit (before any work is queued)."""
        if self.context is not None and prompt_tokens >= self.context:
            raise ParamError(
                "prompt",
                f"this model's maximum context length is {self.context} tokens "
                f"(--max-model-len); the prompt has {prompt_tokens} tokens, which leaves no "
                "room for an answer",
            )
        if prompt_tokens > self.max_prompt_tokens:
            raise ParamError(
                "prompt",
                f"the prompt has {prompt_tokens} tokens; this server takes at most "
                f"{self.max_prompt_tokens} (--max-prompt-tokens)",
            )
        if self.context is None:
            return max_tokens
        if max_tokens > self.context:
            raise ParamError(
                "max_tokens",
                f"'max_tokens'={max_tokens} cannot be greater than the maximum context "
                f"length {self.context} (--max-model-len)",
            )
        return min(max_tokens, self.context - prompt_tokens)
