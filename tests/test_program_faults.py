"""The recording proxy against a hostile upstream: every way an OpenAI-compatible server can
fail a call (cut, malformed, endless, trickling, oversized, erroring) fails that call cleanly -
the program gets an HTTP or stream error, car says one line naming the upstream, the run is
closed `failed` - and nothing prints a traceback over the program's output.

The upstream is a real HTTP/1.1 server (http.server on 127.0.0.1) whose behaviour each request
picks by its `model` (`mode` or `mode:arg`); the program is a real `openai` client in a child
process that prints what it got and goes on."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from engine import events as ev
from engine.journal import Journal

ROOT = Path(__file__).resolve().parent.parent

# Each argument is one call: `model`, or `model#seed` to send that seed; --stream streams.
PROGRAM = """
import json, sys
from openai import OpenAI
c = OpenAI(max_retries=0)
stream = "--stream" in sys.argv
for item in [a for a in sys.argv[1:] if a != "--stream"]:
    model, _, seed = item.partition("#")
    extra = {"seed": int(seed)} if seed else {}
    msgs = [{"role": "user", "content": "q"}]
    try:
        if stream:
            chunks = c.chat.completions.create(model=model, messages=msgs, stream=True, **extra)
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        else:
            reply = c.chat.completions.create(model=model, messages=msgs, **extra)
            text = reply.choices[0].message.content
        print("ok", json.dumps(text[:40]), flush=True)
    except Exception as e:
        print("error", getattr(e, "status_code", None), type(e).__name__, str(e)[:300], flush=True)
