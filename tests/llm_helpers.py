"""A small local OpenAI-compatible HTTP server whose every answer a test scripts.

`scripted_server(reply)` serves POST /v1/chat/completions on 127.0.0.1: `reply(request)` gets
the decoded JSON request and returns (HTTP status, body) — a dict body is sent as JSON, bytes
as they are. The requests received are kept in `server.requests` and their headers (names in
lower case) in `server.headers`, in order.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

Reply = Callable[[dict[str, Any]], tuple[int, dict[str, Any] | bytes]]


def completion(
    content: str | None,
    *,
    model: str | None = "served-model",
    finish_reason: str | None = "stop",
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A chat.completion body with one choice."""
    body: dict[str, Any] = {
        "id": "c1",
        "object": "chat.completion",
        "created": 0,
        "choices": [
            {
                "index": 0,
                "finish_reason": finish_reason,
                "message": {"role": "assistant", "content": content},
            }
        ],
    }
    if model is not None:
        body["model"] = model
    if usage is not None:
        body["usage"] = usage
    return body


@dataclass
class Scripted:
    url: str  # the base URL, ending in /v1
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # of each request, in order


@contextlib.contextmanager
def scripted_server(reply: Reply) -> Iterator[Scripted]:
    server = Scripted("")

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            server.requests.append(request)
            server.headers.append({k.lower(): v for k, v in self.headers.items()})
            status, body = reply(request)
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up waiting (the timeout tests): nobody to answer

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # a short poll interval: shutdown() waits for it
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()


def planner_view() -> Any:
    """A minimal AgentView for calling a policy directly (its fields but the messages unused
    by the openai policy)."""
    from engine.policies.base import AgentView

    return AgentView(
        run_id="r",
        step=0,
        round=0,
        agent="planner",
        role="planner",
        system_prompt="You plan.",
        agents=("planner",),
        transcript=(),
        observations=(),
    )
