"""Forks of a branch whose own history swapped the policy (do_policy): the policy in force at
the fork step, not the one the root run was recorded with, takes `--base-url`/`--model`/
`--timeout` and decides where the branches run (threads for a model server, worker processes
for the embedded policy).

Two families in one SQLite journal: a sim heist whose branch swaps in the openai policy at step
2 (steps 2 and 3 decided by a real llama.cpp server with SmolLM2), and an openai heist whose
branch swaps in sim at step 0 (step 1 decided by sim). A fork at step k of such a branch keeps
the branch's history before k and re-decides from k on with the policy in force at k: the
swapped-in one after the swap step; at the swap step itself the fork replaces the swap, and the
run's own policy decides (as it always has).

Plumbing only, never the model's words: which server a branch's call went to, whether a flag is
refused, the executor's mode. Real-model calls are few (five): recording the two families and
one accepted fork through the CLI; the other forks run sim, or fail fast against a closed port.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from journal_helpers import ROOT, car, run_count
from servers import free_port

from engine import events as ev
from engine.branching import fork
from engine.errors import InterventionError
from engine.heist.config import load_agents_config
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.interventions import BranchRunner, DoPolicy, DoResample, fork_many, parent_info
from engine.journal import Journal
from engine.policies.registry import make_policy
from engine.scenario import Rerun, scenario_of_run

CREW = ROOT / "tests" / "data" / "crew_pair.yaml"
#: The first prompt of a run is evaluated one token at a time (tests/servers.py): generous.
CALL_TIMEOUT = 400
CLI_TIMEOUT = 600


@dataclass
class Family:
    journal: Journal
    path: Path
    base_url: str
    #: sim heist (4 steps) and its branch that swapped in openai at step 2
    sim_root: str
    to_openai: str
    #: openai heist (2 steps) and its branch that swapped in sim at step 0
    openai_root: str
    to_sim: str


def _openai(base_url: str) -> dict[str, Any]:
    return {
        "name": "openai",
        "base_url": base_url,
        "model": "smollm2",
        "max_tokens": 16,
        "timeout": CALL_TIMEOUT,
    }


@pytest.fixture(scope="module")
def family(llama_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    path = tmp_path_factory.mktemp("swap") / "j.db"
    crew = load_agents_config(CREW)
    with Journal(path) as j:
        sim_root = record_heist(j, SimPolicy(), seed=4, rounds=2, config=crew).run_id
        rep = fork_many(j, sim_root, DoPolicy(2, _openai(llama_base_url)), 1)
        assert [b.status for b in rep.branches] == ["completed"], rep.branches
        openai_root = record_heist(
            j,
            make_policy(_openai(llama_base_url)),
            seed=5,
            rounds=1,
            config=crew,
            server=llama_base_url,
        ).run_id
        assert j.status(openai_root) == "completed"
        rep = fork_many(j, openai_root, DoPolicy(0, {"name": "sim"}), 1)
        assert [b.status for b in rep.branches] == ["completed"], rep.branches
        yield Family(
            j,
            path,
            llama_base_url,
            sim_root,
            fork_many_branch(j, sim_root),
            openai_root,
            fork_many_branch(j, openai_root),
        )


def fork_many_branch(j: Journal, run: str) -> str:
    (child,) = j.children(run)
    return child.run_id


def closed_port_url() -> str:
    """An OpenAI base URL nothing listens on: a call there fails at once."""
    return f"http://127.0.0.1:{free_port()}/v1"


def calls(j: Journal, run: str, step: int) -> list[ev.LlmCall]:
    return [e for e in j.events(run) if isinstance(e, ev.LlmCall) and e.step == step]


def test_the_family_is_what_the_tests_assume(family: Family) -> None:
    """Steps 2 and 3 of the first branch went to the server; the second branch's steps are
    sim's (no server) on top of a root whose steps went to the server."""
    j = family.journal
    assert j.run(family.to_openai).label.startswith("do_policy@2 ")
    assert j.run(family.to_sim).label.startswith("do_policy@0 ")
    assert [c.server for k in (2, 3) for c in calls(j, family.to_openai, k)] == [
        family.base_url
    ] * 2
    assert [c.server for k in (0, 1) for c in calls(j, family.openai_root, k)] == [
        family.base_url
    ] * 2
    assert [c.server for k in (0, 1) for c in calls(j, family.to_sim, k)] == [None, None]


# ------------------------------------------------------------------ overrides