"""


def _completion(text: str) -> dict[str, Any]:
    return {
        "id": "x",
        "object": "chat.completion",
        "created": 1,
        "model": "hostile",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def _chunk(delta: Any, finish: str | None = None) -> bytes:
    c = {"id": "s", "object": "chat.completion.chunk", "created": 1, "model": "hostile"}
    c["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
    return b"data: " + json.dumps(c).encode() + b"\n\n"


class _Hostile(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HostileUpstream

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.end_headers()
        self.wfile.write(body)

    def _sse_head(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _sse(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _cut(self) -> None:
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        with self.server.lock:
            self.server.requests.append(req)
        mode, _, arg = str(req.get("model")).partition(":")
        release = self.server.release
        if mode == "ok" and not req.get("stream"):
            self._send(200, json.dumps(_completion("fine")).encode())
        elif mode == "ok":  # a well-formed stream
            self._sse_head()
            for d in ({"role": "assistant", "content": ""}, {"content": "fine"}):
                self._sse(_chunk(d))
            self._sse(_chunk({}, "stop"))
            self._sse(b"data: [DONE]\n\n")
            self._sse(b"")
        elif mode == "close":  # announces 1000 bytes, sends 13, closes
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"choices": [')
            self._cut()
        elif mode == "badstream":  # one good event, then `arg`'s malformed one
            bad = {
                "toolint": _chunk({"tool_calls": [5]}),
                "fnstr": _chunk({"tool_calls": [{"index": 0, "id": "a", "function": "f"}]}),
                "notjson": b"data: {not json\n\n",
                "list": b"data: [1, 2]\n\n",
            }[arg]
            self._sse_head()
            self._sse(_chunk({"role": "assistant", "content": "half"}))
            self._sse(bad)
            self._sse(_chunk({}, "stop"))
            self._sse(b"data: [DONE]\n\n")
            self._sse(b"")
        elif mode == "cut":  # a stream that stops mid-way, no finish_reason, no [DONE]
            self._sse_head()
            self._sse(_chunk({"role": "assistant", "content": "half"}))
            self._cut()
        elif mode == "unfinished":  # ends cleanly but never says it is over
            self._sse_head()
            self._sse(_chunk({"role": "assistant", "content": "half"}))
            self._sse(b"")
        elif mode == "drip":  # a good reply, one byte every 0.2 s
            body = json.dumps(_completion("slow")).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for b in body:
                if release.wait(0.2):
                    return
                self.wfile.write(bytes([b]))
                self.wfile.flush()
        elif mode == "slowchunks":  # a stream of one word a second
            self._sse_head()
            self._sse(_chunk({"role": "assistant", "content": ""}))
            for _ in range(60):
                if release.wait(1.0):
                    return
                self._sse(_chunk({"content": "word "}))
        elif mode == "slow":  # thinks for `arg` seconds before answering
            if not release.wait(float(arg)):
                self._send(200, json.dumps(_completion("late")).encode())
        elif mode == "huge":  # a reply of `arg` bytes of text
            self._send(200, json.dumps(_completion("A" * int(arg))).encode())
        elif mode == "hugechunked":  # the same without Content-Length
            body = json.dumps(_completion("A" * int(arg))).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(body), 1 << 16):
                self._sse(body[i : i + (1 << 16)])
            self._sse(b"")
        elif mode == "gzipbomb":  # 64 MiB of spaces, ~64 KiB on the wire
            bomb = gzip.compress(b" " * (64 << 20), compresslevel=9)
            self._send(200, bomb, Content_Encoding="gzip")
        elif mode == "gzip":
            self._send(200, gzip.compress(json.dumps(_completion("zipped")).encode()),
                       Content_Encoding="gzip")  # fmt: skip
        elif mode == "wide":  # a stream of `arg` three-byte characters, 1000 an event
            self._sse_head()
            self._sse(_chunk({"role": "assistant", "content": ""}))
            for i in range(0, int(arg), 1000):
                self._sse(_chunk({"content": "\u20ac" * min(1000, int(arg) - i)}))
            self._sse(_chunk({}, "stop"))
            self._sse(b"data: [DONE]\n\n")
            self._sse(b"")
        elif mode == "gzipcut":  # half a gzip body, Content-Length and all
            zipped = gzip.compress(json.dumps(_completion("zipped")).encode())
            self._send(200, zipped[: len(zipped) // 2], Content_Encoding="gzip")
        elif mode == "gzipbad":  # a gzip header, then no deflate data
            bad = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03garbage-garbage"
            self._send(200, bad, Content_Encoding="gzip")
        elif mode == "brotli":  # an encoding nobody asked for
            self._send(200, b"xx", Content_Encoding="br")
        elif mode == "endless":  # a stream that never ends
            self._sse_head()
            while not release.is_set():
                self._sse(_chunk({"content": "x" * 1000}))
        elif mode == "nostream":  # answers a streamed request with one completion
            self._send(200, json.dumps(_completion("not streamed")).encode())
        elif mode == "http":
            self._send(int(arg), json.dumps({"error": {"message": "boom"}}).encode())
        elif mode == "badjson":
            self._send(200, b'{"choices": [ {"message": ')
        else:
            self._send(400, json.dumps({"error": {"message": f"unknown mode {mode}"}}).encode())


class HostileUpstream(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Hostile)
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.release = threading.Event()  # set on exit: slow answers give up
        self.base_url = f"http://127.0.0.1:{self.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # the proxy hanging up on a reply it refused is the point of these tests

    def __enter__(self) -> HostileUpstream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[HostileUpstream]:
    with HostileUpstream() as s:
        yield s


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("prog") / "prog.py"
    path.write_text(PROGRAM)
    return str(path)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "OPENAI_BASE_URL")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def car(journal: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), *args],
        capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=120,
    )  # fmt: skip


def record(
    journal: Path, upstream: HostileUpstream, program: str, *calls: str, opts: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return car(
        journal, "record", "--base-url", upstream.base_url, *opts, "--", sys.executable, program,
        *calls,
    )  # fmt: skip


def _only_run(journal: Path) -> tuple[str, list[ev.Event]]:
    with Journal(journal) as j:
        runs = [r for r in j.runs() if r.parent_run_id is None]
        assert len(runs) == 1
        return j.status(runs[0].run_id), j.events(runs[0].run_id)


def _printed(r: subprocess.CompletedProcess[str]) -> list[str]:
    """What the program printed, one line per call."""
    return [line for line in r.stdout.splitlines() if line.startswith(("ok ", "error "))]


def _one_error_line(r: subprocess.CompletedProcess[str], upstream: HostileUpstream) -> str:
    """car's stderr is exactly one line, an error naming the upstream; that line."""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: upstream {upstream.base_url} "), r.stderr
    assert lines[0].endswith("closed as failed)"), r.stderr
    return lines[0]


