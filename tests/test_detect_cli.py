"""`car detect` and `car detect-eval` as a user runs them: output formats, errors, crews."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

import cli
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal

DATA = Path(__file__).resolve().parent / "data"
BLOG_KEYS = {
    "session_id",
    "suggested_mole",
    "confidence",
    "suspicion_scores",
    "score_breakdown",
    "analysis_weights",
    "methods_run",
    "warnings",
}


def run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli.app, list(args))
    return res.exit_code, res.output


def test_detect_json_has_the_blog_format(tmp_path: Path) -> None:
    """--json carries the blog's fields for every method; causal/replay add intervals and
    forward runs; the human table names the suggestion."""
    j = tmp_path / "j.db"
    with Journal(j) as journal:
        rid = record_heist(journal, SimPolicy(), seed=9).run_id
    for method in ("rules", "causal", "replay"):
        reveal = ["--reveal"] if method == "replay" else []  # replay reads the recorded seeds
        code, out = run("--journal", str(j), "detect", rid, "--method", method, *reveal, "--json")
        assert code == 0, out
        d = json.loads(out)
        assert set(d) >= BLOG_KEYS and d["session_id"] == rid and d["method"] == method
        assert 0.0 <= d["confidence"] <= 1.0
        for b in d["score_breakdown"].values():
            assert set(b) == {
                "tool_usage",
                "timing",
                "message_anomaly",
                "information_quality",
                "llm",
                "combined",
            }
        if method != "rules":
            assert d["forward_runs"] > 0 and set(d["intervals"]) == set(d["suspicion_scores"])
    code, out = run("--journal", str(j), "detect", rid)
    assert code == 0 and "suggested mole" in out


def test_detect_errors_are_one_line(tmp_path: Path) -> None:
    """A misspelt method or an unknown run is a clean error and a non-zero exit."""
    j = tmp_path / "j.db"
    with Journal(j) as journal:
        rid = record_heist(journal, SimPolicy(), seed=9, rounds=1).run_id
    res = CliRunner().invoke(cli.app, ["--journal", str(j), "detect", rid, "--method", "rule"])
    assert res.exit_code != 0 and "unknown detection method 'rule'" in str(res.exception)
    res = CliRunner().invoke(cli.app, ["--journal", str(j), "detect", "nope"])
    assert res.exit_code != 0
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(j), "detect", rid, "-m", "magic"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: unknown detection method 'magic'")
    assert proc.stderr.count("\n") == 1


def test_detect_eval_on_a_custom_crew(tmp_path: Path) -> None:
    """detect-eval records N games on a crew file and reports per method and per strategy:
    accuracy with its interval, the baseline 1/#agents, AUROC, Brier, reliability, confusion,
    forward runs and seconds per game; --runs re-scores recorded runs."""
    j = tmp_path / "e.db"
    code, out = run(
        "--journal",
        str(j),
        "detect-eval",
        "--games",
        "6",
        "--seed",
        "5",
        "--config",
        str(DATA / "crew_unseen_4.yaml"),
        "-m",
        "rules",
        "-m",
        "replay",
        "--json",
    )
    assert code == 0, out
    rep = json.loads(out)
    assert rep["games"] == 6 and set(rep["methods"]) == {"rules", "replay"}
    m = rep["methods"]["rules"]
    assert m["random_baseline"] == 0.25 and m["n"] == 6
    assert {
        "accuracy",
        "ci95",
        "auroc",
        "brier",
        "reliability",
        "confusion",
        "per_strategy",
        "forward_runs_per_game",
        "seconds_per_game",
    } <= set(m)
    assert sum(sum(r.values()) for r in m["confusion"].values()) == 6
    assert set(m["confusion"]) <= {"wren", "osprey", "magpie", "heron"}
    with Journal(j) as journal:
        runs = [r.run_id for r in journal.runs() if r.scenario == "heist"]
    code, out = run("--journal", str(j), "detect-eval", "--runs", runs[0], "--runs", runs[1])
    assert code == 0 and "top-1" in out and "confusion" in out


def test_detect_eval_with_no_server_fails_cleanly(tmp_path: Path) -> None:
    """--policy openai against a port nobody listens on: every game fails, is closed in the
    journal, and detect-eval ends with one error line naming the first failure."""
    import subprocess
    import sys

    from servers import free_port

    proc = subprocess.run(
        [
            sys.executable, "-m", "cli", "--journal", str(tmp_path / "e.db"), "detect-eval",
            "--games", "1", "--policy", "openai",
            "--base-url", f"http://127.0.0.1:{free_port()}/v1",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("error: no game completed; first failure: seed 0: failed")
    with Journal(tmp_path / "e.db") as j:
        assert [j.status(r.run_id) for r in j.runs()] == ["failed"]
