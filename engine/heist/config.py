"""The crew of a heist, read from YAML (`agents_config.yaml` ships as the default).

A user file has the same shape as the default::

    agents:
      - name: hacker
        role: Security systems specialist
        goal: Find when the vault-corridor camera is offline
        tools: [file_reader, database_query]

Every problem becomes one `ConfigError` line naming the file, the line, the agent and the
field, e.g. ``crew.yaml line 7: agent 'hacker': field 'tools' must be a list of tool names,
got 'calc'``. The YAML is composed into nodes (never constructed into objects), so tags such
as ``!!python/object`` are only ever rejected as "not a string".
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

import msgspec

from engine.errors import ConfigError
from engine.events import not_journalable_text
from engine.heist.tools import TOOL_NAMES

if TYPE_CHECKING:
    # imported at run time where a crew is parsed: ~8 ms of every start-up else
    import yaml

DEFAULT_CONFIG_NAME = "agents_config.yaml"
DEFAULT_ROUNDS = 4  # rounds of round-robin turns in a default heist (6 agents -> 24 steps)
MIN_AGENTS = 2
MAX_TEXT_CHARS = 1000

_FIELDS = ("name", "role", "goal", "tools")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
_STR = "tag:yaml.org,2002:str"
_CORE_TAGS = frozenset({"str", "int", "float", "bool", "null", "seq", "map", "timestamp"})


class AgentSpec(msgspec.Struct, frozen=True):
    """One crew member as configured."""

    name: str
    role: str
    goal: str
    tools: tuple[str, ...]


class HeistConfig(msgspec.Struct, frozen=True):
    """The crew in turn order; `source` names the file it came from."""

    agents: tuple[AgentSpec, ...]
    source: str = DEFAULT_CONFIG_NAME

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.agents)

    def agent(self, name: str) -> AgentSpec:
        for a in self.agents:
            if a.name == name:
                return a
        raise ConfigError(f"unknown agent {name!r}; agents are: {', '.join(self.names)}")


def load_agents_config(path: str | Path | None = None) -> HeistConfig:
    """Load the crew from `path`, or the default crew shipped with the package."""
    if path is None:
        return _default_config()
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"agents config {str(p)!r} not found") from None
    except OSError as e:
        raise ConfigError(f"cannot read agents config {str(p)!r}: {e.strerror}") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p.name}: not UTF-8 text (byte {e.start})") from e
    return parse_agents_config(text, p.name)


@functools.cache
def _default_config() -> HeistConfig:
    # Parsed once per process: the shipped file cannot change under a running engine.
    resource = importlib.resources.files("engine.heist").joinpath(DEFAULT_CONFIG_NAME)
    return parse_agents_config(resource.read_text(encoding="utf-8"), DEFAULT_CONFIG_NAME)


def parse_agents_config(text: str, source: str = "<string>") -> HeistConfig:
    """Parse and validate a crew definition; `source` is used in error messages."""
    import yaml

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = e.problem or e.context or "invalid YAML"
        raise ConfigError(f"{source}{where}: invalid YAML: {problem}") from e
    except yaml.YAMLError as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{source}: invalid YAML: {detail}") from e
    except RecursionError as e:
        # PyYAML's scanner and composer recurse once per level of `[[[...]]]`; a crew is two
        # levels deep, so this is never a crew
        raise ConfigError(f"{source}: invalid YAML: nested too deeply") from e
    return _Validator(source).config(root)


# PyYAML's node kinds by their `id`, so that the validator needs no import of yaml
def _is_mapping(node: yaml.Node) -> TypeGuard[yaml.MappingNode]:
    return getattr(node, "id", None) == "mapping"


def _is_sequence(node: yaml.Node) -> TypeGuard[yaml.SequenceNode]:
    return getattr(node, "id", None) == "sequence"


def _is_scalar(node: yaml.Node) -> TypeGuard[yaml.ScalarNode]:
    return getattr(node, "id", None) == "scalar"


class _Validator:
    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, node: yaml.Node | None, message: str) -> ConfigError:
        where = f" line {node.start_mark.line + 1}" if node is not None else ""
        return ConfigError(f"{self.source}{where}: {message}")

    def config(self, root: yaml.Node | None) -> HeistConfig:
        if root is None:
            raise self.error(None, "the file is empty; expected a mapping with 'agents'")
        if not _is_mapping(root):
            raise self.error(root, f"expected a mapping with 'agents', got {_show(root)}")
        fields = self.mapping(root, "the top level", ("agents",))
        if "agents" not in fields:
            raise self.error(root, "field 'agents' is missing")
        key_node, seq = fields["agents"]
        if not _is_sequence(seq):
            raise self.error(seq, f"field 'agents' must be a list of agents, got {_show(seq)}")
        agents: list[AgentSpec] = []
        seen: dict[str, int] = {}
        for i, node in enumerate(seq.value, start=1):
            spec = self.agent(node, i)
            if spec.name in seen:
                raise self.error(
                    node, f"agent {spec.name!r} is defined twice (first on line {seen[spec.name]})"
                )
            seen[spec.name] = node.start_mark.line + 1
            agents.append(spec)
        if len(agents) < MIN_AGENTS:
            raise self.error(key_node, f"needs at least {MIN_AGENTS} agents, got {len(agents)}")
        return HeistConfig(agents=tuple(agents), source=self.source)

    def mapping(
        self, node: yaml.MappingNode, what: str, allowed: tuple[str, ...]
    ) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        out = self.fields(node, what)
        for key, (key_node, _) in out.items():
            if key not in allowed:
                raise self.error(
                    key_node, f"{what}: unknown field {key!r}; expected {', '.join(allowed)}"
                )
        return out

    def fields(self, node: yaml.MappingNode, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            if not _is_scalar(key_node) or key_node.tag != _STR:
                raise self.error(
                    key_node, f"{what}: field names must be text, got {_show(key_node)}"
                )
            key = key_node.value
            if key in out:
                raise self.error(key_node, f"{what}: field {key!r} is given twice")
            out[key] = (key_node, value_node)
        return out

    def agent(self, node: yaml.Node, index: int) -> AgentSpec:
        what = f"agent #{index}"
        if not _is_mapping(node):
            raise self.error(node, f"{what} must be a mapping of {', '.join(_FIELDS)}")
        fields = self.fields(node, what)
        if "name" in fields:
            name_node = fields["name"][1]
            name = self.text(name_node, what, "name")
            if not _NAME.match(name):
                raise self.error(
                    name_node,
                    f"{what}: field 'name' must be a short identifier (a letter, then letters, "
                    f"digits, _ or -; at most 32), got {name!r}",
                )
            what = f"agent {name!r}"
        self.mapping(node, what, _FIELDS)
        for field in _FIELDS:
            if field not in fields:
                raise self.error(node, f"{what}: field {field!r} is missing")
        role = self.text(fields["role"][1], what, "role")
        goal = self.text(fields["goal"][1], what, "goal")
        tools = self.tools(fields["tools"][1], what)
        return AgentSpec(name=name, role=role, goal=goal, tools=tools)

    def text(self, node: yaml.Node, what: str, field: str) -> str:
        if not _is_scalar(node) or node.tag != _STR:
            raise self.error(node, f"{what}: field {field!r} must be a string, got {_show(node)}")
        value = str(node.value).strip()
        if not value:
            raise self.error(node, f"{what}: field {field!r} must not be empty")
        problem = not_journalable_text(value)
        if problem is not None:
            # a YAML escape such as "\ud800" yields a lone surrogate: the journal could never
            # record this crew
            raise self.error(node, f"{what}: field {field!r} is {problem}")
        if len(value) > MAX_TEXT_CHARS:
            raise self.error(
                node, f"{what}: field {field!r} is longer than {MAX_TEXT_CHARS} characters"
            )
        return value

    def tools(self, node: yaml.Node, what: str) -> tuple[str, ...]:
        if not _is_sequence(node):
            raise self.error(
                node, f"{what}: field 'tools' must be a list of tool names, got {_show(node)}"
            )
        tools: list[str] = []
        for item in node.value:
            if not _is_scalar(item) or item.tag != _STR:
                raise self.error(
                    item, f"{what}: field 'tools' must list tool names, got {_show(item)}"
                )
            if item.value not in TOOL_NAMES:
                raise self.error(
                    item,
                    f"{what}: unknown tool {item.value!r} in field 'tools'; "
                    f"valid tools: {', '.join(TOOL_NAMES)}",
                )
            if item.value in tools:
                raise self.error(item, f"{what}: tool {item.value!r} is listed twice")
            tools.append(item.value)
        return tuple(tools)


def _show(node: yaml.Node) -> str:
    """A short description of a node for error messages: the scalar itself, or its kind."""
    std = "tag:yaml.org,2002:"
    if not node.tag.startswith(std) or node.tag[len(std) :] not in _CORE_TAGS:
        return f"a value tagged {node.tag.replace(std, '!!')!r}"
    if _is_scalar(node):
        if node.tag == "tag:yaml.org,2002:null":
            return "nothing"
        text = node.value if len(node.value) <= 40 else node.value[:40] + "..."
        return repr(text) if node.tag == _STR else text
    if _is_sequence(node):
        return "a list"
    return "a mapping"
