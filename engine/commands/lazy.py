"""`car`'s command group, loading only the command that runs.

Building all ~25 click commands and importing every command module took ~0.1 s of each
start-up, though one command runs. The group lists every command from `COMMANDS` (name, the
module whose `register(app)` adds it, its one-line help) and imports a module, and builds the
click command, only when that command is looked up: to run it, or for its own `--help`. `car
--help` prints the one-line helps from the table without importing anything;
`tests/test_cli_start.py` keeps the table equal to what the modules register and `car --help`
equal to the help of the group built from every module.

A new command in a module of engine/commands gets a row here, in the place `car --help` lists
it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator, MutableMapping
from typing import Any

import typer
from typer.core import TyperGroup

try:  # typer vendors click in recent releases; older ones use click itself
    from typer._click.utils import make_default_short_help
except ImportError:  # pragma: no cover
    from click.utils import make_default_short_help  # type: ignore[no-redef]

#: Every command that a module of engine/commands registers, in `car --help` order after the
#: commands cli.py defines itself: (name, module, the first paragraph of its help).
COMMANDS: tuple[tuple[str, str, str], ...] = (
    (
        "accuse",
        "engine.commands.counterfactual",
        "Name the mole: SUCCESS (right), FAILURE (wrong agent), BUSTED (nobody named).",
    ),
    (
        "fidelity",
        "engine.commands.counterfactual",
        "Re-execute every step with its recorded seed and context: the action-match rate.",
    ),
    (
        "fork",
        "engine.commands.counterfactual",
        "Fork N branches at step k with one do() intervention; the outcome distribution.",
    ),
    (
        "validate",
        "engine.commands.counterfactual",
        "Run both estimators on synthetic causal models and compare with exact ground truth.",
    ),
    (
        "attribute",
        "engine.commands.counterfactual",
        "Which step (or agent) caused the failure: counterfactual forward runs, ranked.",
    ),
    (
        "detect",
        "engine.commands.detect",
        "Which agent sabotaged the run? Reads the public view only (causal also re-executes "
        "the crew; replay re-decides each step with its recorded seed, so it needs an accused "
        "run or --reveal); `confidence` is a calibrated probability.",
    ),
    (
        "detect-eval",
        "engine.commands.detect",
        "Accuracy of the detector over many games: top-1 with a 95% interval vs random, "
        "AUROC, calibration (Brier, reliability), confusion, cost. Records into --journal, or"
        " recordings/detect-eval.db when none is given. --runs scores recorded games that were"
        " accused or recorded by detect-eval (others with --reveal: the report shows moles).",
    ),
    (
        "export",
        "engine.commands.traces",
        "Export a run as an OpenTelemetry trace (gen_ai.* and OpenInference attributes).",
    ),
    (
        "import",
        "engine.commands.traces",
        "Import OpenTelemetry traces of an LLM program as runs (one run per trace).",
    ),
    (
        "diff",
        "engine.commands.traces",
        "Compare two runs: the first step where they part, then word diffs step by step.",
    ),
    (
        "serve",
        "engine.commands.serve",
        "Serve the dashboard and the API (http://127.0.0.1:8008, API docs at /docs).",
    ),
    (
        "record",
        "engine.commands.program",
        "Run a program with its OpenAI calls recorded through a local proxy, as one run.",
    ),
    (
        "replay",
        "engine.commands.program",
        "Re-run a recorded program with every call answered from the journal: its fidelity.",
    ),
    (
        "runs",
        "engine.commands.journal",
        "List recorded runs (newest last); branches are shown under their parents with --all.",
    ),
    (
        "verify",
        "engine.commands.journal",
        "Check the journal without changing it: every hash, row, column and snapshot.",
    ),
    (
        "anchor",
        "engine.commands.journal",
        "Write keyed digests of every run's head, to keep somewhere the journal's writers cannot.",
    ),
    ("db", "engine.commands.journal", "The journal database itself."),
)


#: The commands cli.py defines itself (`defer(app)` takes them out of the app), by name.
OWN: dict[str, Any] = {}


def defer(app: typer.Typer) -> None:
    """Build the commands registered on `app` itself lazily too: typer would build every one
    of them with the group (evaluating all their annotations) though one runs."""
    for info in app.registered_commands:
        assert info.callback is not None
        OWN[info.name or typer.main.get_command_name(info.callback.__name__)] = info
    app.registered_commands = []


def _one_line(name: str) -> str:
    """The help text `car --help` shortens for a command that is not built yet."""
    if name in OWN:
        info = OWN[name]
        return str(info.help or inspect.getdoc(info.callback) or "")
    return next(h for n, _, h in COMMANDS if n == name)


class _Commands(MutableMapping[str, Any]):
    """The group's commands by name: the ones built so far, and the names of the others
    (in listing order), built from their module on first lookup."""

    def __init__(self, group: LazyGroup, built: dict[str, Any]) -> None:
        self._group = group
        self._built = dict(built)
        names = [*built, *OWN, *(name for name, _, _ in COMMANDS)]
        self._order = list(dict.fromkeys(names))

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            if name not in self._order:
                raise KeyError(name)
            self._built[name] = self._group._load(name)
        return self._built[name]

    def __setitem__(self, name: str, command: Any) -> None:
        if name not in self._order:
            self._order.append(name)
        self._built[name] = command

    def __delitem__(self, name: str) -> None:
        self._order.remove(name)
        self._built.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._order

    def loaded(self, name: str) -> Any | None:
        return self._built.get(name)


class LazyGroup(TyperGroup):
    """The `car` group: cli.py's own commands at once, the modules' commands on demand."""

    def __init__(self, *, commands: Any = None, **attrs: Any) -> None:
        super().__init__(commands=commands, **attrs)
        self.commands = _Commands(self, dict(self.commands))

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)

    def _load(self, name: str) -> Any:
        """Import the module of `name` and build that one click command (or group)."""
        # as typer builds the commands of an app: the root's markup mode, short tracebacks
        settings: dict[str, Any] = {
            "pretty_exceptions_short": True,
            "rich_markup_mode": self.rich_markup_mode,
        }
        if name in OWN:
            return typer.main.get_command_from_info(OWN[name], **settings)
        module = next(m for n, m, _ in COMMANDS if n == name)
        stub = typer.Typer()
        importlib.import_module(module).register(stub)
        for info in stub.registered_commands:
            assert info.callback is not None
            if (info.name or typer.main.get_command_name(info.callback.__name__)) == name:
                return typer.main.get_command_from_info(info, **settings)
        for group_info in stub.registered_groups:
            if group_info.name == name:
                return typer.main.get_group_from_info(
                    group_info, suggest_commands=self.suggest_commands, **settings
                )
        raise LookupError(f"{module}.register() adds no command {name!r}")  # pragma: no cover

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        # TyperGroup's listing, with the one-line help of a command not built yet taken from
        # the table (the same text, shortened by the same rule)
        commands = self.commands
        assert isinstance(commands, _Commands)
        rows: list[tuple[str, Any]] = []
        for name in self.list_commands(ctx):
            cmd = commands.loaded(name)
            if cmd is None or not cmd.hidden:
                rows.append((name, cmd))
        if not rows:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in rows)
        lines = [
            (name, make_default_short_help(_one_line(name), limit))
            if cmd is None
            else (name, cmd.get_short_help_str(limit))
            for name, cmd in rows
        ]
        with formatter.section("Commands"):
            formatter.write_dl(lines)
