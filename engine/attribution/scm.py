"""Synthetic structural causal models (SCMs): a ForwardModel with exact ground truth.

An SCM file describes a run of binary decisions (1 = the risky choice), the policy's
probability of each decision given the earlier ones, when the run counts as bad, and the
recorded failing run:

    name: refund_pivot
    description: the middle step decides, the last step only executes
    steps:
      - name: greet
        p: 0.5
      - name: decide_refund
        p: 0.5
        agent: support
      - name: issue_refund
        p: "decide_refund"
    bad: "issue_refund"
    factual: [1, 1, 1]

Forward runs are vectorised with numpy: a whole batch of requests is one pass over the steps.
Step j of a branch with seed b draws u from a SplitMix64-style hash of (b, j) and takes 1 when
u < p, so requests sharing a branch seed share every step's random number (common random
numbers), exactly as the ForwardModel contract promises.

Exact ground truth enumerates assignments: P(bad | keep S) sums, over every way the re-decided
steps can turn out, the policy's probability of that path times the outcome. It is refused
above EXACT_STEP_LIMIT steps, and exact Shapley values above SHAPLEY_TERM_LIMIT enumeration
terms (3^n for n step-players), with a message saying so.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import reprlib
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import yaml

from engine.attribution.base import ForwardRequest, Player, PlayersKind, players_of
from engine.attribution.expr import FUNCTIONS, KEYWORDS, Expr, compile_expr, constant_expr
from engine.errors import ConfigError, InterventionError
from engine.terminal import printable

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
U64Array = npt.NDArray[np.uint64]

#: Exact truth enumerates up to 2^n assignments; beyond this it would take minutes and GBs.
EXACT_STEP_LIMIT = 20
#: Exact Shapley enumerates (coalition, path) pairs: 3^n for n step-players.
SHAPLEY_TERM_LIMIT = 3**15
#: Load-time checks enumerate the inputs of each expression; an expression reading more
#: earlier steps than this cannot be checked and is refused.
CHECK_NAME_LIMIT = 20
#: Effects smaller than this in magnitude are floating-point noise of the enumeration.
EXACT_TOLERANCE = 1e-9
#: A model file larger than this is refused before it is parsed (the shipped ones are < 2 KiB).
MAX_FILE_BYTES = 1 << 20

_CHUNK = 1 << 16
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_STEP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")
_TOP_KEYS = ("name", "description", "steps", "bad", "factual")
_STEP_KEYS = ("name", "p", "agent")


# --- random numbers -------------------------------------------------------------------------


def _mix64(z: U64Array) -> U64Array:
    """SplitMix64's finaliser: a bijective avalanche on 64-bit words (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seeds_array(seeds: Sequence[int]) -> U64Array:
    """Branch seeds as unsigned 64-bit words (negative or huge ints wrap modulo 2^64)."""
    try:
        return np.array(seeds, dtype=np.uint64).reshape(-1)
    except OverflowError:
        return np.array([s & _MASK64 for s in seeds], dtype=np.uint64).reshape(-1)


def uniforms(seeds: U64Array, step: int) -> FloatArray:
    """One uniform in [0, 1) per branch seed for `step`: a pure function of (seed, step).

    Counter-based on purpose: a stateful generator would make step j's number depend on how
    many draws earlier steps consumed, and common random numbers across branches would break
    as soon as two branches kept different steps.
    """
    key = _mix64(seeds ^ np.uint64(0x5851F42D4C957F2D))
    z = _mix64(key + np.uint64(((step + 1) * _GOLDEN) & _MASK64))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# --- the model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScmStep:
    """One binary decision: its name, the policy's P(step = 1 | earlier steps), its agent."""

    name: str
    p: Expr
    agent: str | None


