"""The commands that read a journal, as a demanding user and an attacker use them: hostile names
and words from an imported trace, long repetitive messages, an older journal, a stopped branch,
a run against itself or its grandchild, s_k at the edges. Real journals, real `car` processes."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from journal_helpers import car

from engine import events as ev
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.interventions import close_stopped, fork_many, parse_intervention
from engine.journal import Journal
from engine.state import step_seq

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _trace(turns: list[tuple[str, str]], trace: str) -> dict[str, object]:
    """An OTLP/JSON trace: one chat call per (agent, reply), in order."""

    def kv(key: str, value: str) -> dict[str, object]:
        return {"key": key, "value": {"stringValue": value}}

    spans = []
    for i, (agent, said) in enumerate(turns, 1):
        reply = json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": said}]}])
        spans.append(
            {"traceId": trace * 16, "spanId": f"{i:016x}", "name": "chat m",
             "startTimeUnixNano": str(1000 * i), "endTimeUnixNano": str(1000 * i + 500),
             "attributes": [kv("gen_ai.operation.name", "chat"), kv("gen_ai.agent.name", agent),
                            kv("gen_ai.output.messages", reply)]}
        )  # fmt: skip
    return {"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": spans}]}]}


def _import(journal: Path, turns: list[tuple[str, str]], trace: str) -> str:
    path = journal.parent / f"{trace}.json"
    path.write_text(json.dumps(_trace(turns, trace)))
    res = car(journal, "import", str(path), "--json")
    assert res.returncode == 0, res.stderr
    return str(json.loads(res.stdout)[0]["run_id"])


# ----------------------------------------------------------------- car diff


@pytest.mark.parametrize(
    ("name_a", "name_b"),
    [("x[/]", "y"), ("a\x1b]0;PWNED\x07[bold]", "b\x1b[2J"), ("[blink]z", "w\u202ek")],
    ids=["closing-tag", "escapes", "markup-bidi"],
)
def test_diff_reason_names_hostile_agents_as_text(tmp_path: Path, name_a: str, name_b: str) -> None:
    """Two runs whose first steps were taken by differently named agents: the reason line
    ("agent (A vs B)") quotes both names. A `[/]` in one was read as rich markup (a
    MarkupError traceback, nothing after the header); escape sequences reached the terminal."""
    journal = tmp_path / "j.db"
    a = _import(journal, [(name_a, "hi"), ("same", "yo")], "ab")
    b = _import(journal, [(name_b, "hi"), ("same", "yo")], "cd")
    res = car(journal, "diff", a, b)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    for bad in ("\x1b", "\x07", "\u202e"):
        assert bad not in res.stdout
    reason = next(line for line in res.stdout.splitlines() if "first diverging step" in line)
    assert "agent (" in reason and name_a.split("\x1b")[0] in reason
    assert "[1] same: same" in res.stdout


def test_word_diff_of_long_repetitive_messages_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two 15,000-word messages from three distinct words: difflib compares up to n x m tokens
    (86 s in `car diff`, a hang for a megabyte). The diff never hands difflib more than a
    million cells, and it still spells both messages exactly."""
    import difflib
    import random

    from engine import diff

    sizes: list[int] = []
    real = difflib.SequenceMatcher

    def bounded(
        isjunk: object, a: list[str], b: list[str], **kw: object
    ) -> difflib.SequenceMatcher[str]:
        sizes.append(len(a) * len(b))
        assert len(a) * len(b) <= 1_000_000, f"a word diff of {len(a)} x {len(b)} tokens"
        return real(None, a, b, autojunk=False)

    monkeypatch.setattr(diff.difflib, "SequenceMatcher", bounded)
    rng = random.Random(1)
    a = " ".join(rng.choice("xyz") for _ in range(15_000))
    b = " ".join(rng.choice("xyz") for _ in range(15_000))
    ops = diff.word_diff(a, b)
    assert "".join(t for op, t in ops if op != "insert") == a
    assert "".join(t for op, t in ops if op != "delete") == b
    # a long common head and tail around a small change: still a word-exact diff
    head, tail = "w " * 20_000, " v" * 20_000
    ops = diff.word_diff(head + "go at 01:00 now" + tail, head + "go at 02:30 now" + tail)
    assert ("delete", "01:00 ") in ops and ("insert", "02:30 ") in ops
    assert [op for op, _ in ops] == ["equal", "delete", "insert", "equal"]
    assert max(sizes) <= 1_000_000


