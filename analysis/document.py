"""The report as blocks: the answer first (a sentence per scale, the forest plot, a compact decision table), then
the scaling figure, the decay branches' fits and the race, the secondary metrics, the descriptive tables, fits,
figures and method; all of it from one value, :class:`Analysis` (computed by `analysis.report`), so the writer never
reaches back into the code that computes."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Mapping, Sequence

import pandas as pd

from analysis import run_table
from analysis.compute import RANGE, EffectiveCompute, Multiplier
from analysis.decide import BOOTSTRAP_MIN_N, CORRECTION, Decision
from analysis.paired import JointResult, PairedResult, is_higher_better
from analysis.power import seeds_phrase
from analysis.render import MISSING, Block, Details, Heading, Paragraph, Plot, Table, number
from analysis.scaling import ScalingReport
from analysis.surface import PLANNED, SURFACE, TOKENS, SurfaceFit, SurfaceReport
from analysis.time_to_target import TimeReport
from analysis.tuning import TRANSFER, TuneCurve, VerdictPair
from study.config.decision import DecisionRule
from study.config.secrets import mask_text
from study.plan.paired_t import VERDICTS
from study.schema import TAG_EVAL, TAG_LR_SOURCE

if TYPE_CHECKING:
    from analysis.published import PublishedDelta


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
    """The racing record (analysis.racing.read_race); None for an experiment that did not race."""
    run_notes: tuple[str, ...] = ()
    """What the store held that the report left out (analysis.run_table.StudyRuns.notes)."""

    @property
    def flat(self) -> list[PairedResult]:
        """Every paired result, metric by metric."""
        return [r for m in self.metrics for r in self.results[m]]


def document(a: Analysis, unpaired: list[dict], plots: Mapping[str, Plot],
             published: Sequence[PublishedDelta] = (), profile: Sequence[Block] = ()) -> list[Block]:
    """Every block of the report, in reading order; `plots` by their place (analysis.report._plots), `profile` the
    reference work profile section. The first screen answers (a 1,280-pixel window); the rest sits folded below."""
    statuses = Counter(a.runs["status"])
    rule = a.rule
    primary = [d for d in a.decisions if d.family == "primary"]
    secondary = [d for d in a.decisions if d.family == "secondary"]
    counts = Counter(d.verdict for d in primary)
    alpha = primary[0].alpha if primary else rule.alpha
    blocks: list[Block] = [Heading(f"Report: {a.experiment}", 1), Heading(f"Decisions on final {rule.metric}")]
    if primary:
        blocks += [Paragraph(_scale_sentence(scale, [d for d in primary if d.scale == scale]))
                   for scale in dict.fromkeys(d.scale for d in primary)]
        blocks += [*([plots["decisions"]] if "decisions" in plots else []), _compact_table(primary)]
    else:
        blocks.append(Paragraph(f"No run logged {rule.metric}: nothing to decide."))
    blocks += [
        Paragraph(f"{', '.join(f'{counts[v]} {v}' for v in VERDICTS)}. Each row pairs the variant with "
                  f"{a.baseline} over the seeds both finished. Primary family: every variant × scale on "
                  f"{rule.metric}, Holm-corrected at family-wise α = {alpha:g}. "
                  + (f"Equivalent: TOST shows |Δ| < {rule.margin:g} (Holm-corrected). " if rule.margin else
                     "No equivalence margin is declared (decision.margin), so no row can be called equivalent. ")
                  + "Undecided rows say how many seed pairs would probably decide them. " + _INTERVALS
                  + (f" {a.sequential_note}" if a.sequential_note else "")),
        Paragraph(f"Baseline {a.baseline}. {len(a.runs)} training runs ("
                  + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()))
                  + f"). Metrics: {', '.join(a.metrics)}. Store: {mask_text(a.uri)}. "
                  f"Written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC."
                  + "".join(f" {note}" for note in a.run_notes)),
        *([Paragraph(_TUNED + (f"; the {a.shared_runs} runs at the shared LR are decided beside them under 'Shared "
                               "LR against tuned LR'" if a.shared_runs else "") + "."
                     + (" Tune runs are shown under 'Tuning curves', never paired." if a.tune_curves else ""))]
          if a.tuned else []),
    ]
    if primary:
        blocks.append(Details(f"Every statistic of the {len(primary)} primary comparisons (adjusted p, sign-flip, "
                              "Wilcoxon, d_z, MDE, TOST)", [_decision_table(primary)]))
    if a.looks:
        blocks += [Heading("Sequential looks", 3), Table(
            ["look", "α this look", "α spent so far", "verdicts", "seeds added after it"],
            [[str(look["round"]), f"{look['alpha']:.4g}", f"{look['alpha_spent']:.4g}",
              ", ".join(f"{k} {v}" for k, v in sorted(look["verdicts"].items())), ", ".join(look["added"]) or "—"]
             for look in a.looks])]
    if "scaling" in plots:
        blocks += [Heading(f"Scaling of final {a.scaling.metric}"), plots["scaling"]]
    if a.surface is not None:
        blocks += _surface_blocks(a.surface, plots.get("surface"))
    blocks += race_blocks(a.race, a.rule.metric)
    if secondary:
        blocks += [Heading("Secondary metrics"),
                   Paragraph("Other metrics and downstream tasks, Benjamini-Hochberg-corrected together "
                             f"(false discovery rate {alpha:g}); equivalence only where decision.margins names a "
                             "margin."),
                   *([plots["secondary"]] if "secondary" in plots else []),
                   Details(f"Every statistic of the {len(secondary)} secondary comparisons",
                           [_decision_table(secondary, with_metric=True)])]
    if a.verdict_pairs:
        blocks += _flip_blocks(a.verdict_pairs)
    headline = a.metrics[0]
    verdicts = {(d.metric, d.scale, d.variant): d.verdict for d in a.decisions}
    blocks.append(Heading(f"Final {headline} per scale"))
    for scale in run_table.scale_order(a.runs):
        blocks += _per_scale(a.runs, a.results[headline], headline, a.baseline, scale, verdicts, a.compute)
    if a.compute is not None:
        blocks += _compute_blocks(a.compute)
    if a.time is not None:
        blocks += _time_blocks(a.time, verdicts, rule.metric)
    blocks += [Heading("Paired deltas, every metric (descriptive)"),
               Paragraph(f"Bootstrap intervals are descriptive and shown only from {BOOTSTRAP_MIN_N} pairs: over "
                         "fewer seeds a bootstrap has too few distinct resamples (3 seeds give 10) and comes out "
                         "narrower than the t interval."),
               Details(f"Paired deltas of {len(a.results)} metrics: mean ± sd, t and bootstrap intervals, Wilcoxon, "
                       "win rate",
                       [b for metric, rs in a.results.items() for b in (
                           Heading(f"{metric} ({'higher' if is_higher_better(metric) else 'lower'} is better)", 3),
                           _deltas_table(rs))])]
    if a.joint:
        blocks += [Heading("Mean across downstream tasks (joint bootstrap, descriptive)"),
                   Paragraph("Δ averaged over the tasks listed; each bootstrap draw resamples seeds once for all "
                             "tasks, so tasks that move together widen the interval as they should."),
                   Table(["metrics", "scale", "variant", "n", "mean Δ across tasks", "joint bootstrap 95% CI"],
                         # acc over arc_easy, piqa for eval/arc_easy/acc and eval/piqa/acc
                         [[f"{j.metrics[0].split('/')[2]} over {', '.join(m.split('/')[1] for m in j.metrics)}",
                           j.scale, j.variant, str(j.n), number(j.mean_delta, "+.4f"),
                           _boot(j.boot_ci_low, j.boot_ci_high, j.boot_method, j.n)] for j in a.joint])]
    if a.items:
        blocks += [Heading("Downstream tasks, item level (descriptive)"),
                   Paragraph("Per task and per-item score: each side's absolute mean (accuracy, or the log-likelihood "
                             "of the correct choice, which every item informs and so is far less noisy at small "
                             "scale) beside the items scored and the accuracy of a random guess on them (the mean of "
                             "1 / the number of choices), the paired Δ over seeds and items, and a two-level bootstrap "
                             "interval that resamples seeds, then items (analysis.items). Scores are each run's "
                             f"evaluation of record, the one with its configured eval settings (tag {TAG_EVAL}<task>); "
                             "re-evaluations with another limit or few-shot count are never used."),
                   Table(["task", "score", "scale", "variant", "seeds", "items", "chance", f"{a.baseline} mean",
                          "variant mean", "Δ", "seed × item 95% CI"],
                         [[i.task, i.metric, i.scale, i.variant, str(i.n_seeds), str(i.n_items),
                           number(i.chance), number(i.baseline_mean),
                           number(i.variant_mean), number(i.mean_delta, "+.4f"), _ci(i.ci_low, i.ci_high)]
                          for i in a.items])]
    if published:
        blocks += _published_blocks(published, a.baseline)
    if a.scaling is not None:
        blocks += [Heading(f"Scaling fits of final {a.scaling.metric}"), *_scaling_blocks(a.scaling)]
    if a.tune_curves:
        blocks += _tuning_blocks(a.tune_curves)
    blocks += [*profile, *_missing(a.runs, unpaired, a.metrics)]
    rest = [plots[k] for k in ("loss_curves", "tuning") if k in plots]
    blocks += [*([Heading("Figures"), *rest] if rest else []), Heading("Method"),
               Paragraph(_METHOD.format(n_resamples=a.n_resamples, min_n=BOOTSTRAP_MIN_N))]
    return blocks


def _published_blocks(published: Sequence[PublishedDelta], baseline: str) -> list[Block]:
    rows = []
    for p in published:
        source = (p.variant_source if p.variant_source == p.baseline_source
                  else f"{p.baseline}: {p.baseline_source}; {p.variant}: {p.variant_source}")
        verified = ("yes" if p.verified else "no" if not (p.baseline_verified or p.variant_verified)
                    else f"{p.variant if p.variant_verified else p.baseline} only")
        published = f"{number(p.paper_baseline, '.3f')} → {number(p.paper_variant, '.3f')} ({p.metric})"
        rows.append([p.scale, p.variant, published, number(p.paper_delta_nats, "+.4f"), source, verified,
                     number(p.ours, "+.4f"), _ci(p.ci_low, p.ci_high), str(p.n),
                     {True: "yes", False: "no", None: "—"}[p.consistent]])
    return [Heading("Published figures beside ours, as deltas in nats"),
            Paragraph("The papers' absolute losses and perplexities come from another corpus and tokenizer, so they "
                      "are not compared with ours: only each design's delta against the baseline is."),
            Paragraph(f"Published Δ: the paper's variant against its {baseline} in nats per token, the log of the "
                      "perplexity ratio or the difference of the losses. Our Δ: the paired mean Δ of val/loss with "
                      "its t 95% interval; consistent: that interval contains the published Δ. Per token of two "
                      "different tokenizers, even deltas compare only roughly. A value not verified was not checked "
                      "against the source it names."),
            Table(["scale", "variant", f"published {baseline} → variant", "published Δ (nats)", "source", "verified",
                   "our Δ val/loss", "our t 95% CI", "seeds", "consistent"], rows)]


def _scale_sentence(scale: str, decisions: Sequence[Decision]) -> str:
    """``At 113M: hourglass_attn better by 0.031 nats [0.018, 0.044]; hourglass_fixed undecided (Holm-adjusted p
    0.052), 9 seed pairs (4 more) would probably decide it.``: a Δ and its adjusted interval as magnitudes."""
    unit = " nats" if decisions[0].metric.endswith("/loss") else ""
    parts = []
    for d in decisions:
        if d.verdict in ("better", "worse"):
            low, high = sorted((abs(d.adj_ci_low), abs(d.adj_ci_high)))
            parts.append(f"{d.variant} {d.verdict} by {abs(d.mean_delta):.3g}{unit} [{low:.3g}, {high:.3g}]")
        elif d.verdict == "equivalent":
            parts.append(f"{d.variant} equivalent (|Δ| < {d.margin:g}{unit})")
        else:
            p = f" ({CORRECTION[d.family]}-adjusted p {d.p_adjusted:.3g})" if math.isfinite(d.p_adjusted) else ""
            parts.append(f"{d.variant} undecided{p}, " + (
                "no number of seed pairs in reach would decide it" if d.seeds_to_decide is None
                else f"{seeds_phrase(d.seeds_to_decide, d.n)} would probably decide it"))
    return f"At {scale}: " + "; ".join(parts) + "."


def _seeds_cell(d: Decision) -> str:
    return seeds_phrase(d.seeds_to_decide, d.n) if d.seeds_to_decide else "—"


def _compact_table(rows: Sequence[Decision]) -> Table:
    """The decision at a glance, narrow enough for a 1,280-pixel window, with the adjusted interval."""
    correction = CORRECTION[rows[0].family]
    header = ["scale", "variant", "Δ", f"t CI, {correction}-adjusted", f"p ({correction})", "Δ %", "verdict",
              "seed pairs to decide"]
    return Table(header, [[d.scale, d.variant, number(d.mean_delta, "+.4f"), _ci(d.adj_ci_low, d.adj_ci_high),
                           _p(d.p_adjusted), _signed_pct(d.pct_delta), d.verdict, _seeds_cell(d)] for d in rows])


def _decision_table(rows: Sequence[Decision], with_metric: bool = False) -> Table:
    header = (["metric"] if with_metric else []) + [
        "scale", "variant", "n", "Δ", "Δ %", "t CI (unadjusted)", "t CI (adjusted)", "p (adj.)", "sign-flip p",
        "Wilcoxon p", "d_z", "P(improve)", "MDE (80%)", "TOST p (adj.)", "verdict", "seeds to decide"]
    body = []
    for d in rows:
        body.append(([d.metric] if with_metric else []) + [
            d.scale, d.variant, str(d.n), number(d.mean_delta, "+.4f"), _signed_pct(d.pct_delta),
            f"{_ci(d.ci_low, d.ci_high)} ({1 - d.alpha:.1%})" if math.isfinite(d.ci_low) else "—",
            _ci(d.adj_ci_low, d.adj_ci_high), _p(d.p_adjusted), _p(d.p_signflip), _p(d.p_wilcoxon),
            number(d.d_z, ".2f"), number(d.prob_improvement, ".0%"), number(d.mde),
            f"{_p(d.p_tost_adjusted)} (±{d.margin:g})" if d.margin is not None else "no margin",
            d.verdict, _seeds_cell(d)])
    return Table(header, body)


def _per_scale(runs: pd.DataFrame, results: list[PairedResult], metric: str, baseline: str, scale: str,
               verdicts: dict, compute: EffectiveCompute | None) -> list[Block]:
    at_scale = runs[(runs["scale"] == scale) & (runs["status"] == run_table.FINISHED) & runs[metric].notna()]
    by_variant = {r.variant: r for r in results if r.scale == scale}
    loss_like = metric.endswith("/loss")
    with_compute = compute is not None and bool(compute.rows)
    header = ["variant", "seeds", f"{metric} (mean ± sd)"] + (["PPL"] if loss_like else []) + [
        "Δ vs " + baseline, "t 95% CI (unadjusted)", "verdict"] + (
        ["effective compute (interval)"] if with_compute else [])
    rows = []
    for variant in [baseline] + sorted(set(runs.loc[runs["scale"] == scale, "variant"]) - {baseline}):
        values = at_scale.loc[at_scale["variant"] == variant, metric]
        # the sample sd (ddof=1) of a single value is NaN, shown as —
        spread = f"{values.mean():.4f} ± {number(values.std(ddof=1))}" if len(values) else "—"
        cells = [variant, str(len(values)), spread]
        if loss_like:
            cells.append(number(math.exp(values.mean()), ".2f"))
        r = by_variant.get(variant)
        if r is None:
            cells += ["—"] * 3
        else:
            cells += [number(r.mean_delta, "+.4f"), _ci(r.ci_low, r.ci_high),
                      verdicts.get((metric, scale, variant), "—")]
        if with_compute:
            cells.append(_multiplier(compute.at(scale, variant)))
        rows.append(cells)
    counted = runs.loc[runs["scale"] == scale, "params_counted"].median()
    size = f" (≈{counted / 1e6:,.1f}M counted parameters)" if pd.notna(counted) else ""
    return [Heading(f"Scale {scale}{size}", 3), Table(header, rows)]


def _boot(low: float, high: float, method: str, n: int) -> str:
    return f"omitted (n < {BOOTSTRAP_MIN_N})" if n < BOOTSTRAP_MIN_N else f"{_ci(low, high)} {method}"


def _deltas_table(results: list[PairedResult]) -> Table:
    header = ["scale", "variant", "n", "Δ mean ± sd", "t 95% CI (unadjusted)", "bootstrap 95% CI", "Wilcoxon p",
              "win rate"]
    rows = [[r.scale, r.variant, str(r.n), f"{number(r.mean_delta, '+.4f')} ± {number(r.sd_delta)}",
             _ci(r.ci_low, r.ci_high), _boot(r.boot_ci_low, r.boot_ci_high, r.boot_method, r.n),
             _p(r.p_wilcoxon), number(r.win_rate, ".0%")] for r in results]
    return Table(header, rows)


def _scaling_blocks(scaling: ScalingReport) -> list[Block]:
    rows = []
    for variant, fit in scaling.fits.items():
        cross = scaling.crossings.get(variant)
        if variant == scaling.baseline or cross is None:
            crossing = "—"
        else:
            crossing = ", ".join(f"{n:.3g}" for n in cross.sizes) or "none in range"
            if cross.draws:
                crossing += (f"; bootstrap: {cross.share:.0%} of draws cross"
                             + (f", [{cross.low:.3g}, {cross.high:.3g}]" if math.isfinite(cross.low) else ""))
        held = scaling.holdouts.get(variant)
        holdout = ("—" if held is None else held if isinstance(held, str) else
                   f"{held.scale}: predicted {held.predicted:.4f}, measured {held.observed:.4f} "
                   f"({held.error:+.4f})")
        rows.append([variant, fit.form, fit.status, f"{fit.n_points} / {fit.n_scales}",
                     f"{number(fit.E, '.3f')} ± {number(fit.E_sd, '.3f')}", number(fit.A, ".4g"),
                     f"{number(fit.alpha, '.3f')} ± {number(fit.alpha_sd, '.3f')}",
                     _ci(fit.alpha_boot[0], fit.alpha_boot[1], 3), crossing, holdout])
    header = ["variant", "form", "status", "runs / scales", "E ± se", "A", "α ± se", "α seed-bootstrap CI",
              f"crosses {scaling.baseline} at N", "largest scale left out"]
    unfitted = all(f.form == "none" for f in scaling.fits.values())
    return [*([Paragraph("No scaling law is fitted: it needs at least 3 scales with finished runs, and no curve is "
                         "drawn.")] if unfitted else []), Table(header, rows)]


def _flip_blocks(pairs: Sequence[VerdictPair]) -> list[Block]:
    flips = [p for p in pairs if p.flip]
    shown = [p for p in pairs if p.family == "primary" or p.flip]
    rows = [[p.metric, p.scale, p.variant, number(p.shared_delta, "+.4f"), p.shared_verdict,
             number(p.tuned_delta, "+.4f"), p.tuned_verdict,
             f"FLIP: {p.shared_verdict} → {p.tuned_verdict}" if p.flip else "—"] for p in shown]
    return [Heading("Shared LR against tuned LR"),
            Paragraph(f"The store also holds this experiment's main runs at the shared (recipe) LR. Both sets are "
                      f"decided by the same rule; {len(flips)} of {len(pairs)} verdicts change between them"
                      + (" (flagged below)" if flips else "") + ". The report decides on the tuned runs. Shown: "
                      "every primary comparison, and any secondary one that flips."),
            Table(["metric", "scale", "variant", "Δ shared LR", "verdict shared LR", "Δ tuned LR",
                   "verdict tuned LR", "flip"], rows)]


def race_blocks(record: dict | None, metric: str) -> list[Block]:
    """The racing section, from the race's record (:func:`analysis.racing.race_record`): one sentence on what stopped,
    the stops, then every rung's verdicts."""
    if not record:
        return []
    stops = record.get("stops") or []
    verdicts = [v for v in record.get("verdicts") or [] if v.get("variant")]
    saved = sum(s.get("gpu_hours_saved") or 0.0 for s in stops)
    points = ", ".join(f"{a:g}" for a in record.get("at") or [])
    rule = ("worse than the baseline, or equivalent to it," if record.get("stop_equivalent") else
            "worse than the baseline")
    blocks: list[Block] = [
        Heading("Racing"),
        Paragraph(f"Arms were raced at the branch points {points} (fractions of the planned tokens): at each, the "
                  f"branch endpoints' paired deltas on {metric} against {record.get('baseline')} were decided at that "
                  "point's share of alpha (spent across the points, Holm over the arms still racing), and an arm "
                  f"decided {rule} stopped training there. The interval shown is the paired t interval at the "
                  "point's alpha, unadjusted for Holm: it can exclude 0 for an arm Holm left undecided, and the "
                  "verdict follows Holm. "
                  # CPU-sized plans price their runs in thousandths of a GPU-hour: three significant digits
                  + (f"{len(stops)} arm(s) stopped, saving about {saved:,.3g} GPU-hours." if stops else
                     "No arm stopped: every arm trained to its last branch.")),
    ]
    if stops:
        blocks.append(Table(["variant", "scale", "stopped at", *_RACE_COLUMNS, "GPU-h saved"],
                            [[s["variant"], s["scale"], f"{s['at']:g}", *_race_cells(s),
                              number(s.get("gpu_hours_saved"), ",.3g")] for s in stops]))
    if verdicts:
        blocks.append(Table(["branch point", "variant", "scale", *_RACE_COLUMNS, "stops"],
                            [[f"{v['at']:g}", v["variant"], v["scale"], *_race_cells(v), "yes" if v["stops"] else ""]
                             for v in verdicts]))
    return blocks


