"""The recording proxy: a local OpenAI-compatible server between a program and its model.

One process-local HTTP/1.1 server on 127.0.0.1 (a free port), one thread per client
connection (the `openai` client keeps its connection alive, so a program's calls reuse one
thread and that thread's keep-alive connection to the upstream). Every chat completion is
answered by one of three sources, decided per call by `route` (engine.program.matching names
the call by agent and position):

* live: forwarded to the upstream server, and journaled;
* the journal: the recorded answer of the same call (a replay, or a fork's prefix), checked
  against the recorded request under the match mode; a miss answers HTTP 400 with the one-line
  diagnosis, and the first miss is kept as the session's failure;
* an intervention (a fork's call k): do_action answers with the given text, do_observation
  keeps the recorded answer and rewrites the tool result the program sends back for it,
  do_context edits the request, do_policy sends this and later calls elsewhere, do_resample
  re-draws it live with the branch's seed.

Journaling happens under one lock, in completion order: a call's step number is taken when its
events are appended (so steps grow with seq even when a program's agents call concurrently),
and the step's events are one atomic append (engine.runtime.recorder). The reply is written in
one send (status line, headers and body together), so Nagle's algorithm never delays it.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import socketserver
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from engine import events as ev
from engine.errors import EngineError, JournalError
from engine.interventions import (
    DoAction,
    DoContext,
    DoObservation,
    DoPolicy,
    DoResample,
    Intervention,
)
from engine.program import wire
from engine.program.matching import (
    MatchMode,
    RecordedCall,
    diagnosis,
    first_difference,
    normalised,
)
from engine.runtime.recorder import Recorder

DEFAULT_TIMEOUT = 600.0
MAX_BODY = 64 << 20


class UpstreamError(EngineError):
    """The upstream server cannot be reached."""


class Upstream:
    """An OpenAI-compatible server: its base URL, one keep-alive connection per thread."""

    def __init__(self, base_url: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        u = urllib.parse.urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise UpstreamError(f"upstream must be an http(s) URL, got {base_url!r}")
        self.url = base_url.rstrip("/")
        self.https = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if self.https else 80)
        self.prefix = u.path.rstrip("/")
        self.timeout = timeout
        self._local = threading.local()

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
        """UpstreamError unless something accepts connections at the upstream's address."""
        try:
            socket.create_connection((self.host, self.port), timeout=timeout).close()
        except OSError as e:
            raise UpstreamError(f"upstream {self.url} is unreachable: {_reason(e)}") from e

    def send(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> http.client.HTTPResponse:
        """Send a request; the response with its body unread. A kept-alive connection the
        server closed meanwhile is re-opened once; UpstreamError when it cannot be reached."""
        for attempt in (0, 1):
            c = self._conn(fresh=attempt == 1)
            reused = c.sock is not None
            try:
                c.request(method, self.prefix + path, body=body, headers=headers)
                if c.sock is not None:
                    c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return c.getresponse()
            except (OSError, http.client.HTTPException) as e:
                c.close()
                if attempt == 0 and reused:
                    continue
                raise UpstreamError(f"upstream {self.url} is unreachable: {_reason(e)}") from e
        raise AssertionError("unreachable")


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    return str(e) or type(e).__name__


def _run_tool(run: Any) -> tuple[Any, str, Exception | None]:
    """(value, its journaled text, the exception it raised)."""
    try:
        value = run()
    except Exception as e:
        return None, f"{type(e).__name__}: {e}", e
    return value, (value if isinstance(value, str) else wire.canonical(value)), None


class Miss(EngineError):
    """A replayed request has no matching recorded call (the message is the diagnosis)."""


class Session:
    """What answers and journals the calls of one program execution."""

    def __init__(
        self,
        *,
        recorder: Recorder | None,
        upstream: Upstream | None,
        root_seed: int = 0,
        recorded: list[RecordedCall] | None = None,
        match: MatchMode = MatchMode.EXACT,
        fork_at: int | None = None,
        intervention: Intervention | None = None,
        branch_seed: int | None = None,
        keep: frozenset[int] = frozenset(),
        next_step: int = 0,
        resulted_ids: set[str] | None = None,
        tool_ids: dict[str, tuple[int, str, str, str]] | None = None,
    ) -> None:
        self.recorder = recorder
        self.upstream = upstream
        self.root_seed = root_seed
        self.recorded = recorded or []
        self.by_key = {c.key: c for c in self.recorded}
        self.by_step = {c.step: c for c in self.recorded}
        self.match = match
        self.fork_at = fork_at
        self.intervention = intervention
        self.branch_seed = branch_seed
        self.keep = keep
        self.next_step = next_step
        self.lock = threading.Lock()
        self.agents = wire.AgentNames()
        for c in self.recorded:
            self.agents.learn(c.agent, c.call.request)
        self.ordinals: dict[str, int] = {}
        # tool-call id -> (step, agent, tool, param) of calls whose result is not journaled yet
        self.tool_ids: dict[str, tuple[int, str, str, str]] = dict(tool_ids or {})
        self.resulted: set[str] = set(resulted_ids or ())
        self.observation_ids: dict[str, str] = {}  # tool-call id -> do_observation's text
        self.policy: dict[str, Any] | None = None  # do_policy's spec, once call k was reached
        self.policy_upstream: Upstream | None = None
        self.checks: list[dict[str, Any]] = []  # one per call answered from the journal
        self.failure: str | None = None  # the first miss, upstream failure or journal error
        self.calls = 0
        self.journaled = 0
        self.upstream_errors: list[str] = []
        # (step, agent, journaled here) of the latest call: where an in-process tool belongs
        self.current: tuple[int, str, bool] | None = None
        self._inflight = 0
        self._idle = threading.Condition(self.lock)

    # ------------------------------------------------------------------ routing

    def route(self, key: tuple[str, int]) -> tuple[str, RecordedCall | None]:
        rec = self.by_key.get(key)
        if self.recorder is None:
            return "journal", rec
        if self.fork_at is None:
            return "live", None
        if rec is not None and rec.step < self.fork_at:
            return "journal", rec
        if rec is not None and rec.step == self.fork_at:
            return "intervene", rec
        if rec is not None and rec.step in self.keep:
            return "forced", rec
        return "live", rec

    def fail(self, message: str) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = message

    # ------------------------------------------------------------------ one call

    def begin(self, header: str | None, body: dict[str, Any]) -> tuple[str, int]:
        with self.lock:
            agent = self.agents.name(header, body)
            n = self.ordinals.get(agent, 0)
            self.ordinals[agent] = n + 1
            self.calls += 1
            self._inflight += 1
        return agent, n

    def end(self) -> None:
        with self.lock:
            self._inflight -= 1
            self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.lock:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def check_recorded(
        self, agent: str, ordinal: int, rec: RecordedCall | None, entries: list[dict[str, str]]
    ) -> None:
        """Compare a request with its recorded call; Miss (the diagnosis) when it does not
        match under the mode. Every comparison is kept for the fidelity report."""
        diff = None if rec is None else first_difference(rec.call.request, entries, self.match)
        exact = (
            rec is not None and first_difference(rec.call.request, entries, MatchMode.EXACT) is None
        )
        # normalised: the same request up to whitespace and case in the messages' contents
        norm = (
            rec is not None
            and normalised(wire.messages_of(rec.call.request))
            == normalised(wire.messages_of(entries))
            and wire.params_of(rec.call.request) == wire.params_of(entries)
        )
        strict = (
            None if rec is None else first_difference(rec.call.request, entries, MatchMode.EXACT)
        )
        with self.lock:
            self.checks.append(
                {
                    "agent": agent,
                    "ordinal": ordinal,
                    "step": None if rec is None else rec.step,
                    "exact": exact,
                    "normalised": norm,
                    "field": None if strict is None else strict[0],
                    "recorded": None if strict is None else strict[1],
                    "got": None if strict is None else strict[2],
                }
            )
        if rec is None or diff is not None:
            message = diagnosis(self.recorded, agent, ordinal, entries, self.match, rec)
            self.fail(f"replay miss: {message}")
            raise Miss(message)

    def journal_call(
        self,
        agent: str,
        ordinal: int,
        body: dict[str, Any],
        seed: int,
        seed_source: str,
        answer: wire.Answer,
        latency_ms: float,
        server: str | None,
    ) -> int:
        """Append the call's step (tool results it carries, the call, the tool calls it asked
        for, its message); returns the step number."""
        assert self.recorder is not None
        entries = wire.request_entries(body, seed_source)
        with self.lock:
            events: list[ev.Event] = []
            for m in body.get("messages") or []:
                if not isinstance(m, dict) or m.get("role") != "tool":
                    continue
                tid = m.get("tool_call_id")
                if not isinstance(tid, str) or tid in self.resulted or tid not in self.tool_ids:
                    continue
                step, who, tool, param = self.tool_ids.pop(tid)
                self.resulted.add(tid)
                content = m.get("content")
                events.append(
                    ev.ToolResult(
                        step=step,
                        agent=who,
                        tool=tool,
                        param=param,
                        ok=True,
                        output=content if isinstance(content, str) else wire.canonical(content),
                    )
                )
            k = self.next_step
            events.append(
                ev.LlmCall(
                    step=k,
                    agent=agent,
                    request=entries,
                    seed=seed,
                    model=answer.model,
                    response=answer.content,
                    finish_reason=answer.finish_reason,
                    prompt_tokens=answer.prompt_tokens,
                    completion_tokens=answer.completion_tokens,
                    system_fingerprint=answer.fingerprint,
                    latency_ms=round(latency_ms, 3),
                    server=server,
                )
            )
            for i, (name, args) in enumerate(answer.tool_calls):
                events.append(ev.ToolCall(step=k, agent=agent, tool=name, param=args))
                self.tool_ids[wire.tool_call_id(agent, ordinal, i)] = (k, agent, name, args)
            events.append(ev.ChatMessage(step=k, agent=agent, text=answer.content))
            try:
                self.recorder.append(events)
            except EngineError as e:
                if self.failure is None:
                    self.failure = f"journal: {e}"
                raise
            self.next_step = k + 1
            self.journaled += 1
            self.current = (k, agent, True)
        return k

    def journal_tool(self, tool: str, param: str, run: Any) -> Any:
        """An in-process tool call (engine.program.client.tool): journaled as the latest
        call's ToolCall and ToolResult (only the ToolResult when the model asked for it by
        OpenAI tool calling, whose ToolCall is journaled already). Under do_observation at
        that call its first tool returns the intervention's text instead of running.
        Outside any call, or in a fork's prefix (journaled by the parent), it just runs."""
        with self.lock:
            cur = self.current
        iv = self.intervention
        if cur is not None and isinstance(iv, DoObservation) and cur[0] == iv.k:
            with self.lock:
                first = not getattr(self, "_observed", False)
                self._observed = True
            if first:
                value, text, exc = iv.observation, iv.observation, None
            else:
                value, text, exc = _run_tool(run)
        else:
            value, text, exc = _run_tool(run)
        if cur is None or not cur[2] or self.recorder is None:
            if exc is not None:
                raise exc
            return value
        step, agent, _ = cur
        with self.lock:
            events: list[ev.Event] = []
            asked = next(
                (
                    tid
                    for tid, (st, _who, name, _p) in self.tool_ids.items()
                    if st == step and name == tool
                ),
                None,
            )
            if asked is not None:
                self.tool_ids.pop(asked)
                self.resulted.add(asked)
            else:
                events.append(ev.ToolCall(step=step, agent=agent, tool=tool, param=param))
            events.append(
                ev.ToolResult(
                    step=step,
                    agent=agent,
                    tool=tool,
                    param=param,
                    ok=exc is None,
                    output=text if exc is None else "",
                    error=None if exc is None else text,
                )
            )
            self.recorder.append(events)
        if exc is not None:
            raise exc
        return value

    # ------------------------------------------------------------------ request edits

    def seed_for(self, agent: str, ordinal: int, body: dict[str, Any]) -> tuple[int, str]:
        """The seed to send and where it came from (wire: client / injected / branch)."""
        if self.branch_seed is not None:
            return wire.derived_seed(self.branch_seed, agent, ordinal), "branch"
        s = body.get("seed")
        if isinstance(s, int) and not isinstance(s, bool):
            return s, "client"
        return wire.derived_seed(self.root_seed, agent, ordinal), "injected"

    def edit(self, body: dict[str, Any], at_k: bool) -> dict[str, Any]:
        """The request as a fork sends it upstream: do_observation's tool text, do_context's
        edits and do_policy's overrides applied (a copy; the program's body is untouched)."""
        iv = self.intervention
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return body
        out = dict(body)
        if self.observation_ids:
            new = []
            for m in msgs:
                if isinstance(m, dict) and m.get("tool_call_id") in self.observation_ids:
                    m = {**m, "content": self.observation_ids[m["tool_call_id"]]}
                new.append(m)
            msgs = new
        if isinstance(iv, DoContext):
            if "step" in iv.edit:
                rec = self.by_step.get(int(iv.edit["step"]))
                text = str(iv.edit.get("text", ""))
                if rec is not None:
                    new = []
                    for m in msgs:
                        if (
                            isinstance(m, dict)
                            and m.get("role") == "assistant"
                            and m.get("content") == rec.call.response
                        ):
                            if not text:
                                continue
                            m = {**m, "content": text}
                        new.append(m)
                    msgs = new
            elif at_k:
                msgs = [*msgs, {"role": "user", "content": str(iv.edit.get("text", ""))}]
        out["messages"] = msgs
        if self.policy is not None:
            for key in ("model", "temperature", "max_tokens"):
                if key in self.policy:
                    out[key] = self.policy[key]
        return out


# ---------------------------------------------------------------------------- the server


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    session: Session

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # skip the reverse DNS lookup of HTTPServer
        self.server_name, self.server_port = self.server_address[:2]  # type: ignore[assignment]


def _error_body(message: str, kind: str) -> bytes:
    return wire.canonical({"error": {"message": message, "type": kind, "code": kind}}).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the program's own output stays the only output

    # ---------------------------------------------------------------- plumbing

    def _reply(
        self, status: int, body: bytes, ctype: str = "application/json", extra: str = ""
    ) -> None:
        head = (
            f"HTTP/1.1 {status} {http.client.responses.get(status, 'Status')}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
        ).encode("latin-1")
        self.wfile.write(head + body)

    def _error(self, status: int, message: str, kind: str) -> None:
        self._reply(status, _error_body(message, kind))

    def _start_stream(self) -> None:
        self.wfile.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
        )

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError(f"request body of {n} bytes is over the {MAX_BODY}-byte limit")
        return self.rfile.read(n) if n else b""

    def _upstream_headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        for name in ("Authorization", "Accept", "OpenAI-Organization", "OpenAI-Project"):
            v = self.headers.get(name)
            if v:
                h[name] = v
        return h

    # ---------------------------------------------------------------- routes

    def do_GET(self) -> None:
        self._passthrough("GET", None)

    def do_POST(self) -> None:
        try:
            raw = self._body()
        except ValueError as e:
            self.close_connection = True
            self._error(413, str(e), "car_request_too_large")
            return
        path = self.path.split("?", 1)[0].rstrip("/")
        if path.endswith("/chat/completions"):
            self._chat(raw)
        else:
            self._passthrough("POST", raw)

    def _passthrough(self, method: str, raw: bytes | None) -> None:
        """Anything but chat completions goes to the upstream unrecorded (e.g. GET /models)."""
        s = self.server.session
        up = s.upstream
        if up is None:
            models = sorted({c.call.model for c in s.recorded})
            if method == "GET" and self.path.rstrip("/").endswith("/models"):
                listed = [{"id": m, "object": "model", "owned_by": "car"} for m in models]
                self._reply(200, wire.canonical({"object": "list", "data": listed}).encode())
                return
            self._error(404, f"{self.path} is not recorded (only chat completions are)", "car")
            return
        path = self.path
        if path.startswith("/v1/") or path == "/v1":
            path = path[3:]
        try:
            resp = up.send(method, path, raw, self._upstream_headers())
            data = resp.read()
        except UpstreamError as e:
            s.fail(str(e))
            self._error(502, str(e), "car_upstream_unreachable")
            return
        self._reply(resp.status, data, resp.getheader("Content-Type") or "application/json")

    def _chat(self, raw: bytes) -> None:
        s = self.server.session
        try:
            body = wire.decode_json(raw)
        except Exception:
            self._error(400, "the request body is not JSON", "car_bad_request")
            return
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            self._error(400, "a chat completion needs a JSON object with messages", "car")
            return
        if body.get("n") not in (None, 1):
            self._error(400, f"n={body.get('n')!r}: one choice per call is recorded", "car")
            return
        agent, ordinal = s.begin(self.headers.get(wire.AGENT_HEADER), body)
        try:
            self._answer(s, agent, ordinal, body)
        except Miss as e:
            self._error(400, f"car replay miss: {e}", "car_replay_miss")
        except UpstreamError as e:
            s.fail(str(e))
            self._error(502, str(e), "car_upstream_unreachable")
        except (JournalError, EngineError) as e:
            s.fail(str(e))
            self._error(500, str(e), "car_error")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            s.end()

    def _answer(self, s: Session, agent: str, ordinal: int, body: dict[str, Any]) -> None:
        route, rec = s.route((agent, ordinal))
        iv = s.intervention
        if route == "journal":
            # the seed source is not compared (params_of leaves it out): any will do
            entries = wire.request_entries(body, "client")
            s.check_recorded(agent, ordinal, rec, entries)
            assert rec is not None
            with s.lock:
                s.current = (rec.step, agent, False)
            self._send_answer(body, rec.answer(), agent, ordinal, rec.step)
            return
        if route == "intervene":
            assert rec is not None
            if isinstance(iv, DoAction):
                a = wire.Answer(iv.action, "stop", rec.call.model, [])
                self._journal_and_send(s, agent, ordinal, body, rec.call.seed, "branch", a, 0.0)
                return
            if isinstance(iv, DoObservation):
                a = rec.answer()
                if a.tool_calls:
                    s.observation_ids[wire.tool_call_id(agent, ordinal, 0)] = iv.observation
                self._journal_and_send(s, agent, ordinal, body, rec.call.seed, "branch", a, 0.0)
                return
            if isinstance(iv, DoPolicy):
                s.policy = dict(iv.policy)
                url = s.policy.get("base_url")
                if url:
                    s.policy_upstream = Upstream(str(url), float(s.policy.get("timeout") or 600))
            self._live(s, agent, ordinal, body, at_k=True)
            return
        if route == "forced":
            assert rec is not None
            a = rec.answer()
            self._journal_and_send(s, agent, ordinal, body, rec.call.seed, "branch", a, 0.0)
            return
        self._live(s, agent, ordinal, body, at_k=False)

    def _journal_and_send(
        self,
        s: Session,
        agent: str,
        ordinal: int,
        body: dict[str, Any],
        seed: int,
        source: str,
        a: wire.Answer,
        latency: float,
        server: str | None = None,
    ) -> None:
        k = s.journal_call(agent, ordinal, s.edit(body, False), seed, source, a, latency, server)
        self._send_answer(body, a, agent, ordinal, k)

    def _send_answer(
        self, body: dict[str, Any], a: wire.Answer, agent: str, ordinal: int, step: int
    ) -> None:
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._start_stream()
            for c in wire.stream_chunks(a, agent, ordinal, step, usage):
                self._chunk(c)
            self._end_stream()
        else:
            self._reply(200, wire.canonical(wire.completion_body(a, agent, ordinal, step)).encode())

    def _live(self, s: Session, agent: str, ordinal: int, body: dict[str, Any], at_k: bool) -> None:
        up = s.policy_upstream or s.upstream
        if up is None:
            raise UpstreamError("no upstream server to answer a live call (give --base-url)")
        seed, source = s.seed_for(agent, ordinal, body)
        sent = s.edit(body, at_k) if s.fork_at is not None else body
        sent = {**sent, "seed": seed}
        payload = wire.canonical(sent).encode()
        t0 = time.perf_counter()
        resp = up.send("POST", "/chat/completions", payload, self._upstream_headers())
        if resp.status != 200:
            data = resp.read()
            s.upstream_errors.append(f"HTTP {resp.status}")
            self._reply(resp.status, data, resp.getheader("Content-Type") or "application/json")
            return
        if body.get("stream"):
            self._live_stream(s, agent, ordinal, sent, seed, source, resp, t0, up)
            return
        data = resp.read()
        latency = (time.perf_counter() - t0) * 1000.0
        try:
            reply = wire.decode_json(data)
            a = wire.answer_of(reply)
        except Exception as e:
            s.upstream_errors.append(f"unreadable reply: {e}")
            self._reply(502, _error_body(f"upstream reply unreadable: {e}", "car_upstream"))
            return
        s.journal_call(agent, ordinal, sent, seed, source, a, latency, up.url)
        if a.tool_calls:
            wire.rewrite_tool_ids(reply, agent, ordinal)
            data = wire.canonical(reply).encode()
        self._reply(200, data)

    def _live_stream(
        self,
        s: Session,
        agent: str,
        ordinal: int,
        sent: dict[str, Any],
        seed: int,
        source: str,
        resp: http.client.HTTPResponse,
        t0: float,
        up: Upstream,
    ) -> None:
        asm = wire.StreamAssembler(agent, ordinal)
        self._start_stream()
        for data in _sse_data(resp):
            self._chunk(b"data: " + asm.feed(data) + b"\n\n")
        latency = (time.perf_counter() - t0) * 1000.0
        if not asm.done:
            s.upstream_errors.append("stream ended without [DONE]")
        s.journal_call(agent, ordinal, sent, seed, source, asm.answer(), latency, up.url)
        self._end_stream()


def _sse_data(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    """The data of each server-sent event of a response, as it arrives."""
    buf: list[bytes] = []
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.rstrip(b"\r\n")
        if not line:
            if buf:
                yield b"\n".join(buf)
                buf = []
            continue
        if line.startswith(b"data:"):
            buf.append(line[5:].lstrip(b" "))
    if buf:
        yield b"\n".join(buf)


class Proxy:
    """The server of one session, serving from a daemon thread until closed."""

    def __init__(self, session: Session, host: str = "127.0.0.1", port: int = 0) -> None:
        self.session = session
        self._server = _Server((host, port), _Handler)
        self._server.session = session
        self.port = self._server.server_address[1]
        self.base_url = f"http://{host}:{self.port}/v1"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> Proxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, wait: float = 5.0) -> None:
        """Stop accepting, and wait (bounded) for calls in flight to be journaled."""
        self._server.shutdown()
        self._server.server_close()
        self.session.wait_idle(wait)


__all__ = ["DoResample", "Miss", "Proxy", "Session", "Upstream", "UpstreamError"]
