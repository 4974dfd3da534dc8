"""Replay, the five do() operations, fork distributions and the fidelity report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import events as ev
from engine.errors import InterventionError
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.interventions import (
    DoAction,
    DoContext,
    DoObservation,
    DoPolicy,
    DoResample,
    fork_many,
    parent_info,
    parse_intervention,
    run_branch,
)
from engine.journal import Journal
from engine.policies.registry import HonestPolicy
from engine.replay import check_requests, fidelity
from engine.runtime.seeds import branch_stream, step_seed
from engine.state import state_at

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[Journal, str]:
    j = Journal(tmp_path / "j.db")
    r = record_heist(j, SimPolicy(), seed=21, mole="intel", strategy="FALSE_INFO")
    yield j, r.run_id
    j.close()


def own_events(j: Journal, run: str) -> list[ev.AnyEvent]:
    info = j.run(run)
    assert info.fork_seq is not None
    return [s.event for s in j.read(run, info.fork_seq)]


def test_prefix_untouched_and_read_from_parent(recorded: tuple[Journal, str]) -> None:
    """Steps before k are the parent's own rows, byte for byte; the branch starts with do()."""
    j, run = recorded
    parent = parent_info(j, run)
    branch = run_branch(j, parent, DoResample(7), branch_seed=5)
    info = j.run(branch.run_id)
    prefix = list(j.read(branch.run_id, 0, info.fork_seq))
    assert {s.run_id for s in prefix} == {run}
    assert [s.payload for s in prefix] == [s.payload for s in j.read(run, 0, info.fork_seq)]
    first = own_events(j, branch.run_id)[0]
    assert isinstance(first, ev.Intervention) and first.op == "resample" and first.at == 7
    assert state_at(j, branch.run_id, 7).transcript == state_at(j, run, 7).transcript
    assert j.verify().ok


def test_do_resample_redraws_with_branch_seed(recorded: tuple[Journal, str]) -> None:
    """do_resample re-decides step k and later steps with the branch's seeds: drawn from the
    branch seed mixed with the run's (secret) root seed, not from the public branch seed alone
    (decision 62)."""
    j, run = recorded
    branch = run_branch(j, parent_info(j, run), DoResample(3), branch_seed=99)
    calls = [e for e in own_events(j, branch.run_id) if isinstance(e, ev.LlmCall)]
    assert [c.step for c in calls] == list(range(3, 24))
    assert [c.seed for c in calls] == [step_seed(branch_stream(21, 99), k) for k in range(3, 24)]
    assert not {c.seed for c in calls} & {step_seed(99, k) for k in range(3, 24)}
    assert calls[0].seed != step_seed(21, 3)


def test_do_action_forces_the_message(recorded: tuple[Journal, str]) -> None:
    """do_action makes a_k exactly the given text, tools in it run against the same world."""
    j, run = recorded
    text = "Checking. [TOOL:calculator:6*7] [PLAN:route=harbour_tunnel]"
    branch = run_branch(j, parent_info(j, run), DoAction(4, text), branch_seed=1)
    mine = own_events(j, branch.run_id)
    msg = next(e for e in mine if isinstance(e, ev.ChatMessage))
    assert msg.step == 4 and msg.text == text
    result = next(e for e in mine if isinstance(e, ev.ToolResult))
    assert result.ok and result.output == "42"


def test_do_observation_replaces_the_tool_result(recorded: tuple[Journal, str]) -> None:
    """do_observation keeps a_k and replaces its tool result; the agent later sees the new one."""
    j, run = recorded
    parent = parent_info(j, run)
    k = min(parent.tool_steps)
    branch = run_branch(j, parent, DoObservation(k, "nothing found"), branch_seed=2)
    mine = own_events(j, branch.run_id)
    msg = next(e for e in mine if isinstance(e, ev.ChatMessage))
    assert msg.text == parent.actions[k]
    result = next(e for e in mine if isinstance(e, ev.ToolResult))
    assert result.output == "nothing found"
    agent = msg.agent
    later = state_at(j, branch.run_id, k + 1).contexts[agent].observations
    assert next(o for o in later if o.step == k).output == "nothing found"


