"""No secret reaches the detector: not the mole event, not the recorded LLM requests, not
anything derived from them — and nothing in engine/detect knows agent names or roles."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import free_port

from engine import events as ev
from engine.detect import analyze
from engine.detect.analysis import inputs
from engine.heist.config import load_agents_config
from engine.heist.mole import Strategy, instructions
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal
from engine.public import public_view

DETECT = Path(__file__).resolve().parent.parent / "engine" / "detect"
AGENTS = load_agents_config().names
SECRETS = [s.value for s in Strategy] + [instructions(s) for s in Strategy] + ["SECRET"]


def test_detector_code_never_touches_secret_fields() -> None:
    """Only evaluate.py (the scorer, after the methods answered) may name the secret event; no
    detector module reads a mole strategy, a secret context or a recorded request."""
    forbidden = re.compile(
        r"MoleAssigned|mole_assigned|\.mole_strategy\b(?!\s*=)|\.secret\b|"
        r"\.strategy\b|\.request\b|\.instructions\b"
    )
    for module in DETECT.glob("*.py"):
        code = "\n".join(
            line for line in module.read_text().splitlines() if not line.strip().startswith("#")
        )
        hits = forbidden.findall(code)
        if module.name == "evaluate.py":
            assert set(hits) <= {"MoleAssigned", ".strategy"}, hits
        else:
            assert not hits, (module.name, hits)


def test_detector_code_knows_no_agent_names_or_roles() -> None:
    """No default-crew name or role word appears in engine/detect (code, data or docs)."""
    words = set(AGENTS) | {"mastermind", "getaway", "safecracker"}
    for f in DETECT.iterdir():
        if f.suffix not in (".py", ".yaml"):
            continue
        text = f.read_text().lower()
        for w in words:
            assert not re.search(rf"\b{w}\b", text), (f.name, w)


@pytest.fixture(scope="module")
def rotated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Journal, list[str]]]:
    """Five games, one per strategy, the mole rotating over the crew."""
    with Journal(tmp_path_factory.mktemp("sec") / "j.db") as j:
        runs = [
            record_heist(
                j, SimPolicy(), seed=300 + i, mole=AGENTS[(2 * i + 1) % 6], strategy=s.value
            ).run_id
            for i, s in enumerate(Strategy)
        ]
        yield j, runs


def _decoded_kinds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    full, slim = ev.decode, ev.decode_for_fold

    def spy_full(payload: bytes, version: int = ev.SCHEMA_VERSION) -> ev.AnyEvent:
        e = full(payload, version)
        seen.append(ev.kind_of(e))
        return e

    def spy_slim(payload: bytes, version: int = ev.SCHEMA_VERSION) -> ev.Event:
        e = slim(payload, version)
        seen.append("slim:" + ev.kind_of(e))
        return e

    monkeypatch.setattr(ev, "decode", spy_full)
    monkeypatch.setattr(ev, "decode_for_fold", spy_slim)
    return seen


@pytest.mark.parametrize("method", ["rules", "llm", "replay"])
def test_methods_never_decode_the_secret_or_a_request(
    rotated: tuple[Journal, list[str]], method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rules, llm and replay decode no mole event and no full LLM call (replay reads the
    recorded seeds through the slim fold decoder, which skips requests)."""
    j, runs = rotated
    url = f"http://127.0.0.1:{free_port()}/v1"
    seen = _decoded_kinds(monkeypatch)
    for run in runs:
        reveal = method == "replay"  # it reads the recorded seeds: refused without it
        analyze(j, run, method=method, base_url=url, timeout=1.0, journal_llm=False, reveal=reveal)
    assert seen
    assert "mole_assigned" not in seen and "slim:mole_assigned" not in seen
    assert "llm_call" not in seen


@pytest.mark.parametrize("method", ["rules", "llm", "causal", "replay"])
def test_no_secret_string_in_any_detector_output(
    rotated: tuple[Journal, list[str]], method: str
) -> None:
    """For every strategy, the output of every method holds no strategy name and no fragment
    of the mole's instructions."""
    j, runs = rotated
    url = f"http://127.0.0.1:{free_port()}/v1"
    for run in runs:
        reveal = method == "replay"
        out = analyze(j, run, method=method, base_url=url, timeout=1.0, k_max=4, reveal=reveal)
        blob = json.dumps(out)
        for s in SECRETS:
            assert s not in blob, (method, s)


