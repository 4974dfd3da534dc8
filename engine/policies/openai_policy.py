"""The OpenAI-compatible policy: LM Studio, Ollama, llama.cpp server, vLLM or a hosted API.

It passes the recorded per-step `seed`, so a local model with a fixed seed replays exactly; the
server's fingerprint and the model name are journaled as the provenance of each action.

A server is untrusted input, so this module speaks HTTP itself (stdlib `http.client`) instead of
through a client library, to hold three promises a library does not make (docs/decisions.md):

* `timeout` is a deadline on the WHOLE call - connect, send, status line, headers, body and
  every retry - enforced by a watchdog that shuts the socket down when it passes, so a server
  trickling one byte a second cannot stretch it;
* a reply is at most `max_reply_bytes` on the wire and after decompression (a gzip bomb is cut
  off when its output passes the bound, not after it was inflated), read by the reader the
  recording proxy uses too (engine.policies.bounded_reply);
* every field that reaches an event is type-checked and bounded by one msgspec Struct before
  a `Completion` is built; anything else is a `PolicyError` quoting what was received.
"""

from __future__ import annotations

import contextlib
import http.client
import math
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Annotated, Any

import msgspec

from engine.errors import ConfigError, PolicyError
from engine.policies.base import (
    AgentView,
    Completion,
    PolicyCancelled,
    history_length,
    trim_history,
)
from engine.policies.bounded_reply import (
    ReplyFault,
    ReplyTooLarge,
    ShortBody,
    TruncatedBody,
    UnsupportedEncoding,
    bounded_body,
)

DEFAULT_BASE_URL = "http://localhost:1234/v1"
DEFAULT_MAX_REPLY_BYTES = 256 * 1024
MAX_TIMEOUT_S = 24 * 3600.0
MAX_RETRIES = 10
MAX_TOKENS_LIMIT = 1_000_000
MAX_REPLY_BYTES_LIMIT = 64 * 1024 * 1024
MIN_REPLY_BYTES = 1024
# Usage counts beyond this are not counts a server could have meant.
MAX_USAGE_COUNT = 10**9
_RETRY_STATUSES = frozenset({408, 409, 429})
_BACKOFF_S = (0.25, 0.5, 1.0, 2.0)

Short = Annotated[str, msgspec.Meta(max_length=256)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_USAGE_COUNT)]


