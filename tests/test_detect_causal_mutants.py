"""engine/detect/causal.py, claim by claim: the forward runs it records, the racing rule,
its checks, scores, intervals and warnings (the survivors of scripts/mutate, killed one at a
time).

The runs here are recorded against a small local OpenAI-compatible server that makes the
outcome a known function of who speaks: every honest prompt answers the world's reference
plan, a prompt carrying a mole's secret instructions answers a wrong route. With the mole
speaking last, the recorded heist is bad; a forward run that replaces the mole by its public
reference is good and every other agent's is bad, whatever the branch seed — so the race's
counts and stops follow from the rule by hand (the Wilson/Newcombe numbers are worked out in
the docstrings).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from llm_helpers import Scripted, completion, scripted_server

from engine import events as ev
from engine import logging as engine_logging
from engine.detect.causal import (
    CausalResult,
    _race,
    causal_scores,
    first_steps,
    reference_branch,
    reference_job,
    reference_label,
)
from engine.errors import EngineError
from engine.heist.mole import Strategy, instructions
from engine.heist.session import record_heist
from engine.heist.world import make_world
from engine.interventions import branch_seed_for, parent_info
from engine.journal import Journal
from engine.policies.openai_policy import OpenAIPolicy
from engine.public import PublicMessage, PublicRun, public_view
from engine.runtime.seeds import branch_stream, step_seed

CREW = ["planner", "hacker", "safecracker", "intel", "driver", "lookout"]
MOLE = "lookout"  # speaks last: its wrong route is the plan's last word
SEED = 8
GOOD = " ".join(f"[PLAN:{k}={v}]" for k, v in make_world(SEED).reference_plan().items())
WRONG = "[PLAN:route=nowhere]"
SECRETS = [instructions(s) for s in Strategy]
_WHO = re.compile(r"^You are (\w+),")
HONEST = [a for a in CREW if a != MOLE]


@pytest.fixture(autouse=True)
def log_to_this_stderr() -> None:
    """Failed forward runs log the policy's error. structlog keeps the stderr it was
    configured with, and a process that runs pytest more than once (mutation testing does)
    has closed that one by now: configure it again with the current stderr."""
    engine_logging.configure()


@dataclass
class Crew:
    journal: Journal
    run_id: str
    server: Scripted
    failing: set[str] = field(default_factory=set)  # agents whose turns the server fails

    @property
    def view(self) -> PublicRun:
        return public_view(self.journal, self.run_id)


@pytest.fixture
def crew(tmp_path: Path) -> Iterator[Crew]:
    failing: set[str] = set()

    def reply(request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        prompt = request["messages"][0]["content"]
        m = _WHO.match(prompt)
        assert m is not None
        if m.group(1) in failing:
            return 500, {"error": "boom"}
        secret = any(s in prompt for s in SECRETS)
        return 200, completion(WRONG if secret else f"{m.group(1)}: {GOOD}")

    with Journal(tmp_path / "j.db") as j, scripted_server(reply) as srv:
        policy = OpenAIPolicy(srv.url, model="m", max_retries=0)
        rid = record_heist(j, policy, seed=SEED, rounds=1, mole=MOLE, strategy="FALSE_INFO")
        assert rid.outcome["bad"] is True  # the recorded heist fails on the mole's route
        yield Crew(j, rid.run_id, srv, failing)


def _branches(j: Journal, rid: str) -> list[tuple[str, ev.Intervention]]:
    out = []
    for info in j.runs():
        if info.parent_run_id == rid:
            (iv,) = [e for e in j.events(info.run_id) if isinstance(e, ev.Intervention)]
            out.append((info.label, iv))
    return out


# ------------------------------------------------------------------ one forward run


def test_reference_branch_is_one_journaled_forward_run(crew: Crew) -> None:
    """A forward run forks the run at k, records an Intervention (op "reference", at k, the
    agent and the run's policy name, the branch seed), plays the agent by its public prompt
    with seeds step_seed(branch_stream(root seed, branch seed), j), and returns the branch's
    outcome: the mole replaced saves the heist, an honest agent replaced does not."""
    j, rid = crew.journal, crew.run_id
    parent = parent_info(j, rid)
    crew.server.requests.clear()
    saved = reference_branch(j, parent, MOLE, 5, 1234)
    assert (saved.status, saved.bad, saved.error) == ("completed", False, None)
    info = j.run(saved.run_id)
    assert info.parent_run_id == rid and info.label == "detect: lookout by reference"
    ivs = [e for e in j.events(saved.run_id) if isinstance(e, ev.Intervention)]
    assert [(iv.step, iv.op, iv.at, iv.value, iv.branch_seed) for iv in ivs] == [
        (5, "reference", 5, {"agent": MOLE, "policy": "openai"}, 1234)
    ]
    calls = [e for e in j.events(saved.run_id) if isinstance(e, ev.LlmCall) and e.step == 5]
    assert [c.server for c in calls] == [crew.server.url]  # the server the run was recorded on
    (req,) = crew.server.requests  # one step re-run: the mole's, by its public prompt
    assert req["seed"] == step_seed(branch_stream(SEED, 1234), 5) != step_seed(1234, 5)
    assert not any(s in req["messages"][0]["content"] for s in SECRETS)
    kept = reference_job(j, parent, ("planner", 0, 99))
    assert (kept.status, kept.bad) == ("completed", True)
    assert j.run(kept.run_id).label == reference_label("planner") == "detect: planner by reference"
    assert [s["seed"] for s in crew.server.requests[1:]] == [
        step_seed(branch_stream(SEED, 99), k) for k in range(6)
    ]


def test_a_forward_run_the_model_fails_is_failed(crew: Crew) -> None:
    """A policy error in the forward run is a failed branch with no outcome and the error."""
    crew.failing.add(MOLE)
    r = reference_branch(crew.journal, parent_info(crew.journal, crew.run_id), MOLE, 5, 1)
    assert r.status == "failed" and r.bad is None and "500" in (r.error or "")


def test_first_steps_are_first_messages_else_turn_order() -> None:
    """An agent's first step is its first message's step; an agent that never spoke gets its
    place in the turn order."""
    msgs = [
        PublicMessage(seq=3, step=2, agent="b", text="x"),
        PublicMessage(seq=4, step=4, agent="a", text="y"),
        PublicMessage(seq=5, step=5, agent="b", text="z"),
    ]
    view = PublicRun(
        run_id="r", scenario="heist", agents=["a", "b", "c"], status="completed", steps=6,
        parent_run_id=None, fork_step=None, outcome=None, messages=msgs, tool_usage=[],
        controls=[], verdict=None,
    )  # fmt: skip
    assert first_steps(view) == {"a": 4, "b": 2, "c": 2}


# ------------------------------------------------------------------ the race


def test_race_stops_once_the_mole_is_separated(crew: Crew) -> None:
    """k_min 2, batch 2: after the first round (2 runs each, 12 in all) the mole's
    replacement is 0 of 2 bad and every other 2 of 2; Newcombe's lower bound of 1 - 0 is
    1 - hypot(1 - 0.3424, 0.6576) = 0.070 > 0 for each, so the race stops, separated. The
    i-th run of every agent has branch seed branch_seed_for(seed, i)."""
    calls: list[tuple[int, int]] = []
    r = causal_scores(
        crew.journal, crew.view, k_min=2, seed=3, progress=lambda d, t: calls.append((d, t))
    )
    assert (r.forward_runs, r.separated, r.failed) == (12, True, 0)
    assert r.n == dict.fromkeys(CREW, 2)
    assert r.bad == {**dict.fromkeys(HONEST, 2), MOLE: 0}
    assert r.scores == {**dict.fromkeys(HONEST, 0.0), MOLE: 1.0}
    assert r.first_step == {a: i for i, a in enumerate(CREW)}
    assert (r.level, r.sequential, r.warnings) == (0.95, True, [])
    assert calls == [(i, 20 * 6) for i in range(1, 13)]
    seeds: dict[str, list[int]] = {}
    for label, iv in _branches(crew.journal, crew.run_id):
        seeds.setdefault(iv.value["agent"], []).append(iv.branch_seed)
        assert label == reference_label(iv.value["agent"]) and iv.at == CREW.index(
            iv.value["agent"]
        )
    want = [branch_seed_for(3, 0), branch_seed_for(3, 1)]
    assert {a: sorted(s) for a, s in seeds.items()} == {a: sorted(want) for a in CREW}


def test_race_waits_for_k_min_and_counts_in_batches(crew: Crew) -> None:
    """With k_min 4 the first look comes after two rounds of 2 (24 runs); with batch 3 and
    k_min 1 after one round of 3 (18 runs)."""
    four = causal_scores(crew.journal, crew.view, k_min=4)
    assert (four.forward_runs, four.separated) == (24, True)
    assert four.n == dict.fromkeys(CREW, 4) and four.bad[MOLE] == 0
    three = causal_scores(crew.journal, crew.view, k_min=1, batch=3)
    assert (three.forward_runs, three.separated) == (18, True)


def test_race_level_decides_when_it_separates(crew: Crew) -> None:
    """At level 0.99 (z = 2.5758) 2 of 2 against 0 of 2 is not separated (Wilson 0.2316 and
    0.7684: the bound 1 - 1.087 < 0), 4 of 4 against 0 of 4 is (1 - hypot(0.6238, 0.6238) =
    0.118): the race stops after the second round, 24 runs, at the level asked for."""
    r = causal_scores(crew.journal, crew.view, k_min=2, level=0.99)
    assert (r.forward_runs, r.separated, r.level) == (24, True, 0.99)
    assert r.extra()["level"] == 0.99


def test_race_that_reaches_k_max_says_it_did_not_separate(crew: Crew) -> None:
    """k_max 1: one run each (0 of 1 against 1 of 1 is not separated at 95%: 1 - hypot(0.7934,
    0.7934) < 0); the race ends at k_max with a warning naming the level and k_max."""
    r = causal_scores(crew.journal, crew.view, k_min=1, k_max=1)
    assert (r.forward_runs, r.separated) == (6, False)
    assert r.warnings == [
        "no agent's replacement was separated from the others at level 0.95 within 1 runs per agent"
    ]


def test_scan_spends_k_max_on_everyone_then_judges(crew: Crew) -> None:
    """sequential=False: k_max runs for every agent in one go (3 each, 18), judged once at
    the end — 3 of 3 against 0 of 3 is separated at 95% (1 - hypot(0.5615, 0.5615) = 0.206);
    with k_max 1 it is not, and says so."""
    calls: list[tuple[int, int]] = []
    r = causal_scores(
        crew.journal, crew.view, k_max=3, k_min=1, sequential=False,
        progress=lambda d, t: calls.append((d, t)),
    )  # fmt: skip
    assert (r.forward_runs, r.separated, r.sequential, r.warnings) == (18, True, False, [])
    assert r.n == dict.fromkeys(CREW, 3) and calls[-1] == (18, 18)
    one = causal_scores(crew.journal, crew.view, k_max=1, k_min=1, sequential=False)
    assert (one.forward_runs, one.separated) == (6, False)
    assert one.warnings[-1].startswith("no agent's replacement was separated")


def test_failed_forward_runs_are_counted_and_not_scored(crew: Crew) -> None:
    """The server fails every driver turn: each branch forked before the driver's step fails
    (10 of the 12), the mole's branches (forked after it) are scored; failures are counted in
    forward_runs, not in n, and warned about; agents with no scored run have no rate."""
    crew.failing.add("driver")
    r = causal_scores(crew.journal, crew.view, k_min=2, k_max=2)
    assert (r.forward_runs, r.failed) == (12, 10)
    assert r.n == {**dict.fromkeys(HONEST, 0), MOLE: 2} and r.bad[MOLE] == 0
    assert r.rate("planner") is None and r.rate(MOLE) == 0.0
    assert r.scores["planner"] == 0.0 and r.scores[MOLE] == 1.0
    assert r.separated is False
    assert r.warnings == [
        "10 forward runs failed and were not scored",
        "no agent's replacement was separated from the others at level 0.95 within 2 runs "
        "per agent",
    ]


def test_every_forward_run_failing_is_an_error(crew: Crew) -> None:
    """When every forward run of the first round fails the detector stops with an error that
    quotes the last failure — also when that round already reached k_max (2 runs each)."""
    crew.failing.update(CREW)
    with pytest.raises(EngineError, match=r"^every forward run failed: .*500"):
        causal_scores(crew.journal, crew.view, k_min=1, k_max=2)


def test_bounds_on_k_and_level(crew: Crew) -> None:
    """k_min must be at least 1 and at most k_max; the level strictly inside (0.5, 1)."""
    for k_min, k_max in ((0, 3), (4, 3)):
        with pytest.raises(EngineError, match=r"^causal detection needs 1 <= k_min <= k_max"):
            causal_scores(crew.journal, crew.view, k_min=k_min, k_max=k_max)
    for level in (0.5, 1.0):
        with pytest.raises(EngineError, match=r"^causal detection level must be in"):
            causal_scores(crew.journal, crew.view, level=level)
    r = causal_scores(crew.journal, crew.view, k_min=1, k_max=1, level=0.51)
    assert r.forward_runs == 6


def test_a_run_that_did_not_complete_is_refused(tmp_path: Path) -> None:
    """Only a completed run can be re-run: a stopped one is refused, naming its status."""
    with Journal(tmp_path / "j.db") as j:
        rid = j.create_run("heist")
        j.append(
            rid,
            [
                ev.RunStarted(
                    scenario="heist", config={}, agents=CREW, policy={"name": "sim"},
                    root_seed=1, engine_version="t", started_at="2026-01-01T00:00:00Z",
                    rounds=1,
                ),
                ev.RunEnded(status="stopped"),
            ],
        )  # fmt: skip
        with pytest.raises(
            EngineError, match=rf"^run {rid!r} is stopped; the causal detector needs a completed"
        ):
            causal_scores(j, public_view(j, rid))


# ------------------------------------------------------------------ result and rule


def test_result_intervals_and_extra() -> None:
    """extra(): the rounded bad rate per agent (None without runs), its 95% Wilson interval
    (2 of 2 -> [0.3424, 1], 0 of 2 -> [0, 0.6576], none -> [0, 1]) and the score's interval,
    1 minus it flipped; the run's settings as given."""
    r = CausalResult(
        agents=["a", "b", "c"], first_step={"a": 0, "b": 1, "c": 2},
        bad={"a": 2, "b": 0, "c": 0}, n={"a": 2, "b": 2, "c": 0}, failed=1, forward_runs=5,
        separated=False, level=0.95, sequential=True,
    )  # fmt: skip
    r.executor = {"name": "inline"}
    extra = r.extra()
    assert {k: extra[k] for k in ("forward_runs", "separated", "sequential", "level")} == {
        "forward_runs": 5, "separated": False, "sequential": True, "level": 0.95,
    }  # fmt: skip
    assert extra["executor"] == {"name": "inline"}
    assert extra["causal"] == {
        "a": {
            "first_step": 0,
            "runs": 2,
            "bad": 2,
            "p_bad_replaced": 1.0,
            "p_bad_ci": [0.3424, 1.0],
        },
        "b": {
            "first_step": 1,
            "runs": 2,
            "bad": 0,
            "p_bad_replaced": 0.0,
            "p_bad_ci": [0.0, 0.6576],
        },
        "c": {"first_step": 2, "runs": 0, "bad": 0, "p_bad_replaced": None, "p_bad_ci": [0.0, 1.0]},
    }
    assert extra["intervals"] == {"a": [0.0, 0.6576], "b": [0.3424, 1.0], "c": [0.0, 1.0]}
    assert r.scores == {"a": 0.0, "b": 1.0, "c": 0.0}
    # 1 of 3 at the result's level 0.9 (z = 1.644854): Wilson [0.0783, 0.7465]
    thirds = CausalResult(["a"], {"a": 0}, {"a": 1}, {"a": 3}, 0, 3, False, 0.9, False)
    assert thirds.extra()["causal"]["a"]["p_bad_replaced"] == 0.3333
    assert thirds.extra()["causal"]["a"]["p_bad_ci"] == [0.0783, 0.7465]


def test_race_rule_best_and_out() -> None:
    """_race: no scored agent -> (None, {}); the best is the lowest bad rate (the first in
    crew order on a tie); out are the scored agents whose Newcombe lower bound against the
    best is above zero — against 0 of 10, 10 of 10 is out, 3 of 10 and 2 of 10 are not at
    95% (3 of 10: 0.3 - hypot(0.3 - 0.1078, 0.2775) = -0.038); an agent with no run is
    neither."""
    assert _race(["a", "b"], {"a": 0, "b": 0}, {"a": 0, "b": 0}, 0.95) == (None, set())
    bad = {"a": 10, "b": 0, "c": 3, "d": 0, "e": 2}
    n = {"a": 10, "b": 10, "c": 10, "d": 0, "e": 10}
    assert _race(list(bad), bad, n, 0.95) == ("b", {"a"})
    tie = {"a": 1, "b": 1}
    assert _race(["a", "b"], tie, {"a": 2, "b": 2}, 0.95) == ("a", set())
    assert _race(["b", "a"], tie, {"a": 2, "b": 2}, 0.95) == ("b", set())
    # 3 of 10 against 0 of 10: out at 80%, not at 95%
    assert _race(["x", "y"], {"x": 3, "y": 0}, {"x": 10, "y": 10}, 0.8) == ("y", {"x"})
    assert _race(["x", "y"], {"x": 3, "y": 0}, {"x": 10, "y": 10}, 0.95) == ("y", set())


def test_one_at_a_time_runs_in_the_calling_thread(
    crew: Crew, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With concurrency 1 the forward runs run inline, one after the other in the caller's
    thread (a policy need not be thread-safe); with 2 they run on worker threads. (The real
    forward run is called; the wrapper only notes the thread it runs on.)"""
    import threading

    import engine.detect.causal as causal

    ran_on: list[int] = []
    real = causal.reference_branch

    def noting(*args: Any) -> Any:
        ran_on.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(causal, "reference_branch", noting)
    causal_scores(crew.journal, crew.view, k_min=1, k_max=1)
    assert ran_on == [threading.get_ident()] * 6
    ran_on.clear()
    causal_scores(crew.journal, crew.view, k_min=1, k_max=1, concurrency=2)
    assert len(ran_on) == 6 and threading.get_ident() not in ran_on
