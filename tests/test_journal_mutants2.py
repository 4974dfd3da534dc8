"""More of the journal's promises that mutation testing showed unchecked: a fork at the very
head, the fold resolving a reference to a row it has not decoded, a run's own chain hashes as
stored, the driver's error class, and a new journal made on a file system without hard links."""

from __future__ import annotations

import errno
import hashlib
import os
import sqlite3
import struct
from pathlib import Path

import msgspec
import pytest

from engine import events as ev
from engine import journal as jm
from engine.errors import InterventionError
from engine.journal import Journal


def chat(step: int, text: str = "x") -> ev.ChatMessage:
    return ev.ChatMessage(step=step, agent="a", text=text)


@pytest.fixture
def j(tmp_path: Path) -> Journal:
    journal = Journal(tmp_path / "j.db")
    yield journal
    journal.close()


def test_fork_at_the_very_head_is_allowed(j: Journal) -> None:
    """A fork at seq == head (the whole history shared, nothing of the parent left out) is a
    valid fork; one past the head is refused naming the head."""
    run = j.create_run("s")
    j.append(run, [chat(0), chat(1), chat(2)], 0)
    child = j.fork(run, 3)
    assert j.head(child) == 3
    assert j.events(child) == [chat(0), chat(1), chat(2)]
    with pytest.raises(InterventionError, match=r"at seq 4: it has only 3 events"):
        j.fork(run, 4)
    empty = j.create_run("s")
    assert j.head(j.fork(empty, 0)) == 0  # an empty run forks at its head, 0


def test_fold_resolves_a_reference_to_a_row_it_read_as_stored(tmp_path: Path) -> None:
    """A chat message that repeats a long string of an earlier event is stored as a
    back-reference to it; a fresh reader's fold, which decodes the earlier event as stored
    (never resolving it), loads that row to resolve the reference, and both read as written."""
    path = tmp_path / "j.db"
    long = "the vault code is behind the third painting"  # >= MIN_REF characters
    assert len(long) >= ev.MIN_REF
    written = [chat(0, long), chat(1, "short"), chat(2, long)]
    with Journal(path) as w:
        run = w.create_run("s")
        w.append(run, written, 0)
    con = sqlite3.connect(path)
    stored = [bytes(r[0]) for r in con.execute("SELECT payload FROM events ORDER BY id")]
    con.close()
    assert long.encode() in stored[0] and long.encode() not in stored[2]  # a reference
    with Journal(path, readonly=True) as r:
        assert list(r.read_for_fold(run)) == written
        assert list(r.read_for_fold(run, 2)) == written[2:]


def test_own_hashes_are_the_stored_chain(j: Journal, tmp_path: Path) -> None:
    """own_hashes gives (seq, "b2:<hex>") of the run's own rows from `start` on, as stored; a
    branch lists only its own events. The first hash is blake2b-256 of "" + (seq, version)
    + kind + NUL + the event's msgpack bytes."""
    run = j.create_run("s")
    events = [chat(0, "a"), chat(1, "b"), chat(2, "c")]
    j.append(run, events, 0)
    child = j.fork(run, 2)
    j.append(child, [chat(2, "z")], 2)
    con = sqlite3.connect(tmp_path / "j.db")
    rows = {
        rid: [
            (int(s), "b2:" + bytes(h).hex())
            for s, h in con.execute(
                "SELECT e.seq, e.hash FROM events e JOIN runs r ON r.run_key = e.run_key"
                " WHERE r.run_id = ? ORDER BY e.seq",
                (rid,),
            )
        ]
        for rid in (run, child)
    }
    con.close()
    assert [s for s, _ in rows[run]] == [0, 1, 2] and [s for s, _ in rows[child]] == [2]
    assert j.own_hashes(run) == rows[run]
    assert j.own_hashes(run, 1) == rows[run][1:]
    assert j.own_hashes(child) == rows[child]
    assert j.own_hashes(child, 3) == []
    h = hashlib.blake2b(digest_size=32)
    h.update(b"" + struct.pack(">qI", 0, ev.SCHEMA_VERSION) + b"chat_message\x00")
    h.update(msgspec.msgpack.encode(events[0]))
    assert rows[run][0][1] == "b2:" + h.hexdigest()
    assert len({hh for _, hh in rows[run] + rows[child]}) == 4


