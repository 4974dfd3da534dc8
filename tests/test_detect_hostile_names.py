"""`car detect` on a run whose agents have names that look like rich markup (an imported
trace names its agents as it likes): the suggested mole is printed as the text it is. A name
`[/]` at the top was a MarkupError traceback; `[bold]b` was printed as "b"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from journal_helpers import car

NAMES = ("[/]", "[bold]b", "[red]c[/red]")


def _kv(key: str, value: str) -> dict[str, Any]:
    return {"key": key, "value": {"stringValue": value}}


def _trace() -> str:
    spans = []
    for i, agent in enumerate(NAMES * 2):
        out = [
            {
                "role": "assistant",
                "parts": [{"type": "text", "content": f"note {i} [PLAN:route=A{i}]"}],
            }
        ]
        spans.append(
            {
                "traceId": "ab" * 16,
                "spanId": f"{i + 1:016x}",
                "name": "chat",
                "startTimeUnixNano": str(1000 * (i + 1)),
                "endTimeUnixNano": str(1000 * (i + 1) + 500),
                "attributes": [
                    _kv("gen_ai.operation.name", "chat"),
                    _kv("gen_ai.agent.name", agent),
                    _kv("gen_ai.output.messages", json.dumps(out)),
                ],
            }
        )
    return json.dumps({"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": spans}]}]})


@pytest.fixture
def imported(tmp_path: Path) -> tuple[Path, str]:
    journal, trace = tmp_path / "j.db", tmp_path / "t.json"
    trace.write_text(_trace())
    res = car(journal, "import", str(trace), "--json")
    assert res.returncode == 0, res.stderr
    (run,) = json.loads(res.stdout)
    return journal, str(run["run_id"])


def test_the_suggested_mole_is_printed_as_text(imported: tuple[Path, str]) -> None:
    journal, run = imported
    as_json = car(journal, "detect", run, "--method", "rules", "--json")
    assert as_json.returncode == 0, as_json.stderr
    top = json.loads(as_json.stdout)["suggested_mole"]
    assert top in NAMES
    res = car(journal, "detect", run, "--method", "rules")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    first = res.stdout.splitlines()[0]
    assert f"suggested mole {top} (confidence" in first, first
