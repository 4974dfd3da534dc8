"""The crew config (YAML) and the prompts built from it."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.heist.config import (
    DEFAULT_ROUNDS,
    AgentSpec,
    HeistConfig,
    load_agents_config,
    parse_agents_config,
)
from engine.heist.mole import Strategy, instructions
from engine.heist.prompts import render_messages, system_prompt
from engine.policies.base import AgentView, ChatLine, Observation

DEFAULT_NAMES = ("planner", "hacker", "safecracker", "intel", "driver", "lookout")


def test_default_crew() -> None:
    """The shipped config has the six agents of the blog, in turn order, with tools."""
    cfg = load_agents_config()
    assert cfg.names == DEFAULT_NAMES
    assert cfg.source == "agents_config.yaml"
    assert DEFAULT_ROUNDS == 4
    for agent in cfg.agents:
        assert agent.role and agent.goal and agent.tools
    assert cfg.agent("safecracker").tools == ("file_reader", "calculator")


def test_default_config_is_package_data() -> None:
    """The default YAML ships inside the package, next to the code that reads it."""
    resource = importlib.resources.files("engine.heist").joinpath("agents_config.yaml")
    assert resource.is_file()
    assert "agents:" in resource.read_text(encoding="utf-8")


def test_user_config_adds_and_removes_agents(tmp_path: Path) -> None:
    """A user file can shrink the crew to two or add new members."""
    path = tmp_path / "crew.yaml"
    path.write_text(
        "agents:\n"
        "  - name: hacker\n    role: r\n    goal: g\n    tools: [file_reader]\n"
        "  - name: forger\n    role: Papers\n    goal: Fake IDs\n    tools: []\n"
    )
    cfg = load_agents_config(path)
    assert cfg.names == ("hacker", "forger") and cfg.source == "crew.yaml"
    assert cfg.agent("forger") == AgentSpec("forger", "Papers", "Fake IDs", ())


def test_config_roundtrips_through_builtins() -> None:
    """The config survives msgspec's to_builtins/convert, as the journal stores it."""
    import msgspec

    cfg = load_agents_config()
    assert msgspec.convert(msgspec.to_builtins(cfg), HeistConfig) == cfg


def _agent(name: str = "a", tools: str = "[calculator]", extra: str = "") -> str:
    return f"  - name: {name}\n    role: r\n    goal: g\n    tools: {tools}\n{extra}"


