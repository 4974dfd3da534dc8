"""The recorder: the one door through which a run's events reach the journal.

It keeps the run's current state by folding exactly the events it appends (so the runtime acts
on the same s_k that a later replay rebuilds), and writes snapshots as the run grows.

Group commit: a step is always appended whole, but when steps come faster than `group_ms`
(the embedded sim policy takes ~0.1 ms a step) several steps share one transaction. A crash
then loses at most the last uncommitted group — whole steps, never half of one — and every
slow step (an LLM call) still commits on its own. `flush()` commits what is pending; the
episode flushes before any control event, at the end and on failure.

Lease: the recorder holds the run's writer lease (engine.journal) from the moment it is made
until the run's RunEnded is committed, refreshing its heartbeat from a daemon thread, so a
reader can tell a run whose process was killed ("abandoned") from one still being written.

Every event is checked to read back as stored (`ev.encode_checked`) when it is handed over, so
a bad event fails its own step and never takes a pending group of good steps down with it."""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from engine import events as ev
from engine.journal import HEARTBEAT_EVERY, Journal
from engine.state import FOLD_VERSION, SNAPSHOT_EVERY, State, apply, encode_state

DEFAULT_GROUP_MS = 2.0


class Recorder:
    """Appends whole steps atomically and tracks (head, state) of one run."""

    def __init__(
        self,
        journal: Journal,
        run_id: str,
        state: State,
        head: int,
        *,
        group_ms: float = 0.0,
        timer: Callable[[], float] = time.monotonic,
        leased: bool = False,
    ) -> None:
        """`leased`: this process has just created the run (`Journal.create_run` gave it the
        lease), so taking the lease again would only cost a transaction."""
        self.journal = journal
        self.run_id = run_id
        self.state = state
        self.head = head
        self.group_ms = group_ms
        self._timer = timer
        self._pending: list[ev.Event] = []
        self._payloads: list[bytes] = []
        self._snapshots: list[tuple[int, bytes]] = []
        self._last_commit = timer()
        self._ended = threading.Event()
        if not leased:
            journal.acquire_lease(run_id)
        _start_heartbeat(self)

    def append(self, events: Sequence[ev.Event]) -> State:
        """Add one step's events (committed now, or with the next group); the state after.

        JournalError, and nothing of the step kept, if an event would not read back."""
        payloads = [ev.encode_checked(e) for e in events]
        s = self.state
        for e in events:
            s = apply(s, e)
            if s.seq % SNAPSHOT_EVERY == 0:
                self._snapshots.append((s.seq, encode_state(s)))
        self._pending.extend(events)
        self._payloads.extend(payloads)
        self.state = s
        if (self._timer() - self._last_commit) * 1000.0 >= self.group_ms:
            self.flush()
        return s

    def flush(self) -> None:
        """Commit every pending step in one transaction, then its snapshots."""
        if self._pending:
            ended = any(isinstance(e, ev.RunEnded) for e in self._pending)
            self.head = self.journal.append(
                self.run_id, self._pending, self.head, payloads=self._payloads
            )
            self._pending = []
            self._payloads = []
            if ended:
                self._ended.set()
        for seq, blob in self._snapshots:
            self.journal.put_snapshot(self.run_id, seq, FOLD_VERSION, blob)
        self._snapshots = []
        self._last_commit = self._timer()

    def drop_pending(self) -> None:
        """Forget the pending group and snapshots once the run was closed without them (their
        flush failed, or had committed before its append raised)."""
        self._pending = []
        self._payloads = []
        self._snapshots = []
        self._ended.set()


class _Heartbeats:
    """One daemon thread per process refreshes the lease of every recorder still writing, every
    HEARTBEAT_EVERY seconds (a thread per recorder cost a branch of a few milliseconds more than
    its own work). A forked process starts its own thread with its first recorder: threads do
    not survive a fork. A recorder leaves when its run has ended or it is gone; a dead process
    stops beating, which is the point."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()
        self._pid = 0
        # a fork while the parent's thread held the lock would leave the child's locked
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lock = threading.Lock()

    def add(self, recorder: Recorder) -> None:
        with self._lock:
            if self._pid != os.getpid():
                # a new process (first use, or a fork's child): the parent's thread is not here
                self._pid = os.getpid()
                self._recorders = weakref.WeakSet()
                threading.Thread(
                    target=self._beat, args=(self._recorders,), name="leases", daemon=True
                ).start()
            self._recorders.add(recorder)

    def _beat(self, recorders: weakref.WeakSet[Recorder]) -> None:
        while True:
            time.sleep(HEARTBEAT_EVERY)
            with self._lock:
                now = list(recorders)
            gone = [r for r in now if r._ended.is_set() or not _beat_one(r)]
            with self._lock:
                for r in gone:
                    recorders.discard(r)


def _beat_one(recorder: Recorder) -> bool:
    """Refresh one lease; False when its journal is closed (nobody to beat for)."""
    try:
        recorder.journal.heartbeat(recorder.run_id)
    except Exception:
        return False
    return True


_heartbeats = _Heartbeats()


def _start_heartbeat(recorder: Recorder) -> None:
    """Refresh the recorder's lease until its run ends or the recorder is gone."""
    _heartbeats.add(recorder)


class MemoryRecorder(Recorder):
    """Same interface, events kept in a list: the floor the journal's overhead is measured by."""

    def __init__(self, state: State | None = None) -> None:
        self.events: list[ev.Event] = []
        self.run_id = "memory"
        self.state = state or State()
        self.head = 0

    def append(self, events: Sequence[ev.Event]) -> State:
        s = self.state
        for e in events:
            s = apply(s, e)
        self.events.extend(events)
        self.head += len(events)
        self.state = s
        return s

    def flush(self) -> None:
        pass
