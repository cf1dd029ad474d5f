"""What a user reads is what was decided: the interval beside a verdict agrees with it, the terminal and report.md
give one seeds-to-decide figure, the tuning note says a grid was extended only where it was, width bars start at 0,
and `study train --cfg job` prints the values the run will use."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from analysis.decide import decide
from analysis.paired import paired_deltas
from study.config.decision import DecisionRule

RULE = DecisionRule(metric="val/loss", margin=0.005)
DELTAS = {
    "deep": [-0.10, -0.11, -0.105, -0.098],  # decided: p ~ 1e-6
    "hourglass": [-0.02, -0.045, -0.015, -0.04],  # p 0.027 alone; Holm's second step doubles it to 0.053
    "tapered": [0.01, -0.02, 0.015, -0.01],  # p 0.89
}


def _runs() -> pd.DataFrame:
    rows = [{"variant": v, "loss": 3.0 + d} for v, ds in {"base": [0.0] * 4, **DELTAS}.items() for d in ds]
    return pd.DataFrame([{"run_id": f"{r['variant']}{k % 4}", "run_key": f"{r['variant']}{k % 4}",
                          "run_name": f"{r['variant']}-s-s{k % 4}", "variant": r["variant"], "scale": "s",
                          "seed": k % 4, "status": "FINISHED", "start_time": 0, "failure_reason": None,
                          "params_counted": 1000, "val/loss": r["loss"]} for k, r in enumerate(rows)])


@pytest.fixture(scope="module")
def decided():
    runs = _runs()
    results = {"val/loss": paired_deltas(runs, "val/loss", "base", n_resamples=0)}
    return runs, results, decide(results, RULE)


def _report_md(runs, results, decisions) -> str:
    from analysis.document import document
    from analysis.render import to_markdown
    from analysis.document import Analysis

    a = Analysis("x", "sqlite:///x.db", "base", ["val/loss"], runs, results, [], None, 0, RULE, decisions)
    return to_markdown(document(a, [], {}))


def test_the_interval_beside_each_verdict_is_the_holm_adjusted_one_it_agrees_with(decided, tmp_path):
    from matplotlib.figure import Figure

    from analysis.plots import _decision_panel

    runs, results, decisions = decided
    rows = {d.variant: d for d in decisions}
    p = {v: stats.ttest_1samp(DELTAS[v], 0.0).pvalue for v in DELTAS}
    holm = dict(zip(DELTAS, multipletests(list(p.values()), alpha=0.05, method="holm")[1]))
    hg = rows["hourglass"]
    # the case read as a contradiction: the unadjusted 95% interval lies wholly outside the equivalence band, yet
    # Holm leaves it undecided
    assert hg.p_adjusted == pytest.approx(holm["hourglass"], rel=1e-9) == pytest.approx(2 * p["hourglass"], rel=1e-9)
    assert hg.verdict == "undecided" and 0.05 < hg.p_adjusted < 0.06 and hg.ci_high < -RULE.margin
    # Holm tested it at its second step, alpha / 2: the interval at that level is the one the verdict agrees with
    d = np.asarray(DELTAS["hourglass"])
    expected = stats.t.interval(1 - 0.05 / 2, 3, loc=d.mean(), scale=stats.sem(d))
    assert (hg.adj_ci_low, hg.adj_ci_high) == pytest.approx(expected, rel=1e-9)
    for row in rows.values():
        assert (row.adj_ci_low > 0 or row.adj_ci_high < 0) == (row.verdict in ("better", "worse")), row
    assert rows["deep"].verdict == "better"

    md = _report_md(runs, results, decisions)
    deep = rows["deep"]
    assert (f"At s: deep better by {-deep.mean_delta:.3g} nats [{-deep.adj_ci_high:.3g}, {-deep.adj_ci_low:.3g}]; "
            f"hourglass undecided (Holm-adjusted p {hg.p_adjusted:.3g}), ") in md
    assert (f"| s | hourglass | {hg.mean_delta:+.4f} | [{expected[0]:+.4f}, {expected[1]:+.4f}] | "
            f"{hg.p_adjusted:.3f} |") in md
    assert "| scale | variant | Δ | t CI, Holm-adjusted | p (Holm) |" in md
    assert "labelled 'unadjusted' wherever it is shown" in md and "t 95% CI (unadjusted)" in md

    ax = Figure().subplots()
    _decision_panel(ax, decisions)
    drawn = sorted(tuple(seg[:, 0]) for lines in ax.collections for seg in lines.get_segments())
    assert drawn == pytest.approx(sorted((r.adj_ci_low, r.adj_ci_high) for r in decisions), rel=1e-9)
    assert "Holm-adjusted t CI" in ax.get_title()


def test_the_terminal_and_report_md_give_one_seeds_to_decide_figure(decided, capsys, monkeypatch):
    from analysis.headline import print_headline

    runs, results, decisions = decided
    hg = next(d for d in decisions if d.variant == "hourglass")
    assert hg.seeds_to_decide > hg.n == 4
    figure = f"{hg.seeds_to_decide} seed pairs ({hg.seeds_to_decide - 4} more)"
    monkeypatch.setenv("COLUMNS", "250")
    print_headline({"experiment": "x", "baseline": "base", "decisions": [d.to_dict() for d in decisions]})
    terminal = capsys.readouterr().out
    line = next(line for line in terminal.splitlines() if "hourglass" in line)
    assert figure in line and f"[{hg.adj_ci_low:+.4f}, {hg.adj_ci_high:+.4f}]" in line
    md = _report_md(runs, results, decisions)
    assert f"hourglass undecided (Holm-adjusted p {hg.p_adjusted:.3g}), {figure} would probably decide it" in md
    assert f"| undecided | {figure} |" in md
    assert figure in hg.reason


def _tune_frames(multiples: list[float]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Tune runs of one variant whose lowest loss sits at the grid's low edge, and its main run that took it."""
    tune = pd.DataFrame([{"variant": "hourglass", "scale": "20M", "status": "FINISHED", "seed": 0, "tune_multiple": m,
                          "lr": m * 1e-3, "val/loss": 3.0 + m, "params_counted": 1000} for m in multiples])
    main = pd.DataFrame([{"variant": "hourglass", "scale": "20M", "lr_source": "tune", "tune_multiple": multiples[0],
                          "tune_status": "edge", "lr": multiples[0] * 1e-3, "params_counted": 1000}])
    return tune, main