class _Message(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    message: _Message
    finish_reason: Short | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: Count = 0
    completion_tokens: Count = 0


class _Reply(msgspec.Struct):
    """The part of a chat completion the journal keeps, with its bounds; extra fields are
    ignored."""

    choices: Annotated[list[_Choice], msgspec.Meta(min_length=1, max_length=64)]
    model: Short | None = None
    system_fingerprint: Short | None = None
    usage: _Usage | None = None


class _ErrorBody(msgspec.Struct):
    error: Any = None
    message: Any = None


class _ErrorDetail(msgspec.Struct):
    code: Any = None
    type: Any = None
    message: Any = None


class _OverflowBody(msgspec.Struct):
    error: _ErrorDetail | str | None = None
    message: Any = None


_reply_decoder = msgspec.json.Decoder(_Reply)
_overflow_decoder = msgspec.json.Decoder(_OverflowBody)
#: how servers name a request longer than their context (OpenAI, llama-cpp-python and vLLM
#: "context_length_exceeded" / "maximum context length", llama.cpp's server
#: "exceed_context_size_error" / "exceeds the available context size", LM Studio "context
#: length", "context window")
_OVERFLOW_CODES = frozenset({"context_length_exceeded", "exceed_context_size_error"})
_OVERFLOW_WORDS = re.compile(
    r"context (length|size|window)|maximum context|too many tokens|prompt is too long", re.I
)
_error_decoder = msgspec.json.Decoder(_ErrorBody)


class _Fault(Exception):
    """One failed attempt: the message, and whether another attempt may help."""

    def __init__(self, message: str, *, retry: bool, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry = retry
        self.retry_after = retry_after


class _TooLong(_Fault):
    """The server refused the request as longer than its context."""


class OpenAIPolicy:
    """Chat completions over HTTP with a total deadline per call, bounded retries and replies."""

    name = "openai"

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        model: str = "local-model",
        *,
        temperature: float = 0.8,
        max_tokens: int = 160,
        timeout: float = 60.0,
        max_retries: int = 2,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.temperature = _bounded_float("temperature", temperature, 0.0, 2.0)
        self.max_tokens = _bounded_int("max_tokens", max_tokens, 1, MAX_TOKENS_LIMIT)
        self.timeout = _bounded_float("timeout", timeout, 0.001, MAX_TIMEOUT_S, low_open=True)
        self.max_retries = _bounded_int("max_retries", max_retries, 0, MAX_RETRIES)
        self.max_reply_bytes = _bounded_int(
            "max_reply_bytes", max_reply_bytes, MIN_REPLY_BYTES, MAX_REPLY_BYTES_LIMIT
        )
        from engine.urls import http_url_problem

        problem = http_url_problem(base_url)
        if problem is not None:
            raise ConfigError(f"bad LLM server URL {base_url!r}: {problem}")
        parts = urllib.parse.urlsplit(base_url)
        self._port = parts.port
        self._https = parts.scheme == "https"
        assert parts.hostname is not None  # checked by http_url_problem
        self._host: str = parts.hostname
        self._path = parts.path.rstrip("/") + "/chat/completions"
        self._api_key = os.environ.get("OPENAI_API_KEY") or "not-needed"
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._inflight: set[socket.socket] = set()

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "base_url": self.base_url,
            "model": self.model,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "timeout": self.timeout,
            "max_retries": self.max_retries,
        }
        if self.max_reply_bytes != DEFAULT_MAX_REPLY_BYTES:
            out["max_reply_bytes"] = self.max_reply_bytes
        return out

    def cancel(self) -> None:
        """Abort the call in flight (and every later one): safe from a signal handler or another
        thread. The aborted `decide` raises PolicyCancelled."""
        self._cancelled.set()
        with self._lock:
            socks = list(self._inflight)
        for s in socks:
            _shutdown(s)

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion:
        """One completion within `timeout`. A server that refuses the request as longer than
        its context is sent the history without its oldest messages, a quarter of what is left
        at a time, until it answers (`Completion.dropped` says how many were left out; the
        system prompt and the turn's prompt always stay). Which agents' requests overflow is
        not for the public to see: the mole's is the longest, and a run failing at its turn
        would name it (decision 54)."""
        deadline = time.monotonic() + self.timeout
        room = history_length(messages)
        dropped = 0
        while True:
            try:
                completion = self._complete(trim_history(messages, dropped), seed, deadline)
            except _TooLong as e:
                if dropped >= room:
                    raise PolicyError(
                        f"LLM server {self.base_url!r} refused the request as longer than its"
                        f" context even without its {room} history messages: {e}"
                    ) from None
                dropped += max(1, (room - dropped + 3) // 4)
                continue
            return msgspec.structs.replace(completion, dropped=dropped) if dropped else completion

    def _complete(self, messages: list[dict[str, str]], seed: int, deadline: float) -> Completion:
        """One request, retried on what may pass (a dropped connection, 429, 5xx) until
        `deadline`; _TooLong when the server says it does not fit its context."""
        body = msgspec.json.encode(
            {
                "model": self.model,
                "messages": messages,
                "seed": seed,
                "temperature": self.temperature,
                "max_tokens": self.max_tokens,
                "stream": False,
            }
        )
        attempts = 0
        while True:
            attempts += 1
            try:
                status, raw = self._attempt(body, deadline)
                return self._completion(status, raw)
            except _TooLong:
                raise
            except _Fault as fault:
                last = fault
            if self._cancelled.is_set():
                raise PolicyCancelled(f"LLM call to {self.base_url!r} was cancelled")
            if not last.retry or attempts > self.max_retries:
                break
            pause = last.retry_after
            if pause is None:
                pause = _BACKOFF_S[min(attempts - 1, len(_BACKOFF_S) - 1)]
            if time.monotonic() + pause >= deadline:
                break
            if self._cancelled.wait(pause):
                raise PolicyCancelled(f"LLM call to {self.base_url!r} was cancelled")
        tries = f" (after {attempts} attempts)" if attempts > 1 else ""
        raise PolicyError(f"LLM server {self.base_url!r} {last}{tries}")

    # ------------------------------------------------------------------ one HTTP attempt

    def _attempt(self, body: bytes, deadline: float) -> tuple[int, bytes]:
        if self._cancelled.is_set():
            raise PolicyCancelled(f"LLM call to {self.base_url!r} was cancelled")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Fault(f"timed out after {self.timeout:g}s", retry=False)
        conn: http.client.HTTPConnection
        if self._https:
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=remaining, context=ssl.create_default_context()
            )
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=remaining)
        expired = threading.Event()
        watchdog: threading.Timer | None = None
        try:
            try:
                conn.connect()
            except TimeoutError as e:
                raise _Fault(f"timed out after {self.timeout:g}s", retry=False) from e
            except OSError as e:
                raise _Fault(f"is unreachable: {_clip(str(e))}", retry=True) from e
            sock = conn.sock
            assert sock is not None
            with self._lock:
                self._inflight.add(sock)
            if self._cancelled.is_set():
                _shutdown(sock)

            def expire() -> None:
                expired.set()
                _shutdown(sock)

            watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), expire)
            watchdog.daemon = True
            watchdog.start()
            try:
                result = self._exchange(conn, body)
            except _Fault:
                if expired.is_set():
                    raise _Fault(f"timed out after {self.timeout:g}s", retry=False) from None
                raise
            except (OSError, http.client.HTTPException) as e:
                if expired.is_set() or isinstance(e, TimeoutError):
                    raise _Fault(f"timed out after {self.timeout:g}s", retry=False) from e
                if isinstance(e, OSError | http.client.IncompleteRead):
                    raise _Fault(f"dropped the connection: {_describe(e)}", retry=True) from e
                raise _Fault(f"sent a malformed HTTP response: {_describe(e)}", retry=False) from e
            # a watchdog or a cancel that shut the socket reads as an early end of the body
            if expired.is_set():
                raise _Fault(f"timed out after {self.timeout:g}s", retry=False)
            if self._cancelled.is_set():
                raise PolicyCancelled(f"LLM call to {self.base_url!r} was cancelled")
            return result
        finally:
            if watchdog is not None:
                watchdog.cancel()
            if conn.sock is not None:
                with self._lock:
                    self._inflight.discard(conn.sock)
            conn.close()

    def _exchange(self, conn: http.client.HTTPConnection, body: bytes) -> tuple[int, bytes]:
        conn.putrequest("POST", self._path, skip_accept_encoding=True)
        for key, value in (
            ("Content-Type", "application/json"),
            ("Accept", "application/json"),
            ("Accept-Encoding", "gzip, deflate"),
            ("Authorization", f"Bearer {self._api_key}"),
            ("Content-Length", str(len(body))),
        ):
            conn.putheader(key, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        limit = self.max_reply_bytes
        try:
            out = b"".join(bounded_body(resp, limit))
        except ShortBody as e:  # the connection closed before the declared Content-Length
            raise http.client.IncompleteRead(b"", e.missing) from None
        except ReplyFault as e:
            raise _Fault(_refused(e, limit), retry=False) from e
        status = resp.status
        retry_after = _retry_after(resp.getheader("Retry-After"))
        if status != 200:
            message = f"answered HTTP {status}: {error_text(out)}"
            if status in (400, 413) and is_overflow(out):
                raise _TooLong(message, retry=False)
            retry = status in _RETRY_STATUSES or status >= 500
            raise _Fault(message, retry=retry, retry_after=retry_after)
        return status, out

    # ------------------------------------------------------------------ the reply

    def _completion(self, status: int, raw: bytes) -> Completion:
        try:
            reply = _reply_decoder.decode(raw)
        except msgspec.ValidationError as e:
            raise _Fault(
                f"returned a malformed completion: {e}{_received(raw)}", retry=False
            ) from e
        except msgspec.DecodeError as e:
            raise _Fault(f"answered with malformed JSON: {e}{_received(raw)}", retry=False) from e
        choice = reply.choices[0]
        text = choice.message.content
        if text is None:
            raise _Fault(
                f"returned no message text (`content` is null){_received(raw)}", retry=False
            )
        usage = reply.usage or _Usage()
        return Completion(
            text=text,
            model=reply.model or self.model,
            finish_reason=choice.finish_reason or "unknown",
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            system_fingerprint=reply.system_fingerprint,
        )


# ---------------------------------------------------------------------- helpers


def _bounded_float(
    name: str, value: Any, low: float, high: float, *, low_open: bool = False
) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"openai {name} must be a number, got {value!r}") from e
    if isinstance(value, bool) or not math.isfinite(v) or v > high or v < low:
        lo = f"> {low:g}" if low_open else f">= {low:g}"
        raise ConfigError(f"openai {name} must be {lo} and <= {high:g}, got {value!r}")
    return v