_RACE_COLUMNS = ("verdict", "pairs", "Δ", "t interval (unadjusted)", "alpha")
"""The columns both racing tables hold; what the race records is the t interval at the point's alpha, before Holm over
the arms."""


def _race_cells(row: dict) -> list[str]:
    """A stop's or a verdict's cells under :data:`_RACE_COLUMNS`."""
    return [row["verdict"], str(row["n"]), number(row["mean_delta"], "+.4g"),
            f"[{number(row['ci_low'], '+.4g')}, {number(row['ci_high'], '+.4g')}]", f"{row['alpha']:.3g}"]


def _tuning_blocks(curves: Sequence[TuneCurve]) -> list[Block]:
    rows = [[c.variant, c.scale,
             ", ".join(f"×{m:g}: {loss:.4f}" for m, loss in zip(c.multiples, c.mean_losses)),
             str(len(c.points)) + (f" ({c.unfinished} unfinished)" if c.unfinished else ""),
             f"×{c.best_multiple:g}", f"×{c.chosen_multiple:.4g}" if math.isfinite(c.chosen_multiple) else "—",
             number(c.chosen_lr, ".4g"), c.status or "—",
             ", ".join(f"{s}: {lr:.4g}" for s, lr in c.main_lrs.items()) or "—"] for c in curves]
    return [
        Heading("Tuning curves"),
        Paragraph("Each variant's tune runs: final val/loss at each multiple of the recipe's peak LR, the mean over "
                  "seeds (each seed is a point in the figure), the grid point with the lowest mean, and the multiple "
                  "tuning chose (the minimum of a quadratic in log LR through the best point and its "
                  "neighbours, recorded on the main runs) with how it was reached: interior (the best point had a "
                  "neighbour on each side), extended (it did after points were added beyond an edge) or edge (it "
                  f"stayed at an edge). Tune runs are never paired or decided on. {TRANSFER}"),
        Table(["variant", "tune scale", "mean final val/loss per multiple", "runs", "lowest mean at", "chosen",
               "chosen LR", "status", "main runs' LR by scale"], rows),
        *(Paragraph(note) for note in _edge_notes([c for c in curves if c.status == "edge"]))]


