"""Record mode: the runtime journals every step, deterministically, and can be controlled."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
from freezegun import freeze_time
from journal_helpers import ROOT, car, unjournalable_crew

from engine import events as ev
from engine.errors import ConfigError, JournalError
from engine.heist.session import accuse_run, record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal
from engine.logging import configure
from engine.policies.base import AgentView, Completion
from engine.policies.registry import make_policy
from engine.runtime.control import ControlChannel
from engine.runtime.seeds import step_seed


@freeze_time("2026-05-01 12:00:00")
def test_same_seed_byte_identical(tmp_path: Path) -> None:
    """The same seed and config give byte-identical event payloads and hashes."""
    rows = []
    for name in ("a.db", "b.db"):
        with Journal(tmp_path / name) as j:
            r = record_heist(j, SimPolicy(), seed=11)
            rows.append([(s.kind, s.payload, s.hash) for s in j.read(r.run_id)])
    assert rows[0] == rows[1]
    assert len(rows[0]) > 24 * 2


def test_different_seeds_differ(tmp_path: Path) -> None:
    """Different seeds give different runs (the policy really is stochastic)."""
    with Journal(tmp_path / "j.db") as j:
        a = record_heist(j, SimPolicy(), seed=1)
        b = record_heist(j, SimPolicy(), seed=2)
        ta = [s.payload for s in j.read(a.run_id) if s.kind == "chat_message"]
        tb = [s.payload for s in j.read(b.run_id) if s.kind == "chat_message"]
    assert ta != tb


def test_every_step_is_journaled(tmp_path: Path) -> None:
    """Each step has its LLM call (request, seed), each tool call its result, and a message."""
    with Journal(tmp_path / "j.db") as j:
        r = record_heist(j, SimPolicy(), seed=5, rounds=3)
        events = [s.event for s in j.read(r.run_id)]
    assert isinstance(events[0], ev.RunStarted) and isinstance(events[-1], ev.RunEnded)
    assert r.steps == 18
    for k in range(18):
        mine = [e for e in events if e.step == k and not isinstance(e, ev.Intervention)]
        call, *middle, msg = mine
        assert isinstance(call, ev.LlmCall) and call.seed == step_seed(5, k)
        assert call.request and call.request[0]["role"] == "system"
        assert isinstance(msg, ev.ChatMessage) and msg.text == call.response
        calls = [e for e in middle if isinstance(e, ev.ToolCall)]
        results = [e for e in middle if isinstance(e, ev.ToolResult)]
        assert [(c.tool, c.param) for c in calls] == [(x.tool, x.param) for x in results]
    outcome = events[-1].outcome  # type: ignore[union-attr]
    assert set(outcome) >= {"bad", "score", "reasons", "plan"}


def test_mole_secret_only_in_its_own_prompt(tmp_path: Path) -> None:
    """The mole's instructions reach only the mole's system prompt, from its first turn."""
    with Journal(tmp_path / "j.db") as j:
        r = record_heist(j, SimPolicy(), seed=3, mole="hacker", strategy="FALSE_INFO")
        calls = [s.event for s in j.read(r.run_id) if s.kind == "llm_call"]
    for c in calls:
        system = c.request[0]["content"]  # type: ignore[union-attr]
        assert ("SECRET" in system) == (c.agent == "hacker")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "strategy",
    ["TIMING_ERRORS", "FALSE_INFO", "COORDINATION_CHAOS", "SUBTLE_DELAYS", "WRONG_TOOLS"],
)
def test_each_strategy_records(tmp_path: Path, strategy: str) -> None:
    """Every strategy records a complete heist with the mole's assignment journaled."""
    with Journal(tmp_path / "j.db") as j:
        r = record_heist(j, SimPolicy(), seed=9, strategy=strategy)
        secret = [s.event for s in j.read(r.run_id) if s.kind == "mole_assigned"]
    assert r.status == "completed"
    assert secret[0].strategy == strategy  # type: ignore[union-attr]


def test_bad_strategy_and_mole_fail_loudly(tmp_path: Path) -> None:
    """A misspelled strategy or an unknown mole agent is a ConfigError listing valid values."""
    with Journal(tmp_path / "j.db") as j:
        with pytest.raises(ConfigError, match="valid strategies: TIMING_ERRORS"):
            record_heist(j, SimPolicy(), seed=1, strategy="FALSE_INFOS")
        with pytest.raises(ConfigError, match="agents are: planner"):
            record_heist(j, SimPolicy(), seed=1, mole="nobody")
        assert j.runs() == []