def test_do_context_edits_the_history(recorded: tuple[Journal, str]) -> None:
    """do_context replaces an earlier message in what every later step sees."""
    j, run = recorded
    edit = {"step": 1, "text": "[PLAN:guard_gap=03:00-03:30]"}
    branch = run_branch(j, parent_info(j, run), DoContext(6, edit), branch_seed=3)
    s7 = state_at(j, branch.run_id, 7)
    texts = {line.step: line.text for line in s7.transcript}
    assert texts[1] == "[PLAN:guard_gap=03:00-03:30]"
    assert state_at(j, run, 7).transcript[1].text != texts[1]
    added = run_branch(j, parent_info(j, run), DoContext(6, {"text": "note"}), branch_seed=3)
    lines = state_at(j, added.run_id, 7).transcript
    assert any(line.agent == "context" and line.text == "note" for line in lines)


def test_honest_policy_hides_the_strategy(recorded: tuple[Journal, str]) -> None:
    """sim-honest decides for the mole exactly as the sim policy decides for an honest agent."""
    import msgspec

    from engine.heist.session import HeistScenario

    j, run = recorded
    s = state_at(j, run, 3)  # step 3 is intel's turn: the mole
    scenario = HeistScenario.from_state(s)
    view = scenario.view(s, run)
    assert view.mole_strategy == "FALSE_INFO"
    honest_view = msgspec.structs.replace(view, mole_strategy=None)
    msgs = scenario.messages(view)
    sim = SimPolicy()
    for seed in range(30):
        assert HonestPolicy(sim).decide(view, msgs, seed) == sim.decide(honest_view, msgs, seed)


def test_do_policy_honest_mole_lowers_the_bad_rate(tmp_path: Path) -> None:
    """Over many branches, replacing the mole's policy by an honest one from step 0 fails less
    often than resampling under the mole's own policy (a causal, statistical claim)."""
    with Journal(tmp_path / "j.db") as j:
        rates = {"resample": [], "honest": []}  # type: ignore[var-annotated]
        for seed in (31, 32, 33):
            r = record_heist(j, SimPolicy(), seed=seed, strategy="FALSE_INFO")
            a = fork_many(j, r.run_id, DoResample(0), 40, seed=seed)
            b = fork_many(j, r.run_id, DoPolicy(0, {"name": "sim-honest"}), 40, seed=seed)
            rates["resample"].append(a.bad)
            rates["honest"].append(b.bad)
    assert sum(rates["honest"]) < sum(rates["resample"]), rates


def test_fork_report_distribution(recorded: tuple[Journal, str]) -> None:
    """fork_many gives N branches, a bad rate and a Wilson interval that contains it."""
    j, run = recorded
    rep = fork_many(j, run, DoResample(2), 12, seed=4)
    assert len(rep.branches) == 12 and rep.scored == 12
    assert rep.ci is not None and rep.bad_rate is not None
    assert rep.ci[0] <= rep.bad_rate <= rep.ci[1]
    assert len(j.children(run)) == 12


def test_concurrent_branches_equal_sequential(tmp_path: Path) -> None:
    """Branches run in worker processes give the same outcomes as run one by one."""
    with Journal(tmp_path / "j.db") as j:
        r = record_heist(j, SimPolicy(), seed=12)
        seq = fork_many(j, r.run_id, DoResample(1), 8, seed=7, concurrency=1)
        par = fork_many(j, r.run_id, DoResample(1), 8, seed=7, concurrency=2)
        assert [b.bad for b in seq.branches] == [b.bad for b in par.branches]
        assert j.verify().ok


@pytest.mark.parametrize(
    ("iv", "message"),
    [
        (DoResample(24), "out of range"),
        (DoResample(-1), "out of range"),
        (DoPolicy(2, {"name": "gpt-9"}), "unknown policy"),
        (DoContext(3, {"step": 5, "text": "x"}), "earlier step"),
    ],
)
def test_bad_interventions(recorded: tuple[Journal, str], iv: object, message: str) -> None:
    """Interventions that do not fit the run are refused with a clear error, no branch made."""
    j, run = recorded
    with pytest.raises(InterventionError, match=message):
        run_branch(j, parent_info(j, run), iv, branch_seed=1)  # type: ignore[arg-type]
    assert j.children(run) == []


