"""The public view carries no trace of the secret: not by content, order nor presence.

Method: record the same seed with each agent as the mole in turn (and each strategy), then
compare what the public may see. Before the mole's first turn every agent behaves honestly, so
all public reads up to that step must be identical whoever the mole is; after it they may
differ only through public behaviour. And no byte that a non-`--reveal` command prints may
contain a secret string.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

import cli
from engine import events as ev
from engine.heist.mole import Strategy, instructions
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal
from engine.public import public_events, public_state, public_view

SEED = 11
AGENTS = ("planner", "hacker", "safecracker", "intel", "driver", "lookout")
SECRETS = [s.value for s in Strategy] + [instructions(s) for s in Strategy]
# fragments that identify the instructions even when a printer wraps or cuts lines
SECRETS += ["SECRET: you are the mole", "Sabotage the heist without being identified"]


@pytest.fixture(scope="module")
def moles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Journal, dict[str, str]]]:
    """One journal; run ids by mole for seed SEED with strategy FALSE_INFO."""
    path = tmp_path_factory.mktemp("public") / "j.db"
    with Journal(path) as j:
        runs = {
            a: record_heist(j, SimPolicy(), seed=SEED, mole=a, strategy="FALSE_INFO").run_id
            for a in AGENTS
        }
        yield j, runs


def _strip(d: dict) -> dict:  # type: ignore[type-arg]
    return {k: v for k, v in d.items() if k != "run_id"}


def test_state_before_the_moles_first_turn_is_the_same_whoever_it_is(
    moles: tuple[Journal, dict[str, str]],
) -> None:
    """s_k's public projection at every k up to the earlier mole's first turn is identical for
    any two choices of mole (the old view listed only the mole at k=0 and it first later)."""
    j, runs = moles
    for i, a in enumerate(AGENTS):
        for b in AGENTS[i:]:
            first = min(AGENTS.index(a), AGENTS.index(b))
            for k in range(first + 1):
                sa, sb = public_state(j, runs[a], k), public_state(j, runs[b], k)
                assert _strip(sa) == _strip(sb), (a, b, k)


def test_state_structure_never_depends_on_the_mole(moles: tuple[Journal, dict[str, str]]) -> None:
    """At every k the keys, the agent order and the per-agent sections (every agent, config
    order, the same keys) are the same for every mole; only behaviour-driven values vary."""
    j, runs = moles
    for k in (0, 1, 5, 12, 23, 24):
        shapes = set()
        for a in AGENTS:
            s = public_state(j, runs[a], k)
            assert [p["agent"] for p in s["per_agent"]] == list(AGENTS)
            assert s["agents"] == list(AGENTS)
            assert all(p["turns"] == (k + 5 - i) // 6 for i, p in enumerate(s["per_agent"]))
            shapes.add((tuple(s), tuple(tuple(p) for p in s["per_agent"])))
        assert len(shapes) == 1, k


def test_public_view_prefix_is_identical_before_the_mole_acts(
    moles: tuple[Journal, dict[str, str]],
) -> None:
    """The public view's messages and tool usage (seqs included) of steps before the mole's
    first turn are equal across moles; the view never holds seeds or LLM calls."""
    j, runs = moles
    views = {a: public_view(j, runs[a]) for a in AGENTS}
    for i, a in enumerate(AGENTS):
        for b in AGENTS[i + 1 :]:
            first = AGENTS.index(a)  # a acts before b
            va, vb = views[a], views[b]
            assert [m for m in va.messages if m.step < first] == [
                m for m in vb.messages if m.step < first
            ]
            assert [t for t in va.tool_usage if t.step < first] == [
                t for t in vb.tool_usage if t.step < first
            ]
            assert va.agents == vb.agents == list(AGENTS)
    raw = json.dumps(msgspec.to_builtins(views["planner"]))
    assert "seed" not in raw and "request" not in raw


def test_public_events_never_yield_secret_or_llm_calls(
    moles: tuple[Journal, dict[str, str]],
) -> None:
    """public_events yields only the public kinds, in seq order, resumable after any seq."""
    j, runs = moles
    rid = runs["intel"]
    items = list(public_events(j, rid))
    kinds = {d["kind"] for _, d in items}
    assert kinds <= {"run_started", "message", "tool_call", "tool_result", "run_ended"}
    seqs = [s for s, _ in items]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    hidden = {s.seq for s in j.read(rid) if s.kind in ("mole_assigned", "llm_call")}
    assert hidden and not hidden & set(seqs)
    assert list(public_events(j, rid, seqs[10])) == items[11:]
    assert "root_seed" not in items[0][1] and "config" not in items[0][1]


def _printed(journal: Path, run: str) -> Iterator[tuple[str, str]]:
    runner = CliRunner()
    commands = [
        ["runs"],
        ["runs", "--all", "--json"],
        ["show", run],
        ["show", run, "--json"],
        *[["state", run, "--at", str(k)] for k in (0, 3, 12, 23, 24)],
        *[["state", run, "--at", str(k), "--json"] for k in (0, 12, 24)],
        ["detect", run, "--json"],
        ["detect", run, "--method", "replay", "--reveal"],
        ["detect", run, "--method", "causal", "--k-max", "4", "--json"],
    ]
    for args in commands:
        res = runner.invoke(cli.app, ["--journal", str(journal), *args])
        assert res.exit_code == 0, (args, res.output)
        yield " ".join(args), res.output


def test_no_secret_string_in_any_non_reveal_output(tmp_path: Path) -> None:
    """For every strategy (mole rotating over the crew), no strategy name and no fragment of
    the mole's instructions appears in the public view, public events or any byte printed by
    runs/show/state/detect without --reveal (replay with it: it reads the recorded seeds, never
    the secret event); `car show --reveal` does show them (the check can fail)."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        runs = []
        for i, strategy in enumerate(Strategy):
            mole = AGENTS[(i * 5) % len(AGENTS)]
            rid = record_heist(j, SimPolicy(), seed=100 + i, mole=mole, strategy=strategy.value)
            runs.append(rid.run_id)
        secret_events = [
            s.event for r in runs for s in j.read(r) if isinstance(s.event, ev.MoleAssigned)
        ]
        texts = {e.instructions for e in secret_events}  # type: ignore[union-attr]
        blobs = [json.dumps(msgspec.to_builtins(public_view(j, r))) for r in runs]
        blobs += [json.dumps(list(public_events(j, r))) for r in runs]
    for r in runs:
        blobs += [out for _, out in _printed(path, r)]
    for blob in blobs:
        for secret in [*SECRETS, *texts]:
            assert secret not in blob
        assert "root_seed" not in blob and "world_seed" not in blob
    revealed = CliRunner().invoke(cli.app, ["--journal", str(path), "show", runs[0], "--reveal"])
    assert "TIMING_ERRORS" in revealed.output


