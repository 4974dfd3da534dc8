"""One agent with several calls in flight at once (`asyncio.gather`), recorded against the real
llama.cpp server (SmolLM2-135M) and answered from the journal in another order.

The program runs two solver tasks of the same agent side by side - each asks for a forced
calculator call, runs the tool and sends its result back - then a reporter sums them up.
Which task the proxy hears from first is a race; the program lets the test decide it
(`FIRST`): the task started second waits half a second. Recorded with task a first, its
first call is step 0; replayed with task b first, the agent's first request is task b's, so
matching by position alone answered it with task a's answer (or, in `exact` mode, refused
it). Five model calls in all, made once for the module; everything else is answered from the
journal. The tests assert plumbing - which recorded answer and which tool-call ids each task
gets - never the model's words."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from program_helpers import ReorderingServer

from engine import events as ev
from engine.journal import Journal
from engine.program import wire

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = {"a": "What is 6 times 7?", "b": "What is 5 plus 3?"}

SOLVERS = """
import asyncio, json, os
from openai import AsyncOpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Compute a op b for two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer"},
                "op": {"type": "string", "enum": ["+", "-", "*"]},
                "b": {"type": "integer"},
            },
            "required": ["a", "op", "b"],
        },
    },
}
FIRST = os.environ.get("FIRST", "a")
QUESTIONS = {"a": "What is 6 times 7?", "b": "What is 5 plus 3?"}
if os.environ.get("TWIST_A"):
    QUESTIONS["a"] = os.environ["TWIST_A"]


def calculator(arguments):
    try:
        args = json.loads(arguments)
        a, b = int(args["a"]), int(args["b"])
        ops = {"+": a + b, "-": a - b, "*": a * b}
        return str(ops[args["op"]]) if max(abs(a), abs(b)) < 10**6 else "error: too large"
    except (ValueError, KeyError, TypeError):
        return "error: bad arguments"


async def solve(client, name):
    # the task started second waits: which one the proxy hears from first is the caller's
    await asyncio.sleep(0 if name == FIRST else 0.5)
    head = {"X-Car-Agent": "solver"}
    history = [
        {"role": "system", "content": "You are the solver. Use the calculator."},
        {"role": "user", "content": QUESTIONS[name]},
    ]
    asked = await client.chat.completions.create(
        model="smollm2", messages=history, tools=[CALCULATOR],
        tool_choice={"type": "function", "function": {"name": "calculator"}},
        max_tokens=40, temperature=0.8, extra_headers=head,
    )
    msg = asked.choices[0].message
    calls = msg.tool_calls or []
    history.append({"role": "assistant", "content": msg.content or "",
                    "tool_calls": [c.model_dump() for c in calls]})
    for c in calls:
        history.append({"role": "tool", "tool_call_id": c.id,
                        "content": calculator(c.function.arguments)})
    answer = await client.chat.completions.create(
        model="smollm2", messages=history, max_tokens=8, temperature=0.8, extra_headers=head
    )
    return {
        "ids": [c.id for c in calls],
        "arguments": [c.function.arguments for c in calls],
        "answer": answer.choices[0].message.content or "",
    }


async def main():
    client = AsyncOpenAI(max_retries=0)
    a, b = await asyncio.gather(solve(client, "a"), solve(client, "b"))
    report = await client.chat.completions.create(
        model="smollm2",
        messages=[
            {"role": "system", "content": "You are the reporter. Sum up in a few words."},
            {"role": "user", "content": f"A: {a['answer']}\\nB: {b['answer']}"},
        ],
        max_tokens=8, temperature=0.8, extra_headers={"X-Car-Agent": "reporter"},
    )
    out = {"a": a, "b": b, "report": report.choices[0].message.content or ""}
    with open(os.environ["SOLVERS_OUT"], "w") as f:
        json.dump(out, f)