def _edge_notes(edges: Sequence[TuneCurve]) -> list[str]:
    """Why an edge choice may not be a variant's best, by whether the grid was extended."""
    taken = "so the LR taken may not be that variant's best"
    groups = {
        "extended": ([c.variant for c in edges if c.extensions], f"the best point stayed at an edge of the grid after "
                     f"extending it by as many points as tune.extend allows, {taken}: widen tune.lr or raise "
                     "tune.extend."),
        "declared": ([c.variant for c in edges if c.extensions == 0], f"the best point stayed at an edge of the "
                     f"declared grid, which was not extended (tune.extend is 0), {taken}: widen tune.lr or set "
                     "tune.extend to add points beyond the edge."),
        "unknown": ([c.variant for c in edges if c.extensions is None], f"the best point stayed at an edge of the "
                    f"grid, {taken}: widen tune.lr or raise tune.extend."),
    }
    return [f"{', '.join(sorted(set(variants)))}: {text}" for variants, text in groups.values() if variants]


def _compute_blocks(compute: EffectiveCompute) -> list[Block]:
    blocks: list[Block] = [
        Heading("Effective compute"),
        Paragraph(f"How many times a variant's training compute the baseline {compute.baseline} needs to reach the "
                  f"variant's final {compute.metric}: final {compute.metric} of each variant is fitted against its "
                  "training compute with the scaling fits below (the same form, Huber loss and seed-cluster "
                  "bootstrap, the same draws for every variant), and the baseline's fit inverted at the variant's "
                  "fitted loss. Read at each scale's median compute and at the centre of the fitted range (the "
                  f"geometric mean of the variant's compute). Interval: from {BOOTSTRAP_MIN_N} seeds, the 95% "
                  "percentile interval over the paired bootstrap draws; with fewer, too few distinct resamples exist "
                  "for a 95% interval (2 seeds give 3, 3 give 10), so the range of k over the draws is shown, marked "
                  "'range', with no coverage claimed; either is widened to hold k itself. 'never' where the baseline's "
                  f"fit does not come down to that loss. Compute: {compute.source}.")]
    if compute.fallback:
        blocks.append(Paragraph(f"Fallback to {compute.source}: {compute.fallback}."))
    if not compute.rows:
        return [*blocks, Paragraph(f"No multipliers: {compute.status}.")]
    blocks.append(Paragraph("; ".join(f"{v}: {_multiplier(r, ' compute')} over {r.scale}"
                                      for v, r in compute.headline().items()) + "."))
    rows = [[r.variant, r.scale + (" (fitted range)" if r.fitted_range else ""), f"{r.compute:.3g}",
             _times(r.multiplier), f"[{_bound(r.ci_low)}, {_bound(r.ci_high)}] ({_interval(r)})", str(r.draws)]
            for r in compute.rows]
    return [*blocks, Table(["variant", "scale", "compute (FLOPs)", "multiplier k", "bootstrap interval", "draws"],
                           rows)]


