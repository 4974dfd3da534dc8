"""engine/branching.py, pinned: what `fork` and `attribute` hand on to a scenario, and what the
heist's forward model answers on its own (written against the survivors of its first mutation
run, docs/testing.md)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import events as ev
from engine.branching import BranchForwardModel, attribute, fork
from engine.errors import ConfigError, EngineError, InterventionError
from engine.executors.base import ExecutorOptions
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.interventions import DoResample, fork_many
from engine.journal import Journal
from engine.runtime.control import ControlChannel
from engine.scenario import Rerun


@pytest.fixture()
def journal(failed_heist: tuple[Path, str]) -> Iterator[tuple[Journal, str]]:
    path, run = failed_heist
    with Journal(path) as j:
        yield j, run


def _said(j: Journal, run_id: str, after: int) -> list[str]:
    """What the run's agents said from step `after` on: it differs with a branch's seed."""
    return [
        e.text
        for e in j.events(run_id)
        if isinstance(e, ev.ChatMessage) and e.step is not None and e.step >= after
    ]


# ------------------------------------------------------------------ attribute


def test_attribute_refuses_an_unknown_method_and_players_for_contrastive(
    journal: tuple[Journal, str],
) -> None:
    """Both are refused in one line before any branch is made."""
    j, run = journal
    before = len(j.children(run))
    with pytest.raises(ConfigError) as bad:
        attribute(j, run, method="magic")
    assert str(bad.value) == "unknown method 'magic'; expected one of: contrastive, shapley"
    with pytest.raises(ConfigError) as players:
        attribute(j, run, method="contrastive", players="agents")
    assert str(players.value) == "--players applies to --method shapley only"
    assert len(j.children(run)) == before


def test_the_library_the_cli_and_the_api_default_alike() -> None:
    """`attribute()`'s defaults are the ones `car attribute` and POST .../attribution
    document: a caller of any of the three gets the same attribution."""
    from engine.commands.counterfactual import attribute_cmd
    from engine.server.app import AttributionRequest

    lib = inspect.signature(attribute).parameters
    cli = inspect.signature(attribute_cmd).parameters
    api = AttributionRequest.model_fields
    for name in ("players", "budget", "seed", "half_width", "all_steps"):
        assert lib[name].default == cli[name].default == api[name].default, name
    assert cli["method"].default == api["method"].default == "contrastive"
    assert (lib["budget"].default, lib["seed"].default, lib["all_steps"].default) == (
        2000,
        0,
        False,
    )


def test_attribute_without_seed_or_all_steps_uses_the_defaults(
    journal: tuple[Journal, str],
) -> None:
    """Seed 0 (the branches of an explicit seed 0 are read back) and the scan stopped at the
    point of commitment (on this heist seed 0 finds none: every step is estimated)."""
    j, run = journal
    explicit = attribute(j, run, method="contrastive", seed=0, all_steps=False)
    implicit = attribute(j, run, method="contrastive")
    assert implicit["branches_added"] == 0
    assert implicit["branches_reused"] == implicit["forward_runs"] == explicit["forward_runs"]
    assert implicit["all_steps"] is False and implicit["ranked"] == explicit["ranked"]
    locus = implicit["locus"]
    assert len(implicit["detail"]["steps"]) == (24 if locus is None else 24 - locus)


def test_attribute_reports_the_whole_run_id_its_progress_and_its_executor(
    journal: tuple[Journal, str],
) -> None:
    j, run = journal
    seen: list[tuple[int, int | None]] = []
    out = attribute(
        j, run[:6], method="contrastive", seed=11, progress=lambda d, t: seen.append((d, t))
    )
    assert out["run_id"] == run
    assert seen and seen[-1][0] == out["forward_runs"] > 0
    assert out["executor"]["name"] == "local" and out["executor"]["workers"] == 1
    assert out["executor"]["lost"] == 0


def test_attribute_hands_k_and_all_steps_on(journal: tuple[Journal, str]) -> None:
    """A fixed number of runs per step and every step estimated, as asked."""
    j, run = journal
    out = attribute(j, run, method="contrastive", k=3, all_steps=True, seed=12)
    steps = out["detail"]["steps"]
    assert out["all_steps"] is True and len(steps) == 24
    assert {s["n"] for s in steps} == {3}
    assert out["forward_runs"] == 3 * 24


def test_attribute_hands_its_rerun_on(journal: tuple[Journal, str]) -> None:
    """`reuse=False` runs again what an earlier attribution made; `concurrency` reaches the
    executor."""
    j, run = journal
    first = attribute(j, run, method="contrastive", k=2, seed=13)
    again = attribute(j, run, method="contrastive", k=2, seed=13, rerun=Rerun(reuse=False))
    assert again["branches_reused"] == 0
    assert again["branches_added"] == again["forward_runs"] == first["forward_runs"]
    wide = attribute(j, run, method="contrastive", k=2, seed=13, rerun=Rerun(concurrency=2))
    assert wide["executor"]["workers"] == 2
    assert wide["branches_reused"] == wide["forward_runs"]


REFUSED = (
    "this is a 'heist' run, not a recorded program; `-- CMD` is only for runs made by car record"
)


def test_a_heist_refuses_a_program_command(journal: tuple[Journal, str]) -> None:
    j, run = journal
    program = Rerun(command=("python", "agents.py"))
    with pytest.raises(ConfigError) as e:
        attribute(j, run, method="contrastive", rerun=program)
    assert str(e.value) == REFUSED
    with pytest.raises(ConfigError) as f:
        fork(j, run, DoResample(k=20), 1, rerun=program)
    assert str(f.value) == REFUSED


def test_a_policy_override_is_checked_against_the_recorded_policy_and_used(
    journal: tuple[Journal, str],
) -> None:
    """`--drift` applies to the sim policy the heist was recorded with, as a number, and
    makes branches of their own; `--base-url` does not apply to it."""
    j, run = journal
    plain = attribute(j, run, method="contrastive", k=2, seed=14)
    drift = attribute(
        j, run, method="contrastive", k=2, seed=14, rerun=Rerun(policy_override={"drift": "0.3"})
    )
    assert plain["branches_added"] > 0
    assert drift["branches_reused"] == 0 and drift["branches_added"] == drift["forward_runs"] > 0
    again = attribute(
        j, run, method="contrastive", k=2, seed=14, rerun=Rerun(policy_override={"drift": 0.3})
    )
    assert again["branches_added"] == 0
    with pytest.raises(InterventionError) as e:
        attribute(
            j, run, method="contrastive", rerun=Rerun(policy_override={"base_url": "http://x"})
        )
    assert str(e.value) == "--base-url does not apply to policy sim"


def test_an_executor_asked_for_is_the_one_used(journal: tuple[Journal, str]) -> None:
    """Ray workers cannot open a SQLite file: the Ray executor asked for refuses it."""
    j, run = journal
    ray = Rerun(executor=ExecutorOptions(kind="ray"))
    with pytest.raises(ConfigError, match="--executor ray needs a PostgreSQL journal"):
        attribute(j, run, method="contrastive", k=2, rerun=ray)
    with pytest.raises(ConfigError, match="--executor ray needs a PostgreSQL journal"):
        fork(j, run, DoResample(k=20), 1, rerun=ray)


# ------------------------------------------------------------------ fork


def test_fork_hands_everything_to_the_scenario(journal: tuple[Journal, str]) -> None:
    """`fork` is `fork_many` for a heist: the same branches for the same arguments (their
    seeds decide what the agents say), progress reported, `reuse` irrelevant."""
    j, run = journal
    calls: list[tuple[int, int | None]] = []
    got = fork(j, run, DoResample(k=20), 4, seed=5, progress=lambda d, t: calls.append((d, t)))
    want = fork_many(j, run, DoResample(k=20), 4, seed=5)
    unseeded = fork(j, run, DoResample(k=20), 2)
    assert [_said(j, b.run_id, 20) for b in unseeded.branches] == [
        _said(j, b.run_id, 20) for b in fork_many(j, run, DoResample(k=20), 2, seed=0).branches
    ]
    drift = fork(j, run, DoResample(k=20), 2, rerun=Rerun(policy_override={"drift": "1"}))
    assert [_said(j, b.run_id, 20) for b in drift.branches] != [
        _said(j, b.run_id, 20) for b in unseeded.branches
    ]
    assert got.parent == run and got.at == 20 and len(got.branches) == 4
    assert [_said(j, b.run_id, 20) for b in got.branches] == [
        _said(j, b.run_id, 20) for b in want.branches
    ]
    other = fork(j, run, DoResample(k=20), 4, seed=6)
    assert [_said(j, b.run_id, 20) for b in other.branches] != [
        _said(j, b.run_id, 20) for b in got.branches
    ]
    assert calls[-1] == (4, 4)
    # the scenario's own fork, called without a seed, is seed 0 too
    from engine.scenario import scenario_of_run

    direct = scenario_of_run(j, run).fork(j, run, DoResample(k=20), 2)
    assert [_said(j, b.run_id, 20) for b in direct.branches] == [
        _said(j, b.run_id, 20) for b in unseeded.branches
    ]
    wide = fork(j, run, DoResample(k=20), 2, rerun=Rerun(concurrency=2))
    assert wide.executor is not None and wide.executor["workers"] == 2


# ------------------------------------------------------------------ the forward model


def test_the_forward_model_refuses_a_run_that_did_not_complete(tmp_path: Path) -> None:
    stop = ControlChannel()
    stop.request("stop")
    with Journal(tmp_path / "j.db") as j:
        run = record_heist(j, SimPolicy(), seed=7, control=stop).run_id
        with pytest.raises(InterventionError) as e:
            BranchForwardModel(j, run)
    assert str(e.value) == f"run {run!r} is stopped; attribution needs a completed run"


def test_the_forward_model_refuses_a_run_that_did_not_fail(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db") as j:
        for seed in range(300, 400):
            r = record_heist(j, SimPolicy(), seed=seed, no_mole=True)
            if not r.outcome.get("bad"):
                break
        else:
            raise AssertionError("no successful heist in 100 seeds")
        with pytest.raises(InterventionError) as e:
            BranchForwardModel(j, r.run_id)
    assert str(e.value) == (
        f"run {r.run_id!r} did not fail (its outcome is ok); attribution explains a bad outcome"
    )


def test_the_forward_model_reads_the_run(journal: tuple[Journal, str]) -> None:
    """Its steps, agents, labels and messages are the recorded run's."""
    j, run = journal
    events = j.events(run)
    agents = {e.step: e.agent for e in events if isinstance(e, ev.ChatMessage)}
    said = {e.step: e.text for e in events if isinstance(e, ev.ChatMessage)}
    with BranchForwardModel(j, run) as model:
        assert model.n_steps == 24 and model.run_id == run
        assert list(model.step_agents) == [agents[k] for k in range(24)]
        assert list(model.step_labels) == [f"{k}:{agents[k]}" for k in range(24)]
        assert [model.message(k) for k in range(24)] == [said[k] for k in range(24)]
        assert model.message(24) == ""


