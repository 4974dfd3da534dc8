"""`car validate` and SCM model files against hostile input: files that are no files, files
too large or not text, YAML that expands, keys given twice, numbers with no float, names that
carry terminal control or markup, models too large to check, and option values past any use.

Every bad input ends in one `error:` line and a non-zero exit (2 for a bad option value), at
once and without a traceback; nothing a model file holds reaches the terminal raw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.attribution.base import ForwardRequest
from engine.attribution.scm import MAX_FILE_BYTES, load_scm
from engine.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def car(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`car ARGS` in a subprocess, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


def one_error_line(res: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The single `error:` line of a refused command (asserting there is exactly one)."""
    assert res.returncode == code, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), lines[:5]
    return lines[0]


def model(steps: str, bad: str, factual: str, name: str = "m", extra: str = "") -> str:
    return f"name: {name}\n{extra}steps:\n{steps}bad: {bad}\nfactual: {factual}\n"


ONE_STEP = model("  - name: a\n    p: 0.5\n", "a", "[1]")


# --- files that are no model files --------------------------------------------------------


def test_a_device_a_fifo_and_a_directory_are_refused_at_once(tmp_path: Path) -> None:
    """/dev/zero was read until memory ran out (the process killed, exit 137) and a FIFO
    waited for a writer for ever; both, and a directory, are refused before any read."""
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    for path, message in (
        ("/dev/zero", "not a regular file"),
        (str(fifo), "not a regular file"),
        (str(folder), "Is a directory"),
    ):
        line = one_error_line(car("validate", "--no-builtin", path, timeout=30))
        assert message in line and "cannot read SCM file" in line, line


def test_a_file_larger_than_the_limit_is_refused_unread(tmp_path: Path) -> None:
    """A model file past MAX_FILE_BYTES is refused by its size (a 50 MB one took 19 s to be
    parsed and refused as 'got str')."""
    big = tmp_path / "big.yaml"
    big.write_text(ONE_STEP + "#" * MAX_FILE_BYTES + "\n")
    line = one_error_line(car("validate", "--no-builtin", str(big)))
    assert f"the limit is {MAX_FILE_BYTES:,}" in line, line


def test_a_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    """Latin-1 bytes raised UnicodeDecodeError out of the command (a traceback)."""
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(ONE_STEP.replace("name: m", "name: caf\xe9").encode("latin-1"))
    line = one_error_line(car("validate", "--no-builtin", str(latin)))
    assert "is not UTF-8 text (byte 9)" in line, line


# --- YAML that is not what it seems ---------------------------------------------------------

BOMB_LEVELS = "bcdefghi"


