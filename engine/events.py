"""What happened: the journal's event types, one tagged union of frozen msgspec Structs.

Schema-evolution rule (written down because journals outlive code):
  * A new field always gets a default, so older payloads decode unchanged.
  * A field's type and meaning never change; a field is never renamed or removed in place.
  * A change the first two rules cannot express bumps `SCHEMA_VERSION` and ships an upcaster
    `upcast_<kind>_v<N>_v<N+1>` that rewrites the old raw payload into the new shape. Every row
    stores the version it was written with, so old journals stay readable forever.

Version history:
  1 -> 2: `tool_result` carried one `text` field that held either the output or the error
          message; version 2 separates `output` and `error` so failures are machine-readable.
  2 -> 3: the *stored* payload may hold text references: every string of at least
          `MIN_TEXT` bytes (LLM requests' messages, responses, long tool output ...) is replaced
          by a msgpack extension `TEXT_EXT` carrying the 32-byte blake2b digest of its UTF-8
          bytes, the text itself kept once in the journal's `texts` table. The event shapes do
          not change: the journal resolves the references back into the v2-shaped bytes before
          anything decodes them, so the upcaster from 2 is the identity.
  3 -> 4: the stored payload refers to earlier events instead (docs/decisions.md, entry 37):
          a string of at least `MIN_REF` characters seen before in the run's history is a
          back-reference `STR_EXT` to the event that holds it inline, an LLM request a delta
          (`REQ_EXT`) of an earlier request, a system prompt a `TEXT_EXT` reference as in v3.
          Resolved, the bytes are the canonical v2-shaped ones: the upcaster is the identity.
  4 -> 5: the stored payload is positional (docs/decisions.md, entry 42): an array of the
          kind's code, a bit mask of the fields present and their values, in the order of
          `STORED_FIELDS` (field names are no longer stored); an LLM request's delta may copy
          from two bases, the agent's previous request and the latest one of the history.
          Resolved, the bytes are the canonical v2-shaped map: the upcaster is the identity.
  5 -> 6: the stored payload is packed (docs/decisions.md, entry 43; engine/packing.py): the v5
          stored bytes deflated against those of the run's own earlier events in the same
          block of 64 seqs, and long texts deflated too. Unpacked, a row is a v5 row: the
          upcaster is the identity.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable
from typing import Any, Union, get_args

import msgspec

SCHEMA_VERSION = 6
# from this version on the event shapes are those of today's Structs (3 and 4 changed storage)
SAME_SHAPE_SINCE = 2
TEXT_EXT = 1
MIN_TEXT = 64
TEXT_PREFIX = "b2:"


class Event(msgspec.Struct, frozen=True, tag_field="kind", kw_only=True, omit_defaults=True):
    """Base of every event. `step` is the agent turn the event belongs to (None = run level)."""

    step: int | None = None


class RunStarted(Event, frozen=True, tag="run_started"):
    scenario: str
    config: dict[str, Any]
    agents: list[str]
    policy: dict[str, Any]
    root_seed: int
    engine_version: str
    started_at: str
    rounds: int = 0
    context_window: int = 0


class MoleAssigned(Event, frozen=True, tag="mole_assigned"):
    """Secret: the mole and its strategy. Detectors never read this kind. A game without a
    mole journals one all the same, with `agent` "" (`NO_MOLE`): whether a game has a mole is
    part of the secret, and the event's presence (and every later seq) then tells nothing."""

    agent: str
    strategy: str
    instructions: str

    @property
    def none(self) -> bool:
        """Whether this is the secret of a game without a mole."""
        return self.agent == ""


#: The secret event of a game without a mole.
NO_MOLE = MoleAssigned(agent="", strategy="", instructions="")


class LlmCall(Event, frozen=True, tag="llm_call"):
    agent: str
    request: list[dict[str, str]]
    seed: int
    model: str
    response: str
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    system_fingerprint: str | None = None
    latency_ms: float = 0.0
    server: str | None = None
    #: the oldest history messages the answered request left out (decision 54): `request` is
    #: what was sent, the rendered messages without them
    dropped: int = 0


class ToolCall(Event, frozen=True, tag="tool_call"):
    agent: str
    tool: str
    param: str


class ToolResult(Event, frozen=True, tag="tool_result"):
    agent: str
    tool: str
    param: str
    ok: bool
    output: str = ""
    error: str | None = None


class ChatMessage(Event, frozen=True, tag="chat_message"):
    agent: str
    text: str


class Intervention(Event, frozen=True, tag="intervention"):
    """Opens a forked run: which do() was applied at which step of the parent."""

    op: str
    at: int
    value: Any = None
    branch_seed: int = 0


class Control(Event, frozen=True, tag="control"):
    """pause / resume / stop, as requested by a user or the dashboard."""

    action: str
    reason: str = ""


class SuspicionDeclared(Event, frozen=True, tag="suspicion_declared"):
    suspect: str | None
    verdict: str
    mole: str
    strategy: str


class RunEnded(Event, frozen=True, tag="run_ended"):
    status: str  # "completed" | "stopped" | "failed"
    outcome: dict[str, Any] = msgspec.field(default_factory=dict)
    error: str | None = None


AnyEvent = (
    RunStarted
    | MoleAssigned
    | LlmCall
    | ToolCall
    | ToolResult
    | ChatMessage
    | Intervention
    | Control
    | SuspicionDeclared
    | RunEnded
)

SECRET_KINDS = frozenset({"mole_assigned"})

