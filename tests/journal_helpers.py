"""What several journal tests read straight from the SQLite file: a run's stored rows."""

from __future__ import annotations

import sqlite3
from pathlib import Path

# the events rows of a run by its public id (they carry its run_key, docs/decisions.md 41)
KEY_OF = "(SELECT run_key FROM runs WHERE run_id = ?)"


def stored_rows(path: Path, run: str) -> list[tuple[int, int, bytes]]:
    """(seq, version, payload as stored) of a run's own events, in seq order."""
    db = sqlite3.connect(path)
    try:
        return db.execute(
            f"SELECT seq, version, payload FROM events WHERE run_key = {KEY_OF} ORDER BY seq",
            (run,),
        ).fetchall()
    finally:
        db.close()
