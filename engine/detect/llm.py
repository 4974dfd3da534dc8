"""The blog's LLM step (its "RAG"): rule findings as a structured context, plus the conversation,
sent to an OpenAI-compatible model that must answer a JSON object of scores.

What can go wrong is handled, never raised into the analysis:

- the server is unreachable, times out or answers an HTTP error: `LlmUnavailable`, and the
  analysis degrades to the rules (its `methods_run` says so);
- the answer is not clean JSON (code fences, prose around it, single quotes, trailing commas,
  bare keys), partial (agents missing), non-numeric, or out of range: `parse_scores` repairs what
  it can and says what it did in warnings; an answer with no usable score is ignored.

The prompt, model, seed and raw answer are journaled as a `detection` run of their own
(docs/decisions.md, entry 13), so an analysis can be audited and a deterministic local model
replayed. Nothing here reads more than the public view.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.detect.rules import Msg, RuleScores, ToolUse, keywords

DEFAULT_BASE_URL = "http://localhost:1234/v1"  # LM Studio, as in the blog
DEFAULT_MODEL = "local-model"
TEMPERATURE = 0.3  # the blog's: steadier answers
MAX_TOKENS = 200
MAX_MESSAGES = 50  # the blog sends the first 50 messages
MAX_MESSAGE_CHARS = 300  # keeps a small model's context window from overflowing
MAX_ANSWER_CHARS = 20_000
SYSTEM = "You are a detective. Answer only with one valid JSON object."


class LlmUnavailable(Exception):
    """The model could not be asked (unreachable server, timeout, HTTP error, no text)."""


def rag_context(
    rules: RuleScores, messages: Sequence[Msg], tools: Sequence[ToolUse], agents: Sequence[str]
) -> str:
    """The blog's structured context: top suspects by the rules, tool failures per agent and
    timing-related mentions per agent."""
    lines = ["TOP SUSPECTS (rule-based):"]
    ranked = sorted(agents, key=lambda a: -rules.combined[a])[:3]
    lines += [f"  - {a}: {rules.combined[a]:.0%} suspicion" for a in ranked]
    failures = {a: 0 for a in agents}
    for t in tools:
        if not t.success and t.agent in failures:
            failures[t.agent] += 1
    failed = [(a, n) for a, n in failures.items() if n]
    if failed:
        lines.append("TOOL FAILURES:")
        lines += [f"  - {a}: {n} tool calls failed" for a, n in failed]
    timing = keywords()["context_timing"]
    mentions = {a: 0 for a in agents}
    for m in messages:
        if m.agent in mentions and timing.present(m.text):
            mentions[m.agent] += 1
    top = sorted((a for a in agents if mentions[a]), key=lambda a: -mentions[a])[:3]
    if top:
        lines.append("TIMING-RELATED MENTIONS:")
        lines += [f"  - {a}: {mentions[a]} messages" for a in top]
    return "\n".join(lines)


def build_prompt(
    rules: RuleScores, messages: Sequence[Msg], tools: Sequence[ToolUse], agents: Sequence[str]
) -> list[dict[str, str]]:
    """The chat messages sent to the model."""
    convo = "\n".join(
        f"{m.agent}: {_clip(m.text, MAX_MESSAGE_CHARS)}" for m in messages[:MAX_MESSAGES]
    )
    example = ", ".join(f'"{a}": 0.0' for a in agents)
    user = (
        "A crew of agents planned a heist; one of them may be a saboteur.\n\n"
        f"SUSPICIOUS PATTERNS FOUND BY RULES:\n{rag_context(rules, messages, tools, agents)}\n\n"
        f"CONVERSATION:\n{convo}\n\n"
        "For each agent, estimate the probability (0.0 to 1.0) that it sabotaged the plan. "
        "Weigh vague or conflicting information, delays and needless questions, suspicious tool "
        "failures and contradictions.\n"
        f"Answer ONLY with JSON of this form: {{{example}}}"
    )
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


@dataclass
class LlmAnswer:
    raw: str
    model: str
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0


def ask(
    prompt: list[dict[str, str]],
    *,
    base_url: str,
    model: str,
    seed: int,
    timeout: float = 60.0,
    max_tokens: int = MAX_TOKENS,
) -> LlmAnswer:
    """One chat completion; every failure to get an answer text is `LlmUnavailable`."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="not-needed", timeout=timeout, max_retries=1)
    t0 = time.monotonic()
    try:
        resp = client.chat.completions.create(
            model=model,
            messages=prompt,  # type: ignore[arg-type]
            seed=seed,
            temperature=TEMPERATURE,
            max_tokens=max_tokens,
        )
    except openai.APITimeoutError as e:
        raise LlmUnavailable(f"LLM server {base_url!r} timed out after {timeout:g}s") from e
    except openai.APIConnectionError as e:
        raise LlmUnavailable(f"LLM server {base_url!r} is unreachable") from e
    except openai.APIStatusError as e:
        raise LlmUnavailable(f"LLM server {base_url!r} answered HTTP {e.status_code}") from e
    except (openai.OpenAIError, json.JSONDecodeError, ValueError) as e:
        raise LlmUnavailable(f"LLM server {base_url!r} failed: {_clip(str(e), 160)}") from e
    try:
        choice = resp.choices[0]
        text = choice.message.content
    except (AttributeError, IndexError, TypeError) as e:
        raise LlmUnavailable(f"LLM server {base_url!r} returned no choices") from e
    if not isinstance(text, str):
        raise LlmUnavailable(f"LLM server {base_url!r} returned no message text")
    usage = getattr(resp, "usage", None)
    return LlmAnswer(
        raw=text[:MAX_ANSWER_CHARS],
        model=str(getattr(resp, "model", None) or model)[:200],
        finish_reason=str(getattr(choice, "finish_reason", None) or "unknown")[:40],
        prompt_tokens=_count(getattr(usage, "prompt_tokens", 0)),
        completion_tokens=_count(getattr(usage, "completion_tokens", 0)),
        latency_ms=round((time.monotonic() - t0) * 1000.0, 3),
    )


