"""`car detect` on a run whose agents have names that look like rich markup (an imported
trace names its agents as it likes): the suggested mole is printed as the text it is. A name
`[/]` at the top was a MarkupError traceback; `[bold]b` was printed as "b"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from journal_helpers import car
from otel_helpers import imported_chat_trace

NAMES = ("[/]", "[bold]b", "[red]c[/red]")


@pytest.fixture
def imported(tmp_path: Path) -> tuple[Path, str]:
    return imported_chat_trace(tmp_path, NAMES)


def test_the_suggested_mole_is_printed_as_text(imported: tuple[Path, str]) -> None:
    journal, run = imported
    as_json = car(journal, "detect", run, "--method", "rules", "--json")
    assert as_json.returncode == 0, as_json.stderr
    top = json.loads(as_json.stdout)["suggested_mole"]
    assert top in NAMES
    res = car(journal, "detect", run, "--method", "rules")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    first = res.stdout.splitlines()[0]
    assert f"suggested mole {top} (confidence" in first, first
