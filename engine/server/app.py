"""The detection server: the blog's API and dashboard on the journal (FastAPI).

Routes (all JSON unless said otherwise; `session_id` is a run id or a unique prefix):

  POST /api/ai-detect/analyze        {"session_id", "method"?}  the full analysis
  POST /api/ai-detect/suggest        {"session_id", "method"?}  suggested_mole + confidence
  GET  /api/sessions?limit&offset    heists, newest first
  POST /api/sessions                 quick-start a heist in the background (202)
  GET  /api/sessions/{id}            public transcript, tool usage and statistics
  GET  /api/sessions/{id}/events     Server-Sent Events of the public events (Last-Event-ID)
  POST /api/sessions/{id}/pause|resume|stop   at the next step, journaled (202)
  POST /api/sessions/{id}/accuse     {"suspect"?} verdict, then the reveal
  GET  /api/sessions/{id}/tree       the branch tree of the run's family
  POST /api/sessions/{id}/fork       {"at", "do", "value"?, "n"?, "seed"?} outcome distribution
  POST /api/sessions/{id}/attribution {"method"?, ...} the attribution table
  GET  /api/sessions/{id}/diff       a branch against its parent (word diff)
  GET  /                             the dashboard; GET /docs the OpenAPI page

Errors are JSON `{"error": "...", ...}`: 404 names the unknown session, 422 a bad body or value,
409 an action that does not apply to the run as it is, 429 when every recording slot is taken
(or, with Retry-After, when too many long requests already run or wait), 503 (with Retry-After)
when another writer held the journal's lock too long: nothing was written, and the same request
may be tried again. 403 refuses a request from another site's page or addressed to a name that
is not this machine's, 413 a body over 1 MiB (`guard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, TypeVar

import anyio
from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import (
    ConfigError,
    EngineError,
    InterventionError,
    JournalBusy,
    TamperedJournal,
    UnknownRun,
)
from engine.events import not_journalable_text
from engine.executors.base import ExecutorOptions
from engine.journal import Journal, redacted_url
from engine.server import views
from engine.server.guard import Guard, is_loopback
from engine.server.runner import HeistRunner, NotControllable, TooManyHeists
from engine.server.stream import LIVE_STATUSES, NotifyingJournal, StreamHub
from engine.version import engine_version

T = TypeVar("T")
STATIC = resources.files("engine.server") / "static"
DETECT_METHODS = ("rules", "llm", "rules+llm", "causal", "replay")
FORK_OPS = ("resample", "action", "observation", "context", "policy")
MAX_BRANCHES = 200
#: the journal's seqs are SQLite / PostgreSQL 64-bit integers
MAX_SEQ = 2**63 - 1
#: seconds a client is told to wait (Retry-After) when the journal was busy
BUSY_RETRY_AFTER_S = 2
#: long requests running at once, and waiting besides: they run in threads of their own, so
#: that however many there are, the threads that answer every other request stay free
MAX_JOBS = 4
MAX_WAITING_JOBS = 32
#: the most characters of a client's value that a 422 quotes back
ECHO_CHARS = 200
#: forward runs of fork and attribution run in threads here, never in forked processes: a
#: fork of this many-threaded process would copy whatever lock another thread holds
THREADS_ONLY = ExecutorOptions(processes=False)


@dataclass
class ServerSettings:
    journal: str
    max_heists: int = 4
    sim_step_delay: float = 0.5
    detect_base_url: str | None = None
    detect_model: str | None = None
    poll_seconds: float = 0.25
    #: the address the server is bound to: a loopback one answers loopback Host names only
    host: str | None = None
    #: more Host names a loopback-bound server answers (a proxy that forwards its own name)
    allowed_hosts: tuple[str, ...] = ()
    #: long requests (forks, attributions, analyses that run or ask a model) at once
    max_jobs: int = MAX_JOBS
    #: long requests that may wait for a turn besides; more get 429
    max_waiting_jobs: int = MAX_WAITING_JOBS


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, headers: Mapping[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers
        self.extra = extra


class Jobs:
    """Long requests (forward runs, analyses that run forks or ask a model): `running` at once
    in threads of their own, `waiting` more queued for a turn (a coroutine each, no thread),
    and 429 beyond. Every other request is answered meanwhile by the framework's own threads,
    which a burst of long requests would otherwise all hold."""

    def __init__(self, running: int, waiting: int) -> None:
        self.limiter = anyio.CapacityLimiter(running)
        self.capacity = running + waiting
        self.admitted = 0  # changed on the event loop's thread only

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.admitted >= self.capacity:
            raise ApiError(
                429,
                f"{self.admitted} long requests (forks, attributions, analyses) are running or "
                f"waiting already (the server's limit is {self.capacity}); try again later",
                headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
            )
        self.admitted += 1
        try:
            return await anyio.to_thread.run_sync(_stoppable, fn, *args, limiter=self.limiter)
        finally:
            self.admitted -= 1


def _stoppable(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a request's thread; stopped by the server's shutdown (its forward runs
    raise the interrupt the CLI turns into exit 130), it is an error reply, not a
    KeyboardInterrupt thrown into the event loop."""
    try:
        return fn(*args)
    except KeyboardInterrupt:
        raise ApiError(
            503,
            "the server is shutting down: the forward runs in flight were stopped and their "
            "branches closed as stopped",
        ) from None


