"""`car export`: runs as OTLP/JSON traces that the OpenTelemetry schema accepts, with the span
layout, links and attributes of docs/decisions.md (entry 17), and never the secret."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from otel_helpers import attrs_of, car, heist_with_branches, otlp_message, spans_of
from servers import free_port

from engine.events import LlmCall
from engine.heist.mole import Strategy, instructions
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal
from engine.otel.exporter import export_runs, span_id, trace_document, trace_id
from engine.public import public_view


@pytest.fixture(scope="module")
def heist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, list[str]]]:
    path = tmp_path_factory.mktemp("export") / "j.db"
    with Journal(path) as j:
        run, branches = heist_with_branches(j)
    yield path, run, branches


def test_every_export_parses_as_otlp(heist: tuple[Path, str, list[str]]) -> None:
    """Each run's trace, and the document with all branches, parse strictly into
    opentelemetry-proto's ExportTraceServiceRequest, span for span."""
    path, run, branches = heist
    with Journal(path) as j:
        for rid in [run, *branches]:
            doc = trace_document(j, [rid])
            message = otlp_message(doc)
            spans = message.resource_spans[0].scope_spans[0].spans
            assert len(spans) == len(spans_of(doc)) > 1
            assert {s.trace_id.hex() for s in spans} == {trace_id(rid)}
        everything = trace_document(j, export_runs(j, run, with_branches=True))
    message = otlp_message(everything)
    assert len({s.trace_id for s in message.resource_spans[0].scope_spans[0].spans}) == 4


def test_span_layout_and_attributes(heist: tuple[Path, str, list[str]]) -> None:
    """One invoke_agent span per step under the run's root, a chat span per LLM call and an
    execute_tool span per tool call under their step, with gen_ai.* and OpenInference kinds."""
    path, run, _ = heist
    with Journal(path) as j:
        doc = trace_document(j, [run])
        view = public_view(j, run)
    spans = spans_of(doc)
    by_id = {s["spanId"]: s for s in spans}
    roots = [s for s in spans if "parentSpanId" not in s]
    assert len(roots) == 1 and attrs_of(roots[0])["openinference.span.kind"] == "CHAIN"
    agents = [s for s in spans if s["name"].startswith("invoke_agent ")]
    chats = [s for s in spans if s["name"].startswith("chat ")]
    tools = [s for s in spans if s["name"].startswith("execute_tool ")]
    assert len(agents) == len(view.messages) == view.steps
    assert len(chats) == view.steps
    assert len(tools) == len(view.tool_usage) > 0
    assert len(spans) == 1 + len(agents) + len(chats) + len(tools)
    for s in agents:
        a = attrs_of(s)
        assert s["parentSpanId"] == roots[0]["spanId"]
        assert a["gen_ai.operation.name"] == "invoke_agent"
        assert a["openinference.span.kind"] == "AGENT"
        assert s["name"] == f"invoke_agent {a['gen_ai.agent.name']}"
    for s in chats:
        a = attrs_of(s)
        parent = attrs_of(by_id[s["parentSpanId"]])
        assert parent["gen_ai.operation.name"] == "invoke_agent"
        assert a["gen_ai.operation.name"] == "chat" and a["openinference.span.kind"] == "LLM"
        assert a["gen_ai.provider.name"] == "car.sim" == a["gen_ai.system"]
        assert a["gen_ai.request.model"] and a["gen_ai.response.finish_reasons"] == ["stop"]
        assert a["gen_ai.usage.output_tokens"] > 0
        out = json.loads(a["gen_ai.output.messages"])
        assert out[0]["parts"][0]["content"] == parent["output.value"] == a["output.value"]
        inputs = json.loads(a["gen_ai.input.messages"])
        assert len(inputs) >= a["car.step"]  # every earlier message of the crew
    for s in tools:
        a = attrs_of(s)
        assert attrs_of(by_id[s["parentSpanId"]])["car.step"] == a["car.step"]
        assert (
            a["gen_ai.operation.name"] == "execute_tool" and a["openinference.span.kind"] == "TOOL"
        )
        assert a["gen_ai.tool.name"] == a["tool.name"]
        failed = s.get("status", {}).get("code") == 2
        assert failed == (not a["car.tool.success"])
    starts = [int(s["startTimeUnixNano"]) for s in agents]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)


