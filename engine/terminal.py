"""Text from a model, a tool or a journal on its way to a terminal: shown, never obeyed.

A reply may carry ANSI escape sequences (clear the screen, retitle the window, fake a prompt),
a bell, or C1 controls that some terminals read as escapes. `printable` replaces every such
character with a visible escape (`\\x1b`, `\\x07`, `\\x9b`), so the user sees that it was there
and the terminal never acts on it. Rich markup is a separate matter: print such text with
`markup=False` or inside a `rich.text.Text`."""

from __future__ import annotations

import re

# C0 controls, DEL and C1 controls; tab and newline are decided by the caller
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_CONTROL_ALL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    ch = m.group()
    return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """`text` with every control character (ESC, CSI, BEL, C0, C1, bidi overrides) replaced by
    a visible escape. Tabs and newlines are escaped too unless `keep_newlines`."""
    pattern = _CONTROL if keep_newlines else _CONTROL_ALL
    return pattern.sub(_escape, text)


def in_markup(value: object) -> str:
    """A value read from a journal (an agent's name, a policy) inside a line printed with rich
    markup: terminal control escaped as by `printable`, and markup too (a name such as
    `[blink]x` is text)."""
    from rich.markup import escape

    return escape(printable(str(value)))