def test_streamed_calls_are_silent(tmp_path: Path, upstream: HostileUpstream, program: str) -> None:
    """Three streamed calls: the program closing its kept-alive connection after each [DONE]
    is normal, so car's stderr stays empty (no 'Exception occurred', no traceback)."""
    r = record(tmp_path / "j.db", upstream, program, "--stream", "ok", "ok", "ok")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert _printed(r) == ['ok "fine"'] * 3
    status, events = _only_run(tmp_path / "j.db")
    assert status == "completed"
    assert [e.response for e in events if isinstance(e, ev.LlmCall)] == ["fine"] * 3


def test_upstream_closing_mid_reply_fails_the_run(
    tmp_path: Path, upstream: HostileUpstream, program: str
) -> None:
    """Content-Length 1000, 13 bytes, close: the program gets a 502 with a JSON error (and
    goes on), car says one line naming the upstream, the run is failed and the broken reply
    is not journaled."""
    r = record(tmp_path / "j.db", upstream, program, "close", "ok")
    assert r.returncode == 1
    first, second = _printed(r)
    assert first.startswith("error 502 InternalServerError")
    assert "closed the connection mid-reply (13 bytes read, 987 more announced)" in first
    assert second == 'ok "fine"'
    line = _one_error_line(r, upstream)
    assert "closed the connection mid-reply" in line
    status, events = _only_run(tmp_path / "j.db")
    assert status == "failed"
    assert [e.response for e in events if isinstance(e, ev.LlmCall)] == ["fine"]


@pytest.mark.parametrize(
    ("variant", "match"),
    [
        ("toolint", "Expected `object`, got `int` - at `$.choices[0].delta.tool_calls[0]`"),
        ("fnstr", "Expected `object | null`, got `str` - at `$.choices[0].delta.tool_calls[0]"),
        ("notjson", "an event is not JSON"),
        ("list", "an event is not a JSON object: '[1, 2]'"),
    ],
)
def test_malformed_stream_chunk_fails_the_call(
    tmp_path: Path, upstream: HostileUpstream, program: str, variant: str, match: str
) -> None:
    """A streamed chunk that is not a chat-completion chunk ends the program's stream with an
    error event (the openai client raises APIError), the call is not journaled, the run is
    failed with one line saying what was wrong and where; no traceback."""
    r = record(tmp_path / "j.db", upstream, program, "--stream", f"badstream:{variant}")
    assert r.returncode == 1
    (printed,) = _printed(r)
    assert printed.startswith("error None APIError upstream")
    assert match in printed
    line = _one_error_line(r, upstream)
    assert "sent a malformed stream" in line and match in line
    status, events = _only_run(tmp_path / "j.db")
    assert status == "failed"
    assert not any(isinstance(e, ev.LlmCall) for e in events)


@pytest.mark.parametrize(
    ("mode", "match"),
    [
        ("cut", "dropped the connection mid-reply"),
        ("unfinished", "ended its stream before it finished (no finish_reason, no [DONE])"),
    ],
)
def test_unfinished_stream_is_an_error(
    tmp_path: Path, upstream: HostileUpstream, program: str, mode: str, match: str
) -> None:
    """A stream that stops before it said it was over (a cut connection, or a clean end with
    neither finish_reason nor [DONE]) is not a completion: the program's stream ends with an
    error, nothing is journaled, the run is failed naming the upstream."""
    r = record(tmp_path / "j.db", upstream, program, "--stream", mode)
    assert r.returncode == 1
    (printed,) = _printed(r)
    assert printed.startswith("error None APIError") and match in printed
    assert match in _one_error_line(r, upstream)
    status, events = _only_run(tmp_path / "j.db")
    assert status == "failed"
    assert not any(isinstance(e, ev.LlmCall) for e in events)


