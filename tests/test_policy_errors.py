"""An LLM server that fails never loses the run: the failed request is journaled, the run is
closed as failed with one clear PolicyError message, and the hash chain stays intact.

The failures come from real HTTP servers: a closed port on 127.0.0.1, and small threaded
`http.server` instances in this file that answer the first requests like an OpenAI-compatible
server and then misbehave (HTTP 500, malformed JSON, JSON without `choices`, no answer).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from engine import events as ev
from engine.heist.session import record_heist
from engine.journal import Journal
from engine.policies.registry import make_policy

CAR = Path(sys.executable).with_name("car")
CANNED = "Checking the vault. [TOOL:calculator:4*9+6] [PLAN:crack_minutes=42]"


# --------------------------------------------------------------------------- servers


@contextlib.contextmanager
def closed_port() -> Iterator[str]:
    """Base URL of a port on 127.0.0.1 that is bound (so nobody else takes it) but never
    listens: every connection is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def completion_body(text: str = CANNED) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": "canned",
        "system_fingerprint": "fp_canned",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
    }


Misbehaviour = Callable[[BaseHTTPRequestHandler, threading.Event], None]


def send(handler: BaseHTTPRequestHandler, status: int, body: bytes, ctype: str) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", ctype)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def http_500(h: BaseHTTPRequestHandler, _: threading.Event) -> None:
    send(h, 500, b'{"error": {"message": "model crashed", "type": "server_error"}}',
         "application/json")  # fmt: skip


def malformed_json(h: BaseHTTPRequestHandler, _: threading.Event) -> None:
    send(h, 200, b'{"id": "chatcmpl-test", "choices": [{"message": ', "application/json")


def no_choices(h: BaseHTTPRequestHandler, _: threading.Event) -> None:
    body = {k: v for k, v in completion_body().items() if k != "choices"}
    send(h, 200, json.dumps(body).encode(), "application/json")


def hang(_: BaseHTTPRequestHandler, release: threading.Event) -> None:
    release.wait(60)  # never answers; released when the test's server shuts down


class FlakyServer:
    """A real HTTP server on 127.0.0.1:0 that answers the first `good` chat completions with a
    canned reply and every later request with `misbehave`. It keeps every request body."""

    def __init__(self, misbehave: Misbehaviour, good: int) -> None:
        self.misbehave = misbehave
        self.good = good
        self.requests: list[dict[str, Any]] = []
        self.release = threading.Event()
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer._lock:
                    outer.requests.append({"path": self.path, "body": json.loads(raw or b"{}")})
                    n = len(outer.requests)
                if n <= outer.good:
                    send(self, 200, json.dumps(completion_body()).encode(), "application/json")
                else:
                    with contextlib.suppress(OSError):
                        outer.misbehave(self, outer.release)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FlakyServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(10)


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    with Journal(tmp_path / "journal.db") as j:
        yield j


def openai_spec(base_url: str, **extra: Any) -> dict[str, Any]:
    return {"name": "openai", "base_url": base_url, "model": "smollm2", **extra}


def assert_closed_as_failed(
    journal: Journal, run_id: str, failed_step: int, base_url: str
) -> tuple[ev.LlmCall, ev.RunEnded]:
    """The run's last two events are the failed request and RunEnded(failed); every earlier
    step is complete; the hash chain verifies."""
    events = journal.events(run_id)
    *before, call, end = events
    assert isinstance(end, ev.RunEnded), end
    assert end.status == "failed"
    assert end.error is not None and base_url in end.error
    assert isinstance(call, ev.LlmCall), call
    assert (call.step, call.finish_reason, call.response) == (failed_step, "error", "")
    assert call.request and call.request[0]["role"] == "system"
    assert journal.status(run_id) == "failed"
    steps = [e for e in before if isinstance(e, ev.LlmCall)]
    assert [c.step for c in steps] == list(range(failed_step))
    for k in range(failed_step):
        kinds = [ev.kind_of(e) for e in before if e.step == k]
        assert kinds == ["llm_call", "tool_call", "tool_result", "chat_message"], (k, kinds)
    report = journal.verify(run_id)
    assert report.ok, report.problems
    assert report.events_checked == len(events)
    return call, end


