"""`car attribute` against hostile input: option values past any use are usage errors that
write nothing, and the text a model answered is printed as text in the ranked tables (never
obeyed by the terminal, never read as markup)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from journal_helpers import car
from llm_helpers import completion, scripted_server

from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal


@pytest.fixture(scope="module")
def heist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A journal with the seed-7 heist (it fails)."""
    path = tmp_path_factory.mktemp("attribute-hostile") / "j.db"
    with Journal(path) as j:
        run = record_heist(j, SimPolicy(), seed=7).run_id
    return path, run


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seed", "-1"], "'--seed'"),
        (["--seed", str(2**63)], "'--seed'"),
        (["--runs", "100001"], "'--runs'"),
        (["--method", "shapley", "--budget", str(10**8)], "'--budget'"),
        (["--half-width", "1e-300"], "'--half-width': target half-width 1e-300 is out of reach"),
    ],
    ids=["seed -1", "seed 2**63", "runs 100001", "budget 10**8", "half-width 1e-300"],
)
def test_option_values_past_any_use_are_usage_errors(
    heist: tuple[Path, str], argv: list[str], message: str
) -> None:
    """--seed -1 ended in a traceback (ValueError from the seed stream, after the forward
    model had been opened); a seed past 2**63 - 1, K past 100,000 runs per step and a budget
    past 10,000,000 were taken as given, each forward run a journaled branch, and a half-width
    no number of runs reaches was refused as if the run were at fault (exit 1). All are
    refused on one line, exit 2, with the journal unchanged."""
    journal, run = heist
    with Journal(journal, create=False) as j:
        before = len(j.runs())
    res = car(journal, "attribute", run, *argv)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], lines
    with Journal(journal, create=False) as j:
        assert len(j.runs()) == before


HOSTILE = "[/] a\x1b]0;PWNED\x07\x1b[2J [blink]x"


def hostile(request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Every agent of the crew answers with escape sequences and rich markup."""
    return 200, completion(HOSTILE)


@pytest.mark.parametrize(
    "argv",
    [["--runs", "2"], ["--method", "shapley", "--budget", "120"]],
    ids=["contrastive", "shapley"],
)
def test_hostile_messages_are_printed_as_text(tmp_path: Path, argv: list[str]) -> None:
    """A message holding `[/]` made the ranked table raise rich's MarkupError once every
    forward run had been spent (a traceback, exit 1), and one holding escape sequences went
    to the terminal raw. Now the table shows both as text, and --json carries the message as
    the model sent it."""
    journal = tmp_path / "j.db"
    with scripted_server(hostile) as server:
        res = car(
            journal,
            "heist",
            "--policy",
            "openai",
            "--base-url",
            server.url,
            "--model",
            "m",
            "--rounds",
            "1",
            "--seed",
            "1",
        )
        assert res.returncode == 0, res.stderr[-2000:]
        with Journal(journal, create=False) as j:
            (run,) = [r.run_id for r in j.runs()]
        res = car(journal, "attribute", run, *argv)
        assert res.returncode == 0, res.stderr[-2000:]
        for raw in ("\x1b", "\x07"):
            assert raw not in res.stdout and raw not in res.stderr
        assert "[/] a\\x1b]0;PWNED\\x07\\x1b[2J" in res.stdout, res.stdout
        data = json.loads(car(journal, "attribute", run, *argv, "--json").stdout)
    assert {r["message"] for r in data["ranked"]} == {HOSTILE}
