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
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import Any, Union, get_args

import msgspec

SCHEMA_VERSION = 4
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
    """Secret: the mole and its strategy. Detectors never read this kind."""

    agent: str
    strategy: str
    instructions: str


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
_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[AnyEvent] = msgspec.msgpack.Decoder(AnyEvent)  # type: ignore[arg-type]
_raw_decoder = msgspec.msgpack.Decoder()


def encode(event: Event) -> bytes:
    """Canonical bytes of an event: msgpack, fields in declaration order, defaults omitted."""
    return _encoder.encode(event)


def encode_checked(event: Event) -> bytes:
    """`encode`, refusing an event that would not read back: its bytes must decode to an event
    whose encoding is the same bytes (a field of the wrong type, an int msgpack cannot hold, a
    value no decoder accepts). What the journal stores is therefore always decodable."""
    from engine.errors import JournalError

    kind = kind_of(event)
    try:
        payload = _encoder.encode(event)
    except (OverflowError, TypeError, ValueError) as e:
        raise JournalError(f"refusing to journal a {kind} event: {e}") from e
    try:
        back = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise JournalError(f"refusing to journal a {kind} event that would not decode: {e}") from e
    if _encoder.encode(back) != payload:
        raise JournalError(f"refusing to journal a {kind} event that does not read back as stored")
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


def decode_stored_for_fold(stored: bytes) -> Event | None:
    """The fold's view of a stored v4 payload without resolving it, None when a field the fold
    reads holds a reference (then the payload must be resolved first)."""
    try:
        return _fold_stored_decoder.decode(stored)  # type: ignore[no-any-return]
    except (_HasReference, msgspec.DecodeError):
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
    """`_inline_strings` of a decoded stored event: its own kind never counts (the writer leaves
    it as it is)."""
    out: list[str] = []
    if type(tree) is dict:
        for k, x in tree.items():
            if k != "kind":
                _inline_strings(x, out)
    return out


