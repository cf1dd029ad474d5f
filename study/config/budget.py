"""The parameter budget a variant meets, and which free dimension meets it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BudgetConfig:
    mode: str = "non_embedding"
    """What the budget counts: `non_embedding` (every parameter but the embeddings, norm gains included),
    `matrices` (attention + FFN matrices: the papers' arithmetic) or `total` (every parameter)."""
    match: str = "ffn"
    """Free dimension solved to meet the budget: none, ffn, depth, attention or width."""
    tolerance: float = 1e-5
    """Largest accepted |counted - budget| / budget."""
    target: int = 0
    """The budget in parameters. 0: the count of the scale's reference conventional model with the same settings
    (the planner fills it in for every run of an experiment, the experiment's shared settings included)."""
