"""Smoke tests of the real test servers (tests/servers.py) the integration tests rely on."""

from __future__ import annotations

import sqlalchemy as sa
from openai import OpenAI


def test_postgres_accepts_connection_and_select_1(pg_url: str) -> None:
    """The throwaway PostgreSQL server answers SELECT 1 through SQLAlchemy + psycopg."""
    assert pg_url.startswith("postgresql+psycopg://")
    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
            assert conn.execute(sa.text("SELECT current_database()")).scalar_one() == "car_test"
    finally:
        engine.dispose()


def _complete(client: OpenAI, seed: int) -> str:
    resp = client.chat.completions.create(
        model="smollm2",
        messages=[
            {"role": "system", "content": "You are the planner of a bank heist crew."},
            {"role": "user", "content": "Name one tool the safecracker should bring."},
        ],
        seed=seed,
        temperature=0.8,
        max_tokens=24,
    )
    text = resp.choices[0].message.content
    assert isinstance(text, str)
    return text


def test_llama_server_chat_completion_is_deterministic_for_a_seed(llama_base_url: str) -> None:
    """The llama.cpp server answers chat completions and repeats its text exactly for one seed."""
    client = OpenAI(base_url=llama_base_url, api_key="not-needed", max_retries=0, timeout=120)
    first = _complete(client, seed=42)
    assert first.strip()
    assert _complete(client, seed=42) == first