def test_a_view_read_while_the_run_ends_is_one_consistent_cut(tmp_path: Path) -> None:
    """A view taken while the writer appends shows a status and the events of one moment: a run
    it calls completed shows every step's message. The writer pauses after step 2 and finishes
    exactly when the reader asks for the status (a scheduling hook: the worst interleaving,
    made deterministic; the journal, the writer thread and the heist are real)."""
    import threading

    path = tmp_path / "j.db"
    paused, release = threading.Event(), threading.Event()
    run_ids: list[str] = []

    def on_step(k: int, agent: str, events: list[ev.Event]) -> None:
        if k == 2:
            paused.set()
            release.wait(30)

    def write() -> None:
        with Journal(path) as w:
            record_heist(
                w,
                SimPolicy(),
                seed=5,
                rounds=1,
                group_ms=0,
                on_step=on_step,
                on_created=run_ids.append,
            )

    writer = threading.Thread(target=write)
    Journal(path).close()  # the schema exists before either side opens it
    writer.start()
    assert paused.wait(30)

    class FinishingAtStatus(Journal):
        def status(self, run_id: str) -> str:
            release.set()
            writer.join(30)
            return super().status(run_id)

    with FinishingAtStatus(path, readonly=True) as r:
        view = public_view(r, run_ids[0])
    writer.join(30)
    assert view.status == "completed"
    assert view.steps == len(AGENTS)
    assert [m.agent for m in view.messages] == list(AGENTS)
