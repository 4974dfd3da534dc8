"""Fixtures rich enough to tell the cases apart: each boundary of the outcome rule on both
sides, in a world made by hand; do_observation on a step with several tool results; a fork
whose branches must each get their own seed; folds that cross the real snapshot interval;
symlinked directories inside the tools' folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import events as ev
from engine import state as st_mod
from engine.heist.outcome import check_plan, parse_minutes
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.heist.tools import Toolbox
from engine.heist.world import (
    VAULT_POST,
    VAULT_ZONE,
    Alarm,
    Camera,
    Guard,
    Route,
    Vault,
    World,
    make_world,
)
from engine.interventions import DoObservation, branch_seed_for, fork_many, parent_info, run_branch
from engine.journal import Journal
from engine.runtime.seeds import branch_stream, step_seed
from engine.state import SNAPSHOT_EVERY, fold, state_at, state_at_seq


def hm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def world(gap: tuple[int, int] = (100, 150), camera: tuple[int, int] = (110, 170)) -> World:
    """A world made by hand: the vault post is guarded 00:00-gap[0] and gap[1]-06:00, the
    vault camera is offline `camera`, the vault takes 3 x 10 + 2 = 32 minutes, the police
    need 20 minutes; fast_road is a 19-minute drive, slow_road exactly 20."""
    return World(
        seed=0,
        bank="Test Bank",
        guards=(
            Guard("Ada", VAULT_POST, "early", 0, gap[0]),
            Guard("Bo", VAULT_POST, "late", gap[1], 360),
            Guard("Cy", "lobby", "all", 0, 360),
        ),
        cameras=(Camera("c1", VAULT_ZONE, *camera, "test"), Camera("c2", "lobby", None, None, "")),
        vault=Vault("m", "l", dials=3, minutes_per_dial=10, setup_minutes=2),
        alarms=(Alarm(VAULT_POST, "door", 20), Alarm("lobby", "pir", 5)),
        routes=(
            Route("fast_road", "a", "open", 19),
            Route("slow_road", "b", "open", 20),
            Route("shut_road", "c", "blocked", 5),
            Route("slower_road", "d", "open", 30),
        ),
        vehicles=(),
    )


W = world()  # safe window 01:50-02:30 (110-150), 40 minutes


def good(w: World = W, **change: str) -> dict[str, str]:
    s, _ = w.safe_window()
    plan = {
        "guard_gap": "-".join(hm(x) for x in w.guard_gap()),
        "camera_window": "-".join(hm(x) for x in w.camera_window()),
        "crack_minutes": "32",
        "entry_time": hm(s),
        "exit_time": hm(s + 32),
        "route": "fast_road",
    }
    plan.update(change)
    return plan


def reasons_for(key: str, plan: dict[str, str], w: World = W) -> list[str]:
    return [r for r in check_plan(w, plan).reasons if r.startswith(key)]


def test_hand_made_world_is_as_described() -> None:
    """The world's derived facts are the hand-computed ones, and its good plan passes."""
    assert W.guard_gap() == (100, 150) and W.camera_window() == (110, 170)
    assert W.safe_window() == (110, 150) and W.vault.crack_minutes == 32
    assert W.best_route().name == "fast_road"
    out = check_plan(W, good())
    assert (out.bad, out.score, out.reasons) == (False, 1.0, [])


@pytest.mark.parametrize(
    "value,ok",
    [("31", False), ("32", True), ("40", True), ("41", False), ("32 min", True), ("x", False)],
)
def test_crack_minutes_boundaries(value: str, ok: bool) -> None:
    """crack_minutes must be at least what the vault needs (32) and at most the safe window's
    length (40): 31 and 41 fail, 32 and 40 pass."""
    assert (reasons_for("crack_minutes", good(crack_minutes=value)) == []) == ok


