"""`car fidelity` with --base-url/--model on runs whose steps different policies decided: the
flags go to the policy that decided each re-executed step when it takes them, and are refused,
naming the steps, when none does.

test_fork_policy_swap.py holds the same against a real llama.cpp server; here two scripted
local servers stand in (the recording's and the one the flags name), so that which server a
step's call went to is counted, in this process."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from llm_helpers import Scripted, completion, scripted_server

from engine import events as ev
from engine.errors import InterventionError
from engine.heist.config import load_agents_config
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.interventions import DoPolicy, fork_many
from engine.journal import Journal
from engine.policies.registry import make_policy
from engine.replay import fidelity

CREW = Path(__file__).resolve().parent / "data" / "crew_pair.yaml"


@dataclass
class Family:
    journal: Journal
    recorded_at: Scripted
    flagged: Scripted
    #: answers another text, and refuses a request of more than `most["messages"]` messages
    #: as longer than its context
    other: Scripted
    most: dict[str, int]
    sim_root: str  # 4 steps, sim
    to_openai: str  # its branch: openai from step 2 on (steps 2 and 3)
    openai_root: str  # 2 steps, openai
    to_sim: str  # its branch: sim from step 0 on


def _openai(url: str) -> dict[str, Any]:
    return {"name": "openai", "base_url": url, "model": "m", "max_tokens": 16, "timeout": 30}


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    def reply(request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 200, completion("I keep watch.")

    most = {"messages": 10**6}

    def smaller(request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if len(request["messages"]) > most["messages"]:
            return 400, {"error": {"message": "exceeds the available context size"}}
        return 200, completion("I go in now.")

    crew = load_agents_config(CREW)
    path = tmp_path_factory.mktemp("fidelity-swap") / "j.db"
    with (
        scripted_server(reply) as a,
        scripted_server(reply) as b,
        scripted_server(smaller) as c,
        Journal(path) as j,
    ):
        sim_root = record_heist(j, SimPolicy(), seed=4, rounds=2, config=crew).run_id
        fork_many(j, sim_root, DoPolicy(2, _openai(a.url)), 1)
        spec = _openai(a.url)
        openai_root = record_heist(
            j, make_policy(spec), seed=5, rounds=1, config=crew, server=a.url
        ).run_id
        fork_many(j, openai_root, DoPolicy(0, {"name": "sim"}), 1)
        (to_openai,) = j.children(sim_root)
        (to_sim,) = j.children(openai_root)
        assert [j.status(r) for r in (to_openai.run_id, openai_root, to_sim.run_id)] == [
            "completed"
        ] * 3
        yield Family(j, a, b, c, most, sim_root, to_openai.run_id, openai_root, to_sim.run_id)


def _sent(server: Scripted, before: int) -> list[dict[str, Any]]:
    return server.requests[before:]


def test_a_mixed_branchs_server_steps_go_to_the_url_given(family: Family) -> None:
    a, b = len(family.recorded_at.requests), len(family.flagged.requests)
    rep = fidelity(
        family.journal, family.to_openai, policy_override={"base_url": family.flagged.url}
    )
    # steps 2 and 3 (openai's) went to the flagged server; steps 0 and 1 replayed as sim
    assert len(_sent(family.flagged, b)) == 2 and _sent(family.recorded_at, a) == []
    assert [(p["step"], p["exact"]) for p in rep.per_step] == [(k, True) for k in range(4)]
    assert rep.policy == {"name": "sim", "drift": 0.0}
    ((swap,),) = [rep.policy_swaps]
    assert swap["step"] == 2 and swap["policy"]["name"] == "openai"
    assert swap["policy"]["base_url"] == family.recorded_at.url


def test_a_smaller_context_at_the_url_given_is_named_in_the_divergence(family: Family) -> None:
    """The flagged server answers otherwise and holds one message fewer than step 2 was
    sent: steps 2 and 3 diverge, each saying the server left out more history than was
    recorded, and naming the server their policy was sent to."""
    j = family.journal
    sent = {
        e.step: len(e.request)
        for e in j.events(family.to_openai)
        if isinstance(e, ev.LlmCall) and e.step in (2, 3)
    }
    family.most["messages"] = sent[2] - 1
    try:
        rep = fidelity(j, family.to_openai, policy_override={"base_url": family.other.url})
    finally:
        family.most["messages"] = 10**6
    assert [d["step"] for d in rep.divergences] == [2, 3]
    for d in rep.divergences:
        assert d["provenance"]["server"] == family.other.url
        assert d["provenance"]["explanation"].startswith(
            "the server refused the recorded request as longer than its context: it was sent"
            " without "
        )


def test_a_divergence_of_the_runs_own_policy_names_the_url_given(family: Family) -> None:
    rep = fidelity(
        family.journal, family.openai_root, policy_override={"base_url": family.other.url}
    )
    assert [d["step"] for d in rep.divergences] == [0, 1]
    assert {d["provenance"]["server"] for d in rep.divergences} == {family.other.url}


def test_the_runs_own_policy_takes_the_flags_and_reports_them(family: Family) -> None:
    a, b = len(family.recorded_at.requests), len(family.flagged.requests)
    rep = fidelity(
        family.journal,
        family.openai_root,
        policy_override={"base_url": family.flagged.url, "model": "other"},
    )
    sent = _sent(family.flagged, b)
    assert len(sent) == 2 and {r["model"] for r in sent} == {"other"}
    assert _sent(family.recorded_at, a) == []
    assert rep.policy["base_url"] == family.flagged.url and rep.policy["model"] == "other"


def test_without_flags_each_step_goes_where_it_was_recorded(family: Family) -> None:
    a, b = len(family.recorded_at.requests), len(family.flagged.requests)
    fidelity(family.journal, family.to_openai)
    assert len(_sent(family.recorded_at, a)) == 2 and _sent(family.flagged, b) == []


def test_a_flag_no_deciding_policy_takes_is_refused_naming_the_steps(family: Family) -> None:
    b = len(family.flagged.requests)
    with pytest.raises(InterventionError) as caught:
        fidelity(family.journal, family.to_sim, policy_override={"base_url": family.flagged.url})
    assert str(caught.value) == (
        f"run {family.to_sim}: --base-url does not apply to policy sim (the policy that decided"
        " steps 0..1)"
    )
    # a run its own policy decided throughout: refused in that policy's own words
    with pytest.raises(InterventionError) as caught:
        fidelity(family.journal, family.sim_root, policy_override={"base_url": family.flagged.url})
    assert str(caught.value) == "--base-url does not apply to policy sim"
    # a flag for each policy, each refused by the other: both named
    with pytest.raises(InterventionError) as caught:
        fidelity(
            family.journal,
            family.to_openai,
            policy_override={"base_url": family.flagged.url, "drift": "0"},
        )
    assert str(caught.value) == (
        f"run {family.to_openai}: --base-url does not apply to policy sim (the policy that"
        " decided steps 0..1); --drift does not apply to policy openai (the policy that decided"
        " steps 2..3)"
    )
    assert _sent(family.flagged, b) == []


def test_a_flag_only_the_runs_own_policy_takes_stays_with_it(family: Family) -> None:
    """--drift on the sim->openai branch: sim (the run's own, steps 0 and 1) takes it, openai
    does not; its steps go where they were recorded."""
    a = len(family.recorded_at.requests)
    rep = fidelity(family.journal, family.to_openai, policy_override={"drift": "0"})
    assert rep.policy == {"name": "sim", "drift": 0.0}
    assert len(_sent(family.recorded_at, a)) == 2