@pytest.mark.parametrize(
    ("calls", "status_printed"),
    [
        (("drip",), "error 504 InternalServerError"),  # a good reply, a byte at a time
        (("slow:30",), "error 504 InternalServerError"),  # no answer at all
        (("--stream", "slowchunks"), "error None APIError"),  # a stream, a word a second
    ],
)
def test_timeout_bounds_the_whole_call(
    tmp_path: Path,
    upstream: HostileUpstream,
    program: str,
    calls: tuple[str, ...],
    status_printed: str,
) -> None:
    """--timeout is a deadline over the whole upstream call, whatever the server trickles: the
    call ends at it (504, or an error event once streaming), the run is failed with one line
    'took longer than 1 s' (a timeout is not 'unreachable')."""
    t0 = time.monotonic()
    r = record(tmp_path / "j.db", upstream, program, *calls, opts=("--timeout", "1"))
    elapsed = time.monotonic() - t0
    assert r.returncode == 1
    assert elapsed < 15, f"the call outlived its 1 s deadline: {elapsed:.1f} s"
    (printed,) = _printed(r)
    assert printed.startswith(status_printed) and "took longer than 1 s" in printed
    line = _one_error_line(r, upstream)
    assert line.startswith(f"error: upstream {upstream.base_url} took longer than 1 s")
    assert "unreachable" not in line
    assert _only_run(tmp_path / "j.db")[0] == "failed"


@pytest.mark.parametrize(
    ("calls", "opts", "match"),
    [
        (("huge:1000000",), (), "sent a reply of 1000"),
        (("hugechunked:1000000",), (), "sent a reply larger than the limit of 262144 bytes"),
        (("gzipbomb",), (), "sent a reply larger than the limit of 262144 bytes"),
        (("--stream", "endless"), (), "streamed a reply larger than the limit of 262144 bytes"),
        # 30000 characters, but 90000 bytes of UTF-8
        (("--stream", "wide:30000"), ("--max-reply-bytes", "65536"), "the limit of 65536 bytes"),
        (("huge:100000",), ("--max-reply-bytes", "65536"), "the limit of 65536 bytes"),
    ],
)
def test_reply_size_is_bounded(
    tmp_path: Path,
    upstream: HostileUpstream,
    program: str,
    calls: tuple[str, ...],
    opts: tuple[str, ...],
    match: str,
) -> None:
    """An upstream reply over --max-reply-bytes (default 256 KiB, like the heist's policy) -
    announced, chunked, a gzip bomb, an endless stream, or a stream whose text is fewer
    characters than the bound but more UTF-8 bytes - fails its call with one line and the run
    with it; nothing of it is journaled."""
    r = record(tmp_path / "j.db", upstream, program, *calls, opts=opts)
    assert r.returncode == 1
    (printed,) = _printed(r)
    assert printed.startswith("error") and match in printed
    line = _one_error_line(r, upstream)
    assert match in line and "(--max-reply-bytes)" in line
    status, events = _only_run(tmp_path / "j.db")
    assert status == "failed"
    assert not any(isinstance(e, ev.LlmCall) for e in events)


def test_replies_within_the_bound_pass(
    tmp_path: Path, upstream: HostileUpstream, program: str
) -> None:
    """A 200 KB reply is under the default bound, and a gzipped reply is relayed decompressed:
    both are journaled and the run completes."""
    r = record(tmp_path / "j.db", upstream, program, "huge:200000", "gzip")
    assert r.returncode == 0, r.stderr
    assert _printed(r) == ['ok "' + "A" * 40 + '"', 'ok "zipped"']
    status, events = _only_run(tmp_path / "j.db")
    assert status == "completed"
    calls = [e for e in events if isinstance(e, ev.LlmCall)]
    assert [len(c.response) for c in calls] == [200000, 6]


