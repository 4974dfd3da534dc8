"""Shared pytest fixtures.

Real servers for integration tests (see tests/servers.py). They are session-scoped and never
skip: a server that cannot be started makes the tests that need it error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from servers import llama_server, postgres_server

# Property tests draw their examples from a fixed seed: a failure seen once is seen on every
# run and every machine (no unseeded randomness in the suite). Widen the search deliberately
# with `--hypothesis-seed=N` or the `explore` profile (`--hypothesis-profile=explore`).
settings.register_profile("car", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("car")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """SQLAlchemy URL (postgresql+psycopg://) of a throwaway PostgreSQL database."""
    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def journal_target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A new journal's target on each store: a SQLite file, then a new PostgreSQL database."""
    if request.param == "sqlite":
        yield str(tmp_path / "j.db")
    else:
        from journal_helpers import fresh_pg_database

        yield fresh_pg_database(request.getfixturevalue("pg_url"), "journal")


@pytest.fixture(scope="session")
def llama_base_url() -> Iterator[str]:
    """OpenAI-compatible base URL (http://127.0.0.1:PORT/v1) of a llama.cpp server with
    SmolLM2-135M-Instruct."""
    with llama_server() as url:
        yield url


@pytest.fixture(scope="module")
def failed_heist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A journal holding the seed-7 default heist (24 steps), which fails: a run to fork,
    attribute or interrupt. One per test module (its tests add branches to it)."""
    from engine.heist.session import record_heist
    from engine.heist.sim import SimPolicy
    from engine.journal import Journal

    path = tmp_path_factory.mktemp("failed-heist") / "j.db"
    with Journal(path) as j:
        run = record_heist(j, SimPolicy(), seed=7).run_id
    return path, run
