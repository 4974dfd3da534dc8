"""structlog, configured once; run_id and step are bound through contextvars."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import structlog

_configured = False
_level = "WARNING"


def set_level(level: str) -> None:
    """Check and remember the level; structlog is configured with it on first use, so a
    command that never logs never imports structlog (a third of a short command's start-up)."""
    global _level
    _level = _checked(level)
    if _configured:
        configure()


def _checked(level: str) -> str:
    name = level.upper()
    if name not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        from engine.errors import ConfigError

        raise ConfigError(
            f"unknown log level {level!r}; expected DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    return name


def configure(level: str | None = None) -> None:
    """Log key=value lines to stderr at `level`; safe to call more than once."""
    global _configured, _level
    import structlog

    if level is not None:
        _level = _checked(level)
    name = _level
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, name)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    import structlog

    if not _configured:
        configure()
    return structlog.get_logger(name)  # type: ignore[no-any-return]