# Each kind's code: the `kinds` table's rows (migrations/versions/0005_integer_rows.py writes
# the same) and the first item of a stored v5 payload. A new kind gets a new code in a new
# revision, never a reused one.
KIND_CODES: dict[str, int] = {
    "run_started": 1,
    "mole_assigned": 2,
    "llm_call": 3,
    "tool_call": 4,
    "tool_result": 5,
    "chat_message": 6,
    "intervention": 7,
    "control": 8,
    "suspicion_declared": 9,
    "run_ended": 10,
}
KIND_NAMES: dict[int, str] = {code: name for name, code in KIND_CODES.items()}

# The position of each field in a stored v5 payload (bit i of its mask, its i-th value):
# written down once, because stored rows outlive the Structs. A new field is appended at the
# end of its kind's tuple, wherever the Struct declares it; a position is never reused.
STORED_FIELDS: dict[str, tuple[str, ...]] = {
    "run_started": (
        "scenario",
        "config",
        "agents",
        "policy",
        "root_seed",
        "engine_version",
        "started_at",
        "rounds",
        "context_window",
        "step",
    ),
    "mole_assigned": ("agent", "strategy", "instructions", "step"),
    "llm_call": (
        "agent",
        "request",
        "seed",
        "model",
        "response",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "system_fingerprint",
        "latency_ms",
        "server",
        "step",
        "dropped",
    ),
    "tool_call": ("agent", "tool", "param", "step"),
    "tool_result": ("agent", "tool", "param", "ok", "output", "error", "step"),
    "chat_message": ("agent", "text", "step"),
    "intervention": ("op", "at", "value", "branch_seed", "step"),
    "control": ("action", "reason", "step"),
    "suspicion_declared": ("suspect", "verdict", "mole", "strategy", "step"),
    "run_ended": ("status", "outcome", "error", "step"),
}
_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[AnyEvent] = msgspec.msgpack.Decoder(AnyEvent)  # type: ignore[arg-type]
_raw_decoder = msgspec.msgpack.Decoder()


def encode(event: Event) -> bytes:
    """Canonical bytes of an event: msgpack, fields in declaration order, defaults omitted."""
    return _encoder.encode(event)


_SURROGATE = re.compile("[\ud800-\udfff]")


def not_journalable_text(text: str) -> str | None:
    """Why no event could hold `text`, or None: a lone surrogate (what a `\\ud800` escape in
    JSON or YAML decodes to) has no UTF-8 form. For refusing input before anything is written."""
    bad = _SURROGATE.search(text)
    if bad is None:
        return None
    return f"not valid Unicode text (a lone surrogate {bad.group()!r} at character {bad.start()})"


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def encode_checked(event: Event) -> bytes:
    """`encode`, refusing an event that would not read back: its bytes must decode to an event
    whose encoding is the same bytes (a field of the wrong type, an int msgpack cannot hold, a
    value no decoder accepts). What the journal stores is therefore always decodable."""
    from engine.errors import JournalError

    kind = kind_of(event)
    try:
        payload = _encoder.encode(event)
    except (OverflowError, TypeError, ValueError) as e:
        raise JournalError(f"refusing to journal {_article(kind)} {kind} event: {e}") from e
    try:
        back = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise JournalError(
            f"refusing to journal {_article(kind)} {kind} event that would not decode: {e}"
        ) from e
    if _encoder.encode(back) != payload:
        raise JournalError(
            f"refusing to journal {_article(kind)} {kind} event that does not read back as stored"
        )
    return payload


def kind_of(event: Event) -> str:
    return type(event).__struct_config__.tag  # type: ignore[return-value]


Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


def upcast_tool_result_v1_v2(raw: dict[str, Any]) -> dict[str, Any]:
    """v1 kept output or error in one `text` field; v2 splits them."""
    out = dict(raw)
    text = out.pop("text", "")
    if out.get("ok", False):
        out["output"] = text
    else:
        out["error"] = text
    return out


# (kind, from_version) -> upcaster to from_version + 1
UPCASTERS: dict[tuple[str, int], Upcaster] = {
    ("tool_result", 1): upcast_tool_result_v1_v2,
}


class FoldLlmCall(Event, frozen=True, tag="llm_call"):
    """An LLM call as the state fold reads it: the request and response (most of the bytes of
    a step) are skipped while decoding, which makes rebuilding s_k several times faster."""

    agent: str
    seed: int


# the same union as AnyEvent, with LLM calls decoded slim
_fold_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    Union[tuple(FoldLlmCall if t is LlmCall else t for t in get_args(AnyEvent))]  # type: ignore[valid-type]  # noqa: UP007
)


class _HasReference(Exception):
    pass


def _refuse_ext(code: int, data: memoryview) -> Any:
    raise _HasReference


# the fold's decoder for *stored* v4 payloads: fields the fold skips (an LLM call's request
# and response) may hold references; any other field that holds one is refused
_fold_stored_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    _fold_decoder.type, ext_hook=_refuse_ext
)


_refusing_decoder = msgspec.msgpack.Decoder(ext_hook=_refuse_ext)
# a stored v5 payload's items left undecoded: the fold takes three fields of an LLM call
_items_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])


def _fold_llm_call(stored: bytes) -> Event | None:
    """FoldLlmCall of a stored v5 LLM call: its agent, seed and step decoded, the request and
    response (which hold references) never looked at."""
    items = _items_decoder.decode(stored)
    if len(items) < 2:
        return None
    code, mask = KIND_CODES["llm_call"], _refusing_decoder.decode(items[1])
    layout = _LAYOUTS.get((code, mask)) if type(mask) is int else None
    if layout is None:
        layout = _layout(code, mask)  # ValueError for a malformed mask
    _kind, names, _order = layout
    if len(items) - 2 != len(names):
        return None
    got = {}
    for name in ("agent", "seed", "step"):
        if name in names:
            got[name] = _refusing_decoder.decode(items[2 + names.index(name)])
    agent, seed, step = got.get("agent"), got.get("seed"), got.get("step")
    if type(agent) is not str or type(seed) is not int or not (step is None or type(step) is int):
        return None
    return FoldLlmCall(agent=agent, seed=seed, step=step)


def decode_stored_for_fold(stored: bytes) -> Event | None:
    """The fold's view of a stored v4 or v5 payload without resolving it, None when a field
    the fold reads holds a reference (then the payload must be resolved first)."""
    if stored[:1] and (0x90 <= stored[0] <= 0x9F or stored[0] in (0xDC, 0xDD)):
        return _fold_positional(stored)
    try:
        return _fold_stored_decoder.decode(stored)  # type: ignore[no-any-return]
    except (_HasReference, msgspec.DecodeError):
        return None


def _fold_positional(stored: bytes) -> Event | None:
    try:
        if len(stored) > 1 and stored[1] == KIND_CODES["llm_call"]:
            return _fold_llm_call(stored)
        # any reference in another kind is in a field the fold reads: give up at the first
        tree = from_positional(_refusing_decoder.decode(stored))
        # the map's bytes through the typed decoder: the fold's types, checked
        return _fold_decoder.decode(_encoder.encode(tree))  # type: ignore[no-any-return]
    except (_HasReference, ValueError, msgspec.DecodeError):
        return None


def decode_for_fold(payload: bytes, version: int = SCHEMA_VERSION) -> Event:
    """Decode a stored payload for the state fold (LLM calls without request and response)."""
    if SAME_SHAPE_SINCE <= version <= SCHEMA_VERSION:
        return _fold_decoder.decode(payload)  # type: ignore[no-any-return]
    return decode(payload, version)


def decode(payload: bytes, version: int = SCHEMA_VERSION) -> AnyEvent:
    """Decode a (resolved) payload, upcasting it first when it was written by an older schema."""
    if SAME_SHAPE_SINCE <= version <= SCHEMA_VERSION:
        return _decoder.decode(payload)
    if version > SCHEMA_VERSION:
        from engine.errors import SchemaTooNew

        raise SchemaTooNew(
            f"event written by schema version {version}, this engine reads up to {SCHEMA_VERSION}"
        )
    raw = _raw_decoder.decode(payload)
    kind = raw.get("kind")
    for v in range(version, SCHEMA_VERSION):
        up = UPCASTERS.get((kind, v))
        if up is not None:
            raw = up(raw)
    return msgspec.convert(raw, AnyEvent)  # type: ignore[arg-type]


# ------------------------------------------------------------------ text references


def text_digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=32).digest()


def text_key(digest: bytes) -> str:
    """The `texts` table's key of a digest: algorithm prefix and hex, like the chain's hashes."""
    return TEXT_PREFIX + digest.hex()


def externalize(
    payload: bytes, digests: dict[str, bytes] | None = None
) -> tuple[bytes, dict[bytes, str]]:
    """The stored form of an encoded event and the texts it refers to: every string of at
    least MIN_TEXT UTF-8 bytes becomes a reference (digest -> the text). Unchanged bytes when
    the event holds no such string.

    `digests` is the caller's memo of text -> digest: the same texts recur in every request
    of a run, and looking a string up costs far less than encoding and hashing it again."""
    texts: dict[bytes, str] = {}
    if len(payload) < MIN_TEXT:
        return payload, texts  # too short to hold a long text
    memo = digests if digests is not None else {}
    ext = msgspec.msgpack.Ext
    short = MIN_TEXT // 4

    def walk(v: Any) -> Any:
        t = type(v)
        if t is str:
            # a str of fewer than MIN_TEXT/4 characters cannot reach MIN_TEXT UTF-8 bytes
            if len(v) < short:
                return v
            d = memo.get(v)
            if d is None:
                body = v.encode()
                if len(body) < MIN_TEXT:
                    return v
                d = memo[v] = text_digest(body)
            texts[d] = v
            return ext(TEXT_EXT, d)
        # short strings (roles, names, kinds) are most of the values: kept without a call
        if t is list:
            return [x if type(x) is str and len(x) < short else walk(x) for x in v]
        if t is dict:
            return {k: x if type(x) is str and len(x) < short else walk(x) for k, x in v.items()}
        return v

    raw = _raw_decoder.decode(payload)
    out = {k: (x if k == "kind" else walk(x)) for k, x in raw.items()}
    if not texts:
        return payload, texts
    return _encoder.encode(out), texts


def refs_of(stored: bytes) -> list[bytes]:
    """The digests a stored payload refers to, in order."""
    found: list[bytes] = []

    def hook(code: int, data: memoryview) -> Any:
        found.append(bytes(data))
        return None

    msgspec.msgpack.Decoder(ext_hook=hook).decode(stored)
    return found


def resolve(stored: bytes, text: Callable[[bytes], bytes]) -> bytes:
    """The full (v2-shaped) bytes of a stored payload: each reference replaced by its text,
    fetched with `text(digest)`. These are the bytes the hash chain covers."""

    def hook(code: int, data: memoryview) -> Any:
        if code != TEXT_EXT:
            raise ValueError(f"unknown msgpack extension {code}")
        return text(bytes(data)).decode()

    return _encoder.encode(msgspec.msgpack.Decoder(ext_hook=hook).decode(stored))


# ------------------------------------------------------------------ schema v4: back-references

# A string of at least MIN_REF characters is addressable: left inline the first time it occurs
# in a run's history, and every later occurrence refers back to it. Shorter ones stay inline.
MIN_REF = 24
STR_EXT = 2  # a string made of parts: literals, back-references, slices of the base request
REQ_EXT = 3  # first item of a request stored as a delta: the seq of its base request
# a request delta chains on its base; every KEYFRAME_DEPTH-th link is stored whole, so that
# reading one call alone resolves at most that many earlier requests
KEYFRAME_DEPTH = 32
SMALL_REQUEST = 96  # encoded bytes up to which a request is never a delta
MORE_CANDIDATES = 8  # v5: inline strings remembered per first or last MIN_REF characters
# a system prompt this long goes to `texts`, once per journal rather than once per run tree:
# every run of the same crew, and every branch forked before an agent's first call, shares it
SHARED_TEXT = 256


class _Ref:
    """A msgpack extension seen while decoding a stored v4 payload, not yet resolved."""

    __slots__ = ("code", "data")

    def __init__(self, code: int, data: bytes) -> None:
        self.code = code
        self.data = data


def _mark(code: int, data: memoryview) -> Any:
    return _Ref(code, bytes(data))


_marked_decoder = msgspec.msgpack.Decoder(ext_hook=_mark)


def _inline_strings(tree: Any, out: list[str]) -> None:
    """The addressable strings left inline in a decoded stored payload, in encoding order (dict
    keys and the event's kind excluded). Back-references `[seq, i]` index this list."""
    t = type(tree)
    if t is str:
        if len(tree) >= MIN_REF:
            out.append(tree)

    elif t is list:
        for x in tree:
            _inline_strings(x, out)
    elif t is dict:
        for x in tree.values():
            _inline_strings(x, out)


def _event_strings(tree: Any) -> list[str]:
    """`_inline_strings` of a decoded stored event, in stored order: its own kind never counts
    (the writer leaves it as it is), nor the code and mask of a positional (v5) one."""
    out: list[str] = []
    if type(tree) is dict:
        for k, x in tree.items():
            if k != "kind":
                _inline_strings(x, out)
    elif type(tree) is list:
        for x in tree[2:]:
            _inline_strings(x, out)
    return out


# field name -> its stored position, per kind; and each kind's fields in the order its Struct
# encodes them (the order of the canonical bytes a positional payload is rebuilt into)
_POSITION: dict[str, dict[str, int]] = {
    kind: {name: i for i, name in enumerate(names)} for kind, names in STORED_FIELDS.items()
}
_ENCODE_ORDER: dict[str, tuple[str, ...]] = {
    t.__struct_config__.tag: t.__struct_fields__  # type: ignore[misc]
    for t in get_args(AnyEvent)
}


def from_positional(tree: Any) -> dict[str, Any]:
    """The map of a decoded stored v5 payload `[code, mask, values...]`, keyed and ordered as
    the event's canonical encoding (its values still in stored form). ValueError when it is
    not one."""
    if type(tree) is not list or len(tree) < 2:
        raise ValueError("a stored v5 event is not [code, mask, values...]")
    code, mask = tree[0], tree[1]
    layout = _LAYOUTS.get((code, mask)) if type(code) is int and type(mask) is int else None
    if layout is None:
        layout = _layout(code, mask)
    kind, names, order = layout
    if len(tree) - 2 != len(names):
        raise ValueError(
            f"a {kind} event holds {len(tree) - 2} values where its mask names {len(names)}"
        )
    out: dict[str, Any] = {"kind": kind}
    if order is None:
        out.update(zip(names, tree[2:], strict=True))
    else:
        for i in order:
            out[names[i]] = tree[2 + i]
    return out


# (code, mask) -> the kind, the names of the fields present in stored order, and the order
# to emit them in (None: the stored order is the Struct's). At most 2**fields masks a kind.
_LAYOUTS: dict[tuple[int, int], tuple[str, tuple[str, ...], tuple[int, ...] | None]] = {}


def _layout(code: Any, mask: Any) -> tuple[str, tuple[str, ...], tuple[int, ...] | None]:
    kind = KIND_NAMES.get(code) if type(code) is int else None
    if kind is None:
        raise ValueError(f"unknown event kind code {code!r}")
    stored = STORED_FIELDS[kind]
    if type(mask) is not int or mask < 0 or mask >> len(stored):
        raise ValueError(f"malformed field mask {mask!r} of a {kind} event")
    names = tuple(name for i, name in enumerate(stored) if mask >> i & 1)
    encode_order = [n for n in _ENCODE_ORDER[kind] if n in names]
    if len(encode_order) != len(names):
        lacking = sorted(set(names) - set(encode_order))
        raise ValueError(f"a {kind} event holds fields its type lacks: {lacking}")
    order = None if tuple(encode_order) == names else tuple(names.index(n) for n in encode_order)
    layout = (kind, names, order)
    _LAYOUTS[(code, mask)] = layout
    return layout


