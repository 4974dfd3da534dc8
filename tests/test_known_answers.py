"""Known answers for every format that outlives the code: the event encoding, the chain hash,
the content hash of stored texts, and checked-in journals of schema v2 and v3.

Every expected value here is a literal written down once (tests/fixtures/make_fixtures.py
says how the journals were made); nothing is recomputed with the code under test, so a change
of a formula — a field left out of the hashed bytes, another digest size, a moved boundary —
fails here. Changing a literal is changing a stored format: it needs a decision entry.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from engine import events as ev
from engine.journal import Journal, chain_hash, chain_rows
from engine.state import state_at

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# ------------------------------------------------------------------ the event encoding

RUN_STARTED = ev.RunStarted(
    scenario="heist",
    config={"a": 1},
    agents=["x", "y"],
    policy={"name": "sim"},
    root_seed=7,
    engine_version="0.1",
    started_at="2026-01-01T00:00:00Z",
    rounds=2,
)
# (event, its canonical bytes): msgpack map, "kind" first, fields in declaration order, the
# base class's `step` last, defaults omitted
ENCODINGS: list[tuple[ev.Event, str]] = [
    (
        RUN_STARTED,
        "89a46b696e64ab72756e5f73746172746564a87363656e6172696fa56865697374a6636f6e666967"
        "81a16101a66167656e747392a178a179a6706f6c69637981a46e616d65a373696da9726f6f745f73"
        "656564 07ae656e67696e655f76657273696f6ea3302e31aa737461727465645f6174b4323032362d"
        "30312d30315430303a30303a30305aa6726f756e647302",
    ),
    (
        ev.ToolResult(
            step=3, agent="intel", tool="search", param="vault", ok=False, error="no such file"
        ),
        "87a46b696e64ab746f6f6c5f726573756c74a56167656e74a5696e74656ca4746f6f6ca6736561726368"
        "a5706172616da57661756c74a26f6bc2a56572726f72ac6e6f20737563682066696c65a47374657003",
    ),
    (
        ev.ToolResult(step=3, agent="intel", tool="search", param="vault", ok=True, output="ok"),
        "87a46b696e64ab746f6f6c5f726573756c74a56167656e74a5696e74656ca4746f6f6ca6736561726368"
        "a5706172616da57661756c74a26f6bc3a66f7574707574a26f6ba47374657003",
    ),
    (
        ev.LlmCall(
            step=1,
            agent="a",
            request=[{"role": "user", "content": "hi"}],
            seed=42,
            model="m",
            response="r",
            finish_reason="stop",
            prompt_tokens=3,
        ),
        "89a46b696e64a86c6c6d5f63616c6ca56167656e74a161a7726571756573749182a4726f6c65a47573"
        "6572a7636f6e74656e74a26869a4736565642aa56d6f64656ca16da8726573706f6e7365a172ad6669"
        "6e6973685f726561736f6ea473746f70ad70726f6d70745f746f6b656e7303a47374657001",
    ),
    (
        ev.Intervention(op="resample", at=2, branch_seed=9),
        "84a46b696e64ac696e74657276656e74696f6ea26f70a8726573616d706c65a2617402ab6272616e63"
        "685f7365656409",
    ),
    (
        ev.RunEnded(status="completed", outcome={"success": True}),
        "83a46b696e64a972756e5f656e646564a6737461747573a9636f6d706c65746564a76f7574636f6d65"
        "81a773756363657373c3",
    ),
]


def _hex(s: str) -> bytes:
    return bytes.fromhex(s.replace(" ", ""))


@pytest.mark.parametrize("event,want", ENCODINGS, ids=[type(e).__name__ for e, _ in ENCODINGS])
def test_encoding_is_the_known_bytes(event: ev.Event, want: str) -> None:
    """Each representative event encodes to exactly the bytes written down, and those bytes
    decode (at the current and at the shape-stable version 2) back to the same event."""
    assert ev.encode(event) == _hex(want)
    assert ev.encode_checked(event) == _hex(want)
    assert ev.decode(_hex(want)) == event
    assert ev.decode(_hex(want), 2) == event


def test_fold_decoder_reads_the_known_llm_call() -> None:
    """The slim fold decoder reads the agent, seed and step of an LLM call from its bytes."""
    slim = ev.decode_for_fold(_hex(ENCODINGS[3][1]))
    assert isinstance(slim, ev.FoldLlmCall)
    assert (slim.agent, slim.seed, slim.step) == ("a", 42, 1)


@pytest.mark.parametrize("ok,field", [(True, "output"), (False, "error")])
def test_v1_tool_result_upcasts(ok: bool, field: str) -> None:
    """A schema-v1 tool result (one `text` field) reads as v2: the text goes to `output` when
    the call succeeded and to `error` when it failed, the other field left at its default."""
    raw = {
        "kind": "tool_result",
        "agent": "a",
        "tool": "t",
        "param": "p",
        "ok": ok,
        "text": "boom",
        "step": 4,
    }
    got = ev.decode(msgspec.msgpack.encode(raw), 1)
    assert isinstance(got, ev.ToolResult)
    assert (got.ok, got.step, got.agent, got.tool, got.param) == (ok, 4, "a", "t", "p")
    assert getattr(got, field) == "boom"
    other = got.error if ok else got.output
    assert other == (None if ok else "")


@pytest.mark.parametrize("ok,field", [(True, "output"), (False, "error")])
def test_v1_tool_result_without_text_upcasts_to_empty(ok: bool, field: str) -> None:
    """A v1 tool result that carried no `text` at all reads with an empty output or error."""
    raw = {"kind": "tool_result", "agent": "a", "tool": "t", "param": "p", "ok": ok}
    got = ev.decode(msgspec.msgpack.encode(raw), 1)
    assert isinstance(got, ev.ToolResult) and getattr(got, field) == ""


def test_fold_decoder_reads_old_versions() -> None:
    """decode_for_fold: a v2 LLM call is decoded slim like a v3 one; a v1 tool result is
    upcast like `decode` does."""
    slim = ev.decode_for_fold(_hex(ENCODINGS[3][1]), 2)
    assert isinstance(slim, ev.FoldLlmCall) and (slim.agent, slim.seed) == ("a", 42)
    raw = {"kind": "tool_result", "agent": "a", "tool": "t", "param": "p", "ok": False, "text": "x"}
    old = ev.decode_for_fold(msgspec.msgpack.encode(raw), 1)
    assert old == ev.ToolResult(agent="a", tool="t", param="p", ok=False, error="x")


def test_newer_schema_is_refused() -> None:
    """A payload written by a newer schema is refused with both versions named, not guessed."""
    from engine.errors import SchemaTooNew

    with pytest.raises(
        SchemaTooNew, match=r"^event written by schema version 7, this engine reads up to 6$"
    ):
        ev.decode(_hex(ENCODINGS[4][1]), ev.SCHEMA_VERSION + 1)


@pytest.mark.parametrize(
    "event,message",
    [
        (
            ev.ToolResult(agent="a", tool="t", param="p", ok=True, step=2**70),
            r"^refusing to journal a tool_result event: can't serialize ints",
        ),
        (
            ev.RunStarted(
                scenario="s",
                config={1: "a"},
                agents=[],
                policy={},
                root_seed=1,
                engine_version="",
                started_at="",
            ),
            r"^refusing to journal a run_started event that would not decode: Expected `str`",
        ),
        (
            ev.LlmCall(
                agent="a",
                request=[],
                seed=1,
                model="m",
                response="",
                finish_reason="",
                latency_ms=0,
            ),
            r"^refusing to journal a llm_call event that does not read back as stored$",
        ),
    ],
    ids=["overflow", "undecodable", "not-read-back"],
)
def test_encode_checked_refusals_name_the_kind(event: ev.Event, message: str) -> None:
    """What would not read back is refused with a message naming the event's kind and why."""
    from engine.errors import JournalError

    with pytest.raises(JournalError, match=message):
        ev.encode_checked(event)


