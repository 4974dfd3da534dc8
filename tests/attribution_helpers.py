"""What the attribution estimator tests share: the built-in SCMs, a recording wrapper, and a
forward model whose outcome is a rule of the kept steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.attribution import ForwardRequest
from engine.attribution.scm import SCM, builtin_models

MODELS = {m.name: m for m in builtin_models()}


class Recording:
    """A ForwardModel wrapper that keeps every request it was asked to run."""

    def __init__(self, model: SCM) -> None:
        self.model = model
        self.requests: list[ForwardRequest] = []
        self.batches = 0

    @property
    def n_steps(self) -> int:
        return self.model.n_steps

    @property
    def step_agents(self) -> Sequence[str | None]:
        return self.model.step_agents

    @property
    def step_labels(self) -> Sequence[str]:
        return self.model.step_labels

    def run_batch(self, requests: Sequence[ForwardRequest]) -> list[bool]:
        self.requests.extend(requests)
        self.batches += 1
        return self.model.run_batch(requests)


class Rule:
    """A forward model whose outcome is a fixed boolean function of the kept steps; it keeps
    every request it was asked to run."""

    def __init__(
        self,
        n: int,
        bad: Callable[[frozenset[int]], bool],
        agents: Sequence[str | None] | None = None,
    ) -> None:
        self.n = n
        self.bad = bad
        self.agents = list(agents) if agents is not None else [None] * n
        self.requests: list[ForwardRequest] = []

    @property
    def n_steps(self) -> int:
        return self.n

    @property
    def step_agents(self) -> Sequence[str | None]:
        return self.agents

    @property
    def step_labels(self) -> Sequence[str]:
        return [f"s{i}" for i in range(self.n)]

    def run_batch(self, requests: Sequence[ForwardRequest]) -> list[bool]:
        self.requests.extend(requests)
        return [self.bad(r.keep) for r in requests]
