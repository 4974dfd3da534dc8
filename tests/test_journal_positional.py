"""Event schema v5 (what the engine writes, docs/decisions.md entry 42): a stored payload is
`[kind code, field mask, values...]` in the fixed order of `ev.STORED_FIELDS`, with v4's
back-references inside, and an LLM request may be a delta of two bases (the agent's previous
request and the latest one of the history). Readers rebuild the canonical map bytes, which the
hash chain covers."""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest
from journal_helpers import KEY_OF, StillClock, stored_rows

from engine import events as ev
from engine.errors import TamperedJournal
from engine.heist.session import record_heist
from engine.journal import Journal
from engine.policies.registry import make_policy
from engine.verify import verify_journal

Ext = msgspec.msgpack.Ext


def _call(step: int, agent: str, request: list[dict[str, str]], response: str) -> ev.LlmCall:
    return ev.LlmCall(
        step=step, agent=agent, request=request, seed=1, model="m", response=response,
        finish_reason="stop",
    )  # fmt: skip


SYS_A = "You are a, the planner of a small crew; keep it short."  # 54 characters
SYS_B = "You are b, the driver of a small crew; keep it short too."
SAID_A = "a: the guard leaves the vault at 03:10 sharp."  # 45 characters
SAID_B = "b: the van waits two streets east of the bank."
CLOSE = "Reply now, keeping to the plan of the crew."  # 43 characters


def test_stored_fields_follow_the_structs() -> None:
    """Every field of every event type has a stored position, and every kind has a code; the
    codes are those of the journal's `kinds` table. The positions of the first schema's fields
    are those of the order the Struct encodes them; a field added since is appended (the
    Struct encodes it before the inherited `step`: the stored form reorders it back)."""
    from engine.journal import KIND_CODES

    added = {"llm_call": ("dropped",)}
    types = {t.__struct_config__.tag: t for t in typing.get_args(ev.AnyEvent)}
    assert set(types) == set(ev.STORED_FIELDS) == set(ev.KIND_CODES)
    for kind, t in types.items():
        new = added.get(kind, ())
        first = tuple(f for f in t.__struct_fields__ if f not in new)
        assert ev.STORED_FIELDS[kind] == first + new, kind
    assert KIND_CODES is ev.KIND_CODES
    assert ev.KIND_CODES["llm_call"] == 3 and ev.KIND_CODES["chat_message"] == 6


def test_v5_encoding_known_answer(tmp_path: Path) -> None:
    """The stored bytes of a small two-agent run, exactly. Event 1 (a chat message) is
    [6, mask of agent|text|step, "b", back-reference to event 0's response, 0]; b's second
    request (event 4) is a delta of two bases, its own previous request (event 2) and the
    latest request (event 3, a's): its system prompt and a's line copied from the first, b's
    line (new to b's own request) from the second, the new message a splice of b's response."""
    path = tmp_path / "j.db"
    r0 = [{"role": "system", "content": SYS_A}, {"role": "user", "content": CLOSE}]
    with Journal(path) as j:
        j.write_version = 5  # the v5 layer itself (v6 packs it: test_journal_packed)
        run = j.create_run("t", run_id="r1")
        j.append(run, [_call(0, "a", r0, SAID_A), ev.ChatMessage(step=0, agent="b", text=SAID_A)])
        r1 = [
            {"role": "system", "content": SYS_B},
            {"role": "user", "content": SAID_A},
            {"role": "user", "content": CLOSE},
        ]
        j.append(run, [_call(1, "b", r1, SAID_B)], 2)
        r2 = [
            {"role": "system", "content": SYS_A},
            {"role": "user", "content": SAID_A},
            {"role": "user", "content": SAID_B},
            {"role": "user", "content": CLOSE},
        ]
        j.append(run, [_call(2, "a", r2, "ok")], 3)
        r3 = [
            {"role": "system", "content": SYS_B},
            *r2[1:3],
            {"role": "user", "content": "b: " + SAID_B},
        ]
        j.append(run, [_call(3, "b", r3, "ok")], 4)
        events = j.events(run)
        assert [s.payload for s in j.read(run)] == [ev.encode(e) for e in events]
        assert events[4] == _call(3, "b", r3, "ok")
        assert verify_journal(j).ok
    stored = stored_rows(path, run)
    assert [v for _s, v, _p in stored] == [5] * 5
    chat = msgspec.msgpack.decode(stored[1][2])
    # agent, text, step are fields 0, 1, 2 of chat_message
    # the text is string 2 of event 0 (its system prompt, closing line, response)
    assert chat == [6, 0b111, "b", Ext(ev.STR_EXT, msgspec.msgpack.encode([[0, 2]])), 0]
    call = msgspec.msgpack.decode(stored[4][2])
    assert call[0] == 3
    # agent, request, seed, model, response, finish_reason, step: bits 0-5 and 11
    assert call[1] == 0b1000_0011_1111
    request = call[3]
    assert request[0] == Ext(ev.REQ_EXT, msgspec.msgpack.encode([2, 3]))
    # messages 0..2 of b's own request (its system prompt, a's line); a's new line from the
    # second base (message 2 of event 3)
    assert request[1:3] == [[0, 2], [2, 3, 1]]
    assert request[3][0] == "user" and request[3][1].code == ev.STR_EXT
    # pinned: a change of the encoding is a new schema version, not a silent edit
    digest = hashlib.blake2b(b"".join(p for _s, _v, p in stored), digest_size=16).hexdigest()
    assert digest == KNOWN_V5_DIGEST