def _surface_blocks(surface: SurfaceReport, plot: Plot | None) -> list[Block]:
    """"L(N, D) per arm" (three sizes or more), else "Loss against tokens per arm": fits, optima, multipliers."""
    metric = surface.metric
    intervals = (f"Intervals: the seed-cluster bootstrap of the L(N) fits (the same draws for every arm, so a "
                 f"multiplier's are paired), the 95% percentile interval from {BOOTSTRAP_MIN_N} seeds; with fewer, "
                 "the range over the draws, marked 'range', with no coverage claimed.")
    compute = (f"Compute is counted in FLOPs ({surface.source}; each arm's FLOPs per token from its own runs"
               + (", interpolated between its sizes" if surface.form == SURFACE else "") + "), never in tokens: "
               "arms matched in parameters differ in FLOPs per token, and a multiplier read in tokens would hand one "
               "arm the FLOPs it spends per token.")
    if surface.form == SURFACE:
        blocks: list[Block] = [
            Heading("L(N, D) per arm"),
            Paragraph(f"Every finished decay branch's end (each seed, point and scale; trunks never) is a point: N "
                      f"counted parameters, D its training tokens. Each arm's final {metric} is fitted as L(N, D) = E "
                      "+ A/N^α + B/D^β with a Huber loss on log residuals from a grid of starts, as the L(N) fits "
                      "are. At each scale's planned compute C (the arm's FLOPs per token × the planned run's "
                      "tokens) the compute-optimal N and D minimise the fitted surface along the iso-FLOP line; the "
                      f"multiplier k is the compute at which {surface.baseline}'s surface, at its best N for that "
                      "compute, reaches the variant's best loss at C, over C (k = 1.5: the baseline needs 1.5 times "
                      f"the FLOPs; 'never' where its surface does not come down to that loss). {compute} {intervals}")]
    else:
        blocks = [
            Heading("Loss against tokens per arm"),
            Paragraph(f"No L(N, D) surface: {surface.why}. Each arm's final {metric} is fitted at each scale as "
                      "L(D) = E + B/D^β over its decay branches' ends (each seed and point; trunks never), with a "
                      "Huber loss on log residuals as the L(N) fits are; at one size, E is the loss that size would "
                      f"reach on unlimited tokens. The multiplier is read at the arms' planned sizes, not at a "
                      f"compute-optimal one: {surface.baseline}'s FLOPs to reach the variant's fitted loss at its "
                      f"planned tokens, over the variant's planned compute. {compute} {intervals}")]
    if surface.fallback:
        blocks.append(Paragraph(f"Fallback to {surface.source}: {surface.fallback}."))
    if surface.caveat:
        blocks.append(Paragraph(surface.caveat))
    if surface.form not in (SURFACE, TOKENS):
        return [*blocks, Paragraph(f"No fit: {surface.status}.")]
    largest = {m.variant: m for m in surface.multipliers}  # scales are read from small to large
    if largest:
        blocks.append(Paragraph("At the largest scale's planned compute: " + "; ".join(
            f"{v} {_multiplier(m, ' compute')} at {m.scale}" for v, m in largest.items()) + "."))
    if surface.form == SURFACE:
        fits = [[f.variant, f.status, f"{f.n_points} / {f.n_sizes} / {f.n_distinct}",
                 *(_with_interval(f, name) for name in ("E", "A", "alpha", "B", "beta"))] for f in surface.fits]
        blocks.append(Table(["variant", "status", "points / sizes / distinct (N, D)", "E", "A", "α", "B", "β"], fits))
        rows = [[o.variant, o.scale, f"{o.compute:.3g}", f"{o.planned_n:.3g}", f"{o.planned_d:.3g}",
                 _sized(o.n_opt, o.n_interval), _sized(o.d_opt, o.d_interval), number(o.d_opt / o.n_opt, ".3g"),
                 f"{number(o.planned_loss)} → {number(o.loss_opt)}",
                 _multiplier(surface.multiplier(o.variant, o.scale))] for o in surface.optima]
        blocks.append(Table(["variant", "scale", "planned C (FLOPs)", "planned N", "planned D", "compute-optimal N",
                             "compute-optimal D", "D/N there", f"fitted {metric}: planned → optimal",
                             f"multiplier k vs {surface.baseline}"], rows))
    else:
        rows = [[f.variant, f.scale, f.status, f"{f.n_points} / {f.n_distinct}",
                 *(_with_interval(f, name) for name in ("E", "B", "beta")),
                 _multiplier(surface.multiplier(f.variant, f.scale))] for f in surface.fits]
        blocks.append(Table(["variant", "scale", "status", "points / token counts", "E", "B", "β",
                             f"multiplier k vs {surface.baseline} at planned sizes"], rows))
    return [*blocks, *([plot] if plot is not None else [])]


