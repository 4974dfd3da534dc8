"""engine/detect/llm.py, claim by claim: the blog's structured context and prompt, one chat
completion against a small local server, and the repairs of a model's answer (the survivors
of scripts/mutate, killed one at a time). Expected texts are written out by hand."""

from __future__ import annotations

import time
from typing import Any

import pytest
from llm_helpers import completion, scripted_server

from engine.detect import llm as L
from engine.detect.rules import Msg, RuleScores, ToolUse

AGENTS = ["ann", "bob", "cat", "dan"]


def _rules(combined: dict[str, float]) -> RuleScores:
    return RuleScores(signals={}, combined=combined)


# ------------------------------------------------------------------ context and prompt


def test_rag_context_top_three_failures_and_timing() -> None:
    """Top suspects: the three highest combined rule scores, highest first, as percentages;
    tool failures per agent (successes and agents outside the crew not counted), in crew
    order; timing mentions (messages with a timing word, one per message) for the three
    agents with most, most first, agents with none left out."""
    rules = _rules({"ann": 0.1, "bob": 0.5, "cat": 0.9, "dan": 0.3})
    tools = [
        ToolUse("dan", "calculator", False),
        ToolUse("bob", "file_reader", False),
        ToolUse("bob", "file_reader", False),
        ToolUse("bob", "file_reader", True),
        ToolUse("eve", "calculator", False),
    ]
    messages = [
        Msg("ann", "We wait for the guard."),
        Msg("cat", "Five minutes, then a delay."),
        Msg("cat", "What time is it?"),
        Msg("cat", "Hours to go."),
        Msg("ann", "The door."),
        Msg("dan", "Delayed again."),
        Msg("dan", "One hour."),
        Msg("eve", "wait wait"),
        Msg("bob", "The vault code."),
    ]
    assert L.rag_context(rules, messages, tools, AGENTS) == (
        "TOP SUSPECTS (rule-based):\n"
        "  - cat: 90% suspicion\n"
        "  - bob: 50% suspicion\n"
        "  - dan: 30% suspicion\n"
        "TOOL FAILURES:\n"
        "  - bob: 2 tool calls failed\n"
        "  - dan: 1 tool calls failed\n"
        "TIMING-RELATED MENTIONS:\n"
        "  - cat: 3 messages\n"
        "  - dan: 2 messages\n"
        "  - ann: 1 messages"
    )


def test_rag_context_without_failures_or_mentions_is_the_suspects_only() -> None:
    """No failed tool and no timing word: only the suspects' lines, no empty sections."""
    rules = _rules({"ann": 0.25, "bob": 0.75})
    text = L.rag_context(
        rules, [Msg("ann", "The door.")], [ToolUse("ann", "x", True)], ["ann", "bob"]
    )
    assert text == "TOP SUSPECTS (rule-based):\n  - bob: 75% suspicion\n  - ann: 25% suspicion"


def test_prompt_is_the_blog_prompt_with_clipped_conversation() -> None:
    """Two messages: the detective system message; the user message with the context, the
    conversation one line per message (whitespace collapsed, clipped to 300 characters with
    an ellipsis) and the JSON form naming every agent."""
    rules = _rules({"ann": 0.5, "bob": 0.0})
    long = "x" * 299 + " yz"
    messages = [Msg("ann", "Hello\n  there"), Msg("bob", long)]
    prompt = L.build_prompt(rules, messages, [], ["ann", "bob"])
    assert prompt[0] == {
        "role": "system",
        "content": "You are a detective. Answer only with one valid JSON object.",
    }
    assert prompt[1]["role"] == "user" and len(prompt) == 2
    assert prompt[1]["content"] == (
        "A crew of agents planned a heist; one of them may be a saboteur.\n\n"
        "SUSPICIOUS PATTERNS FOUND BY RULES:\n"
        "TOP SUSPECTS (rule-based):\n  - ann: 50% suspicion\n  - bob: 0% suspicion\n\n"
        "CONVERSATION:\n"
        "ann: Hello there\n"
        f"bob: {'x' * 299}…\n\n"
        "For each agent, estimate the probability (0.0 to 1.0) that it sabotaged the plan. "
        "Weigh vague or conflicting information, delays and needless questions, suspicious tool "
        "failures and contradictions.\n"
        'Answer ONLY with JSON of this form: {"ann": 0.0, "bob": 0.0}'
    )


