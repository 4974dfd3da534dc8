"""Names that differ only by what shows as nothing or as a blank (a zero-width space or
joiner, a byte-order mark, a no-break space, a Hangul filler, a space at either end) are told
apart wherever car shows a name: `shown_name` escapes those characters and a backslash too,
so that no escape can be forged by a name that spells one out. An imported trace,
a recorded program's X-Car-Agent header or a hand-made journal names its agents as it likes."""

from __future__ import annotations

import json
import random
import re
import unicodedata
from pathlib import Path

import pytest
from journal_helpers import car
from otel_helpers import imported_chat_trace

from engine.terminal import in_markup, shown_name

# each looks like another one, or like "alice", on a terminal
LOOK_ALIKE = (
    "alice",
    "ali\u200bce",  # zero-width space
    "alice\u200d",  # zero-width joiner
    "\ufeffalice",  # byte-order mark
    "alice ",  # a space at the end
    "ali\\u200bce",  # spells out the escape of the second
    "al ice",
    "al\u00a0ice",  # no-break space
    "al\u3164ice",  # Hangul filler
    "alic\u0435",  # Cyrillic e: another letter, shown as itself
)

_ESCAPE = re.compile(r"\\(x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})")


def _unescaped(shown: str) -> str:
    """The name `shown_name` showed: its escapes read back."""

    def one(m: re.Match[str]) -> str:
        return chr(int(m.group(1)[1:], 16))

    return _ESCAPE.sub(one, shown)


def _seen(ch: str) -> bool:
    """Whether `ch` shows as a mark of its own (a letter, digit, symbol, U+0020 inside)."""
    return ch == " " or not unicodedata.category(ch).startswith(("C", "Z"))


def _rendered(markup: str) -> str:
    """What rich prints of `markup`."""
    from rich.console import Console

    console = Console(width=200, force_terminal=False, highlight=False)
    with console.capture() as cap:
        console.print(markup)
    return cap.get().rstrip("\n")


ALPHABET = "ab \\xu0123456789\u200b\u200d\ufeff\u00a0\u3164\u2800\ufe0f\x1b\u202e\u0301é\U000e0041"


def test_shown_names_read_back_and_show_nothing_unseen() -> None:
    """Over 5,000 random names from an alphabet of look-alike characters, escape characters
    and the digits of escapes: every shown name reads back to its name (so two names are
    never shown alike) and holds only characters that show, with no space at either end."""
    rng = random.Random(20261205)
    for _ in range(5000):
        name = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8)))
        shown = shown_name(name)
        assert _unescaped(shown) == name, (name, shown)
        # every backslash shown starts an escape: none stands before a `[` of rich markup
        assert all(
            shown[i + 1 : i + 2] in ("x", "u", "U") for i, c in enumerate(shown) if c == "\\"
        )
        assert all(_seen(ch) for ch in shown), (name, shown)
        assert not shown.startswith(" ") and not shown.endswith(" "), (name, shown)
        # the blank letters of other categories are escaped too
        assert not any(ch in shown for ch in "\u3164\u2800"), (name, shown)


def test_look_alike_names_are_shown_apart_and_other_scripts_as_they_are() -> None:
    shown = [shown_name(n) for n in LOOK_ALIKE]
    assert len(set(shown)) == len(LOOK_ALIKE)
    assert shown[0] == "alice" and shown[1] == "ali\\u200bce" and shown[5] == "ali\\x5cu200bce"
    assert shown[4] == "alice\\x20" and shown[7] == "al\\xa0ice"
    assert shown[-1] == "alic\u0435"  # a name may be written in any script
    assert shown_name("Zoë 名前") == "Zoë 名前"
    # in rich markup too: escaped, and markup in a name is text
    assert in_markup("[bold]ali\u200bce", name=True) == "\\[bold]ali\\u200bce"
    for name in ("a\\", "[bold]x\\", "a\\\\"):
        before_a_tag = _rendered(f"[bold]{in_markup(name, name=True)}[/]")
        assert before_a_tag == _rendered(in_markup(name, name=True)) == shown_name(name)


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return imported_chat_trace(tmp_path_factory.mktemp("look-alike"), LOOK_ALIKE)


def test_show_tells_every_speaker_apart(imported: tuple[Path, str]) -> None:
    """`car show` of an imported trace whose agents look alike: each message line names its
    agent as `shown_name` shows it, ten speakers for ten names."""
    journal, run = imported
    res = car(journal, "show", run)
    assert res.returncode == 0, res.stderr
    speakers = re.findall(r"^\[\d+\] (.*): note \d+", res.stdout, flags=re.M)
    assert len(speakers) == 2 * len(LOOK_ALIKE)
    assert set(speakers) == {shown_name(n) for n in LOOK_ALIKE}
    assert not any(ch in res.stdout for ch in "\u200b\u200d\ufeff\u00a0\u3164")


def test_detect_tells_every_agent_apart(imported: tuple[Path, str]) -> None:
    """`car detect`'s table and its suggested mole name each agent as `shown_name` shows it."""
    journal, run = imported
    as_json = car(journal, "detect", run, "--method", "rules", "--json")
    assert as_json.returncode == 0, as_json.stderr
    top = json.loads(as_json.stdout)["suggested_mole"]
    res = car(journal, "detect", run, "--method", "rules")
    assert res.returncode == 0, res.stderr
    assert f"suggested mole {shown_name(top)} (confidence" in res.stdout.splitlines()[0]
    rows = {line.split()[0] for line in res.stdout.splitlines()[1:] if line.strip()}
    assert {shown_name(n).split()[0] for n in LOOK_ALIKE} <= rows
    assert not any(ch in res.stdout for ch in "\u200b\u200d\ufeff\u00a0\u3164")


@pytest.mark.parametrize("reveal", [False, True], ids=["public", "reveal"])
def test_state_tells_every_agent_apart(imported: tuple[Path, str], reveal: bool) -> None:
    """`car state` (public and --reveal): the next agent, the conversation and the per-agent
    lines name each agent as `shown_name` shows it."""
    journal, run = imported
    res = car(journal, "state", run, "--at", "3", *(["--reveal"] if reveal else []))
    assert res.returncode == 0, res.stderr
    per_agent = re.findall(r"^  (\S.*): turns=", res.stdout, flags=re.M)
    # the public view lists the crew; the private contexts are those of who acted so far
    crew = LOOK_ALIKE[:3] if reveal else LOOK_ALIKE
    assert sorted(per_agent) == sorted(shown_name(n) for n in crew)
    spoken = re.findall(r"^  \[\d+\] (.*): note \d+", res.stdout, flags=re.M)
    assert spoken == [shown_name(n) for n in LOOK_ALIKE[:3]]
    assert f"next agent {shown_name(LOOK_ALIKE[3])} (round" in res.stdout
    assert not any(ch in res.stdout for ch in "\u200b\u200d\ufeff\u00a0\u3164")