def test_input_messages_are_the_public_conversation(heist: tuple[Path, str, list[str]]) -> None:
    """A heist's chat span shows the conversation before the step and the agent's own earlier
    tool results, never a system prompt (the mole's holds its instructions)."""
    path, run, _ = heist
    with Journal(path) as j:
        doc = trace_document(j, [run])
        view = public_view(j, run)
    chat = next(
        s for s in spans_of(doc) if attrs_of(s).get("car.step") == 8 and "chat" in s["name"]
    )
    a = attrs_of(chat)
    inputs = json.loads(a["gen_ai.input.messages"])
    assert all(m["role"] in ("user", "tool") for m in inputs)
    said = [m["parts"][0]["content"] for m in inputs if m["role"] == "user"]
    assert said == [f"{m.agent}: {m.text}" for m in view.messages if m.step < 8]
    agent = a["gen_ai.agent.name"]
    own = [t for t in view.tool_usage if t.agent == agent and t.step < 8]
    assert len([m for m in inputs if m["role"] == "tool"]) == len(own)
    assert a["llm.input_messages.0.message.content"] == said[0]


def test_branches_link_to_their_parent(heist: tuple[Path, str, list[str]]) -> None:
    """A branch is its own trace holding only its own steps; its root links to the parent's
    root span and to the parent's span of the step it re-decided; both exist in the parent's
    export."""
    path, run, branches = heist
    with Journal(path) as j:
        parent_ids = {s["spanId"] for s in spans_of(trace_document(j, [run]))}
        for rid in branches:
            view = public_view(j, rid)
            spans = spans_of(trace_document(j, [rid]))
            root = next(s for s in spans if "parentSpanId" not in s)
            a = attrs_of(root)
            assert a["car.parent_run.id"] == run and a["car.fork.step"] == view.fork_step
            assert a["car.intervention.op"] in ("resample", "action")
            links = {attrs_of(link)["car.link"]: link for link in root["links"]}
            assert links["parent_run"]["spanId"] == span_id(run, "run")
            assert {link["traceId"] for link in root["links"]} == {trace_id(run)}
            assert links["forked_step"]["spanId"] in parent_ids
            steps = [attrs_of(s)["car.step"] for s in spans if s["name"].startswith("invoke_")]
            assert min(steps) == view.fork_step and max(steps) == view.steps - 1


def test_forced_action_has_no_llm_call(heist: tuple[Path, str, list[str]]) -> None:
    """do_action forces a step's message: its agent span is marked forced and has no chat span."""
    path, _, branches = heist
    with Journal(path) as j:
        forced = next(b for b in branches if public_view(j, b).fork_step == 7)
        spans = spans_of(trace_document(j, [forced]))
    step7 = [s for s in spans if attrs_of(s).get("car.step") == 7]
    names = sorted(s["name"].split()[0] for s in step7)
    assert names == ["execute_tool", "invoke_agent"]
    agent = next(s for s in step7 if s["name"].startswith("invoke_agent"))
    assert attrs_of(agent)["car.forced"] is True


def test_reexport_is_identical(heist: tuple[Path, str, list[str]], tmp_path: Path) -> None:
    """Ids and times derive from the journal, so two exports of a run are the same bytes."""
    path, run, _ = heist
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert car(path, "export", run, "--branches", "-o", str(a)).returncode == 0
    assert car(path, "export", run, "--branches", "-o", str(b)).returncode == 0
    assert a.read_bytes() == b.read_bytes()
    assert len(a.read_text().splitlines()) == 1  # one document, as Jaeger's UI reads it
    stdout = car(path, "export", run).stdout
    with Journal(path) as j:
        assert json.loads(stdout) == trace_document(j, [run])


def test_export_one_file_per_trace(heist: tuple[Path, str, list[str]], tmp_path: Path) -> None:
    """With --branches and a directory, each trace goes to its own file (Tempo's import)."""
    path, run, branches = heist
    res = car(path, "export", run, "--branches", "-o", str(tmp_path), "--json")
    assert res.returncode == 0, res.stderr
    files = json.loads(res.stdout)["files"]
    assert sorted(Path(f).name for f in files) == sorted(f"{r}.otlp.json" for r in [run, *branches])
    for f in files:
        doc = json.loads(Path(f).read_text())
        assert len({s["traceId"] for s in spans_of(doc)}) == 1
        otlp_message(doc)


