"""What a short command loads at start-up: only its own command, no pydantic, and the same
help, values and errors as the group built from every command module."""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import cli
from engine.commands import coerce, lazy
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal

ROOT = Path(__file__).resolve().parent.parent


def _registered(module: str) -> dict[str, str]:
    """name -> full help of every command and group that `module.register(app)` adds."""
    stub = typer.Typer(rich_markup_mode=None)
    importlib.import_module(module).register(stub)
    found: dict[str, str] = {}
    for info in stub.registered_commands:
        assert info.callback is not None
        name = info.name or typer.main.get_command_name(info.callback.__name__)
        found[name] = info.help or inspect.getdoc(info.callback) or ""
    for group in stub.registered_groups:
        built = typer.main.get_group_from_info(
            group, pretty_exceptions_short=True, rich_markup_mode=None, suggest_commands=True
        )
        assert group.name is not None
        found[group.name] = built.help or ""
    return found


def _first_paragraph(text: str) -> str:
    return " ".join(text.split("\n\n")[0].split())


def test_the_table_lists_every_registered_command_with_its_help() -> None:
    """Every module of engine/commands with a register() is in the table with exactly the
    commands it registers, each with the first paragraph of its own help (what `car --help`
    shortens), and nothing else is."""
    modules = sorted(
        f"engine.commands.{p.stem}"
        for p in (ROOT / "engine" / "commands").glob("*.py")
        if "def register(" in p.read_text()
    )
    table = {(name, module): text for name, module, text in lazy.COMMANDS}
    expected = {}
    for module in modules:
        for name, text in _registered(module).items():
            expected[(name, module)] = _first_paragraph(text)
    assert table == expected


def _eager_help(args: list[str]) -> str:
    """The help text of the group built the ordinary typer way, from every module."""
    app = typer.Typer(
        rich_markup_mode=None,
        help=cli.app.info.help,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )
    app.callback()(cli.app.registered_callback.callback)  # type: ignore[union-attr]
    for info in lazy.OWN.values():
        app.registered_commands.append(info)
    for module in dict.fromkeys(m for _, m, _ in lazy.COMMANDS):
        importlib.import_module(module).register(app)
    res = CliRunner().invoke(app, args, prog_name="car", terminal_width=100)
    return res.output


@pytest.mark.parametrize("args", [["--help"], ["db", "--help"], ["state", "--help"]])
def test_help_is_the_help_of_the_eagerly_built_group(args: list[str]) -> None:
    """`car --help` (from the table, nothing imported) and a command's help (built on
    demand) print what the group built from every module prints, in the same order."""
    res = CliRunner().invoke(cli.app, args, prog_name="car", terminal_width=100)
    assert res.exit_code == 0, res.output
    assert res.output == _eager_help(args)
    assert "Commands:" in res.output or "Options:" in res.output


def test_the_group_help_lists_every_command_in_order() -> None:
    """The listing names cli.py's own commands first, then the table's, each once."""
    res = CliRunner().invoke(cli.app, ["--help"], prog_name="car", terminal_width=200)
    listed = [
        line.split()[0]
        for line in res.output.split("Commands:")[1].splitlines()
        if line.startswith("  ")
    ]
    assert listed == [*lazy.OWN, *(n for n, _, _ in lazy.COMMANDS)]


