"""One small error hierarchy. The CLI turns every EngineError into one clean line, and every
Ctrl-C (also one that came out as another error: `interrupt_behind`) into one as well."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class JournalError(EngineError):
    """The journal cannot be opened, read or written."""


class NotAJournal(JournalError):
    """The file exists but is not a Causal Agent Replay journal."""


class SchemaTooNew(JournalError):
    """The journal was written by a newer schema than this engine knows."""


class UnknownRun(JournalError):
    """No run with this id (or id prefix) exists in the journal."""


class ConcurrencyError(JournalError):
    """Another writer appended at the same (run_id, seq) first."""


class RunClosed(JournalError):
    """The run has ended: nothing may follow its `RunEnded` but its one accusation."""


class JournalBusy(JournalError):
    """The journal stayed locked by another writer past the wait allowed for it: nothing was
    written, and the same request may succeed if tried again later."""


class AppendOnlyViolation(JournalError):
    """The database refused an UPDATE or DELETE of journal history."""


class TamperedJournal(JournalError):
    """A hash in the chain does not match the event it covers."""


class ReplayDivergence(EngineError):
    """A rebuilt state or action differs from what was recorded."""


class ConfigError(EngineError):
    """A configuration or model file is malformed."""


class PolicyError(EngineError):
    """A policy (e.g. an LLM server) failed to produce an action."""


class InterventionError(EngineError):
    """An intervention does not fit the run or step it targets."""


class UnknownScenario(ConfigError):
    """A run names a scenario that no implementation is registered for."""


def interrupt_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that `e` was raised from or while handling, if any: a Ctrl-C
    inside an import that runs during a command can come out as another error (Python 3.11
    wraps an exception from a class body's `__set_name__` in RuntimeError), which is still
    the user's Ctrl-C and must end as one."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None
