"""Event schema v3: each distinct long text is stored once in `texts`; events hold references;
the hash chain covers the resolved bytes, so a changed text is found at every event that uses
it. Old (v2) journals are covered by tests/test_journal_open.py, schema v4 (what the engine
writes today) by tests/test_journal_refs.py; these journals are written as v3
(`Journal.write_version = 3`), as the engine before v4 wrote them."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from journal_helpers import stored_rows

from engine import events as ev
from engine.errors import TamperedJournal
from engine.heist.session import record_heist
from engine.interventions import DoResample, parent_info, run_branch
from engine.journal import Journal
from engine.policies.registry import make_policy
from engine.verify import verify_journal


@pytest.fixture
def heist(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "j.db"
    with Journal(path) as j:
        j.write_version = 3
        result = record_heist(j, make_policy({"name": "sim"}), seed=7, rounds=2)
    return path, result.run_id


def test_resolved_bytes_are_the_canonical_encoding(heist: tuple[Path, str]) -> None:
    """Reading a v3 journal gives back, byte for byte, the canonical encoding of each event,
    and each distinct long text is stored exactly once."""
    path, run = heist
    with Journal(path, readonly=True) as j:
        events = list(j.read(run))
        assert all(s.payload == ev.encode(s.event) for s in events)
        assert all(s.version == 3 for s in events)
        assert verify_journal(j).ok
    stored = stored_rows(path, run)
    refs = [d for _s, _v, p in stored for d in ev.refs_of(p)]
    db = sqlite3.connect(path)
    (n_texts,) = db.execute("SELECT count(*) FROM texts").fetchone()
    assert n_texts == len(set(refs)) and len(refs) > 2 * n_texts  # shared, and stored once
    full = sum(len(s.payload) for s in events)
    compact = sum(len(p) for _s, _v, p in stored)
    (texts_bytes,) = db.execute("SELECT sum(length(body)) FROM texts").fetchone()
    print(f"full payloads {full} B, stored {compact} B + texts {texts_bytes} B")
    assert compact + texts_bytes < 0.75 * full  # the saving grows with the run (bench)


def test_branch_stores_only_what_it_adds(heist: tuple[Path, str]) -> None:
    """A resampled branch re-uses the parent's texts: it adds fewer text bytes than its events
    would hold in full."""
    path, run = heist
    db = sqlite3.connect(path)
    (before,) = db.execute("SELECT count(*) FROM texts").fetchone()
    with Journal(path) as j:
        j.write_version = 3
        branch = run_branch(j, parent_info(j, run), DoResample(k=6), 1).run_id
    (after,) = db.execute("SELECT count(*) FROM texts").fetchone()
    refs = {d for _s, _v, p in stored_rows(path, branch) for d in ev.refs_of(p)}
    print(f"branch refers to {len(refs)} distinct texts, added {after - before}")
    assert 0 < after - before < len(refs)


def test_tampered_text_names_every_event_that_uses_it(heist: tuple[Path, str]) -> None:
    """One byte of a shared text changed (triggers dropped): verify reports the text and every
    event whose request was rebuilt from it, at its run and seq — and reading it is refused
    nowhere silently (the chain no longer matches)."""
    path, run = heist
    stored = stored_rows(path, run)
    counts: dict[bytes, list[int]] = {}
    for seq, _v, p in stored:
        for d in set(ev.refs_of(p)):
            counts.setdefault(d, []).append(seq)
    shared, users = max(counts.items(), key=lambda kv: len(kv[1]))
    assert len(users) > 3
    db = sqlite3.connect(path, isolation_level=None)
    for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        db.execute(f"DROP TRIGGER {name}")
    (body,) = db.execute("SELECT body FROM texts WHERE hash = ?", (ev.text_key(shared),)).fetchone()
    flipped = bytes([body[0] ^ 0x01]) + bytes(body[1:])
    db.execute("UPDATE texts SET body = ? WHERE hash = ?", (flipped, ev.text_key(shared)))
    db.close()
    with Journal(path, readonly=True) as j:
        report = verify_journal(j)
    named = {p.seq for p in report.problems if p.code == "text" and p.run_id == run}
    assert named == set(users)
    assert {p.seq for p in report.problems if p.code == "hash"} == set(users)
    assert any(p.run_id is None and ev.text_key(shared) in p.problem for p in report.problems)


def test_missing_text_is_a_clean_error(heist: tuple[Path, str]) -> None:
    """A deleted text: readers get TamperedJournal naming it, verify a finding per event."""
    path, run = heist
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DROP TRIGGER texts_no_delete")
    db.execute("DELETE FROM texts")
    db.close()
    with Journal(path, readonly=True) as j:
        with pytest.raises(TamperedJournal, match="lacks text b2:"):
            j.events(run)
        report = verify_journal(j)
    assert any(p.code == "text" and "missing" in p.problem for p in report.problems)


def test_texts_refuse_rewrites(heist: tuple[Path, str]) -> None:
    """`texts` is history: UPDATE, DELETE, REPLACE and UPSERT are refused by the database."""
    path, _run = heist
    db = sqlite3.connect(path, isolation_level=None)
    for sql in (
        "UPDATE texts SET body = x'00'",
        "DELETE FROM texts",
        "REPLACE INTO texts SELECT hash, x'00' FROM texts",
        "INSERT OR REPLACE INTO texts SELECT hash, x'00' FROM texts",
        "INSERT INTO texts SELECT hash, x'00' FROM texts WHERE true ON CONFLICT DO UPDATE"
        " SET body = excluded.body",
    ):
        with pytest.raises(sqlite3.DatabaseError, match="refused"):
            db.execute(sql)
