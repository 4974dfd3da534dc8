"""SCM files: the expression language, loading errors, forward runs and exact ground truth."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import kstest

from engine.attribution import ForwardRequest
from engine.attribution.base import players_of
from engine.attribution.expr import compile_expr
from engine.attribution.scm import SCM, builtin_models, find_model, load_scm, seeds_array, uniforms
from engine.errors import ConfigError, InterventionError

MODELS = {m.name: m for m in builtin_models()}

PIVOT = """
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
"""


# --- exact ground truth of the built-in models ---------------------------------------------


def test_builtin_models_are_the_documented_ones() -> None:
    """The paper's two models ship with the engine, together with two more, each described."""
    assert {"refund_pivot", "and_interaction", "or_redundancy", "crew_late_pivot"} <= set(MODELS)
    assert all(m.description for m in MODELS.values())


def test_and_interaction_exact_shapley() -> None:
    """AND model: exact phi0 = phi1 = 0.455, phi2 = 0, efficiency 0.91 (paper: 0.44/0.45/0)."""
    m = MODELS["and_interaction"]
    phi = list(m.exact_shapley().values())
    assert phi == pytest.approx([0.455, 0.455, 0.0], abs=1e-12)
    assert m.exact_efficiency() == pytest.approx(0.91, abs=1e-12)
    assert sum(phi) == pytest.approx(m.exact_efficiency(), abs=1e-12)


def test_and_interaction_exact_effects_over_count() -> None:
    """AND model: the single-step effects add to 1.61 in magnitude, more than the 0.91 to split."""
    effects = MODELS["and_interaction"].exact_effects()
    assert effects == pytest.approx([-0.91, -0.7, 0.0], abs=1e-12)
    assert sum(abs(e) for e in effects) > MODELS["and_interaction"].exact_efficiency() + 0.5


def test_pivotal_model_locus_is_the_middle_step() -> None:
    """Pivotal model: the decision (middle step) is the locus; the execution step has no effect."""
    m = MODELS["refund_pivot"]
    assert m.exact_effects() == pytest.approx([-0.5, -0.5, 0.0], abs=1e-12)
    assert m.exact_locus() == 1
    assert m.step_labels[1] == "decide_refund"


def test_other_builtin_models_exact_truth() -> None:
    """OR redundancy commits at the first lapse; the crew model commits late, at step 4."""
    or_model = MODELS["or_redundancy"]
    assert or_model.exact_locus() == 0
    assert list(or_model.exact_shapley().values()) == pytest.approx([0.32, 0.32, 0.0])
    crew = MODELS["crew_late_pivot"]
    assert crew.exact_locus() == 4
    agents = crew.exact_shapley("agents")
    assert list(agents) == ["planner", "intel", "hacker", "driver"]
    assert sum(agents.values()) == pytest.approx(crew.exact_efficiency(), abs=1e-12)
    assert max(agents, key=lambda a: agents[a]) == "driver"


# --- exact truth against an independent brute force -----------------------------------------


def _brute_p_bad(model: SCM, keep: set[int]) -> float:
    """P(bad | keep) by walking the probability tree in plain Python, one path at a time."""
    total = 0.0
    for values in itertools.product((0, 1), repeat=model.n_steps):
        if any(values[j] != model.factual[j] for j in keep):
            continue
        env: dict[str, np.ndarray] = {}
        weight = 1.0
        for j, step in enumerate(model.steps):
            if j not in keep:
                p = float(step.p.evaluate(env, 1)[0])
                weight *= p if values[j] == 1 else 1 - p
            env[step.name] = np.array([float(values[j])])
        total += weight * bool(model.bad.evaluate(env, 1)[0])
    return total


def _brute_shapley(model: SCM, players: str) -> list[float]:
    """Shapley values as the average marginal over all m! orders (the textbook definition)."""
    group = players_of(model, players)
    phi = [0.0] * len(group)
    orders = list(itertools.permutations(range(len(group))))
    for order in orders:
        kept: set[int] = set()
        before = _brute_p_bad(model, kept)
        for g in order:
            kept |= set(group[g].steps)
            after = _brute_p_bad(model, kept)
            phi[g] += (after - before) / len(orders)
            before = after
    return phi


_P_FORMS = [
    "{c}",
    "{c} if {a} else {d}",
    "min(1, {c} + {d} * {a})",
    "max({c}, {d}) if not {a} else {c} * {d}",
    "{c} + ({d} - {c}) * ({a} and {b})",
    "{d} if {a} or {b} else {c}",
]


