"""A canned OpenAI-compatible server for the recorded-program tests and the proxy benchmark.

A real HTTP/1.1 server on 127.0.0.1 (keep-alive, one thread per connection) that answers chat
completions instantly: a forced `tool_choice` gets a calculator tool call, anything else a
text that depends on the request's seed and message count (so a re-drawn call differs and a
replayed one can be told apart). `stream: true` gets server-sent events. It stands in for a
model only where speed or a fixed reply is the point; the real llama.cpp server is used
wherever the model itself matters.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: a program of two calls that, run as a fork's branch (SLOW set), then sleeps a minute: the
#: branch is in the middle of its program when the test interrupts it
SLOW_WHEN_FORKED = """
import os, sys, time
from openai import OpenAI
c = OpenAI(max_retries=0)
c.chat.completions.create(model="m", messages=[{"role": "user", "content": "one"}])
c.chat.completions.create(model="m", messages=[{"role": "user", "content": "two"}])
if os.environ.get("SLOW"):
    print("called", file=sys.stderr, flush=True)
    time.sleep(60)
"""


def reply_for(req: dict[str, Any]) -> dict[str, Any]:
    messages = req.get("messages") or []
    seed = req.get("seed")
    choice = req.get("tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_upstream_1",
                    "type": "function",
                    "function": {"name": name, "arguments": '{"a": 6, "op": "*", "b": 7}'},
                }
            ],
        }
        finish = "tool_calls"
    else:
        text = f"canned reply {seed} to {len(messages)} messages"
        message = {"role": "assistant", "content": text}
        finish = "stop"
    return {
        "id": "chatcmpl-canned",
        "object": "chat.completion",
        "created": 1,
        "model": "canned-model",
        "system_fingerprint": "fp_canned",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def sse_for(body: dict[str, Any]) -> bytes:
    msg = body["choices"][0]["message"]
    base = {k: body[k] for k in ("id", "created", "model", "system_fingerprint")}
    base["object"] = "chat.completion.chunk"
    chunks = [{"role": "assistant", "content": ""}]
    text = msg.get("content") or ""
    chunks += [{"content": w} for w in text.split(" ") if w]
    for i, tc in enumerate(msg.get("tool_calls") or []):
        chunks.append({"tool_calls": [{**tc, "index": i}]})
    out = b""
    for i, d in enumerate(chunks):
        if "content" in d and i > 1:
            d = {"content": " " + d["content"]}
        c = {**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]}
        out += b"data: " + json.dumps(c).encode() + b"\n\n"
    fin = {
        **base,
        "choices": [
            {"index": 0, "delta": {}, "finish_reason": body["choices"][0]["finish_reason"]}
        ],
    }
    out += b"data: " + json.dumps(fin).encode() + b"\n\n"
    out += b"data: [DONE]\n\n"
    return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: CannedServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        head = (
            f"HTTP/1.1 {status} OK\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.wfile.write(head + body)

    def do_GET(self) -> None:
        self._send(200, json.dumps({"object": "list", "data": [{"id": "canned-model"}]}).encode())

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        req = json.loads(self.rfile.read(n) or b"{}")
        with self.server.lock:
            self.server.requests.append(req)
        body = reply_for(req)
        if req.get("stream"):
            self._send(200, sse_for(body), "text/event-stream")
        else:
            self._send(200, json.dumps(body).encode())


class CannedServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.base_url = f"http://127.0.0.1:{self.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    def __enter__(self) -> CannedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class ReorderingServer(CannedServer):
    """A canned server that answers the first chat completion it gets only once the next one
    has been answered: two calls in flight together are answered in the reverse of the order
    they came in, as a server that serves requests side by side may (llama.cpp's answers one
    at a time, in arrival order). A first call left alone is answered after `hold` seconds
    (long: under a heavy load the second call has taken over 10 s to come, and the first was
    then answered first)."""

    def __init__(self, hold: float = 60.0) -> None:
        super().__init__()
        self.RequestHandlerClass = _ReorderingHandler
        self.hold = hold
        self.posts = 0
        self.second_answered = threading.Event()
        self.first_answered = threading.Event()
        self.settle = 0.5  # seconds between the second answer and the first


class _ReorderingHandler(_Handler):
    server: ReorderingServer

    def do_POST(self) -> None:
        with self.server.lock:
            self.server.posts += 1
            n = self.server.posts
        if n == 1:
            self.server.second_answered.wait(self.server.hold)
            # the proxy journals the second answer in the thread that got it: give it time to,
            # or the first, answered a moment later, may be journaled first (seen once in CI)
            time.sleep(self.server.settle)
        elif n > 2:
            # later calls (the second's task going on) wait for the first's answer: the two
            # swapped are the journal's first two steps
            self.server.first_answered.wait(self.server.hold)
        super().do_POST()
        if n == 1:
            self.server.first_answered.set()
        if n == 2:
            self.server.second_answered.set()
