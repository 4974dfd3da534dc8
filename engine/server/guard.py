"""The server's outer guard: what every request passes before a route sees it.

- A request from a web page of another site is refused (403). The server has no
  authentication, and any page the user visits can send a "simple" cross-site POST (no body,
  or a text/plain one) to http://127.0.0.1:8008 without the browser asking first: it could
  stop heists, start them until every slot is taken, or journal a BUSTED verdict that spoils
  the game for good. Browsers name the page's origin in `Origin` (and `Sec-Fetch-Site`);
  scripts such as curl send neither and are served as before.
- Bound to a loopback address, the server answers only requests addressed to a loopback name
  (`Host`): a site that rebinds its own DNS name to 127.0.0.1 is same-origin with itself, so
  only the Host it uses gives it away.
- A request body is at most `MAX_BODY_BYTES` (413 before it is read any further): the
  largest body the API takes (a crew of 100,000 characters, each escaped) is well below it.
- A POST body must be sent as JSON (`Content-Type: application/json`): 422 saying so, rather
  than a validation error about a "dictionary" that quotes the bytes back.
- Every error is JSON: the few that the framework answers in plain text itself (a malformed
  or unsatisfiable `Range` on a static file) are rewritten as `{"error": "..."}`.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: the largest request body taken, in bytes
MAX_BODY_BYTES = 1024 * 1024
#: methods that change nothing: no Origin check, and no body is read
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})

ErrorResponse = Callable[..., Any]


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine
    only."""
    name = host.strip().strip("[]").lower()
    if name in _LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The name of a Host header's value without its port."""
    value = value.strip()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    """ASGI middleware: the checks above, in that order, before the app."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        error_response: ErrorResponse,
        loopback_only: bool = False,
        allowed_hosts: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.error_response = error_response
        self.loopback_only = loopback_only
        self.allowed_hosts = frozenset(h.strip().strip("[]").lower() for h in allowed_hosts)

    def _host_allowed(self, host: str) -> bool:
        name = _host_name(host).strip("[]").lower()
        return is_loopback(name) or name in self.allowed_hosts

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, status: int, message: str
    ) -> None:
        await self.error_response(status, message)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        method = str(scope["method"]).upper()
        host = headers.get("host")
        if self.loopback_only and host is not None and not self._host_allowed(host):
            await self._refuse(
                scope,
                receive,
                send,
                403,
                f"host {host!r} refused: this server listens on this machine only and answers "
                "requests addressed to localhost or a loopback address (a proxy that forwards "
                "another name: `car serve --allow-host NAME`)",
            )
            return
        if method not in SAFE_METHODS:
            refused = _cross_site(headers, host)
            if refused is not None:
                await self._refuse(scope, receive, send, 403, refused)
                return
            length = headers.get("content-length")
            if length is not None and length.strip().isdigit() and int(length) > MAX_BODY_BYTES:
                await self._refuse(scope, receive, send, 413, _too_large(int(length)))
                return
            body = await _read_body(receive)
            if body is None:  # the client went away while sending
                return
            if len(body) > MAX_BODY_BYTES:
                await self._refuse(scope, receive, send, 413, _too_large(None))
                return
            ctype = headers.get("content-type")
            if body.strip() and not _is_json(ctype):
                await self._refuse(
                    scope,
                    receive,
                    send,
                    422,
                    "bad request: the body must be JSON sent with Content-Type: "
                    f"application/json (got {'no Content-Type' if ctype is None else repr(ctype)})",
                )
                return
            receive = _replay(body, receive)
        if method == "HEAD":
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _json_errors(send))


def _cross_site(headers: Headers, host: str | None) -> str | None:
    """Why a state-changing request comes from another site's page, or None."""
    origin = headers.get("origin")
    if headers.get("sec-fetch-site", "").lower() == "cross-site":
        return f"cross-site request refused (from {origin or 'another site'!r})"
    if origin is None:
        return None
    netloc = urlsplit(origin).netloc if origin != "null" else ""
    if not netloc or host is None or netloc.lower() != host.strip().lower():
        return (
            f"cross-site request refused: a page of {origin!r} may not act on this server "
            "(send the request without an Origin header, or from the dashboard)"
        )
    return None


def _too_large(length: int | None) -> str:
    got = "" if length is None else f" ({length} bytes)"
    return f"request body too large{got}: the server takes at most {MAX_BODY_BYTES} bytes"


def _is_json(ctype: str | None) -> bool:
    if ctype is None:
        return False
    mime = ctype.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (
        mime.startswith("application/") and mime.endswith("+json")
    )


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or what of it exceeds the limit by a byte; None when the client
    disconnected."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BODY_BYTES or not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body read already, then the client's messages
    (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _json_errors(send: Send) -> Send:
    """A `send` that turns a plain-text error response into a JSON error."""
    held: Message | None = None
    parts: list[bytes] = []

    async def wrapped(message: Message) -> None:
        nonlocal held
        if message["type"] == "http.response.start" and held is None:
            status = int(message["status"])
            ctype = Headers(raw=message.get("headers", [])).get("content-type", "")
            if status >= 400 and not ctype.startswith("application/json"):
                held = message
                return
        elif held is not None and message["type"] == "http.response.body":
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            status = int(held["status"])
            text = b"".join(parts).decode("utf-8", "replace").strip()
            if not text:
                try:
                    text = HTTPStatus(status).phrase
                except ValueError:
                    text = f"HTTP {status}"
            body = json.dumps({"error": text}).encode()
            keep = [
                (k, v)
                for k, v in held.get("headers", [])
                if k.lower() not in (b"content-type", b"content-length")
            ]
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [
                        *keep,
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await send(message)

    return wrapped