def test_diff_of_a_run_with_itself_and_with_its_grandchild(tmp_path: Path) -> None:
    """A run against itself is "the same run" (it said "related: branches of the same run");
    a branch of a branch against the root says that it descends from it."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = record_heist(j, SimPolicy(), seed=7, rounds=2).run_id
        child = fork_many(j, run, parse_intervention("resample", 3, None), 1, seed=2)
        first = next(b.run_id for b in child.branches if b.run_id)
        grand = fork_many(j, first, parse_intervention("resample", 6, None), 1, seed=3)
        second = next(b.run_id for b in grand.branches if b.run_id)
    same = json.loads(car(path, "diff", run, run, "--json").stdout)
    assert same["relation"] == "the same run" and same["first_divergence"] is None
    down = json.loads(car(path, "diff", run, second, "--json").stdout)
    assert down["relation"].startswith("b descends from a")
    up = json.loads(car(path, "diff", second, run, "--json").stdout)
    assert up["relation"].startswith("a descends from b")


# ----------------------------------------------------------------- read-only readers


def _revision(path: Path) -> str:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return str(db.execute("SELECT version_num FROM alembic_version").fetchone()[0])
    finally:
        db.close()


@pytest.mark.parametrize(
    "argv", [["diff", "RUN", "RUN"], ["export", "RUN"]], ids=["diff", "export"]
)
def test_reading_commands_leave_an_older_journal_as_it_is(tmp_path: Path, argv: list[str]) -> None:
    """`car diff` and `car export` only read, like `car show`: they open the journal read-only
    and never migrate it (they upgraded a schema-3 journal to the newest revision, which an
    older `car` sharing the file can no longer open)."""
    for f in FIXTURES.glob("journal_v3.db*"):
        shutil.copy(f, tmp_path / f.name.replace("journal_v3", "j"))
    path = tmp_path / "j.db"
    before = _revision(path)
    runs = json.loads(car(path, "runs", "--json").stdout)
    run = runs[0]["run_id"]
    res = car(path, *[run if a == "RUN" else a for a in argv])
    assert res.returncode == 0, res.stderr
    assert _revision(path) == before == "0003_texts"


# ----------------------------------------------------------------- car export


def test_export_never_prints_raw_terminal_control(tmp_path: Path) -> None:
    """A reply with a bidi override, a C1 CSI and a line separator: `car export` (stdout and
    -o FILE) writes them as \\u escapes, as every other JSON output does, and the document
    still reads back to the very same words."""
    journal = tmp_path / "j.db"
    said = "left \u202eevil\u202c right \x9b31m red\u2028next"
    run = _import(journal, [("p", said), ("q", "ok")], "ef")
    res = car(journal, "export", run)
    assert res.returncode == 0, res.stderr
    target = tmp_path / "t.json"
    assert car(journal, "export", run, "-o", str(target)).returncode == 0
    for text in (res.stdout, target.read_text(encoding="utf-8")):
        for bad in ("\u202e", "\u202c", "\x9b", "\u2028"):
            assert bad not in text
        assert said in _strings(json.loads(text))


def _strings(value: object) -> str:
    """Every string inside a JSON value (and inside JSON strings within it), joined."""
    if isinstance(value, dict):
        return " ".join(_strings(v) for v in value.values())
    if isinstance(value, list):
        return " ".join(_strings(v) for v in value)
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except ValueError:
            return value
        return value + " " + (_strings(inner) if isinstance(inner, (dict, list)) else "")
    return ""


# ----------------------------------------------------------------- car show's branch tree


def test_a_stopped_branch_is_not_shown_as_ok(tmp_path: Path) -> None:
    """A branch stopped mid-run (Ctrl-C: control stop and RunEnded(stopped), no outcome) was
    labelled `ok` in `car show`'s tree and had verdict "ok" in --json; it says `stopped`."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = record_heist(j, SimPolicy(), seed=7, rounds=2).run_id
        fork_seq = step_seq(j, run, 5)
        child = j.fork(run, fork_seq, label="stopped by hand")
        j.append(child, [ev.Intervention(step=5, op="resample", at=5)], fork_seq)
        assert close_stopped(j, child)
        assert j.status(child) == "stopped"
    shown = car(path, "show", run)
    assert shown.returncode == 0, shown.stderr
    line = next(x for x in shown.stdout.splitlines() if child in x)
    assert line.rstrip().endswith("@step 5 resample stopped"), line
    (node,) = json.loads(car(path, "show", run, "--json").stdout)["branches"]["children"]
    assert node["verdict"] is None and node["ended"] == "stopped"


# ----------------------------------------------------------------- car state --at


def test_state_out_of_range_names_the_states_there_are(tmp_path: Path) -> None:
    """`car state --at K` takes 0..steps (steps: after the last step); the error said
    "has steps 0..23" while 24 is accepted."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = record_heist(j, SimPolicy(), seed=7, rounds=2).run_id
        n = j.steps(run)
    assert car(path, "state", run, "--at", str(n)).returncode == 0
    for k in (str(n + 1), "-1", str(2**70)):
        res = car(path, "state", run, "--at", k)
        assert res.returncode == 1 and res.stdout == ""
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
        assert f"has states 0..{n} " in res.stderr, res.stderr


def test_the_dashboards_word_diff_is_bounded_as_car_diffs() -> None:
    """The server's branch diff had its own unbounded word diff: two long repetitive messages
    (15,000 words each) took minutes of difflib. It is `car diff`'s now, in the API's shape."""
    from engine.server.views import word_diff as api_word_diff

    a = "go now " * 7_500 + "at 01:00"
    b = "now go " * 7_500 + "at 02:30"
    segs = api_word_diff(a, b)
    assert [s["op"] for s in segs] == ["delete", "insert"]
    assert segs[0]["text"] == " ".join(a.split()) and segs[1]["text"] == " ".join(b.split())
    small = api_word_diff("go at 01:00 now", "go at 02:30 now")
    assert small == [
        {"op": "equal", "text": "go at"},
        {"op": "delete", "text": "01:00"},
        {"op": "insert", "text": "02:30"},
        {"op": "equal", "text": "now"},
    ]
