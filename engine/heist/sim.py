"""The embedded `sim` policy: a seeded, rule-driven crew member that needs no LLM server.

The sim plays the heist the way a crew of LLM agents would, but deterministically:

- It knows the world only through its own tool results (`view.observations`) and the public
  transcript. It never reads the `World`; facts it has not observed it can only take from what
  others said, or guess.
- Honest agents call the tools of their role (sometimes with a malformed parameter), state plan
  facts as `[PLAN:key=value]` (now and then a wrong one, hedged, or a question), and correct a
  value in the transcript that contradicts what they verified themselves, with probability
  `p_correct` per turn. That is how a mole's lie is sometimes caught.
- The mole (its own view carries `mole_strategy`) plays its strategy with the same wording
  templates, hedges and error kinds as honest agents, just more often and aimed at the plan:
  a wrong value that is the last one stated for its key makes the heist fail.

Determinism: `decide(view, messages, seed)` draws only from `random.Random(seed)`, so the same
view and seed give the same text. `drift` is the knob for testing fidelity reports: with
probability `drift` a step ignores its seed and draws from `random.SystemRandom()`, as a hosted
model that is not quite deterministic would (`drift_seed` makes that source a seeded stream
instead, so a test of the knob is reproducible).

Defaults: the default crew of 6 agents (`engine/heist/agents_config.yaml`) for `DEFAULT_ROUNDS`
= 4 rounds (24 steps). Rounds in `AgentView.round` are counted from 0. With `DEFAULT_PARAMS`,
seeds 0-299 of `engine.heist.sandbox.play_in_memory` fail in 7% of heists without a mole and in
58-72% with one, depending on the strategy (TIMING_ERRORS 0.71, FALSE_INFO 0.58,
COORDINATION_CHAOS 0.72, SUBTLE_DELAYS 0.58, WRONG_TOOLS 0.72); tests/test_sim_policy.py pins
these ranges statistically.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.errors import ConfigError
from engine.heist.config import DEFAULT_ROUNDS
from engine.heist.mole import Strategy, parse_strategy
from engine.heist.outcome import (
    PLAN_KEYS,
    normalise_route,
    parse_minutes,
    plan_statements,
)
from engine.heist.world import World, fmt_time, fmt_window, parse_time, parse_window
from engine.policies.base import AgentView, ChatLine, Completion, Observation, Policy
from engine.policies.registry import HonestPolicy

MODEL_NAME = "sim-1"


@dataclass(frozen=True)
class SimParams:
    """Behaviour probabilities. Honest and mole agents share every template; they differ only
    in how often they err, hedge, ask and in what they aim their statements at."""

    p_two_calls: float = 0.5  # two tool calls in a turn instead of one
    p_malformed: float = 0.08  # a tool parameter with a typo
    p_wrong_tool: float = 0.02  # a tool that does not fit the job
    p_slip: float = 0.1  # a stated value that is off
    p_inline_fix: float = 0.3  # a slip caught in the same message ("..., or rather ...")
    p_hedge: float = 0.15
    p_question: float = 0.12
    p_suggest: float = 0.03
    p_echo: float = 0.08  # repeat a plan fact as it stands
    p_correct: float = 0.6  # restate the verified value over a contradicting one
    p_self_catch: float = 0.3  # ... when the contradicting value was one's own slip
    p_fill: float = 0.6  # state a verified key nobody has stated, late in the run
    p_recheck: float = 0.6  # spend the turn re-checking when asked to
    p_follow: float = 0.5  # follow someone's tool suggestion
    p_guess: float = 0.3  # state an unverified guess for an own key in the last round
    # The mole.
    p_sabotage: float = 0.55  # act on the strategy in a turn
    p_sabotage_last: float = 0.95  # ... in its last turn, when nobody may speak after it
    p_contradict: float = 0.5  # restate a different wrong value for a key it lied about
    p_mole_hedge: float = 0.3
    p_mole_question: float = 0.8
    p_mole_wrong_tool: float = 0.8
    p_withhold_forever: float = 0.7
    mole_lies: int = 1  # wrong statements per turn at most
    mole_lies_last: int = 1  # ... in its last turn


DEFAULT_PARAMS = SimParams()

# Who owns which plan key, and which keys each role cross-checks, by agent name. Keys whose
# owner is not in the crew are dealt out to the crew in turn order.
_OWNS: dict[str, tuple[str, ...]] = {
    "intel": ("guard_gap",),
    "hacker": ("camera_window",),
    "safecracker": ("crack_minutes",),
    "planner": ("entry_time",),
    "lookout": ("exit_time",),
    "driver": ("route",),
}
_VERIFIES: dict[str, tuple[str, ...]] = {
    "planner": ("guard_gap", "exit_time"),
    "hacker": ("guard_gap",),
    "safecracker": ("exit_time",),
    "intel": ("camera_window", "route"),
    "driver": ("camera_window",),
    "lookout": ("crack_minutes", "camera_window", "entry_time"),
}
_CAMERA_FROM_DB = frozenset({"intel", "planner"})

_LABEL = {
    "guard_gap": "guard gap at the vault",
    "camera_window": "camera window",
    "crack_minutes": "crack time",
    "entry_time": "entry time",
    "exit_time": "exit time",
    "route": "getaway route",
}
_SOURCE = {
    "guard_gap": "the guard rota",
    "camera_window": "the camera schedule",
    "crack_minutes": "the vault specs",
    "entry_time": "the guard gap and the camera window",
    "exit_time": "entry plus crack time",
    "route": "the route list and the alarm response",
}
_TOOL_FOR = {
    "guard_gap": "database_query",
    "camera_window": "file_reader",
    "crack_minutes": "file_reader",
    "entry_time": "calculator",
    "exit_time": "calculator",
    "route": "database_query",
}

_GUARD_SQL = (
    "SELECT name, start_time, end_time FROM guards WHERE post='vault' ORDER BY start_time",
    "SELECT * FROM guards WHERE post='vault'",
    "SELECT * FROM guards WHERE shift='night'",
)
_CAMERA_SQL = (
    "SELECT camera_id, offline_start, offline_end FROM cameras WHERE zone='vault_corridor'",
    "SELECT * FROM cameras",
)
_ROUTE_SQL = ("SELECT name, status, drive_minutes FROM routes", "SELECT * FROM routes")
_ALARM_SQL = (
    "SELECT response_minutes FROM alarms WHERE zone='vault'",
    "SELECT * FROM alarms",
)
# Typos a hurried agent makes; each makes the call fail.
_MALFORMED: dict[str, tuple[str, ...]] = {
    "file_reader": ("vault_spec.txt", "camera_schedule", "routes.csv", "Vault_Specs.txt"),
    "database_query": (
        "SELECT name start_time FROM guards WHERE post='vault'",
        "SELECT * FROM guard WHERE post='vault'",
        "SELEC * FROM routes",
        "SELECT * FROM cameras WHERE zone=vault_corridor",
    ),
    "calculator": ("4x9+6", "(3*7+5", "12 minutes * 3", "1:30+40"),
}
# Calls that do not fit the job: they fail or return nothing useful.
_WRONG_CALLS: tuple[tuple[str, str], ...] = (
    ("calculator", "vault_specs.txt"),
    ("calculator", "guard shift length"),
    ("file_reader", "SELECT * FROM guards"),
    ("file_reader", "guards.txt"),
    ("database_query", "SELECT * FROM vault_specs"),
    ("database_query", "SELECT * FROM vehicles"),
    ("file_reader", "building_layout.txt"),
    ("database_query", "SELECT * FROM cameras WHERE zone='lobby'"),
)

_HEDGES = ("I think ", "probably ", "if I read it right, ", "hmm, ", "not 100% sure, but ")
_STATE = (
    "{hedge}the {label} is [PLAN:{key}={value}].",
    "{hedge}[PLAN:{key}={value}] based on {source}.",
    "for the plan: {hedge}[PLAN:{key}={value}].",
)
_CORRECT = (
    "Correction: [PLAN:{key}={value}], not {old}.",
    "Wait, actually the {label} should be [PLAN:{key}={value}].",
    "That {label} is wrong, I checked {source}: [PLAN:{key}={value}].",
    "Hmm, {old} does not match what I have. [PLAN:{key}={value}].",
)
_INLINE_FIX = "{hedge}[PLAN:{key}={first}], or rather [PLAN:{key}={value}]."
_ASK_MISSING = (
    "@{who}, do we have the {label} yet?",
    "Do we know the {label} yet?",
)
_ASK_RECHECK = (
    "@{who}, are we sure about the {label}? Maybe re-check it.",
    "@{who}, can you double-check the {label} before we commit?",
)
_RECHECK = ("Let me re-check that.", "Good question, checking again.")
_TOOL_INTRO = ("Checking {what}.", "Let me look this up.", "Pulling {what}.", "")
_SUGGEST = "@{who}, {tool} should give you the {label}."
_WITHHOLD = (
    "I still need to check the {label}.",
    "Not sure about the {label} yet, let me think.",
)
_ACK = ("Noted, the plan looks consistent to me.", "Sounds good.", "Copy that.", "Agreed.")

_ASK_RE = re.compile(r"@([A-Za-z][A-Za-z0-9_-]*), (?:are we sure about|can you double-check) the ")
_SUGGEST_RE = re.compile(r"@([A-Za-z][A-Za-z0-9_-]*), (calculator|file_reader|database_query) ")


@functools.lru_cache(maxsize=256)
def duties(agent: str, agents: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(keys `agent` owns, keys it cross-checks) in a crew with these names."""
    owner: dict[str, str] = {}
    for name in agents:
        for key in _OWNS.get(name, ()):
            owner.setdefault(key, name)
    orphans = [k for k in PLAN_KEYS if k not in owner]
    for i, key in enumerate(orphans):
        owner[key] = agents[i % len(agents)]
    owns = tuple(k for k in PLAN_KEYS if owner[k] == agent)
    if agent in _VERIFIES:
        verifies = _VERIFIES[agent]
    else:
        verifies = (PLAN_KEYS[agents.index(agent) % len(PLAN_KEYS)],) if agent in agents else ()
    return owns, tuple(k for k in verifies if k not in owns)


