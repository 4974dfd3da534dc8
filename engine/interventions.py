"""The five do() operations, applied by forking a run at step k and running the branch forward.

A branch is a child run: its parent pointer shares the prefix (steps < k) without copying it; its
first own event is the Intervention; from there the policy re-decides every later step with the
branch's seed, tools run against the same recorded world, and the same rule scores the outcome.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from engine import events as ev
from engine.errors import (
    ConcurrencyError,
    ConfigError,
    EngineError,
    InterventionError,
    JournalError,
    PolicyError,
    interrupt_behind,
)
from engine.executors.base import Executor, ExecutorOptions, make_executor
from engine.journal import Journal
from engine.policies.base import ChatLine, Policy
from engine.policies.registry import POLICY_NAMES, load_policy, make_policy
from engine.projections import conversation
from engine.public import public_error
from engine.runtime.episode import EpisodeResult, Overrides, run_episode
from engine.runtime.recorder import Recorder
from engine.runtime.seeds import branch_stream, step_seed
from engine.scenario import scenario_factory, stepped_for
from engine.state import State, apply, edit_transcript, state_at_seq, step_seq
from engine.workers import STOP, Interrupted, StopChannel, WorkerPool, check


class DoResample(msgspec.Struct, frozen=True, tag="resample"):
    """Redraw a_k from the unchanged policy (the null intervention)."""

    k: int


class DoAction(msgspec.Struct, frozen=True, tag="action"):
    """Force a_k to the given message text."""

    k: int
    action: str


class DoObservation(msgspec.Struct, frozen=True, tag="observation"):
    """Keep a_k, replace the result of its (first) tool call with `observation`."""

    k: int
    observation: str


class DoContext(msgspec.Struct, frozen=True, tag="context"):
    """Edit the conversation at k: {"step": j, "text": t} replaces step j's message (empty
    text deletes it); {"text": t} adds a message from the "context" pseudo-agent."""

    k: int
    edit: dict[str, Any]


class DoPolicy(msgspec.Struct, frozen=True, tag="policy"):
    """Swap the policy from step k on (a policy spec such as {"name": "sim-honest"})."""

    k: int
    policy: dict[str, Any]


Intervention = DoResample | DoAction | DoObservation | DoContext | DoPolicy
OPS = ("resample", "action", "observation", "context", "policy")


def op_name(iv: Intervention) -> str:
    return type(iv).__struct_config__.tag  # type: ignore[return-value]


def iv_value(iv: Intervention) -> Any:
    match iv:
        case DoAction():
            return iv.action
        case DoObservation():
            return iv.observation
        case DoContext():
            return iv.edit
        case DoPolicy():
            return iv.policy
        case _:
            return None


#: The longest --value a branch may carry (a do_action message, an observation, an edit).
MAX_VALUE_BYTES = 1 << 20
#: How deeply a do_context JSON value may nest (it is one flat object).
MAX_JSON_DEPTH = 4
#: The most branches one fork makes: each is a journaled run, and their specs are made up
#: front (a bound of 10^11 ran out of memory in a traceback after half a minute).
MAX_BRANCHES = 100_000


def parse_intervention(op: str, k: int, value: str | None) -> Intervention:
    """Build an intervention from CLI-style text; errors name the op and what it needs."""
    if op not in OPS:
        raise InterventionError(f"unknown operation {op!r}; expected one of: {', '.join(OPS)}")
    if op == "resample":
        if value:
            raise InterventionError("do_resample takes no --value")
        return DoResample(k)
    if value is None or value == "":
        raise InterventionError(f"do_{op} needs --value or --value-file")
    check_value_text(value, f"do_{op} value")
    if op == "action":
        return DoAction(k, value)
    if op == "observation":
        return DoObservation(k, value)
    if op == "context":
        return DoContext(k, parse_context_edit(value))
    return DoPolicy(k, parse_policy_spec(value))


def check_value_text(value: str, what: str) -> None:
    """A value is text: bounded in size and free of NUL bytes (a binary file is refused)."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_VALUE_BYTES:
        raise InterventionError(f"{what} is {size} bytes; the limit is {MAX_VALUE_BYTES}")
    if "\x00" in value:
        raise InterventionError(f"{what} contains NUL bytes: it must be text, not binary data")


