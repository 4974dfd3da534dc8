"""The recorder: the one door through which a run's events reach the journal.

It keeps the run's current state by folding exactly the events it appends (so the runtime acts
on the same s_k that a later replay rebuilds), and writes snapshots as the run grows."""

from __future__ import annotations

from collections.abc import Sequence

from engine import events as ev
from engine.journal import Journal
from engine.state import FOLD_VERSION, SNAPSHOT_EVERY, State, apply, encode_state


class Recorder:
    """Appends whole steps atomically and tracks (head, state) of one run."""

    def __init__(self, journal: Journal, run_id: str, state: State, head: int) -> None:
        self.journal = journal
        self.run_id = run_id
        self.state = state
        self.head = head

    def append(self, events: Sequence[ev.Event]) -> State:
        """Append one step's events in one transaction; return the state after them."""
        snapshots: list[tuple[int, bytes]] = []
        s = self.state
        for e in events:
            s = apply(s, e)
            if s.seq % SNAPSHOT_EVERY == 0:
                snapshots.append((s.seq, encode_state(s)))
        self.head = self.journal.append(self.run_id, events, self.head)
        self.state = s
        for seq, blob in snapshots:
            self.journal.put_snapshot(self.run_id, seq, FOLD_VERSION, blob)
        return s


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