@dataclass(frozen=True)
class SCM:
    """A synthetic failed run that can be re-run forward, with exact ground truth."""

    name: str
    description: str
    steps: tuple[ScmStep, ...]
    bad: Expr
    factual: tuple[int, ...]
    source: str = "<text>"  # the file it came from, for messages
    _factual_bits: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bits = sum(v << j for j, v in enumerate(self.factual))
        object.__setattr__(self, "_factual_bits", bits)

    # ForwardModel ------------------------------------------------------------------------

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def step_agents(self) -> Sequence[str | None]:
        return [s.agent for s in self.steps]

    @property
    def step_labels(self) -> Sequence[str]:
        return [s.name for s in self.steps]

    def run_batch(self, requests: Sequence[ForwardRequest]) -> list[bool]:
        """Run every request forward in one vectorised pass; True = the run ended bad."""
        # batches repeat few keep sets: convert each once into a row of booleans (a row, not
        # an integer bitmask, so that a model of any number of steps fits)
        index: dict[frozenset[int], int] = {}
        table: list[BoolArray] = []
        rows = []
        for request in requests:
            row = index.get(request.keep)
            if row is None:
                row = index[request.keep] = len(table)
                table.append(self._keep_row(request.keep))
            rows.append(row)
        unique = np.array(table, dtype=np.bool_).reshape(-1, self.n_steps)
        keep = unique[np.array(rows, dtype=np.intp)]
        seeds = seeds_array([r.branch_seed for r in requests])
        return self.simulate(keep, seeds).tolist()

    def _keep_row(self, keep: frozenset[int]) -> BoolArray:
        row = np.zeros(self.n_steps, dtype=np.bool_)
        for j in keep:
            if not 0 <= j < self.n_steps:
                raise InterventionError(
                    f"model {self.name!r} has steps 0..{self.n_steps - 1}, "
                    f"a request keeps step {j!r}"
                )
            row[j] = True
        return row

    def simulate(self, keep: BoolArray, seeds: U64Array) -> BoolArray:
        """The vectorised core of run_batch: keep is (runs, steps), seeds is (runs,)."""
        size = len(seeds)
        env: dict[str, FloatArray] = {}
        for j, step in enumerate(self.steps):
            drawn = uniforms(seeds, j) < step.p.evaluate(env, size)
            value = np.where(keep[:, j], self.factual[j] == 1, drawn)
            env[step.name] = value.astype(np.float64)
        return np.asarray(self.bad.evaluate(env, size) != 0)

    # exact ground truth ------------------------------------------------------------------

    def p_bad(self, keep: Iterable[int]) -> float:
        """Exact P(bad | the steps in `keep` take their factual action, the rest re-decided)."""
        self._require_exact()
        kept = set(keep)
        tables = []
        for j in range(self.n_steps):
            if j in kept:
                tables.append(_Options.single(self.factual[j] << j))
            else:
                tables.append(_Options.free_of((j,), coalition_bit=0, kept=None))
        return float(sum(w.sum() for w, _ in self._weighted_terms(tables)))

    def exact_effects(self) -> list[float]:
        """Exact contrastive effect of each step: P(bad | keep steps < k) - P(bad | factual).

        P(bad | factual) is 1: the factual run is bad by construction and keeping every step
        replays it exactly.
        """
        factual = self.p_bad(range(self.n_steps))
        return [self.p_bad(range(k)) - factual for k in range(self.n_steps)]

    def exact_locus(self) -> int | None:
        """The point of commitment: the last step whose re-decision can rescue the run."""
        locus = None
        for k, effect in enumerate(self.exact_effects()):
            if effect < -EXACT_TOLERANCE:
                locus = k
        return locus

    def exact_efficiency(self) -> float:
        """v(all) - v(none): what the Shapley values of any players must add up to."""
        return self.p_bad(range(self.n_steps)) - self.p_bad(())

    def exact_values(self, players: str | PlayersKind = "steps") -> FloatArray:
        """v(S) for every coalition S of players, indexed by bitmask (bit g = player g)."""
        group = self.require_exact(players)
        tables = [
            _Options.free_of(p.steps, coalition_bit=1 << g, kept=self._factual_bits)
            for g, p in enumerate(group)
        ]
        values = np.zeros(1 << len(group))
        for weights, coalitions in self._weighted_terms(tables):
            values += np.bincount(coalitions, weights=weights, minlength=len(values))
        return values

    def exact_shapley(self, players: str | PlayersKind = "steps") -> dict[str, float]:
        """Exact Shapley value of each player, by summing over every coalition."""
        group = players_of(self, players)
        phi = shapley_from_values(self.exact_values(players), len(group))
        return {p.name: float(v) for p, v in zip(group, phi, strict=True)}

    def require_exact(self, players: str | PlayersKind = "steps") -> list[Player]:
        """The players, once it is certain that exact ground truth for them can be enumerated
        (every effect, and Shapley values over `players`); a ConfigError saying why not."""
        self._require_exact()
        group = players_of(self, players)
        terms = math.prod(1 + (1 << len(p.steps)) for p in group)
        if terms > SHAPLEY_TERM_LIMIT:
            raise ConfigError(
                f"model {self.name!r}: exact Shapley over {len(group)} "
                f"{PlayersKind.parse(players).value} "
                f"needs {terms:,} enumeration terms, above the limit of {SHAPLEY_TERM_LIMIT:,}; "
                "use fewer steps or players='agents' (Monte Carlo estimates still work)"
            )
        return group

    def _require_exact(self) -> None:
        if self.n_steps > EXACT_STEP_LIMIT:
            raise ConfigError(
                f"model {self.name!r} has {self.n_steps} steps; exact ground truth enumerates "
                f"2^{self.n_steps} assignments and is refused above {EXACT_STEP_LIMIT} steps "
                "(Monte Carlo estimates still work)"
            )

    def _weighted_terms(self, tables: Sequence[_Options]) -> Iterator[tuple[FloatArray, IntArray]]:
        """For each chunk of enumeration terms: path probability x outcome, and coalition."""
        for x, free, coalition in _enumerate(tables):
            size = len(x)
            env: dict[str, FloatArray] = {}
            weight = np.ones(size)
            for j, step in enumerate(self.steps):
                value = ((x >> j) & 1).astype(np.float64)
                is_free = ((free >> j) & 1).astype(np.bool_)
                if is_free.any():
                    p = step.p.evaluate(env, size)
                    weight *= np.where(is_free, np.where(value == 1, p, 1 - p), 1.0)
                env[step.name] = value
            yield weight * (self.bad.evaluate(env, size) != 0), coalition


