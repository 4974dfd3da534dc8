"""A second scenario, defined here and nowhere in the engine, runs through the same core code
paths as the heist: recorded by engine.runtime.record.record_run, replayed by
engine.replay.fidelity / check_requests at fidelity 1.0, forked through the Scenario protocol
(engine.branching.fork, the stepped scenario's SteppedForks) and engine.interventions.run_branch
with do_action, do_observation and do_resample, and refused in one line by a `car` process that
does not know it. That is what makes the core scenario-agnostic."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine import events as ev
from engine.branching import SteppedForks, attribute, fork
from engine.interventions import (
    DoAction,
    DoObservation,
    DoResample,
    fork_many,
    parent_info,
    run_branch,
)
from engine.journal import Journal
from engine.policies.base import AgentView, ChatLine, Completion
from engine.policies.registry import make_policy, register_policy, unregister_policy
from engine.replay import check_requests, fidelity
from engine.runtime.record import record_run
from engine.runtime.seeds import step_seed
from engine.scenario import register_scenario, scenario_for, unregister_scenario
from engine.state import State, state_at

ROOT = Path(__file__).resolve().parent.parent
NAME = "toy-count"
POLICY = "toy-counter"
_NUMBER = re.compile(r"^(-?\d+)")
_ADD = re.compile(r"\[add:(-?\d+)\+(-?\d+)\]")


@dataclass(frozen=True)
class Added:
    """The toy's tool result."""

    ok: bool
    output: str
    error: str | None = None


class CountScenario(SteppedForks):
    """Two agents take turns counting up from 0; each turn is "[add:n+1] m" where m is the
    tool's answer as the agent read it. The run is good when the last number said equals the
    number of steps."""

    name = NAME
    agents = ("ann", "bob")

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.total_steps = steps

    def run_config(self) -> dict[str, Any]:
        return {"steps": self.steps}

    @classmethod
    def from_state(cls, state: State) -> CountScenario:
        return cls(int(state.config["steps"]))

    def view(self, state: State, run_id: str) -> AgentView:
        agent = self.agents[state.step % len(self.agents)]
        ctx = state.contexts.get(agent)
        return AgentView(
            run_id=run_id,
            step=state.step,
            round=state.step // len(self.agents),
            agent=agent,
            role="counter",
            system_prompt=f"You are {agent}. Say the next number.",
            agents=self.agents,
            transcript=state.transcript,
            observations=ctx.observations if ctx is not None else (),
        )

    def messages(self, view: AgentView) -> list[dict[str, str]]:
        return [{"role": "system", "content": view.system_prompt}] + [
            {"role": "user", "content": f"{line.agent}: {line.text}"} for line in view.transcript
        ]

    def tool_calls(self, text: str) -> list[tuple[str, str]]:
        return [("add", f"{a}+{b}") for a, b in _ADD.findall(text)]

    def run_tool(self, name: str, param: str) -> Added:
        a, _, b = param.partition("+")
        return Added(ok=True, output=str(int(a) + int(b)))

    def outcome(self, transcript: list[ChatLine]) -> dict[str, Any]:
        last = _last_number(transcript)
        return {"bad": last != self.steps, "last": last}


def _last_number(lines: tuple[ChatLine, ...] | list[ChatLine]) -> int:
    for line in reversed(lines):
        m = _NUMBER.match(line.text)
        if m:
            return int(m.group(1))
    return 0


class CountPolicy:
    """Says the number after the last one said; the seed only picks the closing word, so a
    replay with any other seed than the recorded one would not match."""

    name = POLICY

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion:
        n = _last_number(view.transcript)
        word = ("done", "next", "ok")[seed % 3]
        return Completion(text=f"{n + 1} {word} [add:{n}+1]", model="count-1")


@pytest.fixture
def toy() -> Iterator[None]:
    register_scenario(NAME, CountScenario)
    register_policy(POLICY, lambda spec: CountPolicy())
    yield
    unregister_scenario(NAME)
    unregister_policy(POLICY)