class _Signalling:
    """A real sim policy that fires control requests when given steps are reached."""

    name = "sim"

    def __init__(self, control: ControlChannel, at: dict[int, list[str]]) -> None:
        self.inner = SimPolicy()
        self.control = control
        self.at = at

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion:
        for action in self.at.get(view.step, []):
            self.control.request(action, "test")
        return self.inner.decide(view, messages, seed)


def test_pause_resume_stop(tmp_path: Path) -> None:
    """Pause, resume and stop are journaled where they took effect; stop closes the run."""
    control = ControlChannel()
    policy = _Signalling(control, {2: ["pause"], 5: ["stop"]})
    result: dict[str, object] = {}

    def play() -> None:
        with Journal(tmp_path / "j.db") as j:
            result["r"] = record_heist(j, policy, seed=4, control=control)

    t = threading.Thread(target=play)
    t.start()
    t.join(timeout=1.0)
    assert t.is_alive(), "the run should be paused"
    control.request("resume", "test")
    t.join(timeout=30)
    r = result["r"]
    with Journal(tmp_path / "j.db") as j:
        events = [s.event for s in j.read(r.run_id)]  # type: ignore[attr-defined]
        assert j.status(r.run_id) == "stopped"  # type: ignore[attr-defined]
    controls = [(e.action, i) for i, e in enumerate(events) if isinstance(e, ev.Control)]
    assert [a for a, _ in controls] == ["pause", "resume", "stop"]
    last_steps = [e.step for e in events if isinstance(e, ev.ChatMessage)]
    assert last_steps == list(range(6))
    assert isinstance(events[-1], ev.RunEnded) and events[-1].status == "stopped"


def test_logs_bind_run_and_step(tmp_path: Path) -> None:
    """structlog lines carry the run id and the step."""
    configure("DEBUG")
    try:
        with (
            structlog.testing.capture_logs(
                processors=[structlog.contextvars.merge_contextvars]
            ) as logs,
            Journal(tmp_path / "j.db") as j,
        ):
            r = record_heist(j, SimPolicy(), seed=2, rounds=1)
    finally:
        configure("WARNING")
    recorded = [x for x in logs if x.get("event") == "step recorded"]
    assert len(recorded) == 6
    assert {x["run_id"] for x in recorded} == {r.run_id}
    assert [x["step"] for x in recorded] == list(range(6))