KNOWN_V5_DIGEST = "c2f21d9d9e294b7f1c7bb7cb77708c7b"


@pytest.fixture(scope="module")
def heist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("v5") / "j.db"
    with Journal(path) as j:
        j.write_version = 5  # the v5 layer itself (v6 packs it: test_journal_packed)
        result = record_heist(j, make_policy({"name": "sim"}), seed=7, rounds=3)
    return path, result.run_id


def test_heist_uses_second_bases_and_reads_canonical(heist: tuple[Path, str]) -> None:
    """On a recorded heist most later requests are deltas of two bases, every event reads
    back as its canonical bytes, and the requests stored are far smaller than v4's one-base
    deltas of the same run would be (the field names alone were ~110 bytes a call)."""
    path, run = heist
    with Journal(path, readonly=True) as j:
        events = list(j.read(run))
        assert all(s.payload == ev.encode(s.event) for s in events)
        assert verify_journal(j).ok
    calls = [msgspec.msgpack.decode(p) for _s, _v, p in stored_rows(path, run) if p[1] == 3]
    heads = [msgspec.msgpack.decode(c[3][0].data) for c in calls if type(c[3][0]) is Ext]
    two = sum(type(h) is list for h in heads)
    print(f"{len(calls)} calls, {len(heads)} deltas, {two} of two bases")
    assert len(calls) == 18 and two >= len(calls) // 2
    v4 = tmp_path_v4(path.parent)
    with Journal(v4) as j:
        j.write_version = 4
        old = record_heist(j, make_policy({"name": "sim"}), seed=7, rounds=3).run_id
        # the same calls (latency_ms is wall time, so it differs)
        assert [(e.request, e.response) for e in j.events(old) if isinstance(e, ev.LlmCall)] == [
            (s.event.request, s.event.response) for s in events if isinstance(s.event, ev.LlmCall)
        ]
    size = sum(len(p) for *_x, p in stored_rows(path, run))
    size_v4 = sum(len(p) for *_x, p in stored_rows(v4, old))
    print(f"stored payloads: v5 {size} B, v4 {size_v4} B")
    assert size < 0.75 * size_v4


def tmp_path_v4(parent: Path) -> Path:
    return parent / "v4.db"


def _tamper(path: Path, run: str, seq: int, payload: bytes) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        db.execute(f"DROP TRIGGER {name}")
    db.execute(
        f"UPDATE events SET payload = ? WHERE run_key = {KEY_OF} AND seq = ?", (payload, run, seq)
    )
    db.close()


