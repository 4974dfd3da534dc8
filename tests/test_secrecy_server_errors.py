"""What a model server writes in an error reply stays out of every public view: it may quote
the request, or count its tokens, and the mole's request holds its secret instructions."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from journal_helpers import car
from llm_helpers import completion, scripted_server

from engine.journal import Journal
from engine.public import public_events


def _openai_heist(journal: Path, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """A one-round heist (seed 3) of the openai policy against the model server at `url`."""
    return car(
        journal, "heist", "--policy", "openai", "--base-url", url, "--model", "m",
        "--rounds", "1", "--seed", "3", *extra,
    )  # fmt: skip


def _quote_the_prompt(request: dict[str, Any], calls: list[int] = []) -> tuple[int, dict[str, Any]]:  # noqa: B006
    """Answer the first turn, then refuse the next with a 400 whose message quotes the request's
    system prompt (as a server's validation error may)."""
    calls.append(1)
    if len(calls) == 1:
        return 200, completion("Checking the guard rota.")
    system = request["messages"][0]["content"]
    return 400, {"error": {"message": f"context too long (2300 tokens): {system}"}}


def test_a_server_error_is_public_without_its_words(tmp_path: Path) -> None:
    """A heist whose model server refuses a step with a message quoting the request: `car
    heist`'s error line and the public events (the server's stream, the detector) keep the
    status (HTTP 400) but not the message, `car show`, its --json and `car export` hold none
    of it; `car show --reveal` has it whole."""
    journal = tmp_path / "j.db"
    with scripted_server(_quote_the_prompt) as server:
        res = _openai_heist(journal, server.url)
    assert res.returncode == 1
    assert "HTTP 400" in res.stderr and "context too long" not in res.stderr
    with Journal(journal, create=False) as j:
        (run,) = [r.run_id for r in j.runs()]
    with Journal(journal, create=False) as j:
        (ended,) = [e for _seq, e in public_events(j, run) if e["kind"] == "run_ended"]
    assert ended["status"] == "failed" and "HTTP 400" in ended["error"]
    assert "context too long" not in ended["error"]
    for args in (["show", run], ["show", run, "--json"], ["export", run]):
        out = car(journal, *args)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() and "context too long" not in out.stdout, args
    revealed = car(journal, "show", run, "--reveal")
    assert "context too long (2300 tokens)" in revealed.stdout
    # `car show` says why the run failed (it said nothing), in the public words only
    shown = car(journal, "show", run).stdout
    assert "failed: LLM server" in shown and "answered HTTP 400 (its message is shown" in shown
    shown_json = json.loads(car(journal, "show", run, "--json").stdout)
    assert "HTTP 400" in shown_json["error"] and "context too long" not in shown_json["error"]
    assert "failed: LLM server" in revealed.stdout


def _refuse(request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    system = request["messages"][0]["content"]
    return 400, {"error": {"message": f"context too long (2300 tokens): {system}"}}


def _answer(_request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return 200, completion("Checking the guard rota.")


def test_a_forks_report_holds_the_status_not_the_servers_words(tmp_path: Path) -> None:
    """A fork whose branches run against a server that refuses with a message quoting the
    request: the report (what the server's API answers before any verdict) and `car fork`'s
    lines keep the status, not the message; the branch's own journal keeps it whole."""
    journal = tmp_path / "j.db"
    with scripted_server(_answer) as good:
        res = _openai_heist(journal, good.url, "--json")
        assert res.returncode == 0, res.stderr
    run = res.stdout.split('"run_id": "')[1].split('"')[0]
    with scripted_server(_refuse) as bad:
        for extra in ([], ["--json"]):
            forked = car(
                journal,
                "fork",
                run,
                "--at",
                "2",
                "--do",
                "resample",
                "-n",
                "1",
                "--base-url",
                bad.url,
                *extra,
            )
            assert "HTTP 400" in forked.stdout + forked.stderr, forked.stdout + forked.stderr
            assert "context too long" not in forked.stdout + forked.stderr


def _echo_the_prompt(request: dict[str, Any], calls: list[int] = []) -> tuple[int, dict[str, Any]]:  # noqa: B006
    """Answer the first turn, then reply 200 with no completion but an echo of the request's
    system prompt (a misconfigured endpoint)."""
    calls.append(1)
    if len(calls) == 1:
        return 200, completion("Checking the guard rota.")
    return 200, {"echo": request["messages"][0]["content"]}


def test_a_reply_that_is_no_completion_is_public_without_its_bytes(tmp_path: Path) -> None:
    """The error of a reply that is no completion quoted its first 120 bytes and their count:
    an endpoint that echoes the request put the acting agent's system prompt (the mole's
    holds its instructions) into the public error. The public views keep what was wrong
    ("returned a malformed completion"), not the bytes; --reveal has them."""
    journal = tmp_path / "j.db"
    with scripted_server(_echo_the_prompt) as server:
        res = _openai_heist(journal, server.url)
    assert res.returncode == 1 and "malformed completion" in res.stderr, res.stderr
    assert "You are" not in res.stderr and "received" not in res.stderr, res.stderr
    with Journal(journal, create=False) as j:
        (run,) = [r.run_id for r in j.runs()]
        (ended,) = [e for _seq, e in public_events(j, run) if e["kind"] == "run_ended"]
    assert "malformed completion" in ended["error"] and "You are" not in ended["error"]
    for args in (["show", run], ["show", run, "--json"], ["export", run]):
        out = car(journal, *args)
        assert out.returncode == 0 and "received" not in out.stdout, args
    assert "received" in car(journal, "show", run, "--reveal").stdout
