"""`car detect-eval`'s bookkeeping on a few real recorded games: the truth read from the secret
event, the seeds and labels of the recorded games, failures, progress, skipped games, and
the summary's edge cases (no games, degraded LLM runs, uncalibrated games, the confusion
counts, the reliability bins' ends).

The statistical claims (accuracy, calibration over many games) are in test_detect_accuracy.py;
this file is fast enough to run against every mutant of engine/detect/evaluate.py.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from engine import events as ev
from engine import logging as engine_logging
from engine.detect import DetectError, analyze
from engine.detect.evaluate import (
    Game,
    Truth,
    _accuracy,
    _reliability,
    evaluate,
    record_games,
    summarize,
)
from engine.detect.evaluate import truth as truth_of
from engine.heist.sim import SimPolicy
from engine.journal import Journal
from engine.policies.openai_policy import OpenAIPolicy

SEED = 91_000
GAMES = 3


@contextlib.contextmanager
def closed_port() -> Iterator[str]:
    """Base URL of a port on 127.0.0.1 that is bound but never listens: connections fail."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}/v1"


@pytest.fixture(autouse=True)
def log_to_this_stderr() -> None:
    """The failed-game test logs the policy's error. structlog keeps the stderr it was
    configured with, and a process that runs pytest more than once (mutation testing does)
    has closed that one by now: configure it again with the current stderr."""
    engine_logging.configure()


def ended(j: Journal, run_id: str) -> str | None:
    """How the run ended (its RunEnded status), None while it has none."""
    last = [s.event for s in j.read(run_id)][-1]
    return last.status if isinstance(last, ev.RunEnded) else None


def secret_of(j: Journal, run_id: str) -> Truth:
    """The mole as the journal holds it: the run's one secret event, read here directly."""
    (e,) = [s.event for s in j.read(run_id) if isinstance(s.event, ev.MoleAssigned)]
    return Truth(e.agent, e.strategy)


@pytest.fixture(scope="module")
def games(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Journal, list[str]]]:
    print(f"{GAMES} games, seeds {SEED}..{SEED + GAMES - 1}")
    with Journal(tmp_path_factory.mktemp("eval") / "j.db") as j:
        calls: list[tuple[int, int]] = []
        runs = record_games(
            j, GAMES, seed=SEED, policy=SimPolicy(), progress=lambda i, n: calls.append((i, n))
        )
        assert calls == [(1, 3), (2, 3), (3, 3)]
        yield j, runs


def test_recorded_games_have_consecutive_seeds_and_no_revealing_label(
    games: tuple[Journal, list[str]],
) -> None:
    """Game i of --seed S is a completed heist with root seed S + i, labelled "detect-eval"
    (never the seed, which would name the mole)."""
    j, runs = games
    assert len(runs) == GAMES
    infos = {r.run_id: r for r in j.runs()}
    for i, rid in enumerate(runs):
        started = next(iter(j.read(rid, 0, 1))).event
        assert isinstance(started, ev.RunStarted) and started.root_seed == SEED + i
        assert infos[rid].label == "detect-eval" and ended(j, rid) == "completed"


def test_truth_is_the_secret_event(games: tuple[Journal, list[str]]) -> None:
    """truth() returns the mole and strategy of the run's secret event."""
    j, runs = games
    for rid in runs:
        assert truth_of(j, rid) == secret_of(j, rid)


def test_truth_of_a_run_without_a_mole_is_none(tmp_path: Path) -> None:
    """A recorded heist without a mole has no truth: it cannot be scored."""
    from engine.heist.session import record_heist

    with Journal(tmp_path / "j.db") as j:
        r = record_heist(j, SimPolicy(), seed=5, rounds=1, no_mole=True)
        assert truth_of(j, r.run_id) is None


def test_evaluate_scores_every_method_and_reports_progress(
    games: tuple[Journal, list[str]],
) -> None:
    """evaluate() runs each method on each game, compares with the truth, and reports progress
    up to games x methods; each game's agents are the crew the methods scored."""
    j, runs = games
    calls: list[tuple[int, int]] = []
    out = evaluate(j, runs, ["rules"], progress=lambda d, t: calls.append((d, t)))
    assert out["games"] == GAMES and out["skipped_without_mole"] == []
    assert calls == [(1, 3), (2, 3), (3, 3)]
    m = out["methods"]["rules"]
    assert m["n"] == GAMES
    hits = sum(analyze(j, rid)["suggested_mole"] == secret_of(j, rid).mole for rid in runs)
    assert m["hits"] == hits
    assert m["random_baseline"] == round(1 / 6, 4)  # the default crew has six agents
    moles = sorted(secret_of(j, rid).mole for rid in runs)
    assert sorted(k for k, row in m["confusion"].items() for _ in range(sum(row.values()))) == moles
    assert m["calibrated"] is True and m["degraded"] == 0
    assert m["forward_runs_per_game"] == 0  # the rules re-run nothing
    assert m["seconds_per_game"] > 0