def test_prompt_sends_the_first_fifty_messages_only() -> None:
    """Of 60 messages the first 50 are sent (the blog's limit), in order."""
    messages = [Msg("ann", f"m{i}") for i in range(60)]
    content = L.build_prompt(_rules({"ann": 0.0}), messages, [], ["ann"])[1]["content"]
    convo = content.split("CONVERSATION:\n")[1].split("\n\n")[0].splitlines()
    assert convo == [f"ann: m{i}" for i in range(50)]


def test_clip_collapses_whitespace_and_keeps_n_characters() -> None:
    """_clip: whitespace runs become one space; a text of exactly n characters is kept, a
    longer one becomes n - 1 characters and an ellipsis."""
    assert L._clip("  a \n\t b  ", 10) == "a b"
    assert L._clip("abcde", 5) == "abcde"
    assert L._clip("abcdef", 5) == "abcd…"


# ------------------------------------------------------------------ one chat completion


def _ok(content: str | None, **kw: Any) -> Any:
    return lambda request: (200, completion(content, **kw))


def test_ask_sends_the_blog_settings_and_reads_the_answer() -> None:
    """ask() posts the prompt with the model, seed, temperature 0.3 and max_tokens asked and
    returns the text, the model and finish reason the server names, its token counts and a
    measured latency."""
    usage = {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}
    prompt = [{"role": "user", "content": "who?"}]
    with scripted_server(_ok('{"ann": 1}', finish_reason="length", usage=usage)) as srv:
        t0 = time.monotonic()
        a = L.ask(prompt, base_url=srv.url, model="m-a", seed=99, max_tokens=77)
        wall = (time.monotonic() - t0) * 1000.0
    (req,) = srv.requests
    assert req["model"] == "m-a" and req["messages"] == prompt and req["seed"] == 99
    assert req["temperature"] == 0.3 and req["max_tokens"] == 77
    assert srv.headers[0]["authorization"] == "Bearer not-needed"  # a local server's placeholder
    assert (a.raw, a.model, a.finish_reason) == ('{"ann": 1}', "served-model", "length")
    assert (a.prompt_tokens, a.completion_tokens) == (11, 4)
    assert 0.0 < a.latency_ms <= wall and a.latency_ms == round(a.latency_ms, 3)


def test_ask_default_max_tokens_is_two_hundred() -> None:
    """Without max_tokens the request asks for 200 tokens."""
    with scripted_server(_ok("x")) as srv:
        L.ask([{"role": "user", "content": "q"}], base_url=srv.url, model="m", seed=1)
    assert srv.requests[0]["max_tokens"] == 200


def test_ask_fills_and_clips_what_the_server_leaves_out_or_overdoes() -> None:
    """No model and no finish reason named: the model asked and "unknown"; no usage: zero
    tokens; an answer, model name and finish reason longer than their limits are clipped to
    20 000, 200 and 40 characters."""
    with scripted_server(_ok("y", model=None, finish_reason=None)) as srv:
        a = L.ask([], base_url=srv.url, model="asked", seed=1)
    assert (a.model, a.finish_reason, a.prompt_tokens, a.completion_tokens) == (
        "asked",
        "unknown",
        0,
        0,
    )
    big = _ok("z" * 20_001, model="m" * 201, finish_reason="f" * 41)
    with scripted_server(big) as srv:
        a = L.ask([], base_url=srv.url, model="asked", seed=1)
    assert a.raw == "z" * 20_000 and a.model == "m" * 200 and a.finish_reason == "f" * 40


