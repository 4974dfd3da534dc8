"""Policies by name, rebuilt from the spec journaled in RunStarted (or given to do_policy).

A policy is built by a factory `(spec) -> Policy` found by its name: the built-in ones are
"module:attr" references imported on first use (the sim crew lives with its scenario; the
core never imports it until a run asks for it), others are added with `register_policy`."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from engine.errors import ConfigError
from engine.policies.base import AgentView, Completion, Policy

PolicyFactory = Callable[[dict[str, Any]], Policy]

#: Built-in policies by name, as "module:attr" references to their factories.
BUILTIN_POLICIES: dict[str, str] = {
    "sim": "engine.heist.sim:sim_policy",
    "sim-honest": "engine.heist.sim:sim_policy",
    "openai": "engine.policies.openai_policy:openai_policy",
}
POLICY_NAMES = tuple(BUILTIN_POLICIES)

_factories: dict[str, str | PolicyFactory] = dict(BUILTIN_POLICIES)
_loaded: dict[str, PolicyFactory] = {}
_lock = threading.Lock()


class HonestPolicy:
    """Wraps a policy so the acting agent never sees secret instructions: an agent given a
    secret plays as if it had none. Used as do_policy(k, <name>-honest) to ask "would an honest
    agent have changed the outcome?"."""

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


def register_policy(name: str, factory: str | PolicyFactory) -> None:
    """Register (or replace) the factory of policy `name`: a "module:attr" reference or the
    factory itself."""
    if not name or not isinstance(name, str):
        raise ConfigError(f"a policy needs a non-empty name, got {name!r}")
    with _lock:
        _factories[name] = factory
        _loaded.pop(name, None)


def unregister_policy(name: str) -> None:
    """Forget a registered policy (a built-in one returns to its built-in reference)."""
    with _lock:
        _loaded.pop(name, None)
        if name in BUILTIN_POLICIES:
            _factories[name] = BUILTIN_POLICIES[name]
        else:
            _factories.pop(name, None)


def policy_names() -> tuple[str, ...]:
    """Every policy name make_policy knows: the built-in ones first, then registered ones."""
    with _lock:
        return tuple(_factories)


def _factory(name: str) -> PolicyFactory:
    with _lock:
        hit = _loaded.get(name)
        target = _factories.get(name)
    if hit is not None:
        return hit
    if target is None:
        raise ConfigError(f"unknown policy {name!r}; expected one of: {', '.join(policy_names())}")
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        try:
            factory: PolicyFactory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"policy {name!r} cannot be loaded from {target!r}: {e}") from e
    else:
        factory = target
    with _lock:
        _loaded[name] = factory
    return factory


def load_policy(name: str) -> None:
    """Import the code of policy `name` now (e.g. before forking workers, so that each
    inherits it instead of importing it again at its first branch); an unknown or broken
    name fails as make_policy would."""
    _factory(name)


def make_policy(spec: dict[str, Any]) -> Policy:
    """Build a policy from its spec dict; an unknown name fails listing the valid ones."""
    name = spec.get("name")
    if not isinstance(name, str):
        raise ConfigError(f"unknown policy {name!r}; expected one of: {', '.join(policy_names())}")
    return _factory(name)(spec)


def policy_spec(policy: Policy) -> dict[str, Any]:
    """The journaled description of a policy, enough for make_policy to rebuild it."""
    spec = getattr(policy, "spec", None)
    if callable(spec):
        return dict(spec())
    out: dict[str, Any] = {"name": policy.name}
    drift = getattr(policy, "drift", None)
    if drift is not None:
        out["drift"] = drift
    drift_seed = getattr(policy, "drift_seed", None)
    if drift_seed is not None:
        out["drift_seed"] = drift_seed
    return out