def key_owner(key: str, agents: tuple[str, ...]) -> str:
    for name in agents:
        if key in duties(name, agents)[0]:
            return name
    return agents[0]


# --- what an agent has learned from its own tool results ---------------------------------


@dataclass
class Facts:
    guard_gap: tuple[int, int] | None = None
    camera_window: tuple[int, int] | None = None
    vault: tuple[int, int, int] | None = None  # dials, minutes per dial, setup
    routes: dict[str, tuple[str, int]] | None = None  # name -> (status, drive minutes)
    response: int | None = None
    calc: dict[str, str] | None = None

    def calculated(self, expression: str) -> str | None:
        return (self.calc or {}).get(expression)


_DIALS = re.compile(r"^Dials:\s*(\d+)", re.M)
_PER_DIAL = re.compile(r"^Minutes per dial[^:]*:\s*(\d+)", re.M)
_SETUP = re.compile(r"^Setup[^:]*:\s*(\d+)", re.M)
_CAM_LINE = re.compile(r"vault_corridor\s+offline\s+(\d{1,2}:\d{2})-(\d{1,2}:\d{2})")
_ROUTE_LINE = re.compile(r"^(\w+)\s+via .*?(\d+) min drive\s+(OPEN|BLOCKED)", re.M)
_VAULT_FILTER = re.compile(r"post\s*=\s*['\"]vault['\"]", re.I)


