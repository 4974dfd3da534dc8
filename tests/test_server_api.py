"""The detection server's HTTP API, tested with httpx against a real `car serve` subprocess."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import Server, car_serve, finished_heist, sse_events, start, wait_status

from engine import events as ev
from engine.journal import Journal


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    journal = tmp_path_factory.mktemp("serve") / "journal.db"
    with car_serve(journal, "--max-heists", "3", "--sim-step-delay", "0") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def finished(client: httpx.Client) -> str:
    """A completed heist (seed 7: the plan fails) recorded through the API."""
    return finished_heist(client)


def secret_of(server: Server, sid: str) -> ev.MoleAssigned:
    with Journal(server.journal) as j:
        for stored in j.read(sid):
            if isinstance(stored.event, ev.MoleAssigned):
                return stored.event
    raise AssertionError(f"run {sid} has no mole")


def test_health_and_default_bind(server: Server, client: httpx.Client) -> None:
    """The server answers on 127.0.0.1 only by default: it listens on the loopback address and
    on no other (read from the kernel's socket table)."""
    assert server.host == "127.0.0.1"
    assert client.get("/api/health").json()["ok"] is True
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, port = local.rsplit(":", 1)
            if state == "0A" and int(port, 16) == server.port:
                listening.add(addr)
    assert listening == {"0100007F"}, listening


def test_quick_start_records_every_agent_of_the_config(client: httpx.Client) -> None:
    """Quick start without a body records a heist with all six agents of the default crew, in
    the background (202 at once), to the journal."""
    r = client.post("/api/sessions", json={"step_delay": 0, "rounds": 1})
    assert r.status_code == 202
    data = r.json()
    assert data["agents"] == ["planner", "hacker", "safecracker", "intel", "driver", "lookout"]
    done = wait_status(client, data["session_id"], {"completed"})
    assert done["steps"] == 6 and done["policy"] == "sim"
    assert {m["agent"] for m in done["messages"]} == set(data["agents"])


def test_quick_start_with_a_crew_config(client: httpx.Client) -> None:
    """`config` takes a crew YAML: the heist plays with exactly that crew."""
    crew = (
        "agents:\n"
        "  - {name: boss, role: Planner, goal: Plan the job, tools: [calculator]}\n"
        "  - {name: eye, role: Lookout, goal: Watch the street, tools: [file_reader]}\n"
    )
    sid = start(client, config=crew, rounds=2, seed=3, step_delay=0)
    d = wait_status(client, sid, {"completed"})
    assert d["agents"] == ["boss", "eye"] and d["steps"] == 4


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"rounds": 0}, "rounds"),
        ({"rounds": "many"}, "rounds"),
        ({"policy": "gpt"}, "policy"),
        ({"seed": -1}, "seed"),
        ({"surprise": 1}, "surprise"),
        ({"step_delay": 99}, "step_delay"),
        ({"config": "agents: 3\n"}, "agents"),
        ({"policy": "sim", "base_url": "http://x"}, "openai only"),
    ],
)
def test_quick_start_bad_bodies_are_422(client: httpx.Client, body: dict, match: str) -> None:
    """A bad quick-start body is a 422 whose one-line error names the problem."""
    r = client.post("/api/sessions", json=body)
    assert r.status_code == 422, r.text
    assert match in r.json()["error"]