def _count(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31 else 0


# ------------------------------------------------------------------ parsing the answer


@dataclass
class Parsed:
    scores: dict[str, float]  # every agent, when any score was usable
    given: int  # how many agents the model scored usably
    warnings: list[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return self.given > 0


_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.S)
_TRAILING_COMMA = re.compile(r",\s*([}\]])")
_BARE_KEY = re.compile(r"([{,]\s*)([A-Za-z_][A-Za-z0-9_-]*)\s*:")


def _objects(text: str) -> list[str]:
    """Balanced {...} spans of `text`, outermost first."""
    spans, depth, start = [], 0, -1
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth > 0:
            depth -= 1
            if depth == 0:
                spans.append(text[start : i + 1])
    return spans


def _loads(candidate: str) -> tuple[Any, list[str]] | None:
    """json.loads, then a few well-known repairs, each named in the returned notes."""
    try:
        return json.loads(candidate), []
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser
        pass
    notes = []
    fixed = candidate
    if "'" in fixed and '"' not in fixed:
        fixed = fixed.replace("'", '"')
        notes.append("single quotes")
    if _TRAILING_COMMA.search(fixed):
        fixed = _TRAILING_COMMA.sub(r"\1", fixed)
        notes.append("trailing commas")
    if _BARE_KEY.search(fixed):
        fixed = _BARE_KEY.sub(r'\1"\2":', fixed)
        notes.append("unquoted keys")
    try:
        return json.loads(fixed), notes
    except (ValueError, RecursionError):
        return None


def _as_mapping(data: Any) -> dict[str, Any] | None:
    """Accept {"agent": score}, {"scores": {...}} and [{"agent": a, "score": s}, ...]."""
    if isinstance(data, dict):
        for wrapper in ("scores", "suspicion_scores", "probabilities", "agents"):
            inner = data.get(wrapper)
            if isinstance(inner, (dict, list)) and len(data) <= 2:
                return _as_mapping(inner)
        return data
    if isinstance(data, list):
        out: dict[str, Any] = {}
        for item in data:
            if isinstance(item, dict):
                name = item.get("agent") or item.get("name")
                value = item.get("score", item.get("probability"))
                if isinstance(name, str):
                    out[name] = value
        return out or None
    return None


def _number(value: Any) -> tuple[float | None, str | None]:
    """A score in [0, 1] from a model's value, or None and why not."""
    if isinstance(value, bool) or value is None:
        return None, f"non-numeric value {value!r}"
    percent = False
    if isinstance(value, str):
        s = value.strip()
        percent = s.endswith("%")
        try:
            value = float(s.rstrip("%").strip())
        except ValueError:
            return None, f"non-numeric value {_clip(value, 40)!r}"
    if not isinstance(value, (int, float)):
        return None, f"non-numeric value {_clip(str(value), 40)!r}"
    try:
        x = float(value)  # an int past a float's range (1 followed by 400 zeros) overflows
    except OverflowError:
        return None, f"out-of-range value {_clip(repr(value), 40)}"
    if not math.isfinite(x):
        return None, f"non-numeric value {_clip(str(value), 40)!r}"
    if percent or 1.0 < x <= 100.0:
        if 0.0 <= x <= 100.0:
            return x / 100.0, f"read {value!r} as a percentage"
        return None, f"out-of-range value {_clip(repr(value), 40)}"
    if 0.0 <= x <= 1.0:
        return x, None
    return None, f"out-of-range value {_clip(repr(value), 40)}"


def parse_scores(raw: str, agents: Sequence[str]) -> Parsed:
    """The model's scores for `agents` from its raw answer, repaired where that is safe."""
    warnings: list[str] = []
    text = raw.strip()
    fence = _FENCE.search(text)
    if fence:
        text = fence.group(1).strip()
    mapping: dict[str, Any] | None = None
    for candidate in [text, *_objects(text)]:
        loaded = _loads(candidate)
        if loaded is None:
            continue
        data, notes = loaded
        mapping = _as_mapping(data)
        if mapping is not None:
            if notes:
                warnings.append(f"LLM answer was repaired ({', '.join(notes)})")
            elif candidate is not text:
                warnings.append("LLM answer had text around its JSON; used the JSON object")
            break
    if mapping is None:
        mapping = _pairs(text, agents)
        if mapping:
            warnings.append("LLM answer was not JSON; read 'agent: score' pairs from its text")
    by_lower = {a.lower(): a for a in agents}
    got: dict[str, float] = {}
    for key, value in (mapping or {}).items():
        agent = by_lower.get(str(key).strip().lower())
        if agent is None:
            warnings.append(f"LLM scored an unknown agent {_clip(str(key), 40)!r}; ignored")
            continue
        x, note = _number(value)
        if x is None:
            warnings.append(f"LLM score for {agent} ignored: {note}")
            continue
        if note:
            warnings.append(f"LLM score for {agent}: {note}")
        got[agent] = x
    if not got:
        warnings.append("LLM answer held no usable score; the LLM step was ignored")
        return Parsed({}, 0, warnings)
    missing = [a for a in agents if a not in got]
    if missing:
        fill = sum(got.values()) / len(got)
        warnings.append(
            f"LLM answer scored {len(got)} of {len(agents)} agents; the others get the mean of "
            f"its scores ({fill:.2f}): {', '.join(missing)}"
        )
        for a in missing:
            got[a] = fill
    return Parsed({a: got[a] for a in agents}, len(agents) - len(missing), warnings)


def _pairs(text: str, agents: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in agents:
        m = re.search(
            rf"(?<![\w]){re.escape(a)}(?![\w])[\"']?\s*[:=]\s*([-+]?\d+(?:\.\d+)?%?)", text, re.I
        )
        if m:
            out[a] = m.group(1)
    return out


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"
