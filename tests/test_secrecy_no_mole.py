"""Whether a game has a mole is part of the secret: a game without one journals an empty
secret event, so that nothing public (which events exist, their seqs, the stream's ids) tells
the two apart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.detect.evaluate import truth
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal
from engine.public import public_events
from engine.state import state_at_seq

ROOT = Path(__file__).resolve().parent.parent


def car(journal: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), *args],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip


def test_a_game_without_a_mole_has_the_public_seqs_of_one_with_a_mole(tmp_path: Path) -> None:
    """Seed 5 with a mole and without one: the public events come at the same seqs, both
    runs hold the same number of events, and the stream ids (seqs) cannot tell them apart."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        with_mole = record_heist(j, SimPolicy(), seed=5, rounds=2, mole="intel").run_id
        without = record_heist(j, SimPolicy(), seed=5, rounds=2, no_mole=True).run_id
        seqs = [[seq for seq, _e in public_events(j, r)][:8] for r in (with_mole, without)]
        assert seqs[0] == seqs[1]
        assert j.head(with_mole) == j.head(without)
        assert truth(j, without) is None and truth(j, with_mole) is not None
        final = state_at_seq(j, without, j.head(without))
        assert not any(c.secret for c in final.contexts.values())
        assert "" not in final.contexts


def test_reveal_and_accuse_of_a_game_without_a_mole(tmp_path: Path) -> None:
    """`car show --reveal` says there is no mole; `car accuse` refuses in one line; without
    --reveal nothing says either way."""
    path = tmp_path / "j.db"
    res = car(path, "heist", "--seed", "5", "--rounds", "1", "--no-mole", "--json")
    assert res.returncode == 0, res.stderr
    run = json.loads(res.stdout)["run_id"]
    shown = car(path, "show", run, "--reveal")
    assert "secret: no mole" in shown.stdout
    public = car(path, "show", run)
    assert "secret" not in public.stdout and "no mole" not in public.stdout
    accused = car(path, "accuse", run, "intel")
    assert accused.returncode == 1 and "has no mole to accuse" in accused.stderr
