"""Names read from a journal are data: an agent's name from an imported trace carrying
terminal control sequences or rich markup is shown escaped in every line of `car show` and
`car state`, as the transcript lines already were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from journal_helpers import car

HOSTILE = "a\x1b]0;PWNED\x07\x1b[2J\x1b[31m[blink]x"


def _trace(agent: str, said: str = "hi", trace: str = "ab") -> dict[str, object]:
    """A minimal OTLP/JSON trace: two chat calls of one agent named `agent`, saying `said`."""

    def kv(key: str, value: str) -> dict[str, object]:
        return {"key": key, "value": {"stringValue": value}}

    reply = json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": said}]}])
    spans = [
        {"traceId": trace * 16, "spanId": f"{i:016x}", "name": "chat m",
         "startTimeUnixNano": str(1000 * i), "endTimeUnixNano": str(1000 * i + 500),
         "attributes": [kv("gen_ai.operation.name", "chat"), kv("gen_ai.agent.name", agent),
                        kv("gen_ai.output.messages", reply)]}
        for i in (1, 2)
    ]  # fmt: skip
    return {"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": spans}]}]}


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    base = tmp_path_factory.mktemp("hostile-names")
    trace = base / "t.json"
    trace.write_text(json.dumps(_trace(HOSTILE)))
    journal = base / "j.db"
    res = car(journal, "import", str(trace), "--json")
    assert res.returncode == 0, res.stderr
    (run,) = json.loads(res.stdout)
    return journal, str(run["run_id"])


@pytest.mark.parametrize(
    "argv",
    [["show", "RUN"], ["state", "RUN", "--at", "1"], ["state", "RUN", "--at", "1", "--reveal"]],
    ids=["show", "state", "state --reveal"],
)
def test_hostile_agent_name_is_escaped(imported: tuple[Path, str], argv: list[str]) -> None:
    """No escape or bell character reaches the terminal, and the markup in the name is
    printed as text (it used to retitle and clear the terminal from the header lines)."""
    journal, run = imported
    res = car(journal, *[run if a == "RUN" else a for a in argv])
    assert res.returncode == 0, res.stderr
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout
    assert "[blink]x" in res.stdout


def test_diff_shows_hostile_words_and_names_escaped(tmp_path: Path) -> None:
    """`car diff` of two imported runs whose replies and agent carry escape sequences prints
    them escaped, in the word diff as in the step lines."""
    journal = tmp_path / "j.db"
    runs = []
    for said, trace in (("calm \x1b[2J words", "ab"), ("loud \x1b]0;PWNED\x07 words", "cd")):
        path = tmp_path / f"{trace}.json"
        path.write_text(json.dumps(_trace(HOSTILE, said, trace)))
        res = car(journal, "import", str(path), "--json")
        assert res.returncode == 0, res.stderr
        runs.append(json.loads(res.stdout)[0]["run_id"])
    res = car(journal, "diff", *runs)
    assert res.returncode == 0, res.stderr
    assert "PWNED" in res.stdout and "[blink]x" in res.stdout
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout
