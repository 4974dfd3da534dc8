"""How `car record` / `car replay` end, and what the recording proxy makes of requests that
are unusual on the wire: real `car` processes, real programs, a real HTTP upstream
(tests/program_helpers.py) and a real SQLite journal; the proxy is driven over raw sockets.

* a program killed by a signal: car says so in words and exits 128+N, as a shell would;
* a command that cannot start (not executable, a directory, a bare name off PATH): one line,
  and no run left in the journal;
* a replay of a program that never called the model is faithful, not "diverged";
* a request body sent chunked is read (and journaled) like one with a Content-Length, and a
  request whose length is nonsense is a 400 that closes the connection, never a
  desynchronised keep-alive connection."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from program_helpers import CannedServer

from engine import events as ev
from engine.journal import Journal
from engine.program.proxy import Proxy, Session
from engine.program.upstream import Upstream
from engine.runtime.recorder import Recorder
from engine.state import State

ROOT = Path(__file__).resolve().parent.parent
CALL = (
    "from openai import OpenAI\n"
    "OpenAI(max_retries=0).chat.completions.create(\n"
    "    model='m', messages=[{'role': 'user', 'content': 'x'}])\n"
)


@pytest.fixture(scope="module")
def canned() -> CannedServer:
    with CannedServer() as s:
        yield s


def car(journal: Path, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "OPENAI_BASE_URL")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), *args],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=180,
    )  # fmt: skip


def _runs(journal: Path) -> list[str]:
    if not journal.exists():
        return []
    with Journal(journal) as j:
        return [r.run_id for r in j.runs()]


# --------------------------------------------------------------------------- exit statuses


def test_a_program_killed_by_a_signal_is_said_in_words_and_exits_128_plus_n(
    tmp_path: Path, canned: CannedServer
) -> None:
    """A program that SIGKILLs itself after one call: the run is completed with outcome bad
    and its journaled call; car says 'was killed by signal 9 (SIGKILL)' - not 'exited with
    status -9' - and exits 137, as the shell reports such a program."""
    prog = tmp_path / "die.py"
    prog.write_text(CALL + "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    journal = tmp_path / "j.db"
    r = car(journal, "record", "--base-url", canned.base_url, "--", sys.executable, str(prog))
    assert r.returncode == 137, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: the program was killed by signal 9 (SIGKILL) (run "), line
    (run_id,) = _runs(journal)
    with Journal(journal) as j:
        events = j.events(run_id)
    end = events[-1]
    assert isinstance(end, ev.RunEnded) and end.status == "completed"
    assert end.outcome["bad"] is True and end.outcome["exit_status"] == -9
    assert sum(isinstance(e, ev.LlmCall) for e in events) == 1


def test_help_says_what_record_exits_with() -> None:
    """`car record --help` names the exit statuses the command really has."""
    r = car(Path("unused.db"), "record", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "128+N when signal N killed it" in text
    assert "130 when interrupted" in text


@pytest.mark.parametrize("kind", ["not-executable", "directory", "bare-name-off-path"])
def test_a_command_that_cannot_start_is_one_line_and_leaves_no_run(
    tmp_path: Path, canned: CannedServer, kind: str
) -> None:
    """A script without its execute bit, a directory, or a bare name that is a file in the
    working directory but not on PATH (execvp would not find it): one `error:` line saying
    why, exit 1, and no run in the journal (before, each left a `failed` run behind)."""
    script = tmp_path / "agents.py"
    script.write_text("print('hi')\n")
    script.chmod(0o644)
    cmd, why = {
        "not-executable": (str(script), "it is not executable"),
        "directory": (str(tmp_path), "it is a directory"),
        "bare-name-off-path": ("agents.py", "no such program on PATH (the file here is run as"),
    }[kind]
    journal = tmp_path / "j.db"
    r = car(journal, "record", "--base-url", canned.base_url, "--", cmd, cwd=tmp_path)
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"error: cannot run {cmd!r}: {why}"), line
    assert "Traceback" not in r.stderr
    assert _runs(journal) == []


def test_replaying_a_program_that_never_called_the_model_is_faithful(
    tmp_path: Path, canned: CannedServer
) -> None:
    """A program that makes no call: recorded with 0 calls; its replay makes none either and
    ends the same, so `car replay` exits 0 (before: 'the replay diverged: fidelity n/a')."""
    prog = tmp_path / "quiet.py"
    prog.write_text("print('no model needed')\n")
    journal = tmp_path / "j.db"
    r = car(
        journal, "record", "--base-url", canned.base_url, "--json", "--",
        sys.executable, str(prog),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    r = car(journal, "replay", run_id, "--", sys.executable, str(prog))
    assert r.returncode == 0, r.stderr
    assert "outcome: recorded good (exit 0), replayed good (exit 0): same" in r.stdout
    assert "error" not in r.stderr
    # a replay that does call the model where the recording did not still diverges
    prog.write_text(CALL)
    r = car(journal, "replay", run_id, "--", sys.executable, str(prog))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")


# --------------------------------------------------------------------------- the wire


@pytest.fixture
def proxy(tmp_path: Path, canned: CannedServer) -> Proxy:
    with Journal(tmp_path / "p.db") as j:
        run_id = j.create_run("program")
        rec = Recorder(j, run_id, State(), 0)
        rec.append(
            [
                ev.RunStarted(
                    scenario="program", config={}, agents=[], policy={}, root_seed=0,
                    engine_version="test", started_at="2026-01-01T00:00:00+00:00",
                )
            ]
        )  # fmt: skip
        session = Session(recorder=rec, upstream=Upstream(canned.base_url, 30.0))
        # a body that stalls is given up after 2 s here (60 s by default)
        with Proxy(session, body_timeout=2.0) as p:
            yield p


def _exchange(port: int, data: bytes, answers: int) -> list[tuple[int, bytes]]:
    """Send `data` on one connection; read `answers` responses (status, body) or until the
    proxy closes it."""
    got: list[tuple[int, bytes]] = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        f = s.makefile("rb")
        for _ in range(answers):
            status_line = f.readline()
            if not status_line:
                break
            length = 0
            while (h := f.readline()) not in (b"\r\n", b""):
                name, _, value = h.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            got.append((int(status_line.split()[1]), f.read(length)))
        f.close()
    return got


def _request(body: bytes, *headers: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in headers)
    return f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body


BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "chunked?"}]}).encode()


