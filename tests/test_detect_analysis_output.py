"""analyze()'s output where mutation testing found it unchecked: the tie-break, the margin and
rounding, the warnings' texts, the option filter, and the LLM step's defaults and degraded
paths (against a port that refuses connections: a real socket, no server).

Expected values are computed here (hashlib, the rules' own signals read from the output),
never by the function under test.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from engine import events as ev
from engine.detect import DetectError, analyze, calibration
from engine.detect.analysis import _pick, inputs, ranking
from engine.detect.llm import DEFAULT_BASE_URL, DEFAULT_MODEL
from engine.detect.rules import WEIGHTS, Msg, ToolUse, rule_scores
from engine.errors import EngineError
from engine.executors.local import LocalExecutor
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal
from engine.policies.openai_policy import OpenAIPolicy
from engine.public import public_view

CREW = ["kite", "lark", "moth"]


@contextlib.contextmanager
def closed_port() -> Iterator[str]:
    """Base URL of a port on 127.0.0.1 that is bound but never listens: connections fail."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def hand_made(j: Journal, agents: list[str], texts: list[tuple[str, str]], ended: bool) -> str:
    rid = j.create_run("heist")
    j.append(
        rid,
        [
            ev.RunStarted(
                scenario="heist",
                config={},
                agents=agents,
                policy={"name": "sim"},
                root_seed=1,
                engine_version="test",
                started_at="2026-01-01T00:00:00Z",
                rounds=1,
            )
        ],
    )
    for k, (agent, text) in enumerate(texts):
        j.append(rid, [ev.ChatMessage(step=k, agent=agent, text=text)])
    if ended:
        j.append(rid, [ev.RunEnded(status="completed", outcome={"bad": True})])
    return rid


@pytest.fixture(scope="module")
def heist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Journal, str]]:
    with Journal(tmp_path_factory.mktemp("an") / "j.db") as j:
        yield j, record_heist(j, SimPolicy(), seed=33).run_id


def test_ties_are_broken_by_a_hash_of_run_and_agent() -> None:
    """Equal scores are ordered by blake2b-64 of "run:agent", not by the config's order;
    higher scores come first whatever their hash."""
    scores = {"a": 0.5, "b": 0.5, "c": 0.5, "d": 0.9}
    for run in ("r1", "r2", "r3"):

        def h(agent: str, run: str = run) -> bytes:
            return hashlib.blake2b(f"{run}:{agent}".encode(), digest_size=8).digest()

        assert ranking(scores, run) == ["d", *sorted("abc", key=h)]
    orders = {tuple(ranking(scores, f"run{i}")) for i in range(20)}
    assert len(orders) > 1  # the tie-break depends on the run


def test_margin_scores_and_breakdown(heist: tuple[Journal, str]) -> None:
    """The margin is the top score minus the second, every number rounded to 4 places, the
    breakdown holds each rule signal per agent (no LLM), and the ranking is by score."""
    j, rid = heist
    out = analyze(j, rid)
    scores = out["suspicion_scores"]
    order = out["ranking"]
    assert order[0] == out["suggested_mole"]
    assert [scores[a] for a in order] == sorted(scores.values(), reverse=True)
    assert out["margin"] == pytest.approx(scores[order[0]] - scores[order[1]], abs=2e-4)
    for a, b in out["score_breakdown"].items():
        assert set(b) == {
            "tool_usage", "timing", "message_anomaly", "information_quality", "llm", "combined",
        }  # fmt: skip
        assert b["llm"] is None and b["combined"] == scores[a]
        for v in b.values():
            assert v is None or round(v, 4) == v
    assert out["confidence"] == round(out["confidence"], 4)
    want, calibrated = calibration.confidence("rules", out["margin"], len(scores))
    assert calibrated and out["confidence"] == pytest.approx(want, abs=2e-3)
    assert out["method"] == "rules" and out["methods_run"] == ["rules"]
    assert out["session_id"] == rid and out["confidence_calibrated"] is True
    assert out["analysis_weights"] == dict(WEIGHTS)
    view = public_view(j, rid)
    agents = list(view.agents)
    msgs = [Msg(m.agent, m.text) for m in view.messages]
    tools = [ToolUse(t.agent, t.tool, t.success) for t in view.tool_usage]
    assert tools and msgs and inputs(view) == (agents, msgs, tools)
    rules = rule_scores(msgs, tools, agents)
    for a, b in out["score_breakdown"].items():
        for signal in ("tool_usage", "timing", "message_anomaly", "information_quality"):
            assert b[signal] == round(rules.signals[signal][a], 4), (a, signal)


