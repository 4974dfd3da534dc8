"""Event schema v6 (docs/decisions.md entry 43, engine/packing.py): a row's payload is its v5
stored form deflated against the run's own earlier rows of its block of 64 seqs, and long texts
are deflated, all but the writer's first against that first one.

What must hold: a packed row unpacks to exactly the bytes a v5 writer stores; unpacking never
reads across a block boundary; altered or hostile packed bytes are named by `car verify` and
are one-line errors elsewhere; a v5 journal upgraded for writing packs what it appends."""

from __future__ import annotations

import itertools
import shutil
import sqlite3
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from journal_helpers import KEY_OF, StillClock, car, stored_rows

from engine import events as ev
from engine import packing
from engine.errors import TamperedJournal
from engine.heist.session import record_heist
from engine.interventions import DoResample, parent_info, run_branch
from engine.journal import HEAD_REVISION, Journal
from engine.policies.registry import make_policy
from engine.verify import verify_journal

FIXTURES = Path(__file__).parent / "fixtures"


def _record(path: Path, version: int, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    """The seed-7 heist (six rounds: past two blocks) and two resampled branches, one forked
    inside a block and one at step 10, by a `version` writer with fixed ids and a still clock."""
    monkeypatch.setattr("engine.runtime.episode.SystemClock", StillClock)
    ids = itertools.count()
    with Journal(path, ids=lambda: f"pk{next(ids):010d}") as j:
        j.write_version = version
        run = record_heist(
            j, make_policy({"name": "sim"}), seed=7, rounds=6, clock=StillClock()
        ).run_id
        first = run_branch(j, parent_info(j, run), DoResample(k=2), 1).run_id
        second = run_branch(j, parent_info(j, run), DoResample(k=10), 2).run_id
    return run, first, second


def _unpacked(rows: list[tuple[int, int, bytes]]) -> list[bytes]:
    """A run's own rows unpacked here, block by block, independently of the journal's reader."""
    out: list[bytes] = []
    tail, block = b"", -1
    for seq, version, stored in rows:
        if seq // packing.BLOCK != block:
            tail, block = b"", seq // packing.BLOCK
        plain = packing.unpack(stored, tail) if version >= 6 else stored
        out.append(plain)
        tail = (tail + plain)[-packing.WINDOW :]
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[str, str, str]]:
    mp = pytest.MonkeyPatch()
    try:
        path = tmp_path_factory.mktemp("packed") / "v6.db"
        return path, _record(path, 6, mp)
    finally:
        mp.undo()


