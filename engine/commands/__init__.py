"""The command line's command groups, one module each; `cli.py` assembles them.

Each module exposes `register(app)` that adds its commands to a Typer app. The `car` group
(engine/commands/lazy.py) lists every command from its table `COMMANDS` and imports a module,
calling its `register`, only when one of its commands runs: a new command needs a row there.
Commands parse and print; the engine decides (a command that needs more than a screen is
missing an engine function).
"""
