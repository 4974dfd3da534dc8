"""structlog, configured once; run_id and step are bound through contextvars."""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


def configure(level: str = "WARNING") -> None:
    """Log key=value lines to stderr at `level`; safe to call more than once."""
    global _configured
    name = level.upper()
    if name not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        from engine.errors import ConfigError

        raise ConfigError(
            f"unknown log level {level!r}; expected DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
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
    if not _configured:
        configure()
    return structlog.get_logger(name)  # type: ignore[no-any-return]