@pytest.fixture
def recorded(toy: None, tmp_path: Path) -> Iterator[tuple[Journal, str]]:
    j = Journal(tmp_path / "toy.db")
    r = record_run(j, CountScenario(6), CountPolicy(), seed=11)
    assert r.status == "completed"
    yield j, r.run_id
    j.close()


def test_records_through_the_core_loop(recorded: tuple[Journal, str]) -> None:
    """record_run journals the toy like any run: RunStarted naming it, one LlmCall with the
    derived seed, tool call and result, and message per step, and the toy's own outcome."""
    j, run = recorded
    events = [s.event for s in j.read(run)]
    first = events[0]
    assert isinstance(first, ev.RunStarted)
    assert (first.scenario, first.config, first.agents) == (NAME, {"steps": 6}, ["ann", "bob"])
    assert first.policy == {"name": POLICY}
    calls = [e for e in events if isinstance(e, ev.LlmCall)]
    assert [c.seed for c in calls] == [step_seed(11, k) for k in range(6)]
    assert [c.agent for c in calls] == ["ann", "bob"] * 3
    results = [e for e in events if isinstance(e, ev.ToolResult)]
    assert [r.output for r in results] == [str(k + 1) for k in range(6)]
    end = events[-1]
    assert isinstance(end, ev.RunEnded)
    assert end.outcome == {"bad": False, "last": 6}
    assert j.run(run).scenario == NAME
    assert isinstance(scenario_for(state_at(j, run, 3)), CountScenario)


def test_replays_at_fidelity_one(recorded: tuple[Journal, str]) -> None:
    """The core's replay rebuilds every toy request from s_k and re-decides every step with
    its recorded seed: fidelity 1.0, no divergence."""
    j, run = recorded
    assert check_requests(j, run).ok
    report = fidelity(j, run)
    assert report.steps == 6 and report.skipped == 0
    assert report.action_match_rate == 1.0 and report.exact_match_rate == 1.0
    assert report.divergences == []
    assert set(report.per_agent) == {"ann", "bob"}


def test_replay_notices_a_policy_that_ignores_its_seed(toy: None, tmp_path: Path) -> None:
    """Fidelity is measured, not assumed: replaying under a policy whose words do not follow
    the recorded seeds reports the steps that differ (so 1.0 above means something)."""
    with Journal(tmp_path / "toy.db") as j:
        run = record_run(j, CountScenario(6), CountPolicy(), seed=11).run_id

        class Stubborn(CountPolicy):
            def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Any:
                return super().decide(view, messages, 0)

        register_policy(POLICY, lambda spec: Stubborn())
        report = fidelity(j, run)
    expected = sum(1 for k in range(6) if step_seed(11, k) % 3 != 0)
    assert expected > 0
    assert len(report.divergences) == expected
    assert report.action_match_rate == pytest.approx((6 - expected) / 6)


def test_do_action_forks_through_the_core(recorded: tuple[Journal, str]) -> None:
    """The protocol's fork (engine.branching.fork) with do_action forks the toy run at k: the
    branch shares the prefix, says the forced text at k, its later agents count on from it, and
    the toy scores it bad."""
    j, run = recorded
    report = fork(j, run, DoAction(2, "40 forced [add:39+1]"), 3, seed=5)
    assert report.factual_bad is False
    assert (report.scored, report.bad, report.bad_rate) == (3, 3, 1.0)
    branch = report.branches[0].run_id
    info = j.run(branch)
    assert info.parent_run_id == run and info.scenario == NAME
    msgs = [e.text for e in (s.event for s in j.read(branch)) if isinstance(e, ev.ChatMessage)]
    assert [int(m.split()[0]) for m in msgs] == [1, 2, 40, 41, 42, 43]
    end = j.last_event(branch)
    assert end is not None and isinstance(end.event, ev.RunEnded)
    assert end.event.outcome == {"bad": True, "last": 43}