def test_every_step_kept_is_the_recorded_outcome_without_a_branch(
    journal: tuple[Journal, str],
) -> None:
    from engine.attribution.base import ForwardRequest

    j, run = journal
    before = len(j.children(run))
    with BranchForwardModel(j, run) as model:
        every = frozenset(range(24))
        assert model.run_batch([ForwardRequest(keep=every, branch_seed=s) for s in (1, 2)]) == [
            True,
            True,
        ]
        assert model.forward_runs == 0 and model.created == 0
    assert len(j.children(run)) == before


def test_the_forward_model_defaults_and_what_it_hands_its_runner(
    journal: tuple[Journal, str],
) -> None:
    """One process, reuse on, the recorded policy; a concurrency, an executor and a policy
    override given reach the branch runner."""
    from engine.attribution.base import ForwardRequest

    j, run = journal
    asks = [ForwardRequest(keep=frozenset(range(22)), branch_seed=s) for s in (31, 32)]
    with BranchForwardModel(j, run) as model:
        first = model.run_batch(asks)
        stats = model.executor_stats()
        assert stats["name"] == "local" and stats["workers"] == 1
    with BranchForwardModel(j, run) as model:
        assert model.run_batch(asks) == first
        assert (model.reused, model.created) == (2, 0)
    with BranchForwardModel(j, run, reuse=False, concurrency=2) as model:
        assert model.run_batch(asks) == first
        assert (model.reused, model.created) == (0, 2)
        assert model.executor_stats()["workers"] == 2
    # Ray workers cannot open a SQLite file: the executor asked for is the one refusing it
    ray = ExecutorOptions(kind="ray")
    with (
        pytest.raises(ConfigError, match="--executor ray needs a PostgreSQL journal"),
        BranchForwardModel(j, run, executor=ray) as model,
    ):
        model.run_batch(asks)
    with BranchForwardModel(j, run, policy_override={"drift": 0.2}) as model:
        # another policy configuration is another branch: nothing of the above is reused
        model.run_batch(asks)
        assert (model.reused, model.created) == (0, 2)


