"""Causal attribution by counterfactual forward runs: which step caused a failure, how sure.

Estimators (`contrastive`, `shapley`) are generic over any `ForwardModel`; synthetic SCMs
(`scm`) are forward models with exact ground truth, and `validate` compares the two.
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
from engine.attribution.scm import SCM, builtin_models, find_model, load_scm, model_summary
from engine.attribution.shapley import PlayerValue, ShapleyResult, shapley
from engine.attribution.validate import ValidationReport, validate

__all__ = [
    "SCM",
    "ContrastiveMode",
    "ContrastiveResult",
    "ForwardModel",
    "ForwardRequest",
    "Player",
    "PlayerValue",
    "PlayersKind",
    "Progress",
    "ShapleyResult",
    "StepEffect",
    "ValidationReport",
    "builtin_models",
    "contrastive",
    "find_model",
    "load_scm",
    "model_summary",
    "players_of",
    "shapley",
    "validate",
]