@pytest.mark.parametrize("extend", [0, 1])
def test_the_tuning_note_says_the_grid_was_extended_only_when_points_were_added_beyond_it(extend):
    from analysis.document import _tuning_blocks
    from analysis.render import to_markdown
    from analysis.tuning import tune_curves

    declared = [0.5, 1.0, 2.0]
    trained = [0.25] * extend + declared  # an extension adds the next point beyond the edge
    (curve,) = tune_curves(*_tune_frames(trained), declared=declared)
    assert curve.status == "edge" and curve.extensions == extend
    md = to_markdown(_tuning_blocks([curve]))
    assert ("after extending it" in md) == bool(extend)
    if not extend:
        assert "hourglass: the best point stayed at an edge of the declared grid, which was not extended " \
               "(tune.extend is 0)" in md
    # without the experiment file no claim is made either way
    (unknown,) = tune_curves(*_tune_frames(trained))
    md = to_markdown(_tuning_blocks([unknown]))
    assert unknown.extensions is None and "hourglass: the best point stayed at an edge of the grid, so the LR" in md
    assert "extending it" not in md and "not extended" not in md


def test_width_bars_start_at_zero_so_widths_a_unit_apart_draw_no_taper(monkeypatch, tmp_path):
    from study.geometry import plots
    from study.plan.show import BARS, fmt_widths

    assert fmt_widths([669, 668, 669, 668]) == "669..668 (sum 2674) " + BARS[-1] * 4
    # a real taper still reads as one: each bar is its width over the widest, in eighths
    assert fmt_widths([1024, 2048, 3072, 4096]) == "1024..4096 (sum 10240) " + "".join(BARS[i] for i in (1, 3, 5, 7))
    limits = []
    monkeypatch.setattr(plots, "_save", lambda fig, plt, path: limits.append(fig.axes[0].get_ylim()) or path)
    plots.plot_widths({"allocated": [669, 668, 669, 668]}, tmp_path / "widths.png")
    assert limits[0][0] == 0 and limits[0][1] >= 669


def test_train_cfg_job_prints_the_values_the_run_will_use(workdir, capsys, monkeypatch):
    import yaml

    from conftest import TINY
    from study.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://bob:hunter2secret@tracking.example:5000")
    assert main(["train", "--cfg", "job", *TINY, "model.block=olmo2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    model = printed["config"]["model"]
    # TINY: d_model 64 over 2 heads; olmo2's defaults: RoPE base 500k, eps 1e-6, QK-norm, truncated-normal init
    assert (model["head_dim"], model["n_kv_heads"], model["rope_theta"]) == (32, 2, 500_000.0)
    assert (model["norm_eps"], model["qk_norm"], model["init"]) == (1e-6, True, "olmo2")
    assert (printed["config"]["init_seed"], printed["config"]["data_seed"]) == (0, 0)
    assert printed["config"]["tracking"]["uri"] == "http://bob:***@tracking.example:5000"
    assert not list(workdir.glob("runs/**/run.json"))  # printed, nothing written
    assert math.isfinite(printed["budget"])


def test_the_race_sections_intervals_are_labelled_unadjusted_beside_holms_verdicts():
    from analysis.document import race_blocks
    from analysis.render import to_markdown

    # undecided under Holm though its interval at the point's alpha excludes 0
    row = {"variant": "b", "scale": "tiny", "at": 0.5, "verdict": "undecided", "n": 4, "mean_delta": 0.03,
           "ci_low": 0.004, "ci_high": 0.056, "alpha": 0.025, "stops": False}
    md = to_markdown(race_blocks({"at": [0.5, 1.0], "baseline": "a", "stops": [], "verdicts": [row]}, "val/loss"))
    assert "| branch point | variant | scale | verdict | pairs | Δ | t interval (unadjusted) | alpha | stops |" in md
    assert "unadjusted for Holm: it can exclude 0 for an arm Holm left undecided" in md
