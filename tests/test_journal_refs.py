"""Event schema v4 (written by `write_version = 4`; v5 adds positional payloads on top,
tests/test_journal_positional.py): a string seen before in a run's history is a
back-reference to the event that holds it inline, an LLM request is a delta of the agent's
previous request; the hash chain covers the resolved bytes, so a changed string is found at
every event rebuilt from it. v2 and v3 journals are covered by tests/test_journal_open.py and
tests/test_journal_texts.py."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import msgspec
import pytest
from journal_helpers import KEY_OF, stored_rows

from engine import events as ev
from engine.heist.session import record_heist
from engine.interventions import DoResample, parent_info, run_branch
from engine.journal import Journal
from engine.policies.registry import make_policy
from engine.verify import verify_journal

FIXTURES = Path(__file__).parent / "fixtures"


def _call(step: int, request: list[dict[str, str]], response: str) -> ev.LlmCall:
    return ev.LlmCall(
        step=step, agent="a", request=request, seed=1, model="m", response=response,
        finish_reason="stop",
    )  # fmt: skip


SYSTEM = "You are a, the planner of a small crew; keep it short."  # 54 characters
SAID = "b: the guard leaves the vault at 03:10 sharp."  # 45 characters


def test_v4_encoding_known_answer(tmp_path: Path) -> None:
    """The stored bytes of a small run, exactly: the second request is the delta
    [base seq, copy of messages 0..2, one new message spliced from a string held by event 1],
    the chat message a back-reference to the response that holds it."""
    path = tmp_path / "j.db"
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "go"}]
    with Journal(path) as j:
        j.write_version = 4  # the v4 writer, kept for this pin (v5: test_journal_positional)
        run = j.create_run("t", run_id="r1")
        j.append(run, [_call(0, first, SAID), ev.ChatMessage(step=0, agent="b", text=SAID)], 0)
        second = [*first, {"role": "user", "content": "b said: " + SAID}]
        j.append(run, [_call(1, second, "ok")], 2)
        assert [s.payload for s in j.read(run)] == [
            ev.encode(e) for e in j.events(run)
        ]  # resolved bytes are the canonical ones
        assert j.events(run)[2] == _call(1, second, "ok")
        assert verify_journal(j).ok
    stored = stored_rows(path, run)
    assert [v for _s, v, _p in stored] == [4, 4, 4]
    ref = msgspec.msgpack.Ext
    assert msgspec.msgpack.decode(stored[1][2]) == {
        "kind": "chat_message", "agent": "b", "text": ref(ev.STR_EXT, b"\x91\x92\x00\x01"),
        "step": 0,
    }  # fmt: skip
    delta = msgspec.msgpack.decode(stored[2][2])["request"]
    assert delta == [
        ref(ev.REQ_EXT, b"\x00"),
        [0, 2],
        ["user", ref(ev.STR_EXT, msgspec.msgpack.encode(["b said: ", [0, 1]]))],
    ]
    # pinned: a change of the encoding is a new schema version, not a silent edit
    digest = hashlib.blake2b(b"".join(p for _s, _v, p in stored), digest_size=16).hexdigest()
    assert digest == KNOWN_V4_DIGEST


KNOWN_V4_DIGEST = "fd989b134a7434726624ff21a34bc668"


@pytest.fixture
def heist(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "j.db"
    with Journal(path) as j:
        j.write_version = 5  # the v5 layer itself (v6 packs it: test_journal_packed)
        result = record_heist(j, make_policy({"name": "sim"}), seed=7, rounds=2)
    return path, result.run_id


def test_heist_reads_back_canonical_and_smaller(heist: tuple[Path, str]) -> None:
    """A recorded heist reads back byte for byte as the canonical encoding of each event, and
    its stored payloads are less than half the full ones (at 12 steps the six system prompts,
    stored once each, are most of it; bench/bench_compact.py measures longer runs)."""
    path, run = heist
    with Journal(path, readonly=True) as j:
        events = list(j.read(run))
        assert all(s.payload == ev.encode(s.event) for s in events)
        assert verify_journal(j).ok
    full = sum(len(s.payload) for s in events)
    stored = sum(len(p) for _s, _v, p in stored_rows(path, run))
    print(f"full payloads {full} B, stored {stored} B")
    assert stored < full / 2


def test_branch_request_is_a_delta_of_the_parents(heist: tuple[Path, str]) -> None:
    """A resampled branch's first request is stored as a delta of a request of its parent's
    history (a fresh writer looks it up), and the branch reads back canonical."""
    path, run = heist
    with Journal(path) as j:
        j.write_version = 5  # the v5 layer itself (v6 packs it: test_journal_packed)
        fork = j.step_start(run, 6)
        branch = run_branch(j, parent_info(j, run), DoResample(k=6), 1).run_id
    with Journal(path, readonly=True) as j:
        assert all(s.payload == ev.encode(s.event) for s in j.read(branch))
        kinds = {s.seq: s.kind for s in j.read(branch)}
    calls = [(s, p) for s, _v, p in stored_rows(path, branch) if kinds[s] == "llm_call"]
    head = ev.from_positional(msgspec.msgpack.decode(calls[0][1]))["request"][0]
    assert head.code == ev.REQ_EXT
    bases = msgspec.msgpack.decode(head.data)
    assert fork is not None and max(bases if type(bases) is list else [bases]) < fork


def _users(path: Path, run: str, holder: int, idx: int) -> set[int]:
    """Events whose stored payload refers to string `idx` of event `holder` directly."""
    out = set()
    for seq, _v, p in stored_rows(path, run):
        found: list[Any] = []

        def hook(code: int, data: memoryview, found: list[Any] = found) -> Any:
            if code == ev.STR_EXT:
                found.extend(x for x in msgspec.msgpack.decode(bytes(data)) if type(x) is list)
            return None

        msgspec.msgpack.Decoder(ext_hook=hook).decode(p)
        if [holder, idx] in found:
            out.add(seq)
    return out


def test_tampered_shared_string_names_every_event_built_from_it(
    heist: tuple[Path, str],
) -> None:
    """One byte of a string that later events refer to, changed in the event holding it
    (triggers dropped): verify names that event and every event that refers to it, each at
    its run and seq; no event is named that does not contain the string."""
    path, run = heist
    stored = stored_rows(path, run)
    best: tuple[int, int, str, set[int]] | None = None
    for seq, _v, p in stored:
        inline = ev._event_strings(ev._marked_decoder.decode(p))
        for i, s in enumerate(inline):
            users = _users(path, run, seq, i)
            if best is None or len(users) > len(best[3]):
                best = (seq, i, s, users)
    assert best is not None
    holder, _i, text, users = best
    assert len(users) >= 3
    with Journal(path, readonly=True) as j:
        containing = {s.seq for s in j.read(run) if text.encode() in s.payload}
    (payload,) = [p for s, _v, p in stored if s == holder]
    at = payload.index(text.encode())
    flipped = payload[:at] + bytes([payload[at] ^ 0x01]) + payload[at + 1 :]
    db = sqlite3.connect(path, isolation_level=None)
    for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        db.execute(f"DROP TRIGGER {name}")
    db.execute(
        f"UPDATE events SET payload = ? WHERE run_key = {KEY_OF} AND seq = ?",
        (flipped, run, holder),
    )
    db.close()
    with Journal(path, readonly=True) as j:
        report = verify_journal(j)
    named = {p.seq for p in report.problems if p.code == "hash" and p.run_id == run}
    print(f"string of event {holder} used by {sorted(users)}; named {sorted(named)}")
    assert {holder} | users <= named <= containing


def test_missing_referenced_event_is_a_clean_error(heist: tuple[Path, str]) -> None:
    """An event that later events refer to, deleted: readers get TamperedJournal naming it,
    verify a finding at the events that cannot be rebuilt."""
    from engine.errors import TamperedJournal

    path, run = heist
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DROP TRIGGER events_no_delete")
    db.execute(f"DELETE FROM events WHERE run_key = {KEY_OF} AND seq = 2", (run,))
    db.close()
    with Journal(path, readonly=True) as j:
        with pytest.raises(TamperedJournal, match="lacks event 2"):
            j.events(run)
        report = verify_journal(j)
    assert any(p.code == "undecodable" and "missing" in p.problem for p in report.problems)


def _summary(j: Journal) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for info in j.runs():
        events = list(j.read(info.run_id))
        out[info.run_id] = {
            "head": len(events),
            "last_hash": events[-1].hash if events else "",
            "payloads_b2": hashlib.blake2b(
                b"".join(s.payload for s in events), digest_size=16
            ).hexdigest(),
            "versions": sorted({s.version for s in events}),
        }
    return out


def test_v4_fixture_reads_as_recorded(tmp_path: Path) -> None:
    """tests/fixtures/journal_v4.db, recorded by the engine that introduced v4 (a one-round
    heist and a resampled branch), reads back to the same canonical events and chain heads,
    verifies, and still does after a writable open."""
    expected = json.loads((FIXTURES / "journal_v4.expected.json").read_text())
    path = tmp_path / "v4.db"
    shutil.copy(FIXTURES / "journal_v4.db", path)
    with Journal(path, readonly=True) as j:
        assert _summary(j) == expected
        assert verify_journal(j).ok
    with Journal(path) as j:
        j.write_version = 5  # the v5 layer itself (v6 packs it: test_journal_packed)
        assert _summary(j) == expected


def test_system_prompts_stored_once_and_tamper_named(heist: tuple[Path, str]) -> None:
    """The crew's system prompts are the `texts` rows of a v4 heist (one per agent, shared by
    its branches); one byte of one changed: verify reports the text, and a hash mismatch at
    every event whose request was rebuilt from it (the first call of that agent at least)."""
    path, run = heist
    with Journal(path) as j:
        j.write_version = 5  # the v5 layer itself (v6 packs it: test_journal_packed)
        run_branch(j, parent_info(j, run), DoResample(k=2), 1)
    db = sqlite3.connect(path, isolation_level=None)
    texts = dict(db.execute("SELECT hash, body FROM texts").fetchall())
    with Journal(path, readonly=True) as j:
        prompts = {m["content"] for e in j.events(run) if isinstance(e, ev.LlmCall)
                   for m in e.request if m["role"] == "system"}  # fmt: skip
    assert {ev.text_key(ev.text_digest(p.encode())) for p in prompts} == set(texts)
    users: dict[str, set[int]] = {}
    for seq, _v, p in stored_rows(path, run):

        def hook(code: int, data: memoryview, seq: int = seq) -> Any:
            if code == ev.TEXT_EXT:
                users.setdefault(ev.text_key(bytes(data)), set()).add(seq)
            return None

        msgspec.msgpack.Decoder(ext_hook=hook).decode(p)
    key, direct = max(users.items(), key=lambda kv: len(kv[1]))
    for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        db.execute(f"DROP TRIGGER {name}")
    body = texts[key]
    db.execute("UPDATE texts SET body = ? WHERE hash = ?", (bytes([body[0] ^ 1]) + body[1:], key))
    db.close()
    with Journal(path, readonly=True) as j:
        report = verify_journal(j)
    named = {p.seq for p in report.problems if p.code == "hash" and p.run_id == run}
    print(f"text {key[:12]} referred to by {sorted(direct)}; named {sorted(named)}")
    assert direct and direct <= named
    assert any(p.run_id is None and key in p.problem for p in report.problems)


def test_threads_sharing_one_journal_read_v4_runs_whole(tmp_path: Path) -> None:
    """One Journal read by four threads at once (as threaded executors and the server do)
    rebuilds every v4 payload exactly: resolutions of references do not mix their state."""
    import threading

    from engine.heist.session import record_heist
    from engine.heist.sim import SimPolicy

    path = tmp_path / "j.db"
    with Journal(path) as j:
        j.write_version = 5  # the v5 layer itself (v6 packs it: test_journal_packed)
        run_id = record_heist(j, SimPolicy(), seed=7).run_id
    with Journal(path) as j:
        j.write_version = 5  # the v5 layer itself (v6 packs it: test_journal_packed)
        want = [s.payload for s in j.read(run_id)]
    errors: list[str] = []
    with Journal(path, readonly=True) as j:

        def work() -> None:
            try:
                for _ in range(15):
                    assert [s.payload for s in j.read(run_id)] == want
            except Exception as e:  # collected: an exception in a thread fails nothing alone
                errors.append(repr(e))

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert errors == []