asyncio.run(main())
"""


def car(journal: Path, out: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    base.pop("OPENAI_BASE_URL", None)
    base.update(env)
    base["SOLVERS_OUT"] = str(out)
    base["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=base,
        timeout=600,
    )


class Recorded:
    def __init__(self, journal: Path, run_id: str, prog: Path, out: dict[str, Any]) -> None:
        self.journal = journal
        self.run_id = run_id
        self.cmd = [sys.executable, str(prog)]
        self.out = out  # what the program got while it was recorded

    def calls(self) -> list[ev.LlmCall]:
        with Journal(self.journal) as j:
            return [e for e in j.events(self.run_id) if isinstance(e, ev.LlmCall)]


@pytest.fixture(scope="module")
def recorded(llama_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    """The program recorded once, task a first: two solver tasks of two calls each, then the
    reporter. Task a's first call is step 0 (the server answers one request at a time, and it
    had a's for half a second before b's came)."""
    tmp = tmp_path_factory.mktemp("program-concurrent")
    prog = tmp / "solvers.py"
    prog.write_text(SOLVERS)
    journal, out = tmp / "j.db", tmp / "recorded.json"
    r = car(journal, out, "record", "--base-url", llama_base_url, "--json", "--",
            sys.executable, str(prog), FIRST="a")  # fmt: skip
    assert r.returncode == 0, r.stderr
    rec = Recorded(journal, json.loads(r.stdout)["run_id"], prog, json.loads(out.read_text()))
    calls = rec.calls()
    assert [c.agent for c in calls] == ["solver"] * 4 + ["reporter"]
    assert wire.messages_of(calls[0].request)[1]["content"] == QUESTIONS["a"]
    # what each task got is the answer journaled for its own requests
    for name in ("a", "b"):
        mine = [
            c for c in calls[:4] if wire.messages_of(c.request)[1]["content"] == QUESTIONS[name]
        ]
        assert len(mine) == 2 and rec.out[name]["answer"] == mine[1].response
    return rec


def _replay(rec: Recorded, tmp_path: Path, *args: str, **env: str) -> tuple[Any, Any]:
    out = tmp_path / "replayed.json"
    r = car(rec.journal, out, "replay", rec.run_id, "--json", *args, "--", *rec.cmd, **env)
    report = json.loads(r.stdout) if r.stdout.strip() else None
    return r, (report, json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.parametrize("mode", ["exact", "messages", "position"])
def test_replay_in_another_order_answers_each_request_its_own(
    recorded: Recorded, tmp_path: Path, mode: str
) -> None:
    """Replayed with task b first, every request gets the answer recorded for it: the replay
    is faithful in each match mode, and each task sees the answers and the tool-call ids it
    saw while recorded (its tool results go back under those ids, so its second request is
    the recorded one too). By position alone, task b's first call met task a's recording:
    `exact` and `messages` refused it, `position` swapped the two tasks' answers."""
    r, (report, out) = _replay(recorded, tmp_path, "--match", mode, FIRST="b")
    assert r.returncode == 0, r.stderr
    assert report["fidelity"] == 1.0 and report["exact_match_rate"] == 1.0
    assert report["replayed_calls"] == 5 and report["divergences"] == []
    assert report["outcome_match"] is True and report["unrequested"] == []
    assert report["reordered"] >= 1  # task b's first call was not the agent's first recorded
    assert out == recorded.out


def test_exact_mode_still_stops_a_request_that_was_never_recorded(
    recorded: Recorded, tmp_path: Path
) -> None:
    """Reordering is no licence: with task b first and task a asking something else, task b's
    calls are answered (they equal recorded ones) and task a's first call is the miss, its
    diagnosis held against the agent's earliest unanswered call - task a's recorded one. By
    position alone the miss came at once, on task b's unchanged first call."""
    r, (_report, out) = _replay(recorded, tmp_path, FIRST="b", TWIST_A="What is 6 times 8?")
    assert r.returncode == 1 and out is None
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: replay miss: call "), last
    assert (
        " of agent 'solver' (recorded step 0) does not match (exact): messages[1].content "
        "differs: recorded 'What is 6 times 7?', got 'What is 6 times 8?'"
    ) in last


