"""The in-process API: record a program's calls without a separate process.

    from engine.journal import Journal
    from engine.program.client import recording

    with Journal("recordings/journal.db") as j, recording(j, upstream=URL) as rec:
        client = rec.wrap(openai.OpenAI(), agent="planner")

        @rec.tool
        def calculator(expression: str) -> str: ...

        ...  # the program, unchanged
        rec.outcome(bad=False)

`wrap` points a copy of the client at the same recording proxy `car record` uses (started in a
thread of this process), so its chat completions are journaled exactly as a recorded program's
are, with the agent named by the X-Car-Agent header. `tool` journals each call of a function
as the latest call's ToolCall/ToolResult, and under a fork's do_observation at that call
returns the intervention's text instead of running (`fork_recording`).
"""

from __future__ import annotations

import functools
import os
import shlex
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from engine import events as ev
from engine.interventions import Intervention, iv_value, op_name
from engine.journal import Journal
from engine.program import wire
from engine.program.proxy import Proxy, Session, Upstream
from engine.program.session import (
    SCENARIO,
    _prefix_tools,
    _utc_now,
    branch_upstream,
    program_info,
)
from engine.runtime.recorder import Recorder
from engine.state import State, state_at_seq, step_seq
from engine.version import engine_version

_F = TypeVar("_F", bound=Callable[..., Any])


class Recording:
    """One run being recorded in this process (a context manager: closing ends the run)."""

    def __init__(self, recorder: Recorder | None, session: Session, run_id: str) -> None:
        self.recorder = recorder
        self.session = session
        self.proxy = Proxy(session)
        self.run_id = run_id
        self._outcome: dict[str, Any] = {"bad": None}
        self._closed = False

    def __enter__(self) -> Recording:
        self.proxy.__enter__()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(None if exc is None else f"{type(exc).__name__}: {exc}")

    def wrap(self, client: Any, agent: str | None = None) -> Any:
        """A copy of an `openai.OpenAI` client whose calls go through the recording."""
        headers = {wire.AGENT_HEADER: agent} if agent else {}
        return client.with_options(base_url=self.proxy.base_url, default_headers=headers)

    def tool(self, fn: _F | None = None, *, name: str | None = None) -> Any:
        """Decorate a tool function: each call journaled (arguments as JSON, result as text)."""

        def deco(f: _F) -> _F:
            tool_name = name or f.__name__

            @functools.wraps(f)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                param = wire.canonical({"args": list(args), "kwargs": kwargs} if args else kwargs)
                return self.session.journal_tool(tool_name, param, lambda: f(*args, **kwargs))

            return wrapper  # type: ignore[return-value]

        return deco(fn) if fn is not None else deco

    def outcome(self, bad: bool, **extra: Any) -> None:
        """The run's outcome, journaled when the recording closes."""
        self._outcome = {"bad": bool(bad), **extra}

    def close(self, error: str | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self.proxy.close()
        if self.recorder is None:
            return  # a replay journals nothing
        failure = error or self.session.failure
        status = "failed" if failure else "completed"
        outcome = {**self._outcome, "calls": self.session.calls}
        self.recorder.append([ev.RunEnded(status=status, outcome=outcome, error=failure)])
        self.recorder.flush()


def recording(
    journal: Journal, *, upstream: str | None = None, name: str = "", seed: int = 0
) -> Recording:
    """Start recording a new run of this process (upstream: default $OPENAI_BASE_URL)."""
    url = upstream or os.environ.get("OPENAI_BASE_URL")
    up = Upstream(url) if url else None
    if up is not None:
        up.check()
    command = [sys.executable, *sys.argv]
    run_id = journal.create_run(SCENARIO, label=name or shlex.join(command)[:80])
    rec = Recorder(journal, run_id, State(), 0)
    rec.append(
        [
            ev.RunStarted(
                scenario=SCENARIO,
                config={
                    "command": command,
                    "cwd": os.getcwd(),
                    "upstream": url,
                    "name": name,
                    "in_process": True,
                },
                agents=[],
                policy={"name": "program", "base_url": url},
                root_seed=seed,
                engine_version=engine_version(),
                started_at=_utc_now(),
            )
        ]
    )
    rec.flush()
    return Recording(rec, Session(recorder=rec, upstream=up, root_seed=seed), run_id)


def fork_recording(
    journal: Journal,
    run_id: str,
    iv: Intervention,
    branch_seed: int = 0,
    *,
    upstream: str | None = None,
) -> Recording:
    """A branch of recorded run `run_id` for the program to run again in this process: calls
    before iv.k answered from the journal, `iv` at k, live after (like `car fork -- CMD`)."""
    info = program_info(journal, run_id)
    k = iv.k
    fork_seq = step_seq(journal, info.run_id, k)
    child = journal.fork(info.run_id, fork_seq, label=f"do_{op_name(iv)}@{k} in-process")
    rec = Recorder(journal, child, state_at_seq(journal, info.run_id, fork_seq), fork_seq)
    rec.append(
        [ev.Intervention(step=k, op=op_name(iv), at=k, value=iv_value(iv), branch_seed=branch_seed)]
    )
    rec.flush()
    tool_ids, done = _prefix_tools(journal, info.run_id, fork_seq, info.calls, k)
    session = Session(
        recorder=rec,
        upstream=branch_upstream(info, upstream),
        root_seed=info.root_seed,
        recorded=info.calls,
        fork_at=k,
        intervention=iv,
        branch_seed=branch_seed,
        next_step=k,
        resulted_ids=done,
        tool_ids=tool_ids,
    )
    return Recording(rec, session, child)


def replaying(journal: Journal, run_id: str) -> Recording:
    """Answer this process's calls from recorded run `run_id` (nothing journaled); a request
    that does not match its recorded call gets the diagnosis as an HTTP 400 error."""
    info = program_info(journal, run_id)
    session = Session(recorder=None, upstream=None, recorded=info.calls)
    return Recording(None, session, info.run_id)