def shapley_from_values(values: FloatArray, m: int) -> FloatArray:
    """Shapley values from v over all 2^m coalitions (bitmask-indexed)."""
    coalitions = np.arange(1 << m)
    sizes = np.zeros(1 << m, dtype=np.int64)
    for g in range(m):
        sizes += (coalitions >> g) & 1
    # |S|! (m - |S| - 1)! / m!, the chance that S is exactly the set before i in a permutation
    weight = np.array(
        [math.factorial(s) * math.factorial(m - s - 1) / math.factorial(m) for s in range(m)]
    )
    phi = np.zeros(m)
    for g in range(m):
        without = coalitions[((coalitions >> g) & 1) == 0]
        phi[g] = np.sum(weight[sizes[without]] * (values[without | (1 << g)] - values[without]))
    return phi


@dataclass(frozen=True)
class _Options:
    """One player's alternatives in an enumeration: kept factual, or each free assignment."""

    x_bits: IntArray
    free_bits: IntArray
    coalition_bits: IntArray

    @staticmethod
    def single(x_bits: int) -> _Options:
        return _Options(np.array([x_bits]), np.array([0]), np.array([0]))

    @staticmethod
    def free_of(steps: Sequence[int], coalition_bit: int, kept: int | None) -> _Options:
        """Every free assignment of `steps`; plus, when `kept` (factual bits) is given, the
        option of keeping them factual, which marks the coalition bit."""
        mask = sum(1 << j for j in steps)
        xs = [
            sum(bit << j for bit, j in zip(bits, steps, strict=True))
            for bits in itertools.product((0, 1), repeat=len(steps))
        ]
        free = [mask] * len(xs)
        coal = [0] * len(xs)
        if kept is not None:
            xs.append(kept & mask)
            free.append(0)
            coal.append(coalition_bit)
        return _Options(np.array(xs), np.array(free), np.array(coal))