class Compactor:
    """The writer's memory of one run's history, which makes its v4 payloads small: where each
    addressable string is inline (seq, index), the latest inline strings, and each agent's latest
    LLM request (what the next request is a delta of).

    Memory is only what this writer put down or loaded; whatever it does not know is written
    inline, so a cold compactor costs bytes, never correctness."""

    def __init__(self, positional: bool = True) -> None:
        # v5 (positional payloads, two-base request deltas) or v4 (maps, one base)
        self.positional = positional
        self.strings: dict[str, tuple[int, int]] = {}
        # first and last MIN_REF characters of inline strings -> the longest such string: how
        # a message that quotes a text ("agent: text", "TOOL RESULT x(p): output") is found
        self.heads: dict[str, str] = {}
        self.tails: dict[str, str] = {}
        # v5: every recent inline string per first and last MIN_REF characters, not only the
        # longest: templated texts share beginnings and endings ("... [PLAN:key=value].")
        self.more_heads: dict[str, list[str]] = {}
        self.more_tails: dict[str, list[str]] = {}
        # v5, a branch's writer: strings inline in the parent's own events past the fork point
        # (not in the branch's history) -> (seq, index) there; a branch re-running its parent
        # writes mostly strings the parent holds
        self.far: dict[str, tuple[int, int]] = {}
        # agent -> (seq, request, depth of its delta chain)
        self.requests: dict[str, tuple[int, list[Any], int]] = {}
        self.last_request: tuple[int, list[Any], int] | None = None
        # texts of LONG_TEXT characters or more: digest -> UTF-8 bytes, to be stored in `texts`
        # by this append (shared by every run of the journal, like a system prompt)
        self.texts: dict[bytes, bytes] = {}
        self._digests: dict[str, bytes] = {}
        # id of a request -> its message keys and where each key first occurs
        self._keys: dict[int, tuple[list[Any], dict[Any, int]]] = {}

    def clone(self) -> Compactor:
        """A copy that goes on learning on its own: what seeding learnt at a fork point,
        shared by the writers of every branch forked there. The requests themselves are
        shared (never changed in place)."""
        c = Compactor(self.positional)
        c.strings = dict(self.strings)
        c.heads = dict(self.heads)
        c.tails = dict(self.tails)
        c.more_heads = {k: list(v) for k, v in self.more_heads.items()}
        c.more_tails = {k: list(v) for k, v in self.more_tails.items()}
        c.far = dict(self.far)
        c.requests = dict(self.requests)
        c.last_request = self.last_request
        c.texts = dict(self.texts)
        c._digests = dict(self._digests)
        c._keys = dict(self._keys)
        return c

    def note_request(
        self, agent: str, seq: int, request: list[Any], depth: int, keys: list[Any] | None = None
    ) -> None:
        old = self.requests.get(agent)
        self.requests[agent] = (seq, request, depth)
        if old is not None and old[1] is not request:
            self._keys.pop(id(old[1]), None)
        if keys is None:
            keys = [_msg_key(m) for m in request]
        where: dict[Any, int] = {}
        for i, k in enumerate(keys):
            where.setdefault(k, i)
        self._keys[id(request)] = (keys, where)
        if self.last_request is None or seq > self.last_request[0]:
            self.last_request = (seq, request, depth)

    def learn(self, seq: int, stored: bytes) -> None:
        """Remember the inline strings of an earlier v4 event of the history (as stored), so
        that a new writer (a branch) refers to them instead of writing them again."""
        found = _event_strings(_marked_decoder.decode(stored))
        for i, t in enumerate(found):
            if t not in self.strings:
                self.strings[t] = (seq, i)
                self._index(t)

    def learn_far(self, seq: int, stored: bytes) -> None:
        """Remember the inline strings of event `seq` of the parent run, past the branch's fork
        point (v5 only: a v4 reader knows no such reference)."""
        if not self.positional:
            return
        found = _event_strings(_marked_decoder.decode(stored))
        for i, t in enumerate(found):
            if t not in self.far and t not in self.strings:
                self.far[t] = (seq, i)
                self._index(t)

    def _part(self, t: str) -> list[Any]:
        """The string part that names known string `t`: `[seq, i]` in the history, else
        `[seq, i, None]` in the parent past the fork point."""
        loc = self.strings.get(t)
        if loc is not None:
            return list(loc)
        far = self.far[t]
        return [far[0], far[1], None]

    def _index(self, t: str) -> None:
        h, e = t[:MIN_REF], t[-MIN_REF:]
        if len(self.heads.get(h, "")) < len(t):
            self.heads[h] = t
        if len(self.tails.get(e, "")) < len(t):
            self.tails[e] = t
        if self.positional:
            for key, table in ((h, self.more_heads), (e, self.more_tails)):
                got = table.setdefault(key, [])
                got.append(t)
                if len(got) > MORE_CANDIDATES:
                    del got[0]

    def _quoted(self, s: str) -> str | None:
        """The longest known inline string that `s` starts or ends with (shorter than `s`)."""
        best: str | None = None
        if self.positional:
            for t in self.more_tails.get(s[-MIN_REF:], ()):
                if len(t) < len(s) and s.endswith(t) and (best is None or len(t) > len(best)):
                    best = t
            for t in self.more_heads.get(s[:MIN_REF], ()):
                if len(t) < len(s) and s.startswith(t) and (best is None or len(t) > len(best)):
                    best = t
            return best
        tail = self.tails.get(s[-MIN_REF:])
        if tail is not None and len(tail) < len(s) and s.endswith(tail):
            best = tail
        head = self.heads.get(s[:MIN_REF])
        if head is not None and len(head) < len(s) and s.startswith(head):
            best = head if best is None or len(head) > len(best) else best
        return best

    def compact(self, seq: int, payload: bytes) -> bytes:
        """The stored form (v5, or v4 when not `positional`) of the canonical bytes of event
        `seq`."""
        if len(payload) < MIN_REF and not self.positional:
            return payload
        raw = _raw_decoder.decode(payload)
        if len(self.strings) > 20_000:  # bounded memory; forgetting costs bytes only
            self.strings.clear()
            self.heads.clear()
            self.tails.clear()
            self.more_heads.clear()
            self.more_tails.clear()
            self.far.clear()
        self._idx = 0
        self._seq = seq
        self._new: list[str] = []
        self._changed = False  # a reference written: else the stored bytes are the payload
        kind = raw.get("kind")
        agent = str(raw.get("agent", ""))
        if self.positional:
            pos = _POSITION.get(kind)  # type: ignore[arg-type]
            if pos is None:
                raise ValueError(f"event kind {kind!r} has no stored field positions")
            try:
                # walked in stored order: back-references count inline strings in that order
                items = sorted((pos[k], k, v) for k, v in raw.items() if k != "kind")
            except KeyError as e:
                raise ValueError(f"field {e.args[0]!r} of {kind} has no stored position") from e
            mask = 0
            values: list[Any] = [KIND_CODES[kind], 0]  # type: ignore[index]
            for i, k, v in items:
                mask |= 1 << i
                if k == "request" and kind == "llm_call" and type(v) is list:
                    values.append(self._request(agent, v))
                else:
                    values.append(self._walk(v))
            values[1] = mask
            for t in self._new:
                self._index(t)
            return _encoder.encode(values)
        out: dict[str, Any] = {}
        for k, v in raw.items():
            if k == "kind":
                out[k] = v
            elif k == "request" and kind == "llm_call" and type(v) is list:
                out[k] = self._request(agent, v)
            else:
                out[k] = self._walk(v)
        for t in self._new:
            self._index(t)
        return _encoder.encode(out) if self._changed else payload

    def _walk(self, v: Any) -> Any:
        t = type(v)
        if t is str:
            return self._str(v) if len(v) >= MIN_REF else v
        if t is list:
            return [self._walk(x) for x in v]
        if t is dict:
            return {k: self._walk(x) for k, x in v.items()}
        return v

    def _inline(self, s: str) -> str:
        if s not in self.strings:
            self.strings[s] = (self._seq, self._idx)
            self._new.append(s)
        self._idx += 1
        return s

    def _str(
        self, s: str, base: list[Any] | None = None, at: tuple[int, ...] = (), shared: bool = False
    ) -> Any:
        """A string in its stored form: a back-reference, a splice of a known text into
        literals, a slice of the base request's message `at`, a `texts` reference (a system
        prompt: `shared`), or inline."""
        if shared and len(s) >= SHARED_TEXT:
            d = self._digests.get(s)
            if d is None:
                body = s.encode()
                d = text_digest(body)
                if len(self._digests) > 2_000:
                    self._digests.clear()
                self._digests[s] = d
                self.texts[d] = body
            self._changed = True
            return msgspec.msgpack.Ext(TEXT_EXT, d)
        if s in self.strings or s in self.far:
            self._changed = True
            return msgspec.msgpack.Ext(STR_EXT, _encoder.encode([self._part(s)]))
        best = self._quoted(s)
        if best is not None:
            i = 0 if s.startswith(best) else len(s) - len(best)
            parts: list[Any] = []
            if i:
                parts.append(s[:i])
            parts.append(self._part(best))
            if i + len(best) < len(s):
                parts.append(s[i + len(best) :])
            self._changed = True
            return msgspec.msgpack.Ext(STR_EXT, _encoder.encode(parts))
        if base is not None:
            for j in at:
                m = base[j] if 0 <= j < len(base) else None
                old = m.get("content") if type(m) is dict else None
                if type(old) is str:
                    sliced = _splice(old, s, j)
                    if sliced is not None:
                        self._changed = True
                        return msgspec.msgpack.Ext(STR_EXT, _encoder.encode(sliced))
        return self._inline(s)

    def _message(self, m: Any, base: list[Any] | None, at: tuple[int, ...]) -> Any:
        if type(m) is not dict:
            return self._walk(m)
        shared = m.get("role") == "system"
        if (
            base is not None
            and len(m) == 2
            and tuple(m) == ("role", "content")
            and len(m["role"]) < MIN_REF  # a role is never addressable, as in the dict form
        ):
            # inside a delta a plain message is the pair [role, content]
            c = m["content"]
            return [m["role"], self._str(c, base, at, shared) if len(c) >= MIN_REF else c]
        out = {}
        for k, x in m.items():
            if k == "content" and type(x) is str and len(x) >= MIN_REF:
                out[k] = self._str(x, base, at, shared)
            else:
                out[k] = self._walk(x)
        return out

    def _request(self, agent: str, req: list[Any]) -> list[Any]:
        own = self.requests.get(agent)
        prior = own or self.last_request
        keys = [_msg_key(m) for m in req]
        # a request of a few short messages is stored as it is: a delta would save nothing
        if prior is None or prior[2] + 1 >= KEYFRAME_DEPTH or None in keys or _small(req):
            self.note_request(agent, self._seq, req, 0, keys)
            return [self._message(m, None, ()) for m in req]
        # v5: the latest request of the history is a second base. Other agents see the same
        # recent chat, so it holds this window but for the newest message, where the agent's
        # own previous request holds its system prompt and is a whole turn older. Only one no
        # deeper than the first: the depth of a delta (how many requests reading it alone
        # resolves in a row) then grows by one per call of the agent, as with one base, where
        # following the latest request each time would grow it by one per call of the run.
        second = self.last_request if self.positional and own is not None else None
        if second is not None and (second[0] == prior[0] or second[2] > prior[2]):
            second = None
        bases = [prior] if second is None else [prior, second]
        indexed = [self._indexed(b[1]) for b in bases]
        base = prior[1]
        self._changed = True
        ops: list[Any] = [None]
        used = [True, False]
        run: list[int] | None = None  # the copy op being extended: [a, b] or [a, b, 1]
        for i, (m, key) in enumerate(zip(req, keys, strict=True)):
            if run is not None:
                src = indexed[run[2] if len(run) == 3 else 0][0]
                if run[1] < len(src) and src[run[1]] == key:
                    run[1] += 1
                    continue
            best: list[int] | None = None
            j = indexed[0][1].get(key)
            if j is not None:
                best = [j, j + 1]
            if len(indexed) > 1:
                j1 = indexed[1][1].get(key)
                # in both bases: the one whose copy runs longer from here (the first on a tie)
                if j1 is not None and (
                    j is None or _run(keys, i, indexed[1][0], j1) > _run(keys, i, indexed[0][0], j)
                ):
                    best = [j1, j1 + 1, 1]
            if best is not None:
                run = best
                used[len(best) == 3] = True
                ops.append(run)
                continue
            run = None
            # what it may be an edit of: the base's message at the same position, counted from
            # the end (the closing instruction of a turn) or from the start (a system prompt)
            ops.append(self._message(m, base, (len(base) - (len(req) - i), i)))
        if used[1]:
            head: Any = [prior[0], bases[1][0]]
            depth = max(prior[2], bases[1][2])
        else:
            head, depth = prior[0], prior[2]
        ops[0] = msgspec.msgpack.Ext(REQ_EXT, _encoder.encode(head))
        self.note_request(agent, self._seq, req, depth + 1, keys)
        return ops

    def _indexed(self, base: list[Any]) -> tuple[list[Any], dict[Any, int]]:
        """A base request's message keys and where each first occurs (cached per request)."""
        cached = self._keys.get(id(base))
        if cached is not None:
            return cached
        bkeys = [_msg_key(m) for m in base]
        where: dict[Any, int] = {}
        for i, k in enumerate(bkeys):
            where.setdefault(k, i)
        return bkeys, where


