"""Bad command-line values of the counterfactual commands: one line on stderr, the right exit
status (2 for a usage error, 1 for a value the journal or model file refutes), no traceback,
and nothing added to the journal."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from journal_helpers import car

from engine import events as ev
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal


@pytest.fixture(scope="module")
def heist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Path]:
    """A journal with the seed-7 heist, and a folder of hostile input files."""
    base = tmp_path_factory.mktemp("bad-values")
    path = base / "j.db"
    with Journal(path) as j:
        run = record_heist(j, SimPolicy(), seed=7).run_id
    files = base / "files"
    files.mkdir()
    (files / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (files / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (files / "big.txt").write_bytes(b"x" * (2 << 20))
    (files / "deep_expr.yaml").write_text(
        "name: deep\nsteps:\n  - name: a\n    p: '" + "(" * 1000 + "0.5" + ")" * 1000 + "'\n"
        "bad: a\nfactual: [1]\n"
    )
    (files / "wide_expr.yaml").write_text(
        "name: wide\nsteps:\n  - name: a\n    p: 0.5\nbad: '" + " + ".join(["a"] * 100_000) + "'\n"
        "factual: [1]\n"
    )
    (files / "deep_yaml.yaml").write_text(
        "name: x\nsteps: " + "[" * 5000 + "]" * 5000 + "\nbad: a\nfactual: [1]\n"
    )
    (files / "deep.json").write_text('{"text": "t", "step": ' + "[" * 100_000 + "]" * 100_000 + "}")
    (files / "notes").mkdir()
    return path, run, files


DEEP_JSON = '{"text": "t", "step": ' + "[" * 10_000 + "]" * 10_000 + "}"
FORK = ["fork", "RUN", "--at", "3"]

CASES: list[tuple[str, list[str], int, str]] = [
    # do_policy values
    (
        "temperature=abc",
        [*FORK, "--do", "policy", "--value", "openai:temperature=abc"],
        2,
        "temperature must be a number",
    ),
    (
        "max_retries=x",
        [*FORK, "--do", "policy", "--value", "openai:max_retries=x"],
        2,
        "max_retries must be a whole number",
    ),
    (
        "max_tokens=1e9",
        [*FORK, "--do", "policy", "--value", "openai:max_tokens=1e9"],
        2,
        "max_tokens must be a whole number",
    ),
    (
        "max_tokens huge",
        [*FORK, "--do", "policy", "--value", "openai:max_tokens=999999999"],
        2,
        "max_tokens must lie within",
    ),
    (
        "timeout=inf",
        [*FORK, "--do", "policy", "--value", "openai:timeout=inf"],
        2,
        "timeout must lie within",
    ),
    (
        "temperature=nan",
        [*FORK, "--do", "policy", "--value", "openai:temperature=nan"],
        2,
        "temperature must lie within",
    ),
    (
        "unknown option",
        [*FORK, "--do", "policy", "--value", "openai:colour=red"],
        2,
        "unknown option 'colour'",
    ),
    ("no equals", [*FORK, "--do", "policy", "--value", "openai:model"], 2, "key=value"),
    ("drift=2", [*FORK, "--do", "policy", "--value", "sim:drift=2"], 2, "drift must lie within"),
    ("unknown policy", [*FORK, "--do", "policy", "--value", "gpt9"], 2, "unknown policy 'gpt9'"),
    # do_context values
    ("deep JSON", [*FORK, "--do", "context", "--value", DEEP_JSON], 2, "nests too deeply"),
    (
        "JSON step text",
        [*FORK, "--do", "context", "--value", '{"step": "x", "text": "t"}'],
        2,
        "'step' must be an integer",
    ),
    (
        "JSON extra key",
        [*FORK, "--do", "context", "--value", '{"text": "t", "x": 1}'],
        2,
        "unknown keys",
    ),
    ("bad JSON", [*FORK, "--do", "context", "--value", '{"text": '], 2, "not valid JSON"),
    # value files
    ("binary file", [*FORK, "--do", "action", "--value-file", "FILES/binary.bin"], 2, "binary"),
    ("latin-1 file", [*FORK, "--do", "action", "--value-file", "FILES/latin1.txt"], 2, "not UTF-8"),
    ("huge file", [*FORK, "--do", "action", "--value-file", "FILES/big.txt"], 2, "the limit is"),
    (
        "directory",
        [*FORK, "--do", "action", "--value-file", "FILES/notes"],
        2,
        "not a regular file",
    ),
    ("missing file", [*FORK, "--do", "action", "--value-file", "FILES/nope.txt"], 2, "cannot read"),
    (
        "value and file",
        [*FORK, "--do", "action", "--value", "x", "--value-file", "FILES/latin1.txt"],
        2,
        "not both",
    ),
    # timeouts and counts
    ("--timeout inf", [*FORK, "--do", "resample", "--timeout", "inf"], 2, "--timeout"),
    ("--timeout nan", [*FORK, "--do", "resample", "--timeout", "nan"], 2, "--timeout"),
    ("--timeout -1", [*FORK, "--do", "resample", "--timeout", "-1"], 2, "--timeout"),
    ("fork -n 0", [*FORK, "--do", "resample", "-n", "0"], 2, "-n"),
    ("fork -c 0", [*FORK, "--do", "resample", "-c", "0"], 2, "-c"),
    ("bad --do", [*FORK, "--do", "teleport"], 2, "'teleport' is not one of"),
    ("step out of range", ["fork", "RUN", "--at", "99", "--do", "resample"], 1, "out of range"),
    (
        "--base-url on sim",
        [*FORK, "--do", "resample", "--base-url", "http://x/v1"],
        1,
        "--base-url does not apply to policy sim",
    ),
    ("unknown run", ["fork", "nosuchrun", "--at", "3", "--do", "resample"], 1, "unknown run"),
    # attribute
    ("bad --method", ["attribute", "RUN", "--method", "magic"], 2, "'magic' is not one of"),
    (
        "bad --players",
        ["attribute", "RUN", "--method", "shapley", "--players", "teams"],
        2,
        "'teams' is not one of",
    ),
    ("players without shapley", ["attribute", "RUN", "--players", "agents"], 2, "shapley only"),
    ("--top -3", ["attribute", "RUN", "--top", "-3"], 2, "--top"),
    ("old -k", ["attribute", "RUN", "-k", "8"], 2, "-k is the step flag"),
    ("--runs 0", ["attribute", "RUN", "--runs", "0"], 2, "--runs"),
    ("--runs 1", ["attribute", "RUN", "--runs", "1"], 2, "--runs"),
    ("validate --runs 1", ["validate", "--runs", "1"], 2, "--runs"),
    ("--half-width 0.7", ["attribute", "RUN", "--half-width", "0.7"], 2, "--half-width"),
    ("--half-width nan", ["attribute", "RUN", "--half-width", "nan"], 2, "--half-width"),
    (
        "budget too small",
        ["attribute", "RUN", "--method", "shapley", "--budget", "5"],
        1,
        "cannot cover one antithetic pair",
    ),
    # validate and model files
    ("expression 1000 deep", ["validate", "--no-builtin", "FILES/deep_expr.yaml"], 1, "expression"),
    (
        "sum of 100000 terms",
        ["validate", "--no-builtin", "FILES/wide_expr.yaml"],
        1,
        "longer than 512 tokens",
    ),
    ("YAML 5000 deep", ["validate", "--no-builtin", "FILES/deep_yaml.yaml"], 1, "nests too deeply"),
    ("--alpha 0", ["validate", "--alpha", "0"], 2, "--alpha"),
    ("--alpha nan", ["validate", "--alpha", "nan"], 2, "--alpha"),
    ("validate -k", ["validate", "-k", "5"], 2, "-k is the step flag"),
    ("validate players", ["validate", "--players", "x"], 2, "'x' is not one of"),
    # fidelity and runs
    ("fidelity --timeout -1", ["fidelity", "RUN", "--timeout", "-1"], 2, "--timeout"),
    ("fidelity --drift 2", ["fidelity", "RUN", "--drift", "2"], 2, "--drift"),
    (
        "fidelity --base-url on sim",
        ["fidelity", "RUN", "--base-url", "http://x/v1"],
        1,
        "does not apply to policy sim",
    ),
    ("runs -n -1", ["runs", "-n", "-1"], 2, "-n"),
    # a value the journal refuses (bytes that are no UTF-8 arrive as lone surrogates): each
    # branch was forked, then left abandoned without its opening event
    (
        "fork --value not UTF-8",
        [*FORK, "--do", "action", "--value", "bad \udcff value"],
        1,
        "do_action's value cannot be journaled",
    ),
    # heist flags: refused before the run exists (a seed RunStarted cannot hold left an
    # empty run behind, abandoned; a misspelt agent or strategy exited 1 after loading)
    ("heist --seed 10**26", ["heist", "--seed", str(10**26)], 2, "'--seed'"),
    ("heist --seed -1", ["heist", "--seed", "-1"], 2, "'--seed'"),
    ("heist --mole nobody", ["heist", "--mole", "nobody"], 2, "unknown agent 'nobody'"),
    ("heist --strategy NOPE", ["heist", "--strategy", "NOPE"], 2, "unknown mole strategy"),
    (
        "heist --timeout nan",
        ["heist", "--policy", "openai", "--base-url", "http://127.0.0.1:9/v1", "--timeout", "nan"],
        2,
        "openai timeout must be",
    ),
    (
        "heist --max-reply-bytes -5",
        ["heist", "--policy", "openai", "--max-reply-bytes", "-5"],
        2,
        "max_reply_bytes must be",
    ),
    ("detect-eval --seed -1", ["detect-eval", "-n", "1", "--seed", "-1"], 2, "'--seed'"),
    (
        "detect-eval seeds past 2**63",
        ["detect-eval", "-n", "3", "--seed", str(2**63 - 2)],
        1,
        "must lie within 0..9223372036854775807",
    ),
]


@pytest.mark.parametrize(("name", "argv", "code", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_value_is_one_line(
    heist: tuple[Path, str, Path], name: str, argv: list[str], code: int, message: str
) -> None:
    """Each bad value: exit `code`, one `error:` line naming the problem, no traceback, and
    the journal unchanged."""
    journal, run, files = heist
    args = [run if a == "RUN" else a.replace("FILES", str(files)) for a in argv]
    with Journal(journal, create=False) as j:
        before = len(j.runs())
    res = car(journal, *args)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == code, res.stderr
    assert "Traceback" not in res.stderr
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    assert message in lines[0], lines[0]
    with Journal(journal, create=False) as j:
        assert len(j.runs()) == before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_fork_do_policy_honours_base_url_and_fails_when_every_branch_fails(
    heist: tuple[Path, str, Path],
) -> None:
    """`fork --do policy --value openai --base-url URL` sends the swapped-in policy to URL (a
    port where nothing listens: every branch fails for real), journals URL as part of the
    intervention, and exits 1 because no branch produced an outcome."""
    journal, run, _ = heist
    url = f"http://127.0.0.1:{free_port()}/v1"
    res = car(
        journal,
        "fork",
        run,
        "--at",
        "3",
        "--do",
        "policy",
        "--value",
        "openai:max_retries=0",
        "--base-url",
        url,
        "--timeout",
        "2",
        "-n",
        "2",
        "--json",
    )
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: every branch failed (2 of 2)"), lines
    report = json.loads(res.stdout)
    assert report["value"] == {"name": "openai", "max_retries": 0, "base_url": url, "timeout": 2.0}
    with Journal(journal, create=False) as j:
        for b in report["branches"]:
            assert b["status"] == "failed"
            events = [s.event for s in j.read(b["run_id"])]
            calls = [e for e in events if isinstance(e, ev.LlmCall)]
            assert calls[-1].server == url and calls[-1].finish_reason == "error"
            assert j.status(b["run_id"]) == "failed"