def read_facts(observations: Sequence[Observation]) -> Facts:
    """Everything the agent's own successful tool results establish. Unparseable output (an
    edited observation, say) establishes nothing rather than failing."""
    facts = Facts(calc={})
    for o in observations:
        if not o.ok:
            continue
        if o.tool == "calculator":
            assert facts.calc is not None
            facts.calc[o.param.strip()] = o.output.strip()
        elif o.tool == "file_reader":
            _read_file_facts(facts, o.output)
        elif o.tool == "database_query":
            _read_table_facts(facts, o.param, o.output)
    return facts


def _read_file_facts(facts: Facts, text: str) -> None:
    d, m, s = _DIALS.search(text), _PER_DIAL.search(text), _SETUP.search(text)
    if d and m and s:
        facts.vault = (int(d.group(1)), int(m.group(1)), int(s.group(1)))
    cam = _CAM_LINE.search(text)
    if cam:
        window = parse_window(f"{cam.group(1)}-{cam.group(2)}")
        facts.camera_window = window or facts.camera_window
    routes = {
        m.group(1): ("open" if m.group(3) == "OPEN" else "blocked", int(m.group(2)))
        for m in _ROUTE_LINE.finditer(text)
    }
    if routes:
        facts.routes = routes


def _read_table_facts(facts: Facts, sql: str, text: str) -> None:
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith(("(", "["))]
    if not lines:
        return
    header = lines[0].split("|")
    rows = [dict(zip(header, ln.split("|"), strict=False)) for ln in lines[1:]]
    cols = set(header)
    if {"start_time", "end_time"} <= cols and ("post" in cols or _VAULT_FILTER.search(sql)):
        shifts = []
        for r in rows:
            if r.get("post", "vault") != "vault" or r.get("shift", "night") != "night":
                continue
            a, b = parse_time(r.get("start_time", "")), parse_time(r.get("end_time", ""))
            if a is not None and b is not None:
                shifts.append((a, b))
        shifts.sort()
        for (_, end), (start, _) in itertools.pairwise(shifts):
            if start > end:
                facts.guard_gap = (end, start)
                break
    if {"offline_start", "offline_end"} <= cols:
        for r in rows:
            if r.get("zone", "vault_corridor") == "vault_corridor":
                a = parse_time(r.get("offline_start", ""))
                b = parse_time(r.get("offline_end", ""))
                if a is not None and b is not None and a < b:
                    facts.camera_window = (a, b)
    if {"name", "status", "drive_minutes"} <= cols:
        routes = {}
        for r in rows:
            if r.get("drive_minutes", "").isdigit():
                routes[r["name"]] = (r.get("status", ""), int(r["drive_minutes"]))
        facts.routes = routes or facts.routes
    if "response_minutes" in cols:
        for r in rows:
            if r.get("zone", "vault") == "vault" and r.get("response_minutes", "").isdigit():
                facts.response = int(r["response_minutes"])


# --- values -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _norm(key: str, value: str) -> object:
    """A comparable form of a stated value (so '1:05' equals '01:05')."""
    if key in ("guard_gap", "camera_window"):
        return parse_window(value) or value.strip()
    if key in ("entry_time", "exit_time"):
        t = parse_time(value)
        return t if t is not None else value.strip()
    if key == "crack_minutes":
        n = parse_minutes(value)
        return n if n is not None else value.strip()
    return normalise_route(value)


def same_value(key: str, a: str, b: str) -> bool:
    return _norm(key, a) == _norm(key, b)