def test_malformed_json_is_422(client: httpx.Client) -> None:
    """A body that is not JSON at all is a 422 too, never a 500."""
    r = client.post(
        "/api/sessions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 422
    r = client.post("/api/ai-detect/analyze", json={"method": "rules"})
    assert r.status_code == 422 and "session_id" in r.json()["error"]


def test_sessions_newest_first_and_paged(client: httpx.Client, finished: str) -> None:
    """The list holds heists newest first with status and outcome; limit/offset page it."""
    newer = start(client, seed=11, step_delay=0, rounds=1)
    wait_status(client, newer, {"completed"})
    page = client.get("/api/sessions", params={"limit": 2}).json()
    assert page["sessions"][0]["session_id"] == newer
    stamps = [s["created_at"] for s in client.get("/api/sessions?limit=200").json()["sessions"]]
    assert stamps == sorted(stamps, reverse=True)
    second = client.get("/api/sessions", params={"limit": 1, "offset": 1}).json()
    assert second["sessions"][0]["session_id"] == page["sessions"][1]["session_id"]
    assert second["total"] == page["total"] >= 2
    row = next(
        s
        for s in client.get("/api/sessions?limit=200").json()["sessions"]
        if s["session_id"] == finished
    )
    assert row["status"] == "completed" and row["outcome"]["bad"] is True
    assert client.get("/api/sessions", params={"limit": 0}).status_code == 422


def test_detail_is_public_until_the_verdict(
    server: Server, client: httpx.Client, finished: str
) -> None:
    """Before the accusation neither the detail nor the event stream holds the mole's strategy,
    its secret instructions, the secret event or any recorded LLM request."""
    secret = secret_of(server, finished)
    detail = client.get(f"/api/sessions/{finished}")
    stream = client.get(f"/api/sessions/{finished}/events")
    for text in (detail.text, stream.text):
        assert secret.instructions not in text
        assert secret.strategy not in text
        for leak in ("mole_assigned", "llm_call", "SECRET", "system_prompt", '"request"'):
            assert leak not in text
    d = detail.json()
    assert d["verdict"] is None and d["messages"] and d["tool_usage"]
    stats = d["tool_stats"]
    assert sum(s["calls"] for s in stats.values()) == len(d["tool_usage"])


def test_the_seed_is_never_shown(server: Server, client: httpx.Client) -> None:
    """The mole is drawn from the root seed, so a heist started without one never shows it:
    not in the quick-start answer, the list, the detail or the stream."""
    r = client.post("/api/sessions", json={"step_delay": 0, "rounds": 1})
    sid = r.json()["session_id"]
    wait_status(client, sid, {"completed"})
    with Journal(server.journal) as j:
        started = next(j.read(sid, 0, 1)).event
    assert isinstance(started, ev.RunStarted)
    seed = str(started.root_seed)
    texts = [
        r.text,
        client.get("/api/sessions?limit=200").text,
        client.get(f"/api/sessions/{sid}").text,
        client.get(f"/api/sessions/{sid}/events").text,
    ]
    for text in texts:
        assert seed not in text and '"seed"' not in text


def test_unknown_session_is_404_naming_it(client: httpx.Client) -> None:
    """Every route with a session answers 404 with a JSON body that names the session."""
    sid = "no-such-heist"
    calls = [
        ("GET", f"/api/sessions/{sid}", None),
        ("GET", f"/api/sessions/{sid}/events", None),
        ("POST", f"/api/sessions/{sid}/pause", None),
        ("POST", f"/api/sessions/{sid}/resume", None),
        ("POST", f"/api/sessions/{sid}/stop", None),
        ("POST", f"/api/sessions/{sid}/accuse", {"suspect": "intel"}),
        ("GET", f"/api/sessions/{sid}/tree", None),
        ("POST", f"/api/sessions/{sid}/fork", {"at": 0, "do": "resample"}),
        ("POST", f"/api/sessions/{sid}/attribution", {}),
        ("GET", f"/api/sessions/{sid}/diff", None),
        ("POST", "/api/ai-detect/analyze", {"session_id": sid}),
        ("POST", "/api/ai-detect/suggest", {"session_id": sid}),
    ]
    for method, path, body in calls:
        r = client.request(method, path, json=body)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"] == f"unknown session {sid!r}", path
        assert r.json()["session_id"] == sid


def test_pause_resume_stop_take_effect_and_are_journaled(
    server: Server, client: httpx.Client
) -> None:
    """Pause stops the heist at its next step (no new step while paused), resume continues it,
    stop closes it; each is a journaled Control event; actions that do not apply are 409."""
    sid = start(client, seed=5, rounds=20, step_delay=0.05)
    time.sleep(0.3)
    assert client.post(f"/api/sessions/{sid}/pause").status_code == 202
    paused = wait_status(client, sid, {"paused"}, timeout=10)
    again = client.post(f"/api/sessions/{sid}/pause")
    assert again.status_code == 409 and "already paused" in again.json()["error"]
    time.sleep(1.0)
    assert client.get(f"/api/sessions/{sid}").json()["steps"] == paused["steps"]
    assert client.post(f"/api/sessions/{sid}/resume").status_code == 202
    wait_status(client, sid, {"recording"}, timeout=10)
    time.sleep(0.4)
    assert client.get(f"/api/sessions/{sid}").json()["steps"] > paused["steps"]
    not_paused = client.post(f"/api/sessions/{sid}/resume")
    assert not_paused.status_code == 409 and "not paused" in not_paused.json()["error"]
    assert client.post(f"/api/sessions/{sid}/stop").status_code == 202
    done = wait_status(client, sid, {"stopped"}, timeout=10)
    assert [c["action"] for c in done["controls"]] == ["pause", "resume", "stop"]
    assert done["steps"] < 20 * 6
    with Journal(server.journal) as j:
        kinds = [s.kind for s in j.read(sid)]
    assert kinds.count("control") == 3 and kinds[-1] == "run_ended"
    for action in ("pause", "resume", "stop"):
        r = client.post(f"/api/sessions/{sid}/{action}")
        assert r.status_code == 409, action
        assert r.json()["run_status"] == "stopped"


def test_control_of_a_run_recorded_elsewhere_is_409(client: httpx.Client, finished: str) -> None:
    """A finished run (or one another process records) cannot be paused from here: 409."""
    r = client.post(f"/api/sessions/{finished}/pause")
    assert r.status_code == 409 and "not recording in this server" in r.json()["error"]


def test_accuse_gives_the_verdict_then_the_reveal(server: Server, client: httpx.Client) -> None:
    """Accusing the real mole is SUCCESS and reveals mole and strategy; afterwards the detail
    shows the verdict; a second accusation is 409; accusing a live run is 409; an unknown
    suspect or a bad body is 422."""
    live = start(client, seed=21, rounds=30, step_delay=0.05)
    r = client.post(f"/api/sessions/{live}/accuse", json={"suspect": "intel"})
    assert r.status_code == 409 and "still" in r.json()["error"]
    client.post(f"/api/sessions/{live}/stop")
    wait_status(client, live, {"stopped"})
    secret = secret_of(server, live)
    assert (
        client.post(f"/api/sessions/{live}/accuse", json={"suspect": "nobody"}).status_code == 422
    )
    assert client.post(f"/api/sessions/{live}/accuse", json={"suspect": 5}).status_code == 422
    r = client.post(f"/api/sessions/{live}/accuse", json={"suspect": secret.agent})
    assert r.status_code == 200
    assert r.json() == {
        "session_id": live,
        "suspect": secret.agent,
        "verdict": "SUCCESS",
        "mole": secret.agent,
        "strategy": secret.strategy,
    }
    assert client.get(f"/api/sessions/{live}").json()["verdict"]["mole"] == secret.agent
    again = client.post(f"/api/sessions/{live}/accuse", json={})
    assert again.status_code == 409 and "already accused" in again.json()["error"]
    history, ended = sse_events(client, live)
    assert ended and history[-1]["kind"] == "verdict"


def test_accuse_nobody_is_busted(client: httpx.Client) -> None:
    """No suspect (no body at all) is BUSTED, and the mole is still revealed."""
    sid = start(client, seed=22, rounds=1, step_delay=0)
    wait_status(client, sid, {"completed"})
    r = client.post(f"/api/sessions/{sid}/accuse")
    assert r.status_code == 200 and r.json()["verdict"] == "BUSTED" and r.json()["mole"]


def test_finished_run_streams_its_history_and_ends(
    server: Server, client: httpx.Client, finished: str
) -> None:
    """The stream of a finished run is every public event of the journal in seq order, each
    with id = seq, then an `end` event."""
    events, ended = sse_events(client, finished)
    assert ended
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs))
    with Journal(server.journal) as j:
        public = [
            s.seq
            for s in j.read(finished)
            if s.kind
            in (
                "run_started",
                "chat_message",
                "tool_call",
                "tool_result",
                "control",
                "run_ended",
                "suspicion_declared",
            )
        ]
    assert seqs == public
    assert events[0]["kind"] == "run_started" and events[-1]["kind"] == "run_ended"


