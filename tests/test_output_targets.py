"""`-o PATH` of `car export` and `car anchor` writes whole files, and writes *into* a target
that is no regular file (a device such as /dev/null, a named pipe) instead of renaming a temp
file over it: run as root, `-o /dev/null` replaced the device with a regular file. A named
pipe stands in for the device here, since replacing the real /dev/null would break the
machine if the check failed."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest
from journal_helpers import car

from engine.output import write_whole


def _read_fifo(path: Path, into: list[bytes]) -> threading.Thread:
    def read() -> None:
        with open(path, "rb") as f:
            into.append(f.read())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("out") / "j.db"
    res = car(path, "heist", "--seed", "3", "--rounds", "1", "-q", "--json")
    assert res.returncode == 0, res.stderr
    return path, json.loads(res.stdout)["run_id"]


@pytest.mark.parametrize("command", ["export", "anchor"])
def test_a_named_pipe_target_is_written_into_and_stays_a_pipe(
    journal: tuple[Path, str], tmp_path: Path, command: str
) -> None:
    """The document arrives through the pipe, whole, and the pipe is still a pipe after."""
    path, run = journal
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = _read_fifo(fifo, got)
    if command == "export":
        res = car(path, "export", run, "-o", str(fifo))
    else:
        key = tmp_path / "key"
        key.write_bytes(os.urandom(32))
        res = car(path, "anchor", "--key-file", str(key), "-o", str(fifo))
    reader.join(30)
    assert res.returncode == 0, res.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert json.loads(got[0])  # a whole JSON document
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_regular_file_is_replaced_whole(tmp_path: Path) -> None:
    """An existing regular file is replaced by the new text (via a temp file, none left)."""
    target = tmp_path / "out.json"
    target.write_text("old")
    write_whole(target, "new\n")
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda d: d, "is a directory"),
        (lambda d: d / "missing" / "x.json", "no directory"),
        (lambda d: d / "file" / "x.json", "not a directory"),
    ],
    ids=["directory", "missing folder", "file as folder"],
)
def test_an_unwritable_target_is_an_os_error_and_leaves_nothing(
    tmp_path: Path, make: object, match: str
) -> None:
    """A directory, a missing folder, a file used as a folder: OSError naming why; no temp
    file anywhere."""
    (tmp_path / "file").write_text("x")
    target = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(OSError, match=match):
        write_whole(target, "text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
