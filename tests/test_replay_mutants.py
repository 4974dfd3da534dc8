"""What mutation testing of engine/replay.py showed unchecked: where fidelity runs each step
(inline for the embedded policy, in threads otherwise), its progress, the run id every view
carries, the policy override, which steps it skips, a one-step run, do_policy branches, the
request diff field by field, and the exact shape of the report.

The probe policies are real policies (the embedded sim crew underneath) registered under their
own names; they note the run id of each view and the thread that decided, and report a system
fingerprint, which the sim crew does not."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine import events as ev
from engine.errors import InterventionError
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.interventions import DoPolicy, fork_many
from engine.journal import Journal
from engine.policies.base import AgentView, Completion
from engine.policies.registry import register_policy, unregister_policy
from engine.replay import (
    StepMatch,
    _explain,
    _report,
    _request_diff,
    check_requests,
    fidelity,
    recorded_steps,
    short_diff,
)
from engine.runtime.episode import FORCED_MODEL
from engine.scenario import scenario_for
from engine.workers import STOP, Interrupted


class Probe:
    """The sim crew's decisions, noting (run id of the view, decided on the main thread)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.inner = SimPolicy()
        self.seen: list[tuple[str, bool]] = []
        self.delay = 0.0  # seconds each decision takes (a slow server)

    def spec(self) -> dict[str, Any]:
        return {"name": self.name}

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion:
        self.seen.append((view.run_id, threading.current_thread() is threading.main_thread()))
        time.sleep(self.delay)
        done = self.inner.decide(view, messages, seed)
        return msgspec.structs.replace(done, system_fingerprint=f"fp-{self.name}")


PROBES = {name: Probe(name) for name in ("probe", "sim-probe")}


@pytest.fixture(scope="module", autouse=True)
def _probes() -> Iterator[None]:
    for name, probe in PROBES.items():
        register_policy(name, lambda spec, p=probe: p)
    yield
    for name in PROBES:
        unregister_policy(name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Journal, dict[str, str]]]:
    j = Journal(tmp_path_factory.mktemp("r") / "j.db")
    made = {
        name: record_heist(j, policy, seed=4, rounds=1, mole="hacker", strategy="FALSE_INFO").run_id
        for name, policy in (("sim", SimPolicy()), *PROBES.items())
    }
    yield j, made
    j.close()


def _copy(j: Journal, run: str, change: Any = None, upto: int | None = None) -> str:
    """A copy of `run` (its first `upto` events), with `change(events)` applied first."""
    events = j.events(run)[:upto]
    if change is not None:
        change(events)
    copy = j.create_run("heist")
    j.append(copy, events, 0)
    return copy


def _calls(events: list[ev.AnyEvent]) -> list[int]:
    return [i for i, e in enumerate(events) if isinstance(e, ev.LlmCall)]


def _set(events: list[ev.AnyEvent], i: int, **fields: Any) -> None:
    events[i] = msgspec.structs.replace(events[i], **fields)  # type: ignore[type-var]


def _fresh(name: str) -> Probe:
    probe = PROBES[name]
    probe.seen.clear()
    return probe


def test_sim_policies_replay_inline_others_in_threads(runs: tuple[Journal, dict[str, str]]) -> None:
    """A policy named sim* replays on the calling thread by default (concurrency 1); with
    concurrency 2, or a policy that is not sim*, every step is decided in a worker thread —
    with the same result either way, every view carrying the replayed run's id."""
    j, made = runs
    run = made["sim-probe"]
    probe = _fresh("sim-probe")
    one = fidelity(j, run)
    assert probe.seen == [(run, True)] * 6
    probe.seen.clear()
    two = fidelity(j, run, concurrency=2)
    assert probe.seen == [(run, False)] * 6
    assert one.per_step == two.per_step and one.exact_match_rate == 1.0
    other = _fresh("probe")
    rep = fidelity(j, made["probe"], concurrency=1)
    assert other.seen == [(made["probe"], False)] * 6
    assert rep.exact_match_rate == 1.0 and len(rep.per_step) == 6