def test_custom_crew_adds_an_agent(tmp_path: Path) -> None:
    """Adding an agent to the YAML adds it to the game."""
    cfg = tmp_path / "crew.yaml"
    cfg.write_text(
        "agents:\n"
        "  - {name: planner, role: boss, goal: plan it, tools: [calculator]}\n"
        "  - {name: hacker, role: tech, goal: cameras, tools: [file_reader]}\n"
        "  - {name: forger, role: papers, goal: fake ids, tools: [file_reader]}\n"
    )
    res = car(tmp_path / "j.db", "heist", "--config", str(cfg), "--rounds", "2", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["agents"] == ["planner", "hacker", "forger"] and data["steps"] == 6
    assert set(data) >= {"run_id", "agents", "steps", "outcome"}
    assert set(data["outcome"]) >= {"bad", "score", "reasons"}


def test_malformed_config_one_line(tmp_path: Path) -> None:
    """Malformed YAML gives one error line naming the line, and records nothing."""
    cfg = tmp_path / "crew.yaml"
    cfg.write_text("agents:\n  - name: planner\n    tools: [calculator\n")
    res = car(tmp_path / "j.db", "heist", "--config", str(cfg))
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "line" in lines[0]


def test_accuse_verdicts(tmp_path: Path) -> None:
    """SUCCESS names the mole, FAILURE a wrong agent, BUSTED nobody; each is journaled once."""
    j = tmp_path / "j.db"
    verdicts = {}
    for suspect in ("hacker", "driver", None):
        res = car(j, "heist", "--seed", "8", "--mole", "hacker", "--json")
        run = json.loads(res.stdout)["run_id"]
        args = ["accuse", run] + ([suspect] if suspect else []) + ["--json"]
        out = json.loads(car(j, *args).stdout)
        assert out["mole"] == "hacker"
        verdicts[suspect] = out["verdict"]
        again = car(j, "accuse", run, "planner")
        assert again.returncode == 1 and "already accused" in again.stderr
    assert verdicts == {"hacker": "SUCCESS", "driver": "FAILURE", None: "BUSTED"}
    with Journal(j) as journal:
        declared = [
            s.event
            for r in journal.runs()
            for s in journal.read(r.run_id)
            if s.kind == "suspicion_declared"
        ]
    assert [d.verdict for d in declared] == ["SUCCESS", "FAILURE", "BUSTED"]  # type: ignore[attr-defined]


def test_a_branch_is_not_accused_in_place_of_its_game(tmp_path: Path) -> None:
    """Accusing a branch is refused, naming the game to accuse: its verdict would reveal the
    mole of the game, which could then be won for sure. The game itself stays accusable."""
    j = tmp_path / "j.db"
    root = json.loads(car(j, "heist", "--seed", "8", "--mole", "hacker", "--json").stdout)
    root_id = root["run_id"]
    fork = json.loads(car(j, "fork", root_id, "--at", "0", "--do", "resample", "-n", "1",
                          "--json").stdout)  # fmt: skip
    branch = fork["branches"][0]["run_id"]
    for args in (["accuse", branch], ["accuse", branch, "hacker", "--json"]):
        res = car(j, *args)
        assert res.returncode == 1 and res.stdout == ""
        assert res.stderr.strip().splitlines() == [
            f"error: run {branch!r} is a branch of heist {root_id!r}; the accusation is the"
            f" game's: accuse {root_id!r}"
        ]
    with Journal(j) as journal:
        assert not [
            s for r in journal.runs() for s in journal.read(r.run_id)
            if s.kind == "suspicion_declared"
        ]  # fmt: skip
    out = json.loads(car(j, "accuse", root_id, "driver", "--json").stdout)
    assert (out["verdict"], out["mole"]) == ("FAILURE", "hacker")


def test_a_drawn_seed_is_not_printed(tmp_path: Path) -> None:
    """Without --seed the root seed is drawn and journaled but not printed (human or --json):
    the mole is drawn from it, so replaying it in a scratch journal would name the mole.
    `car show --reveal` shows it; a seed the user gave is echoed."""
    j = tmp_path / "j.db"
    human = car(j, "heist", "-q")
    data = json.loads(car(j, "heist", "-q", "--json").stdout)
    assert data["seed"] is None
    with Journal(j) as journal:
        seeds = {
            r.run_id: journal.events(r.run_id, 1)[0].root_seed  # type: ignore[attr-defined]
            for r in journal.runs()
        }
    runs = [line for line in human.stdout.splitlines() if line.startswith("run ")]
    assert len(runs) == 1 and runs[0].endswith("(completed, 24 steps)"), runs
    for seed in seeds.values():
        assert str(seed) not in human.stdout
    revealed = car(j, "show", data["run_id"], "--reveal").stdout
    assert f"seed={seeds[data['run_id']]}" in revealed
    given = car(j, "heist", "-q", "--seed", "5", "--rounds", "1")
    assert "(completed, 6 steps, seed 5)" in given.stdout


@pytest.mark.parametrize("on_created", [None, lambda run_id: None])
def test_an_opening_the_journal_refuses_creates_no_run(
    tmp_path: Path, on_created: Callable[[str], None] | None
) -> None:
    """A crew built without the loader whose text no event can hold (a lone surrogate):
    record_run raises, and nothing is written: the run and its opening are one transaction
    (it used to create the run, then close it failed), and a live viewer is never told of it."""
    crew = unjournalable_crew()
    told: list[str] = []
    with Journal(tmp_path / "j.db") as j:
        with pytest.raises(JournalError, match="surrogates not allowed"):
            record_heist(
                j, SimPolicy(), seed=3, rounds=1, config=crew,
                on_created=None if on_created is None else told.append,
            )  # fmt: skip
        assert j.runs() == []
    assert told == []


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64, 10**26])
def test_unrecordable_root_seed_is_refused_before_the_run(tmp_path: Path, seed: int) -> None:
    """A root seed outside 0..2**63-1 is a ConfigError before anything is written (it used
    to create the run row, fail to encode RunStarted and leave an empty run abandoned)."""
    with Journal(tmp_path / "j.db") as j:
        with pytest.raises(ConfigError, match=rf"root seed must lie within 0\.\.{2**63 - 1}"):
            record_heist(j, SimPolicy(), seed=seed, rounds=1)
        assert j.runs() == []