@pytest.mark.parametrize(
    "change",
    [
        "mask bit added",
        "value dropped",
        "unknown kind code",
        "second base after the event",
    ],
)
def test_malformed_positional_payload_is_found(
    tmp_path: Path, heist: tuple[Path, str], change: str
) -> None:
    """A stored v5 payload altered so that it no longer rebuilds (a mask naming a field it
    does not hold, a value missing, an unknown kind code, a request based on a later event):
    a reader gets TamperedJournal in one line, verify a finding at that event."""
    src, run = heist
    path = tmp_path / "j.db"
    shutil.copy(src, path)
    stored = stored_rows(path, run)
    seq, _v, p = next(r for r in stored[10:] if r[2][1] == 3)  # a later LLM call
    tree: list[Any] = msgspec.msgpack.decode(p)
    later = -1
    if change == "mask bit added":
        tree[1] |= 1 << 8  # system_fingerprint, absent
    elif change == "value dropped":
        del tree[-2]
    elif change == "unknown kind code":
        tree[0] = 99
    else:
        req = tree[3]
        assert type(req[0]) is Ext
        head = msgspec.msgpack.decode(req[0].data)
        first = head if type(head) is int else head[0]
        # a later LLM call, which would resolve: only the order of references refuses it
        later = next(s for s, _v, pp in stored if s > seq and pp[1] == ev.KIND_CODES["llm_call"])
        req[0] = Ext(ev.REQ_EXT, msgspec.msgpack.encode([first, later]))
    _tamper(path, run, seq, msgspec.msgpack.encode(tree))
    with Journal(path, readonly=True) as j:
        with pytest.raises(TamperedJournal) as got:
            j.events(run)
        assert "\n" not in str(got.value) and f"event {seq}" in str(got.value)
        if change == "second base after the event":
            assert f"request of seq {seq} based on seq {later}" in str(got.value)
        report = verify_journal(j)
    assert any(p.seq == seq and p.run_id == run for p in report.problems)


def _far_parts(payload: bytes) -> list[list[Any]]:
    """The `[seq, i, None]` parts (strings of the parent past the fork) a stored payload uses."""
    found: list[list[Any]] = []

    def hook(code: int, data: memoryview) -> Any:
        if code == ev.STR_EXT:
            found.extend(
                x for x in msgspec.msgpack.decode(bytes(data)) if type(x) is list and len(x) == 3
            )
        return None

    msgspec.msgpack.Decoder(ext_hook=hook).decode(payload)
    return [p for p in found if p[2] is None]


@pytest.fixture
def rerun(tmp_path: Path, heist: tuple[Path, str]) -> tuple[Path, str, str, int]:
    """A branch forked at step 1 that keeps the parent's actions at every later step (as a
    Shapley coalition does): it writes what its parent holds past the fork point."""
    from engine.interventions import DoResample, parent_info, run_branch

    src, run = heist
    path = tmp_path / "j.db"
    shutil.copy(src, path)
    with Journal(path) as j:
        j.write_version = 5  # the v5 layer itself (v6 packs it: test_journal_packed)
        info = parent_info(j, run)
        keep = {s: a for s, a in info.actions.items() if s > 1}
        branch = run_branch(j, info, DoResample(k=1), 3, keep=keep).run_id
        fork = j.run(branch).fork_seq
    assert fork is not None
    return path, run, branch, fork


def test_branch_refers_to_its_parent_past_the_fork(rerun: tuple[Path, str, str, int]) -> None:
    """A branch that repeats its parent stores the parent's strings as references to the
    parent's own events past the fork point (not part of its history), reads back canonical,
    verifies clean, and stores under 70% of what the parent's same events store (61% here:
    what is left is mostly seeds, timings and short fields)."""
    path, run, branch, fork = rerun
    stored = stored_rows(path, branch)
    far = [p for _s, _v, body in stored for p in _far_parts(body)]
    print(f"{len(far)} references past the fork at seq {fork}")
    assert len(far) >= 20
    assert all(p[0] >= fork for p in far)  # only what the history does not hold
    with Journal(path, readonly=True) as j:
        assert all(s.payload == ev.encode(s.event) for s in j.read(branch))
        assert verify_journal(j).ok
    parent_after = sum(len(b) for s, _v, b in stored_rows(path, run) if s >= fork)
    mine = sum(len(b) for _s, _v, b in stored)
    print(f"branch payloads {mine} B, the parent's past the fork {parent_after} B")
    assert mine < 0.7 * parent_after