def test_ask_counts_only_sane_token_numbers() -> None:
    """Token counts that are not a plain int in [0, 2**31) are read as 0."""
    assert [L._count(v) for v in (0, 5, 2**31 - 1)] == [0, 5, 2**31 - 1]
    assert [L._count(v) for v in (-1, 2**31, True, 3.0, "4", None)] == [0] * 6


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (500, {"error": "boom"}, "answered HTTP 500"),
        (404, {"error": "no"}, "answered HTTP 404"),
        (200, b"{not json", "failed: "),
        (200, {"id": "x", "object": "chat.completion", "choices": [], "model": "m"}, "no choices"),
        (200, completion(None), "returned no message text"),
    ],
)
def test_ask_failures_are_llm_unavailable(
    status: int, body: dict[str, Any] | bytes, message: str
) -> None:
    """Every way of not getting an answer text is LlmUnavailable naming the server."""
    with (
        scripted_server(lambda request: (status, body)) as srv,
        pytest.raises(L.LlmUnavailable, match=message) as info,
    ):
        L.ask([], base_url=srv.url, model="m", seed=1)
    assert str(info.value).startswith(f"LLM server {srv.url!r} ")


def test_ask_retries_a_server_error_once() -> None:
    """A server error is asked again once (max_retries=1): two requests, then the error."""
    with (
        scripted_server(lambda request: (500, {"error": "boom"})) as srv,
        pytest.raises(L.LlmUnavailable, match="HTTP 500"),
    ):
        L.ask([], base_url=srv.url, model="m", seed=1)
    assert len(srv.requests) == 2


