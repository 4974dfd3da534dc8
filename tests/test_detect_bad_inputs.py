"""`car detect` and `car detect-eval` given odd or hostile values, as a user types them: one
`error:` line and a non-zero exit, no traceback, nothing half-written in the journal; and no
answer that reads as measured when it was not (a confident suggestion drawn from a tie)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from journal_helpers import car
from llm_helpers import completion, scripted_server
from servers import free_port

from engine.detect import analyze
from engine.detect.analysis import DetectError
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal


def one_error_line(proc: subprocess.CompletedProcess[str], code: int | None = None) -> str:
    assert proc.returncode != 0 and (code is None or proc.returncode == code), proc.stderr
    assert proc.stderr.startswith("error: "), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def run_ids(journal: Path) -> list[str]:
    with Journal(journal, create=False) as j:
        return [r.run_id for r in j.runs()]


@pytest.fixture(scope="module")
def game(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("bad") / "j.db"
    with Journal(path) as j:
        rid = record_heist(j, SimPolicy(), seed=5, mole="intel", strategy="FALSE_INFO").run_id
    return path, rid


@pytest.mark.parametrize("value", ["inf", "1e300", "86401"])
def test_llm_timeout_out_of_range_is_one_line(game: tuple[Path, str], value: str) -> None:
    """--timeout inf (or one past what a socket takes) once ended in an OverflowError
    traceback from deep in the HTTP client."""
    path, rid = game
    url = f"http://127.0.0.1:{free_port()}/v1"
    proc = car(path, "detect", rid, "-m", "llm", "--base-url", url, "--timeout", value)
    assert "'--timeout'" in one_error_line(proc, 2)


@pytest.mark.parametrize("value", [str(2**64), str(2**63), "-1"])
def test_seed_out_of_range_writes_nothing(tmp_path: Path, value: str) -> None:
    """A --seed the journal cannot store once left an abandoned, empty detection run behind
    (its RunStarted was refused after the run row was made); now it is refused up front."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        rid = record_heist(j, SimPolicy(), seed=5, rounds=1).run_id
    url = f"http://127.0.0.1:{free_port()}/v1"
    proc = car(
        path, "detect", rid, "-m", "llm", "--base-url", url, "--timeout", "1", "--seed", value
    )
    assert "'--seed'" in one_error_line(proc, 2)
    assert run_ids(path) == [rid]
    with Journal(path) as j:  # the library call is refused the same way, before any write
        with pytest.raises(DetectError, match="seed"):
            analyze(j, rid, method="llm", base_url=url, timeout=1.0, seed=2**64)
        assert [r.run_id for r in j.runs()] == [rid]


def test_llm_seed_zero_is_the_seed_sent(tmp_path: Path) -> None:
    """--seed 0 was read as "no seed" and replaced by the run's derived seed."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        rid = record_heist(j, SimPolicy(), seed=5, rounds=1).run_id
    seeds: list[Any] = []

    def reply(request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        seeds.append(request.get("seed"))
        return 200, completion('{"planner": 0.5}')

    with scripted_server(reply) as server:
        proc = car(
            path, "detect", rid, "-m", "llm", "--base-url", server.url, "--seed", "0", "--json"
        )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["llm"]["seed"] == 0 and seeds == [0]


def test_causal_k_max_below_the_default_k_min(game: tuple[Path, str]) -> None:
    """--k-max 2 once failed with "needs 1 <= k_min <= k_max, got 4, 2": a k_min the user
    never set. A cap below the default minimum is a cap."""
    path, rid = game
    proc = car(path, "detect", rid, "-m", "causal", "--k-max", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert all(c["runs"] <= 2 for c in d["causal"].values()) and d["forward_runs"] <= 12


def test_a_tie_at_the_top_is_not_a_confident_suggestion(tmp_path: Path) -> None:
    """replay on a game with no mole: every agent matches its reference, all six tie, and the
    suggestion is the tiebreak hash's. It was reported with confidence 0.99; a pick among t
    tied agents is right with probability at most 1/t."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        rid = record_heist(j, SimPolicy(), seed=5, no_mole=True).run_id
    proc = car(path, "detect", rid, "-m", "replay", "--reveal", "--json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert len(set(d["suspicion_scores"].values())) == 1
    assert d["confidence"] <= 1 / 6 + 1e-4


def test_replay_with_every_step_failing_is_an_error(tmp_path: Path) -> None:
    """replay of a model-played run against a server that refuses every call: no agent was
    re-executed once, yet it answered exit 0 with a suggested mole (the tiebreak) at 0.99."""
    path = tmp_path / "j.db"

    def plays(_: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 200, completion("Checking. [TOOL:calculator:2*3]")

    def refuses(_: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 400, {"error": {"message": "bad request"}}

    with scripted_server(plays) as server:
        rec = car(path, "heist", "--policy", "openai", "--base-url", server.url, "--model", "m",
                  "--seed", "3", "--rounds", "1", "-q")  # fmt: skip
    assert rec.returncode == 0, rec.stderr
    (rid,) = run_ids(path)
    with scripted_server(refuses) as server:
        proc = car(path, "detect", rid, "-m", "replay", "--reveal", "--base-url", server.url)
    err = one_error_line(proc, 1)
    assert "every re-executed step failed (6 of 6)" in err and "HTTP 400" in err
    assert proc.stdout == ""


def test_detect_eval_checks_everything_before_recording(tmp_path: Path) -> None:
    """A misspelt method, or --executor ray on a SQLite journal, was found only after the games
    had been recorded: the journal kept N games of an evaluation that never ran."""
    path = tmp_path / "e.db"
    proc = car(path, "detect-eval", "-n", "2", "-m", "rules", "-m", "bogus")
    assert "unknown detection method 'bogus'" in one_error_line(proc, 1)
    assert not path.exists()
    proc = car(path, "detect-eval", "-n", "1", "-m", "causal", "--executor", "ray")
    assert "needs a PostgreSQL journal" in one_error_line(proc, 1)
    assert not path.exists()  # said before the journal is opened: no file made for it


def test_detect_eval_scores_a_game_once(tmp_path: Path) -> None:
    """The same run given twice (by id and by prefix) was scored as two games: 2/2 hits."""
    path = tmp_path / "e.db"
    proc = car(path, "detect-eval", "-n", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    (rid,) = run_ids(path)
    proc = car(path, "detect-eval", "--runs", rid, "--runs", rid[:8])
    assert f"run '{rid}' is given twice" in one_error_line(proc, 1)
    proc = car(path, "detect-eval", "--runs", rid, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["games"] == 1


def test_a_refused_detection_record_leaves_no_run(tmp_path: Path) -> None:
    """journal_llm_step made the run row first and appended its events one by one: an event the
    journal refused (here a seed msgpack cannot hold) left an empty run, listed as abandoned."""
    from engine.detect.journaling import journal_llm_step
    from engine.errors import JournalError

    with Journal(tmp_path / "j.db") as j:
        rid = record_heist(j, SimPolicy(), seed=5, rounds=1).run_id
        with pytest.raises(JournalError, match="refusing to journal"):
            journal_llm_step(
                j, rid, method="llm", base_url="http://127.0.0.1:9/v1", model="m", seed=2**64,
                prompt=[{"role": "user", "content": "x"}], answer=None, error="unreachable",
                scores=None, warnings=[],
            )  # fmt: skip
        assert [r.run_id for r in j.runs()] == [rid]
