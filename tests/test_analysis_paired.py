"""Paired-seed statistics agree with scipy on the same numbers, honour direction and never drop a run silently."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis.paired import is_higher_better, joint_bootstrap, paired_deltas
from study.errors import StudyError


def runs_frame(rows: list[dict]) -> pd.DataFrame:
    """Rows in the shape analysis.run_table.read_runs returns; defaults fill what a test does not care about."""
    out = []
    for i, row in enumerate(rows):
        base = {"run_id": f"r{i}", "run_name": None, "run_key": f"k{i}", "role": "train", "baseline": "base",
                "status": "FINISHED", "start_time": i, "params_counted": 1_000_000}
        out.append({**base, **row})
    frame = pd.DataFrame(out)
    frame["run_name"] = frame["variant"] + "-" + frame["scale"] + "-s" + frame["seed"].astype(str)
    return frame


def paired_frame(baseline: np.ndarray, variant: np.ndarray, metric: str = "val/loss", scale: str = "s") -> pd.DataFrame:
    rows = [{"variant": "base", "scale": scale, "seed": k, metric: v} for k, v in enumerate(baseline)]
    rows += [{"variant": "new", "scale": scale, "seed": k, metric: v} for k, v in enumerate(variant)]
    return runs_frame(rows)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 20, 50])
def test_t_interval_wilcoxon_and_bootstrap_match_scipy_on_the_same_deltas(n):
    rng = np.random.default_rng(n)
    baseline = 3.4 + rng.normal(0, 0.02, n)
    deltas = rng.normal(-0.015, 0.01, n)
    (r,) = paired_deltas(paired_frame(baseline, baseline + deltas), "val/loss", "base", n_resamples=999, seed=7)
    expected = (baseline + deltas) - baseline

    assert r.n == n and r.seeds == list(range(n))
    assert r.mean_delta == pytest.approx(expected.mean(), abs=1e-15)
    assert r.sd_delta == pytest.approx(expected.std(ddof=1), rel=1e-12)
    sem = expected.std(ddof=1) / math.sqrt(n)
    low, high = stats.t.interval(0.95, n - 1, loc=expected.mean(), scale=sem)
    assert (r.ci_low, r.ci_high) == pytest.approx((low, high), rel=1e-12)
    assert r.p_wilcoxon == pytest.approx(stats.wilcoxon(expected).pvalue, rel=1e-12)
    method = "BCa" if n >= 3 else "percentile"
    boot = stats.bootstrap((expected,), np.mean, n_resamples=999, method=method, rng=7).confidence_interval
    assert r.boot_method == method
    assert (r.boot_ci_low, r.boot_ci_high) == pytest.approx((boot.low, boot.high), rel=1e-12)
    assert r.win_rate == pytest.approx(np.mean(expected < 0))


def test_equal_deltas_fall_back_to_percentile_and_give_no_wilcoxon_when_all_zero():
    baseline = np.array([3.0, 3.1, 3.2, 3.3])
    (shifted,) = paired_deltas(paired_frame(baseline, baseline - 0.25), "val/loss", "base", n_resamples=999)
    assert shifted.boot_method == "percentile"
    assert (shifted.boot_ci_low, shifted.boot_ci_high) == pytest.approx((-0.25, -0.25))
    assert (shifted.ci_low, shifted.ci_high) == pytest.approx((-0.25, -0.25))
    assert shifted.win_rate == 1.0

    (same,) = paired_deltas(paired_frame(baseline, baseline.copy()), "val/loss", "base", n_resamples=999)
    assert same.mean_delta == 0.0 and math.isnan(same.p_wilcoxon) and same.win_rate == 0.0


def test_a_single_pair_has_a_mean_but_no_interval():
    (r,) = paired_deltas(paired_frame(np.array([3.0]), np.array([2.9])), "val/loss", "base")
    assert r.n == 1 and r.mean_delta == pytest.approx(-0.1)
    assert math.isnan(r.sd_delta) and math.isnan(r.ci_low) and math.isnan(r.boot_ci_low)
    assert math.isnan(r.p_wilcoxon) and r.boot_method == "none"
    assert r.to_dict()["ci_low"] is None


def test_missing_failed_and_one_sided_seeds_are_listed_with_a_reason():
    rows = [{"variant": "base", "scale": "s", "seed": k, "val/loss": 3.0 + k / 100} for k in range(5)]
    rows[3]["val/loss"] = math.nan  # finished but never logged a final value
    rows += [{"variant": "new", "scale": "s", "seed": k, "val/loss": 2.9 + k / 100} for k in (0, 1, 3, 7)]
    rows += [{"variant": "new", "scale": "s", "seed": 2, "val/loss": 4.0, "status": "FAILED"}]
    (r,) = paired_deltas(runs_frame(rows), "val/loss", "base")

    assert r.seeds == [0, 1] and r.n == 2
    reasons = {(u.variant, u.seed): u.reason for u in r.unpaired}
    assert reasons == {
        ("base", 3): "no final val/loss",
        ("new", 2): "status FAILED",
        ("base", 2): "no usable new run with seed 2",
        ("base", 4): "no usable new run with seed 4",
        ("new", 3): "no usable base run with seed 3",
        ("new", 7): "no usable base run with seed 7",
    }


def test_a_superseded_run_for_the_same_seed_is_reported_and_the_newest_counts():
    rows = [{"variant": "base", "scale": "s", "seed": 0, "val/loss": 3.0},
            {"variant": "new", "scale": "s", "seed": 0, "val/loss": 3.5, "start_time": 1},
            {"variant": "new", "scale": "s", "seed": 0, "val/loss": 2.9, "start_time": 99}]
    (r,) = paired_deltas(runs_frame(rows), "val/loss", "base")
    assert r.mean_delta == pytest.approx(-0.1)
    assert [u.run_id for u in r.unpaired] == ["r1"]
    assert "superseded" in r.unpaired[0].reason


def test_accuracy_counts_higher_as_a_win_and_keeps_the_sign_of_the_difference():
    baseline = np.array([0.60, 0.61, 0.62, 0.63, 0.64])
    variant = baseline + np.array([0.01, 0.02, 0.01, -0.01, 0.03])
    (acc,) = paired_deltas(paired_frame(baseline, variant, "eval/arc_easy/acc"), "eval/arc_easy/acc", "base")
    assert acc.higher_is_better and acc.win_rate == pytest.approx(0.8)
    assert acc.mean_delta == pytest.approx(0.012) and acc.ci_low < acc.mean_delta < acc.ci_high

    (loss,) = paired_deltas(paired_frame(baseline, variant), "val/loss", "base")
    assert not loss.higher_is_better and loss.win_rate == pytest.approx(0.2)
    assert loss.mean_delta == pytest.approx(0.012)

    (told,) = paired_deltas(paired_frame(baseline, variant), "val/loss", "base", higher_is_better=True)
    assert told.win_rate == pytest.approx(0.8)


def test_direction_is_read_from_the_metric_name():
    assert not is_higher_better("val/loss") and not is_higher_better("val/ppl")
    assert is_higher_better("eval/arc_easy/acc") and is_higher_better("eval/hellaswag/acc_norm")
    assert not is_higher_better("eval/wikitext/word_perplexity")
    with pytest.raises(StudyError) as err:
        is_higher_better("train/tokens_per_s")
    assert err.value.field == "higher_is_better"


def test_each_scale_and_variant_is_compared_separately():
    rows = [{"variant": v, "scale": s, "seed": k, "val/loss": 3.0 + off + k / 50}
            for s in ("113M", "20M") for v, off in (("base", 0.0), ("a", -0.01), ("b", 0.02)) for k in range(3)]
    results = paired_deltas(runs_frame(rows), "val/loss", "base")
    assert [(r.scale, r.variant) for r in results] == [("20M", "a"), ("20M", "b"), ("113M", "a"), ("113M", "b")]
    assert [round(r.mean_delta, 10) for r in results] == [-0.01, 0.02, -0.01, 0.02]


def test_joint_bootstrap_resamples_the_same_seeds_for_every_task():
    rng = np.random.default_rng(3)
    n, tasks = 6, ["eval/arc_easy/acc", "eval/piqa/acc", "eval/hellaswag/acc"]
    base = {t: 0.5 + rng.normal(0, 0.01, n) for t in tasks}
    new = {t: base[t] + rng.normal(0.01, 0.01, n) for t in tasks}
    rows = [{"variant": v, "scale": "s", "seed": k, **{t: src[t][k] for t in tasks}}
            for v, src in (("base", base), ("new", new)) for k in range(n)]
    (j,) = joint_bootstrap(runs_frame(rows), tasks, "base", n_resamples=999, seed=11)

    per_seed = np.mean([new[t] - base[t] for t in tasks], axis=0)
    assert j.n == n and j.mean_delta == pytest.approx(per_seed.mean(), rel=1e-12)
    # One draw of seed indices shared by all tasks is the same as bootstrapping the per-seed task mean.
    boot = stats.bootstrap((per_seed,), np.mean, n_resamples=999, method="BCa", rng=11).confidence_interval
    assert (j.boot_ci_low, j.boot_ci_high) == pytest.approx((boot.low, boot.high), rel=1e-9)


def test_joint_bootstrap_uses_only_seeds_complete_on_every_task():
    rows = [{"variant": v, "scale": "s", "seed": k, "eval/a/acc": 0.5 + d, "eval/b/acc": 0.6 + d}
            for v, d in (("base", 0.0), ("new", 0.01)) for k in range(4)]
    rows[5]["eval/b/acc"] = math.nan  # new, seed 1
    (j,) = joint_bootstrap(runs_frame(rows), ["eval/a/acc", "eval/b/acc"], "base", n_resamples=99)
    assert j.seeds == [0, 2, 3] and j.mean_delta == pytest.approx(0.01)
    with pytest.raises(StudyError) as err:
        joint_bootstrap(runs_frame(rows + [{"variant": "base", "scale": "s", "seed": 9, "val/loss": 3.0}]),
                        ["eval/a/acc", "val/loss"], "base")
    assert err.value.field == "metrics"


def test_unknown_baseline_or_metric_names_the_field_and_the_choices():
    frame = paired_frame(np.array([3.0, 3.1]), np.array([2.9, 3.0]))
    with pytest.raises(StudyError) as err:
        paired_deltas(frame, "val/loss", "uniform")
    assert err.value.field == "baseline" and "base, new" in err.value.fix
    with pytest.raises(StudyError) as err:
        paired_deltas(frame, "val/los", "base")
    assert err.value.field == "metric" and "val/loss" in err.value.fix
