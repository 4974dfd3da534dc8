"""How the writer compacts and the reader rebuilds, pinned at the level of single requests:
which requests are stored whole (keyframes), what a v4 writer may and may not write, messages
that are not plain {role, content} pairs, ties between quoted texts, and reads of one event
alone by a reader that has seen nothing before it."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import msgspec
import pytest
from journal_helpers import stored_rows

from engine import events as ev
from engine.heist.session import record_heist
from engine.journal import Journal
from engine.policies.registry import make_policy

Ext = msgspec.msgpack.Ext
SYS = "You are a, the planner of a small crew; keep it short."


def _call(step: int, agent: str, request: list[dict[str, str]], response: str = "ok") -> bytes:
    return ev.encode(
        ev.LlmCall(
            step=step, agent=agent, request=request, seed=1, model="m", response=response,
            finish_reason="stop",
        )
    )  # fmt: skip


def _request(stored: bytes) -> list[Any]:
    tree = msgspec.msgpack.decode(stored)
    return list(tree[3] if type(tree) is list else tree["request"])


def _is_delta(request: list[Any]) -> bool:
    return bool(request) and type(request[0]) is Ext and request[0].code == ev.REQ_EXT


def _resolve_all(stored: list[bytes]) -> list[ev.AnyEvent]:
    def load(_owner: str, seq: int) -> tuple[int, bytes]:
        return 5, stored[seq]

    resolver = ev.Resolver(lambda run, seq: run, load, lambda d: b"")
    return [ev.decode(resolver.resolve("r", i, s)) for i, s in enumerate(stored)]


def test_every_32nd_link_of_an_agents_chain_is_stored_whole() -> None:
    """One agent's requests, each a delta of its previous one: the first and then every
    KEYFRAME_DEPTH-th are stored whole, so reading one call alone resolves at most 32
    requests; all read back."""
    comp = ev.Compactor()
    history = [{"role": "system", "content": SYS}]
    stored = []
    for i in range(70):
        history = [*history, {"role": "user", "content": f"message number {i} of a long chat"}]
        stored.append(comp.compact(i, _call(i, "a", history)))
    whole = [i for i, s in enumerate(stored) if not _is_delta(_request(s))]
    assert whole == [0, 32, 64]
    assert [e.request for e in _resolve_all(stored)][-1] == history  # type: ignore[attr-defined]


def test_a_v4_writer_uses_one_base_and_writes_deltas_without_references() -> None:
    """A v4 writer (positional=False) never names a second base (a v4 reader would not know
    it), and a delta made only of copies and short new messages is stored as such."""
    comp = ev.Compactor(positional=False)
    r_a = [{"role": "system", "content": SYS}, {"role": "user", "content": "go"}]
    r_b = [{"role": "system", "content": SYS + " b"}, {"role": "user", "content": "go"}]
    stored = [comp.compact(0, _call(0, "a", r_a)), comp.compact(1, _call(1, "b", r_b))]
    r_a2 = [*r_a, {"role": "user", "content": "hi"}]
    stored.append(comp.compact(2, _call(2, "a", r_a2)))
    request = _request(stored[2])
    assert request == [Ext(ev.REQ_EXT, msgspec.msgpack.encode(0)), [0, 2], ["user", "hi"]]
    assert type(msgspec.msgpack.decode(stored[2])) is dict


def test_messages_with_more_than_role_and_content() -> None:
    """A message with a third key (a name) is copied by a delta like any other, and one that
    is an edit of the base's message keeps its map form with the edit inside; a message whose
    keys come content first is never mistaken for the role-first one of the same text."""
    comp = ev.Compactor()
    long = "the guard leaves the vault at 03:10 sharp, says the inside man."
    first = [
        {"role": "system", "content": SYS},
        {"role": "user", "content": long, "name": "intel"},
        {"role": "user", "content": long + " Noted."},
    ]
    second = [
        {"role": "system", "content": SYS},
        {"role": "user", "content": long, "name": "intel"},
        {"role": "user", "content": long + " Noted twice.", "name": "driver"},
        {"content": long + " Noted.", "role": "user"},
    ]
    stored = [comp.compact(0, _call(0, "a", first)), comp.compact(1, _call(1, "a", second))]
    request = _request(stored[1])
    assert request[1] == [0, 2]  # system prompt and the named message copied
    assert type(request[2]) is dict and request[2]["name"] == "driver"
    assert request[2]["content"].code == ev.STR_EXT
    assert type(request[3]) is dict and list(request[3]) == ["content", "role"]
    back = _resolve_all(stored)
    assert back[1].request == second  # type: ignore[attr-defined]
    assert [list(m) for m in back[1].request] == [list(m) for m in second]  # type: ignore[attr-defined]


def _shared(a: str, b: str) -> int:
    """How many leading characters two texts share (counted one by one)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def test_short_multiline_edit_keeps_prefix_and_suffix() -> None:
    """A message under 256 characters edited in its second and fifth lines is stored as the
    shared prefix, the changed middle and the shared suffix (line matching is for long texts
    only)."""
    lines = [f"item {i}: the crew checks item {i}.\n" for i in range(6)]
    old = "".join(lines)
    new_lines = list(lines)
    new_lines[1] = "item 1: CHANGED, all of it, at once.\n"
    new_lines[4] = "item 4: CHANGED as well, much later.\n"
    new = "".join(new_lines)
    assert len(new) < 256
    comp = ev.Compactor()
    a = [{"role": "system", "content": SYS}, {"role": "user", "content": old}]
    b = [{"role": "system", "content": SYS}, {"role": "user", "content": new}]
    stored = [comp.compact(0, _call(0, "a", a)), comp.compact(1, _call(1, "a", b))]
    _role, content = _request(stored[1])[2]
    p = _shared(old, new)
    q = _shared(old[::-1], new[::-1])
    assert p >= len(lines[0]) and q >= len(lines[5]) and len(new) - p - q >= 128
    assert msgspec.msgpack.decode(content.data) == [
        [1, 0, p],
        new[p : len(new) - q],
        [1, len(old) - q, len(old)],
    ]
    assert _resolve_all(stored)[1].request[1]["content"] == new  # type: ignore[attr-defined]


def test_equal_quoted_texts_prefer_the_ending() -> None:
    """A text that both starts with one known string and ends with another of the same length
    refers to the one it ends with (and keeps the other as a literal)."""
    comp = ev.Compactor()
    x = "a first known sentence of the plan, written out."
    y = "a second known sentence, of the very same size."
    assert len(x) == len(y) + 1 or len(x) == len(y)
    y = y if len(x) == len(y) else y + "!"
    assert len(x) == len(y)
    stored = [
        comp.compact(0, ev.encode(ev.ChatMessage(step=0, agent="a", text=x))),
        comp.compact(1, ev.encode(ev.ChatMessage(step=1, agent="b", text=y))),
        comp.compact(2, ev.encode(ev.ChatMessage(step=2, agent="c", text=x + y))),
    ]
    text = msgspec.msgpack.decode(stored[2])[3]
    assert msgspec.msgpack.decode(text.data) == [x, [1, 0]]
    assert _resolve_all(stored)[2].text == x + y  # type: ignore[attr-defined]


@pytest.mark.parametrize("versions", [(4, 4), (3, 5)], ids=["v4 rows", "v3 base of v5 rows"])
def test_one_call_read_alone_by_a_fresh_reader(tmp_path: Path, versions: tuple[int, int]) -> None:
    """The last LLM call of a heist read alone, by a reader that resolved nothing before it,
    rebuilds the same bytes as a reader of the whole run: its base requests are loaded and
    resolved from rows of the older schema (v4 rows; a v5 delta whose chain reaches v3 rows)."""
    first, later = versions
    path = tmp_path / "j.db"
    ids = itertools.count()
    with Journal(path, ids=lambda: f"fresh{next(ids):07d}") as j:
        j.write_version = first
        run = record_heist(j, make_policy({"name": "sim"}), seed=7, rounds=1).run_id
        head = j.head(run)
        j.write_version = later
        run2 = j.fork(run, head - 1)  # a branch written by the later schema
        from engine.interventions import DoResample, parent_info, run_branch

        branch = run_branch(j, parent_info(j, run), DoResample(k=5), 2).run_id
        del run2
    with Journal(path, readonly=True) as j:
        whole = {s.seq: s.payload for s in j.read(branch)}
        calls = [s.seq for s in j.read(branch) if s.kind == "llm_call"]
    own = {s for s, _v, _p in stored_rows(path, branch)}
    last = calls[-1]
    assert last in own
    with Journal(path, readonly=True) as j:
        (alone,) = list(j.read(branch, last, last + 1))
    assert alone.payload == whole[last]
    assert {v for _s, v, _p in stored_rows(path, run)} == {first}