def _renderable(value: Any) -> Any:
    """`value` as JSON can always carry it: a client's input echoed in an error may hold what
    JSON text cannot (NaN, Infinity, a lone surrogate), shown then as its Python repr."""
    if isinstance(value, dict):
        return {_renderable(str(k)): _renderable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_renderable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return _renderable(str(value))


def error_response(
    status: int, message: str, headers: Mapping[str, str] | None = None, **extra: Any
) -> JSONResponse:
    """Every error of the API: `{"error": "...", ...}`."""
    return JSONResponse(
        _renderable({"error": message, **extra}), status_code=status, headers=headers
    )


def busy_response(exc: JournalBusy) -> JSONResponse:
    """503 for a journal that another writer kept locked: nothing of the request was written,
    and it may succeed when tried again (Retry-After, in seconds)."""
    return error_response(
        503,
        f"{exc} (the journal is busy: try again in {BUSY_RETRY_AFTER_S} s)",
        headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
    )


def _echo(text: str) -> str:
    """A client's value as an answer quotes it back: at most ECHO_CHARS long (a value of a
    megabyte is not worth a megabyte of answer; a 10,000-character id came back twice)."""
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + f"... ({len(text)} characters)"


def _not_found(session_id: str, error: UnknownRun | None = None) -> ApiError:
    session_id = _echo(session_id)
    if error is not None and "ambiguous" in str(error):
        # a prefix of several runs: "unknown" would send the client looking for a typo
        return ApiError(
            404,
            f"session id prefix {session_id!r} is ambiguous: give more of the id "
            f"({str(error).rpartition('ambiguous: ')[2] or 'several sessions match'})",
            session_id=session_id,
        )
    return ApiError(404, f"unknown session {session_id!r}", session_id=session_id)


def _short_echo(error: Mapping[str, Any]) -> dict[str, Any]:
    """A validation error with the client's value quoted back (`_echo`)."""
    out = dict(error)
    if "input" in out:
        value = _renderable(out["input"])
        text = json.dumps(value)
        out["input"] = _echo(text) if len(text) > ECHO_CHARS else value
    return out


# ------------------------------------------------------------------ bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _unicode(cls, value: Any) -> Any:
        # a JSON escape such as "\ud800" decodes to a lone surrogate, which no UTF-8 text
        # (and so no journal event) can hold: a bad body, refused before anything is done
        _check_unicode(value)
        return value


def _check_unicode(value: Any) -> None:
    if isinstance(value, str):
        problem = not_journalable_text(value)
        if problem is not None:
            raise ValueError(problem)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k)
            _check_unicode(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_unicode(v)


class DetectRequest(_Body):
    session_id: str = Field(min_length=1, max_length=200, examples=["96127e6a62b9"])
    method: Literal["rules", "llm", "rules+llm", "causal", "replay"] = "rules"
    base_url: str | None = Field(
        default=None, description="OpenAI-compatible server for llm methods."
    )
    model: str | None = None


class QuickStart(_Body):
    policy: Literal["sim", "sim-honest", "openai"] = "sim"
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1, description="Default: random.")
    rounds: int = Field(default=4, ge=1, le=100, description="Turns per agent.")
    config: str | None = Field(
        default=None, max_length=100_000, description="Crew YAML (as `car heist --config` reads)."
    )
    base_url: str | None = Field(default=None, description="policy openai: the server's URL.")
    model: str | None = Field(default=None, description="policy openai: the model name.")
    step_delay: float | None = Field(
        default=None,
        ge=0.0,
        le=10.0,
        allow_inf_nan=False,
        description="Seconds between steps (default: the server's).",
    )