def test_position_mode_answers_a_changed_request_by_its_position(
    recorded: Recorded, tmp_path: Path
) -> None:
    """In `position` mode a request equal to no recorded call takes its position's answer:
    task a, asking something else, gets task a's recorded answers (the agent's earliest
    unanswered calls once task b's equal ones are taken), task b gets its own, and the two
    calls of task a are counted as divergences."""
    r, (report, out) = _replay(
        recorded, tmp_path, "--match", "position", FIRST="b", TWIST_A="What is 6 times 8?"
    )
    assert r.returncode == 1  # the replay diverged (fidelity < 1), it did not stop
    assert report["status"] == "completed" and report["replayed_calls"] == 5
    steps = {c.step: c for c in recorded.calls()}
    diverged = sorted(d["step"] for d in report["divergences"])
    a_steps = sorted(
        s for s, c in steps.items()
        if c.agent == "solver" and wire.messages_of(c.request)[1]["content"] == QUESTIONS["a"]
    )  # fmt: skip
    # a's two calls; the reporter's request holds the recorded answers, so it is the recorded one
    assert diverged == a_steps and report["fidelity"] == 0.6
    assert out["b"] == recorded.out["b"]
    assert out["a"]["answer"] == recorded.out["a"]["answer"]
    assert out["a"]["ids"] == recorded.out["a"]["ids"]


def test_fork_after_the_concurrent_calls_replays_them_in_another_order(
    recorded: Recorded, tmp_path: Path
) -> None:
    """A fork at the reporter's call answers the four solver calls before it from the journal,
    in whatever order they come: the branch completes, and the reporter's request it journals
    (the intervention answers it: no model call) is the recorded one - both tasks got their
    own answers. By position alone the branch failed on its first call."""
    out = tmp_path / "branch.json"
    r = car(recorded.journal, out, "fork", recorded.run_id, "--at", "4", "--do", "action",
            "--value", "Both are done.", "-n", "1", "--json", "--", *recorded.cmd,
            FIRST="b")  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    (branch,) = report["branches"]
    assert branch["status"] == "completed" and report["scored"] == 1
    with Journal(recorded.journal) as j:
        events = j.events(branch["run_id"])
    calls = [e for e in events if isinstance(e, ev.LlmCall)]
    assert [c.step for c in calls] == [0, 1, 2, 3, 4]
    assert calls[4].response == "Both are done."
    assert wire.messages_of(calls[4].request) == wire.messages_of(recorded.calls()[4].request)
    assert json.loads(out.read_text())["report"] == "Both are done."