def test_a_typo_still_suggests_the_command() -> None:
    """An unknown command is a usage error that suggests the near names, lazy ones too."""
    res = subprocess.run(
        [sys.executable, "-m", "cli", "atribute", "x"], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 2
    assert "No such command 'atribute'" in res.stderr and "'attribute'" in res.stderr


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("start") / "j.db"
    with Journal(path) as j:
        run = record_heist(j, SimPolicy(), seed=7, rounds=1).run_id
    return path, run


def _probe(heavy: tuple[str, ...]) -> str:
    """A `python -c` program: `car` with its arguments, then a line on stderr naming which of
    the modules `heavy` the process had loaded by its end."""
    return f"""
import atexit, sys
sys.argv = ["car", *sys.argv[1:]]
heavy = {heavy!r}
# an exit hook: the command's end runs them (also when it skips the interpreter's teardown)
atexit.register(lambda: sys.stderr.write(
    "LOADED " + ",".join(m for m in heavy if m in sys.modules) + "\\n"))
import cli
cli.main()
"""


_PROBE = _probe(
    (
        *("pydantic", "sqlalchemy", "alembic", "scipy", "numpy"),
        *("engine.commands.counterfactual", "engine.commands.detect", "engine.commands.program"),
        *("engine.commands.traces", "engine.commands.serve", "engine.heist.session"),
        *("rich", "yaml", "multiprocessing", "importlib.metadata"),
    )
)


@pytest.mark.parametrize(
    ("argv", "allowed"),
    [
        (["state", "RUN", "--at", "3"], {"rich"}),
        (["state", "RUN", "--at", "3", "--json"], set()),
        (["runs"], {"rich"}),
        (["runs", "--json"], set()),
        (["show", "RUN"], {"rich"}),
    ],
)
def test_short_commands_import_no_heavy_library(
    journal: tuple[Path, str], argv: list[str], allowed: set[str]
) -> None:
    """`car state`, `runs` and `show` import neither pydantic (typer's converter) nor
    SQLAlchemy, Alembic, SciPy or another command's module; nor, unless they print for a
    human, rich; nor YAML (no crew is parsed), multiprocessing (no worker is forked) or
    importlib.metadata (no version is printed or recorded)."""
    path, run = journal
    args = [run if a == "RUN" else a for a in argv]
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, "--journal", str(path), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    line = next(x for x in res.stderr.splitlines() if x.startswith("LOADED "))
    loaded = {m for m in line[len("LOADED ") :].split(",") if m}
    assert loaded <= allowed, loaded
    assert res.stdout.strip(), res.stderr
    if "--json" in argv:
        data = json.loads(res.stdout)
        runs = data if isinstance(data, list) else [data]
        assert run in {r["run_id"] for r in runs}


def test_bad_values_keep_typer_own_messages(journal: tuple[Path, str]) -> None:
    """A value the plain converter does not take goes to typer's converter: the same error
    as before (pydantic's wording), exit 2, one line."""
    path, run = journal
    for value in ("x", "1.5", "-1"):
        res = subprocess.run(
            [sys.executable, "-m", "cli", "--journal", str(path), "show", run, "--depth", value],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert res.returncode == 2, res.stderr
        assert res.stderr.startswith("error: Invalid value for '--depth'"), res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


_SAMPLES = [
    "0", "7", "007", "-0", "-12", "+5", " 5", "5 ", "1_000", "5.0", "5.", ".5", "0.8",
    "-0.0", "1e3", "inf", "nan", "", "x", "١٢", "12345678901234567890", "3.14159",
]  # fmt: skip


@pytest.mark.parametrize("annotation", [str, int, float, bool])
@pytest.mark.parametrize("bounds", [(None, None), (0, None), (1, 10), (0.0, 1.0)])
def test_plain_values_convert_as_typer_own_converter_does(
    annotation: type, bounds: tuple[float | None, float | None]
) -> None:
    """Whatever the plain converter accepts, it converts to exactly (value and type) what
    typer's pydantic adapter returns for the same parameter; what the adapter rejects, the
    plain converter never accepts."""
    from pydantic import ValidationError
    from typer._adapters import build_adapter
    from typer.models import OptionInfo

    info = OptionInfo(min=bounds[0], max=bounds[1])
    adapter = build_adapter(annotation, info)
    values: list[object] = [*_SAMPLES, 0, 5, -3, 11, 0.5, 2.0, True, False]
    accepted = 0
    for value in values:
        plain = coerce.plain_value(annotation, info, value)
        if plain is coerce._MISSING:
            continue
        accepted += 1
        try:
            full = adapter.validate_python(value)
        except ValidationError:
            pytest.fail(
                f"{value!r} as {annotation.__name__}{bounds}: plain took what typer rejects"
            )
        assert (plain, type(plain)) == (full, type(full)) or (
            plain != plain and full != full  # nan
        ), value
    assert accepted > 0


def test_contrastive_attribution_does_not_load_scipy_or_numpy() -> None:
    """The modules of the default `car attribute` (contrastive) load neither SciPy nor numpy:
    its start-up is serial time in front of every worker pool (only Shapley's t quantile needs
    SciPy, its permutations numpy; the branch seeds are numpy's stream drawn in Python)."""
    probe = (
        "import sys, engine.commands.counterfactual, engine.branching, engine.attribution.report;"
        "from engine.attribution.contrastive import wilson, z_value;"
        "from engine.attribution.pcg import SeedStream;"
        "z_value(0.05); wilson(3, 16, 0.05); SeedStream(0).integers(0, 2**63, 16);"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'scipy', 'numpy'}))"
    )
    res = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert res.stdout.strip() == "[]", res.stdout