def test_tampered_parent_string_names_the_branch_events(
    rerun: tuple[Path, str, str, int],
) -> None:
    """One byte changed in a string of the parent past the fork that the branch refers to:
    verify names that parent event and every branch event that refers to it (each at its run
    and seq), and nothing of the branch that does not contain the string."""
    path, run, branch, _fork = rerun
    users: dict[tuple[int, int], set[int]] = {}
    for s, _v, body in stored_rows(path, branch):
        for p in _far_parts(body):
            users.setdefault((p[0], p[1]), set()).add(s)
    (holder, idx), used_by = max(users.items(), key=lambda kv: len(kv[1]))
    (payload,) = [b for s, _v, b in stored_rows(path, run) if s == holder]
    text = ev._event_strings(ev._marked_decoder.decode(payload))[idx]
    with Journal(path, readonly=True) as j:
        containing = {s.seq for s in j.read(branch) if text.encode() in s.payload}
    at = payload.index(text.encode())
    _tamper(path, run, holder, payload[:at] + bytes([payload[at] ^ 0x01]) + payload[at + 1 :])
    with Journal(path, readonly=True) as j:
        report = verify_journal(j)
    in_parent = {p.seq for p in report.problems if p.code == "hash" and p.run_id == run}
    in_branch = {p.seq for p in report.problems if p.code == "hash" and p.run_id == branch}
    print(f"string {idx} of parent event {holder} used by {sorted(used_by)}; named {in_branch}")
    assert holder in in_parent
    assert used_by <= in_branch <= containing


def test_parent_reference_in_a_root_is_found(tmp_path: Path, heist: tuple[Path, str]) -> None:
    """A root run's event altered to refer past a fork it does not have: a reader gets
    TamperedJournal in one line, verify a finding at that event."""
    src, run = heist
    path = tmp_path / "j.db"
    shutil.copy(src, path)
    seq, _v, p = next(r for r in stored_rows(path, run) if r[2][1] == 6)  # a chat message
    tree: list[Any] = msgspec.msgpack.decode(p)
    tree[3] = Ext(ev.STR_EXT, msgspec.msgpack.encode([[0, 0, None]]))
    _tamper(path, run, seq, msgspec.msgpack.encode(tree))
    with Journal(path, readonly=True) as j:
        # the reason itself (the temporary path holds the test's name, "parent" included)
        why = f"reference to a parent's event from seq {seq} of a root"
        with pytest.raises(TamperedJournal, match=f"event {seq} .*: {why}") as got:
            j.events(run)
        assert "\n" not in str(got.value)
        report = verify_journal(j)
    assert any(p.seq == seq and p.run_id == run for p in report.problems)


@pytest.mark.parametrize("version", [5, 4])
def test_stored_heist_known_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    """The stored bytes of a recorded heist (two rounds, the sim crew, a frozen clock), of a
    branch that re-runs it from step 1 (references past the fork) and of one resampled at
    step 5, pinned by digest: any change of how v5 compacts — which base a request is a delta
    of, which string a reference names, what a splice keeps — is a new schema version, not a
    silent edit. Each also reads back as its canonical bytes."""
    import itertools

    from engine.interventions import DoResample, parent_info, run_branch

    # branches take the step loop's default clock
    monkeypatch.setattr("engine.runtime.episode.SystemClock", StillClock)
    path = tmp_path / "j.db"
    ids = itertools.count()
    with Journal(path, ids=lambda: f"pin{next(ids):09d}") as j:
        j.write_version = version
        run = record_heist(
            j, make_policy({"name": "sim"}), seed=11, rounds=2, clock=StillClock()
        ).run_id
        info = parent_info(j, run)
        keep = {s: a for s, a in info.actions.items() if s > 1}
        again = run_branch(j, info, DoResample(k=1), 5, keep=keep).run_id
        other = run_branch(j, info, DoResample(k=5), 9).run_id
        for r in (run, again, other):
            assert all(s.payload == ev.encode(s.event) for s in j.read(r))
    digests = {}
    for name, r in (("run", run), ("again", again), ("other", other)):
        stored = stored_rows(path, r)
        assert {v for _s, v, _p in stored} == {version}
        blob = b"".join(p for _s, _v, p in stored)
        digests[name] = (len(stored), len(blob), hashlib.blake2b(blob, digest_size=16).hexdigest())
    print(digests)
    assert digests == KNOWN_HEIST_DIGESTS[version]