def _enumerate(tables: Sequence[_Options]) -> Iterator[tuple[IntArray, IntArray, IntArray]]:
    """The cartesian product of the players' options, in chunks, as mixed-radix numbers."""
    radices = [len(t.x_bits) for t in tables]
    total = math.prod(radices)
    for start in range(0, total, _CHUNK):
        index = np.arange(start, min(start + _CHUNK, total), dtype=np.int64)
        x = np.zeros_like(index)
        free = np.zeros_like(index)
        coalition = np.zeros_like(index)
        for table, radix in zip(tables, radices, strict=True):
            digit = index % radix
            index = index // radix
            x |= table.x_bits[digit]
            free |= table.free_bits[digit]
            coalition |= table.coalition_bits[digit]
        yield x, free, coalition


# --- loading --------------------------------------------------------------------------------


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4
_REPR.maxlevel = 2


def _shown(value: Any) -> str:
    """A value read from a model file, for a message: its repr, cut short. YAML aliases can
    make a file of a few hundred bytes hold a list of billions of items (or a list that holds
    itself); a full repr of that would never finish."""
    return printable(_REPR.repr(value))


def _source_shown(source: str) -> str:
    """A file name inside a message: any terminal control character in it escaped."""
    return printable(source)


class _Where:
    """Builds the "file: model 'x', step 'y', field 'p'" prefix of a ConfigError."""

    def __init__(self, source: str) -> None:
        self.source = _source_shown(source)
        self.model: str | None = None

    def __call__(self, step: str | None = None, fld: str | None = None) -> str:
        parts = [] if self.model is None else [f"model {self.model!r}"]
        if step is not None:
            parts.append(f"step {step}")
        if fld is not None:
            parts.append(f"field {fld!r}")
        return (f"{self.source}: " + ", ".join(parts)) if parts else self.source

    def error(self, message: str, step: str | None = None, fld: str | None = None) -> ConfigError:
        return ConfigError(f"{self(step, fld)}: {message}")


def load_scm(path_or_text: str | Path) -> SCM:
    """Load and check an SCM from a YAML file path or YAML text; problems are ConfigErrors.

    A str is read as a path when it names an existing file or ends in .yaml/.yml without a
    line break; otherwise it is the YAML text itself.
    """
    if isinstance(path_or_text, Path) or (
        "\n" not in path_or_text
        and (Path(path_or_text).is_file() or path_or_text.endswith((".yaml", ".yml")))
    ):
        path = Path(path_or_text)
        return _parse(_read_file(path), source=str(path))
    return _parse(path_or_text, source="<text>")


def _read_file(path: Path) -> str:
    """The text of the model file at `path`: a regular file of at most MAX_FILE_BYTES of UTF-8.

    Opened without blocking and checked before it is read, so that a FIFO (which would wait
    for a writer) or a device such as /dev/zero (which never ends) is refused at once."""
    shown = _shown(str(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError(f"cannot read SCM file {shown}: {e.strerror}") from e
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"cannot read SCM file {shown}: Is a directory")
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"cannot read SCM file {shown}: not a regular file")
        if info.st_size > MAX_FILE_BYTES:
            raise ConfigError(
                f"SCM file {shown} is {info.st_size:,} bytes; the limit is {MAX_FILE_BYTES:,}"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read SCM file {shown}: {e.strerror}") from e
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:  # it grew after the check
        raise ConfigError(f"SCM file {shown} is larger than the limit of {MAX_FILE_BYTES:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"SCM file {shown} is not UTF-8 text (byte {e.start})") from e


def builtin_models() -> list[SCM]:
    """The SCMs shipped with the engine (the paper's two and a few more), ordered by name."""
    folder = resources.files("engine.attribution.models")
    models = [
        _parse(entry.read_text(encoding="utf-8"), source=f"builtin:{entry.name}")
        for entry in folder.iterdir()
        if entry.name.endswith(".yaml")
    ]
    return sorted(models, key=lambda m: m.name)


def find_model(name_or_path: str) -> SCM:
    """A built-in model by name, else an SCM file; an unknown name lists the built-ins."""
    builtins = {m.name: m for m in builtin_models()}
    if name_or_path in builtins:
        return builtins[name_or_path]
    if Path(name_or_path).is_file():
        return load_scm(Path(name_or_path))
    known = ", ".join(sorted(builtins))
    raise ConfigError(
        f"no built-in model or SCM file named {name_or_path!r} (built-in models: {known})"
    )


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    silently: `bad:` written twice would validate a model other than the one read)."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base`: its keys may be overridden, as YAML intends
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: the base class says so
                    break
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {_shown(key)}",
                        key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)  # type: ignore[arg-type]


