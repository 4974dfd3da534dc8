"""`analyze`: one run in, the blog's output format out, for every method.

rules      the blog's four signals and weights (engine/detect/rules.py)
llm        the LLM's scores given the rules' structured context (engine/detect/llm.py)
rules+llm  0.6 x rules + 0.4 x LLM, as in the blog
causal     swap one agent at a time for its public reference policy (engine/detect/causal.py)
replay     re-execute each agent under its public reference policy (engine/detect/replay.py)

Every method reads the public view (engine/public.py); causal and replay also re-execute steps,
which needs the journal's seeds and the right to run the crew again, never the secret.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

from engine.detect import calibration
from engine.detect.rules import WEIGHTS, Msg, RuleScores, ToolUse, rule_scores
from engine.errors import ConfigError, EngineError, JournalError
from engine.journal import Journal
from engine.public import PublicRun, public_view

METHODS = ("rules", "llm", "rules+llm", "causal", "replay")
RULE_WEIGHT = 0.6
LLM_WEIGHT = 0.4
MAX_SEED = 2**63 - 1  # what the journal stores and the recorder accepts as a seed
MAX_TIMEOUT_S = 24 * 3600.0  # as for a recording's model calls


class DetectError(EngineError):
    """A detection cannot be made (unknown method, a run with nothing to analyse, ...)."""


class SecretNeeded(DetectError):
    """The method reads what only the reveal may: refused before the run is accused."""


Progress = Callable[[int, int], None]


def inputs(view: PublicRun) -> tuple[list[str], list[Msg], list[ToolUse]]:
    """The detector's whole input: agents (config order), messages, tool usage."""
    agents = list(view.agents)
    messages = [Msg(m.agent, m.text) for m in view.messages]
    tools = [ToolUse(t.agent, t.tool, t.success) for t in view.tool_usage]
    return agents, messages, tools


def ranking(scores: dict[str, float], session_id: str) -> list[str]:
    """Agents by score, highest first. Ties are broken by a hash of (run, agent): stable for a
    run, but never in favour of whoever the config lists first."""

    def tiebreak(agent: str) -> bytes:
        return hashlib.blake2b(f"{session_id}:{agent}".encode(), digest_size=8).digest()

    return sorted(scores, key=lambda a: (-scores[a], tiebreak(a)))


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), 4)


def result(
    *,
    view: PublicRun,
    method: str,
    methods_run: list[str],
    final: dict[str, float],
    rules: RuleScores,
    llm: dict[str, float] | None,
    weights: dict[str, float],
    warnings: list[str],
    model: str | None = None,
    extra: dict[str, Any] | None = None,
    calibrate_as: str | None = None,
) -> dict[str, Any]:
    agents = list(view.agents)
    order = ranking(final, view.run_id)
    top = order[0]
    second = final[order[1]] if len(order) > 1 else 0.0
    margin = final[top] - second
    calibrated_as = calibrate_as or method
    conf, calibrated = calibration.confidence(calibrated_as, margin, len(agents), model)
    # t agents tied at the top score: the suggestion among them is the tiebreak hash's, which
    # knows nothing of who the mole is, so it is right with probability at most 1/t (the
    # fitted map only sees the margin, 0 for any tie, and says 0.98 for a six-way one)
    tied = sum(1 for a in agents if final[a] == final[top])
    conf = min(conf, 1.0 / tied)
    if not calibrated:
        warnings = [
            *warnings,
            f"confidence is not calibrated for {calibration.key_for(calibrated_as, model)!r} "
            "(no fitted parameters shipped): read it as a rough score, not a probability",
        ]
    breakdown = {
        a: {
            "tool_usage": _r(rules.signals["tool_usage"][a]),
            "timing": _r(rules.signals["timing"][a]),
            "message_anomaly": _r(rules.signals["message_anomaly"][a]),
            "information_quality": _r(rules.signals["information_quality"][a]),
            "llm": _r(llm[a]) if llm is not None else None,
            "combined": _r(final[a]),
        }
        for a in agents
    }
    out: dict[str, Any] = {
        "session_id": view.run_id,
        "method": method,
        "suggested_mole": top,
        "confidence": round(conf, 4),
        "confidence_calibrated": calibrated,
        "margin": round(margin, 4),
        "suspicion_scores": {a: _r(final[a]) for a in agents},
        "score_breakdown": breakdown,
        "analysis_weights": weights,
        "methods_run": methods_run,
        "warnings": warnings,
        "ranking": order,
    }
    out.update(extra or {})
    return out


