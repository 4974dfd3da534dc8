"""Logging: lines below the level cost nothing (structlog is not even imported), lines carry
what the context bound, and they go to the stderr of the moment they are written."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from engine import logging as car_logging

ROOT = Path(__file__).resolve().parent.parent


def test_a_worker_that_logs_nothing_never_imports_structlog() -> None:
    """The step loop's modules import, bind a run and log a debug line at the default level
    without importing structlog (or rich); an error line then imports and writes it."""
    code = (
        "import sys\n"
        "import engine.interventions, engine.runtime.episode\n"
        "from engine.logging import bind, get_logger\n"
        "bind(run_id='r1', step=3)\n"
        "get_logger('car.test').debug('quiet')\n"
        "print('structlog' in sys.modules, 'rich' in sys.modules)\n"
        "get_logger('car.test').error('loud', why='a test')\n"
        "print('structlog' in sys.modules)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert res.stdout.split() == ["False", "False", "True"]
    assert "quiet" not in res.stderr
    line = res.stderr.strip()
    assert "loud" in line and "why='a test'" in line and "run_id=r1" in line and "step=3" in line


def test_lines_go_to_the_current_stderr_with_the_bound_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Configured while one stderr is in place, a line written after sys.stderr was swapped
    reaches the new one; it carries run_id and step while bound, and not after unbind."""
    car_logging.configure("INFO")
    try:
        first, second = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        car_logging.configure("INFO")
        monkeypatch.setattr(sys, "stderr", second)
        log = car_logging.get_logger("car.test")
        car_logging.bind(run_id="abc", step=7)
        log.info("bound line")
        car_logging.unbind("run_id", "step")
        log.info("free line")
        log.debug("below the level")
    finally:
        car_logging.configure("WARNING")
    assert first.getvalue() == ""
    bound, free = second.getvalue().splitlines()
    assert "bound line" in bound and "run_id=abc" in bound and "step=7" in bound
    assert "free line" in free and "run_id" not in free and "step" not in free