@st.composite
def random_scm(draw: st.DrawFn) -> str:
    n = draw(st.integers(2, 5))
    names = [f"s{j}" for j in range(n)]
    agents = ["red", "blue", None]
    lines = ["name: random", "steps:"]
    for j, name in enumerate(names):
        form = draw(st.sampled_from(_P_FORMS if j >= 1 else _P_FORMS[:1]))
        if "{b}" in form and j < 2:
            form = _P_FORMS[1]
        earlier = names[:j] or ["0"]
        c = draw(st.sampled_from([0.1, 0.3, 0.5, 0.8]))
        d = draw(st.sampled_from([0.2, 0.6, 0.9]))
        p = form.format(
            a=draw(st.sampled_from(earlier)), b=draw(st.sampled_from(earlier)), c=c, d=d
        )
        lines += [f"  - name: {name}", f'    p: "{p}"']
        agent = draw(st.sampled_from(agents))
        if agent:
            lines.append(f"    agent: {agent}")
    bad = draw(st.sampled_from(["{x} and {y}", "{x} or {y}", "{x} + {y} >= 1", "{y}"]))
    bad = bad.format(x=draw(st.sampled_from(names)), y=names[-1])
    lines += [f'bad: "{bad}"', f"factual: {[1] * n}"]
    return "\n".join(lines)


@settings(max_examples=60, deadline=None)
@given(random_scm())
def test_exact_truth_matches_brute_force(text: str) -> None:
    """Vectorised enumeration equals a plain probability-tree walk, for v(S) and for Shapley."""
    try:
        model = load_scm(text)
    except ConfigError:
        return  # a drawn factual run of probability 0 or not bad: refused, as it must be
    for size in range(model.n_steps + 1):
        for keep in itertools.combinations(range(model.n_steps), size):
            assert model.p_bad(keep) == pytest.approx(_brute_p_bad(model, set(keep)), abs=1e-12)
    for players in ("steps", "agents"):
        exact = list(model.exact_shapley(players).values())
        assert exact == pytest.approx(_brute_shapley(model, players), abs=1e-12)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_runs_match_exact_probabilities(name: str) -> None:
    """Vectorised forward runs hit P(bad | keep S) of every S within 4.5 standard errors."""
    model = MODELS[name]
    rng = np.random.default_rng(20260609)
    runs = 20_000
    for keep in [
        (),
        *[tuple(range(k)) for k in range(1, model.n_steps + 1)],
        (0, model.n_steps - 1),
    ]:
        seeds = rng.integers(0, 2**63, size=runs)
        bad = model.run_batch([ForwardRequest(frozenset(keep), int(s)) for s in seeds])
        exact = model.p_bad(keep)
        se = math.sqrt(max(exact * (1 - exact), 1e-12) / runs)
        assert abs(np.mean(bad) - exact) <= 4.5 * se + 1e-12, (name, keep, np.mean(bad), exact)


# --- random numbers --------------------------------------------------------------------------


def test_uniforms_are_uniform_and_independent_across_steps() -> None:
    """The (seed, step) hash gives uniforms (KS test) that are uncorrelated across steps."""
    seeds = seeds_array(list(range(50_000)))
    u = [uniforms(seeds, j) for j in range(4)]
    for row in u:
        assert kstest(row, "uniform").pvalue > 1e-3
    for a, b in itertools.combinations(u, 2):
        assert abs(np.corrcoef(a, b)[0, 1]) < 0.02


def test_common_random_numbers_share_draws_step_by_step() -> None:
    """Two requests with one branch seed re-decide shared steps identically."""
    model = load_scm(
        PIVOT.replace('p: "decide_refund"', "p: 0.5").replace(
            'bad: "issue_refund"', 'bad: "greet or issue_refund"'
        )
    )
    keep = np.array([[False, True, False], [False, False, False]])
    for seed in range(200):
        seeds = seeds_array([seed, seed])
        env_draws = [uniforms(seeds, j) for j in range(3)]
        assert env_draws[0][0] == env_draws[0][1]
        assert env_draws[2][0] == env_draws[2][1]
        out = model.simulate(keep, seeds)
        # keeping decide_refund changes neither greet nor issue_refund's draw, nor the outcome
        assert out[0] == out[1]


def test_run_batch_refuses_steps_outside_the_model() -> None:
    """A request keeping a step the model does not have is an InterventionError."""
    with pytest.raises(InterventionError, match=r"steps 0\.\.2, a request keeps step 7"):
        MODELS["refund_pivot"].run_batch([ForwardRequest(frozenset({7}), 1)])


# --- the expression language ----------------------------------------------------------------