def test_a_chunked_request_body_is_read_and_journaled(proxy: Proxy) -> None:
    """A request sent with Transfer-Encoding: chunked (in three chunks, one with an extension,
    and a trailer) is answered and journaled like any other; a second request on the same
    keep-alive connection is answered too (nothing of the first was left unread)."""
    chunks = [BODY[:10], BODY[10:25], BODY[25:]]
    data = b"".join(
        f"{len(c):x}{';ext=1' if i == 1 else ''}\r\n".encode() + c + b"\r\n"
        for i, c in enumerate(chunks)
    )
    data += b"0\r\nX-Trailer: yes\r\n\r\n"
    plain = _request(BODY, f"Content-Length: {len(BODY)}")
    got = _exchange(proxy.port, _request(data, "Transfer-Encoding: chunked") + plain, 2)
    assert [status for status, _ in got] == [200, 200], got
    assert json.loads(got[0][1])["choices"][0]["message"]["content"].startswith("canned reply")
    s = proxy.session
    assert s.calls == 2 and s.journaled == 2 and s.failure is None
    assert s.recorder is not None
    calls = [e for e in s.recorder.journal.events(s.recorder.run_id) if isinstance(e, ev.LlmCall)]
    assert [c.request[0]["content"] for c in calls] == ["chunked?", "chunked?"]


@pytest.mark.parametrize(
    ("headers", "status", "says"),
    [
        (("Content-Length: -5",), 400, "Content-Length is not a byte count: '-5'"),
        (("Content-Length: abc",), 400, "Content-Length is not a byte count: 'abc'"),
        (("Content-Length: 1_0",), 400, "Content-Length is not a byte count: '1_0'"),
        (("Content-Length: 99999999999",), 413, "is over the 67108864-byte limit"),
        (("Transfer-Encoding: chunked",), 400, "chunked body is malformed"),
    ],
    ids=["negative", "word", "underscore", "huge", "bad-chunk"],
)
def test_an_unreadable_request_length_is_a_400_and_closes_the_connection(
    proxy: Proxy, headers: tuple[str, ...], status: int, says: str
) -> None:
    """A request whose length cannot be read (negative, not a number, a Python-only `1_0`, a
    chunk size that is not hex) is a 400 saying so, one too large a 413; either way the proxy
    closes the connection rather than read the rest of the body as the next request, and
    nothing reaches the upstream or the journal."""
    got = _exchange(proxy.port, _request(b"zz\r\n" + BODY, *headers) + _request(b""), 3)
    assert len(got) == 1, got
    code, body = got[0]
    assert code == status
    assert says in json.loads(body)["error"]["message"]
    assert proxy.session.calls == 0 and proxy.session.journaled == 0


@pytest.mark.parametrize("messages", [[1, 2], [{"role": "user", "content": "hi"}, "hi"], [None]])
def test_a_message_that_is_not_an_object_is_refused(proxy: Proxy, messages: list[object]) -> None:
    """A message that is not a JSON object was forwarded to the model but left out of the
    journaled request: the run did not hold what the model was asked. It is a 400 naming the
    message, and nothing reaches the upstream or the journal."""
    body = json.dumps({"model": "m", "messages": messages}).encode()
    got = _exchange(proxy.port, _request(body, f"Content-Length: {len(body)}"), 1)
    assert got and got[0][0] == 400, got
    assert "is not a JSON object" in json.loads(got[0][1])["error"]["message"]
    assert proxy.session.calls == 0 and proxy.session.journaled == 0


def test_a_body_that_stalls_is_given_up_and_its_thread_freed(proxy: Proxy) -> None:
    """Headers that announce 100 bytes, then 10 of them and silence: the proxy answers 408
    once the body timeout passes and closes the connection (the thread waited for as long as
    the client kept the socket); a request on a new connection is answered meanwhile."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as s:
        s.sendall(_request(b'{"model": ', "Content-Length: 100"))
        plain = _request(BODY, f"Content-Length: {len(BODY)}")
        assert [status for status, _ in _exchange(proxy.port, plain, 1)] == [200]
        f = s.makefile("rb")
        status_line = f.readline()
        assert status_line.split()[1] == b"408", status_line
        while f.readline() not in (b"\r\n", b""):
            pass
        assert b"did not arrive within 2s" in f.read()  # then the proxy closed it
    assert proxy.session.journaled == 1