def test_evaluate_skips_games_without_a_mole(tmp_path: Path) -> None:
    """A game without a mole is skipped (named in the output), still counted in progress."""
    from engine.heist.session import record_heist

    with Journal(tmp_path / "j.db") as j:
        honest = record_heist(j, SimPolicy(), seed=6, rounds=1, no_mole=True).run_id
        scored = record_heist(j, SimPolicy(), seed=7, rounds=1).run_id
        calls: list[tuple[int, int]] = []
        out = evaluate(j, [honest, scored], ["rules"], progress=lambda d, t: calls.append((d, t)))
    assert out["skipped_without_mole"] == [honest]
    assert out["games"] == 1 and out["methods"]["rules"]["n"] == 1
    assert calls == [(2, 2)]


def test_unknown_method_is_refused_before_any_work(games: tuple[Journal, list[str]]) -> None:
    """A misspelt method is a DetectError listing the valid ones."""
    j, runs = games
    with pytest.raises(
        DetectError,
        match=r"^unknown detection method 'rulez'; expected one of: rules, llm, rules\+llm, "
        r"causal, replay$",
    ):
        evaluate(j, runs, ["rules", "rulez"])


def test_a_failed_game_is_left_out_or_stops_the_evaluation(tmp_path: Path) -> None:
    """A game whose policy fails (an LLM server that refuses connections) is closed and left
    out: with a `failures` list its seed and error are appended, without one the evaluation
    stops with a DetectError naming the seed."""
    with closed_port() as url, Journal(tmp_path / "j.db") as j:
        policy = OpenAIPolicy(url, max_retries=0, timeout=2.0)
        failures: list[str] = []
        runs = record_games(j, 2, seed=40, policy=policy, rounds=1, failures=failures)
        assert runs == []
        assert [f.split(":")[0] for f in failures] == ["seed 40", "seed 41"]
        assert all(": failed: " in f for f in failures), failures
        with pytest.raises(DetectError, match=r"^recording game seed 50 ended failed: "):
            record_games(j, 1, seed=50, policy=policy, rounds=1)
        assert [ended(j, r.run_id) for r in j.runs()] == ["failed"] * 3


def game(i: int, mole: str, said: str, conf: float, **extra: Any) -> Game:
    return Game(
        run_id=f"r{i}",
        agents=["a", "b", "c"],
        truth=Truth(mole, "WRONG_TOOLS"),
        results={
            "m": {
                "suggested_mole": said,
                "confidence": conf,
                "suspicion_scores": {"a": 0.5, "b": 0.2, "c": 0.1},
                "methods_run": ["rules"],
                "confidence_calibrated": True,
                **extra,
            }
        },
        seconds={"m": 0.25},
    )


def test_summary_of_no_games() -> None:
    """No games: no accuracy, baseline, AUROC or Brier; zero runs and seconds; empty tables."""
    out = summarize([], "m")
    assert (out["n"], out["hits"], out["accuracy"], out["ci95"]) == (0, 0, None, [0.0, 1.0])
    assert (out["random_baseline"], out["auroc"], out["brier"]) == (None, None, None)
    assert (out["forward_runs_per_game"], out["seconds_per_game"]) == (0, 0)
    assert out["confusion"] == {} and out["per_strategy"] == {}
    assert [b["games"] for b in out["reliability"]] == [0, 0, 0, 0, 0]