GOOD_EXPRESSIONS = [
    ("0.25", {}, 0.25),
    ("1e-1 + .5", {}, 0.6),
    ("a", {"a": 1}, 1),
    ("not a", {"a": 1}, 0),
    ("a and b", {"a": 1, "b": 0}, 0),
    ("a or b", {"a": 0, "b": 1}, 1),
    ("0.3 and 0.7", {}, 0.7),  # Python's meaning: the last operand evaluated
    ("0 or 0.4", {}, 0.4),
    ("not a == b", {"a": 1, "b": 1}, 0),  # not binds looser than ==
    ("1 + 2 * 3 - 4 / 2", {}, 5),
    ("-a + 1", {"a": 1}, 0),
    ("(1 + 2) * 3", {}, 9),
    ("0.9 if a else 0.1", {"a": 0}, 0.1),
    ("0.9 if a else 0.5 if b else 0.1", {"a": 0, "b": 1}, 0.5),  # right-associative
    ("a + b >= 1", {"a": 0, "b": 1}, 1),
    ("0 < a < 2", {"a": 1}, 1),  # comparisons chain
    ("0 < a < 1", {"a": 1}, 0),
    ("a != b", {"a": 1, "b": 0}, 1),
    ("min(a, b, 0.5)", {"a": 1, "b": 1}, 0.5),
    ("max(0.1, 0.2 * a)", {"a": 1}, 0.2),
    ("a or b and c", {"a": 0, "b": 1, "c": 0}, 0),  # and binds tighter than or
]


@pytest.mark.parametrize(("source", "env", "expected"), GOOD_EXPRESSIONS)
def test_expression_values(source: str, env: dict[str, float], expected: float) -> None:
    """The expression language evaluates with Python's precedence and meaning."""
    expr = compile_expr(source, known=["a", "b", "c"], where="t")
    arrays = {k: np.array([float(v)]) for k, v in env.items()}
    arrays.update({k: np.array([0.0]) for k in "abc" if k not in env})
    assert float(expr.evaluate(arrays, 1)[0]) == pytest.approx(expected)


BAD_EXPRESSIONS = [
    ("a **2", r"unexpected token '\*\*' at column 3 \(powers are not supported\)"),
    ("a = 1", r"unexpected token '=' at column 3 \(did you mean '=='\?\)"),
    ("a && b", r"unexpected token '&&' at column 3 \(use 'and'\)"),
    ("", r"empty expression"),
    ("a and", r"unexpected end of expression at column 6"),
    ("(a", r"unexpected end of expression at column 3 \(expected '\)'\)"),
    ("a)", r"unexpected token '\)' at column 2"),
    ("a b", r"unexpected token 'b' at column 3"),
    ("zz + 1", r"unknown name 'zz' at column 1 \(known: a, b, c\)"),
    ("later", r"name 'later' at column 1 is a later step"),
    ("abs(a)", r"unknown function 'abs' at column 1 \(known: min, max\)"),
    ("min(a)", r"min\(\) at column 1 needs at least 2 arguments"),
    ("max + 1", r"max\(\) must be called"),
    ("a if b", r"unexpected end of expression at column 7 \(expected 'else'\)"),
    ("a $ b", r"unexpected character '\$' at column 3"),
    ("__import__(a)", r"unknown function '__import__' at column 1"),
    ("open('x')", r"unexpected character \"'\" at column 6"),
    ("a.b", r"unexpected token '.' at column 2"),
    ("1 2", r"unexpected token '2' at column 3"),
    ("else", r"unexpected token 'else' at column 1"),
]


@pytest.mark.parametrize(("source", "match"), BAD_EXPRESSIONS)
def test_expression_errors(source: str, match: str) -> None:
    """Bad expressions are ConfigErrors that quote the offending token and its column."""
    with pytest.raises(ConfigError, match=r"^model 'x', step 'y', field 'p': " + match):
        compile_expr(
            source, known=["a", "b", "c"], later=["later"], where="model 'x', step 'y', field 'p'"
        )


# --- loading and its errors -----------------------------------------------------------------


def _with(old: str, new: str) -> str:
    assert old in PIVOT
    return PIVOT.replace(old, new)