def test_observation_needs_a_tool_call(recorded: tuple[Journal, str]) -> None:
    """do_observation on a step without a tool call is refused, naming the steps that qualify."""
    j, run = recorded
    parent = parent_info(j, run)
    quiet = next(k for k in range(parent.steps) if k not in parent.tool_steps)
    with pytest.raises(InterventionError, match="needs a step with a tool call"):
        run_branch(j, parent, DoObservation(quiet, "x"), branch_seed=1)


def test_fork_of_recording_run_refused(tmp_path: Path) -> None:
    """A run that has not ended cannot be forked."""
    with Journal(tmp_path / "j.db") as j:
        run = j.create_run("heist")
        j.append(
            run,
            [
                ev.RunStarted(
                    scenario="heist",
                    config={},
                    agents=["a"],
                    policy={"name": "sim"},
                    root_seed=1,
                    engine_version="t",
                    started_at="t",
                ),
                ev.ChatMessage(step=0, agent="a", text="hi"),
            ],
        )
        with pytest.raises(InterventionError, match="still recording"):
            fork_many(j, run, DoResample(0), 1)


@pytest.mark.parametrize(
    ("op", "value", "message"),
    [
        ("teleport", None, "unknown operation 'teleport'"),
        ("action", None, "needs --value"),
        ("resample", "x", "takes no --value"),
        ("context", "{not json", "not valid JSON"),
        ("policy", "gpt-9", "unknown policy 'gpt-9'"),
    ],
)
def test_parse_intervention_errors(op: str, value: str | None, message: str) -> None:
    """Malformed CLI interventions are refused with a message naming the problem."""
    with pytest.raises(InterventionError, match=message):
        parse_intervention(op, 1, value)


def test_replay_rebuilds_recorded_requests(recorded: tuple[Journal, str]) -> None:
    """The conversation rebuilt from the journal equals what each policy call was sent."""
    j, run = recorded
    check = check_requests(j, run)
    assert check.ok and check.steps_checked == 24


def test_fidelity_of_sim_is_one(recorded: tuple[Journal, str]) -> None:
    """A sim run re-executes at action-match rate 1.0, exact and normalised."""
    j, run = recorded
    rep = fidelity(j, run)
    assert rep.action_match_rate == 1.0 and rep.exact_match_rate == 1.0
    assert rep.divergences == [] and set(rep.per_agent) == {
        "planner",
        "hacker",
        "safecracker",
        "intel",
        "driver",
        "lookout",
    }


def test_fidelity_measures_known_drift(tmp_path: Path) -> None:
    """With the drift knob at d, the exact-match rate falls by about d times the chance that a
    re-drawn action differs; at 0 it is 1, and it falls monotonically with d (many steps). The
    drift source is seeded (drift_seed = 1000 + i for heist i, printed on failure), so the
    claim is checked on the same draws every time."""
    with Journal(tmp_path / "j.db") as j:
        runs = [record_heist(j, SimPolicy(), seed=s).run_id for s in range(40, 50)]

        def at(d: float, i: int) -> dict[str, float | int]:
            return {"drift": d, "drift_seed": 1000 + i}

        # how often a freshly drawn action differs from the recorded one at all
        redraw = [fidelity(j, r, policy_override=at(1.0, i)) for i, r in enumerate(runs)]
        q = 1 - sum(x.exact_match_rate or 0 for x in redraw) / len(redraw)
        rates = {}
        for d in (0.0, 0.25, 0.5):
            reps = [fidelity(j, r, policy_override=at(d, i)) for i, r in enumerate(runs)]
            rates[d] = sum(x.exact_match_rate or 0 for x in reps) / len(reps)
    assert rates[0.0] == 1.0
    assert q > 0.5
    n = 240
    for d in (0.25, 0.5):
        expected = 1 - d * q
        sd = (expected * (1 - expected) / n) ** 0.5
        assert abs(rates[d] - expected) < 4 * sd + 0.02, (d, rates[d], expected)
    assert rates[0.5] < rates[0.25] < rates[0.0]


def test_fidelity_reports_divergence_diagnosis(recorded: tuple[Journal, str]) -> None:
    """Each divergence names step, agent, a short diff and its likely provenance."""
    j, run = recorded
    rep = fidelity(j, run, policy_override={"drift": 1.0})
    assert rep.divergences
    d = rep.divergences[0]
    assert set(d) >= {"step", "agent", "recorded", "new", "diff", "provenance"}
    assert "drift" in d["provenance"]["explanation"]


