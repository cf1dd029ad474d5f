"""Scaling fits recover a known law, degrade gracefully with few scales, and find where two fits cross."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis.scaling import ScalingFit, crossing, fit_variant, scaling_report


def law_points(sizes, seeds=3, E=1.8, A=400.0, alpha=0.3, noise=0.002, shift=0.0, variant="base", rng_seed=0):
    rng = np.random.default_rng(rng_seed)
    rows = [{"variant": variant, "scale": f"{n / 1e6:g}M", "seed": k, "status": "FINISHED", "params_counted": n,
             "val/loss": E + A * n ** -alpha + shift + rng.normal(0, noise)} for n in sizes for k in range(seeds)]
    return pd.DataFrame(rows)


SIZES = [20e6, 40e6, 80e6, 160e6, 320e6, 640e6]


def test_saturating_law_is_recovered_with_uncertainty():
    fit = fit_variant(law_points(SIZES), "base", "val/loss", n_boot=100)
    assert fit.form == "E + A*N^-alpha" and fit.status == "ok" and fit.n_scales == 6 and fit.n_points == 18
    assert fit.alpha == pytest.approx(0.3, abs=0.03)
    assert fit.E == pytest.approx(1.8, abs=0.1)
    assert fit.predict(100e6) == pytest.approx(1.8 + 400 * 100e6 ** -0.3, abs=0.005)
    assert 0 < fit.alpha_sd < 0.05 and fit.boot_fits == 100
    assert fit.alpha_boot[0] < fit.alpha < fit.alpha_boot[1]


def test_fewer_than_four_scales_fall_back_to_a_pure_power_law():
    fit = fit_variant(law_points(SIZES[:3], E=0.0), "base", "val/loss", n_boot=20)
    assert fit.form == "A*N^-alpha" and "pure power law" in fit.status
    assert fit.E == 0.0 and fit.alpha == pytest.approx(0.3, abs=0.01)


def test_one_scale_or_one_point_per_scale_is_handled():
    one = fit_variant(law_points(SIZES[:1]), "base", "val/loss")
    assert one.form == "none" and one.status.startswith("not enough scales") and math.isnan(one.alpha)
    assert one.to_dict()["alpha"] is None
    two = fit_variant(law_points(SIZES[:2], seeds=1), "base", "val/loss")
    assert two.form == "A*N^-alpha" and two.boot_fits == 0 and math.isnan(two.alpha_boot[0])


def test_crossing_is_where_the_two_curves_meet():
    a = ScalingFit("a", "val/loss", "E + A*N^-alpha", "ok", 0, 0, E=1.7, A=400.0, alpha=0.3)
    b = ScalingFit("b", "val/loss", "E + A*N^-alpha", "ok", 0, 0, E=1.8, A=300.0, alpha=0.3)
    # 1.7 + 400 x = 1.8 + 300 x  with  x = N^-0.3  =>  x = 0.001  =>  N = 1000^(1/0.3)
    (n,) = crossing(a, b, (1e6, 1e12))
    assert n == pytest.approx(1000 ** (1 / 0.3), rel=1e-8)
    assert crossing(a, b, (1e6, 1e9)) == []


def test_report_compares_every_variant_with_the_baseline_and_ignores_unfinished_runs():
    frame = pd.concat([law_points(SIZES[:4]), law_points(SIZES[:4], shift=-0.02, variant="new", rng_seed=1)])
    frame.loc[frame.index[:2], "status"] = "FAILED"
    report = scaling_report(frame, "base", n_boot=10)
    assert set(report.fits) == {"base", "new"} and report.fits["base"].n_points == 10
    assert report.n_range == (20e6, 160e6 * 100)
    assert set(report.crossings) == {"new"}
    assert report.to_dict()["fits"]["new"]["form"] == "E + A*N^-alpha"