def test_other_interventions_fork_the_toy(recorded: tuple[Journal, str]) -> None:
    """do_observation replaces the toy tool's result at k (the action is kept); do_resample
    re-decides with new seeds and, the count being seed-free, stays good."""
    j, run = recorded
    parent = parent_info(j, run)
    obs = run_branch(j, parent, DoObservation(3, "99"), branch_seed=1)
    results = [e for e in (s.event for s in j.read(obs.run_id)) if isinstance(e, ev.ToolResult)]
    assert [r.output for r in results if r.step == 3] == ["99"]
    assert obs.outcome == {"bad": False, "last": 6}
    resampled = fork_many(j, run, DoResample(1), 4, seed=2)
    assert (resampled.scored, resampled.bad) == (4, 0)


def test_attribution_runs_through_the_protocol(recorded: tuple[Journal, str]) -> None:
    """engine.branching.attribute finds the toy through the registry and attributes a bad
    branch of it through the scenario's own forward_model: forcing "40" at step 2 makes every
    later count wrong, re-deciding step 2 (or an earlier one) repairs it and re-deciding a
    later one does not, so the point of commitment is step 2, said by ann, whose effect is
    -1.0 (re-deciding it takes P(bad) from 1 to 0); steps after it have effect 0."""
    j, run = recorded
    bad = fork(j, run, DoAction(2, "40 forced [add:39+1]"), 1, seed=5).branches[0].run_id
    data = attribute(j, bad, method="contrastive", k=8, seed=1, all_steps=True)
    assert (data["locus"], data["locus_agent"]) == (2, "ann")
    effects = {r["step"]: r["effect"] for r in data["ranked"]}
    assert effects[2] == -1.0
    assert all(effects[k] == 0.0 for k in range(3, 6))
    assert data["branches_added"] > 0 and data["branches_reused"] == 0
    again = attribute(j, bad, method="contrastive", k=8, seed=1, all_steps=True)
    assert again["branches_added"] == 0 and again["locus"] == 2


def test_both_builtin_scenarios_speak_the_common_protocol() -> None:
    """The heist and recorded programs implement the members every scenario has (fork,
    forward_model, run_config, from_state); only the heist the stepped members the core's
    loop calls, and asking the loop to drive a program's run is one line naming car replay."""
    from engine.errors import ConfigError
    from engine.heist.session import HeistScenario
    from engine.program.scenario import ProgramScenario
    from engine.scenario import stepped_for

    common = ("fork", "forward_model", "run_config", "from_state")
    stepped = ("view", "messages", "tool_calls", "run_tool", "outcome")
    for cls in (HeistScenario, ProgramScenario, CountScenario):
        assert all(callable(getattr(cls, m, None)) for m in common), cls
    assert all(callable(getattr(HeistScenario, m, None)) for m in stepped)
    assert not any(callable(getattr(ProgramScenario, m, None)) for m in stepped)
    state = State(scenario="program", config={"command": ["python", "x.py"]})
    with pytest.raises(ConfigError) as e:
        stepped_for(state, "car fidelity")
    assert "\n" not in str(e.value) and "car replay RUN -- CMD" in str(e.value)


def test_a_process_without_the_scenario_refuses_it_in_one_line(
    recorded: tuple[Journal, str],
) -> None:
    """`car fidelity`, `car fork` and `car attribute` in a process where the toy is not
    registered fail with one clear line naming the scenario and the known ones, a non-zero
    exit, no branch made and the journal untouched."""
    j, run = recorded
    before = j.head(run)
    for command in (
        ["fidelity", run],
        ["fork", run, "--at", "1", "--do", "action", "--value", "7 [add:6+1]", "-n", "2"],
        ["attribute", run],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "cli", "--journal", str(j.path), *command],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 1, command
        lines = proc.stderr.strip().splitlines()
        assert lines == [f"error: unknown scenario {NAME!r}; known scenarios: heist, program"], (
            command
        )
        assert proc.stdout == "", command
    assert j.head(run) == before
    assert j.children(run) == []


def test_policies_resolve_through_the_registry(toy: None) -> None:
    """A registered policy is rebuilt from its journaled spec like the built-in ones."""
    assert isinstance(make_policy({"name": POLICY}), CountPolicy)