def _splice(old: str, s: str, j: int) -> list[Any] | None:
    """`s` as slices of `old` (message j of the base request) and literals, when at least
    MIN_REF characters are shared: by common prefix and suffix, and for long texts by lines."""
    p = _common_prefix(old, s)
    q = _common_prefix(old[p:][::-1], s[p:][::-1])
    parts: list[Any] = []
    if len(s) >= 256 and len(s) - p - q >= 128:
        import difflib

        a = old.splitlines(keepends=True)
        b = s.splitlines(keepends=True)
        ao = [0]
        for line in a:
            ao.append(ao[-1] + len(line))
        bo = [0]
        for line in b:
            bo.append(bo[-1] + len(line))
        shared = 0
        pos = 0
        for blk in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
            if blk.size == 0:
                continue
            if bo[blk.b] > pos:
                parts.append(s[pos : bo[blk.b]])
            parts.append([j, ao[blk.a], ao[blk.a + blk.size]])
            shared += ao[blk.a + blk.size] - ao[blk.a]
            pos = bo[blk.b + blk.size]
        if pos < len(s):
            parts.append(s[pos:])
        return parts if shared >= MIN_REF and shared > p + q else _prefix_suffix(old, s, j, p, q)
    return _prefix_suffix(old, s, j, p, q)