def test_ask_unreachable_and_timed_out() -> None:
    """A closed port is "is unreachable"; a server slower than the timeout is "timed out
    after <timeout>s"."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        with pytest.raises(L.LlmUnavailable, match=r"is unreachable$"):
            L.ask([], base_url=url, model="m", seed=1, timeout=0.5)

    def slow(request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        time.sleep(0.6)
        return 200, completion("late")

    with (
        scripted_server(slow) as srv,
        pytest.raises(L.LlmUnavailable, match=r"timed out after 0\.25s$"),
    ):
        L.ask([], base_url=srv.url, model="m", seed=1, timeout=0.25)


# ------------------------------------------------------------------ parsing the answer


def test_objects_are_the_balanced_outermost_spans() -> None:
    """_objects: each outermost balanced {...} once, in order; a stray closing brace before
    any opening one is skipped; an unclosed span is not returned."""
    assert L._objects("a{b{c}d}e{f}") == ["{b{c}d}", "{f}"]
    assert L._objects("}{x}") == ["{x}"]
    assert L._objects("{y") == []
    assert L._objects("{}") == ["{}"]


def test_loads_names_each_repair() -> None:
    """_loads: clean JSON has no notes; single quotes (only when no double quote is present),
    trailing commas and bare keys are each repaired and named, in that order; what no repair
    fixes is None."""
    assert L._loads('{"a": 1}') == ({"a": 1}, [])
    assert L._loads("{'a': 1}") == ({"a": 1}, ["single quotes"])
    assert L._loads('{"a": 1,}') == ({"a": 1}, ["trailing commas"])
    assert L._loads("[1, 2, ]") == ([1, 2], ["trailing commas"])
    assert L._loads("{a: 1, b_2-x: 2}") == ({"a": 1, "b_2-x": 2}, ["unquoted keys"])
    assert L._loads("{'a': 1, b: 2,}") == (
        {"a": 1, "b": 2},
        ["single quotes", "trailing commas", "unquoted keys"],
    )
    assert L._loads("""{"it's": 1,}""") == ({"it's": 1}, ["trailing commas"])
    assert L._loads("{'a\": 1}") is None
    assert L._loads("nothing") is None


def test_as_mapping_accepts_the_three_shapes() -> None:
    """A flat dict is itself; a wrapper key ("scores", "suspicion_scores", "probabilities",
    "agents") holding a dict or list is unwrapped when the object has at most two keys; a
    list of {"agent"|"name", "score"|"probability"} items becomes a dict; anything else is
    None."""
    inner = {"ann": 0.1}
    for wrapper in ("scores", "suspicion_scores", "probabilities", "agents"):
        assert L._as_mapping({wrapper: inner}) == inner
        assert L._as_mapping({wrapper: inner, "note": "x"}) == inner
        crowded = {wrapper: inner, "note": "x", "more": "y"}
        assert L._as_mapping(crowded) == crowded
    assert L._as_mapping({"scores": 0.5, "ann": 0.2}) == {"scores": 0.5, "ann": 0.2}
    items = [
        {"agent": "ann", "score": 0.1},
        {"name": "bob", "probability": 0.2},
        {"agent": "cat", "score": 0.3, "probability": 0.9},
        {"agent": 5, "score": 0.4},
        "junk",
    ]
    assert L._as_mapping(items) == {"ann": 0.1, "bob": 0.2, "cat": 0.3}
    assert L._as_mapping({"agents": [{"agent": "ann", "score": 0.7}]}) == {"ann": 0.7}
    assert L._as_mapping([]) is None and L._as_mapping(["x"]) is None
    assert L._as_mapping(3) is None and L._as_mapping("ann") is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, (0.0, None)),
        (1, (1.0, None)),
        (0.5, (0.5, None)),
        (1.5, (0.015, "read 1.5 as a percentage")),
        (100, (1.0, "read 100 as a percentage")),
        (100.5, (None, "out-of-range value 100.5")),
        (-0.1, (None, "out-of-range value -0.1")),
        ("0.25", (0.25, None)),
        (" 40% ", (0.4, "read 40.0 as a percentage")),
        ("0.5%", (0.005, "read 0.5 as a percentage")),
        ("150%", (None, "out-of-range value 150.0")),
        ("-5%", (None, "out-of-range value -5.0")),
        ("high", (None, "non-numeric value 'high'")),
        (True, (None, "non-numeric value True")),
        (None, (None, "non-numeric value None")),
        (float("inf"), (None, "non-numeric value 'inf'")),
        ([1], (None, "non-numeric value '[1]'")),
    ],
)
def test_number_reads_fractions_and_percentages(value: Any, expected: tuple[Any, Any]) -> None:
    """_number: [0, 1] as it is; (1, 100] or a trailing % as a percentage (said); the rest
    out of range or non-numeric, with the value quoted."""
    x, note = L._number(value)
    assert note == expected[1]
    assert x == (None if expected[0] is None else pytest.approx(expected[0]))


def test_number_clips_a_long_non_numeric_text() -> None:
    """A long non-numeric text is quoted clipped to 40 characters."""
    assert L._number("w " * 50) == (None, f"non-numeric value {'w ' * 19 + 'w…'!r}")


def test_parse_clean_answer_has_every_score_and_no_warning() -> None:
    """A clean JSON answer scoring every agent (any letter case, spaces around the key):
    those scores, all agents given, no warning."""
    p = L.parse_scores('{"ANN": 0.1, " bob ": 0.2, "cat": 0.3, "dan": 0.4}', AGENTS)
    assert p.scores == {"ann": 0.1, "bob": 0.2, "cat": 0.3, "dan": 0.4}
    assert p.given == 4 and p.usable and p.warnings == []


def test_parse_fenced_answer_reads_inside_the_fence() -> None:
    """A ```json fence (or a bare one) is read inside, without a warning."""
    for fence in ("```json", "```JSON", "```"):
        p = L.parse_scores(f'Here:\n{fence}\n{{"ann": 0.5}}\n```\nbye', ["ann"])
        assert p.scores == {"ann": 0.5} and p.warnings == []


