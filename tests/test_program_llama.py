"""The three-agent example against the real llama.cpp server (SmolLM2-135M): recorded,
replayed at fidelity 1.0, forked and attributed, as the README shows it. These assert the
plumbing, never the model's words (another CPU samples other words)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import events as ev
from engine.journal import Journal
from engine.program import wire

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = [sys.executable, str(ROOT / "examples" / "three_agents.py")]
CHECK = f"{sys.executable} {ROOT / 'examples' / 'check.py'}"


def car(journal: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["THREE_AGENTS_OUT"] = str(out)
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )


@pytest.fixture(scope="module")
def recorded(llama_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("program-llama")
    journal = tmp / "j.db"
    r = car(journal, tmp / "out.json", "record", "--base-url", llama_base_url,
            "--outcome", CHECK, "--json", "--", *EXAMPLE, "--stream")  # fmt: skip
    assert r.returncode == 0, r.stderr
    return journal, json.loads(r.stdout)["run_id"]


def test_record_against_llama(recorded: tuple[Path, str], llama_base_url: str) -> None:
    """Four calls of three agents are journaled with the server's fingerprint and usage; the
    forced calculator call becomes a tool_call with the program's tool_result."""
    journal, run_id = recorded
    with Journal(journal) as j:
        events = j.events(run_id)
    calls = [e for e in events if isinstance(e, ev.LlmCall)]
    assert [c.agent for c in calls] == ["planner", "solver", "solver", "agent-1"]
    assert all(c.server == llama_base_url for c in calls)
    # usage arrives with non-streamed replies (a stream carries it only when asked to)
    assert all(c.completion_tokens > 0 for c in calls[:-1])
    assert wire.params_of(calls[-1].request)["stream"] is True
    tools = [e for e in events if isinstance(e, ev.ToolCall)]
    results = [e for e in events if isinstance(e, ev.ToolResult)]
    assert [t.tool for t in tools] == ["calculator"] and len(results) == 1
    end = events[-1]
    assert isinstance(end, ev.RunEnded) and end.status == "completed"
    assert end.outcome["exit_status"] == 0 and end.outcome["outcome_status"] in (0, 1)


def test_replay_at_fidelity_one(recorded: tuple[Path, str], tmp_path: Path) -> None:
    """The deterministic program replays from the journal at fidelity 1.0 with the recorded
    outcome (no server needed: every answer comes from the journal)."""
    journal, run_id = recorded
    r = car(journal, tmp_path / "out.json", "replay", run_id, "--json", "--", *EXAMPLE, "--stream")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["fidelity"] == 1.0 and report["exact_match_rate"] == 1.0
    assert report["replayed_calls"] == 4 and report["outcome_match"] is True


def test_fork_and_attribute(recorded: tuple[Path, str], tmp_path: Path) -> None:
    """`car fork --at 3 --do resample` makes scored child runs; `car attribute -- CMD` ranks
    the calls with forward runs that are journaled branches (when the recording failed)."""
    journal, run_id = recorded
    out = tmp_path / "out.json"
    r = car(journal, out, "fork", run_id, "--at", "3", "--do", "resample", "-n", "2", "--json",
            "--", *EXAMPLE, "--stream")  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["scored"] == 2 and len(report["branches"]) == 2
    with Journal(journal) as j:
        kids = {c.run_id for c in j.children(run_id)}
        assert {b["run_id"] for b in report["branches"]} <= kids
        factual_bad = j.events(run_id)[-1].outcome["bad"]  # type: ignore[attr-defined]
    r = car(journal, out, "attribute", run_id, "--runs", "2", "--json", "--", *EXAMPLE, "--stream")
    if not factual_bad:
        # the model happened to answer right: attribution refuses a good run in one line
        assert r.returncode == 1 and "did not fail" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["forward_runs"] >= 2 and data["branches_added"] >= 1
    assert {row["step"] for row in data["ranked"]} <= {0, 1, 2, 3}
