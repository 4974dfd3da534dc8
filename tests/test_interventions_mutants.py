"""What mutation testing of engine/interventions.py showed unchecked: the parsers' exact
errors and bounds, the depth check at its limit and inside strings, the override check, the
branch key and seed layouts (written out with hashlib), reuse of finished branches, a stop
before a branch starts, and the fork report's fields."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.errors import InterventionError
from engine.executors.base import ExecutorOptions
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.interventions import (
    MAX_JSON_DEPTH,
    BranchRunner,
    BranchSpec,
    DoAction,
    DoContext,
    DoObservation,
    DoPolicy,
    DoResample,
    ForkReport,
    _branch_in,
    _json_depth_ok,
    branch_key,
    branch_seed_for,
    fork_many,
    override_options,
    parent_info,
    parse_context_edit,
    parse_intervention,
    parse_policy_spec,
    validate,
)
from engine.journal import Journal
from engine.workers import STOP


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Journal, str]]:
    j = Journal(tmp_path_factory.mktemp("iv") / "j.db")
    r = record_heist(j, SimPolicy(), seed=4, rounds=1, mole="hacker", strategy="FALSE_INFO")
    yield j, r.run_id
    j.close()


def test_parse_intervention_builds_each_op() -> None:
    """Each op name gives its own intervention type with the value in place."""
    assert parse_intervention("resample", 2, None) == DoResample(2)
    assert parse_intervention("action", 2, "hi") == DoAction(2, "hi")
    assert parse_intervention("observation", 2, "seen") == DoObservation(2, "seen")
    assert parse_intervention("context", 2, "note") == DoContext(2, {"text": "note"})
    assert parse_intervention("policy", 2, "sim-honest") == DoPolicy(2, {"name": "sim-honest"})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("sim:drift=abc", "policy option drift must be a number, got 'abc'"),
        ("sim:drift=1.5", r"policy option drift must lie within \[0, 1\], got '1.5'"),
        ("sim:drift=nan", r"policy option drift must lie within \[0, 1\], got 'nan'"),
        ("openai:max_tokens=0", r"policy option max_tokens must lie within \[1, 131072\], got '0'"),
        ("openai:max_tokens=2.5", "policy option max_tokens must be a whole number, got '2.5'"),
        ("openai:model=", "policy option model must not be empty"),
        ("sim:drift", "policy option 'drift' must look like key=value"),
        ("sim:model=m", r"unknown option 'model' for policy sim \(valid: drift, drift_seed\)"),
        (
            "sim-honest:x=1",
            r"unknown option 'x' for policy sim-honest \(valid: drift, drift_seed\)",
        ),
        (
            "gpt-9",
            "unknown policy 'gpt-9' for do_policy; expected one of: sim, sim-honest, openai$",
        ),
    ],
)
def test_policy_spec_errors_in_full(value: str, message: str) -> None:
    """A bad do_policy value is refused with the whole message: which option, its bounds,
    what was given."""
    with pytest.raises(InterventionError, match=message):
        parse_policy_spec(value)


def test_policy_spec_typed_values_and_bounds() -> None:
    """Options are parsed to their types; the bounds themselves are allowed; blank parts and
    spaces around names are ignored."""
    assert parse_policy_spec(" sim : drift = 0 ,, ") == {"name": "sim", "drift": 0.0}
    assert parse_policy_spec("sim:drift=1") == {"name": "sim", "drift": 1.0}
    assert parse_policy_spec("openai:max_tokens=1,max_retries=10,model=m") == {
        "name": "openai",
        "max_tokens": 1,
        "max_retries": 10,
        "model": "m",
    }
    assert parse_policy_spec("openai:max_tokens=131072")["max_tokens"] == 131072


def test_override_options_checks_against_the_policy() -> None:
    """Overrides are parsed by the policy's own option types; options it does not take are
    named by their flags; a policy with no options takes none."""
    assert override_options("sim", {"drift": "0.5"}) == {"drift": 0.5}
    with pytest.raises(InterventionError, match=r"^--base-url, --max-tokens do not apply"):
        override_options("sim", {"max_tokens": 3, "base_url": "u"})
    with pytest.raises(InterventionError, match=r"^--drift does not apply to policy other$"):
        override_options("other", {"drift": 0})


def test_json_depth_at_the_limit_and_inside_strings() -> None:
    """Nesting exactly at the limit passes, one deeper fails; brackets and escaped quotes
    inside strings do not count, and a string's end is where its closing quote is."""
    at = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert _json_depth_ok(at, MAX_JSON_DEPTH)
    assert not _json_depth_ok("[" + at + "]", MAX_JSON_DEPTH)
    assert _json_depth_ok('{"t": "[[[[[[[[\\"[[[["}', 1)
    # after the string closes, brackets count again
    assert not _json_depth_ok('{"t": "x", "u": [[1]]}', 2)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"step": 1}', r'^do_context JSON must look like \{"step": 3, "text": "..."\} or'),
        ('{"text": "t", "at": 1, "b": 2}', r"unknown keys \['at', 'b'\]; do_context JSON"),
        ('{"text": "t", "step": true}', r"'step' must be an integer, got True$"),
        ('{"text": "t", "step": "2"}', r"'step' must be an integer, got '2'$"),
        ('{"text": [[[[[1]]]]]}', "nests too deeply"),
    ],
)
def test_context_edit_errors_in_full(value: str, message: str) -> None:
    """A malformed do_context JSON value is refused, saying what is wrong with it."""
    with pytest.raises(InterventionError, match=message):
        parse_context_edit(value)