def test_resolve_refuses_an_unknown_extension() -> None:
    """A stored payload with an extension other than the text reference is refused, named."""
    stored = msgspec.msgpack.encode({"kind": "chat_message", "text": msgspec.msgpack.Ext(2, b"x")})
    with pytest.raises(ValueError, match=r"^unknown msgpack extension 2$"):
        ev.resolve(stored, lambda d: b"")


# ------------------------------------------------------------------ the chain hash


def _chain_by_hand(prev: str, seq: int, kind: str, version: int, payload: bytes) -> str:
    """The documented layout, written out independently: blake2b-256 over the previous hash's
    text, seq as big-endian int64, version as big-endian uint32, kind, a NUL, the payload."""
    body = prev.encode() + struct.pack(">q", seq) + struct.pack(">I", version) + kind.encode()
    return "b2:" + hashlib.blake2b(body + b"\x00" + payload, digest_size=32).hexdigest()


CHAIN_CASES = [
    (
        "",
        0,
        "chat_message",
        3,
        b"abc",
        "b2:7595367f39a3ad0b9c4cddee83e0574b4d93eb891612c71d9bff012592997f82",
    ),
    (
        "b2:00",
        5,
        "tool_call",
        2,
        b"",
        "b2:c0e370be4d8a56bac1256039b0b93cbd2b826fa69ac7f3e3394b17e46e1e1f7f",
    ),
]


