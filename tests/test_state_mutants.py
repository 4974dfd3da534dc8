"""The fold's details that a plain-fold comparison cannot see (both sides would share a bug):
known folded states, do_context edits, snapshots actually used, old-version payloads, and
the seqs that steps map to."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec
import pytest

from engine import events as ev
from engine import state as st
from engine.errors import InterventionError
from engine.journal import KIND_CODES, SPAN, Journal, chain_hash, hash_cell
from engine.policies.base import ChatLine
from engine.state import CONTEXT_AGENT, State, build_snapshots, edit_transcript, fold, state_at

FIXTURES = Path(__file__).resolve().parent / "fixtures"
START = ev.RunStarted(
    scenario="s",
    config={"c": 1},
    agents=["a", "b"],
    policy={"name": "p"},
    root_seed=9,
    engine_version="t",
    started_at="t",
    rounds=2,
    context_window=3,
)


def test_fold_of_a_hand_written_run() -> None:
    """Every event kind's effect on s, checked field by field on a short run."""
    events: list[ev.Event] = [
        START,
        ev.MoleAssigned(agent="b", strategy="FALSE_INFO", instructions="lie"),
        ev.LlmCall(
            step=0, agent="a", request=[], seed=11, model="m", response="r", finish_reason="s"
        ),
        ev.ToolCall(step=0, agent="a", tool="t", param="p"),
        ev.ToolResult(step=0, agent="a", tool="t", param="p", ok=False, error="boom"),
        ev.ChatMessage(step=0, agent="a", text="hello"),
        ev.Control(action="pause"),
        ev.LlmCall(
            step=1, agent="b", request=[], seed=12, model="m", response="r", finish_reason="s"
        ),
        ev.ToolResult(step=1, agent="b", tool="t", param="q", ok=True, output="fine"),
        ev.ChatMessage(step=1, agent="b", text="world"),
        ev.Control(action="resume"),
    ]
    s = fold(events)
    assert (s.seq, s.step, s.status, s.round, s.acting_agent) == (11, 2, "recording", 1, "a")
    assert (s.scenario, s.agents, s.rounds, s.root_seed, s.context_window) == (
        "s",
        ("a", "b"),
        2,
        9,
        3,
    )
    assert (s.policy, s.config) == ({"name": "p"}, {"c": 1})
    assert s.seeds == ((0, 11), (1, 12))
    assert (s.n_messages, s.n_tool_calls, s.n_tool_failures) == (2, 1, 1)
    assert s.transcript == (ChatLine(0, "a", "hello"), ChatLine(1, "b", "world"))
    a, b = s.contexts["a"], s.contexts["b"]
    assert (a.turns, a.secret, a.strategy) == (1, None, None)
    assert [(o.step, o.tool, o.param, o.ok, o.output) for o in a.observations] == [
        (0, "t", "p", False, "boom")
    ]
    assert (b.turns, b.secret, b.strategy) == (1, "lie", "FALSE_INFO")
    assert b.observations[0].output == "fine"
    assert fold(events[:7]).status == "paused"
    assert fold([*events, ev.Control(action="stop")]).status == "stopping"
    assert fold([*events, ev.Control(action="other")]).status == "recording"
    assert fold([*events, ev.RunEnded(status="failed")]).status == "failed"
    # an intervention never moves the turn cursor, even one naming a later step
    iv = fold([*events, ev.Intervention(step=5, op="resample", at=5)])
    assert iv.step == 2 and iv.interventions == ({"op": "resample", "at": 5, "value": None},)
    # an event of an earlier step never moves the cursor back
    assert fold([*events, ev.ChatMessage(step=0, agent="a", text="late")]).step == 2
    # fold continues from a given state
    assert fold(events[5:], fold(events[:5])) == s


def test_window_keeps_the_last_entries() -> None:
    """The context window keeps the last `context_window` messages, observations and seeds."""
    events: list[ev.Event] = [START]
    for k in range(5):
        events += [
            ev.LlmCall(
                step=k, agent="a", request=[], seed=k, model="m", response="", finish_reason=""
            ),
            ev.ToolResult(step=k, agent="a", tool="t", param=str(k), ok=True, output=str(k)),
            ev.ChatMessage(step=k, agent="a", text=str(k)),
        ]
    s = fold(events)
    assert [line.text for line in s.transcript] == ["2", "3", "4"]
    assert s.seeds == ((2, 2), (3, 3), (4, 4))
    assert [o.output for o in s.contexts["a"].observations] == ["2", "3", "4"]
    assert s.contexts["a"].turns == 5 and s.n_messages == 5
    three = fold(events[: 1 + 3 * 3])
    assert [line.text for line in three.transcript] == ["0", "1", "2"]