def test_context_edit_accepts_a_step() -> None:
    """A well-formed edit is returned as given."""
    assert parse_context_edit(' {"step": 2, "text": "t"} ') == {"step": 2, "text": "t"}


def test_branch_key_and_seed_layouts() -> None:
    """The branch key is blake2b-80 of a compact sorted-keys JSON list (parent, op, k, value,
    seed, kept steps, override); a branch seed is blake2b-64 of "branch:seed:index",
    big-endian, shifted right by one. Written out here with hashlib and json."""
    iv = DoContext(3, {"text": "t", "step": 1})
    doc = json.dumps(
        ["p", "context", 3, {"step": 1, "text": "t"}, 9, [2, 5], {"drift": 0.5}],
        sort_keys=True,
        separators=(",", ":"),
    )
    want = hashlib.blake2b(doc.encode(), digest_size=10).hexdigest()
    assert branch_key("p", iv, 9, {5: "a", 2: "b"}, {"drift": 0.5}) == want
    assert len(want) == 20
    h = hashlib.blake2b(b"branch:7:3", digest_size=8).digest()
    assert branch_seed_for(7, 3) == int.from_bytes(h, "big") >> 1


def test_validate_refuses_paused_and_empty_runs(recorded: tuple[Journal, str]) -> None:
    """A paused run cannot be forked yet; a run without steps has none to fork."""
    j, run = recorded
    parent = parent_info(j, run)
    paused = type(parent)(run, parent.steps, "paused", {}, frozenset(), {})
    with pytest.raises(InterventionError, match="is still recording; fork it once it has ended"):
        validate(paused, DoResample(0))
    empty = type(parent)(run, 0, "completed", {}, frozenset(), {})
    with pytest.raises(InterventionError, match=f"^run {run!r} has no steps to fork$"):
        validate(empty, DoResample(0))


def test_parent_info_of_the_recorded_run(recorded: tuple[Journal, str]) -> None:
    """The parent's steps, status, recorded actions and outcome as the journal has them."""
    j, run = recorded
    parent = parent_info(j, run)
    assert (parent.steps, parent.status) == (6, "completed")
    assert sorted(parent.actions) == list(range(6))
    assert isinstance(parent.outcome.get("bad"), bool)


def test_stop_before_a_branch_starts(recorded: tuple[Journal, str]) -> None:
    """With a stop requested, a branch job does not start: stopped, no run, 'interrupted'."""
    j, run = recorded
    parent = parent_info(j, run)  # which, with a stop requested, would stop itself
    STOP.set()
    try:
        r = _branch_in(j, parent, BranchSpec(DoResample(1), 5), None)
    finally:
        STOP.clear()
    assert (r.run_id, r.status, r.bad, r.error, r.reused) == (
        "",
        "stopped",
        None,
        "interrupted",
        False,
    )


