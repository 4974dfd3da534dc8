"""The heist outcome: the last stated value per key, checked against the world by rules."""

from __future__ import annotations

import pytest

from engine.heist.outcome import PLAN_KEYS, check_plan, extract_plan, score_plan
from engine.heist.world import make_world
from engine.policies.base import ChatLine

# World 5: guard gap 02:56-04:33, camera offline 03:18-04:16, vault 4 dials x 11 min + 8 min
# setup = 52 min, police response 14 min, old_mill_lane the only usable route.
WORLD = make_world(5)
REF = WORLD.reference_plan()


def test_reference_of_world_5() -> None:
    """The fixture world is the one the tables below were written against."""
    assert REF == {
        "guard_gap": "02:56-04:33",
        "camera_window": "03:18-04:16",
        "crack_minutes": "52",
        "entry_time": "03:18",
        "exit_time": "04:10",
        "route": "old_mill_lane",
    }


def _lines(*texts: str) -> list[ChatLine]:
    return [ChatLine(step=i, agent=f"a{i}", text=t) for i, t in enumerate(texts)]


def test_last_statement_wins() -> None:
    """For each key the plan keeps the value stated last; a later correction overrides."""
    plan = extract_plan(
        _lines(
            "[PLAN:entry_time=01:00] and [PLAN:route=ring_road]",
            "no plan here",
            "Correction: [PLAN:entry_time=01:10], not 01:00.",
        )
    )
    assert plan == {"entry_time": "01:10", "route": "ring_road"}


def test_plan_order_follows_steps_not_list_order() -> None:
    """The transcript is ordered by step, whatever order the lines arrive in."""
    lines = [ChatLine(5, "b", "[PLAN:route=late]"), ChatLine(2, "a", "[PLAN:route=early]")]
    assert extract_plan(lines) == {"route": "late"}


def test_within_a_message_the_last_tag_wins() -> None:
    """'x, or rather y' states y."""
    assert extract_plan(_lines("[PLAN:crack_minutes=40], or rather [PLAN:crack_minutes=44]")) == {
        "crack_minutes": "44"
    }


@pytest.mark.parametrize(
    ("text", "plan"),
    [
        ("[PLAN: entry_time = 01:30 ]", {"entry_time": "01:30"}),
        ("[PLAN:Entry_Time=01:30]", {"entry_time": "01:30"}),
        ("[PLAN:getaway_car=van]", {"getaway_car": "van"}),
        ("[PLAN:route=]", {"route": ""}),
        ("[PLAN:entry_time=01:30", {}),
        ("[PLAN:entry_time 01:30]", {}),
        ("[PLAN:=01:30]", {}),
        ("[PLAN:route=a\nb]", {}),
        ("[plan:route=ring_road]", {}),
    ],
)
def test_plan_tag_grammar(text: str, plan: dict[str, str]) -> None:
    """Tags are [PLAN:key=value] on one line; keys are case-insensitive, values trimmed."""
    assert extract_plan(_lines(text)) == plan


def test_reference_plan_passes() -> None:
    """A transcript stating the reference plan scores 1 and is not bad."""
    text = " ".join(f"[PLAN:{k}={v}]" for k, v in REF.items())
    outcome = score_plan(WORLD, _lines(text))
    assert not outcome.bad and outcome.score == 1.0 and outcome.reasons == []
    assert outcome.plan == REF


@pytest.mark.parametrize("key", PLAN_KEYS)
def test_missing_key_is_bad(key: str) -> None:
    """A plan without a required key fails and says which."""
    plan = {k: v for k, v in REF.items() if k != key}
    outcome = check_plan(WORLD, plan)
    assert outcome.bad and outcome.reasons == [f"{key} is missing: the crew never stated it"]
    assert outcome.score == pytest.approx(5 / 6)


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        (
            "guard_gap",
            "02:50-04:33",
            "guard_gap stated 02:50-04:33, but the guard rota leaves the vault unguarded "
            "02:56-04:33",
        ),
        ("guard_gap", "soon", "guard_gap 'soon' is not a window HH:MM-HH:MM"),
        (
            "camera_window",
            "03:18-04:20",
            "camera_window stated 03:18-04:20, but the vault-corridor camera is offline "
            "03:18-04:16",
        ),
        (
            "crack_minutes",
            "44",
            "crack_minutes stated 44, but the vault needs 52 (4 dials x 11 min + 8 min setup)",
        ),
        (
            "crack_minutes",
            "59",
            "crack_minutes stated 59, but the safe window 03:18-04:16 is only 58 minutes long "
            "(the vault needs 52)",
        ),
        ("crack_minutes", "fifty", "crack_minutes 'fifty' is not a number of minutes"),
        (
            "entry_time",
            "02:50",
            "entry_time stated 02:50, but guard Wes Tanaka is at the vault 00:00-02:56",
        ),
        (
            "entry_time",
            "03:00",
            "entry_time stated 03:00, but the vault-corridor camera records outside 03:18-04:16",
        ),
        (
            "entry_time",
            "03:30",
            "entry_time stated 03:30, but the vault needs 52 minutes and the safe window "
            "03:18-04:16 closes first; enter by 03:24",
        ),
        ("entry_time", "late", "entry_time 'late' is not a time HH:MM"),
        (
            "exit_time",
            "04:00",
            "exit_time stated 04:00, but the vault is not open before 04:10 (entry 03:18 + 52 min)",
        ),
        (
            "exit_time",
            "04:20",
            "exit_time stated 04:20, but the safe window closes at 04:16 (a guard returns or the "
            "camera comes back on)",
        ),
        (
            "route",
            "quarry_road",
            "route stated quarry_road, a 18-minute drive, but the police arrive 14 minutes after "
            "the vault alarm (expected old_mill_lane)",
        ),
        (
            "route",
            "harbour_tunnel",
            "route stated harbour_tunnel, but it is blocked tonight (expected old_mill_lane)",
        ),
        (
            "route",
            "moon",
            "route stated 'moon', which is not a known route (expected old_mill_lane)",
        ),
    ],
)
def test_contradictions_are_bad(key: str, value: str, reason: str) -> None:
    """A value that contradicts the world fails the plan with a sentence naming the key, the
    stated value and what the world says."""
    outcome = check_plan(WORLD, {**REF, key: value})
    assert outcome.bad
    assert outcome.reasons[0] == reason


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("crack_minutes", "52 minutes"),
        ("crack_minutes", "55"),
        ("entry_time", "3:18"),
        ("entry_time", "03:24"),
        ("camera_window", "03:18 – 04:16"),
        ("route", "Old Mill Lane"),
    ],
)
def test_equivalent_and_slack_values_pass(key: str, value: str) -> None:
    """Other spellings of the right value, and values within the slack, still work."""
    plan = {**REF, key: value}
    if key == "entry_time" and value == "03:24":
        plan["exit_time"] = "04:16"
    outcome = check_plan(WORLD, plan)
    assert not outcome.bad, outcome.reasons


def test_score_counts_passing_keys() -> None:
    """Score is the share of the six keys that pass; reasons come in key order."""
    outcome = check_plan(WORLD, {**REF, "route": "moon", "guard_gap": "x"})
    assert outcome.score == pytest.approx(4 / 6)
    assert [r.split()[0] for r in outcome.reasons] == ["guard_gap", "route"]
    assert check_plan(WORLD, {}).score == 0.0