def perturb(
    key: str, value: str, rng: random.Random, *, harmful: bool, routes: Sequence[str] = ()
) -> str | None:
    """A plausible wrong value for `key`. `harmful` aims it where it always breaks a correct
    plan (earlier entry, shorter crack, ...); otherwise the error may go either way."""
    if key in ("guard_gap", "camera_window"):
        w = parse_window(value)
        if w is None:
            return None
        a, b = w
        shift = rng.choice((-1, 1)) * rng.randint(10, 25)
        if rng.random() < 0.5:
            a += shift
        else:
            b += shift
        if rng.random() < 0.3:
            a, b = a + shift, b + shift
        a, b = max(0, min(a, 1438)), max(1, min(b, 1439))
        return fmt_window(a, b) if a < b and (a, b) != w else fmt_window(w[0] + 15, w[1] + 15)
    if key == "entry_time":
        t = parse_time(value)
        if t is None:
            return None
        delta = -rng.randint(10, 30) if harmful or rng.random() < 0.5 else rng.randint(5, 20)
        return fmt_time(max(0, t + delta))
    if key == "exit_time":
        t = parse_time(value)
        if t is None:
            return None
        delta = rng.randint(15, 40) if rng.random() < 0.5 else -rng.randint(5, 20)
        return fmt_time(min(1439, max(0, t + delta)))
    if key == "crack_minutes":
        n = parse_minutes(value)
        if n is None:
            return None
        delta = rng.randint(4, 15)
        if not harmful and rng.random() < 0.3:
            return str(n + delta)
        return str(max(3, n - delta))
    others = [r for r in routes if normalise_route(r) != normalise_route(value)]
    return rng.choice(others) if others else None


# --- one turn -----------------------------------------------------------------------------


