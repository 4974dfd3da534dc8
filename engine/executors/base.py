"""The contract between the commands that spend forward runs and whatever runs them.

A forward run is a job: a module-level function `job(journal, parent, arg) -> BranchResult`
that forks `parent`, runs the branch to its end and appends it to `journal`. An executor maps
a job over many args and reports each result as it arrives, in any order. The job is the same
code under every executor, and all of its randomness comes from the branch seed inside `arg`,
so the same seeds give the same outcomes whatever runs them.

Executors never move journals: a local one hands its own open journal to the job, a Ray worker
opens the shared journal itself from its URL and keeps it (one connection pool) for its life.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from engine.errors import ConfigError

if TYPE_CHECKING:
    from engine.interventions import BranchResult, ParentInfo
    from engine.journal import Journal

#: A forward run: fork the parent, run the branch, return its result (module level, so that a
#: worker on another machine can import it by name).
Job = Callable[["Journal", "ParentInfo", Any], "BranchResult"]
OnDone = Callable[[int, "BranchResult"], None]

EXECUTORS = ("local", "ray")

#: Why a Ray executor refuses a SQLite journal (said by the executor, and by a command that
#: checks before it opens the journal)
RAY_NEEDS_A_SERVER = (
    "--executor ray needs a PostgreSQL journal (--journal postgresql+psycopg://...):"
    " workers on other machines cannot open a SQLite file"
)


class ExecutorOptions(msgspec.Struct, frozen=True):
    """What the user chose on the command line: `--executor`, `--ray-address`, `--workers`."""

    kind: str = "local"
    address: str | None = None
    workers: int | None = None
    #: local: whether this process may fork worker processes for forward runs. A process
    #: with threads of its own (the server) says no: a fork copies every lock another thread
    #: holds at that moment, held for good in the child; its forward runs then go to the
    #: standing pool it forked before its threads started (engine.executors.local), else to
    #: threads.
    processes: bool = True

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise ConfigError(
                f"unknown executor {self.kind!r}; expected one of: {', '.join(EXECUTORS)}"
            )
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers must be at least 1, got {self.workers}")
        if self.kind == "local" and self.address is not None:
            raise ConfigError("--ray-address applies to --executor ray only")


class ExecutorStats(msgspec.Struct):
    """What an executor did, for the command's report."""

    name: str
    workers: int
    #: forward runs whose worker was lost mid-branch and that were run again
    retried: int = 0
    #: forward runs that failed because their worker was lost twice (not scored)
    lost: int = 0
    #: half-run branches of lost workers closed as stopped in the journal
    closed: int = 0
    #: local processes: seconds each spent running jobs, and its CPU seconds (the command's
    #: own process first, its CPU seconds in jobs; then each forked worker's)
    busy_s: list[float] | None = None
    cpu_s: list[float] | None = None
    #: local processes: seconds the command spent in its batches (its own jobs, handing out
    #: the others and waiting for them)
    wall_s: float | None = None


class Executor(Protocol):
    """Runs forward-run jobs; one executor serves a whole command."""

    name: str

    def map(
        self,
        journal: Journal,
        parent: ParentInfo,
        job: Job,
        args: Sequence[Any],
        on_done: OnDone,
        labels: Collection[str] = (),
    ) -> None:
        """Run job(journal, parent, arg) for every arg; on_done(index, result) as each ends.

        Raises Interrupted on a stop request (Ctrl-C), after the running branches were told
        to stop. `labels` are the branch labels the jobs use (for closing what a lost worker
        left open)."""
        ...

    def stats(self) -> ExecutorStats: ...

    def close(self, interrupted: bool = False) -> None: ...


class Borrowed:
    """An executor lent to a caller for a while: closing it is its owner's business (e.g.
    detect-eval keeps one set of Ray workers for every game)."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.name = inner.name

    def map(
        self,
        journal: Journal,
        parent: ParentInfo,
        job: Job,
        args: Sequence[Any],
        on_done: OnDone,
        labels: Collection[str] = (),
    ) -> None:
        self.inner.map(journal, parent, job, args, on_done, labels)

    def stats(self) -> ExecutorStats:
        return self.inner.stats()

    def close(self, interrupted: bool = False) -> None:
        pass


def make_executor(
    options: ExecutorOptions | Executor | None,
    journal: Journal,
    parent: ParentInfo | None = None,
    *,
    concurrency: int,
    mode: str = "threads",
) -> Executor:
    """The executor the options name. `mode` is the local executor's way of running
    (inline, threads or processes); a Ray executor ignores it. A live executor is lent, not
    copied (its owner closes it)."""
    if options is not None and not isinstance(options, ExecutorOptions):
        return Borrowed(options)
    if options is None or options.kind == "local":
        from engine.executors.local import LocalExecutor, standing_pool

        if mode == "processes" and options is not None and not options.processes:
            # no fork from here: the standing pool its host forked before its threads, if any
            standing = standing_pool()
            if standing is None:
                return LocalExecutor("threads", concurrency, parent)
            return LocalExecutor(mode, concurrency, parent, standing=standing)
        return LocalExecutor(mode, concurrency, parent)
    from engine.executors.ray import RayExecutor

    return RayExecutor(
        journal, address=options.address, workers=options.workers, concurrency=concurrency
    )