def _with_interval(fit: SurfaceFit, name: str) -> str:
    """A fitted parameter with its bootstrap interval: ``0.312 [0.298, 0.330]``."""
    spec = ".4g" if name in ("A", "B") else ".3f"
    low, high = fit.intervals.get(name, (math.nan, math.nan))
    return number(getattr(fit, name), spec) + (
        f" [{number(low, spec)}, {number(high, spec)}]" if math.isfinite(low) and math.isfinite(high) else "")


def _sized(value: float, interval: tuple[float, float]) -> str:
    """A count of parameters or tokens with its interval: ``3.7e+07 [3.6e+07, 3.9e+07]``; '—' beyond the search."""
    if not math.isfinite(value):
        return "— (beyond the searched sizes)"
    low, high = interval
    return f"{value:.3g}" + (f" [{low:.3g}, {high:.3g}]" if math.isfinite(low) and math.isfinite(high) else "")


def _time_blocks(time: TimeReport, verdicts: dict, metric: str) -> list[Block]:
    rows = []
    for r in time.rows:
        bound = "≥ " if r.reached < r.n else ""
        rows.append([r.scale, r.variant, number(r.target), str(r.n), number(r.baseline_hours, ".3g"),
                     bound + number(r.variant_hours, ".3g"), f"{r.reached}/{r.n}", bound + _times(r.ratio),
                     f"[{_bound(r.ci_low)}, {_bound(r.ci_high)}]", _p(r.p_adjusted), r.verdict,
                     verdicts.get((metric, r.scale, r.variant), "—"), r.throughput])
    blocks: list[Block] = [
        Heading("Time to target"),
        Paragraph(f"GPU-hours each arm needed to reach the final val/loss of the {time.baseline} run of the same "
                  "seed, interpolated along its validation curve, at its measured throughput (study calibrate's "
                  "figure for the run's shape where one exists, else the median of its own train/tokens_per_s). "
                  "Ratio: geometric mean over seeds of variant over baseline GPU-hours, with the paired t interval "
                  "of the log ratio; the throughput-adjusted verdict decides the log ratios like the primary family "
                  "(paired t, Holm over scales × variants): better needs fewer GPU-hours. A run that never reached "
                  "the target counts its whole training's GPU-hours (≥: a lower bound), which can show a variant "
                  "slower but never faster. The parameter-matched verdict on "
                  f"{metric} is beside it."),
        Table(["scale", "variant", f"target ({time.baseline} final)", "seeds", f"{time.baseline} GPU-h",
               "variant GPU-h", "reached", "ratio", "t CI", "p (adj.)", "throughput-adjusted verdict",
               "parameter-matched verdict", "throughput"], rows)]
    if time.devices_unknown:
        blocks.append(Paragraph(f"{len(time.devices_unknown)} runs logged no readable run spec (run.json), so their "
                                "device count is unknown and one device is counted: their GPU-hours are job-hours."))
    return blocks