def test_packed_rows_unpack_to_the_rows_a_v5_writer_stores(
    packed: tuple[Path, tuple[str, str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row for row, a root and two branches: v6 rows unpacked (block windows rebuilt here)
    are the v5 writer's rows byte for byte; most are packed; the runs read back the same."""
    path6, runs6 = packed
    path5 = tmp_path / "v5.db"
    runs5 = _record(path5, 5, monkeypatch)
    assert runs5 == runs6
    total5 = total6 = n_packed = n = 0
    for run in runs6:
        rows6, rows5 = stored_rows(path6, run), stored_rows(path5, run)
        assert [s for s, _v, _p in rows6] == [s for s, _v, _p in rows5]
        assert {v for _s, v, _p in rows6} == {6} and {v for _s, v, _p in rows5} == {5}
        assert _unpacked(rows6) == [p for _s, _v, p in rows5]
        total5 += sum(len(p) for _s, _v, p in rows5)
        total6 += sum(len(p) for _s, _v, p in rows6)
        n_packed += sum(packing.is_packed(p) for _s, _v, p in rows6)
        n += len(rows6)
    assert n > 2 * packing.BLOCK and n_packed >= 0.8 * n
    print(f"stored payload bytes v5 {total5}, v6 {total6}: {total6 / total5:.2f}x")
    assert total6 < 0.7 * total5
    with Journal(path5, readonly=True) as j5, Journal(path6, readonly=True) as j6:
        for run in runs6:
            assert j6.events(run) == j5.events(run)
        assert verify_journal(j6).ok


def test_unpacking_never_reads_across_a_block(
    packed: tuple[Path, tuple[str, str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading events late in a run, cold: every range the unpacker fetches lies inside one
    block, so a row needs at most BLOCK - 1 others to unpack, never the run's prefix."""
    path, (run, _first, second) = packed
    fetched: list[tuple[int, int]] = []
    with Journal(path, readonly=True) as j:
        head = j.head(run)
        assert head > 2 * packing.BLOCK
        own = j._fetch_own

        def spy(run_id: str, lo: int, hi: int) -> list[tuple[int, int, bytes]]:
            fetched.append((lo, hi))
            return own(run_id, lo, hi)

        monkeypatch.setattr(j._unpacker, "_fetch", spy)
        late = list(j.read(run, head - 3))
        assert [s.seq for s in late] == list(range(head - 3, head))
        list(j.read(second, j.head(second) - 1))
    assert fetched
    for lo, hi in fetched:
        assert lo // packing.BLOCK == (hi - 1) // packing.BLOCK, (lo, hi)


def test_texts_packed_alone_once_then_against_that_one(tmp_path: Path) -> None:
    """The crew's six system prompts: the first stored deflated alone, the other five against
    it (so none needs more than one other), each unpacking to the text its key names."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        record_heist(j, make_policy({"name": "sim"}), seed=7, rounds=1)
    db = sqlite3.connect(path)
    rows = dict(db.execute("SELECT hash, body FROM texts").fetchall())
    db.close()
    assert len(rows) == 6 and all(packing.is_packed(b) for b in rows.values())
    alone = [k for k, b in rows.items() if packing.text_base(b) is None]
    assert len(alone) == 1
    first = packing.unpack_text(rows[alone[0]], None)
    plain_total = 0
    for key, body in rows.items():
        base = packing.text_base(body)
        assert base in (None, ev.text_digest(first))
        text = packing.unpack_text(body, first if base is not None else None)
        assert ev.text_key(ev.text_digest(text)) == key
        plain_total += len(text)
    stored_total = sum(len(b) for b in rows.values())
    assert stored_total < 0.4 * plain_total


def _drop_triggers(db: sqlite3.Connection) -> None:
    for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        db.execute(f"DROP TRIGGER {name}")


def test_altered_base_text_is_named_with_its_users(
    packed: tuple[Path, tuple[str, str, str]], tmp_path: Path
) -> None:
    """One byte of the first text's deflated bytes changed: `car verify` exits 1 naming that
    text, and the events whose requests were rebuilt from it; reading those events is one
    line, no traceback."""
    src, (run, _first, _second) = packed
    path = tmp_path / "j.db"
    shutil.copy(src, path)
    db = sqlite3.connect(path, isolation_level=None)
    rows = dict(db.execute("SELECT hash, body FROM texts").fetchall())
    key = next(k for k, b in rows.items() if packing.text_base(b) is None)
    body = rows[key]
    _drop_triggers(db)
    db.execute(
        "UPDATE texts SET body = ? WHERE hash = ?",
        (body[:4] + bytes([body[4] ^ 0x20]) + body[5:], key),
    )
    db.close()
    with Journal(path, readonly=True) as j:
        report = verify_journal(j)
    assert not report.ok
    assert any(p.run_id is None and key in p.problem for p in report.problems)
    assert any(p.run_id == run for p in report.problems)
    res = car(path, "verify")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert key in res.stdout + res.stderr


@pytest.mark.parametrize(
    "forge",
    [
        "cut short",
        "bytes past the end",
        "not deflate",
        "inflates past the limit",
    ],
)
def test_hostile_packed_payload_is_a_one_line_error(tmp_path: Path, forge: str) -> None:
    """A packed row that does not unpack: reading the run is a TamperedJournal in one line
    that names the event, and verify names it too."""
    path = tmp_path / "j.db"
    text = "the guard changes at two and the vault door opens at midnight. " * 8
    with Journal(path) as j:
        run = j.create_run("hostile")
        head = 0
        for step in range(4):
            said = ev.ChatMessage(step=step, agent="a", text=f"{step} {text}")
            head = j.append(run, [said], head)
    stored = {s: p for s, _v, p in stored_rows(path, run)}
    assert packing.is_packed(stored[2])
    if forge == "cut short":
        bad = stored[2][:-3]
    elif forge == "bytes past the end":
        bad = stored[2] + b"\x00\x01"
    elif forge == "not deflate":
        bad = packing.PACKED + b"\xff" * 40
    else:  # a deflate bomb: a little stored, more than MAX_PLAIN once inflated
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        bad = packing.PACKED + c.compress(bytes(packing.MAX_PLAIN + 1)) + c.flush()
        assert len(bad) < 100_000
    db = sqlite3.connect(path, isolation_level=None)
    _drop_triggers(db)
    db.execute(f"UPDATE events SET payload = ? WHERE run_key = {KEY_OF} AND seq = 2", (bad, run))
    db.close()
    with Journal(path, readonly=True) as j:
        with pytest.raises(TamperedJournal, match=r"event 2 .* does not unpack") as got:
            j.events(run)
        assert len(str(got.value).splitlines()) == 1
        report = verify_journal(j)
    found = {(p.seq, p.code) for p in report.problems if p.run_id == run}
    assert (2, "undecodable") in found
    assert {s for s, c in found if c == "packed"} <= {3}


def test_text_cycle_or_missing_base_is_a_one_line_error(tmp_path: Path) -> None:
    """Texts packed against each other in a cycle, or against a text that is not there: the
    events that use them are TamperedJournal in one line; verify names the texts."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = j.create_run("texts")
        call = ev.LlmCall(
            step=0,
            agent="a",
            request=[{"role": "system", "content": "You are a. " * 40}],
            response="ok",
            seed=1,
            model="m",
            finish_reason="stop",
        )
        j.append(run, [call], 0)
    db = sqlite3.connect(path, isolation_level=None)
    key, body = db.execute("SELECT hash, body FROM texts").fetchone()
    digest = bytes.fromhex(key.removeprefix(ev.TEXT_PREFIX))
    _drop_triggers(db)
    # based on itself: the shortest cycle
    looped = packing.PACKED + b"\x01" + digest + body[2:]
    db.execute("UPDATE texts SET body = ? WHERE hash = ?", (looped, key))
    db.close()
    with Journal(path, readonly=True) as j:
        with pytest.raises(TamperedJournal, match="does not unpack") as got:
            j.events(run)
        assert len(str(got.value).splitlines()) == 1
        report = verify_journal(j)
    assert any(p.code == "text" and key in p.problem for p in report.problems)
    db = sqlite3.connect(path, isolation_level=None)
    missing = packing.PACKED + b"\x01" + bytes(32) + body[2:]
    db.execute("UPDATE texts SET body = ? WHERE hash = ?", (missing, key))
    db.close()
    with Journal(path, readonly=True) as j:
        with pytest.raises(TamperedJournal, match=r"does not unpack|lacks text"):
            j.events(run)
        report = verify_journal(j)
    assert any(p.code == "text" and "missing" in p.problem for p in report.problems)


def test_a_journal_upgraded_for_writing_packs_what_it_appends(tmp_path: Path) -> None:
    """The revision-0006 fixture (v5 rows) opened for writing becomes 0007; a branch forked
    from its heist is written as v6 rows, packed, next to the parent's v5 rows; both read back
    and verify."""
    path = tmp_path / "v6.db"
    shutil.copy(FIXTURES / "journal_v6.db", path)
    with Journal(path) as j:
        assert j.revision == HEAD_REVISION == "0007_packed_rows"
        before = j.events("v6run0000000")
        branch = run_branch(j, parent_info(j, "v6run0000000"), DoResample(k=3), 5).run_id
    rows = stored_rows(path, branch)
    assert rows and {v for _s, v, _p in rows} == {6}
    assert any(packing.is_packed(p) for _s, _v, p in rows)
    assert {v for _s, v, _p in stored_rows(path, "v6run0000000")} == {5}
    with Journal(path, readonly=True) as j:
        assert j.events("v6run0000000") == before
        assert len(j.events(branch)) == j.head(branch)
        assert verify_journal(j).ok


@settings(max_examples=200, deadline=None)
@given(plain=st.binary(max_size=3000), window=st.binary(max_size=packing.WINDOW))
def test_pack_round_trip(plain: bytes, window: bytes) -> None:
    """Any bytes after any window unpack to themselves; they are stored packed only when that
    is smaller (or when, as they are, they would read as packed), else as they are."""
    stored = packing.pack(plain, window)
    assert packing.unpack(stored, window) == plain
    if packing.is_packed(stored):
        assert len(stored) < len(plain) or packing.is_packed(plain)
    else:
        assert stored == plain


@settings(max_examples=100, deadline=None)
@given(body=st.text(min_size=1, max_size=2000), base=st.text(max_size=2000))
def test_text_pack_round_trip(body: str, base: str) -> None:
    raw, plain = body.encode(), base.encode()
    digest = ev.text_digest(plain)
    for packed_form, base_plain in (
        (packing.pack_text(raw, None), None),
        (packing.pack_text(raw, (digest, plain)), plain),
    ):
        assert len(packed_form) <= len(raw)
        if packing.is_packed(packed_form):
            assert packing.text_base(packed_form) == (digest if base_plain is not None else None)
            assert packing.unpack_text(packed_form, base_plain) == raw
        else:
            assert packed_form == raw


def test_threads_writing_runs_with_texts_through_one_journal(tmp_path: Path) -> None:
    """Four threads append runs whose LLM calls carry system prompts of their own through one
    Journal (as threaded executors do) while two read them cold: none waits forever, every
    text is packed against a text that is there, every run reads back as written, and the
    journal verifies."""
    import threading

    path = tmp_path / "j.db"
    written: dict[str, list[ev.AnyEvent]] = {}
    with Journal(path) as j:

        def writer(t: int) -> None:
            for r in range(6):
                run = j.create_run(f"t{t}r{r}")
                events: list[ev.AnyEvent] = []
                head = 0
                for step in range(3):
                    prompt = f"You are agent {t}-{r}, who plans step {step}. " * 12
                    call = ev.LlmCall(
                        step=step,
                        agent=f"a{t}",
                        request=[{"role": "system", "content": prompt}],
                        response=f"thread {t} run {r} step {step} answers",
                        seed=step,
                        model="m",
                        finish_reason="stop",
                    )
                    head = j.append(run, [call], head)
                    events.append(call)
                written[run] = events

        done = threading.Event()
        reads = [0]

        def reader() -> None:
            # cold reads of packed rows (fetches under the journal's lock) while the writers
            # hold it for their transactions: one lock order, no deadlock
            while not done.is_set():
                for run in list(written):
                    j._unpacker.clear()
                    j.events(run)
                    reads[0] += 1

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        readers = [threading.Thread(target=reader) for _ in range(2)]
        for th in threads + readers:
            th.start()
        for th in threads:
            th.join(60)
        done.set()
        for th in readers:
            th.join(60)
        assert not any(th.is_alive() for th in threads + readers), "deadlocked"
    db = sqlite3.connect(path)
    bodies = dict(db.execute("SELECT hash, body FROM texts").fetchall())
    db.close()
    digests = {bytes.fromhex(k.removeprefix(ev.TEXT_PREFIX)) for k in bodies}
    assert len(bodies) == 4 * 6 * 3
    assert all(packing.text_base(b) in digests | {None} for b in bodies.values())
    with Journal(path, readonly=True) as j:
        for run, events in written.items():
            assert j.events(run) == events
        assert verify_journal(j).ok


# ------------------------------------------------------------------ the unpacker's own promises


def _rows_and_fetch(
    n: int,
) -> tuple[list[bytes], dict[int, tuple[int, bytes]], list[tuple[int, int]], packing.Fetch]:
    """`n` rows of one run written through an Unpacker as the journal's writer does, and a
    fetch over them that records what it is asked for."""
    plains = [
        f"row {i}: the guard changes at {i % 7} and the van waits ".encode() * 6 for i in range(n)
    ]
    rows: dict[int, tuple[int, bytes]] = {}
    calls: list[tuple[int, int]] = []

    def fetch(run: str, lo: int, hi: int) -> list[tuple[int, int, bytes]]:
        calls.append((lo, hi))
        return [(s, *rows[s]) for s in range(lo, hi) if s in rows]

    writer = packing.Unpacker(fetch)
    for seq, plain in enumerate(plains):
        rows[seq] = (6, writer.pack_rows("r", seq, [plain])[0])
        writer.remember("r", seq, plain)
    return plains, rows, calls, fetch


def test_a_writer_and_an_in_order_reader_fetch_nothing() -> None:
    """A writer that remembers what it committed needs no read for its next window; a reader
    in seq order fetches nothing, nor on a second pass; a cold read of a late row fetches its
    block's rows before it, once."""
    plains, rows, calls, fetch = _rows_and_fetch(150)
    assert calls == []
    assert sum(packing.is_packed(s) for _v, s in rows.values()) >= 140
    reader = packing.Unpacker(fetch)
    for _ in range(2):
        assert [reader.plain("r", s, *rows[s]) for s in range(150)] == plains
    assert calls == []
    cold = packing.Unpacker(fetch)
    assert cold.plain("r", 100, *rows[100]) == plains[100]
    assert cold.plain("r", 101, *rows[101]) == plains[101]
    assert cold.plain("r", 90, *rows[90]) == plains[90]
    assert calls == [(64, 100)]


def test_remembered_rows_must_follow_on() -> None:
    """A row remembered out of turn (not the block's next) is not taken as part of the
    window: the next window is read instead, and is right."""
    plains, rows, calls, fetch = _rows_and_fetch(10)
    u = packing.Unpacker(fetch)
    u.remember("r", 3, b"not what row 3 holds")
    assert u.plain("r", 5, *rows[5]) == plains[5]
    assert calls == [(0, 5)]
    u.remember("r", 7, b"a gap before it")
    assert u.window("r", 7) == b"".join(plains[:7])[-packing.WINDOW :]


def test_blocks_kept_are_bounded() -> None:
    """At most `max_blocks` blocks are kept; reading past the bound forgets and stays right."""
    plains, rows, _calls, fetch = _rows_and_fetch(4 * packing.BLOCK)
    u = packing.Unpacker(fetch, max_blocks=2)
    for s in (0, 64, 128, 192, 1, 65):
        assert u.plain("r", s, *rows[s]) == plains[s]
        assert len(u._blocks) <= 2
    # remembering is for a writer's next window: no block it has not read is made up
    w = packing.Unpacker(fetch, max_blocks=2)
    for s in (0, 64, 128):
        w.remember("r", s, plains[s])
    assert w._blocks == {}


def test_a_step_across_a_block_boundary_starts_its_window_again() -> None:
    """Rows of one append that cross into the next block: the first row of the new block is
    packed against nothing, even when it repeats the row before it word for word."""
    same = b"the same words again and again, " * 8
    u = packing.Unpacker(lambda run, lo, hi: [])
    stored = u.pack_rows("r", 62, [same, same, same, same])
    assert packing.unpack(stored[2], b"") == same
    with pytest.raises(ValueError):
        # the row after it is packed against it, so it needs it
        packing.unpack(stored[3], b"")


def test_errors_of_packed_bytes_say_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each way a packed payload or text is broken has its own message; the bound on what
    a row may inflate to is exact."""
    good = packing.pack(b"abc" * 100, b"")
    with pytest.raises(ValueError, match=r"^packed bytes do not inflate \("):
        packing.unpack(packing.PACKED + b"\xff" * 30, b"")
    with pytest.raises(ValueError, match=r"^packed bytes are cut short or carry bytes past"):
        packing.unpack(good[:-2], b"")
    with pytest.raises(ValueError, match=r"^packed bytes are cut short or carry bytes past"):
        packing.unpack(good + b"\x00", b"")
    monkeypatch.setattr(packing, "MAX_PLAIN", 300)
    assert packing.unpack(good, b"") == b"abc" * 100  # exactly the bound
    assert packing.is_packed(packing.pack(b"a" * 300, b""))
    assert packing.pack(b"a" * 301, b"") == b"a" * 301  # above it: stored as it is
    with pytest.raises(ValueError, match=r"^packed bytes inflate to more than 300 bytes$"):
        packing.unpack(packing.PACKED + packing._deflate(b"a" * 301, b""), b"")
    monkeypatch.undo()
    base = (ev.text_digest(b"base"), b"base text " * 50)
    text = packing.pack_text(b"base text " * 40 + b"and more", base)
    assert packing.text_base(text) == base[0]
    with pytest.raises(ValueError, match=r"^packed text is cut short$"):
        packing.text_base(text[: 2 + packing.DIGEST - 1])
    assert packing.text_base(text[: 2 + packing.DIGEST]) == base[0]
    with pytest.raises(ValueError, match=r"^packed text has an unknown form$"):
        packing.unpack_text(packing.PACKED + b"\x07" + text[2:], base[1])
    with pytest.raises(ValueError, match=r"^packed text has an unknown form$"):
        packing.unpack_text(text, None)  # based, but no base given
    with pytest.raises(ValueError, match=r"^packed text has an unknown form$"):
        packing.unpack_text(text[:10], base[1])  # based, shorter than its base's digest
    with pytest.raises(ValueError, match=r"^packed bytes are cut short"):
        packing.unpack_text(text[: 2 + packing.DIGEST], base[1])  # the digest, no deflate
    assert packing.unpack_text(text, base[1]) == b"base text " * 40 + b"and more"
    alone = packing.pack_text(b"XXXX" * 200, None)
    assert packing.text_base(alone) is None
    assert packing.unpack_text(alone, None) == b"XXXX" * 200


def test_a_block_read_is_kept_while_another_is_read() -> None:
    """Reading a row of a second block keeps the first (far from the bound): coming back to
    the first fetches nothing more."""
    plains, rows, calls, fetch = _rows_and_fetch(3 * packing.BLOCK)
    u = packing.Unpacker(fetch)
    for s in (10, 70, 11, 71, 12):
        assert u.plain("r", s, *rows[s]) == plains[s]
    assert calls == [(0, 10), (64, 70)]


def _text_chain(n: int) -> tuple[list[bytes], list[bytes], dict[bytes, bytes]]:
    """`n` texts, each packed against the one before it (the first alone): their plain
    bytes, stored bodies and digests (digest -> stored body)."""
    plains = [f"text {i}: the crew meets at the docks at nine. ".encode() * 20 for i in range(n)]
    digests = [bytes([i]) * 32 for i in range(n)]
    stored = [packing.pack_text(plains[0], None)]
    stored += [packing.pack_text(plains[i], (digests[i - 1], plains[i - 1])) for i in range(1, n)]
    return plains, stored, dict(zip(digests, stored, strict=True))


def test_plain_text_follows_its_base_chain_with_depth() -> None:
    """plain_text asks for a base one depth further along (starting at 0), reads a chain of
    MAX_TEXT_DEPTH texts in a row, and refuses one text more with its message."""
    plains, stored, by_digest = _text_chain(packing.MAX_TEXT_DEPTH + 2)
    asked: list[tuple[bytes, int]] = []

    def base_of(digest: bytes, depth: int) -> bytes:
        asked.append((digest, depth))
        return packing.plain_text(by_digest[digest], base_of, depth)

    assert packing.plain_text(stored[0], base_of) == plains[0]
    assert asked == []
    assert packing.plain_text(stored[2], base_of) == plains[2]
    assert asked == [(bytes([1]) * 32, 1), (bytes([0]) * 32, 2)]
    # the last text MAX_TEXT_DEPTH bases along is read at depth MAX_TEXT_DEPTH: no base more
    longest = packing.MAX_TEXT_DEPTH
    assert packing.plain_text(stored[longest], base_of) == plains[longest]
    with pytest.raises(ValueError) as got:
        packing.plain_text(stored[longest + 1], base_of)
    assert str(got.value) == "it is packed against a chain of texts, or a cycle"
    # a text with a base, read at the deepest depth allowed, is refused there and then
    asked.clear()
    with pytest.raises(ValueError, match="chain of texts"):
        packing.plain_text(stored[1], base_of, packing.MAX_TEXT_DEPTH)
    assert asked == []