def test_driver_errors_is_the_dbapi_error_base() -> None:
    """The errors a server open catches besides SQLAlchemy's are the driver's DB-API `Error`
    class (sqlite3.Error for the sqlite dialect), none when the driver names no such class."""
    from sqlalchemy import create_engine

    j = Journal.__new__(Journal)
    j._engine = create_engine("sqlite://")
    try:
        assert j._driver_errors() == (sqlite3.Error,)

        class NoError:
            dbapi = None

        class Fake:
            dialect = NoError()

        j._engine = Fake()  # a dialect whose driver module is missing
        assert j._driver_errors() == ()
    finally:
        create_engine("sqlite://").dispose()


def test_new_journal_on_a_file_system_without_hard_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where os.link fails (a file system without hard links: a fake, since such a mount
    cannot be made here), the new journal is renamed into place instead: it opens as a journal
    and no temporary file is left behind."""

    def no_links(src: object, dst: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    path = tmp_path / "sub" / "j.db"
    with Journal(path) as j:
        run = j.create_run("s")
        j.append(run, [chat(0)], 0)
        assert j.revision == jm.HEAD_REVISION
    monkeypatch.undo()
    assert sorted(p.name for p in path.parent.iterdir() if "creating" in p.name) == []
    with Journal(path, readonly=True) as r:
        assert r.events(run) == [chat(0)]


FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.mark.parametrize(
    "name,run,col",
    [("journal_v3.db", "7cc905d94523", "run_id"), ("journal_v6.db", None, "run_key")],
    ids=["text-keyed", "integer-keyed"],
)
def test_run_col_names_the_layouts_run_column(
    tmp_path: Path, name: str, run: str | None, col: str
) -> None:
    """`run_col` is the events column that names a row's run: `run_id` in a text-keyed
    journal (revision 0003, read as it is), `run_key` from revision 0005 on; `run_key()`
    gives the value that column holds, so a raw query by it finds exactly the run's own rows."""
    import shutil

    shutil.copy(FIXTURES / name, tmp_path / name)
    con = sqlite3.connect(tmp_path / name)
    columns = {r[1] for r in con.execute("PRAGMA table_info(events)")}
    con.close()
    assert col in columns
    with Journal(tmp_path / name, readonly=True) as j:
        rid = run or j.runs()[0].run_id
        assert j.run_col == col
        key = j.run_key(rid)
        assert key == (rid if col == "run_id" else int(key))
        seqs = [
            r[0] for r in j.query(f"SELECT seq FROM events WHERE {col} = ? ORDER BY seq", [key])
        ]
        assert seqs == [s for s, _ in j.own_hashes(rid)] and seqs[0] == 0
        assert seqs == list(range(j.head(rid)))


def test_one_journal_serves_other_threads(tmp_path: Path) -> None:
    """A journal opened in one thread appends and reads in others (one connection, guarded
    by the journal's lock), writable and read-only alike."""
    import threading

    path = tmp_path / "j.db"
    errors: list[BaseException] = []
    with Journal(path) as j:
        runs = [j.create_run("s") for _ in range(3)]

        def work(run: str) -> None:
            try:
                j.append(run, [chat(0, run), chat(1, run)], 0)
            except BaseException as e:  # reported below, in the test's own thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(r,)) for r in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        with Journal(path, readonly=True) as ro:
            got: dict[str, object] = {}

            def read(run: str) -> None:
                try:
                    got[run] = ro.events(run)
                except BaseException as e:
                    errors.append(e)

            t = threading.Thread(target=read, args=(runs[1],))
            t.start()
            t.join()
        assert errors == []
        assert got == {runs[1]: [chat(0, runs[1]), chat(1, runs[1])]}


def test_a_refused_server_journal_is_named_without_its_password() -> None:
    """Opening a PostgreSQL journal where nothing listens fails with JournalError naming the
    URL with its password masked (in-process; the CLI's one-line form is tested elsewhere)."""
    import socket

    from engine.errors import JournalError

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql+psycopg://car:hunter2@127.0.0.1:{port}/car"
    with pytest.raises(JournalError) as got:
        Journal(url)
    text = str(got.value)
    assert text.startswith(
        f"cannot open journal 'postgresql+psycopg://car:***@127.0.0.1:{port}/car': "
    ), text
    assert "hunter2" not in text


LONG = "the vault code is behind the third painting"  # >= MIN_REF characters


def _stored(path: Path, run: str) -> list[bytes]:
    """The payloads of run `run`'s own rows as stored, in seq order."""
    con = sqlite3.connect(path)
    try:
        return [
            bytes(r[0])
            for r in con.execute(
                "SELECT e.payload FROM events e JOIN runs r ON r.run_key = e.run_key"
                " WHERE r.run_id = ? ORDER BY e.seq",
                (run,),
            )
        ]
    finally:
        con.close()


