"""The detection server against an attacker and a demanding user: a burst of long requests that
would take every thread of the server, bodies of many megabytes, values quoted back at length,
bodies that are not sent as JSON, web pages of other sites (cross-site requests and DNS
rebinding), ambiguous id prefixes, plain-text errors from static files, and a crowd accusing
the same game at once. Every claim is checked against a real `car serve` subprocess on a real
SQLite journal."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_helpers import Server, car_serve, finished_heist, start, wait_status
from servers import FaultyLLMServer

from engine import events as ev
from engine.journal import Journal

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    journal = tmp_path_factory.mktemp("attacks") / "journal.db"
    with car_serve(journal, "--sim-step-delay", "0", "--workers", "0") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client(timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def finished(client: httpx.Client) -> str:
    """A completed, unaccused heist (seed 7)."""
    return finished_heist(client)


def verdicts(server: Server, sid: str) -> list[ev.SuspicionDeclared]:
    with Journal(server.journal, readonly=True) as j:
        return [s.event for s in j.read(sid) if isinstance(s.event, ev.SuspicionDeclared)]


def raw_request(server: Server, head: str, body: bytes = b"", chunks: int = 0) -> bytes:
    """Send a hand-made HTTP/1.1 request (optionally chunked: `chunks` chunks of `body`) and
    read the answer until the server closes (the request says `Connection: close`); the
    server may answer before the body has been sent."""
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(head.encode())
        try:
            if chunks:
                for _ in range(chunks):
                    sock.sendall(f"{len(body):x}\r\n".encode() + body + b"\r\n")
                sock.sendall(b"0\r\n\r\n")
            elif body:
                sock.sendall(body)
        except OSError:
            pass  # the server refused and closed before reading the rest: its answer is below
        out = b""
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            out += data
        return out


def split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    header, _, body = raw.partition(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), headers, body


# ------------------------------------------------------------------ 1: long requests


def test_long_requests_leave_every_other_request_answered(
    server: Server, client: httpx.Client, finished: str
) -> None:
    """45 `llm` analyses at once, each waiting on a model server that does not answer, once
    held every thread that answers requests: /api/health, the session list, the dashboard
    page and a session's detail then hung until the model answered. Now long requests run a
    few at a time in threads of their own, the others wait for a turn (or get a JSON 429 with
    Retry-After), and everything else is answered meanwhile; once the model server goes away
    every analysis answers with JSON."""

    def hang(_conn: Any, _req: Any, release: threading.Event) -> None:
        release.wait(120)

    results: list[httpx.Response | BaseException] = []

    async def burst(base_url: str) -> None:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=200, limits=limits) as c:
            body = {"session_id": finished, "method": "llm", "base_url": base_url}
            results.extend(
                await asyncio.gather(
                    *[c.post("/api/ai-detect/analyze", json=body) for _ in range(45)],
                    return_exceptions=True,
                )
            )

    with FaultyLLMServer(hang) as llm:
        sender = threading.Thread(target=asyncio.run, args=(burst(llm.base_url),))
        sender.start()
        deadline = time.monotonic() + 60
        while len(llm.requests) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(llm.requests) >= 4, "the analyses never asked the model"
        time.sleep(1.0)  # the rest of the burst has arrived and waits (or holds threads)
        with server.client(timeout=10) as quick:
            for path in ("/api/health", "/api/sessions", "/", f"/api/sessions/{finished}"):
                r = quick.get(path)
                assert r.status_code == 200, (path, r.text)
            r = quick.post("/api/ai-detect/suggest", json={"session_id": finished})
            assert r.status_code == 200, r.text
    sender.join(300)
    assert not sender.is_alive()
    assert len(results) == 45
    for r in results:
        assert isinstance(r, httpx.Response), r
        assert r.status_code in (200, 409, 422, 429), r.text
        assert "error" in r.json() or r.status_code == 200
        if r.status_code == 429:
            assert r.headers["retry-after"].isdigit() and "try again" in r.json()["error"]


# ------------------------------------------------------------------ 2, 3: big bodies


def test_a_body_over_a_mebibyte_is_413_unread(server: Server, client: httpx.Client) -> None:
    """A 50 MB quick-start body was read whole and answered with a 422 that quoted all 50 MB
    back; a body of unstated length (chunked) likewise. Now both are a short JSON 413 naming
    the limit, and no heist is started."""
    before = client.get("/api/sessions").json()["total"]
    big = b'{"config": "' + b"a" * (50 * MIB) + b'"}'
    r = client.post("/api/sessions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    assert len(r.content) < 1000 and "at most 1048576 bytes" in r.json()["error"]
    head = (
        f"POST /api/sessions HTTP/1.1\r\nHost: {server.host}:{server.port}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    status, headers, body = split_response(raw_request(server, head, b"a" * 65536, chunks=40))
    assert status == 413, body[:300]
    assert headers["content-type"] == "application/json" and len(body) < 1000
    assert "too large" in json.loads(body)["error"]
    assert client.get("/api/sessions").json()["total"] == before


def test_a_bad_value_is_quoted_back_short(client: httpx.Client, finished: str) -> None:
    """A crew of 300,000 characters (over the 100,000 allowed) is a 422 naming the field, with
    the value quoted back in at most a few hundred characters, not in full."""
    r = client.post("/api/sessions", json={"config": "x" * 300_000})
    assert r.status_code == 422
    assert len(r.content) < 2000, len(r.content)
    data = r.json()
    assert "config" in data["error"] and "100000" in data["error"]
    assert data["detail"][0]["input"].endswith("(300002 characters)")
    r = client.post(f"/api/sessions/{finished}/fork", json={"at": "9" * 50_000, "do": "resample"})
    assert r.status_code == 422 and len(r.content) < 2000


# ------------------------------------------------------------------ 4: not sent as JSON


@pytest.mark.parametrize(
    ("headers", "content", "got"),
    [
        ({"Content-Type": "text/plain"}, b'{"seed": 1, "rounds": 1}', "'text/plain'"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, b"seed=1", "urlencoded"),
        ({}, b'{"seed": 1, "rounds": 1}', "no Content-Type"),
    ],
)
def test_a_body_not_sent_as_json_says_so(
    server: Server, client: httpx.Client, headers: dict, content: bytes, got: str
) -> None:
    """A JSON body sent as text/plain (what `fetch` sends for a string body), a form or a body
    with no Content-Type is a 422 that says the body must be sent as application/json and
    what it came as, not "Input should be a valid dictionary" with the bytes quoted back; no
    heist is started."""
    before = client.get("/api/sessions").json()["total"]
    r = client.post("/api/sessions", content=content, headers=headers)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert "Content-Type: application/json" in error and got in error, error
    assert "dictionary" not in r.text
    assert client.get("/api/sessions").json()["total"] == before


# ------------------------------------------------------------------ 5, 6: other sites' pages


def test_a_cross_site_page_cannot_act(server: Server, client: httpx.Client, finished: str) -> None:
    """A page of another site may send a bodyless POST to 127.0.0.1 without the browser
    asking first: it accused a game (a BUSTED verdict, journaled for good), stopped heists
    and started them. Now a POST naming another origin (or `Sec-Fetch-Site: cross-site`) is
    a JSON 403 and nothing is journaled; the dashboard's own POSTs (Origin = its own) and
    clients that send no Origin (curl, scripts) work as before."""
    own = f"http://{server.host}:{server.port}"
    for headers in (
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Origin": f"http://{server.host}:{server.port + 1}"},
        {"Sec-Fetch-Site": "cross-site"},
    ):
        r = client.post(f"/api/sessions/{finished}/accuse", headers=headers)
        assert r.status_code == 403, (headers, r.text)
        assert "cross-site request refused" in r.json()["error"]
        r = client.post("/api/sessions", headers=headers)
        assert r.status_code == 403, (headers, r.text)
    assert verdicts(server, finished) == []
    r = client.post(
        f"/api/sessions/{finished}/fork",
        json={"at": 2, "do": "resample", "n": 1},
        headers={"Origin": own, "Sec-Fetch-Site": "same-origin"},
    )
    assert r.status_code == 200, r.text
    sid = start(client, seed=3, rounds=1, step_delay=0)
    wait_status(client, sid, {"completed"})
    r = client.post(f"/api/sessions/{sid}/accuse", json={"suspect": None})
    assert r.status_code == 200 and r.json()["verdict"] == "BUSTED"


def test_a_rebound_host_name_is_refused(server: Server, finished: str) -> None:
    """A site that points its own DNS name at 127.0.0.1 (DNS rebinding) is same-origin with
    itself, so its pages could read and drive the server; bound to a loopback address, the
    server now answers only requests addressed to a loopback name: any other Host is a JSON
    403, for pages and the API alike."""
    for host in (f"evil.example:{server.port}", "127.0.0.1.nip.io", "localhost.evil.example"):
        for path in ("/", "/api/health", f"/api/sessions/{finished}"):
            r = httpx.get(f"{server.url}{path}", headers={"Host": host}, timeout=30)
            assert r.status_code == 403, (host, path, r.text)
            assert r.headers["content-type"] == "application/json"
            assert "host" in r.json()["error"]
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "localhost"):
        r = httpx.get(f"{server.url}/api/health", headers={"Host": host}, timeout=30)
        assert r.status_code == 200, (host, r.text)


def test_exposed_on_purpose_any_host_name_is_answered(tmp_path: Any) -> None:
    """With `--host 0.0.0.0` (the user exposes the server) requests may use any name."""
    with car_serve(tmp_path / "j.db", "--host", "0.0.0.0", "--workers", "0") as s:
        url = f"http://127.0.0.1:{s.port}/api/health"
        r = httpx.get(url, headers={"Host": f"myhost.lan:{s.port}"}, timeout=30)
        assert r.status_code == 200, r.text


def test_a_name_allowed_on_purpose_is_answered(tmp_path: Any) -> None:
    """`--allow-host NAME` (a proxy that forwards its own name) adds that name, and only it."""
    with car_serve(tmp_path / "j.db", "--allow-host", "car.example", "--workers", "0") as s:
        url = f"{s.url}/api/health"
        r = httpx.get(url, headers={"Host": f"CAR.example:{s.port}"}, timeout=30)
        assert r.status_code == 200, r.text
        r = httpx.get(url, headers={"Host": f"evil.example:{s.port}"}, timeout=30)
        assert r.status_code == 403 and "--allow-host" in r.json()["error"]


# ------------------------------------------------------------------ 7: ambiguous prefixes


def test_an_ambiguous_prefix_is_named_as_such(client: httpx.Client, finished: str) -> None:
    """A prefix that several sessions share was answered "unknown session", which sends the
    user looking for a typo; it is now a 404 that says the prefix is ambiguous and names
    matches. (Eighteen runs share at least one of the sixteen first hex digits.)"""
    r = client.post(f"/api/sessions/{finished}/fork", json={"at": 1, "do": "resample", "n": 17})
    assert r.status_code == 200, r.text
    ids = [finished, *(b["run_id"] for b in r.json()["branches"])]
    first = Counter(i[0] for i in ids).most_common(1)[0][0]
    for path in (f"/api/sessions/{first}", f"/api/sessions/{first}/tree"):
        r = client.get(path)
        assert r.status_code == 404
        error = r.json()["error"]
        assert f"prefix {first!r} is ambiguous" in error and "unknown" not in error, error
    r = client.post("/api/ai-detect/analyze", json={"session_id": first})
    assert r.status_code == 404 and "ambiguous" in r.json()["error"]


# ------------------------------------------------------------------ 8: values as the API names them


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"at": 1, "do": "action"}, "do 'action' needs a `value` (the step's new message)"),
        ({"at": 1, "do": "observation", "value": "  "}, "do 'observation' needs a `value`"),
        ({"at": 1, "do": "policy"}, "needs a `value` (sim, sim-honest or openai)"),
        ({"at": 1, "do": "action", "value": {"x": 1}}, "is text, not an object"),
        ({"at": 1, "do": "policy", "value": {"name": "sim"}}, "is text, not an object"),
    ],
)
def test_a_fork_without_its_value_names_the_field(
    client: httpx.Client, finished: str, body: dict, match: str
) -> None:
    """A fork missing its value was refused in the CLI's words ("needs --value or
    --value-file": flags an API client has not got), and an object where text belongs was
    forked as its JSON text; both are now a 422 naming the body's `value`, and no branch is
    made."""
    before = client.get(f"/api/sessions/{finished}/tree").json()["descendants"]
    r = client.post(f"/api/sessions/{finished}/fork", json=body)
    assert r.status_code == 422, r.text
    assert match in r.json()["error"] and "--value" not in r.json()["error"]
    assert client.get(f"/api/sessions/{finished}/tree").json()["descendants"] == before


def test_the_suspect_is_journaled_as_judged(server: Server, client: httpx.Client) -> None:
    """The verdict reads " intel " as intel and a blank name as nobody, but the answer and the
    journal kept the raw text (" intel ", ""); both now hold the name judged (None for
    nobody)."""
    for raw, named in ((" {agent}\t", "{agent}"), ("   ", None)):
        sid = start(client, seed=13, rounds=1, step_delay=0)
        agent = wait_status(client, sid, {"completed"})["agents"][1]
        suspect = raw.format(agent=agent)
        want = None if named is None else named.format(agent=agent)
        r = client.post(f"/api/sessions/{sid}/accuse", json={"suspect": suspect})
        assert r.status_code == 200, r.text
        assert r.json()["suspect"] == want
        assert [v.suspect for v in verdicts(server, sid)] == [want]
        assert client.get(f"/api/sessions/{sid}").json()["verdict"]["suspect"] == want


# ------------------------------------------------------------------ 8: static files


@pytest.mark.parametrize(
    ("range_", "status"),
    [("bytes=abc", 400), ("bytes=5-1", 400), ("items=0-1", 400), ("bytes=99999999-", 416)],
)
def test_a_bad_range_on_a_static_file_is_a_json_error(
    client: httpx.Client, range_: str, status: int
) -> None:
    """A malformed or unsatisfiable Range header on a dashboard asset was answered in plain
    text (or with an empty body); like every error it is now `{"error": "..."}` with its
    status (and, for 416, its Content-Range)."""
    r = client.get("/static/app.js", headers={"Range": range_})
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]
    if status == 416:
        assert r.headers["content-range"].startswith("bytes */")
    ok = client.get("/static/app.js", headers={"Range": "bytes=0-9"})
    assert ok.status_code == 206 and len(ok.content) == 10


# ------------------------------------------------------------------ 9: a crowd accusing


def test_a_crowd_accusing_one_game_gets_one_verdict(server: Server, client: httpx.Client) -> None:
    """Twenty accusations of one game at once, naming different agents: exactly one verdict
    is journaled and answered 200; every other is a JSON 409 saying the game was already
    accused (whether it lost before reading or at the journal's append), never a 500."""
    sid = start(client, seed=11, rounds=1, step_delay=0)
    agents = wait_status(client, sid, {"completed"})["agents"]

    async def crowd() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as c:
            return await asyncio.gather(
                *[
                    c.post(f"/api/sessions/{sid}/accuse", json={"suspect": agents[i % 6]})
                    for i in range(20)
                ]
            )

    responses = asyncio.run(crowd())
    assert Counter(r.status_code for r in responses) == {200: 1, 409: 19}
    for r in responses:
        if r.status_code == 409:
            assert "already accused" in r.json()["error"]
    assert len(verdicts(server, sid)) == 1
