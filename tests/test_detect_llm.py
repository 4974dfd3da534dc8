"""The LLM step: malformed, partial, non-numeric and out-of-range answers are repaired or
ignored with a warning; an unreachable or misbehaving server degrades to the rules and says
so; prompt, model, seed and raw answer are journaled. Against a misbehaving local HTTP server
(real sockets, real openai client) and the real llama.cpp server."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from servers import free_port

from engine import events as ev
from engine.detect import analyze
from engine.detect.llm import parse_scores
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal

CREW = ["planner", "hacker", "safecracker", "intel", "driver", "lookout"]

# (raw answer, expected scores for planner and hacker or None if ignored, warning fragment)
ANSWERS = [
    (
        '{"planner": 0.2, "hacker": 0.9, "safecracker": 0, "intel": 0, "driver": 0, "lookout": 0}',
        (0.2, 0.9),
        None,
    ),
    (
        '```json\n{"planner": 0.1, "hacker": 0.8, "safecracker": 0, "intel": 0, "driver": 0,'
        ' "lookout": 0}\n```',
        (0.1, 0.8),
        None,
    ),
    (
        "Sure! {'planner': 0.3, 'hacker': 0.6, 'safecracker': 0.1, 'intel': 0.1, 'driver': 0.1,"
        " 'lookout': 0.1,} Hope it helps",
        (0.3, 0.6),
        "repaired",
    ),
    (
        "{planner: 0.4, hacker: 0.5, safecracker: 0, intel: 0, driver: 0, lookout: 0}",
        (0.4, 0.5),
        "unquoted keys",
    ),
    ('{"planner": 0.2, "hacker": 0.6}', (0.2, 0.6), "scored 2 of 6"),
    ('{"planner": "high", "hacker": 0.5}', (0.5, 0.5), "non-numeric"),
    ('{"planner": 85, "hacker": "40%", "intel": -3, "driver": 1e9}', (0.85, 0.4), "out-of-range"),
    ('{"scores": {"planner": 0.1, "hacker": 0.7}}', (0.1, 0.7), "scored 2 of 6"),
    (
        '[{"agent": "planner", "score": 0.2}, {"agent": "Hacker", "score": 0.9}]',
        (0.2, 0.9),
        "scored 2 of 6",
    ),
    ("planner: 0.3\nhacker = 0.8", (0.3, 0.8), "not JSON"),
    ('{"planner": 0.9, "hacker": 0.1, "ghost": 1.0}', (0.9, 0.1), "unknown agent"),
    ("I cannot determine who the saboteur is.", None, "no usable score"),
    ('{"planner": NaN, "hacker": true}', None, "no usable score"),
    ('{"planner": 0.5, "hack', (0.5, 0.5), "not JSON"),
    ("", None, "no usable score"),
    # an int past a float's range (OverflowError in math.isfinite) and nesting deeper than the
    # JSON parser (RecursionError) ended the analysis with a traceback
    ('{"planner": 1' + "0" * 400 + ', "hacker": 0.7}', (0.7, 0.7), "out-of-range"),
    (
        '{"planner": 0.2, "hacker": 0.7, "x": ' + "[" * 5000 + "]" * 5000 + "}",
        (0.2, 0.7),
        "not JSON",
    ),
    ("[" * 5000 + "]" * 5000, None, "no usable score"),
]


@pytest.mark.parametrize(("raw", "expected", "warning"), ANSWERS)
def test_parse_scores_repairs_or_ignores(
    raw: str, expected: tuple[float, float] | None, warning: str | None
) -> None:
    """Each answer is either repaired (scores in [0, 1] for every agent, a warning naming the
    repair) or ignored with a warning; never an exception."""
    p = parse_scores(raw, CREW)
    if expected is None:
        assert not p.usable and p.scores == {}
    else:
        assert p.usable and set(p.scores) == set(CREW)
        assert (p.scores["planner"], p.scores["hacker"]) == pytest.approx(expected)
        assert all(0.0 <= v <= 1.0 for v in p.scores.values())
    if warning is None:
        assert p.warnings == []
    else:
        assert any(warning in w for w in p.warnings), p.warnings


# ------------------------------------------------------------ a misbehaving local server

MODES = {
    "good": '{"planner": 0.1, "hacker": 0.2, "safecracker": 0.1, "intel": 0.95, '
    '"driver": 0.1, "lookout": 0.1}',
    "prose": "After careful analysis: {'intel': 0.9, 'planner': 0.2,} is my answer.",
    "partial": '{"intel": 0.8}',
    "nonnumeric": '{"intel": "very likely", "planner": null}',
    "garbage": "The butler did it.",
}


class _Handler(http.server.BaseHTTPRequestHandler):
    requests: ClassVar[list[dict[str, Any]]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        mode = self.path.strip("/").split("/")[0]
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.requests.append(body)
        if mode == "http500":
            self._send(500, b'{"error": "boom"}')
            return
        if mode == "badjson":
            self._send(200, b"{not json at all")
            return
        if mode == "nochoices":
            self._send(
                200,
                json.dumps(
                    {"id": "x", "object": "chat.completion", "choices": [], "model": "m"}
                ).encode(),
            )
            return
        if mode == "slow":
            time.sleep(3)
        content = MODES.get(mode, MODES["good"])
        reply = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": f"misbehaving-{mode}",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": content},
                }
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }
        self._send(200, json.dumps(reply).encode())

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = free_port()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{port}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def game(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Journal, str]]:
    with Journal(tmp_path_factory.mktemp("llm") / "j.db") as j:
        yield j, record_heist(j, SimPolicy(), seed=5, mole="intel").run_id


CASES = [
    # mode, methods_run, warning fragment
    ("good", ["rules", "llm"], None),
    ("prose", ["rules", "llm"], "repaired"),
    ("partial", ["rules", "llm"], "scored 1 of 6"),
    ("nonnumeric", ["rules"], "no usable score"),
    ("garbage", ["rules"], "no usable score"),
    ("http500", ["rules"], "HTTP 500"),
    ("badjson", ["rules"], "degraded to the rules"),
    ("nochoices", ["rules"], "degraded to the rules"),
    ("slow", ["rules"], "timed out"),
]


@pytest.mark.parametrize(("mode", "methods_run", "warning"), CASES)
def test_misbehaving_server_never_breaks_the_analysis(
    server: str, game: tuple[Journal, str], mode: str, methods_run: list[str], warning: str | None
) -> None:
    """rules+llm against each misbehaviour: the analysis completes, methods_run says whether
    the LLM counted, the warning says why not, and the step is journaled as a detection run
    with the prompt, model, seed and raw answer."""
    j, run = game
    out = analyze(
        j, run, method="rules+llm", base_url=f"{server}/{mode}/v1", model="m", timeout=1.0, seed=42
    )
    assert out["methods_run"] == methods_run
    if warning is not None:
        assert any(warning in w for w in out["warnings"]), out["warnings"]
    assert set(out["suspicion_scores"]) == set(CREW)
    assert all(0.0 <= v <= 1.0 for v in out["suspicion_scores"].values())
    if methods_run == ["rules", "llm"]:
        assert out["analysis_weights"]["llm"] == 0.4
        assert all(b["llm"] is not None for b in out["score_breakdown"].values())
    else:
        assert all(b["llm"] is None for b in out["score_breakdown"].values())
    det = out["llm"]["detection_run"]
    events = j.events(det)
    call = next(e for e in events if isinstance(e, ev.LlmCall))
    assert call.seed == 42 and call.request[1]["content"].startswith("A crew of agents")
    assert isinstance(events[-1], ev.RunEnded)
    if mode in MODES:
        assert call.response == MODES[mode] and call.model == f"misbehaving-{mode}"
        assert _Handler.requests[-1]["seed"] == 42


def test_rules_plus_llm_is_the_blog_mix(server: str, game: tuple[Journal, str]) -> None:
    """combined = 0.6 x rules + 0.4 x LLM per agent; llm alone is the LLM's scores."""
    j, run = game
    rules = analyze(j, run, method="rules")
    mixed = analyze(j, run, method="rules+llm", base_url=f"{server}/good/v1")
    llm = json.loads(MODES["good"])
    for a in CREW:
        assert mixed["suspicion_scores"][a] == pytest.approx(
            0.6 * rules["suspicion_scores"][a] + 0.4 * llm[a], abs=1e-3
        )
    alone = analyze(j, run, method="llm", base_url=f"{server}/good/v1")
    assert alone["suspicion_scores"] == pytest.approx(llm) and alone["methods_run"] == ["llm"]
    assert alone["suggested_mole"] == "intel"


