"""Every fault of an OpenAI-compatible server ends the same way: one clear line, a non-zero exit,
the run closed as `failed` with the failed request and the error journaled, within the total
deadline that `timeout` sets, and a journal whose every event still decodes and verifies.

The faults are produced for real by `FaultyLLMServer` (tests/servers.py), a TCP server on
127.0.0.1 that answers two steps well and then writes the fault byte by byte.
"""

# ruff: noqa: E501  (the fault table reads best one fault per line)
from __future__ import annotations

import functools
import json
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from servers import CANNED_TEXT, FaultyLLMServer, Request, completion_body, http_response

from engine import events as ev
from engine.errors import ConfigError
from engine.heist.session import record_heist
from engine.journal import Journal
from engine.policies.base import AgentView
from engine.policies.openai_policy import DEFAULT_MAX_REPLY_BYTES
from engine.policies.registry import make_policy

CAR = Path(sys.executable).with_name("car")
TIMEOUT = 2.0
# what a call may overrun its deadline by: the watchdog's thread wake-up and the closing
SLACK = 1.5

# --------------------------------------------------------------------------- faults


def _send(conn: socket.socket, data: bytes) -> None:
    conn.sendall(data)


def status(code: int, body: bytes = b"", **headers: str) -> Any:
    def fault(conn: socket.socket, _: Request, __: threading.Event) -> None:
        payload = body or json.dumps({"error": {"message": f"status {code}"}}).encode()
        _send(conn, http_response(code, payload, headers=headers))

    return fault


def json_body(body: object) -> Any:
    def fault(conn: socket.socket, _: Request, __: threading.Event) -> None:
        _send(conn, http_response(200, json.dumps(body).encode()))

    return fault


def raw_body(body: bytes, ctype: str = "application/json") -> Any:
    def fault(conn: socket.socket, _: Request, __: threading.Event) -> None:
        _send(conn, http_response(200, body, ctype=ctype))

    return fault


def reset(conn: socket.socket, _: Request, __: threading.Event) -> None:
    # linger 0: close sends RST instead of FIN
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def hang(_: socket.socket, __: Request, release: threading.Event) -> None:
    release.wait(60)


def trickle_body(conn: socket.socket, _: Request, release: threading.Event) -> None:
    body = json.dumps(completion_body()).encode()
    head, _, rest = http_response(200, body).partition(b"\r\n\r\n")
    _send(conn, head + b"\r\n\r\n")
    for i in range(len(rest)):
        _send(conn, rest[i : i + 1])
        if release.wait(1.0):
            return


def trickle_headers(conn: socket.socket, _: Request, release: threading.Event) -> None:
    data = http_response(200, json.dumps(completion_body()).encode())
    for i in range(len(data)):
        _send(conn, data[i : i + 1])
        if release.wait(1.0):
            return