def _missing(runs: pd.DataFrame, unpaired: list[dict], metrics: list[str]) -> list[Block]:
    blocks: list[Block] = [Heading("Unfinished and unpaired runs")]
    unfinished = runs[runs["status"] != run_table.FINISHED]
    if len(unfinished):
        blocks.append(Table(["run", "status", "run key"], [[r.run_name, r.status, str(r.run_key)]
                                                           for r in unfinished.itertuples()]))
    if unpaired:
        blocks.append(Table(["variant", "scale", "seed", "status", "run key", "reason", "metrics"],
                            [[u["variant"], u["scale"], str(u["seed"]), u["status"], str(u["run_key"]), u["reason"],
                              "all" if u["metrics"] == metrics else ", ".join(u["metrics"])] for u in unpaired]))
    if len(blocks) == 1:
        blocks.append(Paragraph("None: every run finished and every seed has its baseline partner."))
    return blocks


def _signed_pct(x: float) -> str:
    shown = number(x, "+.2f")
    return shown if shown == MISSING else f"{shown}%"


def _ci(low: float, high: float, digits: int = 4) -> str:
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return "—"
    return f"[{low:+.{digits}f}, {high:+.{digits}f}]"


def _times(k: float) -> str:
    return "never" if k == math.inf else "—" if not math.isfinite(k) else f"{k:.2f}x"


