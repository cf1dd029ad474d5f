"""The papers' reported figures beside ours, compared as deltas against the baseline in nats: their absolute losses
come from another corpus and tokenizer, but a design's effect compares (log(ppl_variant / ppl_baseline) is the
difference of the mean losses). Our side is the paired mean val/loss delta with its t interval; each published value
keeps its source and whether it was verified there (study.plan.experiment.Published).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from analysis.records import JsonRecord

if TYPE_CHECKING:
    from analysis.paired import PairedResult
    from study.plan.experiment import Published

OURS = "val/loss"
"""Our side of every comparison: the paired delta of the final validation loss, in nats per token."""


@dataclass(frozen=True)
class PublishedDelta(JsonRecord):
    scale: str
    variant: str
    baseline: str
    metric: str
    """What the paper reported (val/loss or val/ppl)."""
    paper_baseline: float
    """The baseline's reported value, in `metric`."""
    paper_variant: float
    """The variant's reported value, in `metric`."""
    paper_delta_nats: float
    """The paper's variant against its baseline in nats: the log of a perplexity ratio, or a loss difference."""
    baseline_source: str
    variant_source: str
    baseline_verified: bool
    variant_verified: bool
    ours: float
    """Our mean paired val/loss delta (variant - baseline), in nats."""
    ci_low: float
    ci_high: float
    """Our t 95% interval (NaN below two seed pairs)."""
    n: int
    """Seed pairs behind ours."""
    consistent: bool | None
    """Whether our t interval contains the paper's delta (None without an interval)."""

    @property
    def verified(self) -> bool:
        """Both values of the pair were read in their source."""
        return self.baseline_verified and self.variant_verified

    def to_dict(self) -> dict:
        return {**asdict(self), "verified": self.verified}


def published_figures(experiment: str) -> Published | None:
    """The experiment file's `published:` block; None without one or without the file; a malformed block raises."""
    from study.errors import StudyError
    from study.plan.experiment import load_experiment

    try:
        return load_experiment(experiment).published
    except StudyError as err:
        if err.field == "EXPERIMENT":
            return None
        raise


def delta_nats(metric: str, variant: float, baseline: float) -> float:
    """A published pair as a loss delta in nats: perplexity is exp(mean loss), so its ratio's log is the loss delta."""
    return math.log(variant / baseline) if metric.endswith("/ppl") else variant - baseline


def published_deltas(published: Published | None, results: dict[str, list[PairedResult]],
                     baseline: str) -> list[PublishedDelta]:
    """Every measured val/loss comparison whose variant and baseline both have a published value at its scale."""
    if published is None:
        return []
    out = []
    for r in results.get(OURS, []):
        at = published.values.get(r.scale, {})
        if r.variant not in at or baseline not in at:
            continue
        theirs, base = at[r.variant], at[baseline]
        paper = delta_nats(published.metric, theirs.value, base.value)
        has_ci = r.n >= 2 and math.isfinite(r.ci_low) and math.isfinite(r.ci_high)
        out.append(PublishedDelta(r.scale, r.variant, baseline, published.metric, base.value, theirs.value, paper,
                                  base.source, theirs.source, base.verified, theirs.verified, r.mean_delta,
                                  r.ci_low, r.ci_high, r.n, (r.ci_low <= paper <= r.ci_high) if has_ci else None))
    return out