def _json_depth_ok(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest at most `limit` deep (checked before json.loads,
    whose recursion a hostile value could exhaust)."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def parse_context_edit(value: str) -> dict[str, Any]:
    """{"step": j, "text": t} (replace step j's message), {"text": t}, or plain text to add."""
    text = value.strip()
    if not text.startswith("{"):
        return {"text": value}
    shape = 'do_context JSON must look like {"step": 3, "text": "..."} or {"text": "..."}'
    if not _json_depth_ok(text, MAX_JSON_DEPTH):
        raise InterventionError(f"do_context JSON nests too deeply; {shape}")
    try:
        edit = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise InterventionError(f"do_context value is not valid JSON: {e}") from e
    if not isinstance(edit, dict) or not isinstance(edit.get("text"), str):
        raise InterventionError(shape)
    extra = sorted(set(edit) - {"step", "text"})
    if extra:
        raise InterventionError(f"do_context JSON has unknown keys {extra}; {shape}")
    if "step" in edit and (not isinstance(edit["step"], int) or isinstance(edit["step"], bool)):
        raise InterventionError(f"do_context 'step' must be an integer, got {edit['step']!r}")
    return edit


def _finite(key: str, lo: float, hi: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            x = float(raw)
        except ValueError:
            raise InterventionError(f"policy option {key} must be a number, got {raw!r}") from None
        if not (math.isfinite(x) and lo <= x <= hi):
            raise InterventionError(
                f"policy option {key} must lie within [{lo:g}, {hi:g}], got {raw!r}"
            )
        return x

    return parse


def _integer(key: str, lo: int, hi: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            x = int(raw)
        except ValueError:
            raise InterventionError(
                f"policy option {key} must be a whole number, got {raw!r}"
            ) from None
        if not lo <= x <= hi:
            raise InterventionError(
                f"policy option {key} must lie within [{lo}, {hi}], got {raw!r}"
            )
        return x

    return parse


def _text(key: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if not raw:
            raise InterventionError(f"policy option {key} must not be empty")
        return raw

    return parse


#: The options each policy takes in `--do policy --value NAME:key=value,...`, with their types.
POLICY_OPTIONS: dict[str, dict[str, Callable[[str], Any]]] = {
    "sim": {
        "drift": _finite("drift", 0.0, 1.0),
        "drift_seed": _integer("drift_seed", 0, 2**63 - 1),
    },
    "sim-honest": {
        "drift": _finite("drift", 0.0, 1.0),
        "drift_seed": _integer("drift_seed", 0, 2**63 - 1),
    },
    "openai": {
        "base_url": _text("base_url"),
        "model": _text("model"),
        "temperature": _finite("temperature", 0.0, 2.0),
        "max_tokens": _integer("max_tokens", 1, 131072),
        "timeout": _finite("timeout", 0.1, 86400.0),
        "max_retries": _integer("max_retries", 0, 10),
    },
}


def parse_policy_spec(value: str) -> dict[str, Any]:
    """`sim-honest`, or `openai:model=m,temperature=0.2`: a typed policy spec."""
    name, _, rest = value.partition(":")
    name = name.strip()
    if name not in POLICY_NAMES:
        raise InterventionError(
            f"unknown policy {name!r} for do_policy; expected one of: {', '.join(POLICY_NAMES)}"
        )
    known = POLICY_OPTIONS.get(name, {})
    spec: dict[str, Any] = {"name": name}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, val = part.partition("=")
        key = key.strip()
        if not eq:
            raise InterventionError(f"policy option {part!r} must look like key=value")
        if key not in known:
            valid = ", ".join(known) or "none"
            raise InterventionError(f"unknown option {key!r} for policy {name} (valid: {valid})")
        spec[key] = known[key](val.strip())
    return spec


def override_options(name: str, override: Mapping[str, Any]) -> dict[str, Any]:
    """Check CLI overrides (--base-url, --model, --timeout, --drift) against a policy."""
    known = POLICY_OPTIONS.get(name, {})
    bad = sorted(k for k in override if k not in known)
    if bad:
        flags = ", ".join("--" + k.replace("_", "-") for k in bad)
        verb = "does" if len(bad) == 1 else "do"
        raise InterventionError(f"{flags} {verb} not apply to policy {name}")
    return {k: known[k](str(v)) for k, v in override.items()}


def branch_seed_for(seed: int, index: int) -> int:
    """The seed of branch `index` of a fork made with `seed` (63 bits, stable across runs)."""
    h = hashlib.blake2b(f"branch:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


class ParentInfo(msgspec.Struct, frozen=True):
    run_id: str
    steps: int
    status: str
    actions: dict[int, str]  # recorded action text per step
    tool_steps: frozenset[int]
    outcome: dict[str, Any]
    agents: dict[int, str] = msgspec.field(default_factory=dict)  # who acted at each step
    #: do_policy swaps in the run's history, its ancestors' included: (step, policy name)
    policy_swaps: tuple[tuple[int, str], ...] = ()


def parent_info(journal: Journal, run_id: str) -> ParentInfo:
    """What validating and running interventions needs to know about the parent run."""
    info = journal.run(run_id)
    # a scenario this process cannot rebuild fails here in one line, not once per branch
    scenario_factory(info.scenario)
    actions: dict[int, str] = {}
    agents: dict[int, str] = {}
    tool_steps: set[int] = set()
    outcome: dict[str, Any] = {}
    swaps: list[tuple[int, str]] = []
    for stored in journal.read(info.run_id):
        check()  # a stop request between two events: the pass over a long run takes seconds
        e = stored.event
        if isinstance(e, ev.ChatMessage) and e.step is not None:
            actions[e.step] = e.text
            agents[e.step] = e.agent
        elif isinstance(e, ev.ToolCall) and e.step is not None:
            tool_steps.add(e.step)
        elif isinstance(e, ev.Intervention) and e.op == "policy":
            name = e.value.get("name", "") if isinstance(e.value, dict) else ""
            swaps.append((e.at, str(name)))
        elif isinstance(e, ev.RunEnded):
            outcome = dict(e.outcome)
    return ParentInfo(
        run_id=info.run_id,
        steps=journal.steps(info.run_id),
        status=journal.status(info.run_id),
        actions=actions,
        tool_steps=frozenset(tool_steps),
        outcome=outcome,
        agents=agents,
        policy_swaps=tuple(swaps),
    )


def validate(parent: ParentInfo, iv: Intervention) -> None:
    if parent.status in ("recording", "paused"):
        raise InterventionError(
            f"run {parent.run_id!r} is still recording; fork it once it has ended"
        )
    if parent.status == "abandoned":
        # its last step may be half-told; closing it appends the stop that says where it ended
        raise InterventionError(
            f"run {parent.run_id!r} was abandoned by its recording process; close it with "
            "`car runs --close-stale` before forking it"
        )
    if parent.steps == 0:
        raise InterventionError(f"run {parent.run_id!r} has no steps to fork")
    if not 0 <= iv.k < parent.steps:
        raise InterventionError(
            f"step {iv.k} is out of range: run {parent.run_id!r} has steps 0..{parent.steps - 1}"
        )
    if isinstance(iv, DoObservation) and iv.k not in parent.tool_steps:
        raise InterventionError(
            f"do_observation needs a step with a tool call; step {iv.k} of run "
            f"{parent.run_id!r} made none (steps with tool calls: "
            f"{', '.join(map(str, sorted(parent.tool_steps))) or 'none'})"
        )
    if isinstance(iv, DoContext) and "step" in iv.edit and not 0 <= iv.edit["step"] < iv.k:
        raise InterventionError(
            f"do_context can only edit an earlier step's message (0..{iv.k - 1}), "
            f"got step {iv.edit['step']}"
        )
    if isinstance(iv, DoPolicy):
        try:
            policy_for(iv.policy)
        except ConfigError as e:
            raise InterventionError(str(e)) from e
    try:
        # before any branch exists: a value the journal refuses (text that is no Unicode, a
        # number past 64 bits) left each branch forked, without its opening event, abandoned
        ev.encode_checked(
            ev.Intervention(step=iv.k, op=op_name(iv), at=iv.k, value=iv_value(iv), branch_seed=0)
        )
    except JournalError as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        raise InterventionError(f"do_{op_name(iv)}'s value cannot be journaled: {cause}") from e


class BranchBase(msgspec.Struct, frozen=True):
    """What every branch forked at one step shares: where it forks, s_k, the conversation."""

    fork_seq: int
    state: State
    prefix: tuple[ChatLine, ...]


_bases: OrderedDict[tuple[str, str, int], BranchBase] = OrderedDict()
_policies: dict[str, Policy] = {}
_cache_lock = threading.Lock()
_BASE_CACHE = 4096


def _remember(key: tuple[str, str, int], base: BranchBase) -> None:
    with _cache_lock:
        _bases[key] = base
        _bases.move_to_end(key)
        while len(_bases) > _BASE_CACHE:
            _bases.popitem(last=False)


def prepare_bases(journal: Journal, parent: ParentInfo, upto: int | None = None) -> int:
    """s_k and the prefix conversation of every step k < upto (default: all), in ONE pass over
    the parent's history: branch set-up is then a cache lookup at any step, never a re-read of
    the prefix. Returns how many bases were computed."""
    last = parent.steps if upto is None else min(upto, parent.steps)
    s = State()
    lines: list[ChatLine] = []
    k = 0
    made = 0
    for stored in journal.read(parent.run_id):
        check()  # as in parent_info
        e = stored.event
        while e.step is not None and e.step >= k and k < last:
            _remember((journal.url, parent.run_id, k), BranchBase(stored.seq, s, tuple(lines)))
            k += 1
            made += 1
        if k >= last:
            break
        if isinstance(e, ev.ChatMessage):
            lines.append(ChatLine(step=e.step or 0, agent=e.agent, text=e.text))
        elif isinstance(e, ev.Intervention) and e.op == "context":
            lines = edit_transcript(lines, e.value, e.at)
        s = apply(s, e)
    return made


def branch_base(journal: Journal, parent: ParentInfo, k: int) -> BranchBase:
    """s_k and the prefix conversation of `parent`, computed once per process and cached:
    an ended run's history before k never changes, and branches by the hundred share it."""
    key = (journal.url, parent.run_id, k)
    with _cache_lock:
        hit = _bases.get(key)
        if hit is not None:
            _bases.move_to_end(key)
            return hit
    fork_seq = step_seq(journal, parent.run_id, k)
    base = BranchBase(
        fork_seq=fork_seq,
        state=state_at_seq(journal, parent.run_id, fork_seq),
        prefix=tuple(conversation(journal, parent.run_id, fork_seq)),
    )
    _remember(key, base)
    return base


def policy_spec_at(state: State) -> dict[str, Any]:
    """The spec of the policy deciding at this state: the run's own, unless an earlier
    do_policy on this branch's history swapped it."""
    swapped = [iv for iv in state.interventions if iv["op"] == "policy"]
    return dict(swapped[-1]["value"]) if swapped else dict(state.policy)


def policy_for(spec: dict[str, Any]) -> Policy:
    """One policy object per spec and process: policies are stateless given (view, seed), and
    building an HTTP client per branch costs more CPU than a whole sim branch."""
    key = json.dumps(spec, sort_keys=True, default=str)
    with _cache_lock:
        pol = _policies.get(key)
        if pol is None:
            try:
                pol = _policies[key] = make_policy(spec)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"bad policy spec {spec!r}: {e}") from e
        return pol


def policies_in_force(
    journal: Journal, parent: ParentInfo, steps: Iterable[int] | None = None
) -> dict[int, dict[str, Any]]:
    """The spec of the policy that re-decides a branch of `parent` forked at each of `steps`
    (default: every step), before any override: the one `run_branch` builds from s_k. That is
    the run's recorded policy unless a do_policy in the parent's own history swapped another
    in at an earlier step: a fork of a do_policy branch after its swap runs the swapped-in
    policy, not the one its root's RunStarted names. (A fork at the swap step itself replaces
    that step, swap and all: the policy in force before it decides.)"""
    ks = range(parent.steps) if steps is None else sorted(set(steps))
    if not parent.policy_swaps:
        recorded = recorded_policy(journal, parent.run_id)
        return {k: dict(recorded) for k in ks}
    with _cache_lock:
        missing = [k for k in ks if (journal.url, parent.run_id, k) not in _bases]
    if len(missing) > 1:
        prepare_bases(journal, parent, upto=max(missing) + 1)  # one pass, not one per step
    return {k: policy_spec_at(branch_base(journal, parent, k).state) for k in ks}


def check_override(
    journal: Journal,
    parent: ParentInfo,
    override: Mapping[str, Any],
    steps: Iterable[int] | None = None,
    *,
    where_taken: bool = False,
) -> dict[str, Any]:
    """Check CLI overrides (--base-url, --model, --timeout, --drift) against the policy in force
    at each fork step of `steps` (default: every step a forward run may fork at); returns them
    parsed. A flag that one of those policies does not take is refused in one line, which on a
    run with do_policy swaps in its history names the steps and the swaps. `where_taken` (many
    forward runs, an attribution): they go to the branches whose policy takes them
    (`applied_override`), as `car fidelity` applies them to the steps whose deciding policy
    takes them, and are refused only when no policy in force takes them."""
    at = policies_in_force(journal, parent, steps)
    by_name: dict[str, list[int]] = {}
    for k, spec in at.items():
        by_name.setdefault(str(spec.get("name", "")), []).append(k)
    if not by_name:  # no steps: the run's recorded policy
        by_name[str(recorded_policy(journal, parent.run_id).get("name", ""))] = []
    parsed: dict[str, Any] = {}
    refused: list[tuple[InterventionError, list[int]]] = []
    for name, ks in by_name.items():
        try:
            parsed = override_options(name, override)
        except InterventionError as e:
            refused.append((e, ks))
    if not refused or (where_taken and len(refused) < len(by_name)):
        return parsed
    first, ks = refused[0]
    if not parent.policy_swaps or not ks:
        raise first
    swaps = ", ".join(f"to {n} at step {k}" for k, n in parent.policy_swaps)
    if len(parent.policy_swaps) == 1:
        how = f"its do_policy swap {swaps} decides forks after that step"
    else:
        how = f"its do_policy swaps ({swaps}) each decide forks after their step"
    raise InterventionError(
        f"{first} (the policy in force at {steps_text(ks)} of run {parent.run_id}; {how})"
    ) from None


def applied_override(spec: Mapping[str, Any], override: Mapping[str, Any] | None) -> dict[str, Any]:
    """What of `override` (parsed by `check_override`) a branch whose policy is `spec` runs
    with: all of it when that policy takes every flag, else nothing (an attribution's
    sim-decided branches of a run that swapped to a server keep their own policy)."""
    if not override:
        return {}
    known = POLICY_OPTIONS.get(str(spec.get("name", "")), {})
    if "name" in override or all(k in known for k in override):
        return dict(override)
    return {}


def steps_text(ks: Sequence[int]) -> str:
    """`step 3`, `steps 0..2, 5`: sorted steps as ranges."""
    spans: list[list[int]] = []
    for k in ks:
        if spans and k == spans[-1][1] + 1:
            spans[-1][1] = k
        else:
            spans.append([k, k])
    text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in spans)
    return ("step " if len(ks) == 1 else "steps ") + text


def recorded_policy(journal: Journal, run_id: str) -> dict[str, Any]:
    """The spec of the policy run `run_id` (or its root, for a branch) was recorded with."""
    first = next(journal.read(run_id, 0, 1), None)
    if first is None or not isinstance(first.event, ev.RunStarted):
        raise EngineError(f"run {run_id!r} has no RunStarted event")
    return dict(first.event.policy)


def branch_key(
    parent: str,
    iv: Intervention,
    branch_seed: int,
    keep: Mapping[int, str] | None,
    policy_override: Mapping[str, Any] | None,
) -> str:
    """A deterministic name for a branch: the same parent, intervention, kept steps, seed and
    policy always give the same key, so a re-run can find the branch it made before."""
    doc = json.dumps(
        [
            parent,
            op_name(iv),
            iv.k,
            iv_value(iv),
            branch_seed,
            sorted(keep or {}),
            dict(policy_override or {}),
        ],
        sort_keys=True,
        default=str,
        separators=(",", ":"),
    )
    return hashlib.blake2b(doc.encode(), digest_size=10).hexdigest()


def branch_label(iv: Intervention, key: str) -> str:
    return f"do_{op_name(iv)}@{iv.k} #{key}"


#: Group commit of a branch: a forward run of the embedded policy (a few ms a step) commits
#: in one or two transactions instead of one per step; that halves the write lock's share of
#: parallel branches. A crash loses at most the branch in flight (whole steps, as always),
#: and a stopped branch still journals its stop at once. A step slower than this (an LLM
#: call) commits on its own.
BRANCH_GROUP_MS = 50.0

#: Branches this process is running now: run id -> its recorder (closed on an interrupt).
_open: dict[str, Recorder] = {}


def run_branch(
    journal: Journal,
    parent: ParentInfo,
    iv: Intervention,
    branch_seed: int,
    *,
    keep: Mapping[int, str] | None = None,
    policy_override: dict[str, Any] | None = None,
    label: str = "",
) -> EpisodeResult:
    """Fork `parent` at iv.k, apply `iv`, and run the branch to its end.

    `keep` forces the recorded action at later steps too (used by Shapley coalitions). A stop
    request (Ctrl-C) closes the branch as stopped at its next step."""
    validate(parent, iv)
    k = iv.k
    base = branch_base(journal, parent, k)
    s_k = base.state
    scenario = stepped_for(s_k, "a branch of the core's step loop")
    stream = branch_stream(s_k.root_seed, branch_seed)  # not the public branch seed alone
    spec = policy_spec_at(s_k)
    policy_override = applied_override(spec, policy_override)
    spec.update(policy_override)
    policy = policy_for(spec)
    prefix = list(base.prefix)
    key = branch_key(parent.run_id, iv, branch_seed, keep, policy_override)
    child = journal.fork(parent.run_id, base.fork_seq, label=label or branch_label(iv, key))
    opening = ev.Intervention(
        step=k, op=op_name(iv), at=k, value=iv_value(iv), branch_seed=branch_seed
    )
    recorder = Recorder(journal, child, s_k, base.fork_seq, group_ms=BRANCH_GROUP_MS, leased=True)
    _open[child] = recorder
    try:
        recorder.append([opening])
        overrides = Overrides(forced_actions=dict(keep or {}))
        match iv:
            case DoAction():
                overrides.forced_actions[k] = iv.action
            case DoObservation():
                overrides.forced_actions[k] = parent.actions[k]
                overrides.observations[k] = iv.observation
            case DoPolicy():
                overrides.policy_from = (k, policy_for(iv.policy))
            case DoContext():
                prefix = edit_transcript(prefix, iv.edit, iv.k)
            case _:
                pass
        return run_episode(
            recorder,
            scenario,
            policy,
            lambda j: step_seed(stream, j),
            prefix,
            overrides=overrides,
            control=StopChannel(),
            server=(iv.policy if isinstance(iv, DoPolicy) else spec).get("base_url"),
        )
    finally:
        _open.pop(child, None)


def close_stopped(journal: Journal, run_id: str, reason: str = "interrupted") -> bool:
    """Close a branch left recording (its writer was stopped mid-step) as stopped: Control
    stop and RunEnded(status="stopped"), appended through a recorder at its head. Returns
    whether anything was appended."""
    if journal.status(run_id) not in ("recording", "paused"):
        return False
    head = journal.head(run_id)
    state = state_at_seq(journal, run_id, head, snapshots=False)
    recorder = Recorder(journal, run_id, state, head)
    try:
        recorder.append([ev.Control(action="stop", reason=reason), ev.RunEnded(status="stopped")])
        recorder.flush()
    except ConcurrencyError:
        return False  # its own writer closed it first
    return True


def close_open_branches(
    journal: Journal, parent: str, labels: set[str], since: str, finished: set[str]
) -> int:
    """After an interrupt: close every branch of `parent` this command made (by label, created
    at or after `since`, not among the `finished` ones it already has results for) that is
    still recording. Returns how many were closed."""
    closed = 0
    for run_id in list(_open):
        closed += close_stopped(journal, run_id)
    for info in journal.children(parent):
        if info.label in labels and info.created_at >= since and info.run_id not in finished:
            closed += close_stopped(journal, info.run_id)
    return closed


# ------------------------------------------------------------------ many branches


class BranchResult(msgspec.Struct, frozen=True):
    run_id: str
    status: str
    bad: bool | None
    error: str | None = None
    reused: bool = False


class ForkReport(msgspec.Struct, frozen=True):
    parent: str
    at: int
    op: str
    value: Any
    branches: list[BranchResult]
    bad: int
    scored: int
    bad_rate: float | None
    ci: tuple[float, float] | None
    factual_bad: bool | None
    #: where the branches ran and what was lost on the way (ExecutorStats)
    executor: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = msgspec.to_builtins(self)
        d["ci"] = list(self.ci) if self.ci is not None else None
        return d

    @classmethod
    def of(
        cls,
        parent: str,
        iv: Intervention,
        branches: list[BranchResult],
        factual_bad: bool | None,
        executor: dict[str, Any] | None = None,
    ) -> ForkReport:
        """The report of one intervention's branches: the bad rate over the scored ones (a
        branch that failed has no outcome) with its Wilson 95% interval."""
        scored = [b for b in branches if b.bad is not None]
        bad = sum(1 for b in scored if b.bad)
        return cls(
            parent=parent,
            at=iv.k,
            op=op_name(iv),
            value=iv_value(iv),
            branches=branches,
            bad=bad,
            scored=len(scored),
            bad_rate=bad / len(scored) if scored else None,
            ci=wilson(bad, len(scored)) if scored else None,
            factual_bad=factual_bad,
            executor=executor,
        )


def wilson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval, sensible at 0 and n successes."""
    from engine.attribution.contrastive import wilson as wilson_alpha

    if n == 0:
        return (0.0, 1.0)
    return wilson_alpha(successes, n, 1 - confidence)


Progress = Callable[[int, int], None]


class BranchSpec(msgspec.Struct, frozen=True):
    iv: Intervention
    branch_seed: int
    keep: dict[int, str] | None = None


def branch_job(
    j: Journal, parent: ParentInfo, arg: tuple[BranchSpec, dict[str, Any] | None]
) -> BranchResult:
    """One branch as an executor job (engine/executors): arg is (spec, policy override)."""
    spec, policy_override = arg
    return _branch_in(j, parent, spec, policy_override)


def _branch_in(
    j: Journal, parent: ParentInfo, spec: BranchSpec, policy_override: dict[str, Any] | None
) -> BranchResult:
    if STOP.is_set():
        return BranchResult("", "stopped", None, "interrupted")
    try:
        r = run_branch(
            j, parent, spec.iv, spec.branch_seed, keep=spec.keep, policy_override=policy_override
        )
    except (PolicyError, ConfigError) as e:
        return BranchResult("", "failed", None, public_error(str(e)))
    bad = r.outcome.get("bad") if r.status == "completed" else None
    # a fork's report is public (the server answers it before any verdict)
    return BranchResult(
        r.run_id, r.status, None if bad is None else bool(bad), public_error(r.error)
    )


def branch_outcome(journal: Journal, run_id: str) -> BranchResult | None:
    """The result of a finished branch from its last event; None while it is not completed."""
    last = journal.last_event(run_id)
    if last is None or not isinstance(last.event, ev.RunEnded):
        return None
    e = last.event
    if e.status != "completed" or e.outcome.get("bad") is None:
        return None
    return BranchResult(run_id, e.status, bool(e.outcome["bad"]), None, reused=True)


class BranchRunner:
    """Runs batches of independent branches of one parent for the whole command: one worker
    pool (processes for the sim policy on SQLite, threads waiting on a server otherwise), the
    branch bases computed once, and an orderly stop on Ctrl-C. With `reuse`, a branch whose
    deterministic key names a completed branch from an earlier run of the same command is not
    run again; its outcome is read back."""

    def __init__(
        self,
        journal: Journal,
        parent: ParentInfo,
        *,
        concurrency: int = 1,
        policy_override: dict[str, Any] | None = None,
        thread_policy: bool = False,
        reuse: bool = False,
        all_bases: bool = True,
        executor: ExecutorOptions | None = None,
        policies: Collection[str] | None = None,
    ) -> None:
        """`policies`: the names of the policies that decide the branches' steps, which pick
        where they run; by default the one `policy_override` names, else those in force at
        every step of the parent (a do_policy branch's swap decides the forks after it).
        `thread_policy`: threads whatever they are."""
        if concurrency < 1:
            raise InterventionError(f"concurrency must be at least 1, got {concurrency}")
        self.journal = journal
        self.parent = parent
        self.policy_override = policy_override
        self.concurrency = concurrency
        self.reused = 0
        self.created = 0
        self._labels: set[str] = set()
        self._finished: set[str] = set()  # branches with a result: nothing to close
        self._since = _utc_now()
        self._existing: dict[str, str] = {}
        if reuse:
            for info in journal.children(parent.run_id):
                if "#" in info.label:
                    self._existing.setdefault(info.label, info.run_id)
        if all_bases:
            prepare_bases(journal, parent)
        if policy_override and "name" in policy_override:
            names = {str(policy_override["name"])}
        elif policies is not None:
            names = set(policies)
        else:
            names = {str(p.get("name", "")) for p in policies_in_force(journal, parent).values()}
        names = names or {policy_name(journal, parent.run_id)}
        sim = all(n.startswith("sim") for n in names) and not thread_policy
        # a server-backed policy always runs in threads, even one at a time: the command can
        # then stop on Ctrl-C while a call hangs, and close that branch itself
        mode = "inline" if sim else "threads"
        if concurrency > 1 and sim:
            mode = "processes" if journal.is_sqlite else "threads"
        if mode == "processes":
            # the policies' code before the workers fork: each inherits it (one that cannot
            # be loaded fails in its branches, as it would without this)
            for name in sorted(names):
                with contextlib.suppress(ConfigError):
                    load_policy(name)
        self.executor: Executor = make_executor(
            executor, journal, parent, concurrency=concurrency, mode=mode
        )
        # what the executor chose: a local one may run threads where processes were asked
        # for (ExecutorOptions.processes, the server)
        self.mode = (
            str(getattr(self.executor, "mode", mode))
            if self.executor.name == "local"
            else self.executor.name
        )

    @property
    def _procs(self) -> WorkerPool | None:
        return getattr(self.executor, "_procs", None)

    def __enter__(self) -> BranchRunner:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.close(interrupted=exc_type is not None)

    def close(self, interrupted: bool = False) -> None:
        self.executor.close(interrupted)

    def run(
        self, specs: Sequence[BranchSpec], progress: Progress | None = None
    ) -> list[BranchResult]:
        """One result per spec, in spec order."""
        for s in specs:
            validate(self.parent, s.iv)
        total = len(specs)
        results: list[BranchResult | None] = [None] * total
        todo: list[int] = []
        in_force = (
            policies_in_force(self.journal, self.parent, {s.iv.k for s in specs})
            if self.policy_override
            else {}
        )
        for i, s in enumerate(specs):
            # the key run_branch gives the branch: with the override its policy takes
            applied = applied_override(in_force.get(s.iv.k, {}), self.policy_override)
            label = branch_label(
                s.iv, branch_key(self.parent.run_id, s.iv, s.branch_seed, s.keep, applied)
            )
            self._labels.add(label)
            found = self._existing.get(label)
            hit = branch_outcome(self.journal, found) if found else None
            if hit is not None:
                results[i] = hit
                self.reused += 1
            else:
                todo.append(i)
        done = total - len(todo)
        if progress is not None and done:
            progress(done, total)

        def finish(i: int, r: BranchResult) -> None:
            nonlocal done
            results[i] = r
            done += 1
            if progress is not None:
                progress(done, total)

        try:
            self.executor.map(
                self.journal,
                self.parent,
                branch_job,
                [(specs[i], self.policy_override) for i in todo],
                lambda n, r: finish(todo[n], r),
                labels=self._labels,
            )
            check()
        except (KeyboardInterrupt, Exception) as e:
            if interrupt_behind(e) is None:
                raise
            self.close(interrupted=True)
            self._finished.update(r.run_id for r in results if r is not None and r.run_id)
            closed = close_open_branches(
                self.journal, self.parent.run_id, self._labels, self._since, self._finished
            )
            stopped = sum(1 for r in results if r is not None and r.status == "stopped")
            raise Interrupted(
                f"interrupted: {stopped + closed} open branches closed as stopped"
            ) from e
        out = [r for r in results if r is not None]
        self.created += sum(1 for r in out if r.run_id and not r.reused)
        self._finished.update(r.run_id for r in out if r.run_id)
        return out


def run_branches(
    journal: Journal,
    parent: ParentInfo,
    specs: Sequence[BranchSpec],
    *,
    concurrency: int = 1,
    progress: Progress | None = None,
    policy_override: dict[str, Any] | None = None,
) -> list[BranchResult]:
    """Run independent branches once (a runner for one batch). Results keep spec order."""
    with BranchRunner(
        journal,
        parent,
        concurrency=concurrency,
        policy_override=policy_override,
        all_bases=False,
    ) as runner:
        return runner.run(specs, progress)


def policy_name(journal: Journal, run_id: str, override: dict[str, Any] | None = None) -> str:
    """The name of the policy run `run_id` recorded with (or the one `override` names). Not
    the one deciding a fork of a do_policy branch after its swap: `policies_in_force`."""
    if override and "name" in override:
        return str(override["name"])
    return str(recorded_policy(journal, run_id).get("name", ""))


def fork_many(
    journal: Journal,
    run_id: str,
    iv: Intervention,
    n: int,
    *,
    seed: int = 0,
    concurrency: int = 1,
    progress: Progress | None = None,
    policy_override: dict[str, Any] | None = None,
    executor: ExecutorOptions | None = None,
) -> ForkReport:
    """N branches of one intervention; the outcome distribution with a Wilson 95% interval.

    With do_policy, `policy_override` (--base-url, --model, --timeout) applies to the policy
    swapped in, and is journaled as part of the intervention's value."""
    if not 1 <= n <= MAX_BRANCHES:
        raise InterventionError(
            f"the number of branches must lie within [1, {MAX_BRANCHES}], got {n}"
        )
    parent = parent_info(journal, run_id)
    if isinstance(iv, DoPolicy) and policy_override:
        iv = DoPolicy(
            iv.k, {**iv.policy, **override_options(str(iv.policy["name"]), policy_override)}
        )
        policy_override = None
    validate(parent, iv)
    specs = [BranchSpec(iv, branch_seed_for(seed, i)) for i in range(n)]
    prepare_bases(journal, parent, upto=iv.k + 1)
    if isinstance(iv, DoPolicy):
        decider = str(iv.policy["name"])  # from step k on, whatever was in force there
    else:
        # the policy in force at step k (a do_policy in the parent's history may have
        # swapped it) takes the override and decides where the branches run
        if policy_override:
            policy_override = check_override(journal, parent, policy_override, [iv.k])
        spec = policies_in_force(journal, parent, [iv.k])[iv.k]
        decider = str({**spec, **(policy_override or {})}.get("name", ""))
    with BranchRunner(
        journal,
        parent,
        concurrency=concurrency,
        policy_override=policy_override,
        all_bases=False,
        executor=executor,
        policies=[decider],
    ) as runner:
        branches = runner.run(specs, progress)
        stats = runner.executor.stats()
    return ForkReport.of(
        parent.run_id, iv, branches, parent.outcome.get("bad"), msgspec.to_builtins(stats)
    )


def _utc_now() -> str:
    import datetime as dt

    return dt.datetime.now(dt.UTC).isoformat()