@pytest.mark.parametrize("prev,seq,kind,version,payload,want", CHAIN_CASES)
def test_chain_hash_known_values(
    prev: str, seq: int, kind: str, version: int, payload: bytes, want: str
) -> None:
    """The chain hash of known inputs is the literal, and the literal is the documented layout."""
    assert chain_hash(prev, seq, kind, version, payload) == want
    assert _chain_by_hand(prev, seq, kind, version, payload) == want


def test_chain_hash_covers_every_input() -> None:
    """Changing any one input — previous hash, seq, kind, version or one payload byte — changes
    the hash (a field left out of the hashed bytes fails this)."""
    base = ("b2:ab", 7, "tool_call", 3, b"payload")
    h = chain_hash(*base)
    variants = [
        ("b2:ac", 7, "tool_call", 3, b"payload"),
        ("b2:ab", 8, "tool_call", 3, b"payload"),
        ("b2:ab", 7, "tool_cal", 3, b"payload"),
        ("b2:ab", 7, "tool_call", 2, b"payload"),
        ("b2:ab", 7, "tool_call", 3, b"paylOad"),
        ("b2:ab", 7, "tool_cal", 3, b"lpayload"),  # the NUL separates kind from payload
    ]
    for v in variants:
        assert chain_hash(*v) != h, v


def test_chain_rows_link_each_event_to_the_previous() -> None:
    """chain_rows: seq counts up from the given start, each hash chains on the one before,
    the first on the given `prev`, the version written is hashed with the row (known answers
    for a v3 row); by default the version written is the current schema's (6)."""
    events = [e for e, _ in ENCODINGS[:3]]
    rows = chain_rows("r", events, 4, "b2:prev", version=3)
    prev = "b2:prev"
    for i, (row, (event, want)) in enumerate(zip(rows, ENCODINGS[:3], strict=True)):
        run_id, seq, step, kind, version, payload, h = row
        assert (run_id, seq, step, kind, version) == ("r", 4 + i, event.step, ev.kind_of(event), 3)
        assert payload == _hex(want)
        assert h == _chain_by_hand(prev, 4 + i, kind, 3, payload)
        prev = h
    assert rows[-1][6] == "b2:4345bcd26f6ed1c527ac69a79b3117894a0dcb4f6654dfb73e09e845f6f2375e"
    current = chain_rows("r", events, 4, "b2:prev")
    assert [r[4] for r in current] == [6, 6, 6]
    prev = "b2:prev"
    for row in current:
        assert row[6] == _chain_by_hand(prev, row[1], row[3], 6, row[5])
        prev = row[6]
    assert current[-1][6] != rows[-1][6]  # the version is part of what is hashed