OK_B = _agent("b")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "agents:\n" + _agent("hacker", "calc") + OK_B,
            "crew.yaml line 5: agent 'hacker': field 'tools' must be a list of tool names, "
            "got 'calc'",
        ),
        (
            "agents:\n" + _agent("hacker", "[calc]") + OK_B,
            "crew.yaml line 5: agent 'hacker': unknown tool 'calc' in field 'tools'; valid tools: "
            "calculator, file_reader, database_query",
        ),
        (
            "agents:\n" + _agent("a", "[calculator, calculator]") + OK_B,
            "line 5: agent 'a': tool 'calculator' is listed twice",
        ),
        ("agents:\n" + _agent("a", "[3]") + OK_B, "line 5: agent 'a': field 'tools' must list"),
        ("agents: [\n", "crew.yaml line 2: invalid YAML: expected the node content"),
        ("agents:\n\t- a\n", "crew.yaml line 2: invalid YAML: found character '\\t'"),
        ("agents:\n  - name: a\n   role: r\n", "crew.yaml line 3: invalid YAML"),
        ("", "crew.yaml: the file is empty"),
        ("# only a comment\n", "crew.yaml: the file is empty"),
        ("- a\n- b\n", "crew.yaml line 1: expected a mapping with 'agents', got a list"),
        ("agents: 3\n", "line 1: field 'agents' must be a list of agents, got 3"),
        ("crew: []\n", "line 1: the top level: unknown field 'crew'; expected agents"),
        ("{}\n", "line 1: field 'agents' is missing"),
        ("agents:\n" + _agent("a"), "crew.yaml line 1: needs at least 2 agents, got 1"),
        ("agents: []\n", "needs at least 2 agents, got 0"),
        (
            "agents:\n" + _agent("a") + _agent("a"),
            "crew.yaml line 6: agent 'a' is defined twice (first on line 2)",
        ),
        (
            "agents:\n" + _agent("a", extra="    tool: [calculator]\n") + OK_B,
            "line 6: agent 'a': unknown field 'tool'; expected name, role, goal, tools",
        ),
        (
            "agents:\n  - name: a\n    role: r\n    tools: []\n" + OK_B,
            "line 2: agent 'a': field 'goal' is missing",
        ),
        (
            "agents:\n  - role: r\n    goal: g\n    tools: []\n" + OK_B,
            "line 2: agent #1: field 'name' is missing",
        ),
        (
            "agents:\n  - name: a\n    role: 3\n    goal: g\n    tools: []\n" + OK_B,
            "line 3: agent 'a': field 'role' must be a string, got 3",
        ),
        (
            "agents:\n  - name: a\n    role:\n    goal: g\n    tools: []\n" + OK_B,
            "line 3: agent 'a': field 'role' must be a string, got nothing",
        ),
        (
            "agents:\n  - name: a\n    role: ' '\n    goal: g\n    tools: []\n" + OK_B,
            "line 3: agent 'a': field 'role' must not be empty",
        ),
        (
            "agents:\n  - name: a\n    role: !!python/object:os.system x\n    goal: g\n"
            "    tools: []\n" + OK_B,
            "line 3: agent 'a': field 'role' must be a string, got a value tagged "
            "'!!python/object:os.system'",
        ),
        (
            "agents:\n  - name: the boss\n    role: r\n    goal: g\n    tools: []\n" + OK_B,
            "line 2: agent #1: field 'name' must be a short identifier",
        ),
        (
            "agents:\n  - name: a\n    name: b\n    role: r\n    goal: g\n    tools: []\n" + OK_B,
            "line 3: agent #1: field 'name' is given twice",
        ),
        ("agents:\n  - just text\n" + OK_B, "line 2: agent #1 must be a mapping"),
    ],
)
def test_bad_configs(text: str, message: str) -> None:
    """Each malformed config is one ConfigError line naming file, line, agent and field."""
    with pytest.raises(ConfigError) as info:
        parse_agents_config(text, "crew.yaml")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_and_binary_files(tmp_path: Path) -> None:
    """A missing file and a non-UTF-8 file are ConfigErrors too."""
    with pytest.raises(ConfigError, match=r"agents config '.*nope\.yaml' not found"):
        load_agents_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(b"agents: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"bin.yaml: not UTF-8 text \(byte 8\)"):
        load_agents_config(bad)


def test_unknown_agent_lookup() -> None:
    """Looking up an agent that is not in the crew fails listing the crew."""
    with pytest.raises(ConfigError, match="unknown agent 'zorro'; agents are: planner, hacker"):
        load_agents_config().agent("zorro")


# --- prompts ------------------------------------------------------------------------------


def test_system_prompt_contents() -> None:
    """The system prompt names the agent, its goal, the crew, its tools and the plan keys."""
    cfg = load_agents_config()
    text = system_prompt(cfg.agent("hacker"), cfg, None)
    assert text.startswith("You are hacker, Security systems specialist")
    assert "camera window" in text
    for name in DEFAULT_NAMES:
        assert f"- {name}: " in text
    assert "[TOOL:file_reader:vault_specs.txt]" in text and "database_query" in text
    assert "[TOOL:calculator:" not in text
    for key in ("guard_gap", "camera_window", "crack_minutes", "entry_time", "exit_time", "route"):
        assert f"- {key}: " in text
    assert "SECRET" not in text


def test_system_prompt_carries_mole_instructions() -> None:
    """Only the mole's prompt carries the secret instructions, appended at the end."""
    cfg = load_agents_config()
    secret = instructions(Strategy.FALSE_INFO)
    text = system_prompt(cfg.agent("intel"), cfg, secret)
    assert text.endswith(secret)
    assert "FALSE_INFO" in text


def test_render_messages() -> None:
    """Messages: system prompt, transcript and own tool results in step order, then the turn."""
    view = AgentView(
        run_id="r",
        step=7,
        round=1,
        agent="safecracker",
        role="Vault and lock expert",
        system_prompt="SYSTEM",
        agents=DEFAULT_NAMES,
        transcript=(
            ChatLine(1, "hacker", "hello"),
            ChatLine(2, "safecracker", "[TOOL:calculator:50*2] [TOOL:calculator:1/0]"),
            ChatLine(3, "intel", "ok"),
        ),
        observations=(
            Observation(2, "calculator", "50*2", True, "100"),
            Observation(2, "calculator", "1/0", False, "division by zero"),
        ),
        rounds=4,
    )
    messages = render_messages(view)
    assert messages == [
        {"role": "system", "content": "SYSTEM"},
        {"role": "user", "content": "hacker: hello"},
        {"role": "user", "content": "safecracker: [TOOL:calculator:50*2] [TOOL:calculator:1/0]"},
        {"role": "user", "content": "TOOL RESULT calculator(50*2): 100"},
        {"role": "user", "content": "TOOL RESULT calculator(1/0): FAILED: division by zero"},
        {"role": "user", "content": "intel: ok"},
        {
            "role": "user",
            "content": "Reply as safecracker (round 2 of 4). Call tools with [TOOL:name:param] "
            "and state plan facts with [PLAN:key=value].",
        },
    ]
    assert render_messages(view) == messages