@pytest.mark.parametrize(
    "entry,why",
    [
        (109, "camera records outside"),  # unguarded, but the camera still records
        (110, None),  # the camera's first offline minute
        (118, None),  # 118 + 32 = 150: done as the window closes
        (119, "closes first"),
    ],
)
def test_entry_time_boundaries_camera_start_and_deadline(entry: int, why: str | None) -> None:
    """Entry at the camera's first offline minute passes, a minute before fails; the last entry
    that leaves time to crack (window end - 32) passes, a minute later fails."""
    plan = good(entry_time=hm(entry), exit_time=hm(min(entry + 32, 150)))
    got = reasons_for("entry_time", plan)
    assert (got == []) if why is None else (len(got) == 1 and why in got[0]), got


@pytest.mark.parametrize("entry,why", [(99, "guard Ada is at the vault"), (100, None), (118, None)])
def test_entry_time_boundaries_guard_end(entry: int, why: str | None) -> None:
    """With the camera off before the gap opens, entry at the minute the guard leaves passes
    (a stint covers start <= t < end) and a minute earlier meets the guard."""
    w = world(camera=(90, 170))
    plan = good(w, entry_time=hm(entry), exit_time=hm(entry + 32))
    got = reasons_for("entry_time", plan, w)
    assert (got == []) if why is None else (len(got) == 1 and why in got[0]), got


@pytest.mark.parametrize(
    "entry,why",
    [(138, None), (139, "closes first"), (169, "closes first"), (170, "camera records outside")],
)
def test_entry_time_boundary_camera_end(entry: int, why: str | None) -> None:
    """With the gap outlasting the camera (safe window 100-170), the camera's last offline
    minute is 169: entry 170 meets the camera; 138 + 32 = 170 just finishes, 139 does not."""
    w = world(gap=(100, 200), camera=(90, 170))
    got = reasons_for("entry_time", good(w, entry_time=hm(entry), exit_time=hm(170)), w)
    assert (got == []) if why is None else (len(got) == 1 and why in got[0]), got


@pytest.mark.parametrize(
    "entry,exit_at,why",
    [
        (110, 141, "not open before"),  # one minute short of entry + 32
        (110, 142, None),
        (110, 150, None),  # the window's last minute
        (110, 151, "safe window closes"),
        (None, 141, "cannot be open before"),  # no entry stated: s + 32 = 142 is the bound
        (None, 142, None),
    ],
)
def test_exit_time_boundaries(entry: int | None, exit_at: int, why: str | None) -> None:
    """The exit comes no earlier than entry + crack minutes (or window start + crack minutes
    without an entry) and no later than the window's end: each bound on both sides."""
    plan = good(exit_time=hm(exit_at))
    if entry is None:
        del plan["entry_time"]
    else:
        plan["entry_time"] = hm(entry)
    got = reasons_for("exit_time", plan)
    assert (got == []) if why is None else (len(got) == 1 and why in got[0]), got


@pytest.mark.parametrize(
    "route,why",
    [
        ("fast_road", None),  # 19 minutes < 20
        ("Fast Road", None),
        ("fast-road", None),
        ("slow_road", "police arrive"),  # exactly the police response: caught
        ("slower_road", "police arrive"),
        ("shut_road", "blocked tonight"),
        ("no_road", "not a known route"),
    ],
)
def test_route_boundaries(route: str, why: str | None) -> None:
    """The getaway must be strictly faster than the police: 19 passes, 20 fails."""
    got = reasons_for("route", good(route=route))
    assert (got == []) if why is None else (len(got) == 1 and why in got[0]), got


@pytest.mark.parametrize("key", ["guard_gap", "camera_window"])
@pytest.mark.parametrize("shift", [(-1, 0), (1, 0), (0, -1), (0, 1)])
def test_windows_must_match_exactly(key: str, shift: tuple[int, int]) -> None:
    """A window stated one minute off at either end fails; the exact window passes."""
    a, b = W.guard_gap() if key == "guard_gap" else W.camera_window()
    assert reasons_for(key, good(**{key: f"{hm(a)}-{hm(b)}"})) == []
    off = f"{hm(a + shift[0])}-{hm(b + shift[1])}"
    assert len(reasons_for(key, good(**{key: off}))) == 1


