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
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Union, get_args

import msgspec

SCHEMA_VERSION = 3
# from this version on the event shapes are those of today's Structs (3 only changed storage)
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
