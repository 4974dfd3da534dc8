"""`car runs` says "ok" only for a run whose outcome says it is not bad: a run that ended
failed or stopped with an outcome that holds no verdict (a recorded program whose upstream
failed) showed "ok" in the table while `--json` said `"bad": null`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from journal_helpers import car

from engine import events as ev
from engine.journal import Journal


@pytest.mark.parametrize(
    ("status", "outcome", "shown"),
    [
        ("failed", {"bad": None, "score": None}, ""),
        ("stopped", {}, ""),
        ("completed", {"bad": False, "score": 1.0}, "ok"),
        ("completed", {"bad": True, "score": 0.2}, "bad"),
    ],
)
def test_outcome_column(
    tmp_path: Path, status: str, outcome: dict[str, object], shown: str
) -> None:
    """The table's outcome cell agrees with --json's `bad`: ok, bad, or empty for none."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = j.create_run("program")
        j.append(run, [ev.RunEnded(status=status, outcome=outcome)], 0)
    rows = json.loads(car(path, "runs", "--json").stdout)
    assert [r["status"] for r in rows] == [status]
    table = car(path, "runs").stdout.splitlines()
    (row,) = [line for line in table if line.strip().startswith(run)]
    cells = row.split()
    assert cells[1:3] == ["0", status]
    assert cells[3:4] == ([shown] if shown else ["0"])  # then forks