def test_a_fork_after_a_swap_to_openai_takes_server_flags(family: Family) -> None:
    """--base-url/--timeout on a fork of the sim->openai branch at step 3 apply to the openai
    policy deciding there (they were refused: "does not apply to policy sim", the root's),
    and reach it: the branch's call goes to the URL given, here a closed port, so it fails."""
    dead = closed_port_url()
    rep = fork(
        family.journal,
        family.to_openai,
        DoResample(3),
        1,
        rerun=Rerun(policy_override={"base_url": dead, "timeout": "5"}),
    )
    (b,) = rep.branches
    assert b.status == "failed" and b.run_id, b
    assert [c.server for c in calls(family.journal, b.run_id, 3)] == [dead]


def test_a_fork_after_a_swap_to_sim_refuses_server_flags(family: Family) -> None:
    """--base-url on a fork of the openai->sim branch at step 1, decided by sim: refused before
    any branch is made, naming sim, the step and the swap (it was accepted, as the root's
    openai takes it, and silently ignored by sim)."""
    before = run_count(family.path)
    with pytest.raises(InterventionError) as e:
        fork(
            family.journal,
            family.to_sim,
            DoResample(1),
            1,
            rerun=Rerun(policy_override={"base_url": family.base_url}),
        )
    msg = str(e.value)
    assert msg.startswith("--base-url does not apply to policy sim (")
    assert "step 1" in msg and family.to_sim in msg and "sim at step 0" in msg
    assert "\n" not in msg
    assert run_count(family.path) == before


def test_a_fork_at_the_swap_step_checks_the_runs_own_policy(family: Family) -> None:
    """A fork at the swap step replaces the swap: the run's own policy (sim) decides, so
    --base-url is refused, and the error says where the swap applies."""
    with pytest.raises(InterventionError) as e:
        fork_many(
            family.journal, family.to_openai, DoResample(2), 1, policy_override={"model": "m"}
        )
    msg = str(e.value)
    assert msg.startswith("--model does not apply to policy sim (")
    assert "step 2" in msg and "openai at step 2" in msg


def test_an_attribution_sends_server_flags_to_the_branches_whose_policy_takes_them(
    family: Family,
) -> None:
    """Forward runs fork at any step: on the openai->sim branch step 0 is the root's openai,
    step 1 sim. --base-url (refused before: sim does not take it) goes to the branches openai
    decides - one forked at step 0 calls the URL given, a closed port, and fails - while one
    forked at step 1 runs sim as it would without the flag, under the same key: a run
    without the flag reuses it. As `car fidelity` applies the flags to the steps whose
    deciding policy takes them."""
    from engine.interventions import BranchSpec, check_override

    j, run = family.journal, family.to_sim
    dead = closed_port_url()
    model = scenario_of_run(j, run).forward_model(
        j, run, Rerun(policy_override={"base_url": dead, "timeout": "5"})
    )
    model.close()
    parent = parent_info(j, run)
    override = check_override(j, parent, {"base_url": dead, "timeout": "5"}, where_taken=True)
    specs = [BranchSpec(DoResample(0), 71), BranchSpec(DoResample(1), 72)]
    with BranchRunner(j, parent, policy_override=override, reuse=True) as r:
        at0, at1 = r.run(specs)
    assert (at0.status, at1.status) == ("failed", "completed")
    assert [c.server for c in calls(j, at0.run_id, 0)] == [dead]
    assert [c.server for c in calls(j, at1.run_id, 1)] == [None]
    with BranchRunner(j, parent, reuse=True) as r:
        (again,) = r.run(specs[1:])
        assert (r.reused, again.run_id) == (1, at1.run_id)


def test_an_attribution_refuses_flags_no_policy_in_force_takes(family: Family) -> None:
    """Refused in one line before any branch runs when no step's policy takes the flags: a
    sim run with --base-url; the openai->sim branch with --model and --drift (openai takes
    the one, sim the other, neither both)."""
    j = family.journal
    with pytest.raises(InterventionError, match=r"^--base-url does not apply to policy sim$"):
        scenario_of_run(j, family.sim_root).forward_model(
            j, family.sim_root, Rerun(policy_override={"base_url": family.base_url})
        )
    with pytest.raises(InterventionError, match=r"^--drift does not apply to policy openai \("):
        scenario_of_run(j, family.to_sim).forward_model(
            j, family.to_sim, Rerun(policy_override={"model": "m", "drift": "0.1"})
        )


# ------------------------------------------------------------------ where branches run


