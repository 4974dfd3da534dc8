"""Every `car` command pointed at a run `car import` made: it works, or it refuses in one
`error:` line (the API: one JSON error) that says the run was imported and has no program to
re-run, and what reads it instead; never "unknown scenario", never a traceback, and nothing
written to the journal by the refusal."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from journal_helpers import car
from otel_helpers import chat_trace
from server_helpers import car_serve

from engine.errors import UnknownScenario
from engine.journal import Journal
from engine.otel.imported import NotReRunnable

AGENTS = ("alice", "bob", "carol")
REFUSAL = "was imported from a trace and has no program to re-run"


@pytest.fixture
def imported(tmp_path: Path) -> tuple[Path, str]:
    """A journal holding one imported run of three agents, and the run's id."""
    journal, trace = tmp_path / "j.db", tmp_path / "t.json"
    trace.write_text(chat_trace(AGENTS))
    res = car(journal, "import", str(trace), "--json")
    assert res.returncode == 0, res.stderr
    (run,) = json.loads(res.stdout)
    return journal, str(run["run_id"])


def rows(journal: Path) -> tuple[int, int]:
    """(runs, events) in the journal file, counted straight from SQLite."""
    db = sqlite3.connect(journal)
    try:
        return (
            db.execute("SELECT count(*) FROM runs").fetchone()[0],
            db.execute("SELECT count(*) FROM events").fetchone()[0],
        )
    finally:
        db.close()


@pytest.mark.parametrize("method", ["causal", "replay"])
def test_detectors_that_rerun_the_crew_refuse_an_imported_run(
    imported: tuple[Path, str], method: str
) -> None:
    """`car detect --method causal|replay` on an imported run: one line saying it was imported
    and has no program to re-run, naming the detectors that do read it; exit 1, nothing
    written (was: "unknown scenario 'imported'" / "run is a 'imported' run, not a heist")."""
    journal, run = imported
    before = rows(journal)
    res = car(journal, "detect", run, "--method", method)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"error: run {run!r} {REFUSAL}; the {method} detector"), line
    assert "--method rules" in line and "unknown scenario" not in line, line
    assert rows(journal) == before


def test_the_rules_detector_reads_an_imported_run(imported: tuple[Path, str]) -> None:
    """What the refusal points to works: the rules detector scores the imported run's agents."""
    journal, run = imported
    res = car(journal, "detect", run, "--method", "rules", "--json")
    assert res.returncode == 0, res.stderr
    assert set(json.loads(res.stdout)["suspicion_scores"]) == set(AGENTS)


def test_no_scenario_lookup_calls_an_imported_run_unknown(imported: tuple[Path, str]) -> None:
    """The registry's answer for an imported run is NotReRunnable (naming the run when it is
    known), not UnknownScenario: every path that re-runs a run (the library's fork, the
    server's fork and attribution) refuses it the same way, and writes nothing."""
    from engine.branching import fork
    from engine.interventions import parse_intervention
    from engine.scenario import scenario_factory, scenario_of_run

    journal, run = imported
    with pytest.raises(NotReRunnable, match=REFUSAL) as info:
        scenario_factory("imported")
    assert not isinstance(info.value, UnknownScenario)
    before = rows(journal)
    with Journal(journal) as j:
        with pytest.raises(NotReRunnable, match=f"run {run!r} {REFUSAL}"):
            scenario_of_run(j, run)
        with pytest.raises(NotReRunnable, match=f"run {run!r} {REFUSAL}"):
            fork(j, run, parse_intervention("resample", 1, None), 1)
    assert rows(journal) == before


def test_the_api_refuses_to_rerun_an_imported_run(imported: tuple[Path, str]) -> None:
    """`car serve`: fork, attribution and the causal and replay analyses of an imported run
    are 409s saying it was imported (fork and attribution were 422 "unknown scenario
    'imported'"); its detail and the rules analysis work; nothing is written."""
    journal, run = imported
    before = rows(journal)
    with car_serve(journal, "--workers", "0") as server, server.client() as client:
        detail = client.get(f"/api/sessions/{run}")
        assert detail.status_code == 200 and detail.json()["scenario"] == "imported"
        refused = {
            "fork": client.post(
                f"/api/sessions/{run}/fork", json={"do": "resample", "at": 1, "n": 1}
            ),
            "attribution": client.post(f"/api/sessions/{run}/attribution"),
            **{
                method: client.post(
                    "/api/ai-detect/analyze", json={"session_id": run, "method": method}
                )
                for method in ("causal", "replay")
            },
        }
        rules = client.post("/api/ai-detect/analyze", json={"session_id": run, "method": "rules"})
    for what, r in refused.items():
        assert r.status_code == 409, (what, r.status_code, r.text)
        assert f"run {run!r} {REFUSAL}" in r.json()["error"], (what, r.text)
    assert rules.status_code == 200 and set(rules.json()["suspicion_scores"]) == set(AGENTS)
    assert rows(journal) == before


def test_replay_without_a_command_names_an_imported_run_first(
    imported: tuple[Path, str],
) -> None:
    """`car replay RUN` of an imported run said "no command to run: give it after `--`",
    although any command would then be refused: the run is judged first."""
    journal, run = imported
    res = car(journal, "replay", run)
    assert res.returncode == 1 and res.stderr.startswith("error:"), res.stderr
    assert "imported" in res.stderr and "no command" not in res.stderr, res.stderr


def test_a_detection_record_is_not_rerun(tmp_path: Path) -> None:
    """The record of a detector's model call (`car detect --method llm`) is no run of agents:
    fidelity, fork and attribute refuse it in one line (it was "unknown scenario
    'detection'"), and write nothing."""
    from engine.detect.journaling import journal_llm_step
    from engine.detect.llm import LlmAnswer

    journal = tmp_path / "j.db"
    with Journal(journal) as j:
        rid = journal_llm_step(
            j, "abc", method="llm", base_url="http://127.0.0.1:9/v1", model="m", seed=1,
            prompt=[{"role": "user", "content": "who?"}],
            answer=LlmAnswer(raw="{}", model="m", finish_reason="stop"),
            error=None, scores={}, warnings=[],
        )  # fmt: skip
    before = sqlite3.connect(journal).execute("SELECT count(*) FROM events").fetchone()
    for args in (
        ["fidelity", rid],
        ["fork", rid, "--at", "0", "--do", "resample"],
        ["attribute", rid],
    ):
        res = car(journal, *args)
        assert res.returncode == 1, (args, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "record of a detector's model call" in lines[0], res.stderr
    after = sqlite3.connect(journal).execute("SELECT count(*) FROM events").fetchone()
    assert before == after
    assert car(journal, "show", rid).returncode == 0