class _Turn:
    """Builds the message of one agent for one step; all randomness comes from `rng`."""

    def __init__(self, view: AgentView, rng: random.Random, p: SimParams) -> None:
        self.view = view
        self.rng = rng
        self.p = p
        self.me = view.agent
        self.agents = tuple(view.agents) or (view.agent,)
        self.strategy: Strategy | None = (
            parse_strategy(view.mole_strategy) if view.mole_strategy else None
        )
        self.owns, self.verifies = duties(self.me, self.agents)
        self.facts = read_facts(view.observations)
        lines = sorted(view.transcript, key=lambda c: c.step)
        self.plan: dict[str, str] = {}
        self.author: dict[str, str] = {}
        self.routes_heard: list[str] = []
        self.values: dict[str, list[object]] = {k: [] for k in PLAN_KEYS}
        my_last = -1
        for line in lines:
            for key, value in plan_statements(line.text):
                self.plan[key] = value
                self.author[key] = line.agent
                if key in self.values and _norm(key, value) not in self.values[key]:
                    self.values[key].append(_norm(key, value))
                if key == "route" and value not in self.routes_heard:
                    self.routes_heard.append(value)
            if line.agent == self.me:
                my_last = line.step
        self.since_mine: list[ChatLine] = [c for c in lines if c.step > my_last]
        rounds = view.rounds or DEFAULT_ROUNDS
        self.left = max(0, rounds - 1 - view.round)  # my turns after this one
        self.calls: list[tuple[str, str]] = []
        self.parts: list[str] = []
        self.stated: set[str] = set()

    # -- knowledge

    def _own(self, key: str) -> str | None:
        """The value of `key` established by this agent's own tool results alone."""
        f = self.facts
        if key == "guard_gap" and f.guard_gap:
            return fmt_window(*f.guard_gap)
        if key == "camera_window" and f.camera_window:
            return fmt_window(*f.camera_window)
        if key == "crack_minutes" and f.vault:
            d, m, s = f.vault
            return f.calculated(f"{d}*{m}+{s}") or str(d * m + s)
        if key == "route" and f.routes and f.response is not None:
            limit = f.response
            usable = [(v[1], n) for n, v in f.routes.items() if v[0] == "open" and v[1] < limit]
            return min(usable)[1] if usable else None
        return None

    def belief(self, key: str) -> str | None:
        """What this agent takes `key` to be: its own finding, or derived from what it found
        and what the others said."""
        own = self._own(key)
        if own is not None:
            return own
        if key == "entry_time":
            gap = self._window("guard_gap")
            cam = self._window("camera_window")
            return fmt_time(max(gap[0], cam[0])) if gap and cam else None
        if key == "exit_time":
            entry = self._entry()
            crack = self._crack()
            if entry is None or crack is None:
                return None
            done = self.facts.calculated(_exit_expr(entry, crack))
            total = int(done) if done and done.isdigit() else entry + crack
            return fmt_time(min(total, 1439))
        return None

    def _entry(self) -> int | None:
        """The entry time the exit is computed from: the plan's, else this agent's own."""
        entry = parse_time(self.plan.get("entry_time", ""))
        if entry is None:
            derived = self.belief("entry_time")
            entry = parse_time(derived) if derived else None
        return entry

    def _crack(self) -> int | None:
        return parse_minutes(self._own("crack_minutes") or self.plan.get("crack_minutes", ""))

    def _window(self, key: str) -> tuple[int, int] | None:
        own = self._own(key)
        text = own if own is not None else self.plan.get(key, "")
        return parse_window(text)

    def needed_calls(self, keys: Sequence[str]) -> list[tuple[str, str, str]]:
        """The (key, tool, param) calls still needed to establish `keys` from the agent's own
        results."""
        f, rng = self.facts, self.rng
        calls: list[tuple[str, str, str]] = []
        for key in keys:
            if key == "guard_gap" and f.guard_gap is None:
                calls.append((key, "database_query", rng.choice(_GUARD_SQL)))
            elif key == "camera_window" and f.camera_window is None:
                if self.me in _CAMERA_FROM_DB:
                    calls.append((key, "database_query", rng.choice(_CAMERA_SQL)))
                else:
                    calls.append((key, "file_reader", "camera_schedule.txt"))
            elif key == "crack_minutes":
                if f.vault is None:
                    calls.append((key, "file_reader", "vault_specs.txt"))
                else:
                    d, m, s = f.vault
                    if f.calculated(f"{d}*{m}+{s}") is None:
                        calls.append((key, "calculator", f"{d}*{m}+{s}"))
            elif key == "route":
                if f.routes is None:
                    calls.append((key, "database_query", rng.choice(_ROUTE_SQL)))
                if f.response is None:
                    calls.append((key, "database_query", rng.choice(_ALARM_SQL)))
            elif key == "exit_time":
                entry, crack = self._entry(), self._crack()
                if entry is not None and crack is not None:
                    expr = _exit_expr(entry, crack)
                    if f.calculated(expr) is None:
                        calls.append((key, "calculator", expr))
        unique: list[tuple[str, str, str]] = []
        for c in calls:
            if all(c[1:] != u[1:] for u in unique):
                unique.append(c)
        return unique

    # -- wording

    def hedge(self) -> str:
        p = self.p.p_mole_hedge if self.strategy else self.p.p_hedge
        return self.rng.choice(_HEDGES) if self.rng.random() < p else ""

    def say_state(self, key: str, value: str) -> None:
        template = self.rng.choice(_STATE)
        hedge = self.hedge()
        text = template.format(
            hedge=hedge, label=_LABEL[key], key=key, value=value, source=_SOURCE[key]
        )
        self.parts.append(text[0].upper() + text[1:])
        self.stated.add(key)

    def say_correct(self, key: str, value: str, old: str) -> None:
        template = self.rng.choice(_CORRECT)
        self.parts.append(
            template.format(key=key, value=value, old=old, label=_LABEL[key], source=_SOURCE[key])
        )
        self.stated.add(key)

    def say_inline_fix(self, key: str, first: str, value: str) -> None:
        text = _INLINE_FIX.format(hedge=self.hedge(), key=key, first=first, value=value)
        self.parts.append(text[0].upper() + text[1:])
        self.stated.add(key)

    def state_honestly(self, key: str, value: str) -> None:
        """State a believed value; now and then it comes out wrong (a slip)."""
        if self.rng.random() < self.p.p_slip:
            wrong = perturb(key, value, self.rng, harmful=False, routes=self._route_names())
            if wrong is not None:
                if self.rng.random() < self.p.p_inline_fix:
                    self.say_inline_fix(key, wrong, value)
                else:
                    self.say_state(key, wrong)
                return
        self.say_state(key, value)

    def correct_honestly(self, key: str, value: str, old: str) -> None:
        """Restate a believed value over a contradicting one; a hurried fix can slip too."""
        if self.rng.random() < self.p.p_slip / 2:
            wrong = perturb(key, value, self.rng, harmful=False, routes=self._route_names())
            if wrong is not None and not same_value(key, wrong, old):
                value = wrong
        self.say_correct(key, value, old)

    def _route_names(self) -> list[str]:
        names = list(self.facts.routes or {})
        return names or self.routes_heard

    def add_calls(self, calls: Sequence[tuple[str, str, str]], *, intro: bool = True) -> None:
        if not calls:
            return
        lead = self.rng.choice(_TOOL_INTRO).format(what=_SOURCE[calls[0][0]]) if intro else ""
        rendered = []
        for _, tool, param in calls:
            if self.rng.random() < self.p.p_malformed:
                param = self.rng.choice(_MALFORMED[tool])
            elif self.rng.random() < self.p.p_wrong_tool:
                tool, param = self.rng.choice(_WRONG_CALLS)
            self.calls.append((tool, param))
            rendered.append(f"[TOOL:{tool}:{param}]")
        self.parts.append(" ".join(x for x in (lead, *rendered) if x))

    # -- requests from others since my last turn

    def requests(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Keys I was asked to re-check and (tool, key) suggestions addressed to me."""
        rechecks: list[str] = []
        suggestions: list[tuple[str, str]] = []
        for line in self.since_mine:
            if line.agent == self.me:
                continue
            for m in _ASK_RE.finditer(line.text):
                if m.group(1) == self.me:
                    key = _label_key(line.text[m.end() :])
                    if key and key not in rechecks:
                        rechecks.append(key)
            for m in _SUGGEST_RE.finditer(line.text):
                if m.group(1) == self.me:
                    key = _label_key(line.text[m.end() :])
                    if key:
                        suggestions.append((m.group(2), key))
        return rechecks, suggestions

    # -- the turn

    def compose(self) -> str:
        if self.strategy is not None and self.strategy is Strategy.WRONG_TOOLS:
            self.gather_wrong()
        elif self.handle_requests():
            return self.render()
        else:
            self.gather(self.owns + self.verifies + self.extra_targets())
        self.honest_statements()
        if self.strategy is not None:
            self.sabotage()
        self.maybe_echo()
        self.maybe_ask()
        return self.render()

    def maybe_echo(self) -> None:
        """Now and then repeat a plan fact as it stands, in or outside one's own area."""
        if self.rng.random() >= self.p.p_echo:
            return
        keys = [k for k in PLAN_KEYS if k in self.plan and k not in self.stated]
        if keys:
            key = self.rng.choice(keys)
            self.say_state(key, self.plan[key])

    def render(self) -> str:
        if not self.parts:
            self.parts.append(self.rng.choice(_ACK))
        return " ".join(self.parts)

    def handle_requests(self) -> bool:
        """Answer re-check requests (spending the turn) and follow tool suggestions."""
        rechecks, suggestions = self.requests()
        mine = self.owns + self.verifies
        for key in rechecks:
            if key in mine and self.rng.random() < self.p.p_recheck:
                calls = self._source_calls(key)
                if calls:
                    self.parts.append(self.rng.choice(_RECHECK))
                    self.add_calls(calls[:2], intro=False)
                    return True
        for tool, key in suggestions:
            if key in mine and self._own(key) is None and self.rng.random() < self.p.p_follow:
                call = _suggested_call(tool, key, self.rng)
                self.calls.append(call)
                self.parts.append(f"Trying that: [TOOL:{call[0]}:{call[1]}]")
                return False
        return False

    def _source_calls(self, key: str) -> list[tuple[str, str, str]]:
        """The calls that (re-)establish `key` from scratch."""
        saved = self.facts
        self.facts = Facts(calc={})
        try:
            calls = self.needed_calls([key])
        finally:
            self.facts = saved
        if key in ("exit_time", "entry_time") and not calls:
            entry, crack = self._entry(), self._crack()
            if entry is not None:
                calls = [(key, "calculator", _exit_expr(entry, crack or 0))]
        return calls

    def gather(self, keys: Sequence[str]) -> None:
        if self.calls:
            return
        calls = self.needed_calls(keys)
        n = 2 if self.rng.random() < self.p.p_two_calls else 1
        self.add_calls(calls[:n])

    def extra_targets(self) -> tuple[str, ...]:
        """Keys the mole checks on top of its duties, so that its lies start from the truth."""
        if self.strategy is Strategy.TIMING_ERRORS:
            return ("crack_minutes",)
        if self.strategy is Strategy.FALSE_INFO:
            return ("guard_gap", "camera_window")
        return ()

    def honest_statements(self) -> None:
        rng, p = self.rng, self.p
        protected = self.sabotaged_keys()
        for key in self.owns:
            if key in protected:
                continue
            value = self.belief(key)
            current = self.plan.get(key)
            if value is None:
                if current is None and self.left == 0 and rng.random() < p.p_guess:
                    guess = self.guess(key)
                    if guess is not None:
                        self.say_state(key, guess)
                elif current is None and self.view.round >= 1 and rng.random() < 0.3:
                    self.parts.append(rng.choice(_WITHHOLD).format(label=_LABEL[key]))
                continue
            if current is None:
                self.state_honestly(key, value)
            elif not same_value(key, current, value) and rng.random() < self.p_fix(key):
                self.correct_honestly(key, value, current)
        for key in self.verifies:
            if key in protected:
                continue
            value = self.belief(key)
            if value is None:
                continue
            current = self.plan.get(key)
            if current is None:
                if self.left <= 1 and rng.random() < p.p_fill:
                    self.state_honestly(key, value)
            elif not same_value(key, current, value) and rng.random() < self.p_fix(key):
                self.correct_honestly(key, value, current)

    def p_fix(self, key: str) -> float:
        """People defend what they said themselves: an own slip is caught less often than
        someone else's error."""
        return self.p.p_self_catch if self.author.get(key) == self.me else self.p.p_correct

    def guess(self, key: str) -> str | None:
        """An unverified value for `key`: derived from what was said, or a plausible time."""
        belief = self.belief(key)
        if belief is not None:
            return perturb(key, belief, self.rng, harmful=False, routes=self._route_names())
        rng = self.rng
        if key in ("guard_gap", "camera_window"):
            start = rng.randint(40, 200)
            return fmt_window(start, start + rng.randint(30, 70))
        if key in ("entry_time", "exit_time"):
            return fmt_time(rng.randint(40, 260))
        if key == "crack_minutes":
            return str(rng.randint(15, 60))
        return None

    def maybe_ask(self) -> None:
        rng = self.rng
        if self.strategy is Strategy.SUBTLE_DELAYS:
            return
        if rng.random() < self.p.p_suggest:
            key = rng.choice(PLAN_KEYS)
            who = key_owner(key, self.agents)
            if who != self.me:
                self.parts.append(_SUGGEST.format(who=who, tool=_TOOL_FOR[key], label=_LABEL[key]))
                return
        if rng.random() >= self.p.p_question:
            return
        disputed = [
            k for k in PLAN_KEYS if len(self.values[k]) > 1 and self.author.get(k) != self.me
        ]
        if disputed:
            key = rng.choice(disputed)
            who = self.author[key]
            self.parts.append(rng.choice(_ASK_RECHECK).format(who=who, label=_LABEL[key]))
            return
        missing = [k for k in PLAN_KEYS if k not in self.plan and k not in self.stated]
        if missing:
            key = rng.choice(missing)
            who = key_owner(key, self.agents)
            if who != self.me:
                self.parts.append(rng.choice(_ASK_MISSING).format(who=who, label=_LABEL[key]))

    # -- the mole

    def sabotaged_keys(self) -> tuple[str, ...]:
        """Keys the mole never states truthfully."""
        s = self.strategy
        if s is Strategy.TIMING_ERRORS:
            return ("entry_time", "exit_time", "crack_minutes")
        if s is Strategy.FALSE_INFO:
            return ("guard_gap", "camera_window")
        if s is Strategy.SUBTLE_DELAYS or s is Strategy.WRONG_TOOLS:
            return self.owns
        if s is Strategy.COORDINATION_CHAOS:
            return tuple(k for k in PLAN_KEYS if self.author.get(k) not in (None, self.me))
        return ()

    def _act(self) -> bool:
        p = self.p.p_sabotage_last if self.left == 0 else self.p.p_sabotage
        return self.rng.random() < p

    def lie(self, key: str, *, correcting: bool) -> bool:
        """State a wrong value for `key` that looks like a statement or a correction."""
        current = self.plan.get(key)
        base = self.belief(key) or current
        if base is None:
            return False
        if current is not None and self.author.get(key) == self.me and self.view.round >= 1:
            if self.rng.random() >= self.p.p_contradict:
                return False
            base = self.belief(key) or base
        wrong = perturb(key, base, self.rng, harmful=True, routes=self._route_names())
        if wrong is None or (current is not None and same_value(key, wrong, current)):
            wrong = perturb(key, base, self.rng, harmful=True, routes=self._route_names())
        if wrong is None or same_value(key, wrong, base):
            return False
        if current is None or not correcting:
            self.say_state(key, wrong)
        elif self.rng.random() < self.p.p_inline_fix:
            self.say_inline_fix(key, current, wrong)
        else:
            self.say_correct(key, wrong, current)
        return True

    def sabotage(self) -> None:
        s, rng = self.strategy, self.rng
        budget = self.p.mole_lies_last if self.left == 0 else self.p.mole_lies
        if s is Strategy.TIMING_ERRORS or s is Strategy.FALSE_INFO:
            targets = [k for k in self.sabotaged_keys() if k in self.owns or k in self.plan]
            rng.shuffle(targets)
            targets.sort(key=lambda k: k not in self.owns)
            for key in targets:
                if budget <= 0:
                    break
                mine_unsaid = key in self.owns and key not in self.plan
                if (mine_unsaid or self._act()) and self.lie(key, correcting=True):
                    budget -= 1
        elif s is Strategy.COORDINATION_CHAOS:
            targets = [k for k in PLAN_KEYS if self.author.get(k) not in (None, self.me)]
            rng.shuffle(targets)
            for key in targets[: budget + 1]:
                if self._act():
                    self.lie(key, correcting=True)
        elif s is Strategy.SUBTLE_DELAYS:
            self.delay()
        elif s is Strategy.WRONG_TOOLS:
            self.misdirect()

    def delay(self) -> None:
        rng = self.rng
        for key in self.owns:
            value = self.belief(key)
            if key in self.plan:
                continue
            if self.left == 0 and value is not None and rng.random() >= self.p.p_withhold_forever:
                self.lie(key, correcting=False)
            else:
                self.parts.append(rng.choice(_WITHHOLD).format(label=_LABEL[key]))
        # A re-check costs the one asked a turn, so ask those whose part is still open.
        pending = []
        for name in self.agents:
            if name == self.me:
                continue
            owns, verifies = duties(name, self.agents)
            if any(k not in self.plan for k in owns):
                pending.append((name, verifies + owns))
        rng.shuffle(pending)
        for name, keys in pending[:3]:
            if keys and rng.random() < self.p.p_mole_question:
                key = keys[0]
                self.parts.append(rng.choice(_ASK_RECHECK).format(who=name, label=_LABEL[key]))

    def gather_wrong(self) -> None:
        calls = self.needed_calls(self.owns + self.verifies)
        if not calls:
            return
        rendered = []
        for _, tool, param in calls[:2]:
            if self.rng.random() < self.p.p_mole_wrong_tool:
                tool, param = self.rng.choice(_WRONG_CALLS)
            self.calls.append((tool, param))
            rendered.append(f"[TOOL:{tool}:{param}]")
        intro = self.rng.choice(_TOOL_INTRO).format(what=_SOURCE[calls[0][0]])
        self.parts.append(" ".join(x for x in (intro, *rendered) if x))

    def misdirect(self) -> None:
        rng = self.rng
        for key in self.owns:
            if key in self.plan:
                if self.author.get(key) != self.me and self._act():
                    self.lie(key, correcting=True)
                continue
            value = self.belief(key)
            if self.view.round >= 1 and (value is not None or self.left <= 1):
                guess = (
                    perturb(key, value, rng, harmful=True, routes=self._route_names())
                    if (value is not None)
                    else self.guess(key)
                )
                if guess is not None:
                    self.say_state(key, guess)
                    continue
            self.parts.append(rng.choice(_WITHHOLD).format(label=_LABEL[key]))
        pending = [
            (name, k)
            for name in self.agents
            if name != self.me
            for k in duties(name, self.agents)[0]
            if k not in self.plan
        ]
        if pending and self._act():
            name, key = rng.choice(pending)
            wrong = [
                t for t in ("calculator", "file_reader", "database_query") if t != _TOOL_FOR[key]
            ]
            self.parts.append(_SUGGEST.format(who=name, tool=rng.choice(wrong), label=_LABEL[key]))


def _exit_expr(entry: int, crack: int) -> str:
    """The calculator expression for entry (minutes after midnight) plus crack minutes."""
    hours, minutes = divmod(entry, 60)
    return f"{hours}*60+{minutes}+{crack}" if hours else f"{minutes}+{crack}"


def _label_key(text: str) -> str | None:
    for key, label in _LABEL.items():
        if text.startswith(label):
            return key
    return None


def _suggested_call(tool: str, key: str, rng: random.Random) -> tuple[str, str]:
    """What an agent runs when told to use `tool` for `key`: right tools get a right call."""
    if tool == _TOOL_FOR[key]:
        right = {
            "guard_gap": ("database_query", _GUARD_SQL[0]),
            "camera_window": ("file_reader", "camera_schedule.txt"),
            "crack_minutes": ("file_reader", "vault_specs.txt"),
            "route": ("database_query", _ROUTE_SQL[0]),
        }
        if key in right:
            return right[key]
    misuse = {
        "calculator": f"{_LABEL[key]}",
        "file_reader": f"{key}.txt",
        "database_query": f"SELECT * FROM {key}",
    }
    return tool, misuse[tool]


class SimPolicy:
    """The embedded policy: deterministic given (view, seed) unless `drift` > 0."""

    name = "sim"

    def __init__(
        self,
        world_provider: Callable[[], World] | None = None,
        drift: float = 0.0,
        params: SimParams = DEFAULT_PARAMS,
        drift_seed: int | None = None,
    ) -> None:
        if not 0.0 <= drift <= 1.0:
            raise ValueError(f"drift must be a probability in [0, 1], got {drift!r}")
        # Accepted so every policy is built the same way; never consulted for facts.
        self.world_provider = world_provider
        self.drift = drift
        self.params = params
        self.drift_seed = drift_seed
        self._chaos: random.Random = (
            random.SystemRandom() if drift_seed is None else random.Random(drift_seed)
        )

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion:
        """The action of `view.agent` at `view.step`, drawn from `random.Random(seed)`."""
        rng: random.Random = random.Random(seed)
        if self.drift > 0.0 and self._chaos.random() < self.drift:
            rng = self._chaos
        text = _Turn(view, rng, self.params).compose()
        prompt_chars = sum(len(m.get("content", "")) for m in messages)
        return Completion(
            text=text,
            model=MODEL_NAME,
            finish_reason="stop",
            prompt_tokens=prompt_chars // 4,
            completion_tokens=max(1, len(text) // 4),
        )


class SimReferencePolicy:
    """The public reference policy of a crew member under the sim: the same sim playing the
    agent's configured role with no secret instructions.

    It never reads the secret: whatever view it is handed, it decides on a copy whose
    `mole_strategy` is unset and whose system prompt is the one given as public (the sim does
    not read prompts, but an LLM-backed reference would). On an honest agent's view it is the
    sim itself, so replaying honest agents under it matches by construction."""

    name = "sim-reference"

    def __init__(self, sim: SimPolicy | None = None) -> None:
        self.sim = sim or SimPolicy()

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion:
        public = msgspec.structs.replace(view, mole_strategy=None)
        return self.sim.decide(public, messages, seed)


def sim_policy(spec: dict[str, Any]) -> Policy:
    """The policy registry's factory for "sim" and "sim-honest" specs."""
    try:
        drift = float(spec.get("drift", 0.0) or 0.0)
        raw_seed = spec.get("drift_seed")
        sim = SimPolicy(drift=drift, drift_seed=None if raw_seed is None else int(raw_seed))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"bad sim policy spec {spec!r}: {e}") from e
    return HonestPolicy(sim) if spec.get("name") == "sim-honest" else sim