def _parse(text: str, source: str) -> SCM:
    where = _Where(source)
    try:
        doc = yaml.load(text, Loader=_Loader)  # a SafeLoader: plain data only
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{where.source}: YAML syntax error{at}: {printable(problem)}") from e
    except RecursionError as e:
        raise ConfigError(f"{where.source}: the YAML nests too deeply to be a model file") from e
    if not isinstance(doc, dict):
        raise where.error(
            f"expected a mapping with keys {', '.join(_TOP_KEYS)}, got {type(doc).__name__}"
        )
    _no_unknown_keys(doc, _TOP_KEYS, where, None)
    name = _required(doc, "name", where, None)
    if not isinstance(name, str) or not _MODEL_NAME.match(name):
        raise where.error(
            f"name must be letters, digits, '_', '.' or '-', got {_shown(name)}", fld="name"
        )
    where.model = name
    description = doc.get("description", "")
    if not isinstance(description, str):
        raise where.error(f"expected text, got {_shown(description)}", fld="description")

    raw_steps = _required(doc, "steps", where, None)
    if not isinstance(raw_steps, list) or not raw_steps:
        raise where.error(
            f"expected a non-empty list of steps, got {_shown(raw_steps)}", fld="steps"
        )
    names = _step_names(raw_steps, where)
    steps = [_step(raw, j, names, where) for j, raw in enumerate(raw_steps)]

    bad_source = _required(doc, "bad", where, None)
    if not isinstance(bad_source, str):
        raise where.error(f"expected an expression string, got {_shown(bad_source)}", fld="bad")
    bad = compile_expr(bad_source, known=names, where=where(fld="bad"))
    _check_range(bad, names, where(fld="bad"), unit_interval=False)

    factual = _factual(_required(doc, "factual", where, None), names, where)
    model = SCM(
        name=name,
        description=description.strip(),
        steps=tuple(steps),
        bad=bad,
        factual=factual,
        source=source,
    )
    _check_factual(model, where)
    return model


def _required(doc: dict[str, Any], key: str, where: _Where, step: str | None) -> Any:
    if key not in doc:
        raise where.error(f"missing required field {key!r}", step=step)
    return doc[key]


def _no_unknown_keys(
    doc: dict[Any, Any], allowed: Sequence[str], where: _Where, step: str | None
) -> None:
    for key in doc:
        if key not in allowed:
            raise where.error(
                f"unknown field {_shown(key)} (expected: {', '.join(allowed)})", step=step
            )


def _step_names(raw_steps: list[Any], where: _Where) -> list[str]:
    names: list[str] = []
    for j, raw in enumerate(raw_steps):
        label = f"#{j}"
        if not isinstance(raw, dict):
            raise where.error(f"expected a mapping with name and p, got {_shown(raw)}", step=label)
        name = _required(raw, "name", where, label)
        if not isinstance(name, str) or not _STEP_NAME.match(name):
            raise where.error(
                f"a step name must be an identifier (letters, digits, '_'), got {_shown(name)}",
                step=label,
                fld="name",
            )
        if name in KEYWORDS or name in FUNCTIONS:
            raise where.error(
                f"{name!r} is a word of the expression language and cannot name a step",
                step=label,
                fld="name",
            )
        if name in names:
            raise where.error(
                f"duplicate step name {name!r} (also step #{names.index(name)})",
                step=label,
                fld="name",
            )
        names.append(name)
    return names