@pytest.fixture(scope="module")
def reordered(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    """The program recorded, task a first, against a server that answered task b's first call
    before task a's (ReorderingServer): the journal's steps are not the order the calls came
    in, so task a's tool-call id (`call_solver_0_0`, for the agent's first call to arrive)
    belongs to step 1."""
    tmp = tmp_path_factory.mktemp("program-reordered")
    prog = tmp / "solvers.py"
    prog.write_text(SOLVERS)
    journal, out = tmp / "j.db", tmp / "recorded.json"
    with ReorderingServer() as srv:
        r = car(journal, out, "record", "--base-url", srv.base_url, "--json", "--",
                sys.executable, str(prog), FIRST="a")  # fmt: skip
    assert r.returncode == 0, r.stderr
    rec = Recorded(journal, json.loads(r.stdout)["run_id"], prog, json.loads(out.read_text()))
    calls = rec.calls()
    assert [wire.messages_of(c.request)[1]["content"] for c in calls[:2]] == [
        QUESTIONS["b"],
        QUESTIONS["a"],
    ]
    assert rec.out["a"]["ids"] == ["call_solver_0_0"] and rec.out["b"]["ids"] == ["call_solver_1_0"]
    return rec


def test_replay_hands_out_the_recorded_tool_call_ids(reordered: Recorded, tmp_path: Path) -> None:
    """Replayed in the order it was recorded in, each task gets its own answer and the ids it
    got while recorded - read back from the requests that sent them to the server - although
    task a's call is the agent's second in the journal. By position alone task a's first call
    met task b's recording, and was refused."""
    r, (report, out) = _replay(reordered, tmp_path, FIRST="a")
    assert r.returncode == 0, r.stderr
    assert report["fidelity"] == 1.0 and report["exact_match_rate"] == 1.0
    assert report["replayed_calls"] == 5 and report["reordered"] >= 1
    assert out == reordered.out


def test_fork_journals_tool_results_for_the_steps_that_asked(
    reordered: Recorded, tmp_path: Path
) -> None:
    """A fork at step 2 re-draws the solvers' second calls live (the canned server answers
    them). The result of one task's tool call was journaled before step 2 (with the parent's
    step-2 call); the other comes with the branch's call of the same task, and is journaled
    for the step that asked for it - task a's for step 1, task b's for step 0 - although the
    ids the program sends back were handed out in the order the calls came in."""
    with ReorderingServer(hold=0.0) as srv:
        out = tmp_path / "branch.json"
        r = car(reordered.journal, out, "fork", reordered.run_id, "--at", "2", "--do",
                "resample", "-n", "1", "--base-url", srv.base_url, "--json", "--",
                *reordered.cmd, FIRST="a")  # fmt: skip
    assert r.returncode == 0, r.stderr
    (branch,) = json.loads(r.stdout)["branches"]
    assert branch["status"] == "completed"
    with Journal(reordered.journal) as j:
        events = j.events(branch["run_id"])
    question = {
        e.step: wire.messages_of(e.request)[1]["content"]
        for e in events
        if isinstance(e, ev.LlmCall) and e.step in (0, 1)
    }
    assert question == {0: QUESTIONS["b"], 1: QUESTIONS["a"]}
    results = [(i, e) for i, e in enumerate(events) if isinstance(e, ev.ToolResult)]
    assert sorted(e.step for _, e in results) == [0, 1]  # each once
    start = next(i for i, e in enumerate(events) if isinstance(e, ev.Intervention))
    (own,) = [(i, e) for i, e in results if i > start]
    # the branch's call that carried it follows it, in the same append
    carrier = next(x for x in events[own[0] :] if isinstance(x, ev.LlmCall))
    assert own[1].step is not None and carrier.step is not None and carrier.step >= 2
    assert wire.messages_of(carrier.request)[1]["content"] == question[own[1].step]


# Two questions of one agent in flight together, the one started second after a pause: which
# reaches the proxy first is up to FIRST. No tools: a canned server answers (plumbing only).
ASKERS = """
import asyncio, os
from openai import AsyncOpenAI

client = AsyncOpenAI(max_retries=0)
first = os.environ["FIRST"]

async def ask(name, question):
    if name != first:
        await asyncio.sleep(0.3)
    await client.chat.completions.create(
        model="m", user="solver", messages=[{"role": "user", "content": question}])

async def main():
    await asyncio.gather(*(ask(n, q) for n, q in sorted(QUESTIONS.items())))

asyncio.run(main())
""".replace("QUESTIONS", repr(QUESTIONS))


def test_an_agents_calls_in_flight_together_are_seeded_alike_whichever_comes_first(
    tmp_path: Path,
) -> None:
    """The program recorded twice with one root seed, once with task a's call first, once with
    task b's: each question reaches the server with the same injected seed both times, and the
    two questions with different seeds. Seeded by arrival order, the two swapped seeds, so two
    forks with one branch seed could draw one logical call differently."""
    from program_helpers import CannedServer

    prog = tmp_path / "askers.py"
    prog.write_text(ASKERS)
    seeds: dict[str, dict[str, int]] = {}
    for first in ("a", "b"):
        with CannedServer() as srv:
            r = car(tmp_path / f"{first}.db", tmp_path / "unused.json", "record", "--base-url",
                    srv.base_url, "--seed", "5", "--json", "--", sys.executable, str(prog),
                    FIRST=first)  # fmt: skip
            assert r.returncode == 0, r.stderr
            got = [(q["messages"][-1]["content"], q["seed"]) for q in srv.requests]
        assert got[0][0] == QUESTIONS[first]  # the order was as asked
        seeds[first] = {text: seed for text, seed in got}
    assert seeds["a"] == seeds["b"]
    assert len(set(seeds["a"].values())) == 2