def test_cli_fork_and_fidelity(tmp_path: Path) -> None:
    """From the CLI: record, fidelity 1.0, fork with each op, and the branch tree in `show`."""
    jp = tmp_path / "j.db"

    def car(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cli", "--journal", str(jp), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )

    run = json.loads(car("heist", "--seed", "5", "--json").stdout)["run_id"]
    fid = json.loads(car("fidelity", run, "--json").stdout)
    assert fid["action_match_rate"] == 1.0
    assert set(fid) >= {
        "run_id",
        "steps",
        "action_match_rate",
        "exact_match_rate",
        "per_agent",
        "divergences",
    }
    with Journal(jp) as j:
        tool_step = min(parent_info(j, run).tool_steps)
    obs_file = tmp_path / "obs.txt"
    obs_file.write_text("name|start_time|end_time\nnobody|00:00|06:00")
    for op, at, value in [
        ("resample", 3, None),
        ("action", 3, "Copy that."),
        ("observation", tool_step, "@" + str(obs_file)),
        ("context", 3, "hello"),
        ("policy", 3, "sim-honest"),
    ]:
        args = ["fork", run, "--at", str(at), "--do", op, "-n", "3", "--json"]
        if value and value.startswith("@"):
            args += ["--value-file", value[1:]]
        elif value:
            args += ["--value", value]
        res = car(*args)
        assert res.returncode == 0, res.stderr
        data = json.loads(res.stdout)
        assert set(data) >= {"parent", "at", "op", "branches", "bad_rate", "ci"}
        assert data["op"] == op and len(data["branches"]) == 3
    bad = car("fork", run, "--at", "99", "--do", "resample")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "out of range" in bad.stderr
    shown = car("show", run)
    assert "@step 3 resample" in shown.stdout
    listed = json.loads(car("runs", "--all", "--json").stdout)
    assert sum(1 for r in listed if r["parent_run_id"] == run) == 15


def test_replay_names_first_request_divergence(recorded: tuple[Journal, str]) -> None:
    """When a recorded request differs from the rebuilt one, the check names the first step,
    the message and the fields that differ; fidelity refuses to call that a replay."""
    import msgspec

    from engine.errors import ReplayDivergence

    j, run = recorded
    copy = j.create_run("heist")
    events = [s.event for s in j.read(run)]
    for i, e in enumerate(events):
        if isinstance(e, ev.LlmCall) and e.step == 5:
            request = [dict(m) for m in e.request]
            request[-1]["content"] += " (edited)"
            events[i] = msgspec.structs.replace(e, request=request)
    j.append(copy, events, 0)
    check = check_requests(j, copy)
    assert not check.ok and check.first_divergence is not None
    d = check.first_divergence
    assert d["step"] == 5 and d["fields"] == ["content"]
    assert isinstance(d["message_index"], int)
    assert d["recorded"]["content"].endswith("(edited)")
    assert not d["rebuilt"]["content"].endswith("(edited)")
    with pytest.raises(ReplayDivergence, match="step 5"):
        fidelity(j, copy)


def test_fidelity_of_a_do_policy_branch(recorded: tuple[Journal, str]) -> None:
    """A do_policy branch replays at 1.0: steps from k on are re-executed with the swapped
    policy, steps before k with the run's own."""
    j, run = recorded
    rep = fork_many(j, run, DoPolicy(4, {"name": "sim-honest"}), 1, seed=3)
    branch = rep.branches[0].run_id
    fid = fidelity(j, branch)
    assert fid.exact_match_rate == 1.0 and fid.steps == 24


def test_fork_of_a_do_policy_branch_keeps_the_swapped_policy(
    recorded: tuple[Journal, str],
) -> None:
    """Forking a do_policy branch after its swap re-decides with the swapped policy: the new
    branch's LLM calls match what that policy decides, so it replays at 1.0 too."""
    j, run = recorded
    rep = fork_many(j, run, DoPolicy(2, {"name": "sim-honest"}), 1, seed=8)
    branch = rep.branches[0].run_id
    again = fork_many(j, branch, DoResample(10), 1, seed=9).branches[0].run_id
    fid = fidelity(j, again)
    assert fid.exact_match_rate == 1.0
