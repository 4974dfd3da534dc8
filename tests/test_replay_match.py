"""Replay's comparison of a re-executed step with the recorded one, on journals whose recorded
responses were altered in a known way: exact, normalised (whitespace and case only, same tool
calls) or different — so each rate and each diagnosis has a known answer."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from engine import events as ev
from engine.errors import InterventionError, ReplayDivergence
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal
from engine.replay import (
    StepMatch,
    _explain,
    _report,
    check_requests,
    fidelity,
    normalise,
    short_diff,
)


def test_normalise_known_answers() -> None:
    """Whitespace runs collapse to one space, ends are trimmed, case folds (ß to ss)."""
    assert normalise("  Hello\t\nWORLD  ") == "hello world"
    assert normalise("Straße") == "strasse"
    assert normalise("") == ""


def test_short_diff_known_answers() -> None:
    """Word diff: [-removed-] {+added+}; a long equal run is elided to first … last; the
    result is cut to the width with an ellipsis."""
    assert short_diff("a b c", "a x c") == "a [-b-] {+x+} c"
    assert short_diff("a b", "a b c") == "a b {+c+}"
    assert short_diff("a b c", "a c") == "a [-b-] c"
    long = "w1 w2 w3 w4 w5 w6 w7"
    assert short_diff(long + " end", long + " END") == "w1 … w7 [-end-] {+END+}"
    assert short_diff("one two three four five six", "one two three four five six") == (
        "one two three four five six"
    )
    cut = short_diff("a", "b " * 200, width=20)
    assert len(cut) == 20 and cut.endswith("…")


def _copy_with_last_response(j: Journal, run: str, change: str) -> str:
    """A copy of `run` whose last step's recorded response (and message) is altered."""
    events = j.events(run)
    last = max(i for i, e in enumerate(events) if isinstance(e, ev.LlmCall))
    call = events[last]
    assert isinstance(call, ev.LlmCall)
    if change == "spaces":
        text = "  " + call.response.replace(" ", " \t ") + "\n"
    elif change == "words":
        text = call.response + " and one more thing"
    else:
        text = call.response
    events[last] = msgspec.structs.replace(call, response=text)
    msg = next(i for i in range(last, len(events)) if isinstance(events[i], ev.ChatMessage))
    events[msg] = msgspec.structs.replace(events[msg], text=text)  # type: ignore[arg-type]
    copy = j.create_run("heist")
    j.append(copy, events, 0)
    return copy


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Journal, str]:
    j = Journal(tmp_path_factory.mktemp("r") / "j.db")
    r = record_heist(j, SimPolicy(), seed=4, rounds=1, mole="hacker", strategy="FALSE_INFO")
    yield j, r.run_id
    j.close()


def test_fidelity_of_an_unchanged_copy_is_exact(journal: tuple[Journal, str]) -> None:
    """The control: a copy with nothing altered replays exactly at every step."""
    j, run = journal
    rep = fidelity(j, _copy_with_last_response(j, run, "none"))
    assert (rep.steps, rep.skipped, rep.exact_match_rate, rep.action_match_rate) == (6, 0, 1.0, 1.0)
    assert rep.divergences == []
    assert all(a["steps"] == 1 and a["exact_match_rate"] == 1.0 for a in rep.per_agent.values())


def test_whitespace_and_case_is_a_normalised_match(journal: tuple[Journal, str]) -> None:
    """A last response that differs only in whitespace: 5 of 6 exact, 6 of 6
    normalised; the one divergence says so and names the step and agent."""
    j, run = journal
    copy = _copy_with_last_response(j, run, "spaces")
    assert check_requests(j, copy).ok
    rep = fidelity(j, copy)
    assert rep.exact_match_rate == pytest.approx(5 / 6)
    assert rep.action_match_rate == 1.0
    (d,) = rep.divergences
    assert (d["step"], d["agent"], d["normalised_match"]) == (5, "lookout", True)
    assert d["provenance"]["explanation"] == "only whitespace or letter case differ"
    assert rep.per_agent["lookout"] == {
        "steps": 1,
        "exact": 0,
        "normalised": 1,
        "exact_match_rate": 0.0,
        "action_match_rate": 1.0,
    }
    assert [s["exact"] for s in rep.per_step] == [True] * 5 + [False]


def test_other_words_are_no_match(journal: tuple[Journal, str]) -> None:
    """A last response with words added is neither exact nor normalised: 5 of 6 on both."""
    j, run = journal
    rep = fidelity(j, _copy_with_last_response(j, run, "words"))
    assert rep.exact_match_rate == pytest.approx(5 / 6)
    assert rep.action_match_rate == pytest.approx(5 / 6)
    (d,) = rep.divergences
    assert d["normalised_match"] is False
    assert d["diff"].endswith("[-and one more thing-]")  # recorded words the replay lacks
    assert d["provenance"]["explanation"] == (
        "same model and fingerprint: nondeterminism in the model or server"
    )
    assert rep.per_agent["lookout"]["action_match_rate"] == 0.0
    assert rep.per_agent["planner"]["action_match_rate"] == 1.0


