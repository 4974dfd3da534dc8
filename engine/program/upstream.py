"""The recording proxy's upstream: the OpenAI-compatible server a program's live calls go to.

An upstream is untrusted input like any model server, so each call holds the promises the
heist's policy holds (engine.policies.openai_policy):

* `timeout` is a deadline on the WHOLE call - connect, request, status, headers and every read
  of the body or of the stream - enforced by a watchdog that shuts the socket down when it
  passes, so a server trickling one byte at a time cannot stretch it;
* a reply is at most `max_reply_bytes`: a body on the wire and after decompression (a gzip
  bomb is cut off as it passes the bound; engine.policies.bounded_reply reads it, as it does
  for the heist's policy); a stream's text and tool calls as assembled, in UTF-8 bytes (what
  is journaled), its events (their JSON envelopes included, some 200 bytes a token) at most
  `STREAM_ENVELOPE` times that on the wire, and no single event over the bound;
* `abort` ends every call in flight at once: a proxy whose program was stopped does not wait on
  a model that is still thinking.

Every failure is an UpstreamError that names the upstream and says what happened (unreachable,
dropped the connection, took longer than the timeout, sent too much); the proxy answers the
program with its HTTP status (502, or 504 for the timeout) and fails the run with its message.
One connection per proxy thread is kept alive between calls; a call that did not end cleanly
closes it.
"""

from __future__ import annotations

import contextlib
import http.client
import math
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator

from engine.errors import ConfigError, EngineError
from engine.policies.bounded_reply import ReplyFault, ReplyTooLarge, ShortBody, bounded_body
from engine.policies.openai_policy import (
    DEFAULT_MAX_REPLY_BYTES,
    MAX_REPLY_BYTES_LIMIT,
    MAX_TIMEOUT_S,
    MIN_REPLY_BYTES,
)

DEFAULT_TIMEOUT = 600.0
#: How many times `max_reply_bytes` a stream's events may take on the wire: each token of a
#: streamed reply comes wrapped in a JSON chunk of about 200 bytes.
STREAM_ENVELOPE = 16


#: seconds a watchdog waits for the next call before it leaves
WATCHDOG_IDLE_S = 5.0


class UpstreamError(EngineError):
    """The upstream server failed a call: a broken, malformed or oversized reply."""

    status = 502
    kind = "car_upstream_error"


class UpstreamUnreachable(UpstreamError):
    """Nothing answers at the upstream's address."""

    kind = "car_upstream_unreachable"


class UpstreamTimeout(UpstreamError):
    """The upstream took longer than the timeout for one call."""

    status = 504
    kind = "car_upstream_timeout"


class UpstreamAborted(UpstreamError):
    """The call was abandoned: the proxy is closing (its program was stopped or is gone)."""

    kind = "car_upstream_aborted"


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    if isinstance(e, http.client.IncompleteRead):
        return "the body ended early"
    return str(e) or type(e).__name__