@pytest.mark.parametrize("strategy", list(Strategy))
def test_exports_never_carry_the_secret(tmp_path: Path, strategy: Strategy) -> None:
    """No strategy name, no sentence of the mole's instructions, no seed, no prompt size: not in
    the run's export nor in its branches', whoever the mole is."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run, _ = heist_with_branches(j, seed=11, mole="intel", strategy=strategy.value)
        text = json.dumps(trace_document(j, export_runs(j, run, with_branches=True)))
        recorded = [e for e in j.events(run) if isinstance(e, LlmCall) and e.agent == "intel"]
    secret = instructions(strategy)
    # the journal does hold it: the mole's recorded request carries its instructions
    assert secret in recorded[0].request[0]["content"]
    for name in Strategy:
        assert name.value not in text
    for sentence in secret.split(". "):
        assert sentence.strip(" .") not in text
    assert "SECRET" not in text and "mole" not in text.lower()
    for key in ("gen_ai.request.seed", "gen_ai.usage.input_tokens", "llm.token_count.prompt"):
        assert key not in text
    assert '"seed"' not in text


def test_attribute_keys_do_not_depend_on_the_mole(tmp_path: Path) -> None:
    """A heist with a mole and one without export the same attribute keys on every kind of
    span: presence betrays nothing."""
    keys: list[dict[str, set[str]]] = []
    with Journal(tmp_path / "j.db") as j:
        for opts in ({"mole": "hacker"}, {"no_mole": True}):
            run = record_heist(j, SimPolicy(), seed=3, rounds=1, **opts).run_id  # type: ignore[arg-type]
            per_kind: dict[str, set[str]] = {}
            for s in spans_of(trace_document(j, [run])):
                kind = s["name"].split()[0]
                per_kind.setdefault(kind, set()).update(attrs_of(s))
            keys.append(per_kind)
    assert keys[0] == keys[1]


class _Receiver(http.server.BaseHTTPRequestHandler):
    """A real OTLP/HTTP JSON endpoint: checks the media type and the schema of what it gets."""

    received: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path != "/v1/traces" or self.headers["Content-Type"] != "application/json":
            self.send_response(415)
            self.end_headers()
            return
        doc = json.loads(body)
        otlp_message(doc)
        type(self).received.append(doc)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


def test_post_over_otlp_http_json(heist: tuple[Path, str, list[str]]) -> None:
    """--otlp-endpoint posts the document as OTLP/HTTP JSON to <base>/v1/traces."""
    path, run, branches = heist
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        res = car(path, "export", run, "--branches", "--otlp-endpoint", url, "--json")
    finally:
        server.shutdown()
        server.server_close()
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["endpoint"] == url + "/v1/traces"
    (doc,) = _Receiver.received
    assert len({s["traceId"] for s in spans_of(doc)}) == 1 + len(branches)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "zipkin"], "unknown export format 'zipkin'"),
        (["--otlp-endpoint", "ftp://example"], "must be an http(s) URL"),
        (["--otlp-endpoint", "http://127.0.0.1:{port}"], "cannot reach OTLP receiver"),
        (["--otlp-endpoint", "http://127.0.0.1:1", "--otlp-protocol", "grpc"], "unknown OTLP"),
        (["-o", "/nonexistent/dir/x.json"], "cannot write"),
    ],
)
def test_export_errors_are_one_line(
    heist: tuple[Path, str, list[str]], args: list[str], message: str
) -> None:
    """Bad formats, endpoints and paths give one `error:` line and exit 1."""
    path, run, _ = heist
    args = [a.replace("{port}", str(free_port())) for a in args]
    res = car(path, "export", run, *args)
    assert res.returncode == 1
    assert res.stderr.startswith("error: ") and message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_export_unknown_run(heist: tuple[Path, str, list[str]]) -> None:
    """An unknown run id is one line, not a traceback."""
    res = car(heist[0], "export", "nosuchrun")
    assert res.returncode == 1 and res.stderr.startswith("error: unknown run id 'nosuchrun'")
