"""Live public events of runs, fanned out to any number of SSE clients.

One feed per run that somebody watches: a single task reads the journal's new public events and
appends them to the feed's list; every client walks that list with its own cursor. So ten or
fifty browsers cost one journal read per change, see the same events in the same order, and a
client resuming after `Last-Event-ID = seq` starts at the first event with a larger seq: no gap,
no repeat.

The feed wakes up when this process appends to the run (`NotifyingJournal`) and otherwise polls,
so a heist recorded by another process (`car heist` in a terminal) streams too.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from engine import events as ev
from engine.journal import Journal
from engine.logging import get_logger
from engine.server.public_feed import public_events

log = get_logger("car.server.stream")

POLL_SECONDS = 0.25
LIVE_STATUSES = frozenset({"recording", "paused"})


class NotifyingJournal(Journal):
    """A journal that tells listeners which run it appended to, after the commit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._listeners: list[Callable[[str], None]] = []
        self._listeners_lock = threading.Lock()

    def add_listener(self, fn: Callable[[str], None]) -> None:
        with self._listeners_lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[str], None]) -> None:
        with self._listeners_lock, contextlib.suppress(ValueError):
            self._listeners.remove(fn)

    def append(
        self,
        run_id: str,
        events: Sequence[ev.Event],
        expected_seq: int | None = None,
        *,
        payloads: Sequence[bytes] | None = None,
    ) -> int:
        head = super().append(run_id, events, expected_seq, payloads=payloads)
        with self._listeners_lock:
            listeners = list(self._listeners)
        for fn in listeners:
            fn(run_id)
        return head


def sse_frame(seq: int, data: dict[str, Any]) -> bytes:
    """One SSE message: id = the journal seq, data = the event as one line of JSON."""
    return f"id: {seq}\ndata: {json.dumps(data)}\n\n".encode()


class RunFeed:
    """The public events of one live run read so far, shared by every client watching it.
    Each event is encoded once, as its SSE frame, however many clients send it."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.events: list[tuple[int, bytes]] = []
        self.seqs: list[int] = []
        self.scanned = -1  # every public event with seq <= scanned is in `events`
        self.finished = False
        self.ready = False
        self.changed = asyncio.Condition()
        self.wake = asyncio.Event()
        self.clients = 0
        self.task: asyncio.Task[None] | None = None

    def index_after(self, seq: int) -> int:
        return bisect.bisect_right(self.seqs, seq)


class StreamHub:
    """Feeds of live runs, created when a client arrives, dropped when the run ends."""

    def __init__(self, journal: Journal, poll_seconds: float = POLL_SECONDS) -> None:
        self.journal = journal
        self.poll_seconds = poll_seconds
        self._feeds: dict[str, RunFeed] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        if isinstance(journal, NotifyingJournal):
            journal.add_listener(self._appended)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def _appended(self, run_id: str) -> None:
        """Called in the writer's thread after a commit."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._wake, run_id)

    def _wake(self, run_id: str) -> None:
        feed = self._feeds.get(run_id)
        if feed is not None:
            feed.wake.set()
        # an append to a branch shows in the lineage of its descendants only, which are never
        # live while the parent records; nothing else to wake

    async def close(self) -> None:
        for feed in list(self._feeds.values()):
            if feed.task is not None:
                feed.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await feed.task
        self._feeds.clear()

    # ------------------------------------------------------------------ reading

    def _read_new(self, run_id: str, after: int) -> tuple[list[tuple[int, dict[str, Any]]], int]:
        """Public events after `after`, and the last seq the read covered."""
        head = self.journal.head(run_id)
        got = [(s, e) for s, e in public_events(self.journal, run_id, after) if s < head]
        return got, max(head - 1, after)

    def _status(self, run_id: str) -> str:
        return self.journal.status(run_id)

    async def _follow(self, feed: RunFeed) -> None:
        """The one reader of a live run: journal -> feed, until the run has ended."""
        try:
            while True:
                new, scanned = await asyncio.to_thread(self._read_new, feed.run_id, feed.scanned)
                ended = any(e["kind"] == "run_ended" for _, e in new)
                if not new and not ended:
                    # nothing new: a run whose writer is gone without closing it is over too
                    ended = await asyncio.to_thread(self._status, feed.run_id) not in LIVE_STATUSES
                    if ended:  # one last read: the closing events may have landed meanwhile
                        new, scanned = await asyncio.to_thread(
                            self._read_new, feed.run_id, feed.scanned
                        )
                frames = [(seq, sse_frame(seq, data)) for seq, data in new]
                async with feed.changed:
                    for seq, frame in frames:
                        feed.events.append((seq, frame))
                        feed.seqs.append(seq)
                    feed.scanned = scanned
                    feed.ready = True
                    feed.finished = ended
                    feed.changed.notify_all()
                if ended:
                    return
                feed.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(feed.wake.wait(), self.poll_seconds)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a reader that dies must not leave its clients hanging
            log.error("feed reader failed", run_id=feed.run_id, error=str(e))
            async with feed.changed:
                feed.finished = True
                feed.ready = True
                feed.changed.notify_all()
        finally:
            if self._feeds.get(feed.run_id) is feed:
                del self._feeds[feed.run_id]

    def _feed(self, run_id: str) -> RunFeed:
        feed = self._feeds.get(run_id)
        if feed is None or feed.finished:
            feed = RunFeed(run_id)
            self._feeds[run_id] = feed
            feed.task = asyncio.get_running_loop().create_task(self._follow(feed))
        return feed

    async def frames(self, run_id: str, after: int = -1) -> AsyncIterator[tuple[int, bytes]]:
        """SSE frames of every public event of the run with seq > after, live until the run
        has ended: (last seq in the chunk, the chunk). Events that arrived together go out
        as one chunk (one write per client, however many events)."""
        status = await asyncio.to_thread(self._status, run_id)
        if status not in LIVE_STATUSES:
            # a finished run: its whole history, then the end
            history = await asyncio.to_thread(
                lambda: list(public_events(self.journal, run_id, after))
            )
            for lo in range(0, len(history), 200):
                part = history[lo : lo + 200]
                yield part[-1][0], b"".join(sse_frame(q, d) for q, d in part)
            return
        feed = self._feed(run_id)
        feed.clients += 1
        try:
            i: int | None = None
            while True:
                async with feed.changed:
                    while (
                        feed.ready and i is not None and i >= len(feed.events) and not feed.finished
                    ):
                        await feed.changed.wait()
                    if not feed.ready:
                        await feed.changed.wait()
                        continue
                    if i is None:
                        i = feed.index_after(after)
                    batch = feed.events[i:]
                    finished = feed.finished
                i += len(batch)
                if batch:
                    yield batch[-1][0], b"".join(frame for _, frame in batch)
                if finished and i >= len(feed.events):
                    break
            # the feed stops at the run's end; an accusation made meanwhile is history
            last = feed.seqs[-1] if feed.seqs else after
            tail = await asyncio.to_thread(
                lambda: list(public_events(self.journal, run_id, max(last, after)))
            )
            if tail:
                yield tail[-1][0], b"".join(sse_frame(q, d) for q, d in tail)
        finally:
            feed.clients -= 1