def test_parse_text_around_json_and_repairs_are_said() -> None:
    """JSON inside prose is used with a warning saying so; a repaired answer says which
    repairs (and not that there was text around it)."""
    p = L.parse_scores('I think {"ann": 0.5} is it', ["ann"])
    assert p.warnings == ["LLM answer had text around its JSON; used the JSON object"]
    p = L.parse_scores("so {ann: 0.5,} ok", ["ann"])
    assert p.scores == {"ann": 0.5}
    assert p.warnings == ["LLM answer was repaired (trailing commas, unquoted keys)"]


def test_parse_a_non_mapping_candidate_goes_on_to_the_next() -> None:
    """An answer that is JSON but no mapping (a list of numbers and an object with no agent
    key) is passed over for the object inside it."""
    p = L.parse_scores('[1, {"ann": 0.5}]', ["ann"])
    assert p.scores == {"ann": 0.5}
    assert p.warnings == ["LLM answer had text around its JSON; used the JSON object"]


def test_parse_fills_missing_agents_with_the_mean() -> None:
    """Two of four agents scored: the others get the mean of the two, and a warning says how
    many were scored and who was filled; `given` counts the scored ones."""
    p = L.parse_scores('{"ann": 0.2, "cat": 0.5}', AGENTS)
    assert p.scores == {
        "ann": 0.2,
        "bob": pytest.approx(0.35),
        "cat": 0.5,
        "dan": pytest.approx(0.35),
    }
    assert list(p.scores) == AGENTS and p.given == 2
    assert p.warnings == [
        "LLM answer scored 2 of 4 agents; the others get the mean of its scores (0.35): bob, dan"
    ]


def test_parse_warns_on_unknown_agents_and_unusable_scores() -> None:
    """An unknown agent and a non-numeric score are each ignored with their own warning; a
    percentage is read and said."""
    p = L.parse_scores('{"ann": 50, "bob": "x", "zed": 1}', ["ann", "bob"])
    assert p.scores == {"ann": 0.5, "bob": 0.5} and p.given == 1
    assert p.warnings[:3] == [
        "LLM score for ann: read 50 as a percentage",
        "LLM score for bob ignored: non-numeric value 'x'",
        "LLM scored an unknown agent 'zed'; ignored",
    ]


def test_parse_an_unknown_agent_first_does_not_end_the_reading() -> None:
    """An unknown agent before the known ones is skipped, not the end of the answer."""
    p = L.parse_scores('{"zed": 1, "ann": 0.5, "bob": 0.25}', ["ann", "bob"])
    assert p.scores == {"ann": 0.5, "bob": 0.25} and p.given == 2
    assert p.warnings == ["LLM scored an unknown agent 'zed'; ignored"]


def test_parse_nothing_usable() -> None:
    """No usable score: empty scores, given 0, not usable, the warning says it was ignored."""
    p = L.parse_scores('{"zed": 0.5}', ["ann"])
    assert (p.scores, p.given, p.usable) == ({}, 0, False)
    assert p.warnings[-1] == "LLM answer held no usable score; the LLM step was ignored"


def test_parse_pairs_from_prose() -> None:
    """Not JSON at all: 'agent: score' or 'agent = score' pairs are read (quoted names, signs,
    percentages), a name inside a longer word is not, and the warning says so."""
    p = L.parse_scores("ann: 0.3, 'bob' = 40%, xcat: 0.9, cats: 0.8, dan=+1", AGENTS)
    assert p.scores["ann"] == 0.3 and p.scores["bob"] == 0.4 and p.scores["dan"] == 1.0
    assert p.given == 3  # cat was not read from "xcat" or "cats"
    assert p.warnings[0] == "LLM answer was not JSON; read 'agent: score' pairs from its text"
    assert L._pairs("ANN: 7", ["ann"]) == {"ann": "7"}
    assert L._pairs("ann: -0.5", ["ann"]) == {"ann": "-0.5"}
    assert L._pairs("bob: 1", ["ann"]) == {}


def test_parsed_is_usable_only_with_a_score() -> None:
    """Parsed.usable is `given > 0`."""
    assert L.Parsed({}, 0).usable is False
    assert L.Parsed({"a": 0.1}, 1).usable is True
