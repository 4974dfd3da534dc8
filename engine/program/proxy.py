"""The recording proxy: a local OpenAI-compatible server between a program and its model.

One process-local HTTP/1.1 server on 127.0.0.1 (a free port), one thread per client
connection (the `openai` client keeps its connection alive, so a program's calls reuse one
thread and that thread's keep-alive connection to the upstream). Every chat completion is
answered by one of three sources, decided per call by `route` from the recorded call it
claims as it arrives (engine.program.matching.Matcher: the agent's earliest call not yet
answered, or, when calls of the agent were in flight together, the one the request equals):

* live: forwarded to the upstream server (engine.program.upstream: each call under one
  deadline and a size bound), and journaled once its answer is whole. An upstream that fails
  the call (unreachable, too slow, a cut, malformed or oversized reply; in a fork's branch
  also an HTTP error) fails the session with one line naming it, and the program gets an
  HTTP error (502, 504) or, when its stream is under way, an error event ending it;
* the journal: the recorded answer of the same call (a replay, or a fork's prefix), checked
  against the recorded request under the match mode; a miss answers HTTP 400 with the one-line
  diagnosis, and the first miss is kept as the session's failure;
* an intervention (a fork's call k): do_action answers with the given text, do_observation
  keeps the recorded answer and rewrites the tool result the program sends back for it,
  do_context edits the request, do_policy sends this and later calls elsewhere, do_resample
  re-draws it live with the branch's seed.

Journaling happens under one lock, in completion order: a call's step number is taken when its
events are appended (so steps grow with seq even when a program's agents call concurrently),
and the step's events are one atomic append (engine.runtime.recorder). A request whose seed
no journal can hold is refused (400) before it is forwarded. A program hanging up is normal
and silent; car's own faults are one line, never a traceback over the program's output. The
reply is written in one send (status line, headers and body together), so Nagle's algorithm
never delays it.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from engine import events as ev
from engine.errors import EngineError
from engine.interventions import (
    DoAction,
    DoContext,
    DoObservation,
    DoPolicy,
    DoResample,
    Intervention,
)
from engine.policies.openai_policy import error_text
from engine.program import wire
from engine.program.matching import (
    Matcher,
    MatchMode,
    RecordedCall,
    diagnosis,
    first_difference,
    normalised,
)
from engine.program.upstream import (
    DEFAULT_TIMEOUT,
    Upstream,
    UpstreamAborted,
    UpstreamError,
    UpstreamUnreachable,
)
from engine.runtime.recorder import Recorder

MAX_BODY = 64 << 20
#: seconds a request's body may take to arrive once its headers came: a client that stalls
#: mid-body would otherwise hold one of the proxy's threads for as long as it keeps the socket
BODY_TIMEOUT_S = 60.0
HEX_DIGITS = b"0123456789abcdefABCDEF"


def _run_tool(run: Any) -> tuple[Any, str, Exception | None]:
    """(value, its journaled text, the exception it raised)."""
    try:
        value = run()
    except Exception as e:
        return None, f"{type(e).__name__}: {e}", e
    return value, (value if isinstance(value, str) else wire.canonical(value)), None


class BadBody(EngineError):
    """A request whose body cannot be read: a bad length or chunk, or over MAX_BODY."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = "car_request_too_large" if status == 413 else "car_bad_request"


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
        self.matcher = Matcher(self.recorded, match)
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
        # (agent, request key) -> how many such calls were seeded (`seed_for`)
        self.asked: dict[tuple[str, str], int] = {}
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
        self.closed = False  # the proxy closed: calls still in flight are abandoned

    def set_policy(self, spec: dict[str, Any]) -> None:
        """do_policy reached call k: this and later live calls take the policy's model, and
        its server (`base_url`) and `timeout` when it gives them."""
        self.policy = spec
        base = self.upstream
        url = spec.get("base_url") or (base.url if base is not None else None)
        if url is None or ("base_url" not in spec and "timeout" not in spec):
            return
        up = Upstream(
            str(url),
            float(spec.get("timeout") or (base.timeout if base else DEFAULT_TIMEOUT)),
            *([base.max_reply_bytes] if base is not None else []),
        )
        with self.lock:
            self.policy_upstream = up
            closed = self.closed
        if closed:
            up.abort()

    def abort(self) -> None:
        """Abandon every upstream call in flight (their programs will not read the answers)
        and journal nothing more."""
        with self.lock:
            self.closed = True
            ups = [u for u in (self.upstream, self.policy_upstream) if u is not None]
        for u in ups:
            u.abort()

    # ------------------------------------------------------------------ routing

    @property
    def reordered(self) -> int:
        """Calls answered by a recorded call other than their agent's earliest unanswered one."""
        return self.matcher.reordered

    def route(self, rec: RecordedCall | None) -> tuple[str, RecordedCall | None]:
        """Where the answer to a call that claimed `rec` comes from."""
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

    def begin(
        self, header: str | None, body: dict[str, Any]
    ) -> tuple[str, int, RecordedCall | None]:
        """A call arrives: its agent, its ordinal among the agent's calls (in arrival order)
        and the recorded call it claims (none while recording, or when the agent has no
        recorded call left)."""
        # the seed source is not compared (params_of leaves it out): any will do
        entries = wire.request_entries(body, "client") if self.recorded else None
        with self.lock:
            agent = self.agents.name(header, body)
            n = self.ordinals.get(agent, 0)
            self.ordinals[agent] = n + 1
            rec = None if entries is None else self.matcher.claim(agent, entries)
            self.calls += 1
            self._inflight += 1
        return agent, n, rec

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
        for, its message); returns the step number. `ordinal` is the n of the ids the program
        got for its tool calls (`call_<agent>_<n>_<i>`), by which their results come back."""
        assert self.recorder is not None
        entries = wire.request_entries(body, seed_source)
        with self.lock:
            if self.closed:
                raise UpstreamAborted("the proxy closed before the call was journaled")
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
        if cur is None or not cur[2] or self.recorder is None or self.closed:
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

    def seed_for(self, agent: str, body: dict[str, Any]) -> tuple[int, str]:
        """The seed to send and where it came from (wire: client / injected / branch): a
        derived one by the request and how many equal ones the agent sent before
        (`wire.derived_seed`)."""
        s = body.get("seed")
        if self.branch_seed is None and isinstance(s, int) and not isinstance(s, bool):
            return s, "client"
        key = wire.request_key(body)
        with self.lock:
            n = self.asked.get((agent, key), 0)
            self.asked[(agent, key)] = n + 1
        if self.branch_seed is not None:
            return wire.derived_seed(self.branch_seed, agent, key, n), "branch"
        return wire.derived_seed(self.root_seed, agent, key, n), "injected"

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
    body_timeout: float = BODY_TIMEOUT_S

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # skip the reverse DNS lookup of HTTPServer
        self.server_name, self.server_port = self.server_address[:2]  # type: ignore[assignment]

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A program closing its connection (after a stream's [DONE], or when it exits) is
        normal and silent; anything else is one line, never a traceback over its output."""
        e = sys.exc_info()[1]
        if e is None or isinstance(e, ConnectionError | TimeoutError):
            return
        with contextlib.suppress(Exception):
            sys.stderr.write(f"car proxy: error serving a request: {type(e).__name__}: {e}\n")
            sys.stderr.flush()


