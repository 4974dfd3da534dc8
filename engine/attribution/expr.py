"""A small, safe expression language for SCM files: tokenizer, Pratt parser, numpy evaluator.

SCM files come from users, so their expressions are parsed here and never handed to Python's
`eval`. The language is deliberately tiny:

    numbers, names of earlier steps (0/1), and / or / not, < <= > >= == !=,
    + - * /, parentheses, `x if c else y`, min(a, b, ...), max(a, b, ...)

with Python's precedence and meaning: `a and b` is b when a is non-zero, else a; comparisons
chain (`0 < x < 1`) and give 0/1; any non-zero value is true. Every expression compiles to a
closure evaluated over a mapping from step names to numpy arrays, so one call evaluates a
whole batch of forward runs (or every assignment of an enumeration) at once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from engine.errors import ConfigError

FloatArray = npt.NDArray[np.float64]
Env = Mapping[str, FloatArray]
_Fn = Callable[[Env], FloatArray | float]

KEYWORDS = frozenset({"and", "or", "not", "if", "else"})
FUNCTIONS = frozenset({"min", "max"})

# Operators outside the language are still tokenized whole, so the error can quote "**"
# rather than a confusing lone "*". ASCII only: in Unicode mode `\d` takes the digits of any
# script (float() reads "٠.٥" as 0.5, a number the file does not visibly say) and `\s` the
# control characters \x1c-\x1f, which are no spacing a model file should hold.
_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<number>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op><=|>=|==|!=|\*\*|//|&&|\|\||<>|[-+*/<>=(),%&|^~!@\[\]{}:;.])
    """,
    re.VERBOSE | re.ASCII,
)
_LANGUAGE_OPS = frozenset({"<", "<=", ">", ">=", "==", "!=", "+", "-", "*", "/", "(", ")", ","})
_HINTS = {
    "**": "powers are not supported",
    "//": "use '/'",
    "=": "did you mean '=='?",
    "&&": "use 'and'",
    "||": "use 'or'",
    "!": "use 'not'",
    "&": "use 'and'",
    "|": "use 'or'",
    "<>": "use '!='",
}
_COMPARISONS = frozenset({"<", "<=", ">", ">=", "==", "!="})
#: An expression longer than this many tokens is refused (a model's expressions are a line).
MAX_TOKENS = 512
#: How deeply an expression may nest (parentheses, operators, calls, if/else). Both bounds
#: keep the recursive parser and the nested closures it builds far from Python's stack limit.
MAX_DEPTH = 64


class ExprError(Exception):
    """A syntax or name error inside one expression; the caller adds where it sits."""


@dataclass(frozen=True)
class _Token:
    kind: str  # "number", "name", "op", "end"
    text: str
    column: int  # 1-based, as an editor shows it


def _describe(tok: _Token) -> str:
    if tok.kind == "end":
        return f"end of expression at column {tok.column}"
    return f"{tok.text!r} at column {tok.column}"


def tokenize(source: str) -> list[_Token]:
    """Split `source` into tokens; a character outside the language is an ExprError."""
    tokens: list[_Token] = []
    pos = 0
    while pos < len(source):
        m = _TOKEN.match(source, pos)
        if m is None:
            raise ExprError(f"unexpected character {source[pos]!r} at column {pos + 1}")
        kind = m.lastgroup
        assert kind is not None
        if kind != "ws":
            if len(tokens) == MAX_TOKENS:
                raise ExprError(f"expression is longer than {MAX_TOKENS} tokens")
            tokens.append(_Token(kind, m.group(), pos + 1))
        pos = m.end()
    tokens.append(_Token("end", "", len(source) + 1))
    return tokens


# Binding powers, Python's order from loosest to tightest.
_BP_IF = 1
_BP_OR = 2
_BP_AND = 3
_BP_NOT = 4
_BP_CMP = 5
_BP_ADD = 6
_BP_MUL = 7
_BP_UNARY = 8


def _as_bool(x: FloatArray | float) -> npt.NDArray[np.bool_]:
    return np.asarray(x) != 0


