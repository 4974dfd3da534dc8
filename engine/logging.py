"""Logging: key=value lines on stderr through structlog, configured once; the run id and the
step are bound through a context variable of our own.

structlog (and with it rich) is imported only when a line is actually written at the
configured level: a command or a branch worker that logs nothing never pays for it (a fifth of
an attribution's start-up). The lines go to the stderr of the moment they are written, not
the one found when logging was configured (a test runner may have closed that one)."""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

#: the standard library's numeric levels (its `logging` module is not needed to log, and costs
#: ~4 ms of every command's start-up to import)
LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}

_configured = False
_level = "WARNING"
_levelno = LEVELS["WARNING"]

#: what every line of this context carries (run_id, step)
_context: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "car_log", default=MappingProxyType({})
)


def bind(**values: Any) -> None:
    """Add `values` to every line logged in this context from now on."""
    _context.set({**_context.get(), **values})


def unbind(*keys: str) -> None:
    """Stop adding `keys` to the lines of this context."""
    now = _context.get()
    _context.set({k: v for k, v in now.items() if k not in keys})


def set_level(level: str) -> None:
    """Check and remember the level; structlog is configured with it on first use."""
    global _level, _levelno
    _level = _checked(level)
    _levelno = LEVELS[_level]
    if _configured:
        configure()


def _checked(level: str) -> str:
    name = level.upper()
    if name not in LEVELS:
        from engine.errors import ConfigError

        raise ConfigError(
            f"unknown log level {level!r}; expected DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    return name


class _Stderr:
    """sys.stderr as it is when a line is written."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str | None = None) -> None:
    """Log key=value lines to stderr at `level`; safe to call more than once."""
    global _configured, _level, _levelno
    import structlog

    if level is not None:
        _level = _checked(level)
        _levelno = LEVELS[_level]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_levelno),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    _configured = True


class Logger:
    """A named logger whose calls below the configured level cost a comparison."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _emit(self, levelno: int, method: str, event: str, values: dict[str, Any]) -> None:
        if levelno < _levelno:
            return
        import structlog

        if not _configured:
            configure()
        log = structlog.get_logger(self.name).bind(**_context.get())
        getattr(log, method)(event, **values)

    def debug(self, event: str, **values: Any) -> None:
        self._emit(LEVELS["DEBUG"], "debug", event, values)

    def info(self, event: str, **values: Any) -> None:
        self._emit(LEVELS["INFO"], "info", event, values)

    def warning(self, event: str, **values: Any) -> None:
        self._emit(LEVELS["WARNING"], "warning", event, values)

    def error(self, event: str, **values: Any) -> None:
        self._emit(LEVELS["ERROR"], "error", event, values)


def get_logger(name: str) -> Logger:
    return Logger(name)
