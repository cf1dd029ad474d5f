"""Downstream (lm-eval) evaluation settings (none of them changes a run's key)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=lambda: ["arc_easy", "hellaswag", "piqa"])
    """lm-eval task names; the shipped offline tasks are arc_easy_local, hellaswag_local, piqa_local, sciq_local."""
    after_train: bool = False
    """Evaluate the final checkpoint at the end of training."""
    limit: int = 0
    """Examples per task; 0 means all."""
    num_fewshot: int = 0
    """Solved examples put before each prompt (lm-eval's num_fewshot)."""
    batch_size: int = 16
    """Requests per forward pass."""