def test_detector_inputs_differ_only_where_public_behaviour_does(tmp_path: Path) -> None:
    """Same seed, each agent the mole in turn: the detector's inputs (agents, messages, tool
    usage) agree on every step before the earliest mole's first turn, and the agent list is
    always the config order."""
    with Journal(tmp_path / "j.db") as j:
        runs = {a: record_heist(j, SimPolicy(), seed=21, mole=a).run_id for a in AGENTS}
        got = {a: inputs(public_view(j, r)) for a, r in runs.items()}
    for i, a in enumerate(AGENTS):
        for b in AGENTS[i + 1 :]:
            agents_a, msgs_a, tools_a = got[a]
            agents_b, msgs_b, tools_b = got[b]
            assert agents_a == agents_b == list(AGENTS)
            assert msgs_a[:i] == msgs_b[:i]  # one message per step, steps 0..i-1
            n_tools = sum(1 for m in msgs_a[:i] for _ in re.finditer(r"\[TOOL:", m.text))
            assert tools_a[:n_tools] == tools_b[:n_tools]


def test_a_heist_nobody_seeded_draws_a_63_bit_root_seed(tmp_path: Path) -> None:
    """`car heist` and the server's quick start without a seed: the root seed has more than 32
    bits (each below 2**32 with odds 2**-31). The world a heist's tool results show is drawn
    from its root seed, and so is the mole: with a 32-bit seed, a search of every seed for the
    world shown (minutes on a laptop) named the mole."""
    from journal_helpers import car
    from server_helpers import car_serve, start, wait_status

    journal = tmp_path / "j.db"
    for _ in range(2):
        p = car(journal, "heist", "--rounds", "1", "--json")
        assert p.returncode == 0, p.stderr
    with car_serve(journal) as srv, srv.client() as c:
        wait_status(c, start(c, step_delay=0, rounds=1), {"completed"})
    with Journal(journal) as j:
        seeds = [j.events(r.run_id)[0] for r in j.runs()]
    assert len(seeds) == 3
    for e in seeds:
        assert isinstance(e, ev.RunStarted) and 2**32 <= e.root_seed < 2**63


def test_replay_reads_the_recorded_seeds_only_once_the_run_is_accused(tmp_path: Path) -> None:
    """The replay detector re-decides each step with the seed it was recorded with: on the sim
    policy every honest agent reproduces its steps exactly and the mole does not, so before the
    accusation it named the mole with confidence 0.99 (CLI and API alike). Now it is refused in
    one line (CLI exit 1, API 403) until the run is accused; `--reveal` runs it on the CLI; after
    `accuse` both run it."""
    from journal_helpers import car
    from server_helpers import car_serve

    path = tmp_path / "j.db"
    with Journal(path) as j:
        rid = record_heist(j, SimPolicy(), seed=1, rounds=2, mole="intel").run_id
    refused = car(path, "detect", rid, "-m", "replay")
    assert refused.returncode == 1 and refused.stdout == ""
    (line,) = refused.stderr.strip().splitlines()
    assert "as secret as the mole" in line and "--reveal" in line
    assert "intel" not in line
    revealed = car(path, "detect", rid, "-m", "replay", "--reveal", "--json")
    assert revealed.returncode == 0, revealed.stderr
    assert json.loads(revealed.stdout)["suggested_mole"] == "intel"  # what it would have told
    with car_serve(path) as srv, srv.client() as c:
        body = {"session_id": rid, "method": "replay"}
        r = c.post("/api/ai-detect/suggest", json=body)
        assert r.status_code == 403, r.text
        assert "intel" not in r.text and "--reveal" not in r.text
        assert c.post(f"/api/sessions/{rid}/accuse", json={"suspect": "planner"}).status_code == 200
        r = c.post("/api/ai-detect/suggest", json=body)
        assert r.status_code == 200, r.text
    after = car(path, "detect", rid, "-m", "replay", "--json")
    assert after.returncode == 0, after.stderr
