"""The OpenAI chat-completions wire format as journal events, and back.

A recorded program's call is journaled with the event types every run uses (engine.events):

* `LlmCall.request` holds the request's messages, each flattened to string values (a value
  that is not a string - `tool_calls`, a list of content parts - is kept as canonical JSON, a
  null is left out), followed by one pseudo-message of role `car:params` that carries every
  other field of the request (model, tools, temperature, stream ...) as canonical JSON and, in
  `seed`, where the seed came from: `client` (sent by the program), `injected` (the program
  sent none; the run's root seed gave it) or `branch` (a forked branch's seed replaced it).
  Readers of transcripts skip that pseudo-message (`messages_of`).
* `LlmCall.response` is the assistant message's text; each tool call the model asked for is a
  `ToolCall` (tool = function name, param = its JSON arguments) of the same step; the answer
  the program later sends back in a `tool` message becomes that step's `ToolResult`.
* Tool-call ids are the recorder's, not the server's: `call_<agent>_<n>_<i>` for the i-th tool
  call of the n-th call of the agent the proxy received. The program sees those ids, so a
  replay that rebuilds the answer from the journal hands it exactly the ids it saw while
  recording (n is read back from the requests that returned them when the agent's calls
  overlapped and were journaled in another order: engine.program.matching).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import msgspec

from engine import events as ev

PARAMS_ROLE = "car:params"
DEFAULT_AGENT = "assistant"
AGENT_HEADER = "x-car-agent"
#: Request fields the call's own journal fields already hold (or that only steer transport).
_NOT_PARAMS = frozenset({"messages", "seed"})
_json_enc = msgspec.json.Encoder(order="sorted")
_json_dec = msgspec.json.Decoder()


def canonical(value: Any) -> str:
    """Canonical JSON text (sorted keys, no spaces): equal values give equal text."""
    return _json_enc.encode(value).decode()


def decode_json(body: bytes) -> Any:
    return _json_dec.decode(body)


def flatten_message(m: Mapping[str, Any]) -> dict[str, str]:
    """A message with string values only (what `LlmCall.request` can hold)."""
    out: dict[str, str] = {}
    for k, v in m.items():
        if v is None:
            continue
        out[str(k)] = v if isinstance(v, str) else canonical(v)
    return out


def request_entries(body: Mapping[str, Any], seed_source: str) -> list[dict[str, str]]:
    """`LlmCall.request` of a request body: flattened messages, then the params pseudo-message."""
    messages = body.get("messages") or []
    entries = [flatten_message(m) for m in messages if isinstance(m, Mapping)]
    params = {k: v for k, v in body.items() if k not in _NOT_PARAMS}
    entries.append({"role": PARAMS_ROLE, "params": canonical(params), "seed": seed_source})
    return entries


def messages_of(request: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation of a journaled request, without the params pseudo-message."""
    return [m for m in request if m.get("role") != PARAMS_ROLE]


def params_of(request: list[dict[str, str]]) -> dict[str, Any]:
    for m in request:
        if m.get("role") == PARAMS_ROLE:
            got = decode_json(m.get("params", "{}").encode())
            return got if isinstance(got, dict) else {}
    return {}


def seed_source_of(request: list[dict[str, str]]) -> str | None:
    for m in request:
        if m.get("role") == PARAMS_ROLE:
            return m.get("seed")
    return None


def system_prompt(body: Mapping[str, Any]) -> str | None:
    for m in body.get("messages") or []:
        if isinstance(m, Mapping) and m.get("role") in ("system", "developer"):
            c = m.get("content")
            return c if isinstance(c, str) else canonical(c)
    return None