class _Parser:
    """Pratt parser producing closures; names are checked against the steps decided so far."""

    def __init__(self, source: str, known: Sequence[str], later: Sequence[str]) -> None:
        self.tokens = tokenize(source)
        self.i = 0
        self.known = frozenset(known)
        self.later = frozenset(later)
        self.names: set[str] = set()
        self.depth = 0

    def peek(self) -> _Token:
        return self.tokens[self.i]

    def next(self) -> _Token:
        tok = self.tokens[self.i]
        if tok.kind != "end":
            self.i += 1
        return tok

    def unexpected(self, tok: _Token, expected: str | None = None) -> ExprError:
        if tok.kind == "end":
            what = f"unexpected end of expression at column {tok.column}"
        else:
            what = f"unexpected token {tok.text!r} at column {tok.column}"
        hint = _HINTS.get(tok.text) if tok.kind == "op" else None
        if expected is not None:
            what += f" (expected {expected})"
        elif hint is not None:
            what += f" ({hint})"
        return ExprError(what)

    def expect(self, text: str) -> _Token:
        tok = self.next()
        if tok.text != text or tok.kind not in ("op", "name"):
            raise self.unexpected(tok, expected=repr(text))
        return tok

    def parse(self) -> _Fn:
        if self.peek().kind == "end":
            raise ExprError("empty expression")
        fn = self.expression(0)
        tok = self.peek()
        if tok.kind != "end":
            raise self.unexpected(tok)
        return fn

    def lbp(self, tok: _Token) -> int:
        if tok.kind == "name":
            return {"if": _BP_IF, "or": _BP_OR, "and": _BP_AND}.get(tok.text, 0)
        if tok.kind == "op":
            if tok.text in _COMPARISONS:
                return _BP_CMP
            if tok.text in ("+", "-"):
                return _BP_ADD
            if tok.text in ("*", "/"):
                return _BP_MUL
        return 0

    def expression(self, rbp: int) -> _Fn:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ExprError(f"expression nests deeper than {MAX_DEPTH} levels")
        try:
            left = self.nud(self.next())
            # a chain of left-associative operators loops here instead of recursing, but
            # each link nests the closures one level deeper: count the links too
            links = 0
            while self.lbp(self.peek()) > rbp:
                left = self.led(self.next(), left)
                links += 1
                if self.depth + links > 4 * MAX_DEPTH:
                    raise ExprError(
                        f"expression chains more than {4 * MAX_DEPTH} operators at one level"
                    )
            return left
        finally:
            self.depth -= 1

    def nud(self, tok: _Token) -> _Fn:
        if tok.kind == "number":
            value = float(tok.text)
            return lambda env: value
        if tok.kind == "name":
            return self.name(tok)
        if tok.kind == "op" and tok.text == "(":
            inner = self.expression(0)
            self.expect(")")
            return inner
        if tok.kind == "op" and tok.text in ("-", "+"):
            operand = self.expression(_BP_UNARY)
            if tok.text == "+":
                return operand
            return lambda env: np.negative(operand(env))
        raise self.unexpected(tok, expected="a number, a step name or '('")

    def name(self, tok: _Token) -> _Fn:
        text = tok.text
        if text == "not":
            operand = self.expression(_BP_NOT)
            return lambda env: (~_as_bool(operand(env))).astype(np.float64)
        if text in KEYWORDS:
            raise self.unexpected(tok, expected="a number, a step name or '('")
        if self.peek().kind == "op" and self.peek().text == "(":
            return self.call(tok)
        if text in FUNCTIONS:
            raise ExprError(f"{text}() must be called with arguments, at column {tok.column}")
        if text in self.later:
            raise ExprError(
                f"name {text!r} at column {tok.column} is a later step; only steps decided "
                "before this point may be used"
            )
        if text not in self.known:
            known = ", ".join(sorted(self.known)) or "none"
            raise ExprError(f"unknown name {text!r} at column {tok.column} (known: {known})")
        self.names.add(text)
        return lambda env: env[text]

    def call(self, tok: _Token) -> _Fn:
        if tok.text not in FUNCTIONS:
            raise ExprError(
                f"unknown function {tok.text!r} at column {tok.column} (known: min, max)"
            )
        self.expect("(")
        args = [self.expression(0)]
        while self.peek().text == "," and self.peek().kind == "op":
            self.next()
            args.append(self.expression(0))
        self.expect(")")
        if len(args) < 2:
            raise ExprError(f"{tok.text}() at column {tok.column} needs at least 2 arguments")
        reduce = np.minimum if tok.text == "min" else np.maximum

        def fn(env: Env) -> FloatArray | float:
            acc = np.asarray(args[0](env), dtype=np.float64)
            for arg in args[1:]:
                acc = reduce(acc, arg(env))
            return acc

        return fn

    def led(self, tok: _Token, left: _Fn) -> _Fn:
        text = tok.text
        if tok.kind == "name" and text == "if":
            cond = self.expression(_BP_IF)
            else_tok = self.next()
            if else_tok.kind != "name" or else_tok.text != "else":
                raise self.unexpected(else_tok, expected="'else'")
            orelse = self.expression(_BP_IF - 1)  # right-associative, like Python
            return lambda env: np.where(_as_bool(cond(env)), left(env), orelse(env))
        if tok.kind == "name" and text == "or":
            right = self.expression(_BP_OR)
            return lambda env: _or(left(env), right(env))
        if tok.kind == "name" and text == "and":
            right = self.expression(_BP_AND)
            return lambda env: _and(left(env), right(env))
        if text in _COMPARISONS:
            return self.comparison(tok, left)
        if text in ("+", "-", "*", "/"):
            right = self.expression(self.lbp(tok))
            op = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.divide}[text]
            return lambda env: op(left(env), right(env))
        raise self.unexpected(tok)  # pragma: no cover - lbp() admits only the tokens above

    def comparison(self, first_op: _Token, first: _Fn) -> _Fn:
        ops: list[Callable[[FloatArray | float, FloatArray | float], npt.NDArray[np.bool_]]] = []
        operands = [first]
        tok = first_op
        while True:
            ops.append(_COMPARE[tok.text])
            operands.append(self.expression(_BP_CMP))
            if not (self.peek().kind == "op" and self.peek().text in _COMPARISONS):
                break
            tok = self.next()

        def fn(env: Env) -> FloatArray | float:
            values = [operand(env) for operand in operands]
            result = np.asarray(ops[0](values[0], values[1]))
            for i in range(1, len(ops)):
                result = result & ops[i](values[i], values[i + 1])
            return result.astype(np.float64)

        return fn


