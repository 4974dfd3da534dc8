"""The SCM expression language where mutation testing found it unchecked: operands that are
step names on every side of `if`, `and`, `or`, errors inside parentheses and calls, and the
limits on length and nesting. Expected values are worked by hand (Python's meaning)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.attribution.expr import MAX_DEPTH, MAX_TOKENS, compile_expr, constant_expr
from engine.errors import ConfigError

# (source, a, b, c, expected) with Python's meaning of each operator
VALUES = [
    ("a if b else 0.5", 1, 1, 0, 1),
    ("a if b else 0.5", 1, 0, 0, 0.5),
    ("0.5 if b else a", 1, 0, 0, 1),
    ("a and b", 0, 1, 0, 0),  # the first falsy operand
    ("a and b", 1, 0, 0, 0),
    ("a and c", 1, 0, 1, 1),
    ("a or b", 0, 1, 0, 1),
    ("a or b", 1, 0, 0, 1),
    ("c or 0.25", 0, 0, 0, 0.25),
    ("not a", 0, 0, 0, 1),
    ("-a", 1, 0, 0, -1),
    ("+a", 1, 0, 0, 1),
    ("a - b - c", 1, 1, 1, -1),  # left-associative
    ("a / (b + 1) / 2", 1, 1, 0, 0.25),
    ("a == b == c", 1, 1, 1, 1),
    ("a == b == c", 1, 1, 0, 0),
    ("a < b <= c", 0, 1, 1, 1),
    ("a > b >= c", 1, 0, 0, 1),
    ("a > b >= c", 1, 0, 1, 0),
    ("min(a, b)", 1, 0, 0, 0),
    ("max(a, b, c)", 0, 0, 1, 1),
    ("min(max(a, b), 0.5)", 1, 0, 0, 0.5),
    ("a * 0.5 + b * 0.25", 1, 1, 0, 0.75),
    ("min(0.2 if a else 0.8, b)", 0, 1, 0, 0.8),  # a conditional as a call's first argument
    ("min(0.2 if a else 0.8, b)", 1, 1, 0, 0.2),
    ("(a < b) + 1", 0, 1, 0, 2),  # a comparison closed by a parenthesis
    ("max(a < b, 0.5)", 0, 1, 0, 1),  # ... and by a comma
    ("(a == b) * 0.5", 1, 0, 0, 0),
]


@pytest.mark.parametrize(("source", "a", "b", "c", "expected"), VALUES)
def test_names_on_every_side(source: str, a: int, b: int, c: int, expected: float) -> None:
    """Each operator reads its step-name operands, over a batch of two runs at once."""
    expr = compile_expr(source, known=["a", "b", "c"], where="t")
    env = {k: np.array([float(v), float(v)]) for k, v in zip("abc", (a, b, c), strict=True)}
    got = expr.evaluate(env, 2)
    assert got.dtype == np.float64 and got.tolist() == [expected, expected]


NUD = r"\(expected a number, a step name or '\('\)"
ERRORS = [
    ("(a b)", r"unexpected token 'b' at column 4 \(expected '\)'\)"),
    ("min(a b)", r"unexpected token 'b' at column 7 \(expected '\)'\)"),
    ("(a else b)", r"unexpected token 'else' at column 4 \(expected '\)'\)"),
    ("a // b", r"unexpected token '//' at column 3 \(use '/'\)"),
    ("a || b", r"unexpected token '\|\|' at column 3 \(use 'or'\)"),
    ("!a", r"unexpected token '!' at column 1 \(expected a number, a step name or '\('\)"),
    ("a | b", r"unexpected token '\|' at column 3 \(use 'or'\)"),
    ("a & b", r"unexpected token '&' at column 3 \(use 'and'\)"),
    ("a <> b", r"unexpected token '<>' at column 3 \(use '!='\)"),
    ("a if b else", r"unexpected end of expression at column 12 " + NUD),
    ("a if b then c", r"unexpected token 'then' at column 8 \(expected 'else'\)"),
    ("min", r"min\(\) must be called with arguments, at column 1"),
    ("min(a,)", r"unexpected token '\)' at column 7 " + NUD),
    ("max(a, b", r"unexpected end of expression at column 9 \(expected '\)'\)"),
    ("and a", r"unexpected token 'and' at column 1 \(expected a number, a step name or '\('\)"),
    ("zz", r"unknown name 'zz' at column 1 \(known: a, b, c\)"),
]


@pytest.mark.parametrize(("source", "match"), ERRORS)
def test_errors_say_what_was_expected(source: str, match: str) -> None:
    """Inside parentheses and calls an error names the token and what was expected there."""
    with pytest.raises(ConfigError, match=r"^w: " + match + "$"):
        compile_expr(source, known=["a", "b", "c"], where="w")


def test_unknown_name_without_known_steps() -> None:
    """The first step's expression may read no step: the message says none are known."""
    with pytest.raises(ConfigError, match=r"^w: unknown name 'x' at column 1 \(known: none\)$"):
        compile_expr("x", known=[], where="w")