class AgentNames:
    """Tells a program's agents apart: the `X-Car-Agent` header, else the request's `user`
    field, else its system prompt (each new prompt is the next `agent-<n>`), else
    "assistant". Thread-safe enough for the proxy: it is only called under the session lock."""

    def __init__(self) -> None:
        self.by_prompt: dict[str, str] = {}

    def name(self, header: str | None, body: Mapping[str, Any]) -> str:
        if header and header.strip():
            return header.strip()
        user = body.get("user")
        if isinstance(user, str) and user.strip():
            return user.strip()
        prompt = system_prompt(body)
        if prompt is None:
            return DEFAULT_AGENT
        found = self.by_prompt.get(prompt)
        if found is None:
            found = self.by_prompt[prompt] = f"agent-{len(self.by_prompt) + 1}"
        return found

    def learn(self, agent: str, request: list[dict[str, str]]) -> None:
        """Remember a recorded call's prompt -> agent (a replay names agents as the record did)."""
        for m in request:
            if m.get("role") in ("system", "developer"):
                if re.fullmatch(r"agent-\d+", agent):
                    self.by_prompt.setdefault(m.get("content", ""), agent)
                return


#: The seeds the proxy forwards and journals: a signed 64-bit integer, as OpenAI's API takes
#: it (the journal itself holds any 64-bit value, signed or not: engine/otel/importer.py).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def seed_problem(body: Mapping[str, Any]) -> str | None:
    """Why the request's `seed` is refused (None: it is taken, or there is none)."""
    s = body.get("seed")
    if isinstance(s, int) and not isinstance(s, bool) and not SEED_MIN <= s <= SEED_MAX:
        return f"seed={s!r} is outside the 64-bit range [{SEED_MIN}, {SEED_MAX}]"
    return None


def derived_seed(root: int, agent: str, request: str, occurrence: int) -> int:
    """The seed of an agent's call under a root (or branch) seed: by what it asks
    (`request_key`) and how many equal requests the agent made before it, not by when it
    arrived, so that calls an agent has in flight together are seeded alike whichever comes
    first (decision 59). 31 bits, which every OpenAI-compatible server accepts."""
    doc = f"seed:{root}:{agent}:{request}:{occurrence}"
    return int.from_bytes(hashlib.blake2b(doc.encode(), digest_size=8).digest(), "big") & 0x7FFFFFFF


def request_key(body: Mapping[str, Any]) -> str:
    """A digest of a chat-completion request as the program sent it, its seed left out."""
    doc = canonical({k: v for k, v in body.items() if k != "seed"})
    return hashlib.blake2b(doc.encode(), digest_size=16).hexdigest()


def tool_call_id(agent: str, ordinal: int, index: int) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", agent).strip("-") or "agent"
    return f"call_{slug}_{ordinal}_{index}"


# ------------------------------------------------------------------ responses


class Answer(msgspec.Struct):
    """One completion as the journal keeps it (a parsed upstream reply or a recorded one)."""

    content: str
    finish_reason: str
    model: str
    tool_calls: list[tuple[str, str]]  # (function name, JSON arguments)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    fingerprint: str | None = None
    had_content: bool = True  # False: the reply's content was null (tool calls only)


def answer_of(body: Mapping[str, Any]) -> Answer:
    """Parse a non-streamed chat completion; ValueError naming what is missing."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise ValueError("the reply has no choices")
    msg = choices[0].get("message") or {}
    content = msg.get("content")
    calls = []
    for c in msg.get("tool_calls") or []:
        fn = (c or {}).get("function") or {}
        calls.append((str(fn.get("name", "")), _text(fn.get("arguments", ""))))
    usage = body.get("usage") or {}
    return Answer(
        content=_text(content),
        finish_reason=str(choices[0].get("finish_reason") or "unknown"),
        model=str(body.get("model") or "unknown"),
        tool_calls=calls,
        prompt_tokens=_int(usage.get("prompt_tokens")),
        completion_tokens=_int(usage.get("completion_tokens")),
        fingerprint=body.get("system_fingerprint")
        if isinstance(body.get("system_fingerprint"), str)
        else None,
        had_content=content is not None,
    )


def _text(v: Any) -> str:
    if v is None:
        return ""
    return v if isinstance(v, str) else canonical(v)


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 else 0


def rewrite_tool_ids(body: dict[str, Any], agent: str, ordinal: int) -> None:
    """Give the tool calls of a reply the recorder's ids (in place)."""
    for choice in body.get("choices") or []:
        for i, c in enumerate((choice.get("message") or {}).get("tool_calls") or []):
            c["id"] = tool_call_id(agent, ordinal, i)