# ------------------------------------------------------------------ the content hash of texts


def test_text_digest_known_value() -> None:
    """A text's key is `b2:` and the hex of blake2b-256 of its UTF-8 bytes."""
    digest = ev.text_digest(b"hello")
    assert digest == hashlib.blake2b(b"hello", digest_size=32).digest()
    assert (
        ev.text_key(digest) == "b2:324dcf027dd4a30a932c441f365a25e86b173defa4b8e58948253471b81b72cf"
    )


def test_externalize_known_bytes_and_back() -> None:
    """A 64-byte message text becomes the msgpack extension 1 carrying its 32-byte digest, in
    the known stored bytes; resolving them gives back exactly the encoded event."""
    event = ev.ChatMessage(step=0, agent="a", text="x" * 64)
    full = ev.encode(event)
    stored, texts = ev.externalize(full)
    digest = _hex("68fe15b51246fb05aa84b11d8ad165b0c71f34348f386ef879dda156340ef6e9")
    assert stored == _hex(
        "84a46b696e64ac636861745f6d657373616765a56167656e74a161a474657874c72001"
        "68fe15b51246fb05aa84b11d8ad165b0c71f34348f386ef879dda156340ef6e9a47374657000"
    )
    assert texts == {digest: "x" * 64}
    assert ev.refs_of(stored) == [digest]
    assert ev.resolve(stored, {digest: b"x" * 64}.__getitem__) == full


@pytest.mark.parametrize(
    "text,kept_inline",
    [
        ("x" * 63, True),  # 63 bytes: one short of MIN_TEXT
        ("x" * 64, False),
        ("\u20ac" * 21, True),  # 63 UTF-8 bytes in 21 characters
        ("\u20ac" * 22, False),  # 66 bytes
        ("\U0001f600" * 16, False),  # 64 bytes in 16 characters (the short-cut's bound)
        ("\U0001f600" * 15 + "abc", True),  # 63 bytes in 18 characters
    ],
)
def test_text_reference_boundary(text: str, kept_inline: bool) -> None:
    """Strings of at least 64 UTF-8 bytes become references, shorter ones stay inline — the
    boundary in bytes, not characters, tested on both sides. Inside lists and dicts too."""
    for event in (
        ev.ChatMessage(agent="a", text=text),
        ev.LlmCall(
            agent="a",
            request=[{"role": "user", "content": text}],
            seed=1,
            model="m",
            response="",
            finish_reason="stop",
        ),
    ):
        full = ev.encode(event)
        stored, texts = ev.externalize(full)
        if kept_inline:
            assert (stored, texts) == (full, {})
        else:
            assert texts == {hashlib.blake2b(text.encode(), digest_size=32).digest(): text}
            assert len(stored) < len(full)
            assert ev.resolve(stored, lambda d: text.encode()) == full


def test_externalize_long_strings_in_a_list() -> None:
    """A list of strings (the agents of a run) is walked too: a 16-character string of 64
    UTF-8 bytes becomes a reference, a 16-character ASCII one stays."""
    wide, narrow = "\U0001f600" * 16, "n" * 16
    event = ev.RunStarted(scenario="s", config={}, agents=[wide, narrow], policy={}, root_seed=1,
                          engine_version="", started_at="")  # fmt: skip
    stored, texts = ev.externalize(ev.encode(event))
    assert list(texts.values()) == [wide]
    assert narrow.encode() in stored


def test_externalize_trusts_the_callers_memo() -> None:
    """A digest already in the caller's memo is used as it is (not recomputed): the memo is
    the cache that makes appends of repeated texts cheap."""
    text = "m" * 70
    memo = {text: b"\x07" * 32}
    _, texts = ev.externalize(ev.encode(ev.ChatMessage(agent="a", text=text)), memo)
    assert texts == {b"\x07" * 32: text}


