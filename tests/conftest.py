"""Shared pytest fixtures.

Real servers for integration tests (see tests/servers.py). They are session-scoped and never
skip: a server that cannot be started makes the tests that need it error.
"""

from __future__ import annotations

from collections.abc import Iterator

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


@pytest.fixture(scope="session")
def llama_base_url() -> Iterator[str]:
    """OpenAI-compatible base URL (http://127.0.0.1:PORT/v1) of a llama.cpp server with
    SmolLM2-135M-Instruct."""
    with llama_server() as url:
        yield url