def test_accuse_unknown_agent(tmp_path: Path) -> None:
    """Accusing an agent that is not in the crew is a clear error, nothing journaled."""
    with Journal(tmp_path / "j.db") as j:
        r = record_heist(j, SimPolicy(), seed=1, rounds=1)
        head = j.head(r.run_id)
        with pytest.raises(ConfigError, match="'zorro'"):
            accuse_run(j, r.run_id, "zorro")
        assert j.head(r.run_id) == head


def test_unknown_policy_lists_valid() -> None:
    """A misspelled policy name fails loudly listing the valid ones."""
    with pytest.raises(ConfigError, match="sim, sim-honest, openai"):
        make_policy({"name": "simm"})


def test_killed_recording_keeps_whole_steps(tmp_path: Path) -> None:
    """A heist process killed mid-run (group commit on) leaves only whole steps, chain intact."""
    import os
    import signal
    import time

    jp = tmp_path / "j.db"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "--journal",
            str(jp),
            "heist",
            "--rounds",
            "5000",
            "--seed",
            "1",
            "--quiet",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if jp.exists():
            with Journal(jp) as j:
                if j.runs() and j.steps(j.runs()[0].run_id) > 200:
                    break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with Journal(jp) as j:
        (run,) = j.runs()
        events = [s.event for s in j.read(run.run_id)]
        assert j.verify().ok
        assert j.status(run.run_id) == "abandoned"  # its writer is gone
    calls = {e.step for e in events if isinstance(e, ev.LlmCall)}
    messages = {e.step for e in events if isinstance(e, ev.ChatMessage)}
    assert calls == messages == set(range(len(calls))) and len(calls) > 200


def test_ctrl_c_stops_cleanly(tmp_path: Path) -> None:
    """SIGINT during `car heist` journals a stop and closes the run; whole steps only."""
    import os
    import signal
    import time

    jp = tmp_path / "j.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "--journal", str(jp), "heist", "--rounds", "5000", "--quiet"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.3)
        if jp.exists():
            with Journal(jp) as j:
                if j.runs() and j.steps(j.runs()[0].run_id) > 50:
                    break
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip().startswith("stopped: run")
    with Journal(jp) as j:
        (run,) = j.runs()
        events = [s.event for s in j.read(run.run_id)]
        assert j.status(run.run_id) == "stopped" and j.verify().ok
    assert isinstance(events[-2], ev.Control) and events[-2].action == "stop"
    assert isinstance(events[-1], ev.RunEnded) and events[-1].status == "stopped"


class _InterruptedInAnImport:
    """A real sim policy that, at one step, meets a Ctrl-C the way a lazily imported module
    can: while a class body's descriptor is named (Python 3.11 re-raises it as RuntimeError)."""

    name = "sim"

    def __init__(self, at: int) -> None:
        self.inner = SimPolicy()
        self.at = at

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion:
        if view.step == self.at:

            class Named:
                def __set_name__(self, owner: type, name: str) -> None:
                    raise KeyboardInterrupt

            type("Module", (), {"field": Named()})
        return self.inner.decide(view, messages, seed)


def test_a_ctrl_c_behind_another_error_closes_the_run_as_stopped(tmp_path: Path) -> None:
    """The run is closed as `stopped` (the user's Ctrl-C), not `failed` with an internal error,
    when the interrupt reaches the episode as another error; its whole steps stay."""
    from engine.errors import interrupt_behind

    with Journal(tmp_path / "j.db") as j:
        with pytest.raises(BaseException) as caught:
            record_heist(j, _InterruptedInAnImport(at=3), seed=7, rounds=1)  # type: ignore[arg-type]
        assert interrupt_behind(caught.value) is not None
        (run,) = j.runs()
        events = [s.event for s in j.read(run.run_id)]
        assert j.status(run.run_id) == "stopped" and j.verify().ok
        assert j.steps(run.run_id) == 3  # steps 0-2 whole; step 3 never decided
    assert isinstance(events[-1], ev.RunEnded) and events[-1].status == "stopped"
