"""Policies by name, rebuilt from the spec journaled in RunStarted (or given to do_policy)."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.errors import ConfigError
from engine.policies.base import AgentView, Completion, Policy

POLICY_NAMES = ("sim", "sim-honest", "openai")


class HonestPolicy:
    """Wraps a policy so the acting agent never sees secret instructions: the mole plays as an
    honest crew member. Used as do_policy(k, sim-honest) to ask "would an honest agent have
    saved the heist?"."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = f"{inner.name}-honest"

    def spec(self) -> dict[str, Any]:
        return {**policy_spec(self.inner), "name": self.name}

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion:
        if view.mole_strategy is not None:
            view = msgspec.structs.replace(view, mole_strategy=None)
        return self.inner.decide(view, messages, seed)

    def cancel(self) -> None:
        """Abort the inner policy's call in flight, when it can be aborted."""
        cancel = getattr(self.inner, "cancel", None)
        if callable(cancel):
            cancel()


def make_policy(spec: dict[str, Any]) -> Policy:
    """Build a policy from its spec dict; an unknown name fails listing the valid ones."""
    name = spec.get("name")
    if name in ("sim", "sim-honest"):
        from engine.policies.sim import SimPolicy

        try:
            drift = float(spec.get("drift", 0.0) or 0.0)
            sim = SimPolicy(drift=drift)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"bad sim policy spec {spec!r}: {e}") from e
        return HonestPolicy(sim) if name == "sim-honest" else sim
    if name == "openai":
        from engine.policies.openai_policy import (
            DEFAULT_BASE_URL,
            DEFAULT_MAX_REPLY_BYTES,
            OpenAIPolicy,
        )

        # OpenAIPolicy checks every value's type and range itself (ConfigError, one line)
        return OpenAIPolicy(
            base_url=str(spec.get("base_url") or DEFAULT_BASE_URL),
            model=str(spec.get("model") or "local-model"),
            temperature=spec.get("temperature", 0.8),
            max_tokens=spec.get("max_tokens", 160),
            timeout=spec.get("timeout", 60.0),
            max_retries=spec.get("max_retries", 2),
            max_reply_bytes=spec.get("max_reply_bytes", DEFAULT_MAX_REPLY_BYTES),
        )
    raise ConfigError(f"unknown policy {name!r}; expected one of: {', '.join(POLICY_NAMES)}")


def policy_spec(policy: Policy) -> dict[str, Any]:
    """The journaled description of a policy, enough for make_policy to rebuild it."""
    spec = getattr(policy, "spec", None)
    if callable(spec):
        return dict(spec())
    out: dict[str, Any] = {"name": policy.name}
    drift = getattr(policy, "drift", None)
    if drift is not None:
        out["drift"] = drift
    return out
