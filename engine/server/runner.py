"""Heists the server records in the background, one thread each, and their control channels.

A quick-started heist is an ordinary `record_heist` run: the same journal events, the same
Control events for pause / resume / stop (journaled by the episode loop where they take effect,
at the next step). The runner only adds the thread, a bound on how many heists record at once,
and an optional pause between steps of the embedded sim policy, so that a person (or a browser
test) can watch a heist that would otherwise finish in milliseconds.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

from engine import events as ev
from engine.errors import EngineError
from engine.heist.config import HeistConfig
from engine.heist.session import record_heist
from engine.journal import Journal
from engine.logging import get_logger
from engine.policies.base import Policy
from engine.runtime.control import ControlChannel

log = get_logger("car.server")


class TooManyHeists(EngineError):
    """Every recording slot of the server is taken."""


class NotControllable(EngineError):
    """A control action that does not apply to the run in its present state."""


@dataclass
class LiveHeist:
    """One heist recording in this server process."""

    run_id: str
    control: ControlChannel
    step_delay: float
    #: aborted at shutdown, when it can be (an LLM call in flight would hold the run open)
    policy: Policy | None = None
    thread: threading.Thread | None = None
    # what the user asked for last; the journal shows when it took effect
    paused: bool = False
    stopping: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class HeistRunner:
    """Starts heists in background threads and routes control requests to them."""

    def __init__(self, journal: Journal, *, max_heists: int = 4) -> None:
        if max_heists < 1:
            raise ValueError(f"max_heists must be at least 1, got {max_heists!r}")
        self.journal = journal
        self.max_heists = max_heists
        self._lock = threading.Lock()
        self._live: dict[str, LiveHeist] = {}
        # heists whose run does not exist yet, by an opaque ticket: nothing of a heist's seed
        # may name it anywhere a client could read (the mole is drawn from the seed)
        self._starting: dict[int, LiveHeist] = {}
        self._tickets = itertools.count(1)

    def active(self) -> list[str]:
        """Run ids of the heists recording here (a heist still creating its run is counted
        by `starting`, never listed: it has no id a client could use)."""
        with self._lock:
            return [r for r, h in self._live.items() if not h.done.is_set()]

    def starting(self) -> int:
        with self._lock:
            return sum(1 for h in self._starting.values() if not h.done.is_set())

    def _busy(self) -> int:
        live = sum(1 for h in self._live.values() if not h.done.is_set())
        return live + sum(1 for h in self._starting.values() if not h.done.is_set())

    def get(self, run_id: str) -> LiveHeist | None:
        with self._lock:
            h = self._live.get(run_id)
        return h if h is not None and not h.done.is_set() else None

    def start(
        self,
        policy: Policy,
        *,
        seed: int,
        rounds: int,
        config: HeistConfig | None,
        step_delay: float = 0.0,
        server: str | None = None,
    ) -> str:
        """Create the run and start recording it; returns its run id once RunStarted is in
        the journal. TooManyHeists when `max_heists` heists are recording already."""
        with self._lock:
            busy = self._busy()
            if busy >= self.max_heists:
                raise TooManyHeists(
                    f"{busy} heists are recording already (the server's limit is "
                    f"{self.max_heists}); stop one or wait until one ends"
                )
            # the slot is taken before the thread starts, so two quick starts cannot both pass
            ticket = next(self._tickets)
            pending = LiveHeist("", ControlChannel(), step_delay, policy=policy)
            self._starting[ticket] = pending
        created = threading.Event()
        box: dict[str, Any] = {}

        def on_step(_k: int, _agent: str, _events: list[Any]) -> None:
            if pending.step_delay > 0 and not pending.stopping:
                # an interruptible pause between steps: a control request wakes it at once
                pending.wake.wait(pending.step_delay)
                pending.wake.clear()

        def label_run(run_id: str) -> None:
            box["run_id"] = run_id
            with self._lock:
                self._starting.pop(ticket, None)
                pending.run_id = run_id
                self._live[run_id] = pending
            created.set()

        def work() -> None:
            try:
                record_heist(
                    self.journal,
                    policy,
                    seed=seed,
                    rounds=rounds,
                    config=config,
                    control=pending.control,
                    on_step=on_step,
                    server=server,
                    # a live viewer waits for every step; at most a few steps a second here
                    group_ms=0.0,
                    on_created=label_run,
                )
            except Exception as e:
                pending.error = str(e)
                box["error"] = e
                log.error("heist failed", error=str(e))
                if "run_id" in box:
                    self._close_failed(str(box["run_id"]), str(e))
            finally:
                pending.done.set()
                created.set()
                with self._lock:
                    self._starting.pop(ticket, None)

        t = threading.Thread(target=work, name=f"heist-{ticket}", daemon=True)
        pending.thread = t
        t.start()
        created.wait()
        if "run_id" not in box:
            err = box.get("error")
            if isinstance(err, EngineError):
                raise err
            raise EngineError(f"the heist could not start: {err}")
        return str(box["run_id"])

    def _close_failed(self, run_id: str, error: str) -> None:
        """A run whose loop died of an unexpected error is closed as failed, never left
        `recording` with nobody writing it."""
        try:
            if self.journal.status(run_id) in ("recording", "paused"):
                self.journal.append(run_id, [ev.RunEnded(status="failed", error=error)])
        except EngineError as e:
            log.error("could not close failed run", run_id=run_id, error=str(e))

    def request(self, run_id: str, action: str) -> LiveHeist:
        """Ask a recording heist to pause, resume or stop at its next step."""
        h = self.get(run_id)
        if h is None:
            raise NotControllable(
                f"session {run_id!r} is not recording in this server; only heists started "
                "here can be paused, resumed or stopped"
            )
        with self._lock:
            if h.stopping:
                raise NotControllable(f"session {run_id!r} is already stopping")
            if action == "pause" and h.paused:
                raise NotControllable(f"session {run_id!r} is already paused")
            if action == "resume" and not h.paused:
                raise NotControllable(f"session {run_id!r} is not paused")
            if action == "pause":
                h.paused = True
            elif action == "resume":
                h.paused = False
            elif action == "stop":
                h.stopping = True
            h.control.request(action, "dashboard")
        h.wake.set()
        return h

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every heist still recording and wait for each to close its run."""
        with self._lock:
            live = [
                h for h in (*self._live.values(), *self._starting.values()) if not h.done.is_set()
            ]
        for h in live:
            h.stopping = True
            h.control.request("stop", "server shutdown")
            h.wake.set()
            # a call to a model server in flight would hold the run until it answers (or
            # times out): abort it, so that the run is closed as stopped at once
            cancel = getattr(h.policy, "cancel", None)
            if callable(cancel):
                try:
                    cancel()
                except Exception as e:
                    log.error("could not cancel a policy", run_id=h.run_id, error=str(e))
        for h in live:
            if h.thread is not None:
                h.thread.join(timeout)