def test_edit_transcript() -> None:
    """do_context: {"step": j, "text": t} replaces step j's message (not a context line's),
    an empty text deletes it; {"text": t} appends a context line at the given step; anything
    else changes nothing."""
    lines = [ChatLine(0, "a", "x"), ChatLine(1, "b", "y"), ChatLine(1, CONTEXT_AGENT, "c")]
    assert edit_transcript(lines, {"step": 1, "text": "Y"}, 4) == [
        ChatLine(0, "a", "x"),
        ChatLine(1, "b", "Y"),
        ChatLine(1, CONTEXT_AGENT, "c"),
    ]
    assert edit_transcript(lines, {"step": 0, "text": ""}, 4) == lines[1:]
    assert edit_transcript(lines, {"text": "new"}, 4) == [*lines, ChatLine(4, CONTEXT_AGENT, "new")]
    assert edit_transcript(lines, {"step": 7, "text": "z"}, 4) == lines
    assert edit_transcript(lines, {"step": 1}, 4) == lines
    assert edit_transcript(lines, {"step": 1, "text": 3}, 4) == lines
    assert edit_transcript(lines, "text", 4) == lines
    s = fold(
        [
            START,
            ev.ChatMessage(step=0, agent="a", text="x"),
            ev.Intervention(step=1, op="context", at=1, value={"step": 0, "text": "edited"}),
        ]
    )
    assert s.transcript == (ChatLine(0, "a", "edited"),)
    assert s.interventions == ({"op": "context", "at": 1, "value": {"step": 0, "text": "edited"}},)
    other = fold(
        [
            START,
            ev.ChatMessage(step=0, agent="a", text="x"),
            ev.Intervention(step=1, op="action", at=1, value={"step": 0, "text": "no"}),
        ]
    )
    assert other.transcript == (ChatLine(0, "a", "x"),)


def test_v3_fixture_folds_to_the_v2_engines_states() -> None:
    """s_3 and s_6 of the v3 journal's parent equal, byte for byte, the states the v2 engine
    folded from the same heist (seed 3): seeds, contexts and the mole's secret included."""
    with Journal(FIXTURES / "journal_v3.db", readonly=True) as j:
        for k in (3, 6):
            for snapshots in (False, True):
                got = msgspec.json.format(
                    msgspec.json.encode(state_at(j, "7cc905d94523", k, snapshots=snapshots))
                )
                assert got == (FIXTURES / f"journal_v2.fold_2cee_at{k}.json").read_bytes(), (
                    k,
                    snapshots,
                )


def test_snapshots_are_used_and_built(tmp_path: Path) -> None:
    """Reconstruction starts from the nearest snapshot (a planted one is taken as it is, which
    proves it is read) unless snapshots=False; build_snapshots folds the whole run once and
    stores every SNAPSHOT_EVERY-th state."""
    with Journal(tmp_path / "j.db") as j:
        run = j.create_run("s")
        events = [START] + [ev.ChatMessage(step=i, agent="a", text=str(i)) for i in range(1100)]
        j.append(run, events, 0)
        assert build_snapshots(j, run) == 1101
        seqs = [
            r[0] for r in j.query("SELECT seq FROM snapshots WHERE run_id = ? ORDER BY seq", [run])
        ]
        assert seqs == [512, 1024]
        marker = msgspec.structs.replace(fold(events[:512]), n_messages=-7)
        other = j.create_run("s")
        j.append(other, events, 0)
        j.put_snapshot(other, 512, st.FOLD_VERSION, st.encode_state(marker))
        assert st.state_at_seq(j, other, 600).n_messages == -7 + 88
        assert st.state_at(j, other, 599).n_messages == -7 + 88
        assert st.state_at(j, other, 599, snapshots=False).n_messages == 599
        assert st.decode_state(st.encode_state(marker)) == marker