@pytest.mark.parametrize(
    ("mode", "match"),
    [
        ("gzipcut", "sent a truncated gzip body"),
        ("gzipbad", "sent a corrupt gzip body: Error -3 while decompressing data"),
        ("brotli", "sent a reply in an unsupported encoding 'br'"),
    ],
)
def test_a_reply_in_a_broken_encoding_fails_the_call(
    tmp_path: Path, upstream: HostileUpstream, program: str, mode: str, match: str
) -> None:
    """A compressed reply that stops inside its gzip stream, is no gzip data, or comes in an
    encoding the request did not offer is a 502 for the program and one line for car; the
    run is failed and nothing is journaled."""
    r = record(tmp_path / "j.db", upstream, program, mode)
    assert r.returncode == 1
    (printed,) = _printed(r)
    assert printed.startswith("error 502 InternalServerError") and match in printed
    assert match in _one_error_line(r, upstream)
    status, events = _only_run(tmp_path / "j.db")
    assert status == "failed"
    assert not any(isinstance(e, ev.LlmCall) for e in events)


def test_a_stream_within_the_bound_in_bytes_passes(
    tmp_path: Path, upstream: HostileUpstream, program: str
) -> None:
    """A stream's bound counts the UTF-8 bytes of its text, not the bytes of its events: 20000
    three-byte characters (60000 bytes, sent as 120000 bytes of `\\u20ac` escapes) pass a
    65536-byte bound and are journaled whole."""
    opts = ("--max-reply-bytes", "65536")
    r = record(tmp_path / "j.db", upstream, program, "--stream", "wide:20000", opts=opts)
    assert r.returncode == 0, r.stderr
    assert _printed(r) == ["ok " + json.dumps("\u20ac" * 40)]
    status, events = _only_run(tmp_path / "j.db")
    assert status == "completed"
    assert [e.response for e in events if isinstance(e, ev.LlmCall)] == ["\u20ac" * 20000]


def test_a_completion_for_a_streamed_request_is_streamed_on(
    tmp_path: Path, upstream: HostileUpstream, program: str
) -> None:
    """A server that answers `stream: true` with one JSON completion: the program still gets
    a stream (the completion's text), and the call is journaled like any other."""
    r = record(tmp_path / "j.db", upstream, program, "--stream", "nostream")
    assert r.returncode == 0, r.stderr
    assert _printed(r) == ['ok "not streamed"']
    status, events = _only_run(tmp_path / "j.db")
    assert status == "completed"
    assert [e.response for e in events if isinstance(e, ev.LlmCall)] == ["not streamed"]


def test_seed_outside_64_bits_is_refused_before_forwarding(
    tmp_path: Path, upstream: HostileUpstream, program: str
) -> None:
    """A request whose seed no journal can hold (10**20) gets a 400 JSON error and never
    reaches the upstream; the program goes on and the run completes with its other call."""
    before = len(upstream.requests)
    r = record(tmp_path / "j.db", upstream, program, f"ok#{10**20}", "ok")
    assert r.returncode == 0, r.stderr
    refused, fine = _printed(r)
    assert refused.startswith("error 400 BadRequestError")
    assert "seed=100000000000000000000 is outside the 64-bit range" in refused
    assert fine == 'ok "fine"'
    assert [q.get("seed") for q in upstream.requests[before:]] != [10**20]
    assert len(upstream.requests) - before == 1
    status, events = _only_run(tmp_path / "j.db")
    assert status == "completed"
    assert sum(isinstance(e, ev.LlmCall) for e in events) == 1


# ------------------------------------------------------------------ forks