def test_tool_calls_must_match_for_a_normalised_match(journal: tuple[Journal, str]) -> None:
    """Same words up to case is not enough when a tool call's name changes with the case:
    upper-casing `[TOOL:...]` makes it no tool call at all."""
    j, run = journal
    events = j.events(run)
    i = max(k for k, e in enumerate(events) if isinstance(e, ev.LlmCall) and "[TOOL:" in e.response)
    call = events[i]
    assert isinstance(call, ev.LlmCall)
    # only the tool name's case changes: normalise() sees the same words
    text = call.response.replace("[TOOL:", "[tool:", 1)
    assert normalise(text) == normalise(call.response)
    events[i] = msgspec.structs.replace(call, response=text)
    copy = j.create_run("heist")
    j.append(copy, events, 0)
    rep = fidelity(j, copy)
    step = next(d for d in rep.divergences if d["step"] == call.step)
    assert step["normalised_match"] is False


def test_altered_request_is_refused(journal: tuple[Journal, str]) -> None:
    """A recorded request that the fold does not rebuild is a divergence, named by step,
    message index and field — fidelity refuses to call that a replay."""
    j, run = journal
    events = j.events(run)
    i = [k for k, e in enumerate(events) if isinstance(e, ev.LlmCall)][2]
    call = events[i]
    assert isinstance(call, ev.LlmCall)
    request = [dict(m) for m in call.request]
    request[-1]["content"] += "!"
    events[i] = msgspec.structs.replace(call, request=request)
    copy = j.create_run("heist")
    j.append(copy, events, 0)
    check = check_requests(j, copy)
    assert check.steps_checked == 3
    assert check.first_divergence is not None
    assert check.first_divergence["step"] == 2
    assert check.first_divergence["message_index"] == len(request) - 1
    assert check.first_divergence["fields"] == ["content"]
    with pytest.raises(ReplayDivergence, match=r"step 2: rebuilt request differs"):
        fidelity(j, copy)


def test_run_without_steps_is_refused(tmp_path: Path) -> None:
    """Fidelity of a run that has no recorded step says so."""
    with Journal(tmp_path / "j.db") as j:
        run = j.create_run("heist")
        with pytest.raises(InterventionError, match="has no recorded steps"):
            fidelity(j, run)


def _match(**kw: object) -> StepMatch:
    base: dict[str, object] = dict(step=0, agent="a", exact=False, normalised=False,
                                   recorded="x", new="y", recorded_model="m", new_model="m",
                                   recorded_fingerprint="f", new_fingerprint="f")  # fmt: skip
    base.update(kw)
    return StepMatch(**base)  # type: ignore[arg-type]


def test_explanations_in_order_of_precedence() -> None:
    """A changed model is named first, then a changed fingerprint, then the drift knob, then
    a normalised match; otherwise nondeterminism."""
    assert _explain(_match(new_model="n"), {}) == "model changed: 'm' -> 'n'"
    assert _explain(_match(new_fingerprint="g", new_model="m"), {}) == (
        "server fingerprint changed: 'f' -> 'g'"
    )
    assert "drift knob is 0.3" in _explain(_match(), {"name": "sim", "drift": 0.3})
    assert _explain(_match(), {"name": "sim", "drift": 0}) != _explain(
        _match(), {"name": "sim", "drift": 0.3}
    )
    assert _explain(_match(normalised=True), {"name": "openai"}) == (
        "only whitespace or letter case differ"
    )
    assert _explain(_match(), {"name": "sim-honest", "drift": 0.5}).startswith("sim drift")


def test_report_rates_by_hand() -> None:
    """Three steps of two agents: one exact, one normalised, one different."""
    rep = _report(
        "r",
        {"name": "x", "base_url": "http://h"},
        4,
        1,
        [
            _match(step=0, agent="a", exact=True, normalised=True),
            _match(step=1, agent="b", normalised=True),
            _match(step=2, agent="a"),
        ],
    )
    assert (rep.steps, rep.skipped) == (4, 1)
    assert rep.exact_match_rate == pytest.approx(1 / 3)
    assert rep.action_match_rate == pytest.approx(2 / 3)
    assert rep.per_agent["a"]["exact_match_rate"] == 0.5
    assert rep.per_agent["a"]["action_match_rate"] == 0.5
    assert rep.per_agent["b"]["action_match_rate"] == 1.0
    assert [d["step"] for d in rep.divergences] == [1, 2]
    assert rep.divergences[0]["provenance"]["server"] == "http://h"
    empty = _report("r", {}, 0, 0, [])
    assert (empty.exact_match_rate, empty.action_match_rate) == (None, None)