_COMPARE: dict[str, Callable[[FloatArray | float, FloatArray | float], npt.NDArray[np.bool_]]] = {
    "<": np.less,
    "<=": np.less_equal,
    ">": np.greater,
    ">=": np.greater_equal,
    "==": np.equal,
    "!=": np.not_equal,
}


def _and(a: FloatArray | float, b: FloatArray | float) -> FloatArray:
    return np.where(_as_bool(a), b, a)


def _or(a: FloatArray | float, b: FloatArray | float) -> FloatArray:
    return np.where(_as_bool(a), a, b)


@dataclass(frozen=True)
class Expr:
    """A compiled expression: its source, the step names it reads, and a vectorised evaluator."""

    source: str
    names: frozenset[str]
    _fn: _Fn

    def evaluate(self, env: Env, size: int) -> FloatArray:
        """Evaluate over arrays of length `size`; a constant is broadcast to that length.

        Division by zero gives inf or nan rather than a warning: SCM loading enumerates every
        input and reports such values as errors, so they cannot reach a forward run.
        """
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            value = np.asarray(self._fn(env), dtype=np.float64)
        return np.broadcast_to(value, (size,))

    @property
    def constant(self) -> float | None:
        """The value when the expression reads no step, else None."""
        if self.names:
            return None
        return float(self.evaluate({}, 1)[0])


def compile_expr(
    source: str, *, known: Sequence[str], later: Sequence[str] = (), where: str
) -> Expr:
    """Parse `source`, allowing the step names in `known`; errors become one-line ConfigErrors.

    `later` lists the names of steps not decided yet, so that reading one is reported as such
    rather than as an unknown name. `where` prefixes the message, e.g. "model 'x', step 'y',
    field 'p'".
    """
    try:
        parser = _Parser(source, known, later)
        fn = parser.parse()
    except ExprError as e:
        raise ConfigError(f"{where}: {e}") from e
    return Expr(source=source, names=frozenset(parser.names), _fn=fn)


def constant_expr(value: float) -> Expr:
    """An expression that is the number `value` (a YAML number in place of a string)."""
    if not math.isfinite(value):
        raise ValueError(f"constant must be finite, got {value!r}")
    return Expr(source=repr(value), names=frozenset(), _fn=lambda env: value)
