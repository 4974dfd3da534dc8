"""An agent's public reference policy: its configured role and nothing else.

The causal and replay detectors ask "what would this agent have done if it were exactly what
the crew config says it is?". The answer must not come from the secret: the reference view of
an agent is built from the public crew config (its name, role, goal and tools, rendered into
its system prompt with no instructions appended), the public conversation and the agent's own
tool results. Its `mole_strategy` is always unset — set, never read — whoever the agent is.

- `sim`: the sim with the agent's role and no secret (`SimReferencePolicy`).
- `openai`: the run's own model and settings, sent the messages rendered from the public view.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.heist.prompts import render_messages, system_prompt
from engine.heist.session import HeistScenario
from engine.heist.sim import SimReferencePolicy
from engine.policies.base import AgentView, Completion, Policy
from engine.policies.registry import make_policy
from engine.state import State


def reference_inner(spec: dict[str, Any]) -> Policy:
    """The model that plays reference agents for a run recorded with policy `spec`."""
    name = str(spec.get("name", ""))
    if name.startswith("sim"):
        return SimReferencePolicy()
    return make_policy({k: v for k, v in spec.items() if k != "drift"})


class ReferenceView:
    """Builds reference views for one scenario: public prompt, no secret."""

    def __init__(self, scenario: HeistScenario) -> None:
        cfg = scenario.config
        self.scenario = scenario
        self.prompts = {a.name: system_prompt(a, cfg, None) for a in cfg.agents}
        self.roles = {a.name: a.role for a in cfg.agents}

    def of(self, view: AgentView) -> AgentView:
        """`view` with the public system prompt and no strategy (whatever it carried)."""
        return msgspec.structs.replace(
            view, system_prompt=self.prompts[view.agent], mole_strategy=None
        )

    def from_state(self, state: State, run_id: str) -> AgentView:
        """The acting agent's reference view of s_k, read without touching any secret field of
        the state (only the public transcript and the agent's own tool results)."""
        agents = self.scenario.agents
        agent = agents[state.step % len(agents)]
        ctx = state.contexts.get(agent)
        return AgentView(
            run_id=run_id,
            step=state.step,
            round=state.step // len(agents),
            agent=agent,
            role=self.roles[agent],
            system_prompt=self.prompts[agent],
            agents=agents,
            transcript=state.transcript,
            observations=ctx.observations if ctx is not None else (),
            mole_strategy=None,
            rounds=self.scenario.rounds,
        )


class SwapOne:
    """A policy that plays `agent` by its public reference and everyone else as recorded."""

    def __init__(self, base: Policy, agent: str, views: ReferenceView, inner: Policy) -> None:
        self.base = base
        self.agent = agent
        self.views = views
        self.inner = inner
        self.name = f"reference:{agent}"

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion:
        if view.agent != self.agent:
            return self.base.decide(view, messages, seed)
        public = self.views.of(view)
        return self.inner.decide(public, render_messages(public), seed)