# version -> name -> (events, stored bytes, blake2b-128 of the stored payloads in seq order).
# The branches' pins were taken again when their step seeds began to mix in the run's root
# seed (decision 62): they decide other actions, so they hold other events; the run's pins,
# and so the compaction itself, are unchanged.
KNOWN_HEIST_DIGESTS: dict[int, dict[str, tuple[int, int, str]]] = {}
KNOWN_HEIST_DIGESTS[5] = {
    "run": (53, 8352, "0de5af0d6168550c725192f0317eeb2e"),
    "again": (48, 3630, "da82566bee59eec0af1237ec54726d02"),
    "other": (30, 3610, "3645c08bf6873c20fdfac92b779379fe"),
}
KNOWN_HEIST_DIGESTS[4] = {
    "run": (53, 11814, "d49a3c3ad83ec12d36b91594224e0f7c"),
    "again": (48, 8791, "d2c8c529d72db725f28f300fa6efeed4"),
    "other": (30, 5985, "44d61d2f55104470996612766391d746"),
}


def _holds_ref(tree: Any) -> bool:
    if type(tree) is list:
        return any(_holds_ref(x) for x in tree)
    if type(tree) is dict:
        return any(_holds_ref(x) for x in tree.values())
    return type(tree) is ev._Ref


def test_fold_reads_stored_payloads_as_the_full_ones(rerun: tuple[Path, str, str, int]) -> None:
    """The fold's shortcut over stored v5 payloads (no resolution) gives exactly what decoding
    the rebuilt canonical bytes gives, for every event of a heist and of a branch with
    references past its fork; it never gives up on an LLM call (it reads only agent, seed and
    step) nor on an event that holds no reference."""
    path, run, branch, _fork = rerun
    with Journal(path, readonly=True) as j:
        full = {(r, s.seq): s.payload for r in (run, branch) for s in j.read(r)}
    seen = {"llm_call": 0, "plain": 0, "resolved": 0}
    for r in (run, branch):
        for seq, _v, stored in stored_rows(path, r):
            got = ev.decode_stored_for_fold(stored)
            want = ev.decode_for_fold(full[(r, seq)])
            tree = msgspec.msgpack.decode(stored)
            has_ref = _holds_ref(ev._marked_decoder.decode(stored))
            if tree[0] == ev.KIND_CODES["llm_call"]:
                assert got == want and type(got) is ev.FoldLlmCall, seq
                assert got.step == tree[-1] and got.agent == tree[2]
                seen["llm_call"] += 1
            elif got is None:
                assert has_ref, f"gave up on seq {seq} of {r}, which holds no reference"
                seen["resolved"] += 1
            else:
                assert got == want, seq
                seen["plain"] += 1
    print(seen)
    assert min(seen.values()) >= 5


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ([3], r"^a stored v5 event is not \[code, mask, values\.\.\.\]$"),
        ({"kind": "control"}, r"^a stored v5 event is not \[code, mask, values\.\.\.\]$"),
        ([99, 1, "x"], r"^unknown event kind code 99$"),
        (["llm_call", 1, "x"], r"^unknown event kind code 'llm_call'$"),
        ([8, -1], r"^malformed field mask -1 of a control event$"),
        ([8, 8, "x"], r"^malformed field mask 8 of a control event$"),
        ([8, "1", "x"], r"^malformed field mask '1' of a control event$"),
        ([8, [1], "x"], r"^malformed field mask \[1\] of a control event$"),
        ([8, 0b11, "pause"], r"^a control event holds 1 values where its mask names 2$"),
        ([8, 0b1, "pause", "why"], r"^a control event holds 2 values where its mask names 1$"),
    ],
)
def test_malformed_positional_tree_is_named(tree: Any, message: str) -> None:
    """What makes a stored v5 payload unreadable is said in one line: not an array, an unknown
    kind code, a mask naming fields the kind does not have (or not an integer), a mask and
    values that disagree."""
    with pytest.raises(ValueError, match=message):
        ev.from_positional(tree)