def test_branch_job_result_has_the_branch_outcome(recorded: tuple[Journal, str]) -> None:
    """A completed branch's result names its run, status and bad flag as the journal ended it."""
    j, run = recorded
    r = _branch_in(j, parent_info(j, run), BranchSpec(DoResample(1), 5), None)
    last = j.last_event(r.run_id)
    assert last is not None
    assert (r.status, r.error) == ("completed", None)
    assert r.bad is bool(last.event.outcome["bad"])  # type: ignore[union-attr]


def test_reuse_reads_back_finished_branches(recorded: tuple[Journal, str]) -> None:
    """Run again with reuse, the same specs find the branches made before: no new run, the
    same run ids and outcomes, marked reused, and progress starts at the reused count."""
    j, run = recorded
    parent = parent_info(j, run)
    specs = [BranchSpec(DoResample(2), branch_seed_for(11, i)) for i in range(3)]
    with BranchRunner(j, parent, reuse=True) as first:
        made = first.run(specs)
    assert first.reused == 0 and first.created == 3
    before = len(j.children(run))
    seen: list[tuple[int, int]] = []
    with BranchRunner(j, parent, reuse=True) as again:
        back = again.run(specs, progress=lambda d, t: seen.append((d, t)))
    assert again.reused == 3 and again.created == 0
    assert len(j.children(run)) == before
    assert [(b.run_id, b.bad, b.status) for b in back] == [
        (m.run_id, m.bad, m.status) for m in made
    ]
    assert all(b.reused for b in back) and not any(m.reused for m in made)
    assert seen == [(3, 3)]


def test_progress_of_new_branches(recorded: tuple[Journal, str]) -> None:
    """Without reuse, progress counts each finished branch once, up to the total."""
    j, run = recorded
    seen: list[tuple[int, int]] = []
    fork_many(j, run, DoResample(3), 3, seed=2, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(1, 3), (2, 3), (3, 3)]


def test_fork_report_fields(recorded: tuple[Journal, str]) -> None:
    """The report names the parent, the step, the op and its value, the parent's own outcome
    and where the branches ran; to_dict gives the interval as a list."""
    j, run = recorded
    parent = parent_info(j, run)
    rep = fork_many(j, run, DoAction(1, "we wait"), 2, seed=5)
    assert (rep.parent, rep.at, rep.op, rep.value) == (run, 1, "action", "we wait")
    assert rep.factual_bad is parent.outcome["bad"]
    assert rep.executor is not None and isinstance(rep.executor, dict)
    d = rep.to_dict()
    assert d["ci"] == list(rep.ci or ()) and isinstance(d["ci"], list)
    assert d["parent"] == run and len(d["branches"]) == 2


def test_fork_report_of_unscored_branches() -> None:
    """Branches without an outcome give no rate and no interval (None in to_dict too)."""
    from engine.interventions import BranchResult

    rep = ForkReport.of("p", DoResample(0), [BranchResult("", "failed", None, "x")], None)
    assert (rep.scored, rep.bad_rate, rep.ci) == (0, None, None)
    assert rep.to_dict()["ci"] is None


def test_fork_with_an_override_for_the_runs_policy(tmp_path: Path) -> None:
    """--drift on a fork of a sim run is checked against the run's policy; a flag it does not
    take is refused before any branch is made."""
    with Journal(tmp_path / "j.db") as j:
        run = record_heist(j, SimPolicy(), seed=4, rounds=1).run_id
        rep = fork_many(j, run, DoResample(1), 1, policy_override={"drift": "0"})
        assert rep.scored == 1
        with pytest.raises(InterventionError, match="--model does not apply to policy sim"):
            fork_many(j, run, DoResample(1), 1, policy_override={"model": "m"})
        assert len(j.children(run)) == 1


def test_out_of_range_names_the_last_step(recorded: tuple[Journal, str]) -> None:
    """A step past the end is refused naming the run's steps 0..n-1; do_context may edit only
    a step before k (k itself is refused)."""
    j, run = recorded
    parent = parent_info(j, run)
    with pytest.raises(
        InterventionError, match=rf"^step 6 is out of range: run {run!r} has steps 0\.\.5$"
    ):
        validate(parent, DoResample(6))
    with pytest.raises(InterventionError, match=r"earlier step's message \(0\.\.2\), got step 3"):
        validate(parent, DoContext(3, {"step": 3, "text": "t"}))
    validate(parent, DoContext(3, {"step": 2, "text": "t"}))  # the step just before k is fine


