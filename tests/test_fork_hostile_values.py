"""`car fork` and `car fidelity` as a demanding user and an attacker use them: bounds of -n and
--seed, values that are not text, an empty --value-file, a re-run with the same seed, the same
outcomes whatever -c is, and the fidelity of a branch that swapped its policy.

Every refusal is one `error:` line, exit status 2 (a bad flag value), and no branch in the
journal. Real journals recorded with the embedded sim policy (the seed-7 heist of conftest's
`failed_heist`, intel the mole at step 3), real `car` processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import InterventionError
from engine.interventions import MAX_BRANCHES, DoResample, fork_many
from engine.journal import Journal
from tests.journal_helpers import car, run_count


def refused(proc: object, flag: str, words: str) -> None:
    """One `error:` line naming the flag and what is wrong, exit 2, nothing on stdout."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)  # type: ignore[attr-defined]
    lines = proc.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr  # type: ignore[attr-defined]
    assert flag in lines[0] and words in lines[0], lines[0]
    assert "Traceback" not in proc.stderr  # type: ignore[attr-defined]


def test_branches_past_the_bound_are_refused_before_any_work(
    failed_heist: tuple[Path, str],
) -> None:
    """-n had no upper bound: -n 10**11 built every branch's spec up front and died in a
    MemoryError traceback after half a minute. Now -n is at most 100,000 (as --runs), refused
    as a bad flag value before the run is even looked at (here: a step it does not have, which
    the old code reported first, with exit 1)."""
    path, run = failed_heist
    before = run_count(path)
    for n in (str(MAX_BRANCHES + 1), str(10**11)):
        p = car(path, "fork", run, "--at", "999", "--do", "resample", "-n", n)
        refused(p, "'--branches'", "100000")
    assert run_count(path) == before
    # the library call is bounded too (the server forks through it)
    with Journal(path) as j, pytest.raises(InterventionError, match="number of branches"):
        fork_many(j, run, DoResample(999), 10**11)
    assert "100,000" in car(path, "fork", "--help").stdout


def test_the_bound_matches_the_library() -> None:
    from engine.commands.counterfactual import MAX_BRANCHES as CLI_MAX

    assert CLI_MAX == MAX_BRANCHES


def test_a_negative_seed_is_a_bad_flag_value_as_everywhere_else(
    failed_heist: tuple[Path, str],
) -> None:
    """`car fork --seed -1` ran (every other command refuses a seed outside 0..2^63-1)."""
    path, run = failed_heist
    before = run_count(path)
    for seed in ("-1", str(2**63)):
        p = car(path, "fork", run, "--at", "22", "--do", "resample", "-n", "1", "--seed", seed)
        refused(p, "'--seed'", "")
    assert run_count(path) == before


def test_an_empty_value_file_is_named_as_such(
    failed_heist: tuple[Path, str], tmp_path: Path
) -> None:
    """An empty --value-file was reported as "do_action needs --value or --value-file" -- the
    user gave one. (With --do resample it was taken as no value at all.)"""
    path, run = failed_heist
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    before = run_count(path)
    for op in ("action", "resample"):
        p = car(path, "fork", run, "--at", "3", "--do", op, "--value-file", str(empty), "-n", "1")
        refused(p, "'--value-file'", "is empty")
    assert run_count(path) == before


def test_the_same_fork_twice_adds_branches_with_the_same_outcomes_as_documented(
    failed_heist: tuple[Path, str],
) -> None:
    """A fork is not read back (unlike car attribute): the same --seed again adds N new
    branches, with the same outcomes. --help says so."""
    path, run = failed_heist
    assert "not read back" in " ".join(car(path, "fork", "--help").stdout.split())
    args = ("fork", run, "--at", "21", "--do", "resample", "-n", "3", "--seed", "11", "--json")
    first = json.loads(car(path, *args).stdout)
    second = json.loads(car(path, *args).stdout)
    ids = [b["run_id"] for b in first["branches"]] + [b["run_id"] for b in second["branches"]]
    assert len(set(ids)) == 6
    assert [b["bad"] for b in first["branches"]] == [b["bad"] for b in second["branches"]]


def test_outcomes_do_not_depend_on_concurrency(failed_heist: tuple[Path, str]) -> None:
    """The same seed gives the same branch outcomes, in order, with -c 1 and -c 2 (forked
    worker processes), for a resample and for a policy swap."""
    path, run = failed_heist
    for extra in (("--do", "resample"), ("--do", "policy", "--value", "sim-honest")):
        got = []
        for c in ("1", "2"):
            p = car(path, "fork", run, "--at", "3", *extra, "-n", "8", "--seed", "3", "-c", c,
                    "--json")  # fmt: skip
            assert p.returncode == 0, p.stderr
            got.append([b["bad"] for b in json.loads(p.stdout)["branches"]])
        assert got[0] == got[1] and len(got[0]) == 8


def test_fidelity_of_a_policy_swap_names_the_policy_that_decided(
    failed_heist: tuple[Path, str],
) -> None:
    """`car fidelity` of a do_policy branch said "(policy sim)" and explained the swapped-in
    policy's divergences by the run's own: "same model and fingerprint: nondeterminism in the
    model or server" for a sim-honest with drift 1.0, and the server of the run's policy, not
    of the one that decided."""
    path, run = failed_heist
    p = car(path, "fork", run, "--at", "3", "--do", "policy", "--value", "sim-honest:drift=1.0",
            "-n", "1", "--json")  # fmt: skip
    assert p.returncode == 0, p.stderr
    branch = json.loads(p.stdout)["branches"][0]["run_id"]
    p = car(path, "fidelity", branch, "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["policy"]["name"] == "sim"
    assert report["policy_swaps"] == [{"step": 3, "policy": {"name": "sim-honest", "drift": 1.0}}]
    late = [d for d in report["divergences"] if d["step"] >= 3]
    # drift 1.0 redraws all 21 steps from fresh randomness: some differ (all match: < 1e-10)
    assert late
    for d in late:
        assert "drift knob is 1.0" in d["provenance"]["explanation"], d["provenance"]
    assert all(d["step"] >= 3 for d in report["divergences"])
    p = car(path, "fidelity", branch)
    assert p.returncode == 0, p.stderr
    assert "(policy sim, sim-honest from step 3)" in p.stdout.splitlines()[0]