def test_default_attribution_loads_only_what_it_runs(failed_heist: tuple[Path, str]) -> None:
    """The command process of a default `car attribute -c 2` (whose start-up is serial time in
    front of its worker) loads neither SciPy nor numpy (Shapley's), the standard library's
    logging (nothing is logged at the default level), concurrent.futures (no thread pool),
    ctypes (only a forked worker sets its parent-death signal) nor the trace importer (only
    `car import` writes imported runs) — measured in the process as it ends."""
    path, run = failed_heist
    unused = ("scipy", "numpy", "logging", "concurrent.futures", "ctypes", "engine.otel.importer")
    probe = _probe(unused)
    command = ["--journal", str(path), "attribute", run, "-c", "2", "--json"]
    res = subprocess.run(
        [sys.executable, "-c", probe, *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["forward_runs"] > 0 and report["executor"]["workers"] == 2
    line = next(x for x in res.stderr.splitlines() if x.startswith("LOADED "))
    assert line == "LOADED ", line


def test_normal_quantile_agrees_with_scipy() -> None:
    """z_value (the standard library's inverse normal) equals scipy's ndtri to 1e-14 over the
    alphas the schedules use and a grid of others."""
    from scipy.special import ndtri

    from engine.attribution.contrastive import z_value

    alphas = [0.05, 0.05 * 0.05, 0.05 * 0.15, 0.05 * 0.8, 0.01, 0.1, 0.2, 0.5, 1e-6]
    alphas += [i / 1000 for i in range(1, 1000)]
    for a in alphas:
        assert z_value(a) == pytest.approx(float(ndtri(1 - a / 2)), rel=1e-14), a


_JSON_CASES = [
    {"run_id": "abc", "effect": -0.05882352941176472, "ci": (-0.1, 0.0), "n": 3},
    [{"text": "Bühne — “quoted” 東京 \u2028 tab\there", "nested": {"a": [1, 2.5, None, True]}}],
    {1: "int key", "x": float("nan"), "y": float("inf"), "empty": {}, "list": []},
    "a plain string",
    [],
]


@pytest.mark.parametrize("data", _JSON_CASES)
def test_json_into_a_pipe_is_what_rich_printed(
    data: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`emit_json` writes to a pipe without rich, byte for byte what rich's print_json
    wrote there (indented, nothing escaped that need not be, nothing wrapped) but for the
    characters a terminal would act on, which it escapes (\\u2028 here)."""
    from rich.console import Console

    from engine.commands import common

    for name in ("TTY_COMPATIBLE", "FORCE_COLOR"):
        monkeypatch.delenv(name, raising=False)
    common.emit_json(data)
    ours = capsys.readouterr().out
    Console(soft_wrap=True, width=40).print_json(json.dumps(data, default=str))
    assert ours == capsys.readouterr().out.replace("\u2028", "\\u2028")
    assert len(ours.splitlines()) >= 1


@pytest.mark.parametrize(
    ("env", "plain"),
    [
        ({}, True),
        ({"FORCE_COLOR": "1"}, False),
        ({"FORCE_COLOR": ""}, True),
        ({"TTY_COMPATIBLE": "1"}, False),
        ({"TTY_COMPATIBLE": "0", "FORCE_COLOR": "1"}, True),
    ],
)
def test_no_terminal_is_told_as_rich_tells_it(
    env: dict[str, str], plain: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where stdout/stderr is no terminal (a pipe here), JSON skips rich and the progress bar
    is a do-nothing; the variables that make rich take a pipe for a terminal (FORCE_COLOR,
    TTY_COMPATIBLE) bring rich back, as rich itself decides."""
    from rich.console import Console

    from engine.commands import common

    for name in ("TTY_COMPATIBLE", "FORCE_COLOR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with subprocess.Popen(["cat"], stdin=subprocess.PIPE) as cat:
        assert cat.stdin is not None
        assert common._plain(cat.stdin) is plain
        assert Console(file=cat.stdin).is_terminal is not plain
        cat.stdin.close()
    with common.progress() as bar:
        task = bar.add_task("work", total=2)
        bar.update(task, completed=1, total=2)
    assert isinstance(bar, common._NoProgress) is common._plain(sys.stderr)


_LEAVE = """
import atexit, sys, threading, time
import cli

class Teardown:
    def __del__(self):
        sys.stderr.write("TORN DOWN\\n")

keep = Teardown()  # freed only by the interpreter's teardown
atexit.register(lambda: sys.stderr.write("HOOK\\n"))
mode = sys.argv[1]
if mode == "thread":
    def late():
        time.sleep(0.3)
        sys.stdout.write("THREAD DONE\\n")
    threading.Thread(target=late).start()
elif mode == "sigint":
    import os, signal
    def interrupted_hook():  # a Ctrl-C landing while the exit hooks run
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        sys.stderr.write("HOOK DONE\\n")
    atexit.register(interrupted_hook)
elif mode == "daemon":
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
elif mode == "broken":
    class Broken:
        def write(self, s):
            return len(s)
        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")
    sys.stdout = Broken()
sys.stdout.write("OUT\\n")
cli.leave(0 if mode == "broken" else 3)
"""


def _leave(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _LEAVE, mode], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("mode", ["plain", "daemon"])
def test_a_finished_command_leaves_without_teardown_but_with_its_hooks(mode: str) -> None:
    """`cli.leave`: the output flushed, the exit hooks run, the status kept, and no teardown
    (an object only the teardown frees is never freed); also with a daemon thread alive (a
    lease's heartbeat), which the normal exit would not wait for either."""
    res = _leave(mode)
    assert res.returncode == 3, res.stderr
    assert res.stdout == "OUT\n"
    assert "HOOK" in res.stderr
    assert "TORN DOWN" not in res.stderr


def test_leave_with_another_thread_alive_exits_normally() -> None:
    """With a non-daemon thread alive, `leave` is the normal exit: it waits for the thread,
    whose output arrives, and the teardown runs."""
    res = _leave("thread")
    assert res.returncode == 3, res.stderr
    assert res.stdout == "OUT\nTHREAD DONE\n"
    assert "HOOK" in res.stderr
    assert "TORN DOWN" in res.stderr


def test_leave_with_output_that_cannot_be_flushed_exits_as_a_closed_pipe_does() -> None:
    """A final flush that fails (a closed pipe) ends with 141, the status of every command
    whose reader went away (decision 56), and says nothing."""
    res = _leave("broken")
    assert res.returncode == 141, res.stderr
    assert "Traceback" not in res.stderr


def test_a_ctrl_c_while_the_exit_hooks_run_changes_nothing() -> None:
    """The command is over when `leave` runs: a SIGINT during its exit hooks neither breaks
    into them (no traceback, every hook runs to its end) nor changes the exit status."""
    res = _leave("sigint")
    assert res.returncode == 3, res.stderr
    assert res.stdout == "OUT\n"
    assert "HOOK DONE" in res.stderr and "HOOK" in res.stderr.replace("HOOK DONE", "")
    assert "Traceback" not in res.stderr and "KeyboardInterrupt" not in res.stderr
