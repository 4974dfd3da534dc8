"""Pause, resume and stop requests for a running episode (from the CLI, a signal or a server)."""

from __future__ import annotations

import threading


class ControlChannel:
    """Thread-safe requests, checked by the episode loop between steps.

    A request is journaled as a Control event by the loop, not by the caller, so the journal
    shows exactly where in the run it took effect."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: list[tuple[str, str]] = []

    def request(self, action: str, reason: str = "") -> None:
        if action not in ("pause", "resume", "stop"):
            raise ValueError(f"unknown control action {action!r}; expected pause, resume or stop")
        with self._cond:
            self._pending.append((action, reason))
            self._cond.notify_all()

    def take(self) -> list[tuple[str, str]]:
        with self._cond:
            taken, self._pending = self._pending, []
            return taken

    def wait(self, timeout: float | None = None) -> list[tuple[str, str]]:
        """Block until a request arrives (or the timeout passes) and take them all."""
        with self._cond:
            if not self._pending:
                self._cond.wait(timeout)
            taken, self._pending = self._pending, []
            return taken