def _bound(k: float) -> str:
    return "∞" if k == math.inf else "—" if not math.isfinite(k) else f"{k:.2f}"


def _multiplier(k: Multiplier | None, what: str = "") -> str:
    """``1.09x compute [1.02, 1.16] (95% CI)``, or ``(range, 3 seeds)`` where too few seeds give no 95 % interval."""
    if k is None:
        return "—"
    return (f"{_times(k.multiplier)}{what} [{_bound(k.ci_low)}, {_bound(k.ci_high)}] ({_interval(k)}"
            + (f"; at the {k.read_at}" if k.read_at == PLANNED else "") + ")")


def _interval(k: Multiplier) -> str:
    return f"range, {k.seeds} seeds" if k.interval == RANGE else "95% CI"


def _p(p: float) -> str:
    return "—" if p is None or not math.isfinite(p) else ("<0.001" if p < 0.001 else f"{p:.3f}")


_INTERVALS = (
    "The interval beside a verdict (in the sentences above, the compact table and the forest plot) is the t interval "
    "adjusted for multiplicity: at 1 − α·p/p_adj, the level the family's correction tested that comparison at, so "
    "it excludes 0 exactly when the verdict is better or worse. An unadjusted t interval at 1 − α is narrower and "
    "is labelled 'unadjusted' wherever it is shown; it can exclude 0 for a comparison the family leaves undecided.")