def _prefix_suffix(old: str, s: str, j: int, p: int, q: int) -> list[Any] | None:
    if p + q < MIN_REF:
        return None
    parts: list[Any] = [[j, 0, p]] if p else []
    if len(s) - q > p:
        parts.append(s[p : len(s) - q])
    if q:
        parts.append([j, len(old) - q, len(old)])
    return parts


def _small(req: list[Any]) -> bool:
    """Whether a request (of messages that are maps of strings) encodes in SMALL_REQUEST
    bytes at most; a long one is told by its characters, without encoding it."""
    chars = 0
    for m in req:
        for k, v in m.items():
            chars += len(k) + len(v)
        if chars > SMALL_REQUEST:
            return False  # each character is a byte at least
    return len(_encoder.encode(req)) <= SMALL_REQUEST


def _run(keys: list[Any], i: int, bkeys: list[Any], j: int) -> int:
    """How many messages from keys[i] on equal those of a base from bkeys[j] on."""
    n = 1
    while i + n < len(keys) and j + n < len(bkeys) and bkeys[j + n] == keys[i + n]:
        n += 1
    return n


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if n > 32 and a[:32] == b[:32]:
        # long shared beginnings (a system prompt, a tool's output): bisect with slices
        if a[:n] == b[:n]:
            return n
        lo, hi = 32, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid
        return lo
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _msg_key(m: Any) -> Any:
    """A hashable key of a chat message (None for one that holds more than strings)."""
    if type(m) is not dict:
        return None
    if len(m) == 2:
        r, c = m.get("role"), m.get("content")
        if type(r) is str and type(c) is str:
            return (r, c) if next(iter(m)) == "role" else ("", r, c)
    if not all(type(v) is str for v in m.values()):
        return None
    return tuple(m.items())


