"""SCMs where mutation testing looks for unchecked code: the counter-based random numbers
pinned against SplitMix64 written out in plain Python, seeds that wrap, the listing's plain
data, and the loader's less common refusals, each message in full."""

from __future__ import annotations

import pytest

from engine.attribution import ForwardRequest
from engine.attribution.scm import builtin_models, load_scm, model_summary, seeds_array, uniforms
from engine.errors import ConfigError, InterventionError

MASK = (1 << 64) - 1


def mix(z: int) -> int:
    """SplitMix64's finaliser on Python ints (wrapping at 64 bits)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def uniform_by_hand(seed: int, step: int) -> float:
    """The documented draw of step j for branch seed b: key = mix(b ^ C), then
    mix(key + (j + 1) x golden ratio) >> 11, scaled by 2^-53."""
    key = mix((seed & MASK) ^ 0x5851F42D4C957F2D)
    z = mix((key + (((step + 1) * 0x9E3779B97F4A7C15) & MASK)) & MASK)
    return (z >> 11) * 2.0**-53


def test_uniforms_are_splitmix64_of_seed_and_step() -> None:
    """Each uniform equals the hand-written SplitMix64 draw of (seed, step), bit for bit."""
    seeds = [0, 1, 7, 2**63 - 1, 2**64 - 1, 123456789]
    arr = seeds_array(seeds)
    for step in (0, 1, 5, 40):
        assert uniforms(arr, step).tolist() == [uniform_by_hand(s, step) for s in seeds]


def test_seeds_wrap_modulo_two_to_the_64() -> None:
    """Negative and huge branch seeds wrap to unsigned 64-bit words."""
    assert seeds_array([-1, 2**64 + 5, 3]).tolist() == [2**64 - 1, 5, 3]
    assert seeds_array([5]).tolist() == [5]


def test_forward_runs_follow_the_draws() -> None:
    """A free step is 1 exactly when its draw is below p: the outcome of a one-step model
    with p = 0.3 follows the hand-written draws seed by seed."""
    model = load_scm("name: one\nsteps:\n  - {name: a, p: 0.3}\nbad: a\nfactual: [1]\n")
    seeds = list(range(200))
    got = model.run_batch([ForwardRequest(frozenset(), s) for s in seeds])
    assert got == [uniform_by_hand(s, 0) < 0.3 for s in seeds]
    kept = model.run_batch([ForwardRequest(frozenset({0}), s) for s in seeds])
    assert kept == [True] * 200


def test_model_summary_is_plain_data() -> None:
    """The listing names the model, its description, each step's p source and agent, the
    outcome's source, the factual run and where it came from."""
    model = next(m for m in builtin_models() if m.name == "refund_pivot")
    assert model_summary(model) == {
        "name": "refund_pivot",
        "description": model.description,
        "steps": [
            {"name": "greet", "p": "0.5", "agent": "support"},
            {"name": "decide_refund", "p": "0.5", "agent": "support"},
            {"name": "issue_refund", "p": "decide_refund", "agent": "payments"},
        ],
        "bad": "issue_refund",
        "factual": [1, 1, 1],
        "source": "builtin:refund_pivot.yaml",
    }


def test_a_negative_kept_step_is_refused() -> None:
    """A request keeping step -1 is an InterventionError naming the model's steps."""
    model = next(m for m in builtin_models() if m.name == "refund_pivot")
    with pytest.raises(
        InterventionError,
        match=r"^model 'refund_pivot' has steps 0\.\.2, a request keeps step -1$",
    ):
        model.run_batch([ForwardRequest(frozenset({-1}), 1)])