def analyze(
    journal: Journal,
    run_id: str,
    *,
    method: str = "rules",
    base_url: str | None = None,
    model: str | None = None,
    reveal: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Analyse one run with `method` (see METHODS); the blog's output format plus
    methods_run, warnings and, for causal/replay, intervals and forward runs. `replay` reads
    the recorded step seeds, which are as secret as the mole: it runs on a run accused already
    or with `reveal` (decision 61).

    Options: llm — `seed`, `timeout`, `max_tokens`, `journal_llm` (default True);
    causal — `k_max`, `k_min`, `batch`, `level`, `sequential`, `seed`, `concurrency`,
    `progress`, `executor` (ExecutorOptions); replay — `progress`."""
    _pick(options)
    _check_options(options)
    if method not in METHODS:
        raise DetectError(
            f"unknown detection method {method!r}; expected one of: " + ", ".join(METHODS)
        )
    view = public_view(journal, run_id)
    agents, messages, tools = inputs(view)
    if len(agents) < 2:
        n = len(agents)
        raise DetectError(
            f"run {view.run_id!r} has {n} agent{'' if n == 1 else 's'}; detection needs two"
        )
    live = view.status in ("recording", "paused")
    if live and method in ("causal", "replay"):
        raise DetectError(
            f"run {view.run_id!r} is still recording; the {method} detector re-runs the crew "
            "and needs an ended run (rules and llm work on a live one)"
        )
    if method == "replay":
        from engine.detect.causal import needs_a_heist

        needs_a_heist(view, method)  # another run is refused for what it is, first
    if method == "replay" and not reveal and view.verdict is None:
        raise SecretNeeded(
            f"the replay detector re-decides each step of run {view.run_id!r} with the seed it "
            "was recorded with, and those seeds are as secret as the mole (a deterministic "
            "policy reproduces every honest agent exactly with them); it runs after `car "
            "accuse` or with --reveal"
        )
    rules = rule_scores(messages, tools, agents)
    weights: dict[str, float] = dict(WEIGHTS)
    warnings: list[str] = []
    if live:
        # the blog's dashboard analyses a game after a few turns; say what was seen
        warnings.append(f"the run is still {view.status}: analysed its first {view.steps} steps")
    if not messages:
        warnings.append("the run has no messages: every rule signal is 0")
    if method == "rules":
        return result(
            view=view,
            method=method,
            methods_run=["rules"],
            final=rules.combined,
            rules=rules,
            llm=None,
            weights=weights,
            warnings=warnings,
        )
    if method in ("llm", "rules+llm"):
        return _with_llm(
            journal,
            view,
            method,
            rules,
            messages,
            tools,
            base_url,
            model,
            weights,
            warnings,
            options,
        )
    if method == "causal":
        from engine.detect.causal import causal_scores

        c = causal_scores(
            journal,
            view,
            **_pick(
                options,
                "k_max",
                "k_min",
                "batch",
                "level",
                "sequential",
                "seed",
                "concurrency",
                "progress",
                "executor",
            ),
        )
        warnings += c.warnings
        return result(
            view=view,
            method=method,
            methods_run=["causal"],
            final=c.scores,
            rules=rules,
            llm=None,
            weights=weights,
            warnings=warnings,
            extra=c.extra(),
        )
    from engine.detect.replay import replay_scores

    r = replay_scores(journal, view, base_url=base_url, model=model, **_pick(options, "progress"))
    warnings += r.warnings
    return result(
        view=view,
        method=method,
        methods_run=["replay"],
        final=r.scores,
        rules=rules,
        llm=None,
        weights=weights,
        warnings=warnings,
        extra=r.extra(),
    )


OPTIONS = frozenset(
    {
        "k_max",
        "k_min",
        "batch",
        "level",
        "sequential",
        "seed",
        "concurrency",
        "progress",
        "executor",
        "timeout",
        "max_tokens",
        "journal_llm",
    }
)


def _pick(options: dict[str, Any], *names: str) -> dict[str, Any]:
    """The options one method takes; a misspelt option fails rather than being ignored."""
    unknown = set(options) - OPTIONS
    if unknown:
        raise DetectError(f"unknown detection option(s): {', '.join(sorted(unknown))}")
    return {k: v for k, v in options.items() if k in names and v is not None}


def _check_options(options: dict[str, Any]) -> None:
    """Values a method could only fail on later — after journaling half a detection run, or
    deep in a socket call — refused before anything is read or written."""
    seed = options.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED
    ):
        raise DetectError(f"detection seed must be an integer within 0..{MAX_SEED}, got {seed!r}")
    timeout = options.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or not 0 < timeout <= MAX_TIMEOUT_S
    ):
        raise DetectError(
            f"detection timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
            f"got {timeout!r}"
        )
    max_tokens = options.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise DetectError(f"detection max_tokens must be a positive integer, got {max_tokens!r}")


def _with_llm(
    journal: Journal,
    view: PublicRun,
    method: str,
    rules: RuleScores,
    messages: Sequence[Msg],
    tools: Sequence[ToolUse],
    base_url: str | None,
    model: str | None,
    weights: dict[str, float],
    warnings: list[str],
    options: dict[str, Any],
) -> dict[str, Any]:
    from engine.detect import llm as L
    from engine.detect.journaling import journal_llm_step
    from engine.urls import http_url_problem

    agents = list(view.agents)
    url = base_url or L.DEFAULT_BASE_URL
    problem = http_url_problem(url)
    if problem is not None:  # said in one line, not degraded to the rules as a server down is
        raise ConfigError(f"bad LLM server URL {url!r}: {problem}")
    name = model or L.DEFAULT_MODEL
    given = options.get("seed")
    seed = int(given) if given is not None else _seed_for(view.run_id)  # --seed 0 is a seed
    prompt = L.build_prompt(rules, messages, tools, agents)
    answer = None
    parsed = None
    error = None
    try:
        answer = L.ask(
            prompt,
            base_url=url,
            model=name,
            seed=seed,
            timeout=float(options.get("timeout") or 60.0),
            max_tokens=int(options.get("max_tokens") or L.MAX_TOKENS),
        )
    except L.LlmUnavailable as e:
        error = str(e)
    if answer is not None:
        parsed = L.parse_scores(answer.raw, agents)
        warnings += parsed.warnings
    detection_run = None
    if options.get("journal_llm", True):
        detection_run = _journal_or_warn(
            warnings,
            journal_llm_step,
            journal,
            view.run_id,
            method=method,
            base_url=url,
            model=name,
            seed=seed,
            prompt=prompt,
            answer=answer,
            error=error,
            scores=parsed.scores if parsed is not None and parsed.usable else None,
            warnings=warnings,
        )
    extra = {
        "llm": {
            "base_url": url,
            "model": name,
            "seed": seed,
            "detection_run": detection_run,
            "error": error,
            "raw_answer": answer.raw if answer is not None else None,
        }
    }
    if parsed is None or not parsed.usable:
        if error is not None:
            warnings.append(f"{error}: degraded to the rules only")
        return result(
            view=view,
            method=method,
            methods_run=["rules"],
            final=rules.combined,
            rules=rules,
            llm=None,
            weights=weights,
            warnings=warnings,
            extra=extra,
            calibrate_as="rules",
        )
    llm_scores = parsed.scores
    if method == "llm":
        final = dict(llm_scores)
        weights = {**weights, "llm": 1.0}
        run = ["llm"]
    else:
        final = {a: RULE_WEIGHT * rules.combined[a] + LLM_WEIGHT * llm_scores[a] for a in agents}
        weights = {**weights, "rules": RULE_WEIGHT, "llm": LLM_WEIGHT}
        run = ["rules", "llm"]
    return result(
        view=view,
        method=method,
        methods_run=run,
        final=final,
        rules=rules,
        llm=llm_scores,
        weights=weights,
        warnings=warnings,
        model=answer.model if answer else name,
        extra=extra,
    )


def _journal_or_warn(notes: list[str], record: Any, *args: Any, **kwargs: Any) -> str | None:
    """Journal the LLM step; a journal that refuses the write (read-only, say) costs the
    record, not the analysis, and the output says so."""
    try:
        return str(record(*args, **kwargs))
    except JournalError as e:
        notes.append(f"the LLM step could not be journaled: {e}")
        return None


def _seed_for(run_id: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(f"detect:{run_id}".encode(), digest_size=4).digest(), "big"
    )