def test_old_version_payloads_are_upcast_in_the_fold(tmp_path: Path) -> None:
    """A v1 tool result (one `text` field) in the journal folds to the observation its
    upcaster gives."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = j.create_run("s")
        j.append(run, [START], 0)
        prev = j.hash_at(run, 0)
        key = j.run_key(run)
    raw = {
        "kind": "tool_result",
        "agent": "a",
        "tool": "t",
        "param": "p",
        "ok": False,
        "text": "old",
        "step": 0,
    }
    payload = msgspec.msgpack.encode(raw)
    con = sqlite3.connect(path)
    con.execute(
        "INSERT INTO events (id, run_key, seq, step, kind, version, payload, hash)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            key * SPAN + 1,
            key,
            1,
            0,
            KIND_CODES["tool_result"],
            1,
            payload,
            hash_cell(chain_hash(prev, 1, "tool_result", 1, payload)),
        ),
    )
    con.commit()
    con.close()
    with Journal(path, readonly=True) as j:
        s = st.state_at_seq(j, run, 2)
        assert j.verify().ok
    (obs,) = s.contexts["a"].observations
    assert (obs.ok, obs.output) == (False, "old")


def test_step_seq_and_the_end_of_steps(tmp_path: Path) -> None:
    """s_k starts where step k's first event is; k = the number of steps is the end of the
    last step (before a trailing RunEnded); out-of-range k is refused naming the range."""
    with Journal(tmp_path / "j.db") as j:
        run = j.create_run("s")
        steps = [ev.ChatMessage(step=k, agent="a", text=str(k)) for k in range(3)]
        j.append(run, [START, *steps, ev.RunEnded(status="completed")], 0)
        assert [st.step_seq(j, run, k) for k in range(4)] == [1, 2, 3, 4]
        assert state_at(j, run, 3).seq == 4 and state_at(j, run, 3).status == "recording"
        with pytest.raises(
            InterventionError, match=r"^step 4 is out of range: run '\w+' has steps 0..2$"
        ):
            st.step_seq(j, run, 4)
        with pytest.raises(InterventionError, match=r"has steps 0..2$"):
            st.step_seq(j, run, -1)
        empty = j.create_run("s")
        j.append(empty, [START], 0)
        assert st.step_seq(j, empty, 0) == 0
        assert state_at(j, empty, 0) == State()


def test_tail() -> None:
    """_tail keeps the last n items."""
    assert st._tail((1, 2, 3), 2) == (2, 3)
    assert st._tail((1, 2), 2) == (1, 2)
    assert st._tail((), 2) == ()


def test_fold_mid_step_and_odd_orders() -> None:
    """The cursor moves with the first event of a step (its LLM call or a tool call), not
    only with its message; an event kind the fold does not read still counts; the mole's
    secret joins a context that already holds observations; a failure without a message is
    an empty observation."""
    call = ev.LlmCall(
        step=0, agent="a", request=[], seed=1, model="m", response="", finish_reason=""
    )
    assert fold([START, call]).step == 1
    assert fold([START, ev.ToolCall(step=0, agent="a", tool="t", param="p")]).step == 1
    accused = fold([START, ev.SuspicionDeclared(suspect="a", verdict="v", mole="b", strategy="s")])
    assert (accused.seq, accused.step) == (2, 0)
    obs = ev.ToolResult(step=0, agent="b", tool="t", param="p", ok=False)
    late = fold([START, obs, ev.MoleAssigned(agent="b", strategy="S", instructions="i")])
    ctx = late.contexts["b"]
    assert (ctx.secret, ctx.strategy, len(ctx.observations)) == ("i", "S", 1)
    assert ctx.observations[0].output == ""
    assert late.n_tool_failures == 1


def test_fold_counts_every_event_and_adds_context_lines() -> None:
    """seq counts RunEnded too; a tool result opening a step moves the cursor; a do_context
    edit that adds a message puts it at the intervention's step."""
    ended = fold(
        [START, ev.ChatMessage(step=0, agent="a", text="x"), ev.RunEnded(status="completed")]
    )
    assert (ended.seq, ended.status) == (3, "completed")
    assert fold([START, ev.ToolResult(step=0, agent="a", tool="t", param="p", ok=True)]).step == 1
    added = fold([START, ev.Intervention(step=1, op="context", at=1, value={"text": "note"})])
    assert added.transcript == (ChatLine(1, CONTEXT_AGENT, "note"),)