def _error_body(message: str, kind: str) -> bytes:
    return wire.canonical({"error": {"message": message, "type": kind, "code": kind}}).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    _sent = False  # the status line of the current request's answer went out
    _streaming = False  # ... and it began an event stream

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
        self._sent = True
        self.wfile.write(head + body)

    def _error(self, status: int, message: str, kind: str) -> None:
        """An error answer; once the answer has begun, a second status line would corrupt it:
        a stream under way ends with an error event, a whole answer closes the connection."""
        if not self._sent:
            self._reply(status, _error_body(message, kind))
        elif self._streaming:
            self._fail_stream(message, kind)
        else:
            self.close_connection = True

    def _start_stream(self) -> None:
        self._sent = self._streaming = True
        self.wfile.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
        )

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    def _fail_stream(self, message: str, kind: str) -> None:
        """End a stream already under way with an error event (the `openai` client raises it
        as an APIError) and no [DONE]; the connection is not reused."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self._chunk(b"data: " + _error_body(message, kind) + b"\n\n")
            self._end_stream()

    def _body(self) -> bytes:
        """The request's body, by its Content-Length or chunked (an HTTP/1.1 client that does
        not know the length beforehand may send it so), at most MAX_BODY bytes. BadBody when
        it cannot be read: the connection is then closed, since what is left of the body
        would be read as the next request."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            return self._chunked_body()
        raw = self.headers.get("Content-Length")
        if raw is None:
            return b""
        if not raw.strip().isdigit() or not raw.strip().isascii():
            raise BadBody(400, f"the request's Content-Length is not a byte count: {raw!r}")
        n = int(raw)
        if n > MAX_BODY:
            raise BadBody(413, f"request body of {n} bytes is over the {MAX_BODY}-byte limit")
        return self.rfile.read(n) if n else b""

    def _chunked_body(self) -> bytes:
        """A body in chunked transfer coding (RFC 9112 section 7.1), its chunk extensions and
        trailers skipped."""
        out = bytearray()
        while True:
            line = self.rfile.readline(1024)
            size = line.split(b";", 1)[0].strip()
            if not line.endswith(b"\n") or not size or size.strip(HEX_DIGITS):
                raise BadBody(400, "the request's chunked body is malformed (a bad chunk size)")
            n = int(size, 16)
            if n == 0:
                break
            if len(out) + n > MAX_BODY:
                raise BadBody(413, f"the request body is over the {MAX_BODY}-byte limit")
            data = self.rfile.read(n)
            if len(data) < n or self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise BadBody(400, "the request's chunked body is malformed (a chunk cut short)")
            out += data
        for _ in range(100):  # trailer fields, up to the empty line
            if self.rfile.readline(8192) in (b"\r\n", b"\n", b""):
                break
        return bytes(out)

    def _upstream_headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        for name in ("Authorization", "Accept", "OpenAI-Organization", "OpenAI-Project"):
            v = self.headers.get(name)
            if v:
                h[name] = v
        return h

    # ---------------------------------------------------------------- routes

    def do_GET(self) -> None:
        self._sent = self._streaming = False
        self._passthrough("GET", None)

    def do_POST(self) -> None:
        self._sent = self._streaming = False
        try:
            self.connection.settimeout(self.server.body_timeout)
            try:
                raw = self._body()
            except TimeoutError:
                raise BadBody(
                    408, f"the request's body did not arrive within {self.server.body_timeout:g}s"
                ) from None
            finally:
                self.connection.settimeout(None)
        except BadBody as e:
            self.close_connection = True
            self._error(e.status, str(e), e.kind)
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
            with up.call(method, path, raw, self._upstream_headers()) as r:
                status, data = r.status, r.body()
                ctype = r.header("Content-Type") or "application/json"
        except UpstreamError as e:
            if not isinstance(e, UpstreamAborted):
                s.fail(str(e))
            self._error(e.status, str(e), e.kind)
            return
        self._reply(status, data, ctype)

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
        odd = next((i for i, m in enumerate(body["messages"]) if not isinstance(m, dict)), None)
        if odd is not None:
            # the journal records messages as objects: one that is not would be sent but not
            # recorded, and the run would not hold what the model was asked
            self._error(400, f"messages[{odd}] is not a JSON object: a chat message is one", "car")
            return
        if body.get("n") not in (None, 1):
            self._error(400, f"n={body.get('n')!r}: one choice per call is recorded", "car")
            return
        problem = wire.seed_problem(body)
        if problem is not None:
            # refused before it reaches the upstream: an answer that cannot be journaled
            # would be lost, and the run with it
            self._error(400, f"car cannot record this request: {problem}", "car_bad_request")
            return
        agent, ordinal, rec = s.begin(self.headers.get(wire.AGENT_HEADER), body)
        try:
            self._answer(s, agent, ordinal, rec, body)
        except Miss as e:
            self._error(400, f"car replay miss: {e}", "car_replay_miss")
        except UpstreamError as e:
            if not isinstance(e, UpstreamAborted):
                s.fail(str(e))
            self._error(e.status, str(e), e.kind)
        except EngineError as e:
            s.fail(str(e))
            self._error(500, str(e), "car_error")
        except ConnectionError:
            self.close_connection = True
        except Exception as e:
            # a fault of car's own: the call is lost, so the run must not look complete
            message = f"car proxy failed a call of agent {agent!r}: {type(e).__name__}: {e}"
            s.fail(message)
            self.close_connection = True
            with contextlib.suppress(OSError):
                self._error(500, message, "car_error")
        finally:
            s.end()

    def _answer(
        self,
        s: Session,
        agent: str,
        ordinal: int,
        claimed: RecordedCall | None,
        body: dict[str, Any],
    ) -> None:
        route, rec = s.route(claimed)
        iv = s.intervention
        # the n of the tool-call ids the program gets: the recording's for a recorded call
        # (so they are the ids it saw then, in whatever order its calls come now), else the
        # call's own ordinal (past every recorded call of the agent: no id is given twice)
        ids = rec.issued if rec is not None else ordinal
        if route == "journal":
            # the seed source is not compared (params_of leaves it out): any will do
            entries = wire.request_entries(body, "client")
            s.check_recorded(agent, ordinal, rec, entries)
            assert rec is not None
            with s.lock:
                s.current = (rec.step, agent, False)
            self._send_answer(body, rec.answer(), agent, ids, rec.step)
            return
        if route == "intervene":
            assert rec is not None
            if isinstance(iv, DoAction):
                a = wire.Answer(iv.action, "stop", rec.call.model, [])
                self._journal_and_send(s, agent, ids, body, rec.call.seed, "branch", a, 0.0)
                return
            if isinstance(iv, DoObservation):
                a = rec.answer()
                if a.tool_calls:
                    s.observation_ids[wire.tool_call_id(agent, ids, 0)] = iv.observation
                self._journal_and_send(s, agent, ids, body, rec.call.seed, "branch", a, 0.0)
                return
            if isinstance(iv, DoPolicy):
                s.set_policy(dict(iv.policy))
            self._live(s, agent, ordinal, ids, body, at_k=True)
            return
        if route == "forced":
            assert rec is not None
            a = rec.answer()
            self._journal_and_send(s, agent, ids, body, rec.call.seed, "branch", a, 0.0)
            return
        self._live(s, agent, ordinal, ids, body, at_k=False)

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

    def _live(
        self, s: Session, agent: str, ordinal: int, ids: int, body: dict[str, Any], at_k: bool
    ) -> None:
        """Forward a call upstream (seeded by what it asks, its tool calls named by `ids`),
        journal it and answer it."""
        up = s.policy_upstream or s.upstream
        if up is None:
            raise UpstreamUnreachable("no upstream server to answer a live call (give --base-url)")
        seed, source = s.seed_for(agent, body)
        sent = s.edit(body, at_k) if s.fork_at is not None else body
        sent = {**sent, "seed": seed}
        payload = wire.canonical(sent).encode()
        t0 = time.perf_counter()
        with up.call("POST", "/chat/completions", payload, self._upstream_headers()) as r:
            if r.status != 200:
                data = r.body()
                s.upstream_errors.append(f"HTTP {r.status}")
                if s.fork_at is not None:
                    # a branch whose live part the upstream refused tested nothing: it is
                    # failed (unscored), as when the upstream cannot be reached
                    s.fail(f"upstream {up.url} answered HTTP {r.status}: {error_text(data)}")
                ctype = r.header("Content-Type") or "application/json"
                self._reply(r.status, data, ctype)
                return
            ctype = (r.header("Content-Type") or "").lower()
            if body.get("stream") and "json" not in ctype:
                self._live_stream(s, agent, ids, sent, seed, source, r, t0, up)
                return
            data = r.body()
        latency = (time.perf_counter() - t0) * 1000.0
        try:
            reply = wire.decode_json(data)
            if not isinstance(reply, dict):
                raise ValueError("the reply is not a JSON object")
            a = wire.answer_of(reply)
        except Exception as e:
            raise UpstreamError(f"upstream {up.url} sent an unreadable reply: {e}") from e
        k = s.journal_call(agent, ids, sent, seed, source, a, latency, up.url)
        if body.get("stream"):
            # a server that answers a streamed request with one completion: streamed on
            self._send_answer(body, a, agent, ids, k)
            return
        if a.tool_calls:
            wire.rewrite_tool_ids(reply, agent, ids)
            data = wire.canonical(reply).encode()
        self._reply(200, data)

    def _live_stream(
        self,
        s: Session,
        agent: str,
        ids: int,
        sent: dict[str, Any],
        seed: int,
        source: str,
        r: Any,
        t0: float,
        up: Upstream,
    ) -> None:
        """Relay the upstream's stream event by event and journal it once it is complete.
        The program's stream starts with the first good event, so a stream that fails before
        it is an HTTP error; a stream that fails later (cut, malformed, oversized, too slow)
        ends with an error event (`_chat` answers an UpstreamError either way). The call is not
        journaled, and the run fails unless the call was abandoned (the proxy closing)."""
        asm = wire.StreamAssembler(agent, ids)
        limit = up.max_reply_bytes
        for data in r.events():
            try:
                relay = asm.feed(data)
            except ValueError as e:
                raise UpstreamError(f"upstream {up.url} sent a malformed stream: {e}") from e
            if asm.size > limit:
                raise UpstreamError(
                    f"upstream {up.url} streamed a reply larger than the limit of {limit} "
                    "bytes (--max-reply-bytes)"
                )
            if not self._sent:
                self._start_stream()
            self._chunk(b"data: " + relay + b"\n\n")
        if not asm.complete:
            raise UpstreamError(
                f"upstream {up.url} ended its stream before it finished "
                "(no finish_reason, no [DONE])"
            )
        latency = (time.perf_counter() - t0) * 1000.0
        s.journal_call(agent, ids, sent, seed, source, asm.answer(), latency, up.url)
        if not self._sent:
            self._start_stream()
        self._end_stream()


class Proxy:
    """The server of one session, serving from a daemon thread until closed."""

    def __init__(
        self,
        session: Session,
        host: str = "127.0.0.1",
        port: int = 0,
        body_timeout: float = BODY_TIMEOUT_S,
    ) -> None:
        self.session = session
        self._server = _Server((host, port), _Handler)
        self._server.session = session
        self._server.body_timeout = body_timeout
        self.port = self._server.server_address[1]
        self.base_url = f"http://{host}:{self.port}/v1"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> Proxy:
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # an exception (Ctrl-C above all) ends the program: its calls' answers have no reader
        self.close(0.0 if exc_type is not None else 5.0)

    def close(self, wait: float = 5.0) -> None:
        """Stop accepting, wait (at most `wait` seconds) for calls in flight to be journaled,
        then abandon the rest: their upstream calls are cut and nothing more is journaled."""
        self._server.shutdown()
        self._server.server_close()
        idle = self.session.wait_idle(wait)
        self.session.abort()  # whatever is left is abandoned, and nothing new starts
        if not idle:
            self.session.wait_idle(2.0)


__all__ = ["DoResample", "Miss", "Proxy", "Session", "Upstream", "UpstreamError"]
