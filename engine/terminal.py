"""Text from a model, a tool or a journal on its way to a terminal: shown, never obeyed.

A reply may carry ANSI escape sequences (clear the screen, retitle the window, fake a prompt),
a bell, or C1 controls that some terminals read as escapes. `printable` replaces every such
character with a visible escape (`\\x1b`, `\\x07`, `\\x9b`), so the user sees that it was there
and the terminal never acts on it. Rich markup is a separate matter: print such text with
`markup=False` or inside a `rich.text.Text`.

A name (an agent's, the mole's, a suspect's) must also be told apart from every other name:
`shown_name` escapes, on top, what shows as nothing or as a plain blank (zero-width and
format characters, other spaces, fillers), spaces at either end, and a backslash itself (so
that a name cannot spell an escape out), so two different names never look alike through
them. Look-alike letters of other scripts (a
Cyrillic "а" for a Latin "a") are not escaped: a name may be written in any script."""

from __future__ import annotations

import re
import unicodedata

# C0 controls, DEL and C1 controls; tab and newline are decided by the caller
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_CONTROL_ALL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    return _code(m.group())


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """`text` with every control character (ESC, CSI, BEL, C0, C1, bidi overrides) replaced by
    a visible escape. Tabs and newlines are escaped too unless `keep_newlines`."""
    pattern = _CONTROL if keep_newlines else _CONTROL_ALL
    return pattern.sub(_escape, text)


# letters and marks that show as nothing or as a blank: Hangul fillers, the braille blank,
# the combining grapheme joiner, Khmer's inherent vowels, Mongolian variation selectors
_BLANKS = frozenset("\u115f\u1160\u3164\uffa0\u2800\u034f\u17b4\u17b5\u180b\u180c\u180d\u180f")
_UNSEEN_CATEGORIES = frozenset(("Cc", "Cf", "Zs", "Zl", "Zp"))


def _unseen(ch: str) -> bool:
    """Whether `ch` shows as nothing or as a blank that a space cannot be told from."""
    if ch == " ":
        return False
    o = ord(ch)
    return (
        unicodedata.category(ch) in _UNSEEN_CATEGORIES
        or ch in _BLANKS
        or 0xFE00 <= o <= 0xFE0F  # variation selectors
        or 0xE0100 <= o <= 0xE01EF  # variation selectors supplement
    )


def _code(ch: str) -> str:
    o = ord(ch)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def shown_name(name: str) -> str:
    """A name as a terminal shows it, told apart from every other name: each character that
    shows as nothing or as a blank (controls, zero-width and format characters, bidi marks,
    spaces other than U+0020, fillers, variation selectors), a space at either end and a
    backslash as a visible escape. Every backslash shown then starts an escape (which a name
    cannot forge), and none stands before a `[` of rich markup, which would take it for one."""
    out = [_code(ch) if ch == "\\" or _unseen(ch) else ch for ch in name]
    if out and out[0] == " ":
        out[0] = "\\x20"
    if len(out) > 1 and out[-1] == " ":
        out[-1] = "\\x20"
    return "".join(out)


def in_markup(value: object, *, name: bool = False) -> str:
    """A value read from a journal (an agent's name, a policy) inside a line printed with rich
    markup: terminal control escaped as by `printable` (`name`: as by `shown_name`), and
    markup too (a name such as `[blink]x` is text)."""
    from rich.markup import escape

    return escape(shown_name(str(value)) if name else printable(str(value)))