def billion_laughs() -> str:
    """A 400-byte model whose first step is a list of 9^9 strings through YAML aliases."""
    items = ['&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    prev = "a"
    for level in BOMB_LEVELS:
        items.append(f"&{level} [" + ",".join([f"*{prev}"] * 9) + "]")
        prev = level
    return "name: lol\nsteps:\n  - [" + ", ".join(items) + "]\nbad: a\nfactual: [1]\n"


def test_yaml_aliases_that_expand_to_billions_are_shown_short(tmp_path: Path) -> None:
    """The message quoting the bad value wrote its whole expansion (MemoryError after 30 s,
    or the machine's memory); it now quotes a bounded head of it."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    line = one_error_line(car("validate", "--no-builtin", str(bomb), timeout=30))
    assert "expected a mapping with name and p" in line and "..." in line, line
    assert len(line) < 600, len(line)


def test_a_list_that_holds_itself_is_shown_short(tmp_path: Path) -> None:
    f = tmp_path / "loop.yaml"
    f.write_text("name: loop\nsteps: &s [*s]\nbad: a\nfactual: [1]\n")
    line = one_error_line(car("validate", "--no-builtin", str(f)))
    assert "expected a mapping with name and p" in line and len(line) < 300, line


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (ONE_STEP + "bad: not a\n", "'bad'"),
        (model("  - name: a\n    p: 0.5\n    p: 0.9\n", "a", "[1]"), "'p'"),
        (ONE_STEP.replace("name: m\n", "name: m\nname: n\n"), "'name'"),
    ],
    ids=["bad twice", "p twice", "name twice"],
)
def test_a_key_given_twice_is_refused(tmp_path: Path, text: str, key: str) -> None:
    """YAML's loader kept the last of two equal keys silently: `bad:` written twice validated
    a model other than the one the author read."""
    f = tmp_path / "twice.yaml"
    f.write_text(text)
    line = one_error_line(car("validate", "--no-builtin", str(f)))
    assert f"found duplicate key {key}" in line, line


def test_merge_keys_may_still_be_overridden() -> None:
    """`<<: *base` then the key again is YAML's way of overriding: not a duplicate."""
    scm = load_scm(
        "name: merged\nsteps:\n  - &base {name: a, p: 0.2}\n  - {<<: *base, name: b}\n"
        "bad: b\nfactual: [1, 1]\n"
    )
    assert [s.name for s in scm.steps] == ["a", "b"]
    assert scm.steps[1].p.constant == pytest.approx(0.2)


# --- values and names -----------------------------------------------------------------------


def test_an_integer_with_no_float_is_a_probability_out_of_range(tmp_path: Path) -> None:
    """`p: 1000...0` (401 digits) raised OverflowError from math.isfinite (a traceback)."""
    f = tmp_path / "big_int.yaml"
    f.write_text(model("  - name: a\n    p: 1" + "0" * 400 + "\n", "a", "[1]"))
    line = one_error_line(car("validate", "--no-builtin", str(f)))
    assert "field 'p': expected a probability in [0, 1], got 1000" in line, line
    assert len(line) < 300, line


def test_digits_of_other_scripts_are_not_numbers() -> None:
    """The tokenizer read Arabic-Indic digits as a number (p 0.5 written as '٠.٥')."""
    with pytest.raises(ConfigError, match="unexpected character '\u0660' at column 1"):
        load_scm(model('  - name: a\n    p: "\u0660.\u0665"\n', "a", "[1]"))


HOSTILE_TEXT = "a\x1b]0;PWNED\x07\x1b[2J\x1b[31m [blink]x [/]"


def test_description_and_agent_names_are_printed_as_text(tmp_path: Path) -> None:
    """A description with escape sequences went to the terminal raw, and an agent named `[/]`
    was read as rich markup (MarkupError: a traceback after every estimate had run)."""
    f = tmp_path / "shown.yaml"
    f.write_text(
        model(
            "  - name: a\n    p: 0.5\n    agent: '[/]'\n"
            "  - name: b\n    p: 0.5\n    agent: '[blink]b'\n",
            "a and b",
            "[1, 1]",
            extra=f"description: {json.dumps(HOSTILE_TEXT)}\n",
        )
    )
    res = car("validate", "--no-builtin", str(f), "--players", "agents", "--seed", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    for raw in ("\x1b", "\x07"):
        assert raw not in res.stdout and raw not in res.stderr
    assert "\\x1b]0;PWNED\\x07" in res.stdout
    assert " [/] " in res.stdout and " [blink]b " in res.stdout and "[blink]x [/]" in res.stdout


@pytest.mark.parametrize("agent", ["\x1b[2Jx", "a\nb", "x\u202e"], ids=["ESC", "newline", "bidi"])
def test_an_agent_name_with_control_characters_is_refused(tmp_path: Path, agent: str) -> None:
    f = tmp_path / "agent.yaml"
    f.write_text(model(f"  - name: a\n    p: 0.5\n    agent: {json.dumps(agent)}\n", "a", "[1]"))
    line = one_error_line(car("validate", "--no-builtin", str(f)))
    assert "field 'agent': expected an agent name" in line, line
    assert "\x1b" not in line and "\u202e" not in line


def test_a_file_name_with_escape_sequences_is_shown_escaped(tmp_path: Path) -> None:
    """The file name prefixed every message raw: a name holding ESC [2J cleared the screen."""
    f = tmp_path / "e\x1b[2Jvil.yaml"
    f.write_text("name: [\n")
    line = one_error_line(car("validate", "--no-builtin", str(f)))
    assert "e\\x1b[2Jvil.yaml: YAML syntax error" in line, line
    assert "\x1b" not in line


def test_two_models_of_one_name_are_refused(tmp_path: Path) -> None:
    """A user's file named like a built-in (or one file given twice) gave two reports of one
    name, which --json readers and the exit message cannot tell apart."""
    f = tmp_path / "rp.yaml"
    f.write_text(ONE_STEP.replace("name: m", "name: refund_pivot"))
    line = one_error_line(car("validate", str(f)))
    assert "two models are named 'refund_pivot'" in line and "builtin:refund_pivot.yaml" in line
    line = one_error_line(car("validate", "--no-builtin", str(f), str(f)))
    assert "two models are named 'refund_pivot'" in line, line


# --- models too large to check --------------------------------------------------------------


def steps_model(n: int) -> str:
    steps = "".join(f"  - name: s{j}\n    p: 0.5\n" for j in range(n))
    return model(steps, f"s{n - 1}", "[" + ", ".join(["1"] * n) + "]", name=f"n{n}")


def test_a_model_of_more_than_63_steps_runs_forward() -> None:
    """run_batch packed each keep set into an int64 bitmask: 64 steps or more raised
    OverflowError. The forward runs of a 70-step model now agree with its rule: keeping every
    step replays the factual run (bad), and keeping steps 0..68 re-decides only the last,
    which is bad with probability 1/2."""
    scm = load_scm(steps_model(70))
    seeds = range(400)
    assert all(scm.run_batch([ForwardRequest(frozenset(range(70)), s) for s in seeds]))
    half = scm.run_batch([ForwardRequest(frozenset(range(69)), s) for s in seeds])
    assert 150 < sum(half) < 250, sum(half)
    assert np.mean(scm.run_batch([ForwardRequest(frozenset({69}), s) for s in seeds])) == 1.0


def test_validate_refuses_a_model_it_cannot_check_before_any_run(tmp_path: Path) -> None:
    """A 300-step model crashed in the first forward run (a traceback); it is now refused for
    what it is, before any run: exact ground truth stops at 20 steps."""
    f = tmp_path / "n300.yaml"
    f.write_text(steps_model(300))
    line = one_error_line(car("validate", "--no-builtin", str(f)))
    assert "has 300 steps; exact ground truth" in line and "above 20 steps" in line, line


# --- option values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seed", "-1"], "'--seed'"),
        (["--seed", str(2**63)], "'--seed'"),
        (["--runs", str(2**63 - 1)], "'--runs'"),
        (["--budget", str(10**21)], "'--budget'"),
        (["--alpha", "1e-300"], "'--alpha': family-wise alpha 1e-300 split over 30 intervals"),
    ],
    ids=["seed -1", "seed 2**63", "runs 2**63-1", "budget 10**21", "alpha 1e-300"],
)
def test_option_values_past_any_use_are_usage_errors(argv: list[str], message: str) -> None:
    """--seed -1 and --runs 2**63-1 ended in tracebacks, --budget 10**21 ran until memory or
    patience ran out, and --alpha 1e-300 was refused as a 'confidence ... got 1.0' the user
    never gave (exit 1)."""
    line = one_error_line(car("validate", *argv), code=2)
    assert message in line, line