def test_the_forward_model_tells_its_runner_whether_it_was_left_by_an_error(
    journal: tuple[Journal, str],
) -> None:
    """An exception stops the workers at once (interrupted); a normal exit lets them finish."""
    j, run = journal
    flags: list[Any] = []

    def spy(model: BranchForwardModel) -> None:
        close = model.runner.close

        def recorded(interrupted: bool = False) -> None:
            flags.append(interrupted)
            close(interrupted=interrupted)

        model.runner.close = recorded  # type: ignore[method-assign]

    with BranchForwardModel(j, run) as model:
        spy(model)
    with pytest.raises(RuntimeError), BranchForwardModel(j, run) as model:
        spy(model)
        raise RuntimeError("left")
    assert flags == [False, True]


def test_the_steps_kept_after_the_resampled_one_are_forced_to_the_recorded_actions(
    journal: tuple[Journal, str],
) -> None:
    """keep = every step but 20: step 20 is re-decided, 21-23 say what they said."""
    from engine.attribution.base import ForwardRequest

    j, run = journal
    said = _said(j, run, 20)
    keep = frozenset(k for k in range(24) if k != 20)
    before = {r.run_id for r in j.children(run)}
    with BranchForwardModel(j, run) as model:
        model.run_batch([ForwardRequest(keep=keep, branch_seed=s) for s in range(41, 47)])
        assert model.created == 6
    branches = [r.run_id for r in j.children(run) if r.run_id not in before]
    assert len(branches) == 6
    for b in branches:
        assert _said(j, b, 21) == said[1:]
    assert any(_said(j, b, 20)[0] != said[0] for b in branches)


def test_a_failed_forward_run_is_an_error_naming_it(journal: tuple[Journal, str]) -> None:
    """A policy that cannot be made fails the branch, and the batch says why."""
    from engine.attribution.base import ForwardRequest

    j, run = journal
    ask = ForwardRequest(keep=frozenset(range(22)), branch_seed=1)
    with (
        BranchForwardModel(j, run, policy_override={"drift": "hot"}) as model,
        pytest.raises(EngineError) as e,
    ):
        model.run_batch([ask])
    assert str(e.value).startswith("a forward run failed (failed): bad sim policy spec")
