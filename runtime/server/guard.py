"""What ``runtime.server`` checks before a request reaches a handler, and how it reads a
body: access (API key, ``Host``/``Origin`` on a loopback bind, JSON-only posts) and limits
(body size, malformed bodies). Every refusal is an OpenAI-shaped error body.

- ``--api-key`` (or ``MESH_HICACHE_API_KEY``): every endpoint but ``GET /health`` needs
  ``Authorization: Bearer <key>``, compared in constant time; 401 otherwise.
- A server bound to a loopback address answers only requests whose ``Host`` names a
  loopback address (or an ``--allowed-host``) and whose ``Origin``, if any, does too: a
  web page on another site cannot reach it through DNS rebinding (403).
- A ``POST`` must say ``Content-Type: application/json`` (415): a browser's simple
  cross-origin form post cannot, and anything else needs a CORS preflight, which this
  server never grants.
- A body over ``--max-body-bytes`` is a 413, from ``Content-Length`` before any byte is
  read, or as soon as a chunked body passes the limit.
- A body that is not UTF-8 JSON (another charset, a bad ``Content-Encoding``, invalid
  bytes, nesting too deep, ``NaN``) is a 400, with no traceback in the log.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

log = logging.getLogger("runtime.server")

DEFAULT_MAX_BODY_BYTES = 8 << 20
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
OPEN_PATHS = frozenset({"/health"})
"""Paths answered without the API key (liveness probes)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> web.Response:
    """An OpenAI-shaped error body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return web.json_response(body, status=status, headers=headers)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _hostname(value: str) -> str | None:
    """The host of a ``Host`` header (``name[:port]``, ``[v6][:port]``); None if malformed."""
    try:
        parts = urlsplit("//" + value)
        return parts.hostname  # lower-cased, brackets stripped
    except ValueError:
        return None


class Guard:
    """The access checks of one server (an aiohttp middleware)."""

    def __init__(
        self,
        bind_host: str,
        api_key: str | None = None,
        allowed_hosts: Iterable[str] = (),
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.api_key = api_key.encode() if api_key else None
        self.loopback = is_loopback(bind_host)
        self.allowed = {h.lower() for h in allowed_hosts} | LOOPBACK_NAMES | {bind_host.lower()}
        self.max_body_bytes = max_body_bytes

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        refused = self.refusal(request)
        if refused is not None:
            return refused
        try:
            return await handler(request)
        except web.HTTPException as err:  # aiohttp's own 404, 405, 413...
            if err.status < 400:
                raise
            return error_response(err.status, err.reason)

    def refusal(self, request: web.Request) -> web.Response | None:
        """The error response for a request that may not proceed, else None."""
        if self.loopback:
            host = request.headers.get("Host")
            if host is not None and _hostname(host) not in self.allowed:
                return error_response(
                    403,
                    f"Host {host!r} is not this server (a loopback bind answers only "
                    "loopback names; --allowed-host adds one)",
                    "forbidden_host",
                )
            origin = request.headers.get("Origin")
            if origin is not None and _origin_host(origin) not in self.allowed:
                return error_response(
                    403, f"cross-origin request from {origin!r} refused", "forbidden_origin"
                )
        if self.api_key is not None and request.path not in OPEN_PATHS:
            if not self._authorized(request.headers.get("Authorization", "")):
                return error_response(401, "a valid API key is required (Authorization: Bearer)")
        if request.method == "POST":
            if request.content_type != "application/json":
                return error_response(
                    415, f"Content-Type must be application/json, got {request.content_type!r}"
                )
            length = request.content_length
            if length is not None and length > self.max_body_bytes:
                return _too_large(self.max_body_bytes)
        return None

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            token = ""
        assert self.api_key is not None
        # compare_digest takes time independent of where the strings differ.
        return hmac.compare_digest(token.strip().encode(), self.api_key)


def _origin_host(origin: str) -> str | None:
    if origin == "null":
        return None
    try:
        return urlsplit(origin).hostname
    except ValueError:
        return None


def _too_large(limit: int) -> web.Response:
    return error_response(413, f"the request body is larger than --max-body-bytes {limit}")


class BodyError(Exception):
    """A request body that cannot be read; ``response`` is the error to send."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.text)
        self.response = response


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


async def read_json(request: web.Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object (``BodyError`` with the 4xx to send)."""
    charset = (request.charset or "utf-8").lower()
    if charset not in ("utf-8", "utf8"):
        raise BodyError(error_response(400, f"charset {charset!r} is not supported; send UTF-8"))
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > max_bytes:
                response = _too_large(max_bytes)
                response.force_close()
                raise BodyError(response)
            chunks.append(chunk)
    except BodyError:
        raise
    except Exception as err:  # a bad Content-Encoding or a broken chunked body
        # The rest of the body cannot be read either: end it here (else aiohttp reads
        # it again after the response and logs the same error with a traceback) and
        # close the connection after the answer.
        request.content.feed_eof()
        message = f"the request body cannot be read ({type(err).__name__}: {err})"
        response = error_response(400, " ".join(message.split())[:300])
        response.force_close()
        raise BodyError(response) from None
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as err:
        raise BodyError(error_response(400, f"the request body is not UTF-8 ({err})")) from None
    try:
        body = json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise BodyError(error_response(400, "the request body is nested too deeply")) from None
    except ValueError as err:
        raise BodyError(error_response(400, f"the request body is not JSON ({err})")) from None
    if not isinstance(body, dict):
        raise BodyError(error_response(400, "the request body must be a JSON object"))
    return body