class Resolver:
    """Rebuilds the canonical (v2-shaped) bytes of stored v4 payloads.

    `owner_of(run, seq)` names the run that holds event `seq` of run `run`'s history;
    `load(owner, seq)` returns that row's (version, stored payload); `text(digest)` a v3 text.
    Resolved strings and requests are cached per (owner, seq): reading a run in order resolves
    each reference from the cache."""

    def __init__(
        self,
        owner_of: Callable[[str, int], str],
        load: Callable[[str, int], tuple[int, bytes]],
        text: Callable[[bytes], bytes],
        parent_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self.owner_of = owner_of
        self.load = load
        self.text = text
        # the run a run forked from (v5's references past a branch's fork point)
        self.parent_of = parent_of
        self.inline: dict[tuple[str, int], list[str]] = {}
        self.requests: dict[tuple[str, int], tuple[list[Any], int]] = {}
        self._at = -1  # seq of the event being resolved: references only point back
        # one journal serves several threads (threaded executors, the server): `_at` is the
        # state of one resolution in progress, so resolutions take turns (re-entrant: resolving
        # a base request resolves its own base first)
        self._lock = threading.RLock()

    def clear_if_large(self) -> None:
        if len(self.inline) > 20_000:
            self.inline.clear()
        if len(self.requests) > 4_000:
            self.requests.clear()

    def resolve(self, owner: str, seq: int, stored: bytes) -> bytes:
        """The full bytes of a v4 stored payload (those the hash chain covers)."""
        with self._lock:
            return self._resolve(owner, seq, stored)

    def _resolve(self, owner: str, seq: int, stored: bytes) -> bytes:
        tree = _marked_decoder.decode(stored)
        found = _event_strings(tree)
        if type(tree) is list:
            tree = from_positional(tree)
        elif type(tree) is not dict:
            raise ValueError("a stored event is neither a map nor positional")
        self.clear_if_large()
        self.inline[(owner, seq)] = found
        prev, self._at = self._at, seq
        try:
            out = {}
            for k, v in tree.items():
                if k == "request" and type(v) is list:
                    req, depth = self._request(owner, v)
                    self.requests[(owner, seq)] = (req, depth)
                    out[k] = req
                else:
                    out[k] = self._value(owner, v, None)
        finally:
            self._at = prev
        return _encoder.encode(out)

    def _value(self, owner: str, v: Any, base: list[Any] | None) -> Any:
        t = type(v)
        if t is _Ref:
            return self._ref(owner, v, base)
        if t is list:
            return [self._value(owner, x, base) for x in v]
        if t is dict:
            return {k: self._value(owner, x, base) for k, x in v.items()}
        return v

    def _ref(self, owner: str, r: _Ref, base: list[Any] | None) -> str:
        if r.code == TEXT_EXT:
            return self.text(r.data).decode()
        if r.code != STR_EXT:
            raise ValueError(f"unknown msgpack extension {r.code}")
        out = []
        for part in _raw_decoder.decode(r.data):
            if type(part) is str:
                out.append(part)
            elif type(part) is list and len(part) == 2:
                if not 0 <= int(part[0]) <= self._at:
                    raise ValueError(f"reference to seq {part[0]} from seq {self._at}")
                out.append(self._inline_of(owner, int(part[0]))[int(part[1])])
            elif type(part) is list and len(part) == 3 and part[2] is None:
                # v5: string i of the parent's own event seq, past this branch's fork point
                parent = self.parent_of(owner) if self.parent_of is not None else None
                if parent is None:
                    raise ValueError(f"reference to a parent's event from seq {self._at} of a root")
                out.append(self._own_inline(parent, int(part[0]))[int(part[1])])
            elif type(part) is list and len(part) == 3 and base is not None:
                content = base[int(part[0])]["content"]
                out.append(content[int(part[1]) : int(part[2])])
            else:
                raise ValueError(f"malformed string part {part!r}")
        return "".join(out)

    def _inline_of(self, owner: str, seq: int) -> list[str]:
        return self._own_inline(self.owner_of(owner, seq), seq)

    def _own_inline(self, src: str, seq: int) -> list[str]:
        """The addressable strings inline in run `src`'s own event `seq`."""
        got = self.inline.get((src, seq))
        if got is None:
            version, stored = self.load(src, seq)
            got = _event_strings(_marked_decoder.decode(stored)) if version >= 4 else []
            self.inline[(src, seq)] = got
        return got

    def _base_request(self, owner: str, seq: int) -> tuple[list[Any], int]:
        src = self.owner_of(owner, seq)
        got = self.requests.get((src, seq))
        if got is not None:
            return got
        version, stored = self.load(src, seq)
        if version >= 4:
            full = self.resolve(src, seq, stored)
            got = self.requests.get((src, seq))
        else:
            if version >= 3:
                stored = _resolve_v3(stored, self.text)
            full = stored
            got = None
        if got is None:
            raw = _raw_decoder.decode(full)
            got = (list(raw.get("request") or []), 0)
            self.requests[(src, seq)] = got
        return got

    def _request(self, owner: str, ops: list[Any]) -> tuple[list[Any], int]:
        if not ops or type(ops[0]) is not _Ref or ops[0].code != REQ_EXT:
            return [self._value(owner, m, None) for m in ops], 0
        head = _raw_decoder.decode(ops[0].data)
        bseqs = head if type(head) is list and 1 <= len(head) <= 2 else [head]
        bases: list[list[Any]] = []
        depth = 0
        for bseq in bseqs:
            if type(bseq) is not int or not 0 <= bseq < self._at:
                raise ValueError(f"request of seq {self._at} based on seq {bseq!r}")
            b, d = self._base_request(owner, bseq)
            bases.append(b)
            depth = max(depth, d)
        base = bases[0]
        out: list[Any] = []
        for op in ops[1:]:
            if type(op) is list and len(op) == 2 and type(op[0]) is str:
                out.append({"role": op[0], "content": self._value(owner, op[1], base)})
            elif type(op) is list and len(op) == 3:
                # v5: messages a..b of the second base
                out.extend(bases[int(op[2])][int(op[0]) : int(op[1])])
            elif type(op) is list:
                out.extend(base[int(op[0]) : int(op[1])])
            else:
                out.append(self._value(owner, op, base))
        return out, depth + 1


def _resolve_v3(stored: bytes, text: Callable[[bytes], bytes]) -> bytes:
    return resolve(stored, text)
