"""The detection server against hostile and unlucky clients: bursts of quick starts, bodies that
JSON cannot echo, crews nested or encoded to break the loader, seqs past 64 bits, concurrent
forward runs, a model server that never answers, and routes that do not exist. Every claim is
checked against a real `car serve` subprocess (and, for the runner and the loader, the real
engine in this process)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from journal_helpers import unjournalable_crew
from server_helpers import CAR, Server, car_serve, finished_heist, start, wait_status
from servers import FaultyLLMServer, free_port

from engine import events as ev
from engine.errors import ConfigError, EngineError
from engine.heist.config import parse_agents_config
from engine.journal import Journal
from engine.policies.registry import make_policy
from engine.server.runner import HeistRunner
from engine.server.stream import NotifyingJournal

DEEP_YAML = "agents: " + "[" * 30000 + "]" * 30000
SURROGATE_CREW = (
    "agents:\n"
    '  - {name: boss, role: "\\ud800x", goal: Plan the job, tools: [calculator]}\n'
    "  - {name: eye, role: Lookout, goal: Watch the street, tools: [file_reader]}\n"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    journal = tmp_path_factory.mktemp("hostile") / "journal.db"
    with car_serve(journal, "--max-heists", "4", "--sim-step-delay", "0") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client(timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def finished(client: httpx.Client) -> str:
    """A completed, failed, unaccused heist (seed 7)."""
    return finished_heist(client)


def wait_idle(client: httpx.Client, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = client.get("/api/health").json()
        if not h["recording"] and not h["starting"]:
            return
        time.sleep(0.05)
    raise AssertionError("heists still recording")


def post_raw(client: httpx.Client, path: str, text: str) -> httpx.Response:
    """POST `text` as the body, byte for byte (a lone surrogate kept as its JSON escape)."""
    return client.post(
        path,
        content=text.encode("utf-8", "surrogatepass"),
        headers={"Content-Type": "application/json"},
    )


def children_of(pid: int) -> set[int]:
    """The child processes of `pid`, from the kernel (every thread's list; a thread that ended
    between the listing and the read has no children left to list)."""
    kids: set[int] = set()
    for f in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids |= {int(p) for p in f.read_text().split()}
        except FileNotFoundError:
            continue
    return kids


# ------------------------------------------------------------------ 1: no seed of a pending start


def test_a_burst_of_quick_starts_never_shows_a_seed(server: Server, client: httpx.Client) -> None:
    """30 quick starts at once against 4 slots: the 429s and /api/health (polled meanwhile)
    name no heist by anything drawn from its seed; none of the started heists' root seeds
    appears in any of them."""
    wait_idle(client)
    texts: list[str] = []
    done = threading.Event()

    def poll_health() -> None:
        with server.client() as c:
            while not done.is_set():
                texts.append(c.get("/api/health").text)

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as c:
            return await asyncio.gather(
                *[c.post("/api/sessions", json={"step_delay": 0}) for _ in range(30)]
            )

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        responses = asyncio.run(burst())
    finally:
        done.set()
        poller.join(30)
    started = [r.json()["session_id"] for r in responses if r.status_code == 202]
    refused = [r for r in responses if r.status_code == 429]
    assert started and refused and len(started) + len(refused) == 30
    texts += [r.text for r in refused]
    for r in refused:
        body = r.json()
        assert set(body["recording"]) <= set(started) and isinstance(body["starting"], int)
    wait_idle(client)
    with Journal(server.journal, readonly=True) as j:
        seeds = []
        for sid in started:
            first = next(j.read(sid, 0, 1)).event
            assert isinstance(first, ev.RunStarted)
            seeds.append(str(first.root_seed))
    for text in texts:
        assert "pending" not in text
        for seed in seeds:
            assert seed not in text


# ------------------------------------------------------------------ 2: a branch's accusation


def test_accusing_a_branch_is_409_and_reveals_nothing(server: Server, client: httpx.Client) -> None:
    """A branch plays the root's game with the root's mole: accusing it is a 409 that names the
    root and holds no verdict, mole or strategy; the root itself stays accusable."""
    root = start(client, seed=17, step_delay=0, rounds=1)
    wait_status(client, root, {"completed"})
    r = client.post(f"/api/sessions/{root}/fork", json={"at": 2, "do": "resample", "n": 1})
    assert r.status_code == 200, r.text
    branch = r.json()["branches"][0]["run_id"]
    with Journal(server.journal, readonly=True) as j:
        secret = next(s.event for s in j.read(root) if isinstance(s.event, ev.MoleAssigned))
    r = client.post(f"/api/sessions/{branch}/accuse", json={"suspect": secret.agent})
    assert r.status_code == 409, r.text
    body = r.json()
    assert f"accuse {root!r}" in body["error"]
    assert not {"mole", "strategy", "verdict"} & set(body)
    assert secret.strategy not in r.text and secret.instructions not in r.text
    assert client.get(f"/api/sessions/{root}").json()["verdict"] is None
    r = client.post(f"/api/sessions/{root}/accuse", json={"suspect": secret.agent})
    assert r.status_code == 200 and r.json()["verdict"] == "SUCCESS"


# ------------------------------------------------------------------ 3: bodies JSON cannot echo


@pytest.mark.parametrize(
    ("path", "body", "match"),
    [
        ("/api/sessions", '{"step_delay": NaN}', "step_delay"),
        ("/api/sessions", '{"step_delay": Infinity}', "step_delay"),
        ("/api/sessions", '{"seed": -Infinity}', "seed"),
        ("/api/sessions", '{"model": "\\ud800"}', "model"),
        ("/api/sessions", '{"\\ud800": 1}', "unicode"),
        ("{run}/attribution", '{"half_width": NaN}', "half_width"),
        ("{run}/fork", '{"at": NaN, "do": "resample"}', "at"),
        ("{run}/fork", '{"at": 1, "do": "action", "value": "\\ud800 hi"}', "value"),
        ("{run}/fork", '{"at": 1, "do": "context", "value": {"text": "\\udfff"}}', "value"),
        ("/api/ai-detect/analyze", '{"session_id": NaN}', "session_id"),
        ("/api/ai-detect/analyze", '{"session_id": "\\ud800"}', "session_id"),
        ("/api/ai-detect/suggest", '{"session_id": "x", "model": Infinity}', "model"),
        ("{run}/accuse", '{"suspect": NaN}', "suspect"),
        ("{run}/accuse", '{"suspect": "\\ud800"}', "suspect"),
    ],
)
def test_bad_bodies_json_cannot_echo_are_422(
    client: httpx.Client, finished: str, path: str, body: str, match: str
) -> None:
    """A bad body whose values JSON text cannot hold (NaN, Infinity, a lone surrogate) is a
    JSON 422 naming the field, never a plain-text 500; the run is left as it was."""
    r = post_raw(client, path.replace("{run}", f"/api/sessions/{finished}"), body)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/json"
    assert match in r.json()["error"]
    assert client.get(f"/api/sessions/{finished}").json()["verdict"] is None


# ------------------------------------------------------------------ 4, 5: crews that break loaders


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (DEEP_YAML, r"^crew\.yaml: invalid YAML: nested too deeply$"),
        ("agents: " + "{a: " * 5000 + "1" + "}" * 5000, "nested too deeply"),
        (SURROGATE_CREW, r"line 2: agent 'boss': field 'role' is not valid Unicode text"),
        (
            SURROGATE_CREW.replace('"\\ud800x"', "Planner").replace(
                "Watch the street", '"ok \\udc00"'
            ),
            r"agent 'eye': field 'goal' is not valid Unicode text .*'\\udc00'",
        ),
    ],
)
def test_crew_loader_refuses_deep_and_non_unicode_yaml(text: str, match: str) -> None:
    """YAML nested beyond the parser's recursion and text that is not valid Unicode (a lone
    surrogate from a YAML escape) are ConfigErrors naming the file (and the field), never a
    RecursionError or a crew the journal cannot hold."""
    with pytest.raises(ConfigError, match=match):
        parse_agents_config(text, "crew.yaml")


@pytest.mark.parametrize(
    ("config", "match"),
    [(DEEP_YAML, "config: invalid YAML: nested too deeply"), (SURROGATE_CREW, "field 'role'")],
)
def test_quick_start_with_a_hostile_crew_is_422_and_creates_no_run(
    server: Server, client: httpx.Client, config: str, match: str
) -> None:
    """The server's quick start answers such a crew with a 422 naming the problem, and no run
    is created (none is left `recording`)."""
    wait_idle(client)
    with Journal(server.journal, readonly=True) as j:
        before = len(j.runs())
    r = client.post("/api/sessions", json={"config": config})
    assert r.status_code == 422, r.text
    assert match in r.json()["error"]
    with Journal(server.journal, readonly=True) as j:
        assert len(j.runs()) == before
    assert client.get("/api/health").json()["recording"] == []


def test_car_heist_with_a_deep_crew_is_one_line(tmp_path: Path) -> None:
    """`car heist --config deep.yaml` exits 1 with one `error:` line, no traceback."""
    deep = tmp_path / "deep.yaml"
    deep.write_text(DEEP_YAML)
    r = subprocess.run(
        [*CAR, "--journal", str(tmp_path / "j.db"), "heist", "--config", str(deep)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("\n") == 1 and "nested too deeply" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_heist_that_cannot_open_its_run_leaves_nothing_recording(tmp_path: Path) -> None:
    """When the runner's heist cannot write its opening (here: a crew built without the
    loader, whose lone surrogate no journal event can hold), start() raises an EngineError,
    no run is left (the run and its opening are one transaction; it used to be created, then
    closed failed), and no slot stays taken."""
    bad = unjournalable_crew()
    with NotifyingJournal(tmp_path / "j.db") as j:
        runner = HeistRunner(j, max_heists=1)
        with pytest.raises(EngineError, match="surrogate"):
            runner.start(make_policy({"name": "sim"}), seed=3, rounds=1, config=bad)
        assert j.runs() == []
        assert runner.active() == [] and runner.starting() == 0
        # the slot is free again
        ok = runner.start(make_policy({"name": "sim"}), seed=3, rounds=1, config=None)
        runner.shutdown()
        assert j.status(ok) in ("completed", "stopped")


# ------------------------------------------------------------------ 6: seqs past 64 bits


@pytest.mark.parametrize(
    ("headers", "params"),
    [
        ({"Last-Event-ID": "99999999999999999999999999"}, {}),
        ({"Last-Event-ID": str(2**63)}, {}),
        ({"Last-Event-ID": "-2"}, {}),
        ({}, {"after": str(2**63)}),
        ({}, {"after": "-99999999999999999999999"}),
    ],
)
def test_event_ids_outside_64_bits_are_422(
    client: httpx.Client, finished: str, headers: dict, params: dict
) -> None:
    """A Last-Event-ID or `after` the journal's 64-bit seqs cannot hold is a JSON 422."""
    r = client.get(f"/api/sessions/{finished}/events", headers=headers, params=params)
    assert r.status_code == 422, r.text
    assert "error" in r.json()


def test_the_largest_event_id_ends_the_stream(client: httpx.Client, finished: str) -> None:
    """Resuming after the largest 64-bit seq sends no event and then the `end` event, at once
    (the stream's keep-alive pings would hold a broken stream open for good: a deadline)."""
    for headers, params in (({}, {"after": 2**63 - 1}), ({"Last-Event-ID": str(2**63 - 1)}, {})):
        lines: list[str] = []
        deadline = time.monotonic() + 20
        path = f"/api/sessions/{finished}/events"
        with client.stream("GET", path, headers=headers, params=params) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if line == "event: end" or time.monotonic() > deadline:
                    break
        assert "event: end" in lines, lines
        assert not any(line.startswith("id:") for line in lines)


# ------------------------------------------------------------------ 7: concurrent forward runs


def test_concurrent_forks_and_attributions_never_fork_processes(
    server: Server, client: httpx.Client, finished: str
) -> None:
    """Forks and attributions with concurrency 4, eight at once, all answer 200 (or a JSON
    409/429), never a 500 such as `database is locked`; the server never forks while its
    threads run: its only child processes, during the requests and after them, are the
    standing pool's workers it forked at start (one batch uses them, the others threads)."""
    standing = children_of(server.proc.pid)
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(children_of(server.proc.pid))
            time.sleep(0.01)

    def call(i: int) -> httpx.Response:
        with server.client(timeout=300) as c:
            if i % 4 == 3:
                body = {"seed": i, "k": 6, "concurrency": 4}
                return c.post(f"/api/sessions/{finished}/attribution", json=body)
            body = {"at": 5, "do": "resample", "n": 8, "seed": i, "concurrency": 4}
            return c.post(f"/api/sessions/{finished}/fork", json=body)

    watcher = threading.Thread(target=watch)
    watcher.start()
    results: list[httpx.Response | None] = [None] * 8
    try:
        workers = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, call(i))) for i in range(8)
        ]
        for t in workers:
            t.start()
        for t in workers:
            t.join(300)
    finally:
        done.set()
        watcher.join(10)
    for r in results:
        assert r is not None
        assert r.status_code in (200, 409, 429), r.text
        assert r.headers["content-type"] == "application/json"
    assert sum(r is not None and r.status_code == 200 for r in results) >= 6
    assert seen == standing and children_of(server.proc.pid) == standing