REFUSED = [
    (
        "name: x\ndescription: [1]\nsteps:\n  - {name: a, p: 0.5}\nbad: a\nfactual: [1]\n",
        r"^<text>: model 'x', field 'description': expected text, got \[1\]$",
    ),
    (
        "name: x\nsteps:\n  - {name: a, p: 0.5, agent: ' '}\nbad: a\nfactual: [1]\n",
        r"^<text>: model 'x', step 'a', field 'agent': expected an agent name, got ' '$",
    ),
    (
        "name: 5\nsteps:\n  - {name: a, p: 0.5}\nbad: a\nfactual: [1]\n",
        r"^<text>: field 'name': name must be letters, digits, '_', '\.' or '-', got 5$",
    ),
    (
        "name: x\nsteps:\n  - {name: a, p: 0.5}\nbad: 1\nfactual: [1]\n",
        r"^<text>: model 'x', field 'bad': expected an expression string, got 1$",
    ),
    (
        "name: x\nsteps:\n  - {name: a, p: 0.5}\nbad: a\nfactual: 1\n",
        r"^<text>: model 'x', field 'factual': expected a list of 0/1 values, got 1$",
    ),
    (
        "name: x\nsteps:\n  - {name: a, p: 0.5}\nbad: a\nfactual: [true]\n",
        r"^<text>: model 'x', field 'factual': value of step 'a' must be 0 or 1, got True$",
    ),
    (
        "name: x\nsteps:\n  - 7\nbad: a\nfactual: [1]\n",
        r"^<text>: model 'x', step #0: expected a mapping with name and p, got 7$",
    ),
    (
        "name: x\nsteps:\n  - {p: 0.5}\nbad: a\nfactual: [1]\n",
        r"^<text>: model 'x', step #0: missing required field 'name'$",
    ),
    (
        "name: x\nsteps:\n  - {name: min, p: 0.5}\nbad: a\nfactual: [1]\n",
        r"^<text>: model 'x', step #0, field 'name': 'min' is a word of the expression language "
        r"and cannot name a step$",
    ),
    (
        "name: x\nsteps:\n  - {name: a, p: .nan}\nbad: a\nfactual: [1]\n",
        r"^<text>: model 'x', step 'a', field 'p': expected a probability in \[0, 1\], got nan$",
    ),
    (
        "name: x\nsteps:\n  - {name: a, p: 0}\nbad: a\nfactual: [1]\n",
        r"^<text>: model 'x', field 'factual': value 1 of step 'a' has probability 0 under its p "
        r"given the earlier factual values; a recorded run cannot contain it$",
    ),
    (
        "name: x\nsteps:\n  - {name: a, p: 1}\nbad: '1'\nfactual: [0]\n",
        r"^<text>: model 'x', field 'factual': value 0 of step 'a' has probability 0",
    ),
    ("name: x\nsteps: " + "[" * 2000, r"^<text>: the YAML nests too deeply to be a model file$"),
]


@pytest.mark.parametrize(("text", "match"), REFUSED)
def test_loader_refusals_in_full(text: str, match: str) -> None:
    """Each malformed model is one ConfigError line, prefixed with the file, model, step and
    field it concerns."""
    with pytest.raises(ConfigError, match=match):
        load_scm(text)


def test_an_expression_reading_too_many_steps_is_refused() -> None:
    """An expression over more than 20 earlier steps cannot be checked on every input: it is
    refused, saying how many it reads."""
    steps = "\n".join(f"  - {{name: s{j}, p: 0.5}}" for j in range(21))
    text = f"name: x\nsteps:\n{steps}\nbad: '{' + '.join(f's{j}' for j in range(21))}'\n"
    text += f"factual: {[1] * 21}\n"
    with pytest.raises(
        ConfigError,
        match=r"^<text>: model 'x', field 'bad': reads 21 steps; checking it needs all 2\^21 "
        r"inputs and is refused above 20$",
    ):
        load_scm(text)


def test_a_missing_yaml_path_is_a_clear_error(tmp_path: object) -> None:
    """A one-line string ending in .yaml is read as a path; a missing one says so."""
    with pytest.raises(ConfigError, match=r"^cannot read SCM file 'nowhere/x\.yml': "):
        load_scm("nowhere/x.yml")


def test_exact_values_add_up_across_enumeration_chunks() -> None:
    """With 11 step-players the enumeration has 3^11 = 177,147 terms, more than one chunk of
    2^16: every v(S) still equals P(bad | keep S) computed on its own (2^(11 - |S|) terms)."""
    steps = ["  - {name: s0, p: 0.5}"] + [
        f"  - {{name: s{j}, p: '0.3 if s{j - 1} else 0.6'}}" for j in range(1, 11)
    ]
    model = load_scm(
        "name: chunks\nsteps:\n" + "\n".join(steps) + "\nbad: 's9 and s10 or s0 and s5'\n"
        f"factual: {[1] * 11}\n"
    )
    values = model.exact_values("steps")
    assert len(values) == 2**11
    for mask in range(0, 2**11, 7):
        keep = [j for j in range(11) if mask >> j & 1]
        assert values[mask] == pytest.approx(model.p_bad(keep), abs=1e-12), mask