def test_parent_info_of_a_run_without_an_end(tmp_path: Path) -> None:
    """A run that has not ended has no outcome yet: an empty one, not a missing one."""
    with Journal(tmp_path / "j.db") as j:
        full = record_heist(j, SimPolicy(), seed=4, rounds=1).run_id
        events = j.events(full)
        run = j.create_run("heist")
        j.append(run, events[:3], 0)
        info = parent_info(j, run)
    assert (info.status, info.outcome) == ("recording", {})


def test_one_policy_object_per_spec() -> None:
    """policy_for builds a policy once per spec (key order does not matter) and reuses it."""
    from engine.interventions import policy_for

    a = policy_for({"name": "sim", "drift": 0.0})
    assert policy_for({"drift": 0.0, "name": "sim"}) is a
    assert policy_for({"name": "sim-honest"}) is not a


def test_prepared_bases_keep_each_messages_step(tmp_path: Path) -> None:
    """The prefix conversation of a base prepared in one pass keeps every message's step."""
    from engine.interventions import branch_base, prepare_bases

    with Journal(tmp_path / "j.db") as j:
        run = record_heist(j, SimPolicy(), seed=6, rounds=1).run_id
        parent = parent_info(j, run)
        assert prepare_bases(j, parent) == 6
        base = branch_base(j, parent, 4)
    assert [line.step for line in base.prefix] == [0, 1, 2, 3]


def test_runner_mode_by_policy_and_concurrency(recorded: tuple[Journal, str]) -> None:
    """The embedded policy runs inline one at a time and in processes (SQLite) at
    concurrency 2; a policy waiting on a server (thread_policy) runs in threads."""
    j, run = recorded
    parent = parent_info(j, run)
    with BranchRunner(j, parent, all_bases=False) as r:
        assert r.mode == "inline"
    with BranchRunner(j, parent, all_bases=False, thread_policy=True) as r:
        assert r.mode == "threads"
    with BranchRunner(j, parent, all_bases=False, concurrency=2) as r:
        assert r.mode == "processes"
    # a process with threads of its own (the server) never forks: the mode says what runs
    no_fork = ExecutorOptions(processes=False)
    with BranchRunner(j, parent, all_bases=False, concurrency=2, executor=no_fork) as r:
        assert r.mode == "threads"


def test_utc_now_is_timezone_aware() -> None:
    """The 'since' mark of a runner is UTC with its offset, as run rows' created_at are."""
    from engine.interventions import _utc_now

    assert _utc_now().endswith("+00:00")


def test_do_policy_with_an_override_journals_it_in_the_value(tmp_path: Path) -> None:
    """With do_policy, --drift applies to the policy swapped in and is part of the
    intervention's value (parsed to its type)."""
    with Journal(tmp_path / "j.db") as j:
        run = record_heist(j, SimPolicy(), seed=4, rounds=1).run_id
        rep = fork_many(
            j, run, DoPolicy(1, {"name": "sim-honest"}), 1, policy_override={"drift": "0"}
        )
    assert (rep.at, rep.value) == (1, {"name": "sim-honest", "drift": 0.0})


def test_fork_interval_is_the_95_percent_wilson() -> None:
    """A fork's interval is Wilson's at 95% (scipy's binomtest), for 3 bad of 10 branches."""
    from scipy.stats import binomtest

    from engine.interventions import BranchResult

    branches = [BranchResult(f"r{i}", "completed", i < 3) for i in range(10)]
    rep = ForkReport.of("p", DoResample(0), branches, True)
    want = binomtest(3, 10).proportion_ci(0.95, method="wilson")
    assert rep.ci == pytest.approx((want.low, want.high))
    assert (rep.bad, rep.scored, rep.bad_rate) == (3, 10, 0.3)


def test_json_depth_counts_only_brackets_and_closes_one_level() -> None:
    """A closing bracket closes one level (not back to the first); other characters close
    nothing."""
    assert not _json_depth_ok("[[[][[]]]]", 3)  # reaches depth 4 after closing one level
    assert not _json_depth_ok("[[X[[", 3)


