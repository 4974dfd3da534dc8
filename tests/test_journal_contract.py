"""The journal contract: one suite, run against SQLite and a real PostgreSQL server."""

from __future__ import annotations

import os
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from engine import events as ev
from engine.errors import ConcurrencyError, InterventionError, UnknownRun
from engine.journal import KIND_CODES, SPAN, Journal, chain_hash, hash_cell
from engine.verify import VerifyProblem, VerifyReport

# the events rows of a run by its public id (they carry its run_key, docs/decisions.md 38)
KEY_OF = "(SELECT run_key FROM runs WHERE run_id = ?)"


def started(seed: int = 1) -> ev.RunStarted:
    return ev.RunStarted(
        scenario="test",
        config={},
        agents=["a", "b"],
        policy={"name": "sim"},
        root_seed=seed,
        engine_version="test",
        started_at="2026-01-01T00:00:00",
    )


def step_events(k: int, text: str = "hello") -> list[ev.Event]:
    agent = "ab"[k % 2]
    return [
        ev.LlmCall(
            step=k,
            agent=agent,
            request=[{"role": "user", "content": "go"}],
            seed=k,
            model="m",
            response=text,
            finish_reason="stop",
        ),
        ev.ToolResult(step=k, agent=agent, tool="calculator", param="1+1", ok=True, output="2"),
        ev.ChatMessage(step=k, agent=agent, text=f"{text} {k}"),
    ]


def run_findings(report: VerifyReport) -> list[VerifyProblem]:
    """The findings about runs (these tests drop the triggers on purpose, which verify also
    reports, as a finding about the whole file)."""
    dropped = [p for p in report.problems if p.run_id is None]
    assert all(p.code == "trigger" for p in dropped), dropped
    return [p for p in report.problems if p.run_id is not None]


def record(j: Journal, steps: int) -> str:
    run = j.create_run("test")
    head = j.append(run, [started()], 0)
    for k in range(steps):
        head = j.append(run, step_events(k), head)
    return run