def test_unreachable_server_degrades_to_rules(game: tuple[Journal, str]) -> None:
    """Nothing listening: rules only, methods_run says so, and the failed call is journaled."""
    j, run = game
    url = f"http://127.0.0.1:{free_port()}/v1"
    out = analyze(j, run, method="llm", base_url=url, timeout=2.0)
    assert out["methods_run"] == ["rules"]
    assert any("unreachable" in w and "degraded" in w for w in out["warnings"])
    assert out["suspicion_scores"] == analyze(j, run, method="rules")["suspicion_scores"]
    ended = j.events(out["llm"]["detection_run"])[-1]
    assert isinstance(ended, ev.RunEnded) and ended.status == "failed"


def test_prompt_carries_no_secret(server: str, game: tuple[Journal, str]) -> None:
    """What the LLM is sent is built from the public view: no strategy, no instructions."""
    j, run = game
    analyze(j, run, method="llm", base_url=f"{server}/good/v1")
    sent = json.dumps(_Handler.requests[-1])
    secret = next(e for e in j.events(run, 3) if isinstance(e, ev.MoleAssigned))
    assert secret.strategy not in sent and secret.instructions not in sent
    assert "SECRET" not in sent


# ------------------------------------------------------------ the real llama.cpp server


def test_real_llama_server_answers_are_parsed_or_ignored(
    llama_base_url: str, tmp_path: Path
) -> None:
    """Against SmolLM2-135M on llama.cpp: a full answer and a truncated one (max_tokens=4, so
    the JSON is cut off) both give a complete analysis; the prompt, seed, model and raw answer
    are journaled. Asserts the plumbing, never the model's words."""
    with Journal(tmp_path / "j.db") as j:
        run = record_heist(j, SimPolicy(), seed=3, rounds=1).run_id
        for max_tokens in (120, 4):
            out = analyze(
                j,
                run,
                method="rules+llm",
                base_url=llama_base_url,
                model="smollm2",
                seed=7,
                max_tokens=max_tokens,
                timeout=120.0,
            )
            assert out["methods_run"] in (["rules", "llm"], ["rules"])
            if out["methods_run"] == ["rules"]:
                assert any("LLM" in w for w in out["warnings"])
            assert set(out["suspicion_scores"]) == set(CREW)
            call = next(
                e for e in j.events(out["llm"]["detection_run"]) if isinstance(e, ev.LlmCall)
            )
            assert call.seed == 7 and call.response == out["llm"]["raw_answer"]
            assert call.model and call.finish_reason != "error"