# --------------------------------------------------------------------------- tests


def test_unreachable_server_closes_the_run_as_failed_and_journals_the_request(
    journal: Journal,
) -> None:
    """A refused connection ends record_heist as failed, with the request and an error naming
    the server journaled, and the chain intact."""
    with closed_port() as url:
        policy = make_policy(openai_spec(url, max_retries=0, timeout=5))
        result = record_heist(journal, policy, seed=3, rounds=1)
    assert result.status == "failed"
    assert result.steps == 0
    assert result.error is not None and "unreachable" in result.error and url in result.error
    call, end = assert_closed_as_failed(journal, result.run_id, 0, url)
    assert end.error == result.error
    assert call.model == "smollm2"


def test_cli_heist_against_unreachable_server_exits_non_zero_with_one_error_line(
    tmp_path: Path,
) -> None:
    """`car heist --policy openai` against a closed port exits non-zero with exactly one stderr
    line, "error: ..." naming the run and the server, and leaves the run closed as failed."""
    db = tmp_path / "cli.db"
    with closed_port() as url:
        proc = subprocess.run(
            [str(CAR), "--journal", str(db), "heist", "--policy", "openai", "--base-url", url,
             "--model", "smollm2", "--rounds", "1", "--seed", "3"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and url in lines[0] and "unreachable" in lines[0]
    with Journal(db, create=False) as j:
        (run,) = j.runs()
        assert run.run_id in lines[0]
        assert_closed_as_failed(j, run.run_id, 0, url)


@pytest.mark.parametrize(
    ("misbehave", "message"),
    [
        (http_500, r"answered HTTP 500"),
        (malformed_json, r"answered with malformed JSON: Input data was truncated"),
        (no_choices, r"malformed completion: Object missing required field `choices`"),
        (hang, r"timed out after 1s"),
    ],
    ids=["http-500", "malformed-json", "no-choices", "hangs"],
)
def test_misbehaving_server_fails_the_step_with_a_policy_error_and_loses_nothing(
    journal: Journal, misbehave: Misbehaviour, message: str
) -> None:
    """A server that answers two steps and then misbehaves fails step 2 with one clear message;
    steps 0-1 stay complete, the failed request is the one the server got, verify is ok."""
    with FlakyServer(misbehave, good=2) as server:
        policy = make_policy(openai_spec(server.base_url, timeout=1, max_retries=0))
        result = record_heist(journal, policy, seed=11, rounds=1)
    assert result.status == "failed", result
    assert result.steps == 2
    assert result.error is not None
    assert result.error.startswith(f"LLM server {server.base_url!r}")
    assert "\n" not in result.error
    assert re.search(message, result.error), result.error
    call, _ = assert_closed_as_failed(journal, result.run_id, 2, server.base_url)
    assert len(server.requests) == 3  # max_retries=0: no second attempt
    sent = server.requests[-1]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["body"]["messages"] == call.request
    assert sent["body"]["seed"] == call.seed
    # the steps before the failure hold what the server answered, tools included
    before = [e for e in journal.events(result.run_id) if isinstance(e, ev.LlmCall)][:2]
    for c in before:
        assert (c.response, c.model, c.system_fingerprint) == (CANNED, "canned", "fp_canned")
        assert (c.prompt_tokens, c.completion_tokens) == (11, 7)


def test_http_500_is_retried_max_retries_times(journal: Journal) -> None:
    """With max_retries=2 a server answering HTTP 500 receives exactly 3 requests, then the run
    fails."""
    with FlakyServer(http_500, good=0) as server:
        policy = make_policy(openai_spec(server.base_url, timeout=5, max_retries=2))
        result = record_heist(journal, policy, seed=5, rounds=1)
    assert result.status == "failed"
    assert len(server.requests) == 3
    assert len({json.dumps(r["body"], sort_keys=True) for r in server.requests}) == 1
    assert_closed_as_failed(journal, result.run_id, 0, server.base_url)
