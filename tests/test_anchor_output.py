"""`car anchor -o FILE` writes whole or not at all: a target it cannot write (a directory, a
file in a missing directory) is one line and exit 1, and no temp file is left anywhere —
neither next to the target nor in the parent of a directory given as the target."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from journal_helpers import car

from engine import events as ev
from engine.anchor import AnchorError, read_anchor, write_anchor
from engine.journal import Journal

KEY = b"k" * 32


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    """A journal with one run, and a key file: (journal, key file)."""
    path, key = tmp_path / "j.db", tmp_path / "key"
    key.write_bytes(KEY)
    with Journal(path) as j:
        run = j.create_run("s")
        j.append(run, [ev.ChatMessage(step=0, agent="a", text="hi")], 0)
    return path, key


def _temp_files(*dirs: Path) -> list[Path]:
    return [p for d in dirs for p in d.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("out", r"cannot write '.*out': it is a directory"),
        ("missing/x.json", r"cannot write '.*missing/x\.json': no directory '.*missing'"),
    ],
    ids=["a directory", "a missing directory"],
)
def test_an_unwritable_target_is_one_line_and_leaves_no_temp_file(
    setup: tuple[Path, Path], tmp_path: Path, target: str, says: str
) -> None:
    """`car anchor -o` at a directory or into a missing directory: one line on stderr (exit 1,
    no traceback), and no `.NAME.tmp-PID` left in the target's directory or its parent."""
    path, key = setup
    (tmp_path / "out").mkdir()
    res = car(path, "anchor", "--key-file", str(key), "-o", str(tmp_path / target))
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"error: {says}", lines[0]), res.stderr
    assert _temp_files(tmp_path, tmp_path / "out") == []
    assert list((tmp_path / "out").iterdir()) == []


def test_a_write_the_file_system_refuses_is_an_anchor_error(tmp_path: Path) -> None:
    """A target whose temp file name is too long for the file system (the target itself is
    not): one AnchorError naming the target and the OS's reason, chained, nothing left."""
    target = tmp_path / ("a" * 250)
    with pytest.raises(AnchorError, match=r"cannot write '.*aaaa': File name too long") as e:
        write_anchor({"runs": []}, target)
    assert isinstance(e.value.__cause__, OSError)
    assert list(tmp_path.iterdir()) == []


def test_a_writable_target_gets_the_anchor(setup: tuple[Path, Path], tmp_path: Path) -> None:
    """The ordinary case still writes an anchor that authenticates, and only it."""
    path, key = setup
    out = tmp_path / "a.json"
    res = car(path, "anchor", "--key-file", str(key), "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert len(read_anchor(out, KEY)["runs"]) == 1
    assert _temp_files(tmp_path) == []


def test_dash_is_stdout_for_anchor_and_export(setup: tuple[Path, Path], tmp_path: Path) -> None:
    """`-o -` means stdout, as the usual name of it (it wrote a file named "-" in the
    working directory): the anchor and the export go to stdout, no file "-" is made."""
    path, key = setup
    with Journal(path, readonly=True) as j:
        (run,) = [r.run_id for r in j.runs()]
    anchored = car(path, "anchor", "--key-file", str(key), "-o", "-")
    assert anchored.returncode == 0, anchored.stderr
    assert '"runs"' in anchored.stdout
    exported = car(path, "export", run, "-o", "-")
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.startswith('{"resourceSpans"')
    assert not (Path(__file__).resolve().parent.parent / "-").exists()
