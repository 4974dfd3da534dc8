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


def test_an_error_line_shows_terminal_control_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    """`fail` is the one door of every `error:` line: ESC, CSI (C1) and a bidi override in the
    message (an error may quote a file, a model's reply, a name) come out escaped, one line."""
    from engine.commands.common import fail

    with pytest.raises(SystemExit) as exit_:
        fail("cannot read 'a\x1b[2Jb'\nnext \x9b31m \u202etxt.exe")
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert not any(c in err for c in "\x1b\x9b\u202e")
    assert "\\x1b[2J" in err and "\\x9b" in err and "\\u202e" in err


def test_json_output_never_carries_terminal_control(capsys: pytest.CaptureFixture[str]) -> None:
    """`--json` on a pipe: C1 controls, DEL, line separators and bidi overrides inside strings
    are \\u escapes (C0 ones JSON escapes itself), other non-ASCII text is itself, and the
    parsed value is unchanged."""
    from engine.commands.common import emit_json

    data = {"name": "x\x9b31my\x7f\u2028\u202e\x1b ü €", "n": 1}
    emit_json(data)
    text = capsys.readouterr().out
    assert not any(c in text for c in "\x1b\x7f\x9b\u2028\u202e")
    assert "ü €" in text
    assert json.loads(text) == data