def test_last_event_id_resumes_without_gap_or_repeat(client: httpx.Client) -> None:
    """A client that reads part of a live stream and reconnects with Last-Event-ID gets exactly
    the rest: together the two reads are the whole stream, nothing twice."""
    sid = start(client, seed=31, rounds=3, step_delay=0.05)
    first, ended = sse_events(client, sid, limit=10)
    assert not ended and len(first) == 10
    rest, ended = sse_events(client, sid, last_event_id=first[-1]["seq"])
    assert ended
    full, _ = sse_events(client, sid)
    assert [e["seq"] for e in first + rest] == [e["seq"] for e in full]
    assert first + rest == full
    # the query parameter (what a reloaded page sends) does the same; the header wins over it
    tail, _ = sse_events(client, sid, after=first[4]["seq"])
    assert tail == full[5:]
    both, _ = sse_events(client, sid, last_event_id=first[-1]["seq"], after=0)
    assert both == rest
    r = client.get(f"/api/sessions/{sid}/events", headers={"Last-Event-ID": "x"})
    assert r.status_code == 422


def test_several_clients_see_the_same_live_stream(client: httpx.Client) -> None:
    """Five clients that connect while the heist records each receive the same events in the
    same order, the whole history from the start included."""
    sid = start(client, seed=41, rounds=3, step_delay=0.03)
    results: list[list[dict]] = [[] for _ in range(5)]

    def watch(i: int) -> None:
        with httpx.Client(base_url=str(client.base_url), timeout=60) as c:
            results[i], ended = sse_events(c, sid)
            assert ended

    threads = [threading.Thread(target=watch, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(60)
    full, _ = sse_events(client, sid)
    assert all(r == full for r in results)
    assert full[-1]["kind"] == "run_ended"


def test_tree_fork_and_diff(client: httpx.Client, finished: str) -> None:
    """Fork with each of the five interventions gives an outcome distribution with a Wilson
    interval; the branches appear in the tree; a branch's diff starts at its fork step."""
    detail = client.get(f"/api/sessions/{finished}").json()
    tool_step = detail["tool_usage"][0]["step"]
    forks = [
        {"at": 3, "do": "resample", "n": 4},
        {"at": 5, "do": "action", "value": "All good, [PLAN:entry_time=01:00]", "n": 2},
        {"at": tool_step, "do": "observation", "value": "nothing here", "n": 2},
        {"at": 6, "do": "context", "value": {"text": "Remember the vault window."}, "n": 2},
        {"at": 3, "do": "policy", "value": "sim-honest", "n": 3},
    ]
    for body in forks:
        r = client.post(f"/api/sessions/{finished}/fork", json=body)
        assert r.status_code == 200, r.text
        rep = r.json()
        assert rep["op"] == body["do"] and rep["at"] == body["at"]
        assert rep["scored"] == body["n"] and 0.0 <= rep["ci"][0] <= rep["bad_rate"] <= rep["ci"][1]
        assert rep["factual_bad"] is True
    tree = client.get(f"/api/sessions/{finished}/tree").json()
    assert tree["session_id"] == finished and tree["descendants"] == 13
    assert {c["op"] for c in tree["children"]} == {
        "resample",
        "action",
        "observation",
        "context",
        "policy",
    }
    action_branch = next(c for c in tree["children"] if c["op"] == "action")
    d = client.get(f"/api/sessions/{action_branch['session_id']}/diff").json()
    assert d["parent_id"] == finished and d["fork_step"] == 5
    assert d["first_diverging_step"] == 5
    first = d["steps"][0]
    assert first["branch_text"] == "All good, [PLAN:entry_time=01:00]"
    assert {"op": "insert", "text": "All good, [PLAN:entry_time=01:00]"} in first["diff"] or any(
        seg["op"] == "insert" for seg in first["diff"]
    )
    root = client.get(f"/api/sessions/{finished}/diff")
    assert root.status_code == 409 and "not a branch" in root.json()["error"]


@pytest.mark.parametrize(
    ("body", "status", "match"),
    [
        ({"at": 999, "do": "resample"}, 422, "out of range"),
        ({"at": 1, "do": "action"}, 422, "needs a `value`"),
        ({"at": 1, "do": "teleport"}, 422, "do"),
        ({"at": 1, "do": "policy", "value": "gpt"}, 422, "unknown policy"),
        ({"at": 1, "do": "resample", "n": 0}, 422, "n"),
        ({"at": -1, "do": "resample"}, 422, "at"),
    ],
)
def test_fork_bad_requests(
    client: httpx.Client, finished: str, body: dict, status: int, match: str
) -> None:
    """Forks the run cannot take are 422 with the engine's reason."""
    r = client.post(f"/api/sessions/{finished}/fork", json=body)
    assert r.status_code == status, r.text
    assert match in r.json()["error"]


def test_branch_actions_on_a_live_run_are_409(client: httpx.Client) -> None:
    """Fork and attribution need a run that has ended: 409 while it records."""
    sid = start(client, seed=51, rounds=30, step_delay=0.05)
    try:
        r = client.post(f"/api/sessions/{sid}/fork", json={"at": 0, "do": "resample"})
        assert r.status_code == 409 and "still" in r.json()["error"]
        r = client.post(f"/api/sessions/{sid}/attribution", json={})
        assert r.status_code == 409
    finally:
        client.post(f"/api/sessions/{sid}/stop")
        wait_status(client, sid, {"stopped"})


def test_attribution_table(client: httpx.Client, finished: str) -> None:
    """The attribution of a failed heist (every step asked for) ranks every step with an effect
    and an interval and names the causal locus; a run whose plan is not scored cannot be
    attributed."""
    body = {"k": 8, "seed": 1, "all_steps": True}
    r = client.post(f"/api/sessions/{finished}/attribution", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["method"] == "contrastive" and data["forward_runs"] > 0
    steps = sorted(row["step"] for row in data["ranked"])
    assert steps == list(range(24))
    for row in data["ranked"]:
        assert row["ci"][0] <= row["effect"] <= row["ci"][1]
    assert (
        client.post(f"/api/sessions/{finished}/attribution", json={"method": "magic"}).status_code
        == 422
    )
    # the bound `car attribute --half-width` has, refused by the body itself and in /docs
    half = client.post(f"/api/sessions/{finished}/attribution", json={"half_width": 0.5})
    assert half.status_code == 422 and "half_width" in half.text
    spec = client.get("/openapi.json").json()["components"]["schemas"]["AttributionRequest"]
    assert spec["properties"]["half_width"]["exclusiveMaximum"] == 0.5


def test_attribution_settles_as_the_cli_does(client: httpx.Client, finished: str) -> None:
    """`settle` is `car attribute --settle`: every scan reported, the forward runs of all;
    bounded as the CLI's (1..8) and refused for Shapley."""
    body = {"k": 8, "seed": 2, "settle": 2}
    r = client.post(f"/api/sessions/{finished}/attribution", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    scans = data["settle"]["scans"]
    assert data["settle"]["rounds"] == 2 and 1 <= len(scans) <= 2
    assert scans[0]["runs_per_step"] == 8 and scans[0]["half_width"] is None
    assert data["forward_runs"] == sum(s["forward_runs"] for s in scans)
    for bad in ({"settle": 9}, {"settle": 0}, {"settle": 2, "method": "shapley"}):
        refused = client.post(f"/api/sessions/{finished}/attribution", json=bad)
        assert refused.status_code == 422, (bad, refused.text)
    spec = client.get("/openapi.json").json()["components"]["schemas"]["AttributionRequest"]
    assert spec["properties"]["settle"]["maximum"] == 8


def test_too_many_heists_is_429(tmp_path: Path) -> None:
    """With --max-heists 1 a second heist while one records is refused with 429; once the
    first is stopped a new one may start."""
    with car_serve(tmp_path / "j.db", "--max-heists", "1") as s, s.client() as c:
        first = start(c, seed=1, rounds=40, step_delay=0.05)
        r = c.post("/api/sessions", json={"seed": 2})
        assert r.status_code == 429 and "limit is 1" in r.json()["error"]
        assert r.json()["recording"] == [first]
        c.post(f"/api/sessions/{first}/stop")
        wait_status(c, first, {"stopped"})
        deadline = time.monotonic() + 10
        while c.get("/api/health").json()["recording"] and time.monotonic() < deadline:
            time.sleep(0.05)
        second = start(c, seed=3, rounds=1, step_delay=0)
        wait_status(c, second, {"completed"})


def test_shutdown_closes_recording_heists(tmp_path: Path) -> None:
    """Stopping the server while a heist records (and one is paused) closes both runs as
    stopped in the journal: none is left `recording`."""
    journal = tmp_path / "j.db"
    with car_serve(journal) as s, s.client() as c:
        a = start(c, seed=1, rounds=40, step_delay=0.05)
        b = start(c, seed=2, rounds=40, step_delay=0.05)
        c.post(f"/api/sessions/{b}/pause")
        wait_status(c, b, {"paused"})
    with Journal(journal) as j:
        assert j.status(a) == "stopped" and j.status(b) == "stopped"


def test_openapi_page(client: httpx.Client) -> None:
    """The OpenAPI document lists every route, and /docs serves Swagger UI from the package
    (no CDN), its script included."""
    spec = client.get("/openapi.json").json()
    for path in (
        "/api/ai-detect/analyze",
        "/api/ai-detect/suggest",
        "/api/sessions",
        "/api/sessions/{session_id}",
        "/api/sessions/{session_id}/events",
        "/api/sessions/{session_id}/fork",
    ):
        assert path in spec["paths"], path
    page = client.get("/docs")
    assert page.status_code == 200 and "/docs-static/swagger-ui-bundle.js" in page.text
    assert "cdn" not in page.text.lower()
    js = client.get("/docs-static/swagger-ui-bundle.js")
    assert js.status_code == 200 and len(js.content) > 100_000


def test_dashboard_assets_are_served(client: httpx.Client) -> None:
    """The page and its script and style come from the installed package."""
    page = client.get("/")
    assert page.status_code == 200 and "Quick Start Heist" in page.text
    for asset in ("/static/app.js", "/static/app.css", "/static/favicon.svg"):
        assert client.get(asset).status_code == 200, asset
    assert "innerHTML" not in client.get("/static/app.js").text


def test_port_in_use_is_one_line_error(server: Server) -> None:
    """`car serve` on a port that is taken exits 1 with one `error:` line."""
    import subprocess

    from server_helpers import CAR

    r = subprocess.run(
        [*CAR, "--journal", str(server.journal), "serve", "--port", str(server.port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert r.stderr.startswith("error: cannot listen on 127.0.0.1:") and r.stderr.count("\n") == 1


def _json(r: httpx.Response) -> Any:
    return json.loads(r.text)


def test_analyze_and_suggest(client: httpx.Client, finished: str) -> None:
    """analyze returns the blog's format (scores and the four-signal breakdown for every agent,
    the weights); suggest returns only the suggestion and the confidence, the same ones;
    `method` may be given in the body."""
    agents = ["planner", "hacker", "safecracker", "intel", "driver", "lookout"]
    a = client.post("/api/ai-detect/analyze", json={"session_id": finished}).json()
    assert a["session_id"] == finished and a["suggested_mole"] in agents
    assert set(a["suspicion_scores"]) == set(agents)
    for agent in agents:
        row = a["score_breakdown"][agent]
        for signal in ("tool_usage", "timing", "message_anomaly", "information_quality"):
            assert 0.0 <= row[signal] <= 1.0
    assert set(a["analysis_weights"]) >= {
        "tool_usage_anomaly",
        "timing_inconsistency",
        "message_anomaly",
        "information_quality",
    }
    s = client.post("/api/ai-detect/suggest", json={"session_id": finished, "method": "rules"})
    assert s.status_code == 200
    assert s.json() == {
        "session_id": finished,
        "suggested_mole": a["suggested_mole"],
        "confidence": a["confidence"],
    }
    prefix = client.post("/api/ai-detect/suggest", json={"session_id": finished[:8]})
    assert prefix.json()["session_id"] == finished


def test_analyze_errors_and_live_runs(client: httpx.Client) -> None:
    """An unknown method is 422; on a heist that still records, the rules analyse the steps so
    far and say so, while the causal detector (it re-runs the crew) answers 409."""
    sid = start(client, seed=61, rounds=30, step_delay=0.05)
    try:
        r = client.post("/api/ai-detect/analyze", json={"session_id": sid, "method": "magic"})
        assert r.status_code == 422 and "method" in r.json()["error"]
        r = client.post("/api/ai-detect/analyze", json={"session_id": sid})
        assert r.status_code == 200, r.text
        assert any("still" in w for w in r.json()["warnings"])
        r = client.post("/api/ai-detect/analyze", json={"session_id": sid, "method": "causal"})
        assert r.status_code == 409 and "still recording" in r.json()["error"]
    finally:
        client.post(f"/api/sessions/{sid}/stop")
        wait_status(client, sid, {"stopped"})


def test_the_blogs_curl_examples_on_port_8008(tmp_path: Path) -> None:
    """`car serve` listens on 8008 by default, and the blog's two curl commands work as
    written there (with a real session id in place of game_001)."""
    import subprocess

    journal = tmp_path / "j.db"
    with car_serve(journal, default_port=True) as s, s.client() as c:
        assert s.port == 8008
        sid = start(c, seed=7, step_delay=0)
        wait_status(c, sid, {"completed"})
        for endpoint in ("analyze", "suggest"):
            r = subprocess.run(
                [
                    "curl", "-s", "-X", "POST", f"http://localhost:8008/api/ai-detect/{endpoint}",
                    "-H", "Content-Type: application/json",
                    "-d", json.dumps({"session_id": sid}),
                ],
                capture_output=True, text=True, timeout=60, check=True,
            )  # fmt: skip
            data = json.loads(r.stdout)
            assert data["session_id"] == sid and "confidence" in data
            assert ("score_breakdown" in data) == (endpoint == "analyze")
