"""`car record / replay / fork -- CMD` against a canned OpenAI-compatible HTTP server: the
plumbing of recorded programs (events, agents, seeds, streams, tool calls, errors).

The canned server (tests/program_helpers.py) is a real HTTP server whose replies are fixed
text; the real model is exercised in test_program_llama.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from program_helpers import SLOW_WHEN_FORKED, CannedServer
from servers import FaultyLLMServer, free_port

from engine import events as ev
from engine.journal import Journal
from engine.program import wire

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "three_agents.py")
CHECK = f"{sys.executable} {ROOT / 'examples' / 'check.py'}"


def car(
    journal: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    base.pop("OPENAI_BASE_URL", None)
    base.update(env or {})
    base["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env=base,
        timeout=180,
    )


@pytest.fixture(scope="module")
def canned() -> CannedServer:
    with CannedServer() as s:
        yield s


def _record(
    tmp_path: Path, url: str, *extra: str
) -> tuple[Path, str, subprocess.CompletedProcess[str]]:
    journal = tmp_path / "j.db"
    env = {"THREE_AGENTS_OUT": str(tmp_path / "out.json")}
    r = car(
        journal, "record", "--base-url", url, "--outcome", CHECK, "--json", "--",
        sys.executable, EXAMPLE, *extra, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    return journal, run_id, r


Shared = tuple[Path, str, list[dict[str, object]]]


@pytest.fixture(scope="module")
def shared(canned: CannedServer, tmp_path_factory: pytest.TempPathFactory) -> Shared:
    """One recording of the example that the tests below only read or fork (with the
    requests the server received for it)."""
    before = len(canned.requests)
    journal, run_id, _ = _record(tmp_path_factory.mktemp("shared"), canned.base_url)
    return journal, run_id, canned.requests[before:]


def _events(journal: Path, run_id: str) -> list[ev.Event]:
    with Journal(journal) as j:
        return j.events(run_id)


def test_record_journals_one_run_of_existing_event_types(
    tmp_path: Path, canned: CannedServer, shared: Shared
) -> None:
    """A recorded program is one run: RunStarted(scenario program), one LlmCall per chat
    completion with request, seed, usage, latency and fingerprint, the model's tool call and
    the program's tool result, chat messages, and RunEnded with the outcome command's verdict."""
    journal, run_id, sent = shared
    events = _events(journal, run_id)
    kinds = [ev.kind_of(e) for e in events]
    assert kinds[0] == "run_started" and kinds[-1] == "run_ended"
    start = events[0]
    assert isinstance(start, ev.RunStarted) and start.scenario == "program"
    assert start.config["upstream"] == canned.base_url
    calls = [e for e in events if isinstance(e, ev.LlmCall)]
    assert [c.step for c in calls] == [0, 1, 2, 3]
    for c in calls:
        assert c.model == "canned-model" and c.system_fingerprint == "fp_canned"
        assert c.prompt_tokens == 10 and c.completion_tokens == 5 and c.latency_ms > 0
        assert c.server == canned.base_url
        assert wire.seed_source_of(c.request) == "injected"  # the example sends no seed
        assert wire.params_of(c.request)["model"] == "smollm2"
    tool_calls = [e for e in events if isinstance(e, ev.ToolCall)]
    results = [e for e in events if isinstance(e, ev.ToolResult)]
    assert [(t.step, t.tool) for t in tool_calls] == [(1, "calculator")]
    assert [(t.step, t.output) for t in results] == [(1, "42")]
    assert sum(isinstance(e, ev.ChatMessage) for e in events) == 4
    end = events[-1]
    assert isinstance(end, ev.RunEnded) and end.status == "completed"
    # the canned reporter never says 42: check.py judges the run bad
    assert end.outcome == {"bad": True, "exit_status": 0, "outcome_status": 1, "calls": 4}
    # the injected seed is what the server received
    assert [r["seed"] for r in sent] == [c.seed for c in calls]


def test_agents_told_apart_by_header_user_field_and_system_prompt(
    tmp_path: Path, canned: CannedServer, shared: Shared
) -> None:
    """The planner sends X-Car-Agent, the solver the `user` field, the reporter only a system
    prompt (named agent-1, the first unnamed prompt)."""
    journal, run_id, _sent = shared
    calls = [e for e in _events(journal, run_id) if isinstance(e, ev.LlmCall)]
    assert [c.agent for c in calls] == ["planner", "solver", "solver", "agent-1"]


def test_tool_call_ids_are_the_recorders(
    tmp_path: Path, canned: CannedServer, shared: Shared
) -> None:
    """The program sees `call_<agent>_<n>_<i>` ids (not the server's), and sends them back in
    its tool message, so a replay hands out the very ids the recording did."""
    _, _, sent = shared
    tool_msgs = [m for m in sent[-2]["messages"] if m.get("role") == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == ["call_solver_0_0"]


def test_streaming_is_recorded_and_restreamed(tmp_path: Path, canned: CannedServer) -> None:
    """A `stream: true` call reaches the program as SSE chunks (the report it assembles is the
    server's text), is journaled whole, and a replay streams the same text back."""
    journal, run_id, _ = _record(tmp_path, canned.base_url, "--stream")
    calls = [e for e in _events(journal, run_id) if isinstance(e, ev.LlmCall)]
    last = calls[-1]
    assert wire.params_of(last.request)["stream"] is True
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["report"] == last.response and last.response.startswith("canned reply")
    (tmp_path / "out.json").unlink()
    env = {"THREE_AGENTS_OUT": str(tmp_path / "out.json")}
    r = car(journal, "replay", run_id, "--json", "--", sys.executable, EXAMPLE, "--stream", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["fidelity"] == 1.0
    assert json.loads((tmp_path / "out.json").read_text())["report"] == last.response


def test_replay_answers_from_the_journal_at_fidelity_one(
    tmp_path: Path, canned: CannedServer, shared: Shared
) -> None:
    """A replay needs no server: every call is answered from the journal, every request
    matches, and the outcome is the recorded one."""
    journal, run_id, _sent = shared
    before = len(canned.requests)
    env = {"THREE_AGENTS_OUT": str(tmp_path / "out.json")}
    r = car(journal, "replay", run_id, "--json", "--", sys.executable, EXAMPLE, env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["fidelity"] == 1.0 and report["exact_match_rate"] == 1.0
    assert report["replayed_calls"] == report["recorded_calls"] == 4
    assert report["outcome_match"] is True
    assert len(canned.requests) == before  # nothing reached the server


NONDETERMINISTIC = """
import os, sys
from openai import OpenAI
c = OpenAI(max_retries=0)
r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}])
extra = os.environ.get("TWIST", "")
r = c.chat.completions.create(model="m", messages=[
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": r.choices[0].message.content},
    {"role": "user", "content": "and then?" + extra},
])
"""


def test_replay_miss_is_a_diagnosis(tmp_path: Path, canned: CannedServer) -> None:
    """A program that asks something else on replay gets a one-line diagnosis naming the first
    differing field, both values and the nearest recorded call; the replay exits 1."""
    prog = tmp_path / "prog.py"
    prog.write_text(NONDETERMINISTIC)
    journal = tmp_path / "j.db"
    r = car(
        journal, "record", "--base-url", canned.base_url, "--json", "--", sys.executable, str(prog)
    )
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    r = car(journal, "replay", run_id, "--", sys.executable, str(prog), env={"TWIST": " now"})
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: replay miss: call 1 of agent 'assistant' (recorded step 1)")
    assert "messages[2].content differs: recorded 'and then?', got 'and then? now'" in last
    assert "nearest recorded call: step 1" in last
    # --match position answers by position: the run completes, the divergence is counted
    r = car(journal, "replay", run_id, "--match", "position", "--json", "--",
            sys.executable, str(prog), env={"TWIST": " now"})  # fmt: skip
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["fidelity"] == 0.5
    assert [d["field"] for d in report["divergences"]] == ["messages[2].content"]


def test_match_mode_typo_fails_loudly(tmp_path: Path, canned: CannedServer, shared: Shared) -> None:
    """An unknown --match is a usage error listing the valid modes."""
    journal, run_id, _sent = shared
    r = car(journal, "replay", run_id, "--match", "exactly", "--", sys.executable, EXAMPLE)
    assert r.returncode == 2
    assert "'exact', 'messages', 'position'" in r.stderr


def test_upstream_down_is_one_line_and_leaves_no_run_open(tmp_path: Path) -> None:
    """Nothing listens at the upstream: one line, non-zero exit, no run recording."""
    journal = tmp_path / "j.db"
    url = f"http://127.0.0.1:{free_port()}/v1"
    r = car(journal, "record", "--base-url", url, "--", sys.executable, EXAMPLE)
    assert r.returncode == 1
    assert r.stderr.strip() == f"error: upstream {url} is unreachable: connection refused"
    if journal.exists():
        with Journal(journal) as j:
            assert all(j.status(i.run_id) != "recording" for i in j.runs())


def test_no_upstream_at_all_is_one_line(tmp_path: Path) -> None:
    """No --base-url and no OPENAI_BASE_URL: one line saying which to give."""
    r = car(tmp_path / "j.db", "record", "--", sys.executable, EXAMPLE)
    assert r.returncode == 1
    assert r.stderr.startswith("error: no upstream model server: give --base-url URL")


def _reset(conn, req, release) -> None:  # type: ignore[no-untyped-def]
    conn.close()


def test_upstream_dying_mid_run_closes_the_run_failed(tmp_path: Path) -> None:
    """The upstream answers the first call, then drops every connection: the program fails,
    the run is closed as failed with the reason, and car says so in one line."""
    journal = tmp_path / "j.db"
    with FaultyLLMServer(_reset, good=1) as srv:
        r = car(journal, "record", "--base-url", srv.base_url, "--", sys.executable, EXAMPLE,
                env={"THREE_AGENTS_OUT": str(tmp_path / "o.json")})  # fmt: skip
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: upstream {srv.base_url} is unreachable")
    assert "closed as failed" in last
    with Journal(journal) as j:
        (info,) = j.runs()
        assert j.status(info.run_id) == "failed"
        end = j.events(info.run_id)[-1]
        assert isinstance(end, ev.RunEnded) and "unreachable" in (end.error or "")
        assert sum(isinstance(e, ev.LlmCall) for e in j.events(info.run_id)) == 1


def test_program_crash_closes_the_run_with_a_bad_outcome(
    tmp_path: Path, canned: CannedServer
) -> None:
    """A program that exits 3 after one call: the run is completed with outcome bad and exit
    status 3, car says so in one line and exits 3 too."""
    prog = tmp_path / "crash.py"
    prog.write_text(
        "import sys\nfrom openai import OpenAI\n"
        "OpenAI().chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'x'}])\n"
        "sys.exit(3)\n"
    )
    journal = tmp_path / "j.db"
    r = car(journal, "record", "--base-url", canned.base_url, "--", sys.executable, str(prog))
    assert r.returncode == 3
    assert r.stderr.strip().splitlines()[-1].startswith("error: the program exited with status 3")
    with Journal(journal) as j:
        (info,) = j.runs()
        end = j.events(info.run_id)[-1]
        assert isinstance(end, ev.RunEnded) and end.status == "completed"
        assert end.outcome["bad"] is True and end.outcome["exit_status"] == 3


def test_ctrl_c_closes_the_run_as_stopped(tmp_path: Path, canned: CannedServer) -> None:
    """SIGINT while the program runs: the program is stopped, the run closed as stopped (never
    left recording), one line and exit 130."""
    prog = tmp_path / "slow.py"
    prog.write_text(
        "import time\nfrom openai import OpenAI\n"
        "OpenAI().chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'x'}])\n"
        "print('called', flush=True)\ntime.sleep(60)\n"
    )
    journal = tmp_path / "j.db"
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_BASE_URL"}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.Popen(
        [sys.executable, "-m", "cli", "--journal", str(journal), "record", "--base-url",
         canned.base_url, "--", sys.executable, str(prog)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "called"
    p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=30)
    assert p.returncode == 130
    assert (
        stderr.strip().splitlines()[-1]
        == "interrupted: the program was stopped; run closed as stopped"
    )
    with Journal(journal) as j:
        (info,) = j.runs()
        assert j.status(info.run_id) == "stopped"


def test_fork_branches_are_child_runs_with_outcomes(
    tmp_path: Path, canned: CannedServer, shared: Shared
) -> None:
    """`car fork RUN --at K --do action -- CMD`: each branch is a child run that shares the
    calls before K, starts with the Intervention, journals the forced answer at K and the live
    calls after it, and ends with its own outcome (bad: the canned reporter never says 42)."""
    journal, run_id, _sent = shared
    env = {"THREE_AGENTS_OUT": str(tmp_path / "out.json")}
    before = len(canned.requests)
    r = car(journal, "fork", run_id, "--at", "2", "--do", "action", "--value", "It is 42.",
            "-n", "2", "--json", "--", sys.executable, EXAMPLE, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["bad"] == 2 and report["scored"] == 2 and report["factual_bad"] is True
    assert len(canned.requests) == before + 2  # only the reporter's call after K went live
    with Journal(journal) as j:
        for b in report["branches"]:
            events = j.events(b["run_id"])
            own = events[[ev.kind_of(e) for e in events].index("intervention") :]
            assert isinstance(own[0], ev.Intervention) and own[0].at == 2
            calls = [e for e in own if isinstance(e, ev.LlmCall)]
            assert [(c.step, c.agent) for c in calls] == [(2, "solver"), (3, "agent-1")]
            assert calls[0].response == "It is 42."
            assert wire.seed_source_of(calls[1].request) == "branch"
            assert j.run(b["run_id"]).parent_run_id == run_id


def test_fork_resample_redraws_with_branch_seeds(
    tmp_path: Path, canned: CannedServer, shared: Shared
) -> None:
    """do_resample at K re-sends call K live with each branch's own seed (the canned text
    echoes it), and the calls before K never reach the server."""
    journal, run_id, sent = shared
    env = {"THREE_AGENTS_OUT": str(tmp_path / "out.json")}
    before = len(canned.requests)
    r = car(journal, "fork", run_id, "--at", "3", "--do", "resample", "-n", "3", "--json", "--",
            sys.executable, EXAMPLE, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    sent = canned.requests[before:]
    assert len(sent) == 3 and len({s["seed"] for s in sent}) == 3


def test_fork_observation_rewrites_the_tool_result_the_model_sees(
    tmp_path: Path, canned: CannedServer, shared: Shared
) -> None:
    """do_observation at the solver's tool call keeps the recorded call and replaces the tool
    result in what the next call sends upstream (and in the journaled ToolResult)."""
    journal, run_id, _sent = shared
    env = {"THREE_AGENTS_OUT": str(tmp_path / "out.json")}
    before = len(canned.requests)
    r = car(journal, "fork", run_id, "--at", "1", "--do", "observation", "--value", "41",
            "-n", "1", "--json", "--", sys.executable, EXAMPLE, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    first = canned.requests[before]
    assert [m["content"] for m in first["messages"] if m["role"] == "tool"] == ["41"]
    child = json.loads(r.stdout)["branches"][0]["run_id"]
    with Journal(journal) as j:
        res = [e for e in j.events(child) if isinstance(e, ev.ToolResult)]
        assert [x.output for x in res] == ["41"]


def test_fork_observation_needs_a_tool_call(
    tmp_path: Path, canned: CannedServer, shared: Shared
) -> None:
    """do_observation at a call without tool calls: one line listing the calls that have one."""
    journal, run_id, _sent = shared
    r = car(journal, "fork", run_id, "--at", "0", "--do", "observation", "--value", "x",
            "-n", "1", "--", sys.executable, EXAMPLE)  # fmt: skip
    assert r.returncode == 1
    assert "calls with tool calls: 1" in r.stderr and r.stderr.count("\n") == 1


def test_replay_of_a_heist_run_with_a_command_is_refused(tmp_path: Path) -> None:
    """`-- CMD` is for recorded programs: a heist run is refused in one line."""
    journal = tmp_path / "j.db"
    r = car(journal, "heist", "--rounds", "1", "--seed", "1", "-q")
    assert r.returncode == 0, r.stderr
    with Journal(journal) as j:
        run_id = j.runs()[0].run_id
    r = car(journal, "replay", run_id, "--", sys.executable, EXAMPLE)
    assert r.returncode == 1
    assert "is a 'heist' run, not a recorded program" in r.stderr


def test_core_commands_send_a_program_run_to_its_command(
    tmp_path: Path, canned: CannedServer, shared: Shared
) -> None:
    """The Scenario registry knows "program": `car fidelity` (which would drive the run step
    by step) and `car fork` without `-- CMD` say in one line how such a run is re-run."""
    journal, run_id, _sent = shared
    r = car(journal, "fidelity", run_id)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "re-run by its own command" in r.stderr and "car replay RUN -- CMD" in r.stderr
    r = car(journal, "fork", run_id, "--at", "1", "--do", "resample", "-n", "1")
    assert r.returncode == 1 and "give its command after `--`" in r.stderr


def test_ctrl_c_during_a_fork_closes_the_branch_as_stopped(
    tmp_path: Path, canned: CannedServer
) -> None:
    """SIGINT while a branch's program runs: the program is stopped, the branch closed as
    stopped (never left recording), exit 130."""
    prog = tmp_path / "slow.py"
    prog.write_text(SLOW_WHEN_FORKED)
    journal = tmp_path / "j.db"
    r = car(
        journal, "record", "--base-url", canned.base_url, "--json", "--", sys.executable, str(prog)
    )
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_BASE_URL"}
    env.update(PYTHONPATH=str(ROOT), SLOW="1")
    p = subprocess.Popen(
        [sys.executable, "-m", "cli", "--journal", str(journal), "fork", run_id, "--at", "1",
         "--do", "resample", "-n", "3", "--", sys.executable, str(prog)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stderr is not None
    assert p.stderr.readline().strip() == "called"
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=30)
    assert p.returncode == 130
    with Journal(journal) as j:
        kids = j.children(run_id)
        assert len(kids) == 1  # the next branches never started
        assert j.status(kids[0].run_id) == "stopped"


def test_fork_policy_and_context(tmp_path: Path, canned: CannedServer, shared: Shared) -> None:
    """do_policy at K sends call K and later ones to another server and model; do_context
    {"text": t} adds t as a user message to call K's request."""
    journal, run_id, sent = shared
    env = {"THREE_AGENTS_OUT": str(tmp_path / "out.json")}
    with CannedServer() as other:
        spec = f"openai:base_url={other.base_url},model=other-model"
        r = car(journal, "fork", run_id, "--at", "2", "--do", "policy", "--value", spec,
                "-n", "1", "--json", "--", sys.executable, EXAMPLE, env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert [q["model"] for q in other.requests] == ["other-model", "other-model"]
    before = len(canned.requests)
    r = car(journal, "fork", run_id, "--at", "3", "--do", "context", "--value", "Say 42.",
            "-n", "1", "--json", "--", sys.executable, EXAMPLE, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    (sent,) = canned.requests[before:]
    assert sent["messages"][-1] == {"role": "user", "content": "Say 42."}


EARLY_TWIST = """
import os
from openai import OpenAI
c = OpenAI(max_retries=0)
first = "hello" + os.environ.get("TWIST", "")
c.chat.completions.create(model="m", messages=[{"role": "user", "content": first}])
c.chat.completions.create(model="m", messages=[{"role": "user", "content": "and then?"}])
"""


def test_fork_names_a_divergence_before_k(tmp_path: Path, canned: CannedServer) -> None:
    """A program that asks something else before the fork point is not deterministic given
    the model's answers: the branch fails with the diagnosis (closed as failed, never left
    recording) and the fork says so in one line."""
    prog = tmp_path / "prog.py"
    prog.write_text(EARLY_TWIST)
    journal = tmp_path / "j.db"
    r = car(
        journal, "record", "--base-url", canned.base_url, "--json", "--", sys.executable, str(prog)
    )
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    r = car(journal, "fork", run_id, "--at", "1", "--do", "resample", "-n", "1", "--",
            sys.executable, str(prog), env={"TWIST": "!"})  # fmt: skip
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: every branch failed (1 of 1): replay miss: call 0 of agent")
    assert "messages[0].content differs: recorded 'hello', got 'hello!'" in last
    with Journal(journal) as j:
        (kid,) = j.children(run_id)
        assert j.status(kid.run_id) == "failed"


CONCURRENT = """
import threading
from openai import OpenAI
c = OpenAI(max_retries=0)

def agent(name):
    history = [{"role": "user", "content": f"I am {name}"}]
    for _ in range(2):
        head = {"X-Car-Agent": name}
        r = c.chat.completions.create(model="m", messages=history, extra_headers=head)
        history += [{"role": "assistant", "content": r.choices[0].message.content}]

threads = [threading.Thread(target=agent, args=(n,)) for n in ("ann", "bob", "cy")]
for t in threads: t.start()
for t in threads: t.join()
"""


def test_concurrent_agents_replay_by_agent_and_position(
    tmp_path: Path, canned: CannedServer
) -> None:
    """Three agents calling at once: steps are numbered in completion order, each agent's calls
    keep their order, and a replay (matching each agent's n-th call) is faithful whatever
    order the calls arrive in this time."""
    prog = tmp_path / "three_at_once.py"
    prog.write_text(CONCURRENT)
    journal = tmp_path / "j.db"
    r = car(
        journal, "record", "--base-url", canned.base_url, "--json", "--", sys.executable, str(prog)
    )
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    calls = [e for e in _events(journal, run_id) if isinstance(e, ev.LlmCall)]
    assert sorted(c.step for c in calls) == list(range(6))
    assert sorted(c.agent for c in calls) == ["ann", "ann", "bob", "bob", "cy", "cy"]
    r = car(journal, "replay", run_id, "--json", "--", sys.executable, str(prog))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["fidelity"] == 1.0


def test_the_detector_reads_a_recorded_program(shared: Shared) -> None:
    """`car detect` works on a recorded program: its agents, learned as they called, are the
    public view's agents in the order they first acted, and the rules score each of them."""
    journal, run_id, _ = shared
    r = car(journal, "detect", run_id, "--method", "rules", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert list(data["suspicion_scores"]) == ["planner", "solver", "agent-1"]
    assert data["suggested_mole"] in ("planner", "solver", "agent-1")
