"""An export of a heist with branches, sent to a real OTLP receiver (Arize Phoenix, from PyPI,
in its own virtualenv made by scripts/test) and read back through Phoenix's REST API: the same
spans, attributes and parent links."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from otel_helpers import ROOT, attrs_of, car, heist_with_branches, spans_of
from servers import ServerError, free_port

from engine.journal import Journal
from engine.otel.exporter import export_runs, trace_document

PHOENIX = ROOT / ".venv-phoenix" / "bin" / "phoenix"
# Phoenix re-derives these from what it receives: the span kind becomes its own column, and
# the JSON of tool.parameters is opened into tool.parameters.<name>. Both are checked below.
DERIVED = {"openinference.span.kind", "tool.parameters"}


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


@contextlib.contextmanager
def phoenix_server(startup_timeout: float = 400) -> Iterator[str]:
    """Start `phoenix serve` on free ports of 127.0.0.1 with a temp working dir; yield its URL."""
    if not PHOENIX.exists():
        raise ServerError(f"{PHOENIX} is missing; scripts/test installs Phoenix into .venv-phoenix")
    tmp = Path(tempfile.mkdtemp(prefix="car-phoenix-"))
    port = free_port()
    env = {
        **os.environ,
        "PHOENIX_WORKING_DIR": str(tmp),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(free_port()),
        "PHOENIX_TELEMETRY_ENABLED": "false",
    }
    log = tmp / "phoenix.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(PHOENIX), "serve"], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise ServerError(f"phoenix exited with {proc.returncode} during startup\n{tail}")
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(f"{base}/healthz", timeout=2) as resp,
            ):
                if resp.status == 200:
                    break
            if time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:]
                raise ServerError(f"phoenix did not answer within {startup_timeout:.0f}s\n{tail}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _phoenix_spans(base: str, expected: int, timeout: float = 120) -> list[dict[str, Any]]:
    """Every span of the default project, once Phoenix has stored `expected` of them."""
    deadline = time.monotonic() + timeout
    while True:
        spans: list[dict[str, Any]] = []
        cursor = None
        while True:
            query = "limit=1000" + (f"&cursor={cursor}" if cursor else "")
            page = _get(f"{base}/v1/projects/default/spans?{query}")
            spans.extend(page["data"])
            cursor = page.get("next_cursor")
            if not cursor:
                break
        if len(spans) >= expected or time.monotonic() > deadline:
            return spans
        time.sleep(0.5)


def test_phoenix_reads_back_the_export(tmp_path: Path) -> None:
    """Phoenix stores every span of the run and its branches with the same trace, span and
    parent ids, names, kinds and attributes; the JSON encoding is refused with a clear line."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run, branches = heist_with_branches(j, seed=8)
        sent = spans_of(trace_document(j, export_runs(j, run, with_branches=True)))
    with phoenix_server() as base:
        res = car(path, "export", run, "--branches", "--otlp-endpoint", base)
        assert res.returncode == 1 and "415" in res.stderr and "http/protobuf" in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
        res = car(
            path, "export", run, "--branches", "--otlp-endpoint", base,
            "--otlp-protocol", "http/protobuf",
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        stored = _phoenix_spans(base, len(sent))
    assert len({s["traceId"] for s in sent}) == 1 + len(branches)
    by_id = {s["context"]["span_id"]: s for s in stored}
    assert len(stored) == len(sent) == len(by_id)
    for span in sent:
        got = by_id[span["spanId"]]
        assert got["context"]["trace_id"] == span["traceId"]
        assert got["parent_id"] == span.get("parentSpanId")
        assert got["name"] == span["name"]
        attrs = attrs_of(span)
        assert got["span_kind"] == attrs["openinference.span.kind"]
        if "tool.parameters" in attrs:
            assert got["attributes"]["tool.parameters.param"] == attrs["input.value"]
        for key, value in attrs.items():
            if key not in DERIVED:
                assert got["attributes"].get(key) == value, (span["name"], key)
        failed = span.get("status", {}).get("code") == 2
        assert (got["status_code"] == "ERROR") == failed
        start = int(span["startTimeUnixNano"]) // 1000
        assert got["start_time"][:26].replace("T", " ") == _iso_us(start)


def _iso_us(us: int) -> str:
    import datetime as dt

    t = dt.datetime.fromtimestamp(us // 1_000_000, dt.UTC).replace(microsecond=us % 1_000_000)
    return t.strftime("%Y-%m-%d %H:%M:%S.%f")


pytestmark = pytest.mark.timeout(900)