def test_live_run_warning_says_how_much_was_seen(tmp_path: Path) -> None:
    """A run still recording is analysed with the warning "the run is still recording:
    analysed its first N steps"."""
    with Journal(tmp_path / "j.db") as j:
        rid = hand_made(j, CREW, [("kite", "Maybe."), ("lark", "The door.")], ended=False)
        out = analyze(j, rid)
        with pytest.raises(
            DetectError,
            match=rf"^run '{rid}' is still recording; the causal detector re-runs the crew and "
            r"needs an ended run \(rules and llm work on a live one\)$",
        ):
            analyze(j, rid, method="causal")
    assert "the run is still recording: analysed its first 2 steps" in out["warnings"]


def test_a_run_needs_two_agents(tmp_path: Path) -> None:
    """A crew of one cannot be told apart: a DetectError naming the run and its count."""
    with Journal(tmp_path / "j.db") as j:
        rid = hand_made(j, ["solo"], [("solo", "hi")], ended=True)
        with pytest.raises(DetectError, match=rf"^run '{rid}' has 1 agent; detection needs two$"):
            analyze(j, rid)


class _Answers(http.server.BaseHTTPRequestHandler):
    """A chat-completions endpoint that always scores kite 0.9, lark 0.1, moth 0.2."""

    def log_message(self, *args: object) -> None:
        pass

    models: ClassVar[list[str]] = []  # the model each request asked for

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Answers.models.append(request.get("model"))
        content = json.dumps({"kite": 0.9, "lark": 0.1, "moth": 0.2})
        body = json.dumps(
            {
                "id": "c1",
                "object": "chat.completion",
                "created": 0,
                "model": "tiny-model",
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
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def answers() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def test_llm_scores_mix_and_uncalibrated_confidence(tmp_path: Path, answers: str) -> None:
    """With a usable answer: llm alone takes the LLM's scores (weight llm 1.0); rules+llm is
    0.6 x rules + 0.4 x LLM per agent; the model the server names (no fitted parameters)
    gives the uncalibrated fallback 1/n + margin x (1 - 1/n) with a warning naming
    'method@model'."""
    with Journal(tmp_path / "j.db") as j:
        rid = hand_made(j, CREW, [("kite", "Maybe, I think."), ("lark", "Vault.")], ended=True)
        rules = analyze(j, rid)
        alone = analyze(j, rid, method="llm", base_url=answers)
        ended = j.events(alone["llm"]["detection_run"])[-1]
        mixed = analyze(j, rid, method="rules+llm", base_url=answers, journal_llm=False)
    assert alone["suspicion_scores"] == {"kite": 0.9, "lark": 0.1, "moth": 0.2}
    assert isinstance(ended, ev.RunEnded) and ended.status == "completed"
    assert ended.outcome["llm_scores"] == {"kite": 0.9, "lark": 0.1, "moth": 0.2}
    assert alone["llm"]["error"] is None and ended.error is None
    assert alone["methods_run"] == ["llm"] and alone["analysis_weights"]["llm"] == 1.0
    assert alone["margin"] == 0.7 and alone["confidence"] == round(1 / 3 + 0.7 * 2 / 3, 4)
    assert alone["confidence_calibrated"] is False
    assert (
        "confidence is not calibrated for 'llm@tiny-model' (no fitted parameters shipped): "
        "read it as a rough score, not a probability"
    ) in alone["warnings"]
    assert [b["llm"] for b in alone["score_breakdown"].values()] == [0.9, 0.1, 0.2]
    llm = {"kite": 0.9, "lark": 0.1, "moth": 0.2}
    for a in CREW:
        want = 0.6 * rules["suspicion_scores"][a] + 0.4 * llm[a]
        assert mixed["suspicion_scores"][a] == pytest.approx(want, abs=1e-4)
    assert mixed["methods_run"] == ["rules", "llm"]
    assert {k: mixed["analysis_weights"][k] for k in ("rules", "llm")} == {"rules": 0.6, "llm": 0.4}
    assert any("'rules+llm@tiny-model'" in w for w in mixed["warnings"])


def test_pick_keeps_only_the_named_options_that_are_set() -> None:
    """_pick passes on the options a method takes, drops None values, and refuses unknown
    names, listing them sorted."""
    opts = {"k_max": 4, "seed": None, "timeout": 2.0}
    assert _pick(opts, "k_max", "seed") == {"k_max": 4}
    assert _pick(opts) == {}
    with pytest.raises(DetectError, match=r"^unknown detection option\(s\): kmax, zeta$"):
        _pick({"zeta": 1, "kmax": 2, "k_max": 1})


def test_unreachable_llm_degrades_with_defaults_journaled(tmp_path: Path) -> None:
    """An LLM analysis whose server refuses: the rules' scores, methods_run ["rules"], a
    warning "...: degraded to the rules only", confidence calibrated as the rules'; the seed
    defaults to blake2b-32 of "detect:<run>", and the failed step is journaled as a detection
    run with that seed, the server and the model."""
    with closed_port() as url, Journal(tmp_path / "j.db") as j:
        rid = hand_made(j, CREW, [("kite", "Maybe, I think."), ("lark", "Vault.")], ended=True)
        rules = analyze(j, rid)
        out = analyze(j, rid, method="rules+llm", base_url=url, model="m-y", timeout=1.0)
        seed = int.from_bytes(
            hashlib.blake2b(f"detect:{rid}".encode(), digest_size=4).digest(), "big"
        )
        assert out["methods_run"] == ["rules"]
        assert out["suspicion_scores"] == rules["suspicion_scores"]
        assert out["confidence"] == rules["confidence"] and out["confidence_calibrated"]
        assert any(w.endswith(": degraded to the rules only") for w in out["warnings"])
        llm = out["llm"]
        assert (llm["base_url"], llm["model"], llm["seed"]) == (url, "m-y", seed)
        assert llm["raw_answer"] is None and "unreachable" in llm["error"]
        events = j.events(llm["detection_run"])
        started, call, ended = events
        assert isinstance(started, ev.RunStarted) and started.root_seed == seed
        assert started.config == {"analysed_run": rid, "method": "rules+llm"}
        assert isinstance(call, ev.LlmCall) and call.seed == seed and call.model == "m-y"
        assert isinstance(ended, ev.RunEnded) and ended.status == "failed"
        again = analyze(j, rid, method="llm", base_url=url, timeout=1.0, seed=7)
        assert again["llm"]["seed"] == 7


def test_llm_defaults_and_no_journaling(tmp_path: Path) -> None:
    """Without base_url and model the LLM step names the defaults; journal_llm=False records
    no detection run."""
    with Journal(tmp_path / "j.db") as j:
        rid = hand_made(j, CREW, [("kite", "Maybe.")], ended=True)
        before = len(j.runs())
        out = analyze(j, rid, method="llm", timeout=0.5, journal_llm=False)
        assert len(j.runs()) == before
    assert out["llm"]["detection_run"] is None
    assert (out["llm"]["base_url"], out["llm"]["model"]) == (DEFAULT_BASE_URL, DEFAULT_MODEL)


def test_a_read_only_journal_costs_the_record_not_the_analysis(tmp_path: Path) -> None:
    """A journal that refuses the detection run's write: the analysis completes and says the
    LLM step could not be journaled."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        rid = hand_made(j, CREW, [("kite", "Maybe.")], ended=True)
    with closed_port() as url, Journal(path, readonly=True) as ro:
        out = analyze(ro, rid, method="llm", base_url=url, timeout=0.5)
    assert out["llm"]["detection_run"] is None
    assert any(w.startswith("the LLM step could not be journaled: ") for w in out["warnings"])
    assert out["methods_run"] == ["rules"]


def test_causal_options_reach_the_detector(heist: tuple[Journal, str]) -> None:
    """analyze() hands k_min, k_max, level, sequential, concurrency and progress to the causal
    detector: its checks quote them, and a non-sequential scan spends exactly k_max runs on
    every agent at the level asked for, on two workers, reporting each run."""
    j, rid = heist
    with pytest.raises(
        EngineError, match=r"^causal detection needs 1 <= k_min <= k_max, got 5, 3$"
    ):
        analyze(j, rid, method="causal", k_min=5, k_max=3)
    with pytest.raises(
        EngineError, match=r"^causal detection level must be in \(0\.5, 1\), got 0\.4$"
    ):
        analyze(j, rid, method="causal", level=0.4)
    calls: list[tuple[int, int]] = []
    out = analyze(
        j, rid, method="causal", k_min=1, k_max=2, level=0.9, sequential=False, concurrency=2,
        progress=lambda done, total: calls.append((done, total)),
    )  # fmt: skip
    assert out["level"] == 0.9 and out["sequential"] is False
    assert out["method"] == "causal" and out["methods_run"] == ["causal"]
    assert out["executor"]["workers"] == 2
    assert calls[-1] == (2 * len(out["causal"]), 2 * len(out["causal"]))
    assert {a: c["runs"] for a, c in out["causal"].items()} == dict.fromkeys(out["causal"], 2)
    assert out["forward_runs"] == 2 * len(out["causal"])


def test_causal_batch_and_executor_reach_the_detector(heist: tuple[Journal, str]) -> None:
    """`batch` sets how many runs each agent gets between two looks at the race: with batch =
    k_max the first look comes only after every agent's k_max runs (6 x 8), while the default
    batch of 2 lets the race stop earlier on this game. A live executor handed in is the one
    that runs the forward runs (its three workers, with concurrency 1)."""
    j, rid = heist
    whole = analyze(j, rid, method="causal", k_min=1, k_max=8, batch=8)
    assert whole["forward_runs"] == 48
    early = analyze(j, rid, method="causal", k_min=1, k_max=8)
    assert early["forward_runs"] < 48
    ex = LocalExecutor("threads", 3, None)
    try:
        out = analyze(j, rid, method="causal", k_min=1, k_max=1, executor=ex)
    finally:
        ex.close()
    assert out["executor"]["workers"] == 3 and out["forward_runs"] == 6


def test_replay_options_reach_the_detector(tmp_path: Path, answers: str) -> None:
    """analyze(method="replay") re-executes a recorded LLM run against the server and model
    given (each re-executed request names that model), reports progress per step, and says
    which method ran."""
    with Journal(tmp_path / "j.db") as j:
        policy = OpenAIPolicy(answers, model="recorded-model", max_retries=0)
        rid = record_heist(j, policy, seed=8, rounds=1).run_id
        calls: list[tuple[int, int]] = []
        _Answers.models.clear()
        out = analyze(
            j, rid, method="replay", base_url=answers, model="m-q", reveal=True,
            progress=lambda done, total: calls.append((done, total)),
        )  # fmt: skip
    steps = len(out["suspicion_scores"])  # one round: one step per agent
    assert _Answers.models == ["m-q"] * steps
    assert calls == [(i, steps) for i in range(1, steps + 1)]
    assert out["method"] == "replay" and out["methods_run"] == ["replay"]
    assert isinstance(out["warnings"], list) and out["forward_runs"] == steps
