"""The verdict on the user's accusation after a heist (the blog's HeistController).

Recording the verdict as an event is the runtime's job; this module only decides it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from engine.errors import ConfigError
from engine.heist.mole import Strategy


class Verdict(enum.Enum):
    """SUCCESS: the suspect is the mole; FAILURE: a wrong agent; BUSTED: nobody was named."""

    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"
    BUSTED = "BUSTED"


def accuse(mole: str, suspect: str | None, agents: Sequence[str]) -> Verdict:
    """Judge an accusation. A blank suspect counts as no suspect; unknown names are errors."""
    crew = list(agents)
    if mole not in crew:
        raise ConfigError(f"mole {mole!r} is not in the crew; agents are: {', '.join(crew)}")
    if suspect is None or not suspect.strip():
        return Verdict.BUSTED
    name = suspect.strip()
    if name not in crew:
        raise ConfigError(f"unknown suspect {suspect!r}; agents are: {', '.join(crew)}")
    return Verdict.SUCCESS if name == mole else Verdict.FAILURE


class HeistController:
    """Holds the secret (mole and strategy) of one heist and judges accusations against it."""

    def __init__(self, agents: Sequence[str], mole: str, strategy: Strategy) -> None:
        self.agents = tuple(agents)
        if mole not in self.agents:
            raise ConfigError(f"mole {mole!r} is not in the crew; agents are: {', '.join(agents)}")
        self.mole = mole
        self.strategy = strategy

    def accuse(self, suspect: str | None) -> Verdict:
        """The verdict for naming `suspect` (None or blank: no suspect)."""
        return accuse(self.mole, suspect, self.agents)

    def reveal(self) -> tuple[str, Strategy]:
        """The mole and its strategy, shown after the verdict."""
        return self.mole, self.strategy
