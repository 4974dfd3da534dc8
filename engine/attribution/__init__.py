"""Causal attribution by counterfactual forward runs: which step caused a failure, how sure.

Estimators (`contrastive`, `shapley`) are generic over any `ForwardModel`; synthetic SCMs
(`scm`) are forward models with exact ground truth, and `validate` compares the two.

The package itself exports what the default `car attribute` uses (the forward-model contract
and the contrastive estimator), which needs no numpy: numpy's import is 0.1 s of serial
start-up in front of every worker pool. Shapley (`engine.attribution.shapley`), the SCMs
(`engine.attribution.scm`) and validation (`engine.attribution.validate`) need numpy and are
imported from their own modules.
"""

from engine.attribution.base import (
    ForwardModel,
    ForwardRequest,
    Player,
    PlayersKind,
    Progress,
    players_of,
)
from engine.attribution.contrastive import (
    ContrastiveMode,
    ContrastiveResult,
    StepEffect,
    contrastive,
)

__all__ = [
    "ContrastiveMode",
    "ContrastiveResult",
    "ForwardModel",
    "ForwardRequest",
    "Player",
    "PlayersKind",
    "Progress",
    "StepEffect",
    "contrastive",
    "players_of",
]
