"""How an experiment decides its comparisons: the `decision:` block of an experiment file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from study.config.validate import is_number, refuse_unknown
from study.errors import StudyError


@dataclass(frozen=True)
class DecisionRule:
    """How an experiment decides (`decision:` in its file); everything has a default but the margin."""

    metric: str = "val/loss"
    """The primary metric: its comparisons form the Holm-corrected family."""
    margin: float | None = None
    """Equivalence margin on the primary metric, in its own units (|delta| < margin counts as no difference);
    None: no equivalence verdicts."""
    margins: dict[str, float] | None = None
    """Equivalence margins of secondary metrics (`eval/arc_easy/acc: 0.01`); a metric without one gets no
    equivalence verdict."""
    alpha: float = 0.05
    """Error rate: family-wise for the primary family, false discovery rate for the secondary metrics."""
    power: float = 0.8
    """Power used for the minimum detectable effect and the seeds needed."""
    prior_sd: float | None = None
    """Seed-to-seed sd of paired deltas on the primary metric assumed before any run exists (planning only)."""

    def margin_of(self, metric: str) -> float | None:
        """The equivalence margin of ``metric``, if one is declared."""
        return self.margin if metric == self.metric else (self.margins or {}).get(metric)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None, where: str = "decision") -> "DecisionRule":
        """Checked rule from an experiment file's `decision:` block (None: defaults)."""
        raw = dict(raw or {})
        allowed = sorted(cls.__dataclass_fields__)
        refuse_unknown(raw, allowed, where, "a decision key", f"use only {', '.join(allowed)}")
        if not isinstance(raw.get("metric", "val/loss"), str):
            raise StudyError(f"{where}.metric", "must be a metric name", "e.g. metric: val/loss")
        for key in ("margin", "prior_sd"):
            value = raw.get(key)
            if value is not None and (not is_number(value) or value <= 0):
                raise StudyError(f"{where}.{key}", f"must be a positive number, got {value!r}",
                                 f"e.g. {key}: 0.01 (in the metric's own units)")
        margins = raw.get("margins") or {}
        if not isinstance(margins, dict) or any(not is_number(v) or v <= 0 for v in margins.values()):
            raise StudyError(f"{where}.margins", "must map metric names to positive numbers",
                             "e.g. margins: {eval/arc_easy/acc: 0.01}")
        for key, low, high in (("alpha", 0.0, 0.5), ("power", 0.5, 1.0)):
            value = raw.get(key, getattr(cls, key))
            if not is_number(value) or not low < value < high:
                raise StudyError(f"{where}.{key}", f"must lie strictly between {low} and {high}, got {value!r}",
                                 f"e.g. {key}: {getattr(cls, key)}")
        return cls(**{**raw, "margins": {str(k): float(v) for k, v in margins.items()} or None})