def test_score_is_the_share_of_passing_keys() -> None:
    """Two wrong keys and one missing: score 3/6, reasons in plan-key order."""
    plan = good(crack_minutes="31", route="slow_road")
    del plan["guard_gap"]
    out = check_plan(W, plan)
    assert out.bad and out.score == 0.5
    assert [r.split(" ")[0] for r in out.reasons] == ["guard_gap", "crack_minutes", "route"]


@pytest.mark.parametrize(
    "text,want",
    [
        ("42", 42),
        ("42 min", 42),
        ("7 minutes", 7),
        ("1234", 1234),
        ("12345", None),
        ("-3", None),
        ("", None),
    ],
)
def test_parse_minutes(text: str, want: int | None) -> None:
    """Minutes are 1-4 digits with an optional unit."""
    assert parse_minutes(text) == want


# ------------------------------------------------------------------ interventions


@pytest.fixture(scope="module")
def heist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Journal, str]:
    j = Journal(tmp_path_factory.mktemp("b") / "j.db")
    r = record_heist(j, SimPolicy(), seed=3, rounds=1)
    yield j, r.run_id
    j.close()


def test_do_observation_replaces_the_first_of_several_results(heist: tuple[Journal, str]) -> None:
    """On a step with two tool calls, do_observation replaces the first call's result and
    leaves the second exactly as recorded; the agent then sees both, in order."""
    j, run = heist
    by_step: dict[int, list[ev.ToolResult]] = {}
    for e in j.events(run):
        if isinstance(e, ev.ToolResult) and e.step is not None:
            by_step.setdefault(e.step, []).append(e)
    k = min(s for s, rs in by_step.items() if len(rs) >= 2)
    recorded = by_step[k]
    branch = run_branch(j, parent_info(j, run), DoObservation(k, "nothing here"), branch_seed=4)
    own = [s.event for s in j.read(branch.run_id, j.run(branch.run_id).fork_seq or 0)]
    results = [e for e in own if isinstance(e, ev.ToolResult) and e.step == k]
    assert len(results) == len(recorded)
    first, *rest = results
    assert (first.tool, first.param, first.ok, first.output) == (
        recorded[0].tool,
        recorded[0].param,
        True,
        "nothing here",
    )
    assert rest == recorded[1:]
    agent = recorded[0].agent
    seen = [
        o for o in state_at(j, branch.run_id, k + 1).contexts[agent].observations if o.step == k
    ]
    assert [o.output for o in seen] == ["nothing here"] + [
        r.output if r.ok else r.error for r in recorded[1:]
    ]


def test_fork_gives_every_branch_its_own_seed(heist: tuple[Journal, str]) -> None:
    """fork_many's branch i has seed branch_seed_for(seed, i) (known values), every branch a
    different one, and each branch's LLM calls draw from its own seed mixed with the run's
    root seed (decision 62)."""
    assert branch_seed_for(11, 0) == 1491423321324003647  # journal_v3's branches
    assert branch_seed_for(11, 1) == 8102103572083298661
    j, run = heist
    report = fork_many(j, run, DoObservation(2, "the vault is empty"), 4, seed=11)
    seeds = []
    for b in report.branches:
        own = [s.event for s in j.read(b.run_id, j.run(b.run_id).fork_seq or 0)]
        opener = own[0]
        assert isinstance(opener, ev.Intervention)
        seeds.append(opener.branch_seed)
        calls = [e for e in own if isinstance(e, ev.LlmCall)]
        assert calls and all(
            c.seed == step_seed(branch_stream(3, opener.branch_seed), c.step or 0)
            for c in calls[1:]
        )
    assert seeds == [branch_seed_for(11, i) for i in range(4)]
    assert len(set(seeds)) == 4
    assert report.scored == 4 and report.bad == sum(1 for b in report.branches if b.bad)


# ------------------------------------------------------------------ snapshots


