"""The one public read model of a run: what anyone but the reveal may see.

Everything that is not the reveal reads runs through this module: `car state` and `car show`
without `--reveal`, the sabotage detector, the server before the verdict, exports. It carries
the conversation as the crew saw it, the tool usage, control events and, once the run ended,
its (public) outcome. It never carries:

- the secret event (`mole_assigned`) nor anything derived from it, such as a private context
  that only the mole has;
- recorded LLM calls: a request holds the acting agent's system prompt, and the mole's holds
  its secret instructions (its token counts and latency differ too);
- the root seed, the world seed and the step seeds: when a scenario draws its mole from the run
  seed, the seed *is* the answer to anyone who can read the source;
- any order or presence that depends on who the mole is: agents come in config order and every
  per-agent section lists every agent;
- what a model server wrote in an error reply: it may quote or count the request, and the
  mole's request holds its instructions (`public_error`).

Reading skips the LLM-call and secret rows without decoding them, which also makes the view
cheap: most of a run's bytes are recorded prompts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import msgspec

from engine import events as ev
from engine.journal import Journal, StoredEvent

# Kinds never decoded by a public read: the secret, and LLM calls (their requests hold the
# mole's instructions).
_HIDDEN_KINDS = frozenset({*ev.SECRET_KINDS, "llm_call"})

# A server's own words in a failure: "... answered HTTP 400: <its message> (after 3 attempts)"
_SERVER_WORDS = re.compile(r"(answered HTTP \d{3}): .*?((?: \(after \d+ attempts\))?)$", re.S)


# ... and in a reply that is no completion: "... (received 812 bytes: '{\"echo\": ...')"
_RECEIVED = re.compile(r" \(received \d+ bytes: .*?\)(?=(?: \(after \d+ attempts\))?$)", re.S)


def public_error(error: str | None) -> str | None:
    """A run's error as the public may see it: the error reply of a model server keeps its
    status but not its message, which may quote the request or count its tokens (a request
    of the mole holds its secret instructions: "you requested 2300 tokens" tells a longer
    prompt), and a reply that is no completion keeps what was wrong with it but not its
    bytes nor their count (a server may echo the request); `--reveal` shows the whole
    error."""
    if error is None:
        return None
    error = _RECEIVED.sub(" (what it sent is shown with --reveal)", error)
    return _SERVER_WORDS.sub(r"\1 (its message is shown with --reveal)\2", error)


class PublicMessage(msgspec.Struct, frozen=True):
    seq: int
    step: int
    agent: str
    text: str


class PublicToolUse(msgspec.Struct, frozen=True):
    seq: int
    step: int
    agent: str
    tool: str
    param: str
    success: bool
    output: str
    error: str | None


class PublicRun(msgspec.Struct, frozen=True):
    run_id: str
    scenario: str
    agents: list[str]  # config order, never mole-dependent
    status: str
    steps: int
    parent_run_id: str | None
    fork_step: int | None
    outcome: dict[str, Any] | None  # only once the run ended (the outcome is public)
    messages: list[PublicMessage]
    tool_usage: list[PublicToolUse]
    controls: list[dict[str, Any]]  # pause/resume/stop: seq, step, action, reason
    verdict: dict[str, Any] | None  # only after `car accuse`: the reveal itself
    # additions beyond the agreed interface (defaults, so readers may ignore them)
    policy: str = ""  # the policy's name (sim, openai, ...)
    rounds: int = 0
    interventions: list[dict[str, Any]] = msgspec.field(default_factory=list)
    # why the run failed or stopped, as the public may see it (`public_error`)
    error: str | None = None


def public_steps(journal: Journal, run_id: str) -> int:
    """How many steps the run shows the public: `public_view(...).steps` without reading the
    run (a listing's count), so a run that failed in a step's LLM call counts the steps before
    it, as its view does, not the failed call's."""
    return journal.steps(run_id, skip_kinds=sorted(_HIDDEN_KINDS))


def _public_rows(
    journal: Journal, run_id: str, after_seq: int = -1, stop: int | None = None
) -> Iterator[StoredEvent]:
    for stored in journal.read(run_id, max(0, after_seq + 1), stop):
        if stored.kind not in _HIDDEN_KINDS:
            yield stored


def _agents(
    started: dict[str, Any], messages: list[PublicMessage], tools: list[PublicToolUse]
) -> list[str]:
    """The agents as RunStarted lists them (config order); a run that learns its agents as
    they act (a recorded program names each on its first call) lists them in the order they
    first spoke or used a tool, which is public behaviour."""
    listed = list(started.get("agents", []))
    if listed:
        return listed
    seen: dict[str, int] = {}
    for seq, agent in sorted(
        [(m.seq, m.agent) for m in messages] + [(t.seq, t.agent) for t in tools]
    ):
        seen.setdefault(agent, seq)
    return list(seen)


def _started_fields(e: ev.RunStarted) -> dict[str, Any]:
    """RunStarted without seeds or config internals: what the crew and the audience know."""
    return {
        "scenario": e.scenario,
        "agents": list(e.agents),
        "rounds": e.rounds,
        "policy": str(e.policy.get("name", "")),
    }


def _verdict(e: ev.SuspicionDeclared) -> dict[str, Any]:
    return {"suspect": e.suspect, "verdict": e.verdict, "mole": e.mole, "strategy": e.strategy}


def public_view(journal: Journal, run_id: str) -> PublicRun:
    """The public view of a run (or branch: its history through the parent's prefix)."""
    info = journal.run(run_id)
    started: dict[str, Any] = {}
    messages: list[PublicMessage] = []
    tools: list[PublicToolUse] = []
    controls: list[dict[str, Any]] = []
    interventions: list[dict[str, Any]] = []
    outcome: dict[str, Any] | None = None
    error: str | None = None
    verdict: dict[str, Any] | None = None
    fork_step: int | None = None
    # one consistent cut while a writer appends: the status first, then the events up to the
    # head seen after it, and the step count from those same events (a completed run read
    # this way always shows all of its steps)
    status = journal.status(info.run_id)
    head = journal.head(info.run_id)
    steps = 0
    for stored in _public_rows(journal, info.run_id, stop=head):
        e = stored.event
        if stored.step is not None:
            steps = max(steps, stored.step + 1)
        if isinstance(e, ev.ChatMessage):
            messages.append(PublicMessage(stored.seq, e.step or 0, e.agent, e.text))
        elif isinstance(e, ev.ToolResult):
            tools.append(
                PublicToolUse(
                    stored.seq, e.step or 0, e.agent, e.tool, e.param, e.ok, e.output, e.error
                )
            )
        elif isinstance(e, ev.RunStarted):
            started = _started_fields(e)
        elif isinstance(e, ev.Control):
            controls.append(
                {"seq": stored.seq, "step": e.step, "action": e.action, "reason": e.reason}
            )
        elif isinstance(e, ev.Intervention):
            interventions.append({"seq": stored.seq, "op": e.op, "at": e.at, "value": e.value})
            if info.fork_seq is not None and stored.seq == info.fork_seq:
                fork_step = e.at
        elif isinstance(e, ev.RunEnded):
            outcome = dict(e.outcome) if e.status == "completed" or e.outcome else None
            error = public_error(e.error)
        elif isinstance(e, ev.SuspicionDeclared):
            verdict = _verdict(e)
    if status in ("recording", "paused"):
        outcome = error = None  # an ancestor's RunEnded is not this branch's end
    return PublicRun(
        run_id=info.run_id,
        scenario=str(started.get("scenario", info.scenario)),
        agents=_agents(started, messages, tools),
        status=status,
        steps=steps,
        parent_run_id=info.parent_run_id,
        fork_step=fork_step,
        outcome=outcome,
        messages=messages,
        tool_usage=tools,
        controls=controls,
        verdict=verdict,
        policy=str(started.get("policy", "")),
        rounds=int(started.get("rounds", 0)),
        interventions=interventions,
        error=error,
    )


def public_events(
    journal: Journal, run_id: str, after_seq: int = -1
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Every public event of the run with seq > `after_seq`, in seq order, as (seq, dict).

    Kinds: run_started (scenario, agents, rounds, policy), message, tool_call, tool_result,
    control, run_ended, verdict. Secret events and LLM calls are never yielded; interventions
    (a branch's opening event) are not either."""
    info = journal.run(run_id)
    for stored in _public_rows(journal, info.run_id, after_seq):
        e = stored.event
        data: dict[str, Any] | None = None
        if isinstance(e, ev.RunStarted):
            data = {"kind": "run_started", **_started_fields(e)}
        elif isinstance(e, ev.ChatMessage):
            data = {"kind": "message", "step": e.step, "agent": e.agent, "text": e.text}
        elif isinstance(e, ev.ToolCall):
            data = {
                "kind": "tool_call",
                "step": e.step,
                "agent": e.agent,
                "tool": e.tool,
                "param": e.param,
            }
        elif isinstance(e, ev.ToolResult):
            data = {
                "kind": "tool_result",
                "step": e.step,
                "agent": e.agent,
                "tool": e.tool,
                "param": e.param,
                "success": e.ok,
                "output": e.output,
                "error": e.error,
            }
        elif isinstance(e, ev.Control):
            data = {"kind": "control", "step": e.step, "action": e.action, "reason": e.reason}
        elif isinstance(e, ev.RunEnded):
            data = {
                "kind": "run_ended",
                "status": e.status,
                "outcome": dict(e.outcome) if e.status == "completed" or e.outcome else None,
                "error": public_error(e.error),
            }
        elif isinstance(e, ev.SuspicionDeclared):
            data = {"kind": "verdict", **_verdict(e)}
        if data is not None:
            yield stored.seq, data


def public_state(journal: Journal, run_id: str, k: int) -> dict[str, Any]:
    """s_k as the public may see it: the conversation window before step k, the turn cursor,
    and for every agent (config order) its turns and its tool usage so far. No seeds, no
    secret, no count of folded events (the secret event would be one of them)."""
    from engine.state import next_agent, shown_state

    info = journal.run(run_id)
    s = shown_state(journal, info.run_id, k)
    agents = list(s.agents)
    per_agent = []
    for name in agents:
        ctx = s.contexts.get(name)
        per_agent.append(
            {
                "agent": name,
                "turns": ctx.turns if ctx is not None else 0,
                "tool_usage": [
                    {
                        "step": o.step,
                        "tool": o.tool,
                        "param": o.param,
                        "success": o.ok,
                        "output": o.output,
                    }
                    for o in (ctx.observations if ctx is not None else ())
                ],
            }
        )
    status = s.status
    return {
        "run_id": info.run_id,
        "k": k,
        "scenario": s.scenario,
        "agents": agents,
        "step": s.step,
        "acting_agent": next_agent(s),
        "round": s.round,
        "rounds": s.rounds,
        "status": status,
        "transcript": [{"step": c.step, "agent": c.agent, "text": c.text} for c in s.transcript],
        "per_agent": per_agent,
        "n_messages": s.n_messages,
        "n_tool_calls": s.n_tool_calls,
        "n_tool_failures": s.n_tool_failures,
        "interventions": list(s.interventions),
    }
