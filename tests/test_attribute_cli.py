"""`car validate` and `car attribute` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.branching import attribute
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal

ROOT = Path(__file__).resolve().parent.parent


def car(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], capture_output=True, text=True, cwd=ROOT
    )


USER_MODEL = """
name: two_gates
description: a user's model; the audit step only matters when the transfer was risky
steps:
  - name: transfer
    p: 0.4
    agent: teller
  - name: audit_skipped
    p: "0.9 if transfer else 0.1"
    agent: auditor
  - name: log
    p: 0.5
bad: "transfer and audit_skipped"
factual: [1, 1, 0]
"""


def test_validate_builtins_and_user_file(tmp_path: Path) -> None:
    """validate passes on the built-in models and a user-written file, estimates beside truth."""
    f = tmp_path / "two_gates.yaml"
    f.write_text(USER_MODEL)
    res = car("validate", str(f), "--seed", "3", "--json")
    assert res.returncode == 0, res.stderr
    reports = {r["scm"]: r for r in json.loads(res.stdout)}
    assert {"refund_pivot", "and_interaction", "two_gates"} <= set(reports)
    r = reports["two_gates"]
    assert set(r) >= {"scm", "locus", "shapley", "efficiency", "forward_runs"}
    assert r["locus"]["estimated"] == r["locus"]["exact"] == 1
    assert all(p["ci"][0] <= p["exact"] <= p["ci"][1] for p in r["shapley"])
    and_model = reports["and_interaction"]
    exact = {p["player"]: round(p["exact"], 3) for p in and_model["shapley"]}
    assert sorted(exact.values()) == [0.0, 0.455, 0.455]
    assert and_model["efficiency"]["exact"] == pytest.approx(0.91)


def test_validate_agents_players(tmp_path: Path) -> None:
    """With --players agents an agent's steps form one player, with exact values to compare."""
    f = tmp_path / "m.yaml"
    f.write_text(USER_MODEL)
    # one seed: coverage over many seeds is tested in test_attribution_stats.py
    res = car("validate", str(f), "--no-builtin", "--players", "agents", "--seed", "3", "--json")
    assert res.returncode == 0, res.stderr
    (r,) = json.loads(res.stdout)
    assert {p["player"] for p in r["shapley"]} == {"teller", "auditor", "log"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: x\nsteps: [{name: a, p: 2}]\nbad: a\nfactual: [1]\n", "p"),
        ("name: x\nsteps: [{name: a, p: 'b ** 2'}]\nbad: a\nfactual: [1]\n", "'a'"),
        ("name: x\nsteps: [{name: a, p: 0.5}]\nbad: a\nfactual: [0]\n", "bad"),
        ("name: x\nsteps: [{name: a, p: 0.5}\n", "line"),
    ],
)
def test_validate_bad_model_one_line(tmp_path: Path, text: str, message: str) -> None:
    """A malformed model file gives one error line naming what is wrong, exit status 1."""
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    res = car("validate", str(f), "--no-builtin")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], lines


def failed_heist(j: Journal) -> str:
    for seed in range(100, 200):
        r = record_heist(j, SimPolicy(), seed=seed, strategy="FALSE_INFO")
        if r.outcome.get("bad"):
            return r.run_id
    raise AssertionError("no failed heist in 100 seeds")


def test_attribute_contrastive_on_a_heist(tmp_path: Path) -> None:
    """Contrastive attribution ranks steps, names a locus whose interval excludes zero, and
    counts its forward runs, each a journaled branch."""
    with Journal(tmp_path / "j.db") as j:
        run = failed_heist(j)
        data = attribute(j, run, method="contrastive", k=24, seed=1, all_steps=True)
        assert data["forward_runs"] == 24 * 24
        assert len(j.children(run)) <= data["forward_runs"]
        locus = data["locus"]
        ranked = {r["step"]: r for r in data["ranked"]}
        assert locus is not None
        assert ranked[locus]["ci"][1] < 0
        assert all(not ranked[s]["rescues"] for s in ranked if s > locus)
        assert j.verify().ok


def test_attribute_shapley_agents_budget(tmp_path: Path) -> None:
    """Shapley over agents stays within its budget and reports the efficiency check."""
    with Journal(tmp_path / "j.db") as j:
        run = failed_heist(j)
        data = attribute(j, run, method="shapley", players="agents", budget=400, seed=2)
    assert data["forward_runs"] <= 400
    assert {r["player"] for r in data["ranked"]} == {
        "planner",
        "hacker",
        "safecracker",
        "intel",
        "driver",
        "lookout",
    }
    assert set(data["efficiency"]) >= {"sum_phi", "v_all", "v_none", "difference"}


def test_attribute_cli_json(tmp_path: Path) -> None:
    """`car attribute --json` carries the ranked table, locus and forward runs."""
    jp = tmp_path / "j.db"
    with Journal(jp) as j:
        run = failed_heist(j)
    res = car("--journal", str(jp), "attribute", run, "--runs", "8", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert set(data) >= {"run_id", "method", "ranked", "locus", "forward_runs"}
    bad = car("--journal", str(jp), "attribute", run, "--method", "magic")
    assert bad.returncode == 2 and "'magic' is not one of" in bad.stderr
