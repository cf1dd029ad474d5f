"""What the report says about one experiment, as one value (`Analysis`): computed by `analysis.report`, written by
`analysis.document`, so the writer never reaches back into the code that computes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from analysis.compute import EffectiveCompute
from analysis.decide import Decision
from analysis.paired import JointResult, PairedResult
from analysis.scaling import ScalingReport
from analysis.surface import SurfaceReport
from analysis.time_to_target import TimeReport
from analysis.tuning import TuneCurve, VerdictPair
from study.config.decision import DecisionRule

HEADLINE = "val/loss"
"""The metric of the headline table and of the scaling fit, when the runs logged it."""


@dataclass(frozen=True)
class Analysis:
    """Everything the report says about one experiment, before it is written anywhere."""

    experiment: str
    """MLflow experiment name."""
    uri: str
    """Tracking URI it was read from."""
    baseline: str
    """Variant every delta is measured against."""
    metrics: list[str]
    """Final metrics compared; the first heads the report."""
    runs: pd.DataFrame
    """One row per training run decided on (analysis.run_table.read_study: the tuned runs when there are any)."""
    results: dict[str, list[PairedResult]]
    """Paired deltas per metric."""
    joint: list[JointResult]
    """Mean-across-tasks deltas."""
    scaling: ScalingReport | None
    """Scaling fits of val/loss, when logged."""
    n_resamples: int
    """Bootstrap resamples per interval."""
    rule: DecisionRule = DecisionRule()
    """How comparisons are decided (the experiment file's `decision:` block)."""
    decisions: list[Decision] = field(default_factory=list)
    """The decision table: primary family first, then secondary metrics."""
    looks: list[dict] = field(default_factory=list)
    """Looks of an adaptive (`--until-decided`) launch; empty for a fixed-seed one."""
    sequential_note: str = ""
    """How the primary verdicts were reached when the launch was adaptive."""
    items: list = field(default_factory=list)
    """Downstream-task deltas with two-level (seed, item) bootstrap intervals (analysis.items.ItemDelta)."""
    curves: pd.DataFrame = field(default_factory=pd.DataFrame)
    """val/loss histories of the finished runs (analysis.run_table.read_curves)."""
    tuned: bool = False
    """The runs decided on trained at their own tuned LRs (study.lr_source = tune)."""
    tune_curves: list[TuneCurve] = field(default_factory=list)
    """Each variant's LR grid from its tune runs, with the LR chosen."""
    shared_runs: int = 0
    """Main runs at the shared LR beside the tuned ones (not decided on)."""
    verdict_pairs: list[VerdictPair] = field(default_factory=list)
    """Every comparison decided at the shared LR and at the tuned LRs, flips flagged."""
    compute: EffectiveCompute | None = None
    """Effective compute multipliers from fits of val/loss against training compute, when logged."""
    time: TimeReport | None = None
    """GPU-hours to the baseline's final val/loss and the throughput-adjusted verdicts, when logged."""
    surface: SurfaceReport | None = None
    """The L(N, D) (or L(D)) fits over the decay branches and what they say; None without branches."""
    race: dict | None = None
    """The racing record (analysis.race_report); None for an experiment that did not race."""
    run_notes: tuple[str, ...] = ()
    """What the store held that the report left out (analysis.run_table.StudyRuns.notes)."""

    @property
    def flat(self) -> list[PairedResult]:
        """Every paired result, metric by metric."""
        return [r for m in self.metrics for r in self.results[m]]
