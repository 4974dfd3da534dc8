"""The server's read of a run before the verdict: `engine.public`, with each event's seq in it.

The stream's `id` is the journal seq; the dashboard also keeps it in the event's data, so an
event stored in the browser and replayed after a reload knows where it came from."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine import public
from engine.journal import Journal


def public_events(
    journal: Journal, run_id: str, after_seq: int = -1
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(seq, event) for every public event of the run's history with seq > after_seq."""
    for seq, data in public.public_events(journal, run_id, after_seq):
        yield seq, {"seq": seq, "step": None, **data}