def test_summary_counts_confusion_degraded_and_calibration() -> None:
    """Two games with the same (mole, suggestion) count 2 in the confusion table; an LLM
    method's game without "llm" among methods_run is degraded; one uncalibrated game makes
    the method uncalibrated; a game without forward runs counts 0 of them."""
    games = [
        game(0, "a", "a", 0.9, forward_runs=4),
        game(1, "a", "a", 0.8),
        game(2, "b", "a", 0.3, forward_runs=2, confidence_calibrated=False),
    ]
    out = summarize(games, "m")
    assert out["confusion"] == {"a": {"a": 2}, "b": {"a": 1}}
    assert out["forward_runs_per_game"] == 2.0
    assert out["seconds_per_game"] == 0.25
    assert out["calibrated"] is False
    assert out["degraded"] == 0  # "m" is no LLM method
    llm = [Game(g.run_id, g.agents, g.truth, {"llm": g.results["m"]}, {"llm": 0.25}) for g in games]
    llm[1].results["llm"] = {**llm[1].results["llm"], "methods_run": ["llm"]}
    assert summarize(llm, "llm")["degraded"] == 2
    both = [
        Game(g.run_id, g.agents, g.truth, {"rules+llm": g.results["m"]}, {"rules+llm": 1.0})
        for g in games
    ]
    assert summarize(both, "rules+llm")["degraded"] == 3
    assert summarize(games[:2], "m")["calibrated"] is True


def test_per_strategy_rows_are_sorted_and_scored() -> None:
    """Per strategy: its own hits, n and AUROC, strategies in alphabetical order."""
    games = [game(0, "a", "a", 0.9), game(1, "b", "a", 0.4), game(2, "a", "a", 0.5)]
    games[1] = Game(
        games[1].run_id, games[1].agents, Truth("b", "FALSE_INFO"), games[1].results,
        games[1].seconds,
    )  # fmt: skip
    out = summarize(games, "m")["per_strategy"]
    assert list(out) == ["FALSE_INFO", "WRONG_TOOLS"]
    assert (out["FALSE_INFO"]["hits"], out["FALSE_INFO"]["n"]) == (0, 1)
    assert (out["WRONG_TOOLS"]["hits"], out["WRONG_TOOLS"]["n"]) == (2, 2)
    # FALSE_INFO: the mole b scored 0.2 against a 0.5 and c 0.1 -> 1 of 2 pairs won
    assert out["FALSE_INFO"]["auroc"] == 0.5
    assert out["WRONG_TOOLS"]["auroc"] == 1.0


def test_reliability_bins_include_their_low_end_and_one() -> None:
    """A confidence of exactly 1.0 falls in the last bin, 0.0 in the first; each bin is
    [lo, hi) and reports its games' mean confidence and hit rate, rounded to 4 places."""
    bins = _reliability([0.0, 1.0, 0.8, 0.79999, 0.6], [False, True, False, True, True])
    assert [b["bin"] for b in bins] == ["0.0-0.2", "0.2-0.4", "0.4-0.6", "0.6-0.8", "0.8-1.0"]
    assert [b["games"] for b in bins] == [1, 0, 0, 2, 2]
    assert bins[0] == {"bin": "0.0-0.2", "games": 1, "mean_confidence": 0.0, "accuracy": 0.0}
    assert bins[4]["mean_confidence"] == 0.9 and bins[4]["accuracy"] == 0.5
    assert bins[3]["mean_confidence"] == round((0.79999 + 0.6) / 2, 4)
    assert bins[1]["mean_confidence"] is None and bins[1]["accuracy"] is None


DATA = Path(__file__).resolve().parent / "data"