# ------------------------------------------------------------------ 8: shutdown and a slow model


def test_shutdown_cancels_a_heist_waiting_on_a_slow_model(tmp_path: Path) -> None:
    """SIGTERM while an `openai` heist waits on a model server that does not answer: the
    server aborts the call and closes the run as `stopped` within seconds (not `abandoned`)."""

    def hang(_conn: Any, _req: Any, release: threading.Event) -> None:
        release.wait(120)

    journal = tmp_path / "j.db"
    with FaultyLLMServer(hang) as llm, car_serve(journal) as s, s.client() as c:
        r = c.post("/api/sessions", json={"policy": "openai", "base_url": llm.base_url})
        assert r.status_code == 202, r.text
        sid = r.json()["session_id"]
        deadline = time.monotonic() + 30
        while not llm.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert llm.requests, "the heist never called the model"
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(30)
        assert time.monotonic() - t0 < 10
    with Journal(journal, readonly=True) as j:
        assert j.status(sid) == "stopped"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "term"])
def test_shutdown_stops_an_attribution_in_flight_and_closes_its_branches(
    tmp_path: Path, sig: int
) -> None:
    """Ctrl-C (or SIGTERM) while a long Shapley attribution runs: the client got a plain-text
    500, the server printed a CancelledError traceback and a branch stayed open, then read
    `abandoned`. Now the forward runs stop within a step, their branches are closed as
    stopped, and the client gets a JSON 503 before the server exits."""
    journal = tmp_path / "j.db"
    got: dict[str, httpx.Response] = {}
    with car_serve(journal, "--workers", "1") as s, s.client() as c:
        sid = finished_heist(c)

        def attribute() -> None:
            body = {"method": "shapley", "budget": 5000, "seed": 7}
            got["r"] = c.post(f"/api/sessions/{sid}/attribution", json=body, timeout=60)

        t = threading.Thread(target=attribute)
        t.start()
        deadline = time.monotonic() + 30
        while len(_children(journal, sid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        s.proc.send_signal(sig)
        t.join(60)
        s.proc.wait(30)
        err = s.proc.stderr.read() if s.proc.stderr else ""
    r = got["r"]
    assert r.status_code == 503 and "shutting down" in r.json()["error"], r.text
    assert "Traceback" not in err, err
    with Journal(journal, readonly=True) as j:
        statuses = {j.status(b) for b in _children(journal, sid)}
    # the branch in hand when the signal came is closed as stopped (none, if it came between
    # two): none is left open, to be found abandoned
    assert statuses <= {"completed", "stopped"}, statuses


def _children(journal: Path, run: str) -> list[str]:
    with Journal(journal, readonly=True) as j:
        return [b.run_id for b in j.children(run)]


# ------------------------------------------------------------------ 9: every error is JSON


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "match"),
    [
        ("GET", "/nope", None, 404, "not found: /nope"),
        ("GET", "/api/nope", None, 404, "not found"),
        ("GET", "/api/sessions/a%2Fb", None, 404, "not found"),
        ("GET", "/static/nope.js", None, 404, "not found"),
        ("PUT", "/api/sessions", None, 405, "PUT is not allowed"),
        ("DELETE", "{run}", None, 405, "DELETE is not allowed"),
        ("POST", "/api/health", None, 405, "POST is not allowed"),
        ("POST", "/api/sessions", "[" * 100_000 + "]" * 100_000, 422, "cannot be parsed"),
        ("POST", "/api/sessions", "{not json", 422, "bad request"),
        ("POST", "{run}/fork", '{"at": 1, "do": "action", "value": "\\ud800 hi"}', 422, "value"),
    ],
)
def test_every_error_is_a_json_error(
    client: httpx.Client,
    finished: str,
    method: str,
    path: str,
    body: str | None,
    status: int,
    match: str,
) -> None:
    """Unknown routes, wrong methods and unparseable bodies answer `{"error": "..."}` with the
    right status (a bad body is 422, as the README says), like every other error."""
    path = path.replace("{run}", f"/api/sessions/{finished}")
    content = None if body is None else body.encode("utf-8", "surrogatepass")
    r = client.request(method, path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    data = r.json()
    assert isinstance(data["error"], str) and match in data["error"]
    assert "detail" not in data or status == 422


def test_pages_still_work_beside_the_json_errors(client: httpx.Client) -> None:
    """The dashboard, its assets, /docs and the OpenAPI document are served as before."""
    assert "Quick Start Heist" in client.get("/").text
    assert client.get("/static/app.js").status_code == 200
    assert "swagger-ui-bundle.js" in client.get("/docs").text
    assert "/api/sessions" in client.get("/openapi.json").json()["paths"]
    assert client.put("/api/sessions").headers.get("allow")


# ------------------------------------------------------------------ 10: heists only


def test_the_session_list_holds_heists_only(
    server: Server, client: httpx.Client, finished: str
) -> None:
    """The detector's journaled LLM runs (an `llm` analysis with no model server reachable)
    are not heists: /api/sessions lists only runs of the heist scenario."""
    dead = f"http://127.0.0.1:{free_port()}/v1"
    r = client.post(
        "/api/ai-detect/analyze", json={"session_id": finished, "method": "llm", "base_url": dead}
    )
    assert r.status_code in (200, 409, 422), r.text
    with Journal(server.journal, readonly=True) as j:
        runs = j.runs()
    scenarios = {info.run_id: info.scenario for info in runs}
    assert "detection" in scenarios.values()
    page = client.get("/api/sessions", params={"limit": 200}).json()
    listed = [s["session_id"] for s in page["sessions"]]
    assert listed and all(scenarios[sid] == "heist" for sid in listed)
    heists = [i for i in runs if i.parent_run_id is None and i.scenario == "heist"]
    assert page["total"] == len(heists) == len(listed)
    assert all(s["agents"] != ["detector"] for s in page["sessions"])
