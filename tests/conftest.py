"""Shared pytest fixtures.

Real servers for integration tests (see tests/servers.py). They are session-scoped and never
skip: a server that cannot be started makes the tests that need it error.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from servers import llama_server, postgres_server


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
