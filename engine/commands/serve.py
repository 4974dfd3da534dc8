"""`car serve`: the detection server and the live dashboard."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from engine.commands.common import fail, journal_target

if TYPE_CHECKING:
    from engine.executors.local import StandingPool

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8008


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_cmd)


def serve_cmd(
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="Address to bind. The default serves this machine only; 0.0.0.0 "
            "exposes the server (it has no authentication) to the network.",
        ),
    ] = DEFAULT_HOST,
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="TCP port (0: any free port).")
    ] = DEFAULT_PORT,
    max_heists: Annotated[
        int,
        typer.Option(
            "--max-heists", min=1, help="Heists that may record at once; more get HTTP 429."
        ),
    ] = 4,
    sim_step_delay: Annotated[
        float,
        typer.Option(
            "--sim-step-delay",
            min=0.0,
            max=10.0,
            help="Seconds between steps of a quick-started sim heist, so it can be watched "
            "live (the sim policy itself takes well under a millisecond). 0: full speed.",
        ),
    ] = 0.5,
    detect_base_url: Annotated[
        str | None,
        typer.Option(
            "--detect-base-url", help="OpenAI-compatible server for the llm analysis methods."
        ),
    ] = None,
    detect_model: Annotated[
        str | None, typer.Option("--detect-model", help="Model for the llm analysis methods.")
    ] = None,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-host",
            help="Bound to this machine only, the server answers requests addressed to "
            "localhost or a loopback address (so that no web site can reach it by pointing "
            "its own name at 127.0.0.1); this adds a name, e.g. the one a forwarding proxy "
            "uses. Repeatable.",
        ),
    ] = None,
    log_level: Annotated[
        str, typer.Option("--access-log-level", help="uvicorn log level (info shows requests).")
    ] = "warning",
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            min=0,
            max=64,
            help="Worker processes for the sim branches of forks and attributions with "
            "concurrency > 1, forked once at start (before the server's threads), one request "
            "at a time; default: CPUs - 1. 0: branches run in the server's threads.",
        ),
    ] = None,
) -> None:
    """Serve the dashboard and the API (http://127.0.0.1:8008, API docs at /docs)."""
    import socket
    import sys

    import uvicorn

    from engine.server import ServerSettings, create_app

    levels = ("critical", "error", "warning", "info", "debug", "trace")
    if log_level.lower() not in levels:
        fail(f"--access-log-level must be one of {', '.join(levels)}, got {log_level!r}", code=2)
    target = journal_target()
    settings = ServerSettings(
        journal=target,
        max_heists=max_heists,
        sim_step_delay=sim_step_delay,
        detect_base_url=detect_base_url,
        detect_model=detect_model,
        host=host,
        allowed_hosts=tuple(allow_host or ()),
    )
    app = create_app(settings)
    pool = _standing_pool(workers, target)
    # bind first, so a taken port is one clear line instead of a uvicorn traceback
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP (not 0): asyncio sets TCP_NODELAY only on sockets that say they are
    # TCP, and without it every response waits ~40 ms on the client's delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        fail(f"cannot listen on {host}:{port}: {e.strerror}")
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    # one unwrapped line: scripts (and the tests) read the port from it
    sys.stderr.write(
        f"car serve: dashboard http://{shown}:{bound}/  API docs http://{shown}:{bound}/docs  "
        f"journal {target}\n"
    )
    sys.stderr.flush()
    config = uvicorn.Config(app, log_level=log_level.lower(), timeout_graceful_shutdown=5)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Ctrl-C or SIGTERM: the forks and attributions in flight stop within a step and
            # close their branches as stopped (engine.workers.STOP, as on the CLI), so their
            # requests end inside the graceful shutdown instead of being cut off with their
            # branches left open
            from engine.workers import STOP

            STOP.set()
            super().handle_exit(sig, frame)

    server = _Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        if pool is not None:
            pool.close()


def _standing_pool(workers: int | None, target: str) -> StandingPool | None:
    """The server's worker processes for sim branches, forked here: before the socket is
    bound (a worker must not hold the port) and before any thread starts. None for 0, for a
    journal on a database server (its sim branches run in threads, as the CLI's do), or where
    this process already runs threads (then branches run in threads; said on stderr)."""
    import os
    import sys

    from engine.errors import InterventionError
    from engine.executors.local import start_standing_pool
    from engine.journal import is_sqlite_target

    n = max(0, (os.cpu_count() or 1) - 1) if workers is None else workers
    if n == 0 or not is_sqlite_target(target):
        return None
    try:
        return start_standing_pool(n)
    except InterventionError as e:
        sys.stderr.write(f"car serve: no worker processes ({e}); branches run in threads\n")
        return None