def test_externalize_keeps_the_kind_and_uses_the_memo() -> None:
    """The `kind` tag is never replaced, and a memo given by the caller is filled and used."""
    long_kind_free = ev.ToolResult(agent="a", tool="t", param="p" * 70, ok=True, output="o" * 80)
    memo: dict[str, bytes] = {}
    stored, texts = ev.externalize(ev.encode(long_kind_free), memo)
    assert set(texts.values()) == {"p" * 70, "o" * 80}
    assert memo == {s: hashlib.blake2b(s.encode(), digest_size=32).digest() for s in texts.values()}
    assert (
        msgspec.msgpack.Decoder(ext_hook=lambda c, d: None).decode(stored)["kind"] == "tool_result"
    )
    again, texts2 = ev.externalize(ev.encode(long_kind_free), memo)
    assert (again, texts2) == (stored, texts)


# ------------------------------------------------------------------ the checked-in journals

V2_HEADS = {
    "2cee56fa4461": (35, "b2:69710464b681d17ba70951ba91acb387d1f7af701336d10ad2d9b1debacaeb31"),
    "f127b61ac668": (36, "b2:9d91176e07cf5594a9b09c6543f8be6a22c523cedcd06f8996211cf9ba621b64"),
}
V3_PARENT = "7cc905d94523"
V3_BRANCHES = ("a5d38dc637fa", "c241030b4fa6")
# the head hash of each run covers every event of its history
V3_HEADS = {
    V3_PARENT: (34, "b2:ea737cd1638e9807e2276a81d7e1e64088094ba1d09b1f001504c4fa6cd83747"),
    "a5d38dc637fa": (35, "b2:cebe6e370b897c7b711d93fda337e895962ef7137d57704c45596e90477936ac"),
    "c241030b4fa6": (35, "b2:3676ec74c500cdb3a2d220ee718f880cfcbc32a40f5cec56e923d8329795d5dc"),
}
V3_FIRST = "b2:35cf2e56711663b26981ce9e6b020455743f2573b0e7cc315bc3f12794839e23"
V3_BRANCH_SEEDS = {"a5d38dc637fa": 1491423321324003647, "c241030b4fa6": 8102103572083298661}