def test_fold_across_the_real_snapshot_interval(tmp_path: Path) -> None:
    """A run of 3 x SNAPSHOT_EVERY + 5 events: s at seqs just below, at and above each
    snapshot boundary equals the plain fold, the snapshots written are exactly those at
    multiples of SNAPSHOT_EVERY, and a branch forked past a boundary reuses it."""
    assert SNAPSHOT_EVERY == 512
    n = 3 * SNAPSHOT_EVERY + 5
    with Journal(tmp_path / "j.db") as j:
        run = j.create_run("long")
        events: list[ev.Event] = [
            ev.RunStarted(
                scenario="s",
                config={},
                agents=["a", "b"],
                policy={},
                root_seed=1,
                engine_version="t",
                started_at="t",
                context_window=3,
            )
        ]
        for i in range(n - 1):
            agent = "ab"[i % 2]
            events.append(
                ev.ChatMessage(step=i, agent=agent, text=f"m{i}")
                if i % 3
                else ev.ToolResult(
                    step=i,
                    agent=agent,
                    tool="t",
                    param=str(i),
                    ok=i % 2 == 0,
                    output="o",
                    error="e",
                )
            )
        j.append(run, events, 0)
        plain = [st_mod.State()]
        for e in events:
            plain.append(st_mod.apply(plain[-1], e))
        for seq in (511, 512, 513, 1023, 1024, 1025, 1536, 1537, n):
            assert state_at_seq(j, run, seq) == plain[seq], seq
        snaps = [
            r[0] for r in j.query("SELECT seq FROM snapshots WHERE run_id = ? ORDER BY seq", [run])
        ]
        assert snaps == [512, 1024, 1536]
        assert j.nearest_snapshot(run, 1023, st_mod.FOLD_VERSION)[0] == 512  # type: ignore[index]
        assert j.nearest_snapshot(run, 1024, st_mod.FOLD_VERSION)[0] == 1024  # type: ignore[index]
        assert j.nearest_snapshot(run, 511, st_mod.FOLD_VERSION) is None
        child = j.fork(run, 1030)
        j.append(child, [ev.ChatMessage(step=2000, agent="a", text="branch")], 1030)
        assert j.nearest_snapshot(child, 1031, st_mod.FOLD_VERSION)[0] == 1024  # type: ignore[index]
        assert state_at_seq(j, child, 1031) == st_mod.apply(
            plain[1030], ev.ChatMessage(step=2000, agent="a", text="branch")
        )
        assert fold(events) == plain[n]


# ------------------------------------------------------------------ the tools' folder


@pytest.mark.parametrize("target", ["inside", "parent"])
def test_symlinked_directory_in_the_folder_is_refused(tmp_path: Path, target: str) -> None:
    """A symlinked directory inside the tools' folder is refused even when it points back into
    the folder itself (so following it would read a legitimate file)."""
    tb = Toolbox(make_world(77), root=tmp_path)
    assert tmp_path in tb.folder.parents  # never change the shared cache (a mutant's root)
    real = sorted(p.name for p in tb.files_dir.iterdir() if p.is_file())[0]
    (tb.files_dir / "sub").symlink_to(tb.files_dir if target == "inside" else tb.files_dir.parent)
    name = f"sub/{real}" if target == "inside" else f"sub/{tb.files_dir.name}/{real}"
    r = tb.run("file_reader", name)
    assert not r.ok and r.output == "" and "symbolic link" in (r.error or ""), r
    assert tb.run("file_reader", real).ok  # the file itself is readable


def test_exit_time_messages_name_the_bound() -> None:
    """The exit reasons say the bound that was missed, as a time; a value that is no time is
    quoted back."""
    plan = good(exit_time=hm(141))
    del plan["entry_time"]
    assert reasons_for("exit_time", plan) == [
        "exit_time stated 02:21, but the vault cannot be open before 02:22"
    ]
    assert reasons_for("exit_time", good(exit_time="25:99")) == [
        "exit_time '25:99' is not a time HH:MM"
    ]
    assert reasons_for("exit_time", good(exit_time=hm(141))) == [
        "exit_time stated 02:21, but the vault is not open before 02:22 (entry 01:50 + 32 min)"
    ]
    assert reasons_for("exit_time", good(exit_time=hm(151))) == [
        "exit_time stated 02:31, but the safe window closes at 02:30 (a guard returns or the "
        "camera comes back on)"
    ]
