"""Causal attribution by counterfactual forward runs: which step caused a failure, how sure.

Estimators (`contrastive`, `shapley`) are generic over any `ForwardModel`; synthetic SCMs
(`scm`) are forward models with exact ground truth, and `validate` compares the two.
"""

from engine.attribution.base import ForwardModel, ForwardRequest, Player, players_of
from engine.attribution.contrastive import ContrastiveResult, StepEffect, contrastive
from engine.attribution.scm import SCM, builtin_models, find_model, load_scm
from engine.attribution.shapley import PlayerValue, ShapleyResult, shapley
from engine.attribution.validate import ValidationReport, validate

__all__ = [
    "SCM",
    "ContrastiveResult",
    "ForwardModel",
    "ForwardRequest",
    "Player",
    "PlayerValue",
    "ShapleyResult",
    "StepEffect",
    "ValidationReport",
    "builtin_models",
    "contrastive",
    "find_model",
    "load_scm",
    "players_of",
    "shapley",
    "validate",
]