def _shutdown(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed by the other side
            sock.shutdown(socket.SHUT_RDWR)


class Upstream:
    """An OpenAI-compatible server: its base URL, one keep-alive connection per thread, and
    the bounds of every call (`timeout` seconds, `max_reply_bytes`)."""

    def __init__(
        self,
        base_url: str,
        timeout: float = DEFAULT_TIMEOUT,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
    ) -> None:
        from engine.urls import NOT_HTTP, http_url_problem

        problem = http_url_problem(base_url)
        if problem == NOT_HTTP:
            raise UpstreamError(f"upstream must be an http(s) URL, got {base_url!r}")
        if problem is not None:  # a bracket left open (`http://[::1`), a port out of range
            raise ConfigError(f"bad upstream URL {base_url!r}: {problem}")
        u = urllib.parse.urlsplit(base_url)
        if isinstance(timeout, bool) or not (
            isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0
        ):
            raise ConfigError(f"the upstream timeout must be a positive number, got {timeout!r}")
        if isinstance(max_reply_bytes, bool) or not (
            isinstance(max_reply_bytes, int)
            and MIN_REPLY_BYTES <= max_reply_bytes <= MAX_REPLY_BYTES_LIMIT
        ):
            raise ConfigError(
                f"max_reply_bytes must be an integer between {MIN_REPLY_BYTES} and "
                f"{MAX_REPLY_BYTES_LIMIT}, got {max_reply_bytes!r}"
            )
        self.url = base_url.rstrip("/")
        self.https = u.scheme == "https"
        assert u.hostname is not None  # checked by http_url_problem
        self.host: str = u.hostname
        self.port = u.port or (443 if self.https else 80)
        self.prefix = u.path.rstrip("/")
        self.timeout = float(min(timeout, MAX_TIMEOUT_S))
        self.max_reply_bytes = max_reply_bytes
        self._local = threading.local()
        self._lock = threading.Lock()
        self._inflight: set[Reply] = set()
        self._aborted = False
        # one watchdog for every call of this upstream: it cuts a call whose deadline passed
        # (a thread a call cost ~0.3 ms of each call to start)
        self._due = threading.Condition(self._lock)
        self._watchdog: threading.Thread | None = None
        self._watch_pid = 0

    def _track(self, reply: Reply) -> None:
        """Count `reply` in flight and under the watchdog (started with the first call)."""
        with self._lock:
            if self._aborted:
                reply.aborted = True
            self._inflight.add(reply)
            # a forked child inherits the field but not the thread
            if self._watchdog is None or self._watch_pid != os.getpid():
                self._watch_pid = os.getpid()
                self._watchdog = threading.Thread(
                    target=self._watch, name="car-upstream-watchdog", daemon=True
                )
                self._watchdog.start()
            self._due.notify()

    def _watch(self) -> None:
        """Cut each call in flight once its deadline has passed; sleep until the next one."""
        idle = False
        while True:
            with self._lock:
                now = time.monotonic()
                live = [r for r in self._inflight if not r.expired]
                if not live:
                    # nothing in flight for a while, or never again: leave (the next call
                    # starts a watchdog anew), so an upstream that is done holds no thread
                    if idle or self._aborted:
                        self._watchdog = None
                        return
                    idle = True
                    self._due.wait(WATCHDOG_IDLE_S)
                    continue
                idle = False
                late = [r for r in live if r._deadline <= now]
                if not late:
                    self._due.wait(min(r._deadline for r in live) - now)
                    continue
            for r in late:  # outside the lock: a cut takes the reply's own lock
                r._cut("expired")

    def _conn(self, fresh: bool = False) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None or fresh:
            if c is not None:
                c.close()
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            c = cls(self.host, self.port, timeout=self.timeout)
            self._local.conn = c
        return c

    def check(self, timeout: float = 3.0) -> None:
        """UpstreamUnreachable unless something accepts connections at the upstream's address."""
        try:
            socket.create_connection((self.host, self.port), timeout=timeout).close()
        except OSError as e:
            raise UpstreamUnreachable(f"upstream {self.url} is unreachable: {_reason(e)}") from e

    def call(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> Reply:
        """Send a request and read the status line and headers, under the call's deadline; the
        Reply (a context manager: leaving it ends the call) reads the rest. A kept-alive
        connection the server closed meanwhile is re-opened once."""
        reply = Reply(self)
        try:
            reply.check_cut()  # aborted: the proxy is closing
            for attempt in (0, 1):
                c = self._conn(fresh=attempt == 1)
                reused = c.sock is not None
                reply.conn = c
                c.timeout = reply.remaining()
                try:
                    if c.sock is not None:
                        c.sock.settimeout(c.timeout)
                    c.request(method, self.prefix + path, body=body, headers=headers)
                    if c.sock is not None:
                        c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    reply.check_cut()  # the deadline passed while connecting
                    reply.resp = c.getresponse()
                    return reply
                except (OSError, http.client.HTTPException) as e:
                    c.close()
                    cut = reply._cut_fault(e)
                    if cut is not None:
                        raise cut from e
                    if attempt == 0 and reused:
                        continue
                    raise UpstreamUnreachable(
                        f"upstream {self.url} is unreachable: {_reason(e)}"
                    ) from e
            raise AssertionError("unreachable")
        except BaseException:
            reply.close()
            raise

    def abort(self) -> None:
        """End every call in flight now (each raises UpstreamAborted), and refuse new ones."""
        with self._lock:
            self._aborted = True
            replies = list(self._inflight)
            self._due.notify()  # a watchdog with nothing left to watch leaves
        for r in replies:
            r.abort()


class Reply:
    """One upstream call in flight: its response, read under the deadline and the size bound."""

    def __init__(self, up: Upstream) -> None:
        self.up = up
        self.conn: http.client.HTTPConnection | None = None
        self.resp: http.client.HTTPResponse | None = None
        self.expired = False
        self.aborted = False
        self._ended = False
        self._complete = False  # the whole response was read: the connection can be reused
        self._lock = threading.Lock()
        self._deadline = time.monotonic() + up.timeout
        up._track(self)

    def __enter__(self) -> Reply:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def status(self) -> int:
        assert self.resp is not None
        return self.resp.status

    def header(self, name: str) -> str | None:
        assert self.resp is not None
        return self.resp.getheader(name)

    def remaining(self) -> float:
        return max(0.001, self._deadline - time.monotonic())

    def abort(self) -> None:
        self._cut("aborted")

    def _cut(self, why: str) -> None:
        with self._lock:
            if self._ended:
                return
            setattr(self, why, True)
            sock = self.conn.sock if self.conn is not None else None
        _shutdown(sock)

    def _cut_fault(self, e: BaseException | None = None) -> UpstreamError | None:
        """The error a failed or short read means when the watchdog, an abort or a socket
        timeout caused it; None otherwise."""
        url = self.up.url
        if self.aborted:
            return UpstreamAborted(f"upstream {url}: the call was abandoned (the proxy closed)")
        if self.expired or isinstance(e, TimeoutError):
            return UpstreamTimeout(f"upstream {url} took longer than {self.up.timeout:g} s")
        return None

    def fault(self, e: BaseException, what: str) -> UpstreamError:
        """The error a failed read means: a cut (timeout, abort), else `what` went wrong."""
        return self._cut_fault(e) or UpstreamError(f"upstream {self.up.url} {what}: {_reason(e)}")

    def check_cut(self) -> None:
        found = self._cut_fault()
        if found is not None:
            raise found

    def _too_big(self, limit: int, what: str = "a reply") -> UpstreamError:
        return UpstreamError(
            f"upstream {self.up.url} sent {what} larger than the limit of {limit} bytes "
            "(--max-reply-bytes)"
        )

    def _pieces(self, limit: int) -> Iterator[bytes]:
        """The body as it arrives (decompressed), at most `limit` bytes on the wire and after
        decompression; UpstreamError when it is more, is cut short or takes too long."""
        resp = self.resp
        assert resp is not None
        try:
            yield from bounded_body(resp, limit)
        except ReplyFault as e:
            # a watchdog or an abort that shut the socket reads as an early end of the body
            self.check_cut()
            raise self._refused(e, limit) from e
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise self.fault(e, "dropped the connection mid-reply") from e
        self.check_cut()
        resp.close()  # the body is read: the connection is free for the thread's next call
        self._complete = True

    def _refused(self, fault: ReplyFault, limit: int) -> UpstreamError:
        """What a reply that broke its bounds or its encoding did, as the proxy says it."""
        url = self.up.url
        if isinstance(fault, ReplyTooLarge):
            if fault.announced is not None:
                return self._too_big(limit, f"a reply of {fault.announced} bytes,")
            return self._too_big(limit)
        if isinstance(fault, ShortBody):
            return UpstreamError(
                f"upstream {url} closed the connection mid-reply "
                f"({fault.received} bytes read, {fault.missing} more announced)"
            )
        # an unsupported encoding, a corrupt or a truncated body: the fault names it
        return UpstreamError(f"upstream {url} sent {fault}")

    def body(self) -> bytes:
        """The whole body (decompressed), bounded by `max_reply_bytes`."""
        return b"".join(self._pieces(self.up.max_reply_bytes))

    def events(self) -> Iterator[bytes]:
        """The data of each server-sent event, as it arrives: all of them at most
        STREAM_ENVELOPE times `max_reply_bytes`, none over `max_reply_bytes`."""
        limit = self.up.max_reply_bytes
        buf = bytearray()
        data: list[bytes] = []
        size = 0
        for piece in self._pieces(limit * STREAM_ENVELOPE):
            buf += piece
            while (i := buf.find(b"\n")) >= 0:
                line = bytes(buf[:i]).rstrip(b"\r")
                del buf[: i + 1]
                if not line:
                    if data:
                        yield b"\n".join(data)
                        data, size = [], 0
                    continue
                if line.startswith(b"data:"):
                    d = line[5:]
                    data.append(d[1:] if d.startswith(b" ") else d)
                    size += len(d)
                    if size > limit:
                        raise self._too_big(limit, "a stream event")
            if len(buf) > limit:
                raise self._too_big(limit, "a stream event")
        line = bytes(buf).rstrip(b"\r")
        if line.startswith(b"data:"):
            d = line[5:]
            data.append(d[1:] if d.startswith(b" ") else d)
        if data:
            yield b"\n".join(data)

    def close(self) -> None:
        """End the call: the watchdog stopped, the connection closed unless the whole
        response was read (what is left of it would be read as the next call's answer)."""
        with self._lock:
            self._ended = True
        with self.up._lock:
            self.up._inflight.discard(self)
            self.up._due.notify()  # its watchdog may be asleep until this call's deadline
        if self.conn is not None and not (self._complete and not self.expired):
            self.conn.close()