BAD_FILES = [
    (
        _with('p: "decide_refund"', 'p: "decide_refund **2"'),
        r"model 'refund_pivot', step 'issue_refund', field 'p': "
        r"unexpected token '\*\*' at column 15",
    ),
    (
        _with('p: "decide_refund"', 'p: "issue_refund"'),
        r"step 'issue_refund', field 'p': name 'issue_refund' at column 1 is a later step",
    ),
    (
        _with('p: "decide_refund"', 'p: "decide_refund + 0.5"'),
        r"step 'issue_refund', field 'p': evaluates to 1\.5 \(expected a probability in \[0, 1\]\) "
        r"when decide_refund=1",
    ),
    (
        _with('p: "decide_refund"', 'p: "1 / decide_refund"'),
        r"field 'p': evaluates to inf .* when decide_refund=0",
    ),
    (
        _with("p: 0.5\n  - name: decide", "p: 1.5\n  - name: decide"),
        r"step 'greet', field 'p': expected a probability in \[0, 1\], got 1\.5",
    ),
    (
        _with("p: 0.5\n  - name: decide", "p: yes\n  - name: decide"),
        r"step 'greet', field 'p': expected a number in \[0, 1\] or an expression string, got True",
    ),
    (
        _with("factual: [1, 1, 1]", "factual: [1, 1]"),
        r"field 'factual': has 2 values but the model has 3 steps",
    ),
    (
        _with("factual: [1, 1, 1]", "factual: [1, 0, 1]"),
        r"field 'factual': value 1 of step 'issue_refund' has probability 0",
    ),
    (
        _with("factual: [1, 1, 1]", "factual: [1, 1, 2]"),
        r"field 'factual': value of step 'issue_refund' must be 0 or 1, got 2",
    ),
    (
        _with("factual: [1, 1, 1]", "factual: [1, 0, 0]").replace('p: "decide_refund"', "p: 0.5"),
        r"field 'factual': \[1, 0, 0\] does not make bad \('issue_refund'\) true",
    ),
    (
        _with("name: decide_refund", "name: greet"),
        r"step #1, field 'name': duplicate step name 'greet' \(also step #0\)",
    ),
    (_with("name: greet", "name: and"), r"'and' is a word of the expression language"),
    (_with("name: greet", "name: 2fast"), r"a step name must be an identifier"),
    (
        _with("    agent: support", "    agnt: support"),
        r"step 'decide_refund': unknown field 'agnt' \(expected: name, p, agent\)",
    ),
    (_with("factual:", "factuals:"), r"unknown field 'factuals'"),
    (_with('bad: "issue_refund"\n', ""), r"model 'refund_pivot': missing required field 'bad'"),
    (
        _with('bad: "issue_refund"', 'bad: "issue_refund +"'),
        r"field 'bad': unexpected end of expression at column 15",
    ),
    (
        _with('bad: "issue_refund"', 'bad: "issue_refund / (greet - 1)"'),
        r"field 'bad': evaluates to .* \(expected a finite number\)",
    ),
    (_with("name: refund_pivot", "name: refund pivot"), r"field 'name': name must be letters"),
    (
        "- just\n- a list\n",
        r"expected a mapping with keys name, description, steps, bad, factual, got list",
    ),
    ("name: x\nsteps: [\n  - name: a\n", r"YAML syntax error at line \d+, column \d+"),
    (
        "name: x\nsteps: []\nbad: '1'\nfactual: []\n",
        r"field 'steps': expected a non-empty list of steps",
    ),
]


@pytest.mark.parametrize(("text", "match"), BAD_FILES)
def test_scm_file_errors(text: str, match: str) -> None:
    """Every malformed SCM file is one ConfigError line naming model, step and field."""
    with pytest.raises(ConfigError, match=match) as info:
        load_scm(text)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("<text>")


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    """Errors from a file start with its path; a YAML syntax error gives the line."""
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nsteps:\n  - name: a\n    p: [0.5\n")
    with pytest.raises(ConfigError, match=rf"^{path}: YAML syntax error at line 5"):
        load_scm(path)
    with pytest.raises(ConfigError, match=r"cannot read SCM file '.*missing\.yaml'"):
        load_scm(str(tmp_path / "missing.yaml"))


def test_load_from_path_and_find_model(tmp_path: Path) -> None:
    """A model loads from a path or by built-in name; an unknown name lists the built-ins."""
    path = tmp_path / "mine.yaml"
    path.write_text(PIVOT)
    assert load_scm(str(path)).name == "refund_pivot"
    assert find_model(str(path)).source == str(path)
    assert find_model("and_interaction").name == "and_interaction"
    with pytest.raises(
        ConfigError,
        match=r"no built-in model or SCM file named 'nope' \(built-in models: and_interaction, ",
    ):
        find_model("nope")


def test_exact_truth_is_refused_for_large_models() -> None:
    """Above 20 steps a model still runs forward but exact truth is refused with a reason."""
    steps = "\n".join(f"  - name: s{j}\n    p: 0.5" for j in range(21))
    model = load_scm(f"name: big\nsteps:\n{steps}\nbad: s20\nfactual: {[1] * 21}\n")
    assert len(model.run_batch([ForwardRequest(frozenset(), 3)])) == 1
    with pytest.raises(
        ConfigError, match=r"model 'big' has 21 steps; exact ground truth .* refused above 20 steps"
    ):
        model.exact_locus()


def test_exact_shapley_is_refused_beyond_the_term_limit() -> None:
    """Exact Shapley over 16 step-players (3^16 terms) is refused; over agents it may fit."""
    steps = "\n".join(f"  - name: s{j}\n    p: 0.5\n    agent: a{j % 2}" for j in range(16))
    model = load_scm(f"name: wide\nsteps:\n{steps}\nbad: s15\nfactual: {[1] * 16}\n")
    with pytest.raises(ConfigError, match=r"needs 43,046,721 enumeration terms, above the limit"):
        model.exact_shapley("steps")
