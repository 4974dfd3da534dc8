"""The heist world: deterministic from its seed, internally consistent, solvable."""

from __future__ import annotations

import random

import msgspec
import pytest

from engine.heist.outcome import check_plan
from engine.heist.world import (
    VAULT_POST,
    fmt_time,
    make_world,
    parse_time,
    parse_window,
    world_files,
    world_tables,
)

SEEDS = range(500)


def test_same_seed_same_world() -> None:
    """make_world is a pure function of its seed: two draws made afresh (past the cache every
    branch of a run shares) are equal and encode alike, and the cached world is that draw."""
    first, second = make_world.__wrapped__(42), make_world.__wrapped__(42)
    assert first is not second and first == second
    assert msgspec.json.encode(first) == msgspec.json.encode(second)
    assert first.content_hash() == second.content_hash()
    assert make_world(42) == first and make_world(42) is make_world(42)


def test_different_seeds_differ() -> None:
    """Different seeds give different worlds (and content hashes)."""
    hashes = {make_world(s).content_hash() for s in range(200)}
    assert len(hashes) == 200


def test_global_random_untouched() -> None:
    """Drawing a world neither uses nor disturbs the global random state."""
    random.seed(7)
    before = random.getstate()
    make_world(3)
    assert random.getstate() == before
    random.seed(1)
    a = make_world(5)
    random.seed(2)
    assert make_world(5) == a


def test_content_hash_has_algorithm_prefix() -> None:
    """The content hash names its algorithm, so a later change of algorithm is detectable."""
    h = make_world(0).content_hash()
    assert h.startswith("b2:") and len(h) == 3 + 32


def test_world_is_solvable_and_consistent() -> None:
    """Every world has one guard gap, a camera window overlapping it by the crack time plus
    4-12 minutes of slack, exactly one usable route, and its reference plan passes."""
    for seed in SEEDS:
        _check_world(seed)


def _check_world(seed: int) -> None:
    w = make_world(seed)
    g0, g1 = w.guard_gap()
    c0, c1 = w.camera_window()
    s, e = w.safe_window()
    assert 0 < g0 < g1 < 360 and 0 < c0 < c1 < 360
    assert s == max(g0, c0) and e == min(g1, c1)
    assert 4 <= (e - s) - w.vault.crack_minutes <= 12
    assert all(w.guard_at(VAULT_POST, m) is None for m in range(g0, g1))
    assert w.guard_at(VAULT_POST, g0 - 1) is not None and w.guard_at(VAULT_POST, g1) is not None
    limit = w.vault_alarm().response_minutes
    usable = [r for r in w.routes if r.status == "open" and r.drive_minutes < limit]
    assert usable == [w.best_route()]
    outcome = check_plan(w, w.reference_plan())
    assert not outcome.bad and outcome.score == 1.0, (seed, outcome.reasons)


def test_files_and_tables_agree_with_the_world() -> None:
    """The files and the database state the same facts as the world they render."""
    w = make_world(9)
    files = world_files(w)
    assert set(files) == {
        "vault_specs.txt",
        "camera_schedule.txt",
        "building_layout.txt",
        "routes.txt",
    }
    specs = files["vault_specs.txt"]
    assert f"Dials: {w.vault.dials}\n" in specs
    assert f"Minutes per dial (experienced safecracker): {w.vault.minutes_per_dial}\n" in specs
    c0, c1 = w.camera_window()
    assert f"offline {fmt_time(c0)}-{fmt_time(c1)}" in files["camera_schedule.txt"]
    tables = world_tables(w)
    assert set(tables) == {"guards", "cameras", "alarms", "routes", "vehicles"}
    cols, rows = tables["guards"]
    assert cols == ("name", "post", "shift", "start_time", "end_time")
    assert len(rows) == len(w.guards)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("01:05", 65),
        ("1:05", 65),
        (" 23:59 ", 1439),
        ("24:00", None),
        ("01:60", None),
        ("1am", None),
        ("", None),
        ("01:05:00", None),
    ],
)
def test_parse_time(text: str, expected: int | None) -> None:
    """Times are H:MM or HH:MM within one day; anything else is not a time."""
    assert parse_time(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("01:05-01:55", (65, 115)),
        ("01:05 – 01:55", (65, 115)),
        ("1:05 to 1:55", (65, 115)),
        ("01:55-01:05", None),
        ("01:05", None),
        ("01:05-", None),
    ],
)
def test_parse_window(text: str, expected: tuple[int, int] | None) -> None:
    """Windows are start-end with start before end."""
    assert parse_window(text) == expected