def completion_body(a: Answer, agent: str, ordinal: int, step: int) -> dict[str, Any]:
    """A chat completion rebuilt from a journaled answer."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": a.content if (a.had_content or not a.tool_calls) else None,
    }
    if a.tool_calls:
        message["tool_calls"] = [
            {
                "id": tool_call_id(agent, ordinal, i),
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            for i, (name, args) in enumerate(a.tool_calls)
        ]
    body: dict[str, Any] = {
        "id": f"chatcmpl-car-{step}",
        "object": "chat.completion",
        "created": 0,
        "model": a.model,
        "choices": [{"index": 0, "message": message, "finish_reason": a.finish_reason}],
        "usage": {
            "prompt_tokens": a.prompt_tokens,
            "completion_tokens": a.completion_tokens,
            "total_tokens": a.prompt_tokens + a.completion_tokens,
        },
    }
    if a.fingerprint is not None:
        body["system_fingerprint"] = a.fingerprint
    return body


def stream_chunks(a: Answer, agent: str, ordinal: int, step: int, usage: bool) -> Iterator[bytes]:
    """A journaled answer as the SSE events of a streamed completion (`data: {...}\\n\\n`),
    the text in word-sized pieces, ending with `data: [DONE]`."""
    base = {
        "id": f"chatcmpl-car-{step}",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": a.model,
    }
    if a.fingerprint is not None:
        base["system_fingerprint"] = a.fingerprint

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        d = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + _json_enc.encode(d) + b"\n\n"

    yield chunk({"role": "assistant", "content": "" if a.had_content else None})
    for piece in re.findall(r"\s*\S+|\s+", a.content):
        yield chunk({"content": piece})
    for i, (name, args) in enumerate(a.tool_calls):
        yield chunk(
            {
                "tool_calls": [
                    {
                        "index": i,
                        "id": tool_call_id(agent, ordinal, i),
                        "type": "function",
                        "function": {"name": name, "arguments": args},
                    }
                ]
            }
        )
    yield chunk({}, a.finish_reason)
    if usage:
        d = {
            **base,
            "choices": [],
            "usage": {
                "prompt_tokens": a.prompt_tokens,
                "completion_tokens": a.completion_tokens,
                "total_tokens": a.prompt_tokens + a.completion_tokens,
            },
        }
        yield b"data: " + _json_enc.encode(d) + b"\n\n"
    yield b"data: [DONE]\n\n"


class _FunctionDelta(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolCallDelta(msgspec.Struct):
    index: int | None = None
    # UNSET: the delta has no `id` (only the first delta of a tool call has one)
    id: str | msgspec.UnsetType | None = msgspec.UNSET
    function: _FunctionDelta | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ToolCallDelta] | None = None


class _ChunkChoice(msgspec.Struct):
    delta: _Delta | None = None
    finish_reason: str | None = None


class _ChunkUsage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Chunk(msgspec.Struct):
    """The fields of a streamed chat-completion chunk the journal reads (others pass as is)."""

    choices: list[_ChunkChoice] | None = None
    model: str | None = None
    system_fingerprint: str | None = None
    usage: _ChunkUsage | None = None
    error: Any = None  # an error event: `{"error": {...}}` and no choices


_chunk_dec = msgspec.json.Decoder(_Chunk)


def _clip(data: bytes, n: int = 80) -> str:
    text = data.decode("utf-8", errors="replace")
    return repr(text if len(text) <= n else text[:n] + "…")


def _utf8_len(text: str) -> int:
    """The length of `text` in UTF-8 bytes."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class StreamAssembler:
    """Reads an upstream SSE stream chunk by chunk into one Answer, rewriting tool-call ids
    on the way (each event is handed back, possibly re-encoded, to be relayed). An event that
    is not a chat-completion chunk is a ValueError saying what is wrong and where.

    Each event is decoded once, straight into a `_Chunk`, and relayed as it came; only an
    event that carries tool-call ids (the first delta of each tool call, not every token) is
    read again as a whole, to relay it with the recorder's ids and every other field as sent.
    """

    def __init__(self, agent: str, ordinal: int) -> None:
        self.agent = agent
        self.ordinal = ordinal
        self.parts: list[str] = []
        self.calls: dict[int, list[str]] = {}  # index -> [name, arguments]
        self.finish = "unknown"
        self.finished = False  # a choice gave its finish_reason
        self.model = "unknown"
        self.fingerprint: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.had_content = False
        self.done = False  # the stream's `[DONE]` came
        self.size = 0  # UTF-8 bytes of text, tool names and arguments so far (as journaled)

    @property
    def complete(self) -> bool:
        """The stream said it was over: `[DONE]`, or a finish_reason."""
        return self.done or self.finished

    def feed(self, data: bytes) -> bytes:
        """One event's data (after `data: `); the data to relay."""
        if data.strip() == b"[DONE]":
            self.done = True
            return data
        try:
            chunk = _chunk_dec.decode(data)
        except msgspec.ValidationError as e:
            raise _malformed(data, e) from e
        except msgspec.DecodeError as e:
            raise ValueError(f"an event is not JSON ({e}): {_clip(data)}") from e
        if chunk.error is not None and not chunk.choices:
            reported = canonical(chunk.error).encode()
            raise ValueError(f"the stream reports an error: {_clip(reported, 200)}")
        if chunk.model:
            self.model = chunk.model
        if chunk.system_fingerprint is not None:
            self.fingerprint = chunk.system_fingerprint
        if chunk.usage is not None:
            self.prompt_tokens = _int(chunk.usage.prompt_tokens) or self.prompt_tokens
            self.completion_tokens = _int(chunk.usage.completion_tokens) or self.completion_tokens
        ids = False  # a tool call of this event has an `id`: the recorder's replaces it
        for choice in chunk.choices or ():
            delta = choice.delta
            if delta is not None:
                if delta.content is not None:
                    self.parts.append(delta.content)
                    self.size += _utf8_len(delta.content)
                    self.had_content = True
                for tc in delta.tool_calls or ():
                    slot = self.calls.setdefault(_int(tc.index), ["", ""])
                    fn = tc.function
                    if fn is not None:
                        if fn.name:
                            slot[0] += fn.name
                            self.size += _utf8_len(fn.name)
                        if fn.arguments:
                            slot[1] += fn.arguments
                            self.size += _utf8_len(fn.arguments)
                    ids = ids or tc.id is not msgspec.UNSET
            if choice.finish_reason:
                self.finish = choice.finish_reason
                self.finished = True
        return self._with_ids(data) if ids else data

    def _with_ids(self, data: bytes) -> bytes:
        """The event with the recorder's tool-call ids, every other field as it came (the
        event was decoded as a `_Chunk` already, so it is a well-formed chunk)."""
        obj = decode_json(data)
        for choice in obj["choices"]:
            for tc in (choice.get("delta") or {}).get("tool_calls") or ():
                if "id" in tc:
                    tc["id"] = tool_call_id(self.agent, self.ordinal, _int(tc.get("index")))
        return _json_enc.encode(obj)

    def answer(self) -> Answer:
        return Answer(
            content="".join(self.parts),
            finish_reason=self.finish,
            model=self.model,
            tool_calls=[(n, a) for _, (n, a) in sorted(self.calls.items())],
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            fingerprint=self.fingerprint,
            had_content=self.had_content or not self.calls,
        )


def _malformed(data: bytes, e: msgspec.ValidationError) -> ValueError:
    """Why an event that is JSON but no `_Chunk` is refused: not an object, an error report
    (whose other fields may be anything), or a chunk with a field of the wrong type."""
    obj = decode_json(data)
    if not isinstance(obj, dict):
        return ValueError(f"an event is not a JSON object: {_clip(data)}")
    if obj.get("error") is not None and not obj.get("choices"):
        reported = canonical(obj["error"]).encode()
        return ValueError(f"the stream reports an error: {_clip(reported, 200)}")
    return ValueError(f"a malformed chunk: {e}")


def answer_from_events(call: ev.LlmCall, tools: list[ev.ToolCall]) -> Answer:
    """The answer a recorded step gave (for a replay)."""
    return Answer(
        content=call.response,
        finish_reason=call.finish_reason,
        model=call.model,
        tool_calls=[(t.tool, t.param) for t in tools],
        prompt_tokens=call.prompt_tokens,
        completion_tokens=call.completion_tokens,
        fingerprint=call.system_fingerprint,
        had_content=bool(call.response) or not tools,
    )
