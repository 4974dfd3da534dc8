"""Files a command writes for the user (`-o PATH`): whole or not at all.

A regular file is written next to its target and renamed over it, so an interrupted write
never leaves half a file in place and a failed one leaves no temp file. A target that exists
and is no regular file - a device such as /dev/null or /dev/stdout, a named pipe - is written
to directly: renaming over it would replace the device with a file (run as root, `-o
/dev/null` did exactly that)."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def write_whole(path: Path, text: str) -> None:
    """Write `text` to `path` (see the module docstring); OSError with the reason when the
    target cannot be written (a directory, a missing folder, no permission)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except NotADirectoryError as e:
        raise OSError(e.errno, "a part of the path is not a directory") from e
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(21, "it is a directory (expected a file name)")
    if mode is not None and not stat.S_ISREG(mode):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    if not path.parent.is_dir():
        raise FileNotFoundError(2, f"no directory {str(path.parent)!r}")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # never made (a name too long, say)
            tmp.unlink(missing_ok=True)
        raise