def test_length_limit() -> None:
    """An expression of 511 tokens compiles; one of twice MAX_TOKENS is refused, naming the
    limit."""
    ok = " + ".join(["1"] * ((MAX_TOKENS + 1) // 2))  # 2 * 256 - 1 = 511 tokens
    assert compile_expr(ok, known=[], where="w").constant == (MAX_TOKENS + 1) // 2
    with pytest.raises(ConfigError, match=rf"^w: expression is longer than {MAX_TOKENS} tokens$"):
        compile_expr(" + ".join(["1"] * MAX_TOKENS), known=[], where="w")


def test_length_limit_at_its_boundary() -> None:
    """Exactly MAX_TOKENS tokens compile (trailing blanks are no tokens); one more is refused,
    even when it is the last token of the text."""
    ones = " + ".join(["1"] * ((MAX_TOKENS + 1) // 2))  # 511 tokens
    exact = "-" + ones  # a unary minus makes 512
    assert compile_expr(exact + "   ", known=[], where="w").constant == -1 + (MAX_TOKENS - 1) // 2
    with pytest.raises(ConfigError, match=rf"^w: expression is longer than {MAX_TOKENS} tokens$"):
        compile_expr("-" + exact, known=[], where="w")


def test_nesting_limit() -> None:
    """MAX_DEPTH - 1 nested parentheses compile; MAX_DEPTH + 1 are refused, naming the limit."""
    depth = MAX_DEPTH - 1
    ok = "(" * depth + "a" + ")" * depth
    assert compile_expr(ok, known=["a"], where="w").names == {"a"}
    deep = "(" * (MAX_DEPTH + 1) + "a" + ")" * (MAX_DEPTH + 1)
    with pytest.raises(ConfigError, match=rf"^w: expression nests deeper than {MAX_DEPTH} levels$"):
        compile_expr(deep, known=["a"], where="w")
    with pytest.raises(ConfigError, match=rf"nests deeper than {MAX_DEPTH} levels"):
        compile_expr("-" * (MAX_DEPTH + 1) + "a", known=["a"], where="w")


def test_constants() -> None:
    """An expression that reads no step has a constant value; one that reads a step has
    none; constant_expr refuses non-finite values and keeps the number's text."""
    assert compile_expr("0.5 * 3", known=["a"], where="w").constant == 1.5
    assert compile_expr("a * 0", known=["a"], where="w").constant is None
    c = constant_expr(0.25)
    assert (c.constant, c.source, c.names) == (0.25, "0.25", frozenset())
    assert c.evaluate({}, 3).tolist() == [0.25, 0.25, 0.25]
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"^constant must be finite, got"):
            constant_expr(bad)


def test_division_by_zero_gives_inf_without_a_warning() -> None:
    """Evaluating 1 / a at a = 0 gives inf (loading reports it), silently."""
    expr = compile_expr("1 / a", known=["a"], where="w")
    with np.errstate(all="raise"):
        assert expr.evaluate({"a": np.array([0.0, 2.0])}, 2).tolist() == [float("inf"), 0.5]


def test_reading_a_later_step_says_why() -> None:
    """A name of a step not decided yet is refused with the reason, in full."""
    with pytest.raises(
        ConfigError,
        match=r"^w: name 'd' at column 5 is a later step; only steps decided before this point "
        r"may be used$",
    ):
        compile_expr("a + d", known=["a"], later=["d"], where="w")


def test_depth_is_counted_back_after_a_nested_operand() -> None:
    """Leaving a nested operand returns to the depth of the level around it: 40 parentheses,
    then `(a) + ` and 30 more are 71 levels and refused; with 10 more (51 levels) it
    compiles."""
    deep = "(" * 40 + "(a) + " + "(" * 30 + "a" + ")" * 30 + ")" * 40
    with pytest.raises(ConfigError, match=rf"nests deeper than {MAX_DEPTH} levels"):
        compile_expr(deep, known=["a"], where="w")
    ok = "(" * 40 + "(a) + " + "(" * 10 + "a" + ")" * 10 + ")" * 40
    assert compile_expr(ok, known=["a"], where="w").names == {"a"}


def test_a_long_chain_deep_inside_is_refused() -> None:
    """Links of one chain count as nesting: at depth 63 (62 `not`s) a chain of 194 `+` makes
    63 + 194 > 4 x MAX_DEPTH and is refused; 193 still compile (both within MAX_TOKENS)."""
    head = "not " * (MAX_DEPTH - 2) + "1"
    ok = head + " + 1" * 193
    assert compile_expr(ok, known=[], where="w").constant == 1.0  # an even number of nots
    with pytest.raises(
        ConfigError,
        match=rf"^w: expression chains more than {4 * MAX_DEPTH} operators at one level$",
    ):
        compile_expr(head + " + 1" * 194, known=[], where="w")


def test_overflow_gives_inf_without_a_warning() -> None:
    """An overflowing product gives inf (loading reports it), silently even where numpy
    would otherwise raise."""
    expr = compile_expr("1e308 * a", known=["a"], where="w")
    with np.errstate(all="raise"):
        assert expr.evaluate({"a": np.array([10.0, 0.5])}, 2).tolist() == [float("inf"), 5e307]


def test_zero_over_zero_gives_nan_without_a_warning() -> None:
    """0 / 0 gives nan (loading reports it), silently even where numpy would raise."""
    expr = compile_expr("a / a", known=["a"], where="w")
    with np.errstate(all="raise"):
        got = expr.evaluate({"a": np.array([0.0, 2.0])}, 2)
    assert np.isnan(got[0]) and got[1] == 1.0