def test_resample_value_message_in_full() -> None:
    """do_resample with a value is refused with exactly that message."""
    with pytest.raises(InterventionError, match=r"^do_resample takes no --value$"):
        parse_intervention("resample", 1, "x")


def test_prepare_bases_up_to_a_step(recorded: tuple[Journal, str]) -> None:
    """prepare_bases(upto=3) computes the bases of steps 0, 1 and 2: three, no more."""
    from engine.interventions import prepare_bases

    j, run = recorded
    assert prepare_bases(j, parent_info(j, run), upto=3) == 3


def test_runner_mode_follows_an_overridden_policy_name(recorded: tuple[Journal, str]) -> None:
    """An override that names a policy decides the runner's mode by that name."""
    j, run = recorded
    parent = parent_info(j, run)
    with BranchRunner(j, parent, all_bases=False, policy_override={"name": "sim-honest"}) as r:
        assert r.mode == "inline"


# ------------------------------------------------------------------ second round (seed 1)


def test_nul_bytes_message_in_full() -> None:
    """A value with a NUL byte is refused as binary data, naming what it is."""
    with pytest.raises(
        InterventionError,
        match=r"^do_action value contains NUL bytes: it must be text, not binary data$",
    ):
        parse_intervention("action", 1, "a\x00b")


def test_wilson_at_zero_and_one_branch() -> None:
    """No scored branch gives the whole [0, 1]; one branch already gives Wilson's interval
    (scipy's binomtest), not the whole range."""
    from scipy.stats import binomtest

    from engine.interventions import wilson

    assert wilson(0, 0) == (0.0, 1.0)
    want = binomtest(1, 1).proportion_ci(0.95, method="wilson")
    assert wilson(1, 1) == pytest.approx((want.low, want.high))
    assert wilson(1, 1)[0] > 0.2


def test_branch_base_is_cached(tmp_path: Path) -> None:
    """A base computed once is returned again from the cache (the same object), and it is the
    state and conversation the journal has before the fork point."""
    from engine.interventions import branch_base
    from engine.projections import conversation

    with Journal(tmp_path / "j.db") as j:
        run = record_heist(j, SimPolicy(), seed=6, rounds=1).run_id
        parent = parent_info(j, run)
        first = branch_base(j, parent, 3)
        assert branch_base(j, parent, 3) is first
        assert list(first.prefix) == conversation(j, run, first.fork_seq)


def test_prepared_bases_match_the_journal_after_a_context_edit(tmp_path: Path) -> None:
    """Bases prepared in one pass over a branch whose history holds a do_context edit are the
    ones the journal's own projection gives: the edited conversation, agents and steps kept."""
    from engine.interventions import BranchBase, prepare_bases, run_branch
    from engine.projections import conversation
    from engine.state import state_at_seq

    with Journal(tmp_path / "j.db") as j:
        run = record_heist(j, SimPolicy(), seed=6, rounds=1).run_id
        edit = {"step": 1, "text": "[PLAN:route=old_mill_lane]"}
        b = run_branch(j, parent_info(j, run), DoContext(3, edit), 7).run_id
        parent = parent_info(j, b)
        assert prepare_bases(j, parent) == parent.steps
        import engine.interventions as m

        for k in range(parent.steps):
            got = m._bases[(j.url, b, k)]
            want = BranchBase(
                got.fork_seq,
                state_at_seq(j, b, got.fork_seq),
                tuple(conversation(j, b, got.fork_seq)),
            )
            assert got == want, k
        assert [line.text for line in m._bases[(j.url, b, 5)].prefix][1] == edit["text"]


def test_completed_run_without_an_outcome_is_not_reused(tmp_path: Path) -> None:
    """A branch that ended completed but carries no `bad` is not read back as a result, and
    neither is one that ended otherwise."""
    from engine import events as ev
    from engine.interventions import branch_outcome

    with Journal(tmp_path / "j.db") as j:
        full = record_heist(j, SimPolicy(), seed=4, rounds=1).run_id
        events = j.events(full)
        opening = [e for e in events if e.step is None][:1]
        for end in (
            ev.RunEnded(status="completed", outcome={}),
            ev.RunEnded(status="stopped", outcome={"bad": True}),
        ):
            run = j.create_run("heist")
            j.append(run, [*opening, end], 0)
            assert branch_outcome(j, run) is None
        got = branch_outcome(j, full)
        assert got is not None and (got.error, got.reused) == (None, True)


