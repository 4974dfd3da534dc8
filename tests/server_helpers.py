"""A real `car serve` in a subprocess, for the API and browser tests of the server."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
CAR = [str(Path(sys.executable).parent / "car")]
ARTIFACTS = ROOT / "artifacts" / "screenshots"
_LINE = re.compile(r"dashboard http://(?P<host>[^/]+):(?P<port>\d+)/")


@dataclass
class Server:
    url: str
    host: str
    port: int
    journal: Path
    proc: subprocess.Popen[str]

    def client(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)


@contextlib.contextmanager
def car_serve(
    journal: Path,
    *args: str,
    env: dict[str, str] | None = None,
    default_port: bool = False,
    port: int = 0,
) -> Iterator[Server]:
    """Start `car --journal J serve --port PORT ARGS` (PORT 0: any free one; no --port: the
    default 8008) and yield it once it listens; stop it with SIGINT (a graceful shutdown) and
    fail if it does not exit."""
    port_args = [] if default_port else ["--port", str(port)]
    cmd = [*CAR, "--journal", str(journal), "serve", *port_args, *args]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError(f"car serve exited with {proc.returncode}: {proc.stderr.read()}")
            m = _LINE.search(line)
            if m:
                host, port = m.group("host").strip("[]"), int(m.group("port"))
                url = f"http://{m.group('host')}:{port}"
                _wait_healthy(url)
                yield Server(url, host, port, journal, proc)
                break
        else:
            raise RuntimeError(f"car serve did not start in time (last line {line!r})")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
                raise AssertionError("car serve did not shut down within 20 s of SIGINT") from None


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/api/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} never became healthy")


def start(client: httpx.Client, **body: Any) -> str:
    """Quick-start a heist through the API (202); its session id."""
    r = client.post("/api/sessions", json=body)
    assert r.status_code == 202, r.text
    return str(r.json()["session_id"])


def finished_heist(client: httpx.Client) -> str:
    """The seed-7 heist (its plan fails) recorded through the API at full speed, to its end."""
    sid = start(client, seed=7, step_delay=0)
    wait_status(client, sid, {"completed"})
    return sid


def wait_status(client: httpx.Client, sid: str, want: set[str], timeout: float = 60) -> dict:
    """Poll a session until its status is one of `want`; its detail then."""
    deadline = time.monotonic() + timeout
    detail: dict[str, Any] = {}
    while time.monotonic() < deadline:
        detail = client.get(f"/api/sessions/{sid}").json()
        if detail.get("status") in want:
            return detail
        time.sleep(0.05)
    raise AssertionError(f"session {sid} still {detail.get('status')!r}, wanted {want}")


def sse_events(
    client: httpx.Client,
    sid: str,
    *,
    last_event_id: int | None = None,
    after: int | None = None,
    limit: int | None = None,
    timeout: float = 60,
) -> tuple[list[dict[str, Any]], bool]:
    """Read a session's SSE stream: (the data events, whether an `end` event closed it).
    Stops after `limit` data events when given."""
    headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
    params = {} if after is None else {"after": after}
    out: list[dict[str, Any]] = []
    ended = False
    with client.stream(
        "GET", f"/api/sessions/{sid}/events", headers=headers, params=params, timeout=timeout
    ) as r:
        assert r.status_code == 200, r.read()
        event, data, ident = "message", "", None
        for line in r.iter_lines():
            if line.startswith(":"):
                continue
            if line == "":
                if data:
                    if event == "end":
                        ended = True
                        break
                    item = json.loads(data)
                    assert ident == str(item["seq"]), (ident, item)
                    out.append(item)
                    if limit is not None and len(out) >= limit:
                        break
                event, data, ident = "message", "", None
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                event = value
            elif field == "data":
                data += value
            elif field == "id":
                ident = value
    return out, ended