def _step(raw: dict[str, Any], j: int, names: list[str], where: _Where) -> ScmStep:
    name = names[j]
    label = repr(name)
    _no_unknown_keys(raw, _STEP_KEYS, where, label)
    p_raw = _required(raw, "p", where, label)
    if isinstance(p_raw, bool) or not isinstance(p_raw, int | float | str):
        raise where.error(
            f"expected a number in [0, 1] or an expression string, got {_shown(p_raw)}",
            step=label,
            fld="p",
        )
    if isinstance(p_raw, str):
        p = compile_expr(p_raw, known=names[:j], later=names[j:], where=where(step=label, fld="p"))
    else:
        # compared as it is: an int of 400 digits has no float (math.isfinite overflows)
        if not (0 <= p_raw <= 1):  # also false for NaN
            raise where.error(
                f"expected a probability in [0, 1], got {_shown(p_raw)}", step=label, fld="p"
            )
        p = constant_expr(float(p_raw))
    _check_range(p, names[:j], where(step=label, fld="p"), unit_interval=True)
    agent = raw.get("agent")
    if agent is not None and (
        not isinstance(agent, str) or not agent.strip() or printable(agent) != agent
    ):
        # a name, shown in tables: no line breaks, tabs or terminal control characters
        raise where.error(f"expected an agent name, got {_shown(agent)}", step=label, fld="agent")
    return ScmStep(name=name, p=p, agent=agent)


def _check_range(expr: Expr, names: Sequence[str], where: str, unit_interval: bool) -> None:
    """Evaluate `expr` on every 0/1 input it reads: finite, and a probability if asked."""
    inputs = [n for n in names if n in expr.names]
    if len(inputs) > CHECK_NAME_LIMIT:
        raise ConfigError(
            f"{where}: reads {len(inputs)} steps; checking it needs all 2^{len(inputs)} inputs "
            f"and is refused above {CHECK_NAME_LIMIT}"
        )
    size = 1 << len(inputs)
    codes = np.arange(size)
    env = {n: ((codes >> i) & 1).astype(np.float64) for i, n in enumerate(inputs)}
    values = expr.evaluate(env, size)
    ok = np.isfinite(values)
    if unit_interval:
        ok &= (values >= 0) & (values <= 1)
    if not ok.all():
        i = int(np.argmin(ok))
        at = ", ".join(f"{n}={int(env[n][i])}" for n in inputs)
        expected = "a probability in [0, 1]" if unit_interval else "a finite number"
        raise ConfigError(
            f"{where}: evaluates to {float(values[i])!r} (expected {expected})"
            + (f" when {at}" if at else "")
        )


def _factual(raw: Any, names: list[str], where: _Where) -> tuple[int, ...]:
    if not isinstance(raw, list):
        raise where.error(f"expected a list of 0/1 values, got {_shown(raw)}", fld="factual")
    if len(raw) != len(names):
        raise where.error(
            f"has {len(raw)} values but the model has {len(names)} steps", fld="factual"
        )
    for j, v in enumerate(raw):
        if isinstance(v, bool) or v not in (0, 1):
            raise where.error(
                f"value of step {names[j]!r} must be 0 or 1, got {_shown(v)}", fld="factual"
            )
    return tuple(int(v) for v in raw)


def _check_factual(model: SCM, where: _Where) -> None:
    """The factual run must be bad and possible: it is a recorded failing run."""
    env: dict[str, FloatArray] = {}
    for step, value in zip(model.steps, model.factual, strict=True):
        p = float(step.p.evaluate(env, 1)[0])
        if (value == 1 and p == 0) or (value == 0 and p == 1):
            raise where.error(
                f"value {value} of step {step.name!r} has probability 0 under its p "
                "given the earlier factual values; a recorded run cannot contain it",
                fld="factual",
            )
        env[step.name] = np.array([float(value)])
    if not model.bad.evaluate(env, 1)[0]:
        raise where.error(
            f"{list(model.factual)} does not make bad ({model.bad.source!r}) true; "
            "the factual run must be the recorded failing run",
            fld="factual",
        )


def model_summary(model: SCM) -> dict[str, Any]:
    """Plain data describing a model, for listings."""
    return {
        "name": model.name,
        "description": model.description,
        "steps": [{"name": s.name, "p": s.p.source, "agent": s.agent} for s in model.steps],
        "bad": model.bad.source,
        "factual": list(model.factual),
        "source": model.source,
    }


__all__ = [
    "EXACT_STEP_LIMIT",
    "SCM",
    "SHAPLEY_TERM_LIMIT",
    "ScmStep",
    "builtin_models",
    "find_model",
    "load_scm",
    "model_summary",
    "seeds_array",
    "shapley_from_values",
    "uniforms",
]