class Compactor:
    """The writer's memory of one run's history, which makes its v4 payloads small: where each
    addressable string is inline (seq, index), the latest inline strings, and each agent's latest
    LLM request (what the next request is a delta of).

    Memory is only what this writer put down or loaded; whatever it does not know is written
    inline, so a cold compactor costs bytes, never correctness."""

    def __init__(self) -> None:
        self.strings: dict[str, tuple[int, int]] = {}
        # first and last MIN_REF characters of inline strings -> the longest such string: how
        # a message that quotes a text ("agent: text", "TOOL RESULT x(p): output") is found
        self.heads: dict[str, str] = {}
        self.tails: dict[str, str] = {}
        # agent -> (seq, request, depth of its delta chain)
        self.requests: dict[str, tuple[int, list[Any], int]] = {}
        self.last_request: tuple[int, list[Any], int] | None = None
        # texts of LONG_TEXT characters or more: digest -> UTF-8 bytes, to be stored in `texts`
        # by this append (shared by every run of the journal, like a system prompt)
        self.texts: dict[bytes, bytes] = {}
        self._digests: dict[str, bytes] = {}
        # id of a request -> its message keys and where each key first occurs
        self._keys: dict[int, tuple[list[Any], dict[Any, int]]] = {}
        self.seeded = False

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

    def _index(self, t: str) -> None:
        h, e = t[:MIN_REF], t[-MIN_REF:]
        if len(self.heads.get(h, "")) < len(t):
            self.heads[h] = t
        if len(self.tails.get(e, "")) < len(t):
            self.tails[e] = t

    def compact(self, seq: int, payload: bytes) -> bytes:
        """The stored v4 form of the canonical bytes of event `seq`."""
        if len(payload) < MIN_REF:
            return payload
        raw = _raw_decoder.decode(payload)
        if len(self.strings) > 20_000:  # bounded memory; forgetting costs bytes only
            self.strings.clear()
            self.heads.clear()
            self.tails.clear()
        self._idx = 0
        self._seq = seq
        self._new: list[str] = []
        self._changed = False  # a reference written: else the stored bytes are the payload
        out: dict[str, Any] = {}
        for k, v in raw.items():
            if k == "kind":
                out[k] = v
            elif k == "request" and raw.get("kind") == "llm_call" and type(v) is list:
                out[k] = self._request(str(raw.get("agent", "")), v)
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
        loc = self.strings.get(s)
        if loc is not None:
            self._changed = True
            return msgspec.msgpack.Ext(STR_EXT, _encoder.encode([list(loc)]))
        best = None
        t = self.tails.get(s[-MIN_REF:])
        if t is not None and len(t) < len(s) and s.endswith(t):
            best = t
        t = self.heads.get(s[:MIN_REF])
        if t is not None and len(t) < len(s) and s.startswith(t):
            best = t if best is None or len(t) > len(best) else best
        if best is not None:
            i = 0 if s.startswith(best) else len(s) - len(best)
            parts: list[Any] = []
            if i:
                parts.append(s[:i])
            parts.append(list(self.strings[best]))
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
        prior = self.requests.get(agent) or self.last_request
        keys = [_msg_key(m) for m in req]
        # a request of a few short messages is stored as it is: a delta would save nothing
        if (
            prior is None
            or prior[2] + 1 >= KEYFRAME_DEPTH
            or None in keys
            or len(_encoder.encode(req)) <= SMALL_REQUEST
        ):
            self.note_request(agent, self._seq, req, 0, keys)
            return [self._message(m, None, ()) for m in req]
        bseq, base, depth = prior
        cached = self._keys.get(id(base))
        if cached is None:
            bkeys = [_msg_key(m) for m in base]
            where: dict[Any, int] = {}
            for i, k in enumerate(bkeys):
                where.setdefault(k, i)
        else:
            bkeys, where = cached
        self._changed = True
        ops: list[Any] = [msgspec.msgpack.Ext(REQ_EXT, _encoder.encode(bseq))]
        run: list[int] | None = None
        for i, (m, key) in enumerate(zip(req, keys, strict=True)):
            if run is not None and run[1] < len(base) and bkeys[run[1]] == key:
                run[1] += 1
                continue
            j = where.get(key)
            if j is not None:
                run = [j, j + 1]
                ops.append(run)
                continue
            run = None
            # what it may be an edit of: the base's message at the same position, counted from
            # the end (the closing instruction of a turn) or from the start (a system prompt)
            ops.append(self._message(m, base, (len(base) - (len(req) - i), i)))
        self.note_request(agent, self._seq, req, depth + 1, keys)
        return ops


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


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
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
    ) -> None:
        self.owner_of = owner_of
        self.load = load
        self.text = text
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
        if type(tree) is not dict:
            raise ValueError("a stored event is not a map")
        found = _event_strings(tree)
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
            elif type(part) is list and len(part) == 3 and base is not None:
                content = base[int(part[0])]["content"]
                out.append(content[int(part[1]) : int(part[2])])
            else:
                raise ValueError(f"malformed string part {part!r}")
        return "".join(out)

    def _inline_of(self, owner: str, seq: int) -> list[str]:
        src = self.owner_of(owner, seq)
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
        bseq = int(_raw_decoder.decode(ops[0].data))
        if not 0 <= bseq < self._at:
            raise ValueError(f"request of seq {self._at} based on seq {bseq}")
        base, depth = self._base_request(owner, bseq)
        out: list[Any] = []
        for op in ops[1:]:
            if type(op) is list and len(op) == 2 and type(op[0]) is str:
                out.append({"role": op[0], "content": self._value(owner, op[1], base)})
            elif type(op) is list:
                out.extend(base[int(op[0]) : int(op[1])])
            else:
                out.append(self._value(owner, op, base))
        return out, depth + 1


def _resolve_v3(stored: bytes, text: Callable[[bytes], bytes]) -> bytes:
    return resolve(stored, text)
