"""The journal commands of the CLI, on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from journal_helpers import fresh_pg_database

from engine.journal import HEAD_REVISION

ROOT = Path(__file__).resolve().parent.parent


def car(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_db_path_and_upgrade(tmp_path: Path) -> None:
    """`db path` names the journal (CAR_JOURNAL honoured); `db upgrade` creates it at head."""
    target = tmp_path / "sub" / "j.db"
    res = car("db", "path", env={"CAR_JOURNAL": str(target)})
    assert res.stdout.strip() == str(target)
    assert not target.exists()
    res = car("--journal", str(target), "db", "upgrade")
    assert res.returncode == 0 and HEAD_REVISION in res.stdout
    assert target.exists()


def test_runs_show_state_json(tmp_path: Path) -> None:
    """runs, show and state speak JSON for scripts, and hide the mole unless asked."""
    j = str(tmp_path / "j.db")
    run = json.loads(car("--journal", j, "heist", "--seed", "2", "--rounds", "1", "--json").stdout)[
        "run_id"
    ]
    runs = json.loads(car("--journal", j, "runs", "--json").stdout)
    assert [r["run_id"] for r in runs] == [run] and runs[0]["status"] == "completed"
    shown = json.loads(car("--journal", j, "show", run, "--json").stdout)
    assert shown["steps"] == 6 and not any("secret" in line for line in shown["lines"])
    revealed = json.loads(car("--journal", j, "show", run, "--reveal", "--json").stdout)
    assert any("secret: mole=" in line for line in revealed["lines"])
    state = json.loads(car("--journal", j, "state", run, "--at", "4", "--json").stdout)
    assert state["step"] == 4 and state["acting_agent"] == "driver"
    assert "contexts" not in state and "seeds" not in state
    assert [a["agent"] for a in state["per_agent"]] == shown["started"]["agents"]
    revealed_state = json.loads(
        car("--journal", j, "state", run, "--at", "4", "--reveal", "--json").stdout
    )
    assert any(c.get("secret") for c in revealed_state["contexts"].values())


def test_cli_on_postgresql(pg_url: str) -> None:
    """The same commands run against a PostgreSQL journal: record, fork, verify."""
    target = fresh_pg_database(pg_url, "cli")
    res = car("--journal", target, "heist", "--seed", "4", "--rounds", "2", "--json")
    assert res.returncode == 0, res.stderr
    run = json.loads(res.stdout)["run_id"]
    fork = car(
        "--journal",
        target,
        "fork",
        run,
        "--at",
        "5",
        "--do",
        "resample",
        "-n",
        "3",
        "-c",
        "2",
        "--json",
    )
    assert fork.returncode == 0, fork.stderr
    assert len(json.loads(fork.stdout)["branches"]) == 3
    fid = json.loads(car("--journal", target, "fidelity", run, "--json").stdout)
    assert fid["action_match_rate"] == 1.0
    ok = car("--journal", target, "verify")
    assert ok.returncode == 0 and "every hash verified" in ok.stdout