class _Server(http.server.BaseHTTPRequestHandler):
    """Chat completions that score kite/lark/moth for a detector and say "ok" to an agent;
    after `budget` requests it answers HTTP 500. It keeps the model each request named."""

    budget: ClassVar[int] = 10**9
    models: ClassVar[list[str]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Server.models.append(request.get("model"))
        _Server.budget -= 1
        if _Server.budget < 0:
            body, code = b'{"error": "out of budget"}', 500
        else:
            scores = {"planner": 0.9, "hacker": 0.1, "safecracker": 0.2, "intel": 0.1,
                      "driver": 0.1, "lookout": 0.1}  # fmt: skip
            content = json.dumps(scores)
            body = json.dumps(
                {
                    "id": "c1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "srv",
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": content},
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
                }
            ).encode()
            code = 200
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def test_record_games_passes_crew_rounds_and_server_on(tmp_path: Path) -> None:
    """The crew file, the rounds and the server name given reach every recorded game."""
    with Journal(tmp_path / "j.db") as j:
        (rid,) = record_games(
            j, 1, seed=3, policy=SimPolicy(), config_path=DATA / "crew_unseen_4.yaml",
            rounds=1, server="srv-x",
        )  # fmt: skip
        events = [s.event for s in j.read(rid)]
    started = events[0]
    assert isinstance(started, ev.RunStarted) and started.rounds == 1
    assert len(started.agents) == 4
    calls = [e for e in events if isinstance(e, ev.LlmCall)]
    assert len(calls) == 4 and {c.server for c in calls} == {"srv-x"}


def test_the_failing_game_is_named_by_its_own_seed(tmp_path: Path, server: str) -> None:
    """When game 2 of 2 fails (the server stops answering after game 1's six requests), the
    error names seed S + 1."""
    _Server.budget = 6
    try:
        with Journal(tmp_path / "j.db") as j:
            policy = OpenAIPolicy(server, max_retries=0, timeout=5.0)
            with pytest.raises(DetectError, match=r"^recording game seed 61 ended failed: "):
                record_games(j, 2, seed=60, policy=policy, rounds=1)
    finally:
        _Server.budget = 10**9


def test_evaluate_hands_method_server_model_and_options_on(
    games: tuple[Journal, list[str]], server: str
) -> None:
    """evaluate() runs each method asked for against the server and model given, with the
    options given: the LLM method is used (not degraded) on every game, each request names
    the model, no detection run is journaled (journal_llm False), and progress counts
    games x methods."""
    j, runs = games
    before = len(j.runs())
    _Server.models.clear()
    calls: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    out = evaluate(
        j, runs, ["rules", "llm"], base_url=server, model="m-e",
        options={"journal_llm": False}, progress=lambda d, t: calls.append((d, t)),
    )  # fmt: skip
    wall = time.perf_counter() - t0
    assert len(j.runs()) == before
    assert _Server.models == ["m-e"] * GAMES
    assert calls == [(i, 2 * GAMES) for i in range(1, 2 * GAMES + 1)]
    llm = out["methods"]["llm"]
    assert llm["degraded"] == 0 and llm["n"] == GAMES
    assert out["methods"]["rules"]["degraded"] == 0
    assert 0 < llm["seconds_per_game"] < wall


def test_progress_counts_skipped_games(tmp_path: Path) -> None:
    """Two games without a mole, then one with: progress still ends at games x methods."""
    from engine.heist.session import record_heist

    with Journal(tmp_path / "j.db") as j:
        runs = [record_heist(j, SimPolicy(), seed=s, rounds=1, no_mole=True).run_id for s in (1, 2)]
        runs.append(record_heist(j, SimPolicy(), seed=3, rounds=1).run_id)
        calls: list[tuple[int, int]] = []
        out = evaluate(j, runs, ["rules"], progress=lambda d, t: calls.append((d, t)))
    assert calls == [(3, 3)] and out["skipped_without_mole"] == runs[:2]


@pytest.mark.parametrize("n", [1, 2])
def test_no_game_with_a_mole_is_an_error_not_an_empty_report(tmp_path: Path, n: int) -> None:
    """Runs none of which has a mole leave nothing to score: one DetectError saying so (the
    report came out with blank accuracies and exit 0)."""
    from engine.heist.session import record_heist

    with Journal(tmp_path / "j.db") as j:
        runs = [
            record_heist(j, SimPolicy(), seed=s, rounds=1, no_mole=True).run_id for s in range(n)
        ]
        which = "the run given has no" if n == 1 else "none of the 2 runs has a"
        with pytest.raises(DetectError, match=f"^{which} mole to evaluate against"):
            evaluate(j, runs, ["rules"])


def test_accuracy_and_brier_are_rounded_to_four_places() -> None:
    """1 hit of 3 is an accuracy of 0.3333 (overall and in a reliability bin); a Brier score
    of 1/9 is 0.1111; seconds a game keep 4 places, forward runs a game 2."""
    assert _accuracy(1, 3)["accuracy"] == 0.3333
    games = [game(0, "a", "a", 2 / 3), game(1, "b", "b", 2 / 3)]
    assert summarize(games, "m")["brier"] == 0.1111
    thirds = [game(i, "a", "a", 0.5, forward_runs=int(i == 0)) for i in range(3)]
    for g in thirds:
        g.seconds["m"] = 1 / 3
    out = summarize(thirds, "m")
    assert (out["forward_runs_per_game"], out["seconds_per_game"]) == (0.33, 0.3333)
    (row,) = [b for b in _reliability([0.5, 0.5, 0.5], [True, False, False]) if b["games"]]
    assert (row["mean_confidence"], row["accuracy"]) == (0.5, 0.3333)
