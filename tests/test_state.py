"""s_k as a pure fold: snapshot-based reconstruction equals the plain fold, forks included."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import events as ev
from engine import state as st_mod
from engine.errors import InterventionError
from engine.journal import Journal
from engine.state import State, fold, state_at, state_at_seq

AGENTS = ["planner", "hacker", "mole"]


def start(window: int) -> ev.RunStarted:
    return ev.RunStarted(
        scenario="prop",
        config={"x": 1},
        agents=AGENTS,
        policy={"name": "sim"},
        root_seed=7,
        engine_version="t",
        started_at="t",
        rounds=3,
        context_window=window,
    )


@st.composite
def step_strategy(draw: st.DrawFn, k: int) -> list[ev.Event]:
    agent = AGENTS[k % len(AGENTS)]
    out: list[ev.Event] = [
        ev.LlmCall(
            step=k,
            agent=agent,
            request=[],
            seed=draw(st.integers(0, 2**31)),
            model="m",
            response="r",
            finish_reason="stop",
        )
    ]
    for _ in range(draw(st.integers(0, 2))):
        ok = draw(st.booleans())
        out.append(ev.ToolCall(step=k, agent=agent, tool="calculator", param="1"))
        out.append(
            ev.ToolResult(
                step=k,
                agent=agent,
                tool="calculator",
                param="1",
                ok=ok,
                output="1" if ok else "",
                error=None if ok else "bad",
            )
        )
    out.append(ev.ChatMessage(step=k, agent=agent, text=draw(st.text(max_size=12))))
    if draw(st.integers(0, 9)) == 0:
        out.append(ev.Control(action=draw(st.sampled_from(["pause", "resume"]))))
    return out


@st.composite
def runs(draw: st.DrawFn) -> tuple[list[list[ev.Event]], int, int, list[list[ev.Event]], int]:
    window = draw(st.integers(1, 6))
    n = draw(st.integers(0, 12))
    steps = [
        [start(window), ev.MoleAssigned(agent="mole", strategy="FALSE_INFO", instructions="s")]
    ]
    steps += [draw(step_strategy(k)) for k in range(n)]
    fork_step = draw(st.integers(0, n))
    branch = [draw(step_strategy(k)) for k in range(fork_step, fork_step + draw(st.integers(0, 6)))]
    every = draw(st.integers(1, 5))
    return steps, fork_step, window, branch, every


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs(), st.data())
def test_snapshot_reconstruction_equals_plain_fold(data, choose) -> None:  # type: ignore[no-untyped-def]
    """For random event sequences, forks and k, s_k from snapshots equals the plain fold."""
    steps, fork_step, _window, branch, every = data
    old = st_mod.SNAPSHOT_EVERY
    st_mod.SNAPSHOT_EVERY = every
    try:
        with tempfile.TemporaryDirectory() as d, Journal(Path(d) / "j.db") as j:
            run = j.create_run("prop")
            head = 0
            for events in steps:
                head = j.append(run, events, head)
            fork_seq = sum(len(s) for s in steps[: fork_step + 1])
            child = j.fork(run, fork_seq)
            h = j.append(
                child, [ev.Intervention(step=fork_step, op="resample", at=fork_step)], fork_seq
            )
            for events in branch:
                h = j.append(child, events, h)
            for target in (run, child):
                total = j.head(target)
                for _ in range(4):
                    seq = choose.draw(st.integers(0, total))
                    plain = fold(e.event for e in j.read(target, 0, seq))
                    assert state_at_seq(j, target, seq) == plain
                    # a second read starts from the snapshots the first one wrote
                    assert state_at_seq(j, target, seq) == plain
    finally:
        st_mod.SNAPSHOT_EVERY = old


def test_fold_is_pure() -> None:
    """Folding never mutates its input state."""
    s0 = fold([start(4)])
    before = st_mod.encode_state(s0)
    s1 = st_mod.apply(s0, ev.ChatMessage(step=0, agent="planner", text="hi"))
    assert st_mod.encode_state(s0) == before
    assert s1.transcript[-1].text == "hi" and s1.step == 1


def test_state_before_step_k(tmp_path: Path) -> None:
    """s_k holds exactly the messages of steps < k, the cursor at k, and the window bound."""
    with Journal(tmp_path / "j.db") as j:
        run = j.create_run("t")
        head = j.append(run, [start(2)], 0)
        for k in range(5):
            head = j.append(run, [ev.ChatMessage(step=k, agent=AGENTS[k % 3], text=f"m{k}")], head)
        s3 = state_at(j, run, 3)
        assert s3.step == 3 and s3.acting_agent == "planner"
        assert [m.text for m in s3.transcript] == ["m1", "m2"]  # window of 2
        assert s3.n_messages == 3
        assert state_at(j, run, 5).n_messages == 5
        with pytest.raises(InterventionError, match="out of range"):
            state_at(j, run, 6)
        assert isinstance(state_at(j, run, 0), State)