def test_progress_counts_up_to_the_steps(runs: tuple[Journal, dict[str, str]]) -> None:
    """Inline, progress is called once a step with (done, total); in threads every call has
    done <= total, done never falls, and the last call is (total, total)."""
    j, made = runs
    seen: list[tuple[int, int]] = []
    fidelity(j, made["sim"], concurrency=1, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(i, 6) for i in range(1, 7)]
    seen.clear()
    fidelity(j, made["probe"], concurrency=1, progress=lambda d, t: seen.append((d, t)))
    assert seen and seen[-1] == (6, 6)
    assert all(t == 6 and 0 <= d <= 6 for d, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_a_stop_cancels_the_steps_not_started(runs: tuple[Journal, dict[str, str]]) -> None:
    """A stop request during a threaded replay (a policy taking 0.1 s a step) raises
    Interrupted and cancels the steps still queued: they are never decided, not even after
    the command gave up."""
    j, made = runs
    probe = _fresh("probe")
    probe.delay = 0.1
    try:
        with pytest.raises(Interrupted):
            fidelity(j, made["probe"], concurrency=1, progress=lambda d, t: STOP.set())
        time.sleep(1.0)  # queued steps left running would all be decided by now
    finally:
        STOP.clear()
        probe.delay = 0.0
    assert 1 <= len(probe.seen) < 6


def test_a_stop_does_not_wait_for_a_call_in_flight(runs: tuple[Journal, dict[str, str]]) -> None:
    """A stop requested while a policy call hangs (2 s here) ends the threaded replay at the
    next poll: Interrupted within a second, without waiting for the call to return."""
    j, made = runs
    probe = _fresh("probe")
    probe.delay = 2.0
    try:
        t0 = time.monotonic()
        with pytest.raises(Interrupted):
            fidelity(j, made["probe"], concurrency=1, progress=lambda d, t: STOP.set())
        elapsed = time.monotonic() - t0
    finally:
        STOP.clear()
        probe.delay = 0.0
        time.sleep(2.2)  # let the abandoned call return before the next test
    assert elapsed < 1.0, elapsed
    assert len(probe.seen) == 1


def test_provenance_carries_both_fingerprints(runs: tuple[Journal, dict[str, str]]) -> None:
    """A divergence's provenance has the recorded and the new model and fingerprint; a
    recorded fingerprint that differs is the explanation."""
    j, made = runs

    def older_server(events: list[ev.AnyEvent]) -> None:
        last = _calls(events)[-1]
        call = events[last]
        assert isinstance(call, ev.LlmCall)
        _set(events, last, system_fingerprint="fp-old", response=call.response + " too")
        msg = next(i for i in range(last, len(events)) if isinstance(events[i], ev.ChatMessage))
        _set(events, msg, text=call.response + " too")

    copy = _copy(j, made["probe"], older_server)
    (d,) = fidelity(j, copy).divergences
    assert d["provenance"] == {
        "recorded_model": "sim-1",
        "new_model": "sim-1",
        "recorded_fingerprint": "fp-old",
        "new_fingerprint": "fp-probe",
        "server": None,
        "explanation": "server fingerprint changed: 'fp-old' -> 'fp-probe'",
    }


def test_divergence_and_step_entries_have_exact_keys(runs: tuple[Journal, dict[str, str]]) -> None:
    """The report names its run and policy; a divergence holds exactly step, agent, whether it
    matched normalised, both texts, the diff and the provenance; to_dict is plain data."""
    j, made = runs
    events = j.events(made["sim"])
    last = _calls(events)[-1]
    call = events[last]
    assert isinstance(call, ev.LlmCall)

    def more_words(evs: list[ev.AnyEvent]) -> None:
        _set(evs, last, response=call.response + " and more")
        msg = next(i for i in range(last, len(evs)) if isinstance(evs[i], ev.ChatMessage))
        _set(evs, msg, text=call.response + " and more")

    copy = _copy(j, made["sim"], more_words)
    rep = fidelity(j, copy)
    assert rep.run_id == copy
    assert rep.policy == {"name": "sim", "drift": 0.0}
    (d,) = rep.divergences
    assert set(d) == {"step", "agent", "normalised_match", "recorded", "new", "diff", "provenance"}
    assert (d["recorded"], d["new"]) == (call.response + " and more", call.response)
    assert rep.per_step[-1] == {"step": 5, "agent": "lookout", "exact": False, "normalised": False}
    plain = rep.to_dict()
    assert plain["run_id"] == copy and plain["divergences"][0]["step"] == 5
    assert isinstance(plain["per_step"][0], dict)


def test_policy_override_is_checked_and_applied(runs: tuple[Journal, dict[str, str]]) -> None:
    """--drift on a sim run is parsed into the replayed policy's spec; an option the run's
    policy does not take is refused by its flag name."""
    j, made = runs
    rep = fidelity(j, made["sim"], policy_override={"drift": "0"})
    assert rep.policy == {"name": "sim", "drift": 0.0}
    assert rep.exact_match_rate == 1.0
    with pytest.raises(InterventionError, match=r"--model does not apply to policy sim$"):
        fidelity(j, made["sim"], policy_override={"model": "m"})


def test_drift_override_reaches_every_step(tmp_path: Path) -> None:
    """The override replaces the run's policy at every step of a run without do_policy: with
    drift 1 every one of 24 steps is redrawn unseeded, so not all of them can match (each
    matches by chance with probability below 1/2; all 24 do with probability < 1e-7)."""
    with Journal(tmp_path / "j.db") as j:
        run = record_heist(j, SimPolicy(), seed=21, mole="intel", strategy="FALSE_INFO").run_id
        rep = fidelity(j, run, policy_override={"drift": 1.0})
    assert rep.steps == 24
    assert rep.exact_match_rate is not None and rep.exact_match_rate < 1.0


def test_failed_and_forced_steps_are_skipped(runs: tuple[Journal, dict[str, str]]) -> None:
    """A step whose call failed (finish_reason "error") or was forced (do_action) has nothing
    to re-execute: it counts as a step, is skipped, and is in no rate."""
    j, made = runs
    calls = _calls(j.events(made["sim"]))
    copy = _copy(j, made["sim"], lambda evs: _set(evs, calls[1], finish_reason="error"))
    rep = fidelity(j, copy)
    assert (rep.steps, rep.skipped, len(rep.per_step)) == (6, 1, 5)
    assert [s["step"] for s in rep.per_step] == [0, 2, 3, 4, 5]
    copy = _copy(j, made["sim"], lambda evs: _set(evs, calls[3], model=FORCED_MODEL))
    rep = fidelity(j, copy)
    assert (rep.steps, rep.skipped) == (6, 1)
    assert [s["step"] for s in rep.per_step] == [0, 1, 2, 4, 5]


def test_a_run_of_one_step_replays(runs: tuple[Journal, dict[str, str]]) -> None:
    """A run cut after its first step (no second step to look at) replays that step."""
    j, made = runs
    calls = _calls(j.events(made["sim"]))
    copy = _copy(j, made["sim"], upto=calls[1])
    rep = fidelity(j, copy)
    assert (rep.steps, rep.skipped, rep.exact_match_rate) == (1, 0, 1.0)


def test_do_policy_branch_replays_with_the_swapped_policy(tmp_path: Path) -> None:
    """A do_policy(sim-honest) branch replays exactly: from the fork on, its mole's steps are
    re-decided by the honest policy, whose actions differ from the run's own policy there
    (checked: replaying the branch's own steps with the run's policy would not match)."""
    with Journal(tmp_path / "j.db") as j:
        run = record_heist(j, SimPolicy(), seed=21, mole="intel", strategy="FALSE_INFO").run_id
        branch = fork_many(j, run, DoPolicy(4, {"name": "sim-honest"}), 1, seed=3)
        child = branch.branches[0].run_id
        rep = fidelity(j, child)
        assert (rep.steps, rep.exact_match_rate) == (24, 1.0)
        # the claim has teeth: the run's own policy decides some branch step differently
        sim = SimPolicy()
        steps = list(recorded_steps(j, child))
        scenario = scenario_for(steps[0].state)
        differ = [
            s.step
            for s in steps[4:]
            if sim.decide(scenario.view(s.state, child), s.call.request, s.call.seed).text
            != s.call.response
        ]
    assert differ


def test_check_requests_names_its_run_and_counts_steps(
    runs: tuple[Journal, dict[str, str]],
) -> None:
    """check_requests reports the run it checked and how many steps it compared."""
    j, made = runs
    ok = check_requests(j, made["sim"])
    assert (ok.run_id, ok.steps_checked, ok.ok) == (made["sim"], 6, True)
    calls = _calls(j.events(made["sim"]))

    def altered(evs: list[ev.AnyEvent]) -> None:
        call = evs[calls[0]]
        assert isinstance(call, ev.LlmCall)
        _set(evs, calls[0], request=[*call.request, {"role": "user", "content": "x"}])

    copy = _copy(j, made["sim"], altered)
    bad = check_requests(j, copy)
    assert (bad.run_id, bad.steps_checked, bad.ok) == (copy, 1, False)


def test_request_diff_known_answers(runs: tuple[Journal, dict[str, str]]) -> None:
    """The first differing message by index, both sides (None past the end of one) and the
    keys that differ, from either side; a request equal to the rebuild names no message."""
    j, made = runs
    step = next(recorded_steps(j, made["sim"]))
    recorded = step.call.request
    n = len(recorded)
    extra = {"role": "user", "content": "one more"}
    assert _request_diff(step, [*recorded, extra]) == {
        "step": 0,
        "agent": step.agent,
        "message_index": n,
        "recorded": None,
        "rebuilt": extra,
        "fields": ["content", "role"],
    }
    shorter = _request_diff(step, recorded[:-1])
    assert (shorter["message_index"], shorter["rebuilt"]) == (n - 1, None)
    assert shorter["recorded"] == recorded[-1] and shorter["fields"] == ["content", "role"]
    named = [*recorded[:-1], {**recorded[-1], "name": "x"}]
    assert _request_diff(step, named)["fields"] == ["name"]
    assert _request_diff(step, list(recorded)) == {
        "step": 0,
        "agent": step.agent,
        "message_index": None,
    }


def _match(**kw: object) -> StepMatch:
    base: dict[str, object] = dict(step=0, agent="a", exact=False, normalised=False,
                                   recorded="x", new="y", recorded_model="m", new_model="m",
                                   recorded_fingerprint="f", new_fingerprint="f")  # fmt: skip
    base.update(kw)
    return StepMatch(**base)  # type: ignore[arg-type]


def test_explanation_of_a_spec_without_name_or_drift() -> None:
    """A spec without a name, or a sim spec without a drift, is plain nondeterminism."""
    same = "same model and fingerprint: nondeterminism in the model or server"
    assert _explain(_match(), {}) == same
    assert _explain(_match(), {"name": "sim"}) == same


def test_report_entries_by_hand() -> None:
    """Every entry of a divergence and of per_step, written out for one hand-made step."""
    m = _match(step=3, agent="b", recorded="a b", new="a c", new_model="n",
               recorded_fingerprint="f1", new_fingerprint="f2")  # fmt: skip
    rep = _report("r", {"name": "x", "base_url": "http://h"}, 1, 0, [m])
    assert (rep.run_id, rep.policy) == ("r", {"name": "x", "base_url": "http://h"})
    assert rep.divergences == [
        {
            "step": 3,
            "agent": "b",
            "normalised_match": False,
            "recorded": "a b",
            "new": "a c",
            "diff": "a [-b-] {+c+}",
            "provenance": {
                "recorded_model": "m",
                "new_model": "n",
                "recorded_fingerprint": "f1",
                "new_fingerprint": "f2",
                "server": "http://h",
                "explanation": "model changed: 'm' -> 'n'",
            },
        }
    ]
    assert rep.per_step == [{"step": 3, "agent": "b", "exact": False, "normalised": False}]


def test_short_diff_widths_and_long_runs() -> None:
    """The default width is 240 characters; a text of exactly the width is kept whole; an
    insertion of several words is joined by spaces; a run of 250 equal words is one equal
    run, elided to its first and last word, even where difflib's junk heuristic (off here)
    would call a word that makes up most of a long text junk."""
    assert short_diff("", "x" * 236) == "{+" + "x" * 236 + "+}"  # 240 characters: whole
    cut = short_diff("", "x" * 237)  # 241 characters
    assert len(cut) == 240 and cut.endswith("…")
    assert short_diff("a", "a", width=1) == "a"
    assert short_diff("a", "a b c") == "a {+b c+}"
    hundred = " ".join(["x"] * 100)
    # 300 x against 100 x, q, 100 x: without the junk heuristic q is one deleted word
    assert short_diff(f"{hundred} q {hundred}", " ".join(["x"] * 300)) == (
        "x … x [-q-] x … x {+" + hundred + "+}"
    )