def test_new_journal_in_folders_that_do_not_exist_yet(tmp_path: Path) -> None:
    """A journal path several missing folders deep is created with its folders."""
    path = tmp_path / "a" / "b" / "c" / "j.db"
    with Journal(path) as j:
        j.append(j.create_run("s"), [chat(0)], 0)
    assert path.is_file()


def test_a_resumed_run_refers_to_its_earlier_events(tmp_path: Path) -> None:
    """A new journal object appending to a run that has events (without naming the seq)
    learns the run's history first: a long string of an earlier event is stored as a
    reference, not repeated, and the run reads back and verifies as written."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = j.create_run("s")
        j.append(run, [chat(0, LONG)], 0)
    with Journal(path) as j:
        assert j.append(run, [chat(1, LONG)]) == 2
    stored = _stored(path, run)
    assert LONG.encode() in stored[0] and LONG.encode() not in stored[1]
    with Journal(path, readonly=True) as r:
        assert r.events(run) == [chat(0, LONG), chat(1, LONG)]
        assert r.verify().ok


def test_a_resumed_branch_learns_only_its_own_history(tmp_path: Path) -> None:
    """A branch with events of its own, resumed by a new journal object, learns the strings
    of its history: its own events and its parent's before the fork point, never the parent's
    events past it (their seqs are the branch's own there). A string the parent wrote past
    the fork point and the branch writes again reads back as written, and the journal
    verifies."""
    path = tmp_path / "j.db"
    other = "a different long sentence the parent wrote later on"
    with Journal(path) as j:
        run = j.create_run("s")
        j.append(run, [chat(0, LONG), chat(1, other), chat(2, "p")], 0)
        child = j.fork(run, 1)
        j.append(child, [chat(1, "c"), chat(2, "d")], 1)
    with Journal(path) as j:
        j.append(child, [chat(3, other), chat(4, LONG)], 3)
    with Journal(path, readonly=True) as r:
        want = [chat(0, LONG), chat(1, "c"), chat(2, "d"), chat(3, other), chat(4, LONG)]
        assert r.events(child) == want
        report = r.verify()
        assert report.ok, report.problems
    assert LONG.encode() not in _stored(path, child)[-1]  # referred to (seq 0, shared)


def test_a_directory_is_refused_by_name(tmp_path: Path) -> None:
    """A journal path that is a directory is refused, naming that path."""
    from engine.errors import NotAJournal

    with pytest.raises(NotAJournal) as got:
        Journal(tmp_path)
    assert str(got.value) == f"{str(tmp_path)!r} is a directory, not a journal file"


def test_run_id_prefix_has_no_wildcards(tmp_path: Path) -> None:
    """A run id prefix matches the start of ids, as written: `_` and `%` in it are not LIKE
    wildcards, they match only themselves (no generated id holds them)."""
    from engine.errors import UnknownRun

    ids = iter(["axb1", "ayc2", "q_1", "r%2", "s\\3"])
    with Journal(tmp_path / "j.db", ids=lambda: next(ids)) as j:
        for _ in range(5):
            j.create_run("s")
        for text in ("a_b", "a_x_", "ay%", "a%", "%", "q%", "r_", "s%"):
            with pytest.raises(UnknownRun) as e:
                j.run(text)
            assert str(e.value) == f"unknown run id {text!r} (see `car runs`)"
        assert j.run("ax").run_id == "axb1" and j.run("ay").run_id == "ayc2"
        # an id given by its creator may hold them: then they match themselves
        assert [j.run(p).run_id for p in ("q_", "r%", "s\\")] == ["q_1", "r%2", "s\\3"]
        with pytest.raises(UnknownRun, match=r"ambiguous: \['axb1', 'ayc2'\]"):
            j.run("a")


def test_appending_no_events_writes_nothing(j: Journal) -> None:
    """An empty append writes nothing and returns the seq the caller named, or the head when
    it named none."""
    run = j.create_run("s")
    j.append(run, [chat(0), chat(1)], 0)
    assert j.append(run, [], 7) == 7
    assert j.append(run, []) == 2
    assert j.append(run, [], 0) == 0
    assert j.head(run) == 2


def test_a_branch_snapshot_past_the_fork_is_the_branchs(j: Journal) -> None:
    """A snapshot taken in a branch after its own first event belongs to the branch: the
    parent never finds it; one at the fork point is still shared history."""
    run = j.create_run("s")
    j.append(run, [chat(i) for i in range(8)], 0)
    child = j.fork(run, 5)
    j.append(child, [chat(i, "b") for i in range(5, 8)], 5)
    j.put_snapshot(child, 6, 1, b"c6")
    assert j.nearest_snapshot(child, 7, 1) == (6, b"c6")
    assert j.nearest_snapshot(run, 7, 1) is None
    j.put_snapshot(child, 1, 1, b"c1")  # seq 1 is the parent's too
    assert j.nearest_snapshot(run, 3, 1) == (1, b"c1")


def test_an_unresolvable_payload_is_one_line_naming_the_event(tmp_path: Path) -> None:
    """A stored reference to a string its event does not hold reads as TamperedJournal:
    one line naming the event, the run and the journal, pointing to `car verify`."""
    from engine.errors import TamperedJournal

    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = j.create_run("s")
        j.append(run, [chat(0, LONG), chat(1, LONG)], 0)
    stored = _stored(path, run)
    ref = msgspec.msgpack.Ext(ev.STR_EXT, msgspec.msgpack.encode([[0, 7]]))  # no string 7
    tree = msgspec.msgpack.decode(stored[1])
    assert isinstance(tree, list)
    tree = [ref if isinstance(x, msgspec.msgpack.Ext) else x for x in tree]
    assert tree != msgspec.msgpack.decode(stored[1])
    con = sqlite3.connect(path, isolation_level=None)
    for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        con.execute(f"DROP TRIGGER {name}")
    con.execute(
        "UPDATE events SET payload = ? WHERE seq = 1 AND run_key ="
        " (SELECT run_key FROM runs WHERE run_id = ?)",
        (msgspec.msgpack.encode(tree), run),
    )
    con.close()
    with Journal(path, readonly=True) as r, pytest.raises(TamperedJournal) as got:
        r.events(run)
    text = str(got.value)
    assert text.startswith(f"event 1 of run {run!r} in {str(path)!r} does not resolve: "), text
    assert text.endswith(" (see `car verify`)") and "\n" not in text


def _drop_triggers_and_set(path: Path, run: str, seq: int, payload: bytes) -> None:
    """Overwrite one stored payload (the no-rewrite triggers dropped first): tampering."""
    con = sqlite3.connect(path, isolation_level=None)
    for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        con.execute(f"DROP TRIGGER {name}")
    con.execute(
        "UPDATE events SET payload = ? WHERE seq = ? AND run_key ="
        " (SELECT run_key FROM runs WHERE run_id = ?)",
        (payload, seq, run),
    )
    con.close()


def test_the_fold_never_rebuilds_an_llm_calls_response(tmp_path: Path) -> None:
    """The fold reads an LLM call's agent, seed and step from the stored payload as it is:
    a response whose reference no longer resolves (tampered) stops a full read with
    TamperedJournal, while the fold still reads the run, the call as the fold sees it."""
    from engine.errors import TamperedJournal

    path = tmp_path / "j.db"
    call = ev.LlmCall(
        step=1,
        agent="a",
        request=[{"role": "user", "content": "go"}],
        seed=9,
        model="m",
        response=LONG,
        finish_reason="stop",
    )
    with Journal(path) as j:
        run = j.create_run("s")
        j.append(run, [chat(0, LONG), call], 0)
    stored = _stored(path, run)
    tree = msgspec.msgpack.decode(stored[1])
    refs = [i for i, x in enumerate(tree) if isinstance(x, msgspec.msgpack.Ext)]
    assert len(refs) == 1  # the response, a reference to event 0's string
    tree[refs[0]] = msgspec.msgpack.Ext(ev.STR_EXT, msgspec.msgpack.encode([[0, 7]]))
    _drop_triggers_and_set(path, run, 1, msgspec.msgpack.encode(tree))
    with Journal(path, readonly=True) as r:
        with pytest.raises(TamperedJournal, match=r"event 1 of run .* does not resolve"):
            r.events(run)
        folded = list(r.read_for_fold(run))
    assert folded == [chat(0, LONG), ev.FoldLlmCall(step=1, agent="a", seed=9)]


def test_an_append_that_would_leave_a_gap_is_refused(tmp_path: Path) -> None:
    """An append at a seq past the head (one event would be missing before it) is refused,
    whether the journal has just written the head itself or is a new one; nothing is written
    and the run's chain stays whole."""
    from engine.errors import JournalError

    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = j.create_run("s")
        assert j.append(run, [chat(0), chat(1)], 0) == 2
        with pytest.raises(JournalError, match=f"run {run!r} has no event at seq 2"):
            j.append(run, [chat(3)], 3)
        assert j.head(run) == 2
    with Journal(path) as j:
        with pytest.raises(JournalError, match="has no event at seq 4"):
            j.append(run, [chat(5)], 5)
        assert j.append(run, [chat(2)], 2) == 3
        assert [s.seq for s in j.read(run)] == [0, 1, 2]
        assert j.verify().ok


def test_server_sql_uses_the_drivers_placeholders() -> None:
    """SQL written with `?` placeholders is passed to SQLite as it is and to a server driver
    (psycopg's paramstyle) with `%s` in their place; nothing else changes."""
    j = Journal.__new__(Journal)
    sql = "SELECT a FROM t WHERE b = ? AND c IN (?, ?)"
    j.is_sqlite = True
    assert j._q(sql) == sql
    j.is_sqlite = False
    assert j._q(sql) == "SELECT a FROM t WHERE b = %s AND c IN (%s, %s)"


@pytest.mark.parametrize("stored", [b"\x90", b"\x91", b"\x9f"], ids=["empty", "one", "fifteen"])
def test_a_one_byte_positional_payload_is_not_a_fold_event(stored: bytes) -> None:
    """A stored payload of a single array header (tampered: no kind code follows) is not
    something the fold can read as stored (None: the journal then resolves it and reports
    the damage), never an IndexError from looking for its kind code."""
    assert ev.decode_stored_for_fold(stored) is None


def test_positional_fields_come_back_in_the_structs_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stored positions are fixed forever, while a Struct may declare a later field anywhere:
    when the Struct's order differs from the stored one (simulated here by changing the
    encode order chat messages are given), a positional payload is rebuilt in the Struct's
    order with every value at its name; with the orders equal, in stored order."""
    stored = ev.STORED_FIELDS["chat_message"]
    tree = [ev.KIND_CODES["chat_message"], 0b111, "a", "hello", 4]
    assert stored[:2] == ("agent", "text") and stored[-1] == "step"
    assert list(ev.from_positional(tree).items()) == [
        ("kind", "chat_message"),
        ("agent", "a"),
        ("text", "hello"),
        ("step", 4),
    ]
    monkeypatch.setattr(ev, "_LAYOUTS", {})
    monkeypatch.setitem(ev._ENCODE_ORDER, "chat_message", ("step", "text", "agent"))
    assert list(ev.from_positional(tree).items()) == [
        ("kind", "chat_message"),
        ("step", 4),
        ("text", "hello"),
        ("agent", "a"),
    ]


def _turn(role: str, n: object) -> dict[str, str]:
    return {"role": role, "content": f"message {n} " + "words of the chat go here " * 8}


@pytest.mark.parametrize("tie", [False, True], ids=["second-runs-longer", "tie"])
def test_a_message_in_both_bases_is_copied_from_the_longer_run(tie: bool) -> None:
    """v5: a message found in both of a request's bases is copied from the base whose run of
    equal messages from there is longer, the agent's own previous request on a tie; the
    stored request names the bases it uses, and every request resolves to its own bytes."""
    sa, sb, x = _turn("system", "A"), _turn("system", "B"), _turn("user", "X")
    m1, m2, m3 = _turn("user", 1), _turn("user", 2), _turn("user", 3)
    a1 = [sa, m1, m2] if tie else [sa, m1, m2, m3]
    b2 = [x, m1, m2] if tie else [x, m1, m2, m3]
    turns = [("A", [sa, m1]), ("B", [sb, m1, m2]), ("A", a1), ("B", b2)]
    comp = ev.Compactor(positional=True)
    payloads, stored = [], []
    for seq, (agent, req) in enumerate(turns):
        e = ev.LlmCall(
            step=seq,
            agent=agent,
            request=req,
            seed=1,
            model="m",
            response="ok",
            finish_reason="stop",
        )
        payloads.append(ev.encode_checked(e))
        stored.append(comp.compact(seq, payloads[-1]))
    req = msgspec.msgpack.decode(stored[3])[3]
    head = msgspec.msgpack.decode(req[0].data)
    copies = [o for o in req[1:] if isinstance(o, list) and all(type(v) is int for v in o)]
    if tie:
        # b1 (seq 1) and a1 (seq 2) both hold m1, m2 from position 1: b1 is B's own
        assert (head, copies) == (1, [[1, 3]])
    else:
        # a1 (seq 2) also holds m3 after them: copied from the second base, seq 2
        assert (head, copies) == ([1, 2], [[1, 4, 1]])
    rows = {seq: (ev.SCHEMA_VERSION, s) for seq, s in enumerate(stored)}
    reader = ev.Resolver(lambda run, seq: run, lambda run, seq: rows[seq], lambda d: b"")
    assert [reader.resolve("r", seq, s) for seq, s in enumerate(stored)] == payloads
