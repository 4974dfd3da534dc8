"""The core is scenario-agnostic: no core module imports the heist (or a module that moved into
it), the heist is loaded only through the registries' lazy references, and the scenario
registry refuses a name it does not know with one line."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ConfigError, UnknownScenario
from engine.scenario import BUILTIN_SCENARIOS, scenario_factory, scenario_names

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"

#: The core: everything in engine/ but the heist and its own consumers (the mole detector,
#: the mole game's server, the CLI commands).
NOT_CORE = ("heist", "detect", "server", "commands")
#: Modules that moved into engine/heist/ (or out of the sim): nothing may import them by
#: their old paths.
MOVED = ("engine.policies.sim", "engine.attribution.heist_model", "engine.attribution.heist_report")
#: The only places the core names a heist module: lazy "module:attr" references of the
#: registries, loaded when a run asks for the scenario or the policy.
REGISTRY_TABLES = {
    "engine/scenario.py": "BUILTIN_SCENARIOS",
    "engine/policies/registry.py": "BUILTIN_POLICIES",
}


def core_modules() -> list[Path]:
    mods = [
        p for p in sorted(ENGINE.rglob("*.py")) if p.relative_to(ENGINE).parts[0] not in NOT_CORE
    ]
    assert len(mods) > 30  # the walk found the core, not an empty directory
    return mods


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(tree: ast.AST, here: str) -> list[tuple[int, str]]:
    """Every module an import statement (or importlib.import_module("...")) names."""
    found: list[tuple[int, str]] = []
    package = here.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def forbidden(name: str) -> bool:
    return (
        name == "engine.heist"
        or name.startswith("engine.heist.")
        or any(name == m or name.startswith(m + ".") for m in MOVED)
    )


def test_no_core_module_imports_the_heist() -> None:
    """Parsed with ast, no module of the core imports engine.heist or a moved module path."""
    offenders = []
    for path in core_modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in imported_names(tree, module_name(path)):
            if forbidden(name):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: imports {name}")
    assert offenders == []


def test_the_checker_sees_every_kind_of_import() -> None:
    """The import walk catches plain, from-, relative, in-function and importlib imports."""
    src = (
        "import engine.heist.world\n"
        "from engine import heist\n"
        "from ..heist import sim\n"
        "def f():\n    from engine.policies.sim import SimPolicy\n"
        "import importlib\nimportlib.import_module('engine.attribution.heist_model')\n"
    )
    names = [n for _, n in imported_names(ast.parse(src), "engine.policies.registry")]
    assert sorted({n for n in names if forbidden(n)}) == [
        "engine.attribution.heist_model",
        "engine.heist",
        "engine.heist.sim",
        "engine.heist.world",
        "engine.policies.sim",
        "engine.policies.sim.SimPolicy",
    ]


def test_moved_modules_are_gone() -> None:
    """The sim lives in engine/heist/, not at its old path; forks and attribution are the
    core's (engine/branching.py), through the Scenario protocol, not the heist's."""
    for name in MOVED:
        assert not (ROOT / (name.replace(".", "/") + ".py")).exists(), name
    assert (ENGINE / "heist" / "sim.py").exists()
    for gone in ("forward_model.py", "attribution.py"):
        assert not (ENGINE / "heist" / gone).exists(), gone
    assert (ENGINE / "branching.py").exists()


def test_only_the_registry_tables_name_heist_modules() -> None:
    """Outside the heist, a heist module is named only as a lazy reference in the scenario
    and policy registries' built-in tables."""
    offenders = []
    for path in core_modules():
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), filename=rel)
        allowed: set[int] = set()
        table = REGISTRY_TABLES.get(rel)
        for node in ast.walk(tree):
            if (
                table is not None
                and isinstance(node, ast.AnnAssign | ast.Assign)
                and any(
                    isinstance(t, ast.Name) and t.id == table
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                )
                and node.value is not None
            ):
                allowed |= {id(c) for c in ast.walk(node.value)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and "engine.heist" in node.value
                and id(node) not in allowed
            ):
                offenders.append(f"{rel}:{node.lineno}: {node.value[:60]!r}")
    assert offenders == []


def test_core_imports_load_no_heist_module() -> None:
    """Importing every core module (and building a non-sim policy) in a fresh interpreter
    loads no heist module: the registries' references stay unloaded until a run asks."""
    names = [module_name(p) for p in core_modules()]
    code = (
        "import importlib, json, sys\n"
        f"for n in {names!r}:\n    importlib.import_module(n)\n"
        "from engine.policies.registry import make_policy\n"
        "make_policy({'name': 'openai'})\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('engine.heist'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == []


def test_registry_finds_the_heist_by_its_recorded_name() -> None:
    """The name the heist's runs record, "heist", resolves lazily to its scenario class."""
    assert BUILTIN_SCENARIOS["heist"] == "engine.heist.session:HeistScenario"
    from engine.heist import HeistScenario

    assert scenario_factory("heist") is HeistScenario
    assert "heist" in scenario_names()


@pytest.mark.parametrize("name", ["nope", "", "Heist"])
def test_registry_refuses_an_unknown_scenario(name: str) -> None:
    """An unknown scenario name is an UnknownScenario (a ConfigError): one line naming it and
    the known scenarios."""
    with pytest.raises(UnknownScenario) as info:
        scenario_factory(name)
    msg = str(info.value)
    assert isinstance(info.value, ConfigError)
    assert "\n" not in msg
    assert msg.startswith("unknown scenario ") and "known scenarios: heist" in msg
    assert (repr(name) if name else "(none recorded)") in msg


def test_heist_public_names_resolve() -> None:
    """Every name engine.heist exports (what its consumers use) resolves to the object of the
    heist module that defines it; an unknown name is an AttributeError."""
    import importlib

    import engine.heist as heist

    for name in heist.__all__:
        obj = getattr(heist, name)
        assert obj is getattr(importlib.import_module(heist._EXPORTS[name]), name)
    assert sorted(heist._EXPORTS) == sorted(heist.__all__)
    with pytest.raises(AttributeError):
        heist.nope  # noqa: B018