def _recorded(tmp_path: Path, upstream: HostileUpstream, program: str) -> tuple[Path, str]:
    journal = tmp_path / "j.db"
    r = record(journal, upstream, program, "ok", "ok")
    assert r.returncode == 0, r.stderr
    with Journal(journal) as j:
        (info,) = j.runs()
    return journal, info.run_id


@pytest.mark.parametrize("model", ["http:500", "http:404", "badjson"])
def test_upstream_failure_in_a_branch_fails_it_unscored(
    tmp_path: Path, upstream: HostileUpstream, program: str, model: str
) -> None:
    """An HTTP error or an unreadable reply in a branch's live part is the upstream's failure,
    not the program's outcome: every branch is `failed` and unscored (no bad rate), as when
    the upstream is unreachable, and the fork says so in its last line."""
    journal, run_id = _recorded(tmp_path, upstream, program)
    r = car(journal, "fork", run_id, "--at", "1", "--do", "policy", "--value",
            f"openai:model={model}", "-n", "2", "--", sys.executable, program,
            "ok", "ok")  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert "bad rate" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: every branch failed (2 of 2): upstream {upstream.base_url}")
    with Journal(journal) as j:
        kids = j.children(run_id)
        assert len(kids) == 2
        for kid in kids:
            assert j.status(kid.run_id) == "failed"
            end = j.events(kid.run_id)[-1]
            assert isinstance(end, ev.RunEnded) and end.outcome["bad"] is None


def test_ctrl_c_during_a_live_call_of_a_fork_closes_branches_stopped(
    tmp_path: Path, upstream: HostileUpstream, program: str
) -> None:
    """SIGINT while a branch waits on an upstream that takes 30 s: the call is abandoned at
    once, so the branch is closed `stopped` well within the hard-exit grace; after exit 130 no
    run is left `recording` or `abandoned`."""
    journal, run_id = _recorded(tmp_path, upstream, program)
    before = len(upstream.requests)
    p = subprocess.Popen(
        [sys.executable, "-m", "cli", "--journal", str(journal), "fork", run_id, "--at", "1",
         "--do", "policy", "--value", "openai:model=slow:30", "-n", "3", "-c", "1", "--",
         sys.executable, program, "ok", "ok"],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(upstream.requests) == before:  # the branch's call k is at the upstream
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=30)
    assert p.returncode == 130
    assert time.monotonic() - t0 < 5
    with Journal(journal) as j:
        kids = j.children(run_id)
        assert len(kids) == 1  # the next branches never started
        statuses = {j.status(r.run_id) for r in j.runs()}
        assert statuses == {"completed", "stopped"}
        assert j.status(kids[0].run_id) == "stopped"


def test_an_upstream_that_is_done_holds_no_watchdog_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The deadline watchdog leaves once its upstream is aborted, or idle for a while: a fork
    makes an Upstream a branch, and each kept a thread for good before."""
    import http.server
    import threading
    import time

    from engine.program import upstream as upstream_mod
    from engine.program.upstream import Upstream

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = b'{"ok": 1}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    def watchdogs() -> int:
        return sum(t.name == "car-upstream-watchdog" for t in threading.enumerate())

    def settle(want: int) -> int:
        deadline = time.monotonic() + 5
        while watchdogs() != want and time.monotonic() < deadline:
            time.sleep(0.02)
        return watchdogs()

    monkeypatch.setattr(upstream_mod, "WATCHDOG_IDLE_S", 0.2)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        before = watchdogs()
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
        aborted = [Upstream(url, timeout=600) for _ in range(3)]
        for up in aborted:
            with up.call("POST", "/chat/completions", b"{}", {}) as reply:
                reply.body()
            up.abort()
        idle = Upstream(url, timeout=600)
        with idle.call("POST", "/chat/completions", b"{}", {}) as reply:
            reply.body()
        assert settle(before) == before
    finally:
        srv.shutdown()