def truncated(conn: socket.socket, _: Request, __: threading.Event) -> None:
    body = json.dumps(completion_body()).encode()
    full = http_response(200, body)
    _send(conn, full[: len(full) - len(body) // 2])


def garbage_status(conn: socket.socket, _: Request, __: threading.Event) -> None:
    _send(conn, b"SSH-2.0-OpenSSH_9.2\r\n\r\n")


def endless_headers(conn: socket.socket, _: Request, release: threading.Event) -> None:
    _send(conn, b"HTTP/1.1 200 OK\r\n")
    for i in range(100_000):
        if release.is_set():
            return
        _send(conn, f"X-Filler-{i}: {'y' * 50}\r\n".encode())


def huge_reply(declared: bool) -> Any:
    def fault(conn: socket.socket, _: Request, __: threading.Event) -> None:
        text = "A" * (5 * 1024 * 1024)
        _send(conn, http_response(200, json.dumps(completion_body(text)).encode(), length=declared))

    return fault


@functools.cache
def gzip_bomb(size: int) -> bytes:
    """A gzip body of ~size/1000 bytes that inflates to a `size`-byte JSON completion.

    Built in a fraction of a second: after a full flush deflate forgets its window, so every
    1 MiB block of "A" compresses to the same bytes, which are repeated."""
    prefix, block, suffix = b'{"choices": [{"message": {"content": "', b"A" * MIB, b'"}}]}'
    z = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    head = z.compress(prefix) + z.flush(zlib.Z_FULL_FLUSH)
    packed = z.compress(block) + z.flush(zlib.Z_FULL_FLUSH)
    tail = z.compress(suffix) + z.flush()
    n = size // MIB
    crc = zlib.crc32(prefix)
    for _ in range(n):
        crc = zlib.crc32(block, crc)
    crc = zlib.crc32(suffix, crc)
    total = len(prefix) + n * MIB + len(suffix)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03"
    return header + head + packed * n + tail + struct.pack("<II", crc, total & 0xFFFFFFFF)


def bomb(size: int) -> Any:
    def fault(conn: socket.socket, _: Request, __: threading.Event) -> None:
        _send(conn, http_response(200, gzip_bomb(size), headers={"Content-Encoding": "gzip"}))

    fault.prepare = lambda: gzip_bomb(size)  # type: ignore[attr-defined]  # build before timing
    return fault


def choices(value: object) -> Any:
    return json_body(completion_body(choices=value))


def message(content: object) -> Any:
    return json_body(
        completion_body(choices=[{"message": {"role": "assistant", "content": content}}])
    )


def usage(value: object) -> Any:
    return json_body(completion_body(usage={"prompt_tokens": 3, "completion_tokens": value}))


def usage_raw(number: str) -> Any:
    body = json.dumps(completion_body(usage={"prompt_tokens": 3, "completion_tokens": 0}))
    return raw_body(
        body.replace('"completion_tokens": 0', f'"completion_tokens": {number}').encode()
    )


MIB = 1 << 20

# (id, fault, regex the error must match, extra policy options)
FAULTS: list[tuple[str, Any, str, dict[str, Any]]] = [
    ("http-400", status(400), r"answered HTTP 400: status 400$", {}),
    ("http-401", status(401), r"answered HTTP 401", {}),
    ("http-404-html", status(404, b"<html><h1>Not Found</h1></html>"), r"HTTP 404: <html>", {}),
    ("http-429", status(429, **{"Retry-After": "0"}), r"answered HTTP 429.*\(after 3 attempts\)", {}),
    ("http-500", status(500), r"answered HTTP 500: status 500 \(after 3 attempts\)", {}),
    ("http-503", status(503), r"answered HTTP 503", {}),
    ("reset", reset, r"dropped the connection: .*reset.* \(after 3 attempts\)", {}),
    ("hang", hang, rf"timed out after {TIMEOUT:g}s", {}),
    ("trickle-body", trickle_body, rf"timed out after {TIMEOUT:g}s", {}),
    ("trickle-headers", trickle_headers, rf"timed out after {TIMEOUT:g}s", {}),
    ("truncated-body", truncated, r"dropped the connection: IncompleteRead", {}),
    ("garbage-status-line", garbage_status, r"malformed HTTP response", {}),
    ("endless-headers", endless_headers, r"malformed HTTP response: .*more than 100 headers", {}),
    ("invalid-utf8", raw_body(b'{"choices": [{"message": {"content": "\xff\xfe"}}]}'),
     r"malformed JSON: Invalid UTF-8", {}),
    ("lone-surrogate", raw_body(b'{"choices": [{"message": {"content": "\\ud800"}}]}'),
     r"malformed JSON", {}),
    ("not-json", raw_body(b"<html>busy</html>", "text/html"), r"malformed JSON: JSON is malformed", {}),
    ("empty-body", raw_body(b""), r"malformed JSON: Input data was truncated", {}),
    ("json-array", json_body([1, 2]), r"malformed completion: Expected `object`, got `array`", {}),
    ("choices-object", choices({"message": {"content": "x"}}),
     r"Expected `array`, got `object` - at `\$.choices`", {}),
    ("choices-empty", choices([]), r"Expected `array` of length >= 1 - at `\$.choices`", {}),
    ("choices-missing", json_body({"model": "m"}), r"missing required field `choices`", {}),
    ("choice-not-object", choices(["hi"]), r"Expected `object`, got `str` - at `\$.choices\[0\]`", {}),
    ("content-number", message(42), r"Expected `str \| null`, got `int`", {}),
    ("content-list", message([{"type": "text", "text": "x"}]), r"Expected `str \| null`, got `array`", {}),
    ("content-null", message(None), r"no message text", {}),
    ("fingerprint-number", json_body(completion_body(system_fingerprint=12)),
     r"got `int` - at `\$.system_fingerprint`", {}),
    ("fingerprint-object", json_body(completion_body(system_fingerprint={"a": 1})),
     r"got `object` - at `\$.system_fingerprint`", {}),
    ("fingerprint-long", json_body(completion_body(system_fingerprint="f" * 5000)),
     r"length <= 256 - at `\$.system_fingerprint`", {}),
    ("model-object", json_body(completion_body(model={"name": "x"})), r"at `\$.model`", {}),
    ("usage-1e30", usage_raw("1e30"), r"Expected `int`, got `float` - at `\$.usage.completion_tokens`", {}),
    ("usage-huge-int", usage_raw(str(10**30)), r"<= 1000000000 - at `\$.usage.completion_tokens`", {}),
    ("usage-negative", usage(-5), r">= 0 - at `\$.usage.completion_tokens`", {}),
    ("usage-neg-2-70", usage_raw(str(-(2**70))), r">= 0 - at `\$.usage.completion_tokens`", {}),
    ("usage-fraction", usage(3.5), r"Expected `int`, got `float`", {}),
    ("usage-string", usage("7"), r"Expected `int`, got `str`", {}),
    ("reply-5mb-declared", huge_reply(True), r"reply of \d+ bytes, more than the limit of 262144", {}),
    ("reply-5mb-streamed", huge_reply(False), r"larger than the limit of 262144 bytes", {}),
    ("gzip-bomb-512mib", bomb(512 * MIB), r"larger than the limit of 1048576 bytes",
     {"max_reply_bytes": MIB}),
    ("gzip-corrupt", lambda c, r, e: _send(
        c, http_response(200, b"\x1f\x8b\x08\x00garbage", headers={"Content-Encoding": "gzip"})),
     r"corrupt", {}),
    ("brotli", lambda c, r, e: _send(
        c, http_response(200, b"xx", headers={"Content-Encoding": "br"})),
     r"unsupported encoding 'br'", {}),
]  # fmt: skip


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    with Journal(tmp_path / "journal.db") as j:
        yield j


def spec(url: str, **extra: Any) -> dict[str, Any]:
    return {"name": "openai", "base_url": url, "model": "smollm2", "timeout": TIMEOUT, **extra}


def assert_failed_at(journal: Journal, run_id: str, step: int, url: str) -> ev.RunEnded:
    """The run is closed as failed: the steps before `step` are whole, the failed request is
    journaled with the error, every event decodes, the chain verifies."""
    events = journal.events(run_id)
    *before, call, end = events
    assert isinstance(end, ev.RunEnded) and end.status == "failed", end
    assert end.error is not None and url in end.error and "\n" not in end.error
    assert isinstance(call, ev.LlmCall) and call.step == step, call
    assert (call.finish_reason, call.response) == ("error", "")
    assert call.request[0]["role"] == "system"
    assert call.latency_ms <= (TIMEOUT + SLACK) * 1000
    assert [e.step for e in before if isinstance(e, ev.LlmCall)] == list(range(step))
    assert journal.status(run_id) == "failed"
    assert journal.verify(run_id).ok
    return end


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("fault", "pattern", "extra"), [f[1:] for f in FAULTS],
                         ids=[f[0] for f in FAULTS])  # fmt: skip
def test_server_fault_fails_the_step_within_the_deadline(
    journal: Journal, fault: Any, pattern: str, extra: dict[str, Any]
) -> None:
    """Two good steps, then the fault: step 2 fails with one line naming the server and the
    fault, within timeout + slack (retries included), and the run is closed as failed with the
    failed request journaled; the two good steps keep exactly what the server said."""
    getattr(fault, "prepare", lambda: None)()
    with FaultyLLMServer(fault, good=2) as server:
        policy = make_policy(spec(server.base_url, **extra))
        t0 = time.monotonic()
        result = record_heist(journal, policy, seed=11, rounds=1)
        elapsed = time.monotonic() - t0
    assert result.status == "failed", result
    assert result.error is not None
    assert result.error.startswith(f"LLM server {server.base_url!r} "), result.error
    assert re.search(pattern, result.error), result.error
    assert elapsed < TIMEOUT + SLACK, elapsed
    end = assert_failed_at(journal, result.run_id, 2, server.base_url)
    assert end.error == result.error
    sent = server.requests[2].json()
    (call,) = [
        e for e in journal.events(result.run_id) if isinstance(e, ev.LlmCall) and e.step == 2
    ]
    assert sent["messages"] == call.request and sent["seed"] == call.seed
    good = [e for e in journal.events(result.run_id) if isinstance(e, ev.LlmCall)][:2]
    assert [(c.response, c.system_fingerprint, c.completion_tokens) for c in good] == [
        (CANNED_TEXT, "fp_canned", 7)
    ] * 2


def test_gzip_bomb_is_inflated_only_up_to_the_bound() -> None:
    """A gzip body inflating to 512 MiB costs at most a few MiB of memory: inflation stops one
    byte past max_reply_bytes. (The bomb itself is checked to really inflate to 512 MiB.)"""
    body = gzip_bomb(512 * MIB)
    assert len(body) < MIB
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    inflated = sum(len(d.decompress(body[i : i + 4096], 0)) for i in range(0, len(body), 4096))
    assert d.eof and inflated >= 512 * MIB
    with FaultyLLMServer(bomb(512 * MIB)) as server:
        policy = make_policy(spec(server.base_url, max_reply_bytes=MIB, max_retries=0))
        view = AgentView("r", 0, 0, "a", "role", "sys", ("a",), (), ())
        tracemalloc.start()
        try:
            with pytest.raises(Exception, match=r"larger than the limit of 1048576 bytes"):
                policy.decide(view, [{"role": "user", "content": "hi"}], 1)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 8 * MIB, peak


def test_retries_stay_inside_the_total_deadline(journal: Journal) -> None:
    """A server that always answers 500 after 0.8 s gets only as many attempts as fit in the
    deadline; the call ends within timeout + slack however many retries are allowed."""

    def slow_500(conn: socket.socket, _: Request, release: threading.Event) -> None:
        if not release.wait(0.8):
            _send(conn, http_response(500, b'{"error": "slow"}'))

    with FaultyLLMServer(slow_500) as server:
        policy = make_policy(spec(server.base_url, max_retries=10))
        t0 = time.monotonic()
        result = record_heist(journal, policy, seed=3, rounds=1)
        elapsed = time.monotonic() - t0
    assert result.status == "failed" and elapsed < TIMEOUT + SLACK, (elapsed, result.error)
    assert 1 <= len(server.requests) <= 3, len(server.requests)


@pytest.mark.parametrize(
    "fault_id",
    ["http-500", "reset", "trickle-body", "invalid-utf8", "choices-object", "usage-1e30",
     "fingerprint-object", "reply-5mb-streamed", "gzip-bomb-512mib", "endless-headers"],
)  # fmt: skip
def test_cli_heist_on_a_faulty_server_prints_one_line_and_closes_the_run(
    tmp_path: Path, fault_id: str
) -> None:
    """`car heist --policy openai --timeout 2` against a faulty server exits 1 with exactly one
    stderr line "error: run ... failed ...", no traceback, within the deadline plus start-up,
    and `car runs` then shows the run as failed. The line is public: a server's error reply
    keeps its status there, not its words (`public_error`)."""
    _, fault, pattern, extra = next(f for f in FAULTS if f[0] == fault_id)
    pattern = pattern.replace(": status 500", r" \(its message is shown with --reveal\)")
    db = tmp_path / "cli.db"
    args = ["--max-reply-bytes", str(extra["max_reply_bytes"])] if extra else []
    getattr(fault, "prepare", lambda: None)()
    with FaultyLLMServer(fault, good=1) as server:
        t0 = time.monotonic()
        proc = subprocess.run(
            [str(CAR), "--journal", str(db), "heist", "--policy", "openai", "--base-url",
             server.base_url, "--model", "smollm2", "--rounds", "1", "--seed", "3",
             "--timeout", str(TIMEOUT), *args],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
        )  # fmt: skip
        elapsed = time.monotonic() - t0
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: run ") and "failed" in lines[0], lines[0]
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert elapsed < TIMEOUT + SLACK + 8, elapsed
    with Journal(db, create=False) as j:
        (run,) = j.runs()
        assert_failed_at(j, run.run_id, 1, server.base_url)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"temperature": "abc"}, r"temperature must be a number, got 'abc'"),
        ({"temperature": float("nan")}, r"temperature must be >= 0"),
        ({"max_retries": "x"}, r"max_retries must be an integer, got 'x'"),
        ({"max_retries": 99}, r"max_retries must be between 0 and 10"),
        ({"max_tokens": 1e9}, r"max_tokens must be between 1 and 1000000, got 1000000000"),
        ({"max_tokens": 2.5}, r"max_tokens must be an integer, got 2.5"),
        ({"timeout": float("inf")}, r"timeout must be > 0.001 and <= 86400, got inf"),
        ({"timeout": 0}, r"timeout must be > 0.001"),
        ({"max_reply_bytes": 10}, r"max_reply_bytes must be between 1024 and 67108864"),
        ({"base_url": "ftp://x/v1"}, r"bad LLM server URL 'ftp://x/v1'"),
        ({"base_url": "http://127.0.0.1:99999/v1"}, r"bad LLM server URL .*Port out of range"),
    ],
)
def test_bad_policy_options_are_config_errors(options: dict[str, Any], match: str) -> None:
    """Every bad openai option is one ConfigError quoting the value, never a traceback."""
    with pytest.raises(ConfigError, match=match):
        make_policy({"name": "openai", **options})


def test_default_reply_bound_is_256_kib() -> None:
    """The default reply bound is 256 KiB and is journaled only when changed."""
    assert DEFAULT_MAX_REPLY_BYTES == 256 * 1024
    assert "max_reply_bytes" not in make_policy({"name": "openai"}).spec()  # type: ignore[attr-defined]
    assert (
        make_policy({"name": "openai", "max_reply_bytes": 2048}).spec()["max_reply_bytes"] == 2048
    )  # type: ignore[attr-defined]
