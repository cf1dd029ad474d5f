"""The papers' reported figures beside the measured ones: each experiment file may carry `published: {source, metric,
values: {scale: {variant: value}}}`; a comparison gets the paper's delta (variant - baseline) and whether our paired
confidence interval contains it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from analysis.paired import PairedResult


@dataclass(frozen=True)
class PublishedDelta:
    scale: str
    variant: str
    metric: str
    paper_variant: float
    """The variant's reported value."""
    paper_baseline: float
    """The baseline's reported value."""
    paper_delta: float
    """paper_variant - paper_baseline."""
    ours: float
    """Our mean paired delta."""
    ci_low: float
    ci_high: float
    contains: bool | None
    """Whether our t interval contains the paper's delta (None without an interval)."""
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


def published_figures(experiment: str) -> dict:
    """The experiment file's `published` block, or {} (no such file in this checkout, or none given)."""
    from study.errors import StudyError
    from study.plan.experiment import load_experiment

    try:
        return load_experiment(experiment).published
    except StudyError:
        return {}


def published_deltas(published: dict, results: dict[str, list[PairedResult]], baseline: str) -> list[PublishedDelta]:
    """Every measured comparison whose variant and baseline both have a reported value at its scale."""
    metric = published.get("metric")
    out = []
    for r in results.get(metric, []):
        at = published.get("values", {}).get(r.scale, {})
        if r.variant not in at or baseline not in at:
            continue
        paper = float(at[r.variant]) - float(at[baseline])
        has_ci = r.n >= 2 and r.ci_low == r.ci_low and r.ci_high == r.ci_high
        out.append(PublishedDelta(r.scale, r.variant, metric, float(at[r.variant]), float(at[baseline]), paper,
                                  r.mean_delta, r.ci_low, r.ci_high,
                                  (r.ci_low <= paper <= r.ci_high) if has_ci else None,
                                  str(published.get("source", ""))))
    return out