class JournalContract:
    """Behaviour every backend must show. Subclasses provide `journal` and raw SQL access."""

    def raw_execute(self, j: Journal, sql: str) -> None:
        raise NotImplementedError

    def test_append_and_read_back(self, journal: Journal) -> None:
        """Appended events read back in seq order, decoded to the same values."""
        run = record(journal, 3)
        stored = list(journal.read(run))
        assert [s.seq for s in stored] == list(range(10))
        assert stored[0].event == started()
        assert stored[-1].event == step_events(2)[-1]
        assert journal.head(run) == 10
        assert journal.steps(run) == 3
        assert journal.step_start(run, 1) == 4

    def test_update_and_delete_refused_by_database(self, journal: Journal) -> None:
        """The database itself refuses UPDATE and DELETE on events and runs, clearly."""
        record(journal, 1)
        for sql in (
            "UPDATE events SET kind = 99",
            "DELETE FROM events",
            "UPDATE runs SET label = 'x'",
            "DELETE FROM runs",
        ):
            with pytest.raises(Exception, match="append-only"):
                self.raw_execute(journal, sql)

    def test_verify_intact(self, journal: Journal) -> None:
        """An untouched journal verifies, every event counted."""
        run = record(journal, 4)
        fork = journal.fork(run, 5)
        journal.append(fork, [ev.Intervention(step=1, op="resample", at=1)], 5)
        report = journal.verify()
        assert report.ok and report.events_checked == 13 + 1

    def test_tampered_payload_located(self, journal: Journal) -> None:
        """Changing one event's bytes (with the triggers dropped) is found at that run and seq."""
        run = record(journal, 4)
        self.disable_guards(journal)
        forged = ev.encode(ev.ChatMessage(step=1, agent="b", text="forged"))
        self.raw_execute_params(
            journal,
            f"UPDATE events SET payload = ? WHERE run_key = {KEY_OF} AND seq = ?",
            (forged, run, 6),
        )
        problems = run_findings(journal.verify(run))
        assert (problems[0].run_id, problems[0].seq) == (run, 6)
        assert "altered" in problems[0].problem
        # v6: the later events of its block are packed against it; each is named once, as such
        later = problems[1:]
        assert [p.seq for p in later] == list(range(7, 13))
        assert all(p.code == "packed" and "event 6" in p.problem for p in later)

    def test_removed_event_located(self, journal: Journal) -> None:
        """Deleting an event is reported at the first missing seq."""
        run = record(journal, 4)
        self.disable_guards(journal)
        self.raw_execute_params(
            journal, f"DELETE FROM events WHERE run_key = {KEY_OF} AND seq = ?", (run, 3)
        )
        problems = run_findings(journal.verify(run))
        assert [(p.seq, "removed" in p.problem) for p in problems[:1]] == [(3, True)]
        # v6: the later events of its block were packed against it
        assert all(p.code == "packed" and "event 3 " in p.problem for p in problems[1:])

    def test_reordered_events_located(self, journal: Journal) -> None:
        """Swapping two events' payloads and hashes is found at the first swapped seq."""
        run = record(journal, 4)
        rows = {s.seq: s for s in journal.read(run)}
        self.disable_guards(journal)
        for a, b in ((4, 7), (7, 4)):
            self.raw_execute_params(
                journal,
                "UPDATE events SET payload = ?, hash = ?, kind = ?"
                f" WHERE run_key = {KEY_OF} AND seq = ?",
                (rows[b].payload, hash_cell(rows[b].hash), KIND_CODES[rows[b].kind], run, a),
            )
        problems = run_findings(journal.verify(run))
        # the first finding is the first swapped seq; every finding lies at a swapped row or
        # the row that chains on one
        assert problems[0].seq == 4 and problems[0].code == "hash"
        # v6: the block's later events were packed against the rows as they were
        unpacked = [p for p in problems if p.code != "packed"]
        assert {p.seq for p in unpacked} <= {4, 5, 7, 8}
        assert all("event 4 " in p.problem for p in problems if p.code == "packed")
        assert {(p.seq, p.code) for p in unpacked} >= {(4, "hash")}

    def test_concurrent_writer_conflicts(self, journal: Journal, second: Journal) -> None:
        """Two writers appending at the same seq: one wins, the other gets ConcurrencyError."""
        run = record(journal, 1)
        head = journal.head(run)
        journal.append(run, step_events(1, "first"), head)
        with pytest.raises(ConcurrencyError, match=r"seq \d+ was already written"):
            second.append(run, step_events(1, "second"), head)
        texts = [s.event.text for s in journal.read(run) if s.kind == "chat_message"]
        assert texts == ["hello 0", "first 1"]
        assert journal.verify(run).ok

    def test_threads_racing_never_overwrite(self, journal: Journal, second: Journal) -> None:
        """Many racing appends: each seq written once, losers told, the chain intact."""
        run = record(journal, 0)
        wins: list[str] = []
        losses: list[str] = []

        def writer(j: Journal, name: str) -> None:
            for k in range(20):
                try:
                    j.append(run, step_events(k, name))
                    wins.append(name)
                except ConcurrencyError:
                    losses.append(name)

        threads = [
            threading.Thread(target=writer, args=(j, n)) for j, n in ((journal, "x"), (second, "y"))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert journal.head(run) == 1 + 3 * len(wins)
        assert journal.verify(run).ok

    def test_fork_reads_prefix_through_parent(self, journal: Journal) -> None:
        """A fork shares the parent's prefix without copying it; nested forks work."""
        run = record(journal, 3)
        before = self.count_events(journal)
        child = journal.fork(run, 4)
        assert self.count_events(journal) == before
        journal.append(child, [ev.Intervention(step=1, op="action", at=1), *step_events(1, "c")], 4)
        grandchild = journal.fork(child, 6)
        journal.append(grandchild, step_events(2, "g"), 6)
        texts = [s.event.text for s in journal.read(grandchild) if s.kind == "chat_message"]
        assert texts == ["hello 0", "g 2"]
        owners = [s.run_id for s in journal.read(grandchild)]
        assert owners[:4] == [run] * 4 and owners[4:6] == [child] * 2
        assert set(owners[6:]) == {grandchild}
        assert journal.verify().ok
        assert journal.steps(grandchild) == 3

    def test_fork_beyond_head_refused(self, journal: Journal) -> None:
        """Forking past the parent's last event is a clear error."""
        run = record(journal, 1)
        with pytest.raises(InterventionError, match="has only 4 events"):
            journal.fork(run, 99)

    def test_unknown_run(self, journal: Journal) -> None:
        """Unknown run ids give UnknownRun naming the id."""
        with pytest.raises(UnknownRun, match="'nope'"):
            journal.run("nope")
        with pytest.raises(UnknownRun):
            journal.append("nope", step_events(0))

    def test_unique_prefix_resolves(self, journal: Journal) -> None:
        """A unique prefix of a run id names the run."""
        run = record(journal, 0)
        assert journal.run(run[:6]).run_id == run

    def test_what_a_writer_remembers_is_what_the_store_holds(
        self, journal: Journal, second: Journal
    ) -> None:
        """The runs rows, run keys and fork-point hashes a journal remembers (of what it
        created or read) are those a journal that never saw them reads from the store; and
        appends keyed by a remembered run key land in that run."""
        run = record(journal, 2)
        child = journal.fork(run, 4, label="b")
        journal.append(child, step_events(1, "c"), 4)
        grandchild = journal.fork(child, 7)
        journal.append(grandchild, step_events(2, "g"), 7)
        for r in (run, child, grandchild):
            assert journal.run(r) == second.run(r)
            assert journal.run_key(r) == second.run_key(r)
            assert journal.lineage(r) == second.lineage(r)
        for seq in (3, 6):
            assert journal.hash_at(grandchild, seq) == second.hash_at(grandchild, seq)
        texts = [s.event.text for s in second.read(grandchild) if s.kind == "chat_message"]
        assert texts == ["hello 0", "c 1", "g 2"]
        assert second.verify().ok

    def test_a_run_whose_transaction_failed_is_not_remembered(
        self, journal: Journal, second: Journal, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A fork whose transaction rolls back after its runs row was inserted leaves no run,
        neither in the store nor in what the journal that tried remembers."""
        run = record(journal, 1)

        def refuse(cur: object, run_id: str) -> None:
            raise RuntimeError("the lease could not be written")

        monkeypatch.setattr(journal, "_ids", lambda: "f0f0f0f0f0f0")
        monkeypatch.setattr(journal, "_put_lease", refuse)
        with pytest.raises(RuntimeError, match="lease"):
            journal.fork(run, 2)
        monkeypatch.undo()
        for j in (journal, second):
            with pytest.raises(UnknownRun):
                j.run("f0f0f0f0f0f0")
        assert [r.run_id for r in journal.runs()] == [run]

    def test_a_fork_needs_a_fork_point_and_a_run_its_label(self, journal: Journal) -> None:
        run = record(journal, 1)
        for bad in (None, -1):
            with pytest.raises(InterventionError) as e:
                journal.create_run("test", parent_run_id=run, fork_seq=bad)
            assert str(e.value) == f"a fork needs a fork_seq >= 0, got {bad!r}"
        assert journal.run(journal.create_run("test")).label == ""

    def test_a_branch_forked_at_its_parents_first_event_verifies(
        self, journal: Journal, second: Journal
    ) -> None:
        """Forked at seq 0 the branch shares nothing: its first event chains on nothing."""
        run = record(journal, 1)
        child = journal.fork(run, 0)
        journal.append(child, step_events(0, "zero"), 0)
        assert journal.hash_at(child, 0) == second.hash_at(child, 0)
        assert second.verify().ok
        # what a first event chains on
        assert journal.hash_at(run, -1) == second.hash_at(child, -1) == ""

    def test_a_prefix_is_taken_as_written(self, journal: Journal, second: Journal) -> None:
        """A journal that never saw the run resolves a unique prefix too; the wildcards of SQL
        LIKE in a prefix match only themselves; an empty id names no run."""
        run = record(journal, 0)
        assert second.run(run[:5]).run_id == run
        for text in ("%", run[:3] + "%", "_" + run[1:6], ""):
            with pytest.raises(UnknownRun) as e:
                second.run(text)
            assert str(e.value) == f"unknown run id {text!r} (see `car runs`)"

    def test_a_branch_first_written_by_another_journal_is_stored_alike(
        self, journal: Journal, second: Journal
    ) -> None:
        """Two branches forked by one journal at one point with the same events: written by
        it or by another journal (which did not fork it: it reads the parent's head itself),
        their rows are the same bytes."""
        run = record(journal, 6)
        mine, theirs = journal.fork(run, 9), journal.fork(run, 9)
        events = step_events(3, "same")
        journal.append(mine, events, 9)
        second.append(theirs, events, 9)
        assert self.stored(second, mine) == self.stored(second, theirs) != []
        assert second.verify().ok

    def test_upcaster_reads_old_rows(self, journal: Journal) -> None:
        """A version-1 tool_result row (one `text` field) reads back as a version-2 event."""
        import msgspec

        run = journal.create_run("test")
        key = journal.run_key(run)
        payload = msgspec.msgpack.encode(
            {
                "kind": "tool_result",
                "step": 0,
                "agent": "a",
                "tool": "file_reader",
                "param": "../x",
                "ok": False,
                "text": "path leaves the folder",
            }
        )
        h = chain_hash("", 0, "tool_result", 1, payload)
        self.raw_execute_params(
            journal,
            "INSERT INTO events (id, run_key, seq, step, kind, version, payload, hash)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (key * SPAN, key, 0, 0, KIND_CODES["tool_result"], 1, payload, hash_cell(h)),
        )
        (stored,) = list(journal.read(run))
        assert stored.event == ev.ToolResult(
            step=0,
            agent="a",
            tool="file_reader",
            param="../x",
            ok=False,
            error="path leaves the folder",
        )
        assert journal.verify(run).ok

    # helpers implemented per backend
    def raw_execute_params(self, j: Journal, sql: str, params: tuple[object, ...]) -> None:
        raise NotImplementedError

    def stored(self, j: Journal, run_id: str) -> list[tuple[int, int, bytes, bytes]]:
        """(seq, version, stored payload, hash) of the run's own rows."""
        raise NotImplementedError

    def disable_guards(self, j: Journal) -> None:
        raise NotImplementedError

    def count_events(self, j: Journal) -> int:
        raise NotImplementedError


class TestSqliteJournal(JournalContract):
    @pytest.fixture
    def path(self, tmp_path: Path) -> Path:
        return tmp_path / "journal.db"

    @pytest.fixture
    def journal(self, path: Path) -> Iterator[Journal]:
        with Journal(path) as j:
            yield j

    @pytest.fixture
    def second(self, path: Path, journal: Journal) -> Iterator[Journal]:
        with Journal(path) as j:
            yield j

    def _db(self, j: Journal) -> sqlite3.Connection:
        assert j.path is not None
        return sqlite3.connect(j.path, isolation_level=None)

    def raw_execute(self, j: Journal, sql: str) -> None:
        self._db(j).execute(sql)

    def raw_execute_params(self, j: Journal, sql: str, params: tuple[object, ...]) -> None:
        self._db(j).execute(sql, params)

    def disable_guards(self, j: Journal) -> None:
        db = self._db(j)
        for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'"):
            db.execute(f"DROP TRIGGER {name}")

    def count_events(self, j: Journal) -> int:
        return int(self._db(j).execute("SELECT count(*) FROM events").fetchone()[0])

    def stored(self, j: Journal, run_id: str) -> list[tuple[int, int, bytes, bytes]]:
        rows = self._db(j).execute(
            "SELECT seq, version, payload, hash FROM events WHERE run_key ="
            " (SELECT run_key FROM runs WHERE run_id = ?) ORDER BY seq",
            (run_id,),
        )
        return [(s, v, bytes(p), bytes(h)) for s, v, p, h in rows]

    def test_a_branch_of_a_known_run_reads_only_its_parents_head(self, path: Path) -> None:
        """What never changes once committed (the runs rows, the run keys, the chain hash at a
        fork point, the parent's head when this journal forked the run) is read once: after
        the first branch at a step, each further one reads one thing, the parent's head,
        under the write lock (to refuse a fork past it). Each read more is a statement after
        the other writers' commits, from a cold page cache, in every forward run."""
        from engine.heist.session import record_heist
        from engine.heist.sim import SimPolicy
        from engine.interventions import DoResample, parent_info, prepare_bases, run_branch

        with Journal(path) as j:
            run = record_heist(j, SimPolicy(), seed=7).run_id
        with Journal(path) as j:  # as a forward run's worker: it saw none of it written
            sql0: list[str] = []
            j._conn.set_trace_callback(sql0.append)
            j.run(run)
            read_once = len(sql0)
            j.run(run)
            j._conn.set_trace_callback(None)
            assert read_once > 0 and len(sql0) == read_once, "a runs row is read once"
            parent = parent_info(j, run)
            prepare_bases(j, parent)
            run_branch(j, parent, DoResample(k=20), 100)
            for seed in (101, 102):
                sql: list[str] = []
                j._conn.set_trace_callback(sql.append)
                try:
                    run_branch(j, parent, DoResample(k=20), seed)
                finally:
                    j._conn.set_trace_callback(None)
                reads = [
                    (i, " ".join(q.split()))
                    for i, q in enumerate(sql)
                    if q.lstrip().upper().startswith(("SELECT", "WITH"))
                ]
                assert len(reads) == 1, reads
                (at, query), began = (
                    reads[0],
                    max(
                        i for i, q in enumerate(sql[: reads[0][0]]) if q.upper().startswith("BEGIN")
                    ),
                )
                assert query.startswith("SELECT seq FROM events WHERE id >= ")
                assert not any(q.upper().startswith("COMMIT") for q in sql[began:at])


class TestPostgresJournal(JournalContract):
    @pytest.fixture
    def db_url(self, pg_url: str) -> Iterator[str]:
        url = make_url(pg_url)
        name = "j_" + uuid.uuid4().hex[:12]
        admin = _plain(url.set(database="postgres"))
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        yield url.set(database=name).render_as_string(hide_password=False)
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    @pytest.fixture
    def journal(self, db_url: str) -> Iterator[Journal]:
        with Journal(db_url) as j:
            yield j

    @pytest.fixture
    def second(self, db_url: str, journal: Journal) -> Iterator[Journal]:
        with Journal(db_url) as j:
            yield j

    def _conn(self, j: Journal) -> psycopg.Connection:
        return psycopg.connect(_plain(make_url(j.url)), autocommit=True)

    def raw_execute(self, j: Journal, sql: str) -> None:
        with self._conn(j) as c:
            c.execute(sql)  # type: ignore[arg-type]

    def raw_execute_params(self, j: Journal, sql: str, params: tuple[object, ...]) -> None:
        with self._conn(j) as c:
            c.execute(sql.replace("?", "%s"), params)  # type: ignore[arg-type]

    def disable_guards(self, j: Journal) -> None:
        with self._conn(j) as c:
            c.execute("ALTER TABLE events DISABLE TRIGGER USER")
            c.execute("ALTER TABLE runs DISABLE TRIGGER USER")

    def count_events(self, j: Journal) -> int:
        with self._conn(j) as c:
            row = c.execute("SELECT count(*) FROM events").fetchone()
            assert row is not None
            return int(row[0])

    def stored(self, j: Journal, run_id: str) -> list[tuple[int, int, bytes, bytes]]:
        with self._conn(j) as c:
            rows = c.execute(
                "SELECT seq, version, payload, hash FROM events WHERE run_key ="
                " (SELECT run_key FROM runs WHERE run_id = %s) ORDER BY seq",
                (run_id,),
            ).fetchall()
        return [(s, v, bytes(p), bytes(h)) for s, v, p, h in rows]


def _plain(url: object) -> str:
    """A libpq connection string from a SQLAlchemy URL."""
    u = make_url(str(url)) if not hasattr(url, "drivername") else url
    return u.set(drivername="postgresql").render_as_string(hide_password=False)  # type: ignore[attr-defined]


def test_env_var_names_default_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CAR_JOURNAL overrides the default journal location."""
    from engine.journal import default_journal_url

    monkeypatch.setenv("CAR_JOURNAL", str(tmp_path / "x.db"))
    assert default_journal_url() == str(tmp_path / "x.db")
    monkeypatch.delenv("CAR_JOURNAL")
    assert default_journal_url() == os.path.join("recordings", "journal.db")