_TUNED = ("Decided on the tuned runs: each variant trained at the LR its own tune runs found best "
          f"({TAG_LR_SOURCE} = tune)")

_METHOD = (
    "Runs are paired by (scale, seed): paired runs share data order and initialisation, so the per-seed "
    "difference cancels most seed noise. Only FINISHED runs with a final value pair; the rest are listed above. "
    "Decisions: the paired t test of the deltas (the p of scipy.stats.ttest_1samp) decides better/worse after "
    "Holm's correction over the primary family or Benjamini-Hochberg's over the secondary metrics (statsmodels "
    "multipletests); equivalence is TOST against the declared margin (the p of statsmodels ttost_paired), "
    "corrected the same way; the unadjusted t interval is at 1 − α, the adjusted one at 1 − α·p/p_adj (it "
    "excludes 0 exactly when the adjusted p is below α). Sign-flip p: exact permutation test of the mean delta "
    "(scipy.stats.permutation_test, all 2^n sign patterns up to 16 pairs); Wilcoxon: two-sided signed-rank test. "
    "With 5 pairs neither can go below 0.0625, so they are shown, not used to decide. d_z = mean/sd of the "
    "deltas; P(improve): share of seeds where the variant is better, ties one half. MDE: the smallest true |Δ| the "
    "t test finds with 80% power at this n and α (the noncentral t power of statsmodels' TTestPower). Seeds to "
    "decide: pairs at which the observed Δ (or, inside the margin, equivalence) would be found with 80% power at "
    "the family's Bonferroni level, assuming the observed sd. Bootstrap CI: scipy.stats.bootstrap of the mean over "
    "seeds ({n_resamples} resamples, fixed seed), descriptive only and omitted below {min_n} pairs. PPL = exp(mean "
    "final val loss). Scaling: L(N) = E + A·N^(−α) fitted to every finished run (N = counted parameters) with a "
    "Huber loss (δ = 1e-3) on log residuals from a grid of starts; E is fixed at 0 with 3 scales and no law is "
    "fitted below 3. Intervals come from a seed-cluster bootstrap shared by all variants, so a crossing's interval "
    "is over paired draws; with 4 scales or more the fit without the largest scale predicts it."
)