def test_positional_tree_rebuilds_the_map_in_the_structs_order() -> None:
    """`[code, mask, values]` becomes the event's map, kind first, fields in their Struct's
    order and only those the mask names; the same tree twice gives the same map (the layout
    is cached per code and mask)."""
    tree = [8, 0b101, "stop", 7]  # control: action, (no reason), step
    for _ in range(2):
        out = ev.from_positional(tree)
        assert list(out.items()) == [("kind", "control"), ("action", "stop"), ("step", 7)]
    assert ev.decode(msgspec.msgpack.encode(out)) == ev.Control(action="stop", step=7)


@pytest.mark.parametrize(
    "change", ["values missing", "agent not text", "seed not an integer", "step not an integer"]
)
def test_fold_shortcut_gives_up_on_odd_llm_calls(change: str) -> None:
    """A stored LLM call whose agent, seed or step is not what the fold expects, or whose
    values disagree with its mask, is left to the full decoder (None), never folded wrongly."""
    call = ev.LlmCall(
        step=4, agent="a", request=[{"role": "user", "content": "go"}], seed=9, model="m",
        response="ok", finish_reason="stop",
    )  # fmt: skip
    tree: list[Any] = msgspec.msgpack.decode(ev.Compactor().compact(0, ev.encode(call)))
    assert ev.decode_stored_for_fold(msgspec.msgpack.encode(tree)) == ev.FoldLlmCall(
        agent="a", seed=9, step=4
    )
    if change == "values missing":
        del tree[-1]
    elif change == "agent not text":
        tree[2] = 5
    elif change == "seed not an integer":
        tree[4] = "9"
    else:
        tree[-1] = "4"
    assert ev.decode_stored_for_fold(msgspec.msgpack.encode(tree)) is None


