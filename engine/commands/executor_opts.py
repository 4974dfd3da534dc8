"""The flags that choose where forward runs execute, shared by fork, attribute, detect and
detect-eval: `--executor local|ray`, `--ray-address`, `--workers`."""

from __future__ import annotations

from typing import Annotated

import typer

from engine.errors import ConfigError
from engine.executors.base import EXECUTORS, ExecutorOptions

ExecutorOpt = Annotated[
    str,
    typer.Option(
        "--executor",
        help="Where forward runs execute: local (this machine) | ray (a Ray cluster; needs a "
        "PostgreSQL --journal).",
    ),
]
RayAddressOpt = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        help="ray: auto (the cluster `ray start` runs here), HOST:PORT or ray://HOST:PORT; "
        "default: a Ray instance started for this command.",
    ),
]
WorkersOpt = Annotated[
    int | None,
    typer.Option(
        "--workers",
        min=1,
        help="ray: worker actors (default: the cluster's CPUs); -c is spread over them.",
    ),
]


def executor_options(
    executor: str, ray_address: str | None, workers: int | None
) -> ExecutorOptions | None:
    """The parsed flags; a bad combination is a usage error naming the flag."""
    if executor not in EXECUTORS:
        raise typer.BadParameter(
            f"{executor!r} is not one of: {', '.join(EXECUTORS)}", param_hint="'--executor'"
        )
    if executor == "local":
        if ray_address is not None:
            raise typer.BadParameter("applies to --executor ray only", param_hint="'--ray-address'")
        if workers is not None:
            raise typer.BadParameter("applies to --executor ray only", param_hint="'--workers'")
        return None
    try:
        return ExecutorOptions(kind=executor, address=ray_address, workers=workers)
    except ConfigError as e:  # pragma: no cover - the checks above catch what it checks
        raise typer.BadParameter(str(e)) from e