def _bounded_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"openai {name} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError as e:
            raise ConfigError(f"openai {name} must be an integer, got {value!r}") from e
    if not isinstance(value, int):
        raise ConfigError(f"openai {name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"openai {name} must be between {low} and {high}, got {value!r}")
    return value


def _refused(fault: ReplyFault, limit: int) -> str:
    """What a reply that broke its bounds or its encoding did, as this policy says it."""
    if isinstance(fault, ReplyTooLarge):
        if fault.announced is not None:
            return (
                f"sent a reply of {fault.announced} bytes, more than the limit of {limit} "
                "(max_reply_bytes)"
            )
        return f"sent a reply larger than the limit of {limit} bytes (max_reply_bytes)"
    if isinstance(fault, UnsupportedEncoding):
        return f"sent a reply in an unsupported encoding {_clip(fault.encoding)!r}"
    if isinstance(fault, TruncatedBody):
        return f"sent a corrupt or truncated {fault.encoding} body"
    return f"sent {fault}"  # a corrupt body


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed by the other side
        sock.shutdown(socket.SHUT_RDWR)


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and 0 <= seconds <= MAX_TIMEOUT_S else None


def error_text(raw: bytes) -> str:
    """The message of an error reply on one line, terminal control escaped: `error.message`
    of an OpenAI-style body, else the body (clipped)."""
    try:
        body = _error_decoder.decode(raw)
    except msgspec.MsgspecError:
        return _clip(raw.decode("utf-8", errors="replace")) or "(empty body)"
    err = body.error
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return _clip(err["message"])
    if isinstance(err, str):
        return _clip(err)
    if isinstance(body.message, str):
        return _clip(body.message)
    return _clip(raw.decode("utf-8", errors="replace"))


def is_overflow(raw: bytes) -> bool:
    """Whether an error reply says the request does not fit the server's context: its
    `error.code` or `error.type`, else the words of its message."""
    try:
        body = _overflow_decoder.decode(raw)
    except msgspec.MsgspecError:
        return bool(_OVERFLOW_WORDS.search(raw[:4096].decode("utf-8", errors="replace")))
    err = body.error
    if isinstance(err, _ErrorDetail):
        if err.code in _OVERFLOW_CODES or err.type in _OVERFLOW_CODES:
            return True
        text = err.message
    else:
        text = err if isinstance(err, str) else body.message
    return isinstance(text, str) and bool(_OVERFLOW_WORDS.search(text[:4096]))


def _received(raw: bytes) -> str:
    head = raw[:120].decode("utf-8", errors="replace")
    more = "…" if len(raw) > 120 else ""
    return f" (received {len(raw)} bytes: {_escape(head)!r}{more})"


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return _clip(f"{type(e).__name__}: {text}" if type(e).__name__ not in text else text)


def _escape(text: str) -> str:
    """Control characters as visible escapes, so no reply reaches a terminal as control."""
    return "".join(
        ch if (ch.isprintable() or ch == " ") else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )


def _clip(text: str, n: int = 200) -> str:
    text = _escape(" ".join(text.split()))
    return text if len(text) <= n else text[: n - 1] + "…"


def openai_policy(spec: dict[str, Any]) -> OpenAIPolicy:
    """The policy registry's factory for "openai" specs (RunStarted.policy, do_policy)."""
    # OpenAIPolicy checks every value's type and range itself (ConfigError, one line)
    return OpenAIPolicy(
        base_url=str(spec.get("base_url") or DEFAULT_BASE_URL),
        model=str(spec.get("model") or "local-model"),
        temperature=spec.get("temperature", 0.8),
        max_tokens=spec.get("max_tokens", 160),
        timeout=spec.get("timeout", 60.0),
        max_retries=spec.get("max_retries", 2),
        max_reply_bytes=spec.get("max_reply_bytes", DEFAULT_MAX_REPLY_BYTES),
    )