def test_long_edited_message_is_stored_as_line_slices() -> None:
    """A long message that differs from the base request's message at its position in two
    lines far apart is stored as slices of the base's message by lines (difflib's matching
    blocks) and the two new lines, exactly; a short edit near one end as prefix and suffix
    slices; and both read back as the texts."""
    lines = [f"line {i:02d}: the crew notes item {i} of the plan in full.\n" for i in range(12)]
    old = "".join(lines)
    new_lines = list(lines)
    new_lines[2] = "line 02: CHANGED entirely, nothing of the old.\n"
    new_lines[9] = "line 09: CHANGED as well, far from the first.\n"
    new = "".join(new_lines)
    first = [{"role": "system", "content": SYS_A}, {"role": "user", "content": old}]
    second = [{"role": "system", "content": SYS_A}, {"role": "user", "content": new}]
    comp = ev.Compactor()
    calls = [_call(0, "a", first, "ok"), _call(1, "a", second, "ok")]
    stored = [comp.compact(i, ev.encode(c)) for i, c in enumerate(calls)]
    request = msgspec.msgpack.decode(stored[1])[3]
    assert request[:2] == [Ext(ev.REQ_EXT, msgspec.msgpack.encode(0)), [0, 1]]
    role, content = request[2]
    off = [0]
    for line in lines:
        off.append(off[-1] + len(line))
    assert role == "user" and content.code == ev.STR_EXT
    assert msgspec.msgpack.decode(content.data) == [
        [1, 0, off[2]],
        new_lines[2],
        [1, off[3], off[9]],
        new_lines[9],
        [1, off[10], off[12]],
    ]
    # an edit of a few characters near the end: the shared prefix and suffix
    third = [{"role": "system", "content": SYS_A}, {"role": "user", "content": new[:-8] + "XY.\n"}]
    stored.append(comp.compact(2, ev.encode(_call(2, "a", third, "ok"))))
    role, content = msgspec.msgpack.decode(stored[2])[3][2]
    assert msgspec.msgpack.decode(content.data) == [
        [1, 0, len(new) - 8],
        "XY",
        [1, len(new) - 2, len(new)],
    ]

    # a change at the beginning: only a suffix shared; and text added after the last line
    fourth = [
        {"role": "system", "content": SYS_A},
        {"role": "user", "content": "XY" + third[1]["content"][2:]},
    ]
    stored.append(comp.compact(3, ev.encode(_call(3, "a", fourth, "ok"))))
    role, content = msgspec.msgpack.decode(stored[3])[3][2]
    assert msgspec.msgpack.decode(content.data) == ["XY", [1, 2, len(new) - 4]]
    tail = "a closing line that no earlier message held, long enough.\n" * 3
    fifth_lines = list(lines)
    fifth_lines[5] = "line 05: CHANGED in the middle this time.\n"
    fifth = "".join(fifth_lines) + tail
    msgs = [{"role": "system", "content": SYS_A}, {"role": "user", "content": fifth}]
    comp5 = ev.Compactor()
    first5 = comp5.compact(0, ev.encode(_call(0, "a", first, "ok")))
    got5 = comp5.compact(1, ev.encode(_call(1, "a", msgs, "ok")))
    role, content = msgspec.msgpack.decode(got5)[3][2]
    assert msgspec.msgpack.decode(content.data) == [
        [1, 0, off[5]],
        fifth_lines[5],
        [1, off[6], off[12]],
        tail,
    ]
    assert first5 == stored[0]

    def load(_owner: str, seq: int) -> tuple[int, bytes]:
        return 5, stored[seq]

    resolver = ev.Resolver(lambda run, seq: run, load, lambda d: b"")
    back = [ev.decode(resolver.resolve("r", i, s)) for i, s in enumerate(stored)]
    assert [c.request[1]["content"] for c in back] == [
        old,
        new,
        new[:-8] + "XY.\n",
        "XY" + new[2:-8] + "XY.\n",
    ]  # type: ignore[attr-defined]


def _stored_call(**fields: Any) -> list[Any]:
    call = ev.LlmCall(
        step=4, agent="a", request=[{"role": "user", "content": "go"}], seed=9, model="m",
        response="ok", finish_reason="stop", **fields,
    )  # fmt: skip
    tree: list[Any] = msgspec.msgpack.decode(ev.Compactor().compact(0, ev.encode(call)))
    return tree


def test_fold_shortcut_learns_a_new_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """An LLM call whose set of fields (its mask) no reader has met yet is folded all the
    same (its layout is worked out and kept), and a mask that is not an integer is left to
    the full decoder."""
    monkeypatch.setattr(ev, "_LAYOUTS", {})
    tree = _stored_call(system_fingerprint="fp", server="s")
    want = ev.FoldLlmCall(agent="a", seed=9, step=4)
    assert ev.decode_stored_for_fold(msgspec.msgpack.encode(tree)) == want
    assert (ev.KIND_CODES["llm_call"], tree[1]) in ev._LAYOUTS
    for odd in ([1, 2], "7", None):
        tree[1] = odd
        assert ev.decode_stored_for_fold(msgspec.msgpack.encode(tree)) is None, odd


def test_field_this_engine_lacks_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stored field position this engine's event type has no field for (a table from a
    newer engine) is refused with the field named, not dropped."""
    monkeypatch.setattr(ev, "_LAYOUTS", {})
    monkeypatch.setitem(ev.STORED_FIELDS, "control", ("action", "reason", "step", "ghost"))
    with pytest.raises(
        ValueError, match=r"^a control event holds fields its type lacks: \['ghost'\]$"
    ):
        ev.from_positional([8, 0b1001, "stop", "x"])