def test_do_context_added_at_the_last_step_counts_in_the_outcome(tmp_path: Path) -> None:
    """A message added by do_context is part of the conversation the outcome is scored on:
    a route stated only there is the plan's route."""
    from engine.interventions import run_branch

    with Journal(tmp_path / "j.db") as j:
        run = record_heist(j, SimPolicy(), seed=4, rounds=1).run_id
        parent = parent_info(j, run)
        assert "route" not in parent.outcome["plan"]
        k = parent.steps - 1
        edit = {"text": "[PLAN:route=through_the_roof]"}
        r = run_branch(j, parent, DoContext(k, edit), branch_seed=3)
    assert r.outcome["plan"]["route"] == "through_the_roof"


def test_run_branches_keeps_spec_order(recorded: tuple[Journal, str]) -> None:
    """run_branches runs each spec once on the given parent and returns results in spec
    order, each naming a new branch of that parent."""
    from engine.interventions import run_branches

    j, run = recorded
    parent = parent_info(j, run)
    specs = [BranchSpec(DoResample(4), branch_seed_for(21, i)) for i in range(3)]
    before = {c.run_id for c in j.children(run)}
    out = run_branches(j, parent, specs)
    made = [c for c in j.children(run) if c.run_id not in before]
    assert len(out) == 3 and {c.run_id for c in made} == {b.run_id for b in out}
    for spec, b in zip(specs, out, strict=True):
        first = j.events(b.run_id)[j.run(b.run_id).fork_seq or 0]
        assert first.branch_seed == spec.branch_seed  # type: ignore[union-attr]