class AccuseRequest(_Body):
    suspect: str | None = Field(
        default=None, max_length=64, description="Omit to give up (BUSTED)."
    )


class ForkRequest(_Body):
    at: int = Field(ge=0, description="The step to intervene on.")
    do: Literal["resample", "action", "observation", "context", "policy"]
    value: str | dict[str, Any] | None = Field(
        default=None,
        description="action/observation: text; context: text or {step, text}; "
        "policy: sim | sim-honest | openai.",
    )
    n: int = Field(default=20, ge=1, le=MAX_BRANCHES, description="Branches.")
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    concurrency: int = Field(default=1, ge=1, le=16)


class AttributionRequest(_Body):
    method: Literal["contrastive", "shapley"] = "contrastive"
    players: Literal["steps", "agents"] = "steps"
    k: int | None = Field(default=None, ge=2, le=1000)
    budget: int = Field(default=2000, ge=1, le=20000)
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    concurrency: int = Field(default=1, ge=1, le=16)
    half_width: float = Field(default=0.1, gt=0.0, lt=0.5, allow_inf_nan=False)
    # like `car attribute --all-steps`: by default the scan stops at the point of commitment
    all_steps: bool = False
    # like `car attribute --settle N`: contrastive scans at most until the locus is settled
    settle: int = Field(default=1, ge=1, le=8)


# ------------------------------------------------------------------ app