def test_a_fork_decided_by_a_server_runs_in_threads(family: Family) -> None:
    """-c 2 at step 3 of the sim->openai branch: two threads waiting on the server (it forked
    worker processes for the root's sim)."""
    rep = fork(
        family.journal,
        family.to_openai,
        DoResample(3),
        2,
        rerun=Rerun(2, {"base_url": closed_port_url(), "timeout": "5"}),
    )
    assert rep.executor is not None
    assert (rep.executor["workers"], rep.executor["busy_s"]) == (2, None)
    assert [b.status for b in rep.branches] == ["failed", "failed"]


def test_a_fork_decided_by_sim_runs_in_processes(family: Family) -> None:
    """-c 2 at step 1 of the openai->sim branch: the command and a forked worker process
    (it ran threads for the root's openai); a do_policy swapping sim into the openai root
    too."""
    rep = fork(family.journal, family.to_sim, DoResample(1), 2, rerun=Rerun(2))
    assert rep.executor is not None and rep.executor["busy_s"] is not None
    assert len(rep.executor["busy_s"]) == 2
    assert [b.status for b in rep.branches] == ["completed", "completed"]
    rep = fork(family.journal, family.openai_root, DoPolicy(1, {"name": "sim"}), 2, rerun=Rerun(2))
    assert rep.executor is not None and rep.executor["busy_s"] is not None
    assert [b.status for b in rep.branches] == ["completed", "completed"]


def test_a_runner_over_every_step_of_a_mixed_branch_waits_in_threads(family: Family) -> None:
    """A forward model forks at any step: sim decides some, the server others, so its branches
    run in threads (inline before: the root's sim)."""
    j = family.journal
    with BranchRunner(j, parent_info(j, family.to_openai)) as r:
        assert r.mode == "threads"
    with BranchRunner(j, parent_info(j, family.sim_root), concurrency=2) as r:
        assert r.mode == "processes"


# ------------------------------------------------------------------ the command line


def test_cli_fork_after_the_swap_with_a_server_flag(family: Family) -> None:
    """`car fork BRANCH --at 3 --base-url URL` runs the openai step against URL (one real
    call): refused before ("--base-url does not apply to policy sim")."""
    alt = family.base_url.replace("127.0.0.1", "localhost")
    p = car(
        family.path,
        "fork", family.to_openai, "--at", "3", "--do", "resample", "-n", "1",
        "--base-url", alt, "--model", "smollm2", "--timeout", str(CALL_TIMEOUT), "--json",
        timeout=CLI_TIMEOUT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    (b,) = json.loads(p.stdout)["branches"]
    assert b["status"] == "completed", b
    assert [c.server for c in calls(family.journal, b["run_id"], 3)] == [alt]


def test_cli_refuses_a_server_flag_where_sim_decides(family: Family) -> None:
    """`car fork` of the openai->sim branch after its swap with --base-url: one `error:` line
    naming the policy in force, exit 1, no branch (it ran branches that ignored the flag)."""
    before = run_count(family.path)
    p = car(
        family.path,
        "fork", family.to_sim, "--at", "1", "--do", "resample", "-n", "1",
        "--base-url", family.base_url,
    )  # fmt: skip
    assert p.returncode == 1, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("error: --base-url does not apply to policy sim ("), lines[0]
    assert family.to_sim in lines[0] and "Traceback" not in p.stderr
    assert run_count(family.path) == before


# ------------------------------------------------------------------ fidelity


def test_fidelity_sends_a_swapped_in_servers_steps_to_the_url_given(family: Family) -> None:
    """`car fidelity` of the sim->openai branch with --base-url: the steps openai decided (2,
    3) go to the URL given (a closed port: they fail at once, and the report says so), the
    steps sim decided replay as they were (the flag was refused: "does not apply to policy
    sim", the root's)."""
    from engine.errors import PolicyError
    from engine.replay import fidelity

    dead = closed_port_url()
    with pytest.raises(PolicyError, match="unreachable") as e:
        fidelity(
            family.journal, family.to_openai, policy_override={"base_url": dead, "timeout": "5"}
        )
    assert dead in str(e.value)


def test_fidelity_refuses_a_server_flag_no_deciding_policy_takes(family: Family) -> None:
    """The openai->sim branch: sim decided every step, so --base-url reaches nothing; refused
    in one line naming the steps sim decided (it was accepted, as the root's openai takes it,
    and silently unused)."""
    p = car(family.path, "fidelity", family.to_sim, "--base-url", family.base_url)
    assert p.returncode == 1, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert (
        "--base-url does not apply to policy sim (the policy that decided steps 0..1)" in (lines[0])
    )