def _car(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


@pytest.fixture
def v3(tmp_path: Path) -> Path:
    dst = tmp_path / "journal_v3.db"
    shutil.copy(FIXTURES / "journal_v3.db", dst)
    return dst


def test_v3_fixture_is_what_it_claims() -> None:
    """The checked-in v3 journal is at revision 0003, stores its long texts in `texts` and
    holds the parent and the two branches forked at step 2 (event 12)."""
    con = sqlite3.connect(f"file:{FIXTURES / 'journal_v3.db'}?mode=ro", uri=True)
    try:
        assert con.execute("SELECT version_num FROM alembic_version").fetchall() == [
            ("0003_texts",)
        ]
        assert con.execute("SELECT count(*) FROM texts").fetchone() == (56,)
        assert con.execute("SELECT DISTINCT version FROM events").fetchall() == [(3,)]
        forks = con.execute(
            "SELECT run_id, parent_run_id, fork_seq FROM runs ORDER BY run_id"
        ).fetchall()
    finally:
        con.close()
    assert forks == [
        (V3_PARENT, None, None),
        ("a5d38dc637fa", V3_PARENT, 12),
        ("c241030b4fa6", V3_PARENT, 12),
    ]


@pytest.mark.parametrize("readonly", [True, False], ids=["read-only", "opened-for-writing"])
def test_v3_journal_known_hashes(v3: Path, readonly: bool) -> None:
    """Today's engine reads the v3 journal to exactly the recorded chain: the first and head
    hash of every run, every hash re-derived from the resolved payload, the branches' seeds."""
    with Journal(v3, readonly=readonly) as j:
        for run, (head_seq, head_hash) in V3_HEADS.items():
            rows = list(j.read(run))
            assert [r.seq for r in rows] == list(range(head_seq + 1))
            assert rows[0].hash == V3_FIRST  # branches share the parent's first 12 events
            assert (rows[-1].seq, rows[-1].hash) == (head_seq, head_hash)
            assert j.hash_at(run, head_seq) == head_hash
            prev = ""
            for r in rows:
                assert chain_hash(prev, r.seq, r.kind, r.version, r.payload) == r.hash
                prev = r.hash
        for run, seed in V3_BRANCH_SEEDS.items():
            opener = next(iter(j.read(run, 12, 13))).event
            assert opener == ev.Intervention(
                step=2, op="observation", at=2, value="the vault is empty", branch_seed=seed
            )


def test_v3_journal_cli_verify(v3: Path) -> None:
    """`car verify --json` on the v3 journal prints exactly what the engine that wrote it did."""
    res = _car("--journal", str(v3), "verify", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == json.loads((FIXTURES / "journal_v3.verify.json").read_text())


def test_v3_journal_cli_state_and_runs(v3: Path) -> None:
    """`car state --reveal --json` and `car runs --json` print what they printed then."""
    res = _car("--journal", str(v3), "state", V3_PARENT[:4], "--at", "3", "--json", "--reveal")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == json.loads(
        (FIXTURES / "journal_v3.state_at3.json").read_text()
    )
    res = _car("--journal", str(v3), "runs", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == json.loads((FIXTURES / "journal_v3.runs.json").read_text())


def test_v2_and_v3_fixtures_fold_alike(v3: Path) -> None:
    """Both fixtures recorded the same heist (seed 3, one round): s_3 folded from the v3
    journal equals the state the v2 engine wrote down."""
    want = json.loads((FIXTURES / "journal_v2.state_2cee_at3.json").read_text())
    with Journal(v3, readonly=True) as j:
        got = json.loads(msgspec.json.encode(state_at(j, V3_PARENT, 3, snapshots=False)))
    assert got["transcript"] == want["transcript"]
    assert (got["seq"], got["step"], got["root_seed"]) == (want["seq"], want["step"], 3)


def _tamper(path: Path, run: str, seq: int) -> None:
    """Rewrite one stored payload behind the triggers' back (dropped and re-created)."""
    con = sqlite3.connect(path)
    try:
        (sql,) = con.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = 'events_no_update'"
        ).fetchone()
        con.execute("DROP TRIGGER events_no_update")
        (payload,) = con.execute(
            "SELECT payload FROM events WHERE run_id = ? AND seq = ?", (run, seq)
        ).fetchone()
        changed = bytes(payload).replace(b"kind", b"kine", 1)
        assert changed != bytes(payload)
        con.execute(
            "UPDATE events SET payload = ? WHERE run_id = ? AND seq = ?", (changed, run, seq)
        )
        con.execute(sql)
        con.commit()
    finally:
        con.close()


@pytest.mark.parametrize(
    "run,seq",
    [
        (V3_PARENT, 0),
        (V3_PARENT, 11),
        (V3_PARENT, 12),
        (V3_PARENT, 34),
        ("a5d38dc637fa", 12),
        ("c241030b4fa6", 35),
    ],
)
def test_verify_finds_a_tampered_event_anywhere(v3: Path, run: str, seq: int) -> None:
    """An altered payload is reported at its own run and seq — the first event of a run, the
    last one shared with the branches, a branch's first own event and a run's head alike."""
    _tamper(v3, run, seq)
    with Journal(v3, readonly=True) as j:
        report = j.verify()
    hashes = {(p.run_id, p.seq) for p in report.problems if p.code == "hash"}
    assert hashes == {(run, seq)}, report.problems


def test_v2_fixture_known_heads() -> None:
    """The v2 journal's chain (version 2 hashed into every link) is still the recorded one."""
    with Journal(FIXTURES / "journal_v2.db", readonly=True) as j:
        heads = {
            r.run_id: (j.head(r.run_id), j.hash_at(r.run_id, j.head(r.run_id) - 1))
            for r in j.runs()
        }
        versions = {row.version for r in j.runs() for row in j.read(r.run_id)}
    assert versions == {2}
    assert heads == V2_HEADS