def create_app(settings: ServerSettings) -> FastAPI:
    journal: Journal = NotifyingJournal(settings.journal)
    runner = HeistRunner(journal, max_heists=settings.max_heists)
    hub = StreamHub(journal, poll_seconds=settings.poll_seconds)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        hub.bind(asyncio.get_running_loop())
        try:
            yield
        finally:
            # every heist this server records is closed in the journal before it exits
            await asyncio.to_thread(runner.shutdown)
            await hub.close()
            journal.close()

    app = FastAPI(
        title="Causal Agent Replay: detection server",
        version=engine_version(),
        description="The mole game in a browser: record heists, watch them live, ask the "
        "detector, accuse and reveal; fork and attribute finished runs.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(
        Guard,
        error_response=error_response,
        loopback_only=settings.host is not None and is_loopback(settings.host),
        allowed_hosts=settings.allowed_hosts,
    )
    jobs = Jobs(settings.max_jobs, settings.max_waiting_jobs)
    app.state.journal = journal
    app.state.runner = runner
    app.state.hub = hub
    app.state.settings = settings

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError) -> JSONResponse:
        if isinstance(exc.__cause__, JournalBusy):
            # a route that maps the engine's errors (409, ...) met a busy journal: that is
            # no answer about the run, only "not now"
            return busy_response(exc.__cause__)
        return error_response(exc.status, exc.message, headers=exc.headers, **exc.extra)

    @app.exception_handler(JournalBusy)
    async def _busy(_req: Request, exc: JournalBusy) -> JSONResponse:
        return busy_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_req: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [_short_echo(e) for e in exc.errors()]
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = f"bad request: {where + ': ' if where else ''}{first.get('msg', 'invalid')}"
        return error_response(422, msg, detail=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        path = req.url.path
        if status == 400 and "parsing the body" in str(exc.detail):
            # a body the JSON parser gave up on (e.g. nested 100,000 deep) is a bad body
            return error_response(422, "bad request: the body cannot be parsed as JSON")
        if status == 404:
            message = f"not found: {path}"
        elif status == 405:
            message = f"method {req.method} is not allowed on {path}"
        else:
            message = str(exc.detail)
        return error_response(status, message, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, exc: Exception) -> JSONResponse:
        # logged with its traceback by the server; the client gets JSON, and only the kind
        # of error: its text could quote anything the engine holds, secrets included
        if isinstance(exc, TamperedJournal):
            return error_response(
                500,
                "the journal was changed outside car (TamperedJournal): `car verify` names"
                " what; the server's log has the details",
            )
        return error_response(
            500, f"internal error ({type(exc).__name__}); the server's log has the details"
        )

    def resolve(session_id: str) -> str:
        try:
            return journal.run(session_id).run_id
        except UnknownRun as e:
            raise _not_found(session_id, e) from None

    # -------------------------------------------------------------- pages

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(str(STATIC / "index.html"), media_type="text/html")

    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")
    _mount_swagger(app)

    @app.get("/api/health", tags=["server"])
    def health() -> dict[str, Any]:
        """The server's version, journal and recording slots."""
        return {
            "ok": True,
            "version": engine_version(),
            # the server has no login: never the password of a server URL
            "journal": redacted_url(journal.url) if journal.path is None else str(journal.path),
            "recording": runner.active(),
            "starting": runner.starting(),
            "max_heists": runner.max_heists,
        }

    # -------------------------------------------------------------- detection

    def _analyze(body: DetectRequest) -> dict[str, Any]:
        run_id = resolve(body.session_id)
        try:
            from engine.detect import analyze
            from engine.detect.analysis import SecretNeeded
        except ImportError:
            raise ApiError(501, "the sabotage detector is not part of this build") from None
        try:
            return analyze(
                journal,
                run_id,
                method=body.method,
                base_url=body.base_url or settings.detect_base_url,
                model=body.model or settings.detect_model,
            )
        except UnknownRun:
            raise _not_found(body.session_id) from None
        except ConfigError as e:
            raise ApiError(422, str(e), session_id=run_id) from e
        except SecretNeeded as e:
            # before the verdict the server never reveals (`car detect --reveal` may)
            raise ApiError(403, str(e).replace(" or with --reveal", ""), session_id=run_id) from e
        except EngineError as e:
            raise ApiError(409, str(e), session_id=run_id) from e

    async def _analysis(body: DetectRequest) -> dict[str, Any]:
        if body.method == "rules":  # reads the run once: quick
            return await run_in_threadpool(_analyze, body)
        # the others ask a model or run the crew again: long
        return await jobs.run(_analyze, body)

    @app.post("/api/ai-detect/analyze", tags=["detection"])
    async def analyze_session(body: DetectRequest) -> dict[str, Any]:
        """The full analysis: suspicion per agent, the four-signal breakdown, the weights."""
        return await _analysis(body)

    @app.post("/api/ai-detect/suggest", tags=["detection"])
    async def suggest_mole(body: DetectRequest) -> dict[str, Any]:
        """Only the suggested mole and the confidence."""
        a = await _analysis(body)
        return {
            "session_id": a.get("session_id"),
            "suggested_mole": a.get("suggested_mole"),
            "confidence": a.get("confidence"),
        }

    # -------------------------------------------------------------- sessions

    @app.get("/api/sessions", tags=["sessions"])
    def sessions(
        limit: int = Query(20, ge=1, le=200), offset: int = Query(0, ge=0)
    ) -> dict[str, Any]:
        """Recorded heists with status and outcome, newest first, one page."""
        return views.list_sessions(journal, limit, offset)

    @app.post("/api/sessions", status_code=202, tags=["sessions"])
    def quick_start(body: QuickStart | None = None) -> dict[str, Any]:
        """Quick-start a heist with every agent of the crew; it records in the background."""
        body = body or QuickStart()
        from engine.heist.config import load_agents_config, parse_agents_config
        from engine.policies.registry import make_policy

        try:
            crew = (
                parse_agents_config(body.config, "config")
                if body.config is not None
                else load_agents_config()
            )
            spec: dict[str, Any] = {"name": body.policy}
            if body.policy == "openai":
                spec["base_url"] = body.base_url or "http://localhost:1234/v1"
                spec["model"] = body.model or "local-model"
            elif body.base_url or body.model:
                raise ConfigError("base_url and model apply to policy openai only")
            policy = make_policy(spec)
        except ConfigError as e:
            raise ApiError(422, str(e)) from e
        from engine.runtime.seeds import fresh_seed

        seed = body.seed if body.seed is not None else fresh_seed()
        delay = body.step_delay
        if delay is None:
            delay = settings.sim_step_delay if body.policy.startswith("sim") else 0.0
        try:
            run_id = runner.start(
                policy,
                seed=seed,
                rounds=body.rounds,
                config=crew,
                step_delay=delay,
                server=spec.get("base_url"),
            )
        except TooManyHeists as e:
            raise ApiError(
                429, str(e), recording=runner.active(), starting=runner.starting()
            ) from e
        except ConfigError as e:
            raise ApiError(422, str(e)) from e
        except EngineError as e:
            # the runner closed whatever run it had created: nothing is left `recording`
            raise ApiError(500, f"the heist could not start: {e}") from e
        return {
            "session_id": run_id,
            "status": journal.status(run_id),
            "agents": list(crew.names),
            "policy": body.policy,
            # no seed: the mole is drawn from it, so it would be the answer
            "rounds": body.rounds,
            "step_delay": delay,
            "events": f"/api/sessions/{run_id}/events",
        }

    @app.get("/api/sessions/{session_id}", tags=["sessions"])
    def session_detail(session_id: str) -> dict[str, Any]:
        """Public transcript and tool usage (the mole only after the verdict)."""
        run_id = resolve(session_id)
        data = views.public_view(journal, run_id)
        data["controllable"] = runner.get(run_id) is not None
        return data

    @app.get("/api/sessions/{session_id}/events", tags=["sessions"])
    async def session_events(
        request: Request,
        session_id: str,
        last_event_id: str | None = Header(None, alias="Last-Event-ID"),
        after: int | None = Query(
            None,
            ge=-1,
            le=MAX_SEQ,
            description="Resume after this seq (when no Last-Event-ID header).",
        ),
    ) -> EventSourceResponse:
        """Server-Sent Events: each public event with `id` = its journal seq; a reconnect with
        Last-Event-ID resumes right after it. Ends with an `end` event once the run has."""
        run_id = await asyncio.to_thread(resolve, session_id)
        start = -1 if after is None else after
        if last_event_id:
            try:
                start = int(last_event_id)
            except ValueError:
                raise ApiError(
                    422, f"Last-Event-ID must be a journal seq (an integer), got {last_event_id!r}"
                ) from None
            if not -1 <= start <= MAX_SEQ:
                raise ApiError(
                    422, f"Last-Event-ID must lie within -1..{MAX_SEQ}, got {last_event_id!r}"
                )
        # no journal holds 2**62 events: nothing follows such a seq either, and the reads
        # stay clear of the 64-bit bound
        read_after = min(start, 2**62)

        async def gen() -> AsyncIterator[bytes | dict[str, Any]]:
            last = start
            async for seq, chunk in hub.frames(run_id, read_after):
                last = seq
                yield chunk  # ready-made SSE frames, sent as they are
            status = await asyncio.to_thread(journal.status, run_id)
            # the end event carries no id, so a reconnect would still resume at `last`
            yield {"event": "end", "data": json.dumps({"status": status, "last_seq": last})}

        return EventSourceResponse(gen(), ping=15, headers={"X-Accel-Buffering": "no"})

    def _control(session_id: str, action: str) -> dict[str, Any]:
        run_id = resolve(session_id)
        try:
            runner.request(run_id, action)
        except NotControllable as e:
            raise ApiError(409, str(e), session_id=run_id, run_status=journal.status(run_id)) from e
        return {"session_id": run_id, "action": action, "requested": True}

    @app.post("/api/sessions/{session_id}/pause", status_code=202, tags=["control"])
    def pause(session_id: str) -> dict[str, Any]:
        """Pause at the next step (a Control event marks where)."""
        return _control(session_id, "pause")

    @app.post("/api/sessions/{session_id}/resume", status_code=202, tags=["control"])
    def resume(session_id: str) -> dict[str, Any]:
        """Resume a paused heist."""
        return _control(session_id, "resume")

    @app.post("/api/sessions/{session_id}/stop", status_code=202, tags=["control"])
    def stop(session_id: str) -> dict[str, Any]:
        """Stop at the next step; the run is closed as stopped."""
        return _control(session_id, "stop")

    @app.post("/api/sessions/{session_id}/accuse", tags=["game"])
    def accuse(session_id: str, body: AccuseRequest | None = None) -> dict[str, Any]:
        """Name your suspect (or nobody): the verdict, then the mole and its strategy."""
        from engine.heist.session import accuse_run

        run_id = resolve(session_id)
        suspect = (body or AccuseRequest()).suspect
        # the verdict reads " intel " as intel and a blank name as nobody: journal and answer
        # the name it judged
        suspect = suspect.strip() or None if suspect is not None else None
        status = journal.status(run_id)
        if status in LIVE_STATUSES:
            raise ApiError(
                409,
                f"session {run_id!r} is still {status}; accuse once it has ended",
                session_id=run_id,
                run_status=status,
            )
        try:
            result = accuse_run(journal, run_id, suspect)
        except ConfigError as e:
            raise ApiError(422, str(e), session_id=run_id) from e
        except EngineError as e:
            raise ApiError(409, str(e), session_id=run_id) from e
        return {
            "session_id": result.run_id,
            "suspect": result.suspect,
            "verdict": result.verdict,
            "mole": result.mole,
            "strategy": result.strategy,
        }

    # -------------------------------------------------------------- branches

    @app.get("/api/sessions/{session_id}/tree", tags=["branches"])
    def tree(session_id: str) -> dict[str, Any]:
        """The family of the run: its root and every branch, with outcomes."""
        return views.branch_tree(journal, resolve(session_id))

    def _ended(run_id: str, what: str) -> None:
        status = journal.status(run_id)
        if status in LIVE_STATUSES:
            raise ApiError(
                409,
                f"session {run_id!r} is still {status}; {what} it once it has ended",
                session_id=run_id,
                run_status=status,
            )

    @app.post("/api/sessions/{session_id}/fork", tags=["branches"])
    async def fork(session_id: str, body: ForkRequest) -> dict[str, Any]:
        """N branches from step `at` with one do() intervention; bad rate and Wilson 95% CI."""
        return await jobs.run(_fork, session_id, body)

    def _fork(session_id: str, body: ForkRequest) -> dict[str, Any]:
        from engine.branching import fork as fork_branches
        from engine.interventions import parse_intervention
        from engine.scenario import Rerun

        run_id = resolve(session_id)
        _ended(run_id, "fork")
        value = body.value
        if body.do != "resample" and (
            value is None or (isinstance(value, str) and not value.strip())
        ):
            raise ApiError(
                422,
                f"bad request: do {body.do!r} needs a `value` ("
                + {
                    "action": "the step's new message",
                    "observation": "the tool result the step sees instead",
                    "context": 'text, or {"step": K, "text": "..."}',
                    "policy": "sim, sim-honest or openai",
                }[body.do]
                + ")",
                session_id=run_id,
            )
        if isinstance(value, dict) and body.do != "context":
            raise ApiError(
                422,
                f"bad request: the `value` of do {body.do!r} is text, not an object",
                session_id=run_id,
            )
        text = json.dumps(value) if isinstance(value, dict) else value
        try:
            iv = parse_intervention(body.do, body.at, text)
            report = fork_branches(
                journal,
                run_id,
                iv,
                body.n,
                seed=body.seed,
                rerun=Rerun(body.concurrency, executor=THREADS_ONLY),
            )
        except (InterventionError, ConfigError) as e:
            raise ApiError(422, str(e), session_id=run_id) from e
        except EngineError as e:
            raise ApiError(409, str(e), session_id=run_id) from e
        return report.to_dict()

    @app.post("/api/sessions/{session_id}/attribution", tags=["branches"])
    async def attribution(
        session_id: str, body: AttributionRequest | None = None
    ) -> dict[str, Any]:
        """Which step (or agent) caused the failure: the ranked attribution table."""
        return await jobs.run(_attribution, session_id, body)

    def _attribution(session_id: str, body: AttributionRequest | None) -> dict[str, Any]:
        from engine.branching import attribute
        from engine.scenario import Rerun

        body = body or AttributionRequest()
        run_id = resolve(session_id)
        _ended(run_id, "attribute")
        try:
            data = attribute(
                journal,
                run_id,
                method=body.method,
                players=body.players,
                k=body.k,
                budget=body.budget,
                seed=body.seed,
                half_width=body.half_width,
                all_steps=body.all_steps,
                settle=body.settle,
                rerun=Rerun(body.concurrency, executor=THREADS_ONLY),
            )
        except (ConfigError, InterventionError) as e:
            raise ApiError(422, str(e), session_id=run_id) from e
        except EngineError as e:
            raise ApiError(409, str(e), session_id=run_id) from e
        data.pop("detail", None)
        return data

    @app.get("/api/sessions/{session_id}/diff", tags=["branches"])
    def diff(session_id: str) -> dict[str, Any]:
        """A branch against its parent: first diverging step and word diffs."""
        run_id = resolve(session_id)
        try:
            return views.branch_diff(journal, run_id)
        except views.NotABranch as e:
            raise ApiError(409, str(e), session_id=run_id) from e

    return app


def _mount_swagger(app: FastAPI) -> None:
    """The OpenAPI page from the Swagger UI that the fastapi-offline package ships (no CDN:
    the page works without internet access)."""
    import fastapi_offline

    static = resources.files(fastapi_offline) / "static"
    app.mount("/docs-static", StaticFiles(directory=str(static)), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - API",
            swagger_js_url="/docs-static/swagger-ui-bundle.js",
            swagger_css_url="/docs-static/swagger-ui.css",
            swagger_favicon_url="/docs-static/favicon.png",
        )
