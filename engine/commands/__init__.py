"""The command line's command groups, one module each; `cli.py` assembles them.

Each module exposes `register(app)` that adds its commands to the `car` Typer app. Commands
parse and print; the engine decides (a command that needs more than a screen is missing an
engine function).
"""