def test_runner_mode_of_an_override_naming_a_server_policy(recorded: tuple[Journal, str]) -> None:
    """An override naming a server-backed policy runs the branches of a sim run in threads,
    and the executor itself runs in the mode the runner reports."""
    j, run = recorded
    parent = parent_info(j, run)
    override = {"name": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"}
    with BranchRunner(j, parent, all_bases=False, policy_override=override) as r:
        assert r.mode == "threads" and r.executor.mode == "threads"  # type: ignore[attr-defined]
    with BranchRunner(j, parent, all_bases=False) as r:
        assert r.executor.mode == "inline"  # type: ignore[attr-defined]
    with BranchRunner(j, parent, all_bases=False, concurrency=2) as r:
        assert r.executor.mode == "processes"  # type: ignore[attr-defined]


def test_do_policy_of_the_embedded_policy_runs_in_processes(
    recorded: tuple[Journal, str],
) -> None:
    """do_policy swapping in an embedded policy at concurrency 2 runs its branches in worker
    processes (CPU work; threads would share one core), as the report's executor shows."""
    j, run = recorded
    rep = fork_many(j, run, DoPolicy(2, {"name": "sim-honest"}), 2, seed=3, concurrency=2)
    assert rep.scored == 2
    assert rep.executor is not None
    assert rep.executor["workers"] == 2 and len(rep.executor["busy_s"] or []) == 2


def test_every_policy_name_has_its_options() -> None:
    """Each policy do_policy accepts has an entry in POLICY_OPTIONS (the option check never
    meets a policy it knows nothing of)."""
    from engine.interventions import POLICY_OPTIONS
    from engine.policies.registry import POLICY_NAMES

    assert set(POLICY_NAMES) == set(POLICY_OPTIONS)


# ------------------------------------------------------------------ second round (seed 2)


def test_parse_intervention_messages_in_full() -> None:
    """An unknown operation lists the five; an empty value is no value."""
    with pytest.raises(
        InterventionError,
        match=r"^unknown operation 'swap'; expected one of: "
        r"resample, action, observation, context, policy$",
    ):
        parse_intervention("swap", 1, None)
    with pytest.raises(InterventionError, match=r"^do_action needs --value or --value-file$"):
        parse_intervention("action", 1, "")


def test_validate_lists_the_steps_with_tool_calls(recorded: tuple[Journal, str]) -> None:
    """do_observation at a step without a tool call names the steps that have one."""
    j, run = recorded
    parent = parent_info(j, run)
    no_tools = type(parent)(run, 6, "completed", {}, frozenset({1, 4}), {})
    with pytest.raises(
        InterventionError,
        match=rf"^do_observation needs a step with a tool call; step 2 of run {run!r} made "
        r"none \(steps with tool calls: 1, 4\)$",
    ):
        validate(no_tools, DoObservation(2, "x"))


def test_do_context_may_edit_the_first_step(recorded: tuple[Journal, str]) -> None:
    """Step 0 is an earlier step too; a negative step is not."""
    j, run = recorded
    parent = parent_info(j, run)
    validate(parent, DoContext(3, {"step": 0, "text": "t"}))
    with pytest.raises(InterventionError, match=r"\(0\.\.2\), got step -1$"):
        validate(parent, DoContext(3, {"step": -1, "text": "t"}))


def test_kept_steps_are_forced_in_the_branch(tmp_path: Path) -> None:
    """A branch job's kept steps (Shapley's coalitions) are forced: the branch says exactly
    the kept text there; its label keys on the kept steps and the override."""
    from engine import events as ev
    from engine.interventions import branch_label, run_branch

    with Journal(tmp_path / "j.db") as j:
        run = record_heist(j, SimPolicy(), seed=4, rounds=1).run_id
        parent = parent_info(j, run)
        r = _branch_in(j, parent, BranchSpec(DoResample(1), 5, keep={3: "we hold"}), None)
        said = {e.step: e.text for e in j.events(r.run_id) if isinstance(e, ev.ChatMessage)}
        assert said[3] == "we hold"
        keep, override = {3: "we hold"}, {"drift": 0.0}
        b = run_branch(j, parent, DoResample(1), 5, keep=keep, policy_override=override)
        want = branch_label(DoResample(1), branch_key(run, DoResample(1), 5, keep, override))
        assert j.run(b.run_id).label == want
        assert want != branch_label(DoResample(1), branch_key(run, DoResample(1), 5, keep, None))
        assert want != branch_label(
            DoResample(1), branch_key(run, DoResample(1), 5, None, override)
        )


def test_ray_executor_on_a_sqlite_journal_is_refused(recorded: tuple[Journal, str]) -> None:
    """--executor ray with a SQLite journal is refused in one line before any branch: its
    workers on other machines cannot open the file."""
    from engine.errors import ConfigError
    from engine.executors.base import ExecutorOptions

    j, run = recorded
    with pytest.raises(ConfigError, match=r"^--executor ray needs a PostgreSQL journal"):
        BranchRunner(j, parent_info(j, run), all_bases=False, executor=ExecutorOptions("ray"))


# ------------------------------------------------------------------ a fresh sample (seed 3)


def test_letters_outside_strings_are_not_brackets() -> None:
    """Text after a do_context object is bad JSON, not deep nesting."""
    with pytest.raises(InterventionError, match=r"^do_context value is not valid JSON: Extra data"):
        parse_context_edit('{"text": "t"} XXXXX')


def test_branch_job_passes_the_override(recorded: tuple[Journal, str]) -> None:
    """An executor's branch job applies the policy override it is handed."""
    from engine.interventions import branch_job

    j, run = recorded
    r = branch_job(j, parent_info(j, run), (BranchSpec(DoResample(1), 5), {"drift": 7.0}))
    assert (r.status, r.run_id) == ("failed", "")


def test_runner_counts_branches_over_batches(recorded: tuple[Journal, str]) -> None:
    """A runner used for two batches counts the branches of both as created."""
    j, run = recorded
    parent = parent_info(j, run)
    with BranchRunner(j, parent) as runner:
        runner.run([BranchSpec(DoResample(5), branch_seed_for(31, 0))])
        runner.run([BranchSpec(DoResample(5), branch_seed_for(31, i)) for i in (1, 2)])
        assert runner.created == 3


# ------------------------------------------------------------------ server flags where taken


@pytest.fixture(scope="module")
def swapped(recorded: tuple[Journal, str]) -> Iterator[tuple[Journal, str, str]]:
    """A branch of the sim heist that swapped in the openai policy at step 3 (a scripted
    server answers its calls at once): forks at steps up to 3 are decided by sim, later ones
    by openai."""
    from llm_helpers import completion, scripted_server

    j, run = recorded
    with scripted_server(lambda _r: (200, completion("Checking."))) as server:
        spec = {"name": "openai", "base_url": server.url, "model": "m", "timeout": 30}
        rep = fork_many(j, run, DoPolicy(3, spec), 1)
        assert [b.status for b in rep.branches] == ["completed"], rep.branches
        yield j, rep.branches[0].run_id, server.url


def test_check_override_sends_flags_where_a_policy_takes_them(
    swapped: tuple[Journal, str, str],
) -> None:
    """An attribution's check (where_taken) accepts --base-url on a branch where openai
    decides some forks and sim others, and returns it parsed; a fork's strict check at a
    sim-decided step refuses it naming the swap; flags no policy in force takes all of are
    refused either way."""
    from engine.interventions import check_override

    j, branch = swapped[0], swapped[1]
    parent = parent_info(j, branch)
    flags = {"base_url": "http://127.0.0.1:9/v1", "timeout": "5"}
    assert check_override(j, parent, flags, where_taken=True) == {
        "base_url": "http://127.0.0.1:9/v1",
        "timeout": 5.0,
    }
    assert check_override(j, parent, flags, [4]) == {
        "base_url": "http://127.0.0.1:9/v1",
        "timeout": 5.0,
    }
    with pytest.raises(InterventionError) as e:
        check_override(j, parent, flags)
    assert str(e.value) == (
        f"--base-url, --timeout do not apply to policy sim (the policy in force at steps 0..3 "
        f"of run {branch}; its do_policy swap to openai at step 3 decides forks after that step)"
    )
    with pytest.raises(InterventionError, match=r"^--model does not apply to policy sim \("):
        check_override(j, parent, {"drift": "0.1", "model": "m"}, where_taken=True)
    refused = r"^--base-url, --timeout do not apply to policy sim$"
    with pytest.raises(InterventionError, match=refused):
        check_override(j, parent, flags, [])  # no step: the run's recorded policy
    with pytest.raises(InterventionError, match=refused):
        root = parent_info(j, j.run(branch).parent_run_id or "")
        check_override(j, root, flags, where_taken=True)


def test_applied_override_is_all_or_nothing_per_policy() -> None:
    """A branch gets the whole override when its policy takes every flag, none of it else; an
    override naming a policy (do_policy's) is taken as it is; no override is an empty one."""
    from engine.interventions import applied_override

    flags = {"base_url": "http://x/v1", "timeout": 5.0}
    assert applied_override({"name": "openai"}, flags) == flags
    assert applied_override({"name": "openai"}, flags) is not flags
    assert applied_override({"name": "sim"}, flags) == {}
    assert applied_override({"name": "openai"}, {**flags, "drift": 0.1}) == {}
    assert applied_override({"name": "sim"}, {"drift": 0.1}) == {"drift": 0.1}
    assert applied_override({"name": "sim"}, {"name": "openai", **flags}) == {
        "name": "openai",
        **flags,
    }
    assert applied_override({"name": "openai"}, None) == {}
    assert applied_override({"name": "openai"}, {}) == {}
    assert applied_override({}, flags) == {}


def test_a_branch_the_override_does_not_reach_keeps_its_key(
    swapped: tuple[Journal, str, str],
) -> None:
    """The label (key) of a branch forked where sim decides is the same with the server flags
    as without them: a run without the flags reuses it. Where openai decides, they change it."""
    j, branch = swapped[0], swapped[1]
    parent = parent_info(j, branch)
    flags = {"base_url": "http://127.0.0.1:9/v1", "timeout": 5.0}
    spec = BranchSpec(DoResample(1), 5)
    with BranchRunner(j, parent, policy_override=flags, reuse=True) as r:
        (made,) = r.run([spec])
    with BranchRunner(j, parent, reuse=True) as r:
        (again,) = r.run([spec])
        assert (r.reused, again.run_id) == (1, made.run_id)
    assert branch_key(branch, DoResample(4), 5, None, flags) != branch_key(
        branch, DoResample(4), 5, None, None
    )
