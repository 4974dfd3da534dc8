"""The heist outcome y: does the crew's final plan work in the real world?

Agents state plan facts inline as `[PLAN:key=value]`. The final plan takes, for each key, the
LAST value anyone stated, so a later correction overrides an earlier error (and a late wrong
statement overrides an earlier right one). `score_plan` checks that plan against the `World`
with explicit rules; it reads nothing but the public transcript.

Plan keys (all required):

- guard_gap      'HH:MM-HH:MM'  the window with no guard at the vault post
- camera_window  'HH:MM-HH:MM'  when the vault-corridor camera is offline
- crack_minutes  integer        minutes to open the vault (dials x minutes per dial + setup)
- entry_time     'HH:MM'        when the crew enters the vault corridor
- exit_time      'HH:MM'        when the crew leaves with the vault open
- route          route name     the getaway route (open, and faster than the police)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import msgspec

from engine.heist.world import (
    VAULT_POST,
    World,
    fmt_time,
    fmt_window,
    parse_time,
    parse_window,
)
from engine.policies.base import ChatLine

PLAN_KEYS: tuple[str, ...] = (
    "guard_gap",
    "camera_window",
    "crack_minutes",
    "entry_time",
    "exit_time",
    "route",
)

PLAN_TAG = re.compile(r"\[PLAN:\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([^\]\n]*?)\s*\]")
_MINUTES = re.compile(r"^\s*(\d{1,4})\s*(?:m|min|mins|minute|minutes)?\s*$", re.I)


class Outcome(msgspec.Struct, frozen=True):
    """The verdict on a plan: bad when any rule fails; score = share of keys that pass."""

    bad: bool
    score: float
    reasons: list[str]
    plan: dict[str, str]


@functools.lru_cache(maxsize=8192)
def plan_statements(text: str) -> tuple[tuple[str, str], ...]:
    """The (key, value) pairs stated in one message, in order; keys lower-cased. Memoised:
    every turn and every outcome reads the whole conversation again, and a run's branches
    share its messages."""
    return tuple((m.group(1).lower(), m.group(2)) for m in PLAN_TAG.finditer(text))


def extract_plan(transcript: Sequence[ChatLine]) -> dict[str, str]:
    """For each key, the last value stated in the transcript (ordered by step)."""
    plan: dict[str, str] = {}
    for line in sorted(transcript, key=lambda c: c.step):
        for key, value in plan_statements(line.text):
            plan[key] = value
    return plan


def parse_minutes(text: str) -> int | None:
    """'42', '42 min' or '42 minutes' to 42; None otherwise."""
    m = _MINUTES.match(text)
    return int(m.group(1)) if m else None


def normalise_route(text: str) -> str:
    return re.sub(r"[\s-]+", "_", text.strip().lower())


def score_plan(world: World, transcript: Sequence[ChatLine]) -> Outcome:
    """Check the final plan stated in `transcript` against `world`."""
    plan = extract_plan(transcript)
    return check_plan(world, plan)


def check_plan(world: World, plan: dict[str, str]) -> Outcome:
    """Check a plan (key -> value) against `world`; see the module docstring for the keys."""
    failures: dict[str, str] = {}
    for key in PLAN_KEYS:
        if key not in plan:
            failures[key] = f"{key} is missing: the crew never stated it"
    reasons: dict[str, str | None] = {
        "guard_gap": _check_window(
            plan, "guard_gap", world.guard_gap(), "the guard rota leaves the vault unguarded"
        ),
        "camera_window": _check_window(
            plan, "camera_window", world.camera_window(), "the vault-corridor camera is offline"
        ),
        "crack_minutes": _check_crack(world, plan),
        "entry_time": _check_entry(world, plan),
        "exit_time": _check_exit(world, plan),
        "route": _check_route(world, plan),
    }
    for key, reason in reasons.items():
        if reason is not None and key not in failures:
            failures[key] = reason
    ordered = [failures[k] for k in PLAN_KEYS if k in failures]
    passed = len(PLAN_KEYS) - len(failures)
    return Outcome(
        bad=bool(failures), score=passed / len(PLAN_KEYS), reasons=ordered, plan=dict(plan)
    )


def _check_window(plan: dict[str, str], key: str, truth: tuple[int, int], what: str) -> str | None:
    if key not in plan:
        return None
    stated = parse_window(plan[key])
    if stated is None:
        return f"{key} {plan[key]!r} is not a window HH:MM-HH:MM"
    if stated != truth:
        return f"{key} stated {fmt_window(*stated)}, but {what} {fmt_window(*truth)}"
    return None


def _check_crack(world: World, plan: dict[str, str]) -> str | None:
    if "crack_minutes" not in plan:
        return None
    stated = parse_minutes(plan["crack_minutes"])
    v = world.vault
    need = v.crack_minutes
    if stated is None:
        return f"crack_minutes {plan['crack_minutes']!r} is not a number of minutes"
    if stated < need:
        return (
            f"crack_minutes stated {stated}, but the vault needs {need} "
            f"({v.dials} dials x {v.minutes_per_dial} min + {v.setup_minutes} min setup)"
        )
    s, e = world.safe_window()
    if stated > e - s:
        return (
            f"crack_minutes stated {stated}, but the safe window {fmt_window(s, e)} "
            f"is only {e - s} minutes long (the vault needs {need})"
        )
    return None


def _check_entry(world: World, plan: dict[str, str]) -> str | None:
    if "entry_time" not in plan:
        return None
    entry = parse_time(plan["entry_time"])
    if entry is None:
        return f"entry_time {plan['entry_time']!r} is not a time HH:MM"
    stated = fmt_time(entry)
    guard = world.guard_at(VAULT_POST, entry)
    if guard is not None:
        return (
            f"entry_time stated {stated}, but guard {guard.name} is at the vault "
            f"{fmt_window(guard.start, guard.end)}"
        )
    c0, c1 = world.camera_window()
    if not c0 <= entry < c1:
        return (
            f"entry_time stated {stated}, but the vault-corridor camera records outside "
            f"{fmt_window(c0, c1)}"
        )
    s, e = world.safe_window()
    need = world.vault.crack_minutes
    if entry + need > e:
        return (
            f"entry_time stated {stated}, but the vault needs {need} minutes and the safe "
            f"window {fmt_window(s, e)} closes first; enter by {fmt_time(e - need)}"
        )
    return None


def _check_exit(world: World, plan: dict[str, str]) -> str | None:
    if "exit_time" not in plan:
        return None
    exit_at = parse_time(plan["exit_time"])
    if exit_at is None:
        return f"exit_time {plan['exit_time']!r} is not a time HH:MM"
    stated = fmt_time(exit_at)
    need = world.vault.crack_minutes
    entry = parse_time(plan.get("entry_time", ""))
    if entry is not None and exit_at < entry + need:
        return (
            f"exit_time stated {stated}, but the vault is not open before "
            f"{fmt_time(entry + need)} (entry {fmt_time(entry)} + {need} min)"
        )
    s, e = world.safe_window()
    if exit_at > e:
        return (
            f"exit_time stated {stated}, but the safe window closes at {fmt_time(e)} "
            "(a guard returns or the camera comes back on)"
        )
    if exit_at < s + need:
        return (
            f"exit_time stated {stated}, but the vault cannot be open before {fmt_time(s + need)}"
        )
    return None


def _check_route(world: World, plan: dict[str, str]) -> str | None:
    if "route" not in plan:
        return None
    name = normalise_route(plan["route"])
    route = world.route(name)
    best = world.best_route().name
    if route is None:
        return f"route stated {plan['route']!r}, which is not a known route (expected {best})"
    if route.status != "open":
        return f"route stated {name}, but it is {route.status} tonight (expected {best})"
    limit = world.vault_alarm().response_minutes
    if route.drive_minutes >= limit:
        return (
            f"route stated {name}, a {route.drive_minutes}-minute drive, but the police arrive "
            f"{limit} minutes after the vault alarm (expected {best})"
        )
    return None
