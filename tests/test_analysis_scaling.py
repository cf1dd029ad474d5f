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


def test_below_three_scales_no_law_is_fitted_and_one_seed_gives_no_bootstrap():
    for k in (1, 2):
        fit = fit_variant(law_points(SIZES[:k]), "base", "val/loss")
        assert fit.form == "none" and fit.status == f"no fit possible: {k} scale(s), a fit needs 3"
        assert math.isnan(fit.alpha) and fit.to_dict()["alpha"] is None
    three = fit_variant(law_points(SIZES[:3], seeds=1), "base", "val/loss")
    assert three.form == "A*N^-alpha" and three.boot_fits == 0 and math.isnan(three.alpha_boot[0])


def test_one_wild_run_barely_moves_the_huber_fit_but_drags_least_squares():
    from scipy.optimize import curve_fit

    points = law_points(SIZES, noise=0.001)
    points.loc[points.index[-1], "val/loss"] += 0.5  # one diverged run at the largest scale
    fit = fit_variant(points, "base", "val/loss", n_boot=0)
    n, loss = points["params_counted"].to_numpy(float), points["val/loss"].to_numpy(float)
    (E, A, alpha), _ = curve_fit(lambda n, E, A, a: E + A * n ** -a, n, loss, p0=[1.8, 400.0, 0.3], maxfev=20000)
    assert abs(fit.alpha - 0.3) < 0.01 < abs(alpha - 0.3)


def test_the_fit_without_the_largest_scale_predicts_it():
    points = law_points(SIZES, noise=0.0005)
    (report := scaling_report(points, "base", n_boot=0))
    held = report.holdouts["base"]
    observed = points.loc[points["scale"] == "640M", "val/loss"].mean()
    truth = 1.8 + 400 * 640e6 ** -0.3
    assert held.scale == "640M" and held.observed == pytest.approx(observed, abs=1e-12)
    assert held.error == pytest.approx(held.predicted - observed, abs=1e-12) and abs(held.predicted - truth) < 0.01
    few = scaling_report(law_points(SIZES[:3]), "base", n_boot=0).holdouts["base"]
    assert few == "needs 4 scales (3 finished)"


def test_crossing_interval_comes_from_paired_seed_bootstrap_draws():
    # `new` is better at small N and worse at large N: the curves cross inside the range.
    frame = pd.concat([law_points(SIZES, noise=0.001),
                       law_points(SIZES, E=1.75, A=600.0, noise=0.001, variant="new", rng_seed=1)])
    report = scaling_report(frame, "base", n_range=(1e6, 1e13), n_boot=40)
    cross = report.crossings["new"]
    (point,) = cross.sizes
    truth = (200.0 / 0.05) ** (1 / 0.3)  # 1.75 + 600 x = 1.8 + 400 x  with  x = N^-0.3
    assert point == pytest.approx(truth, rel=0.5)
    assert cross.draws == 40 and cross.share > 0.9 and cross.low < point < cross.high


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
    both = [np.isfinite(a).all() and np.isfinite(b).all()
            for a, b in zip(report.fits["new"].boots, report.fits["base"].boots)]
    assert set(report.crossings) == {"new"} and report.crossings["new"].draws == sum(both) > 0
    assert report.to_dict()["fits"]["new"]["form"] == "E + A*N^-alpha"


def test_bootstrap_draws_of_one_seed_multiset_share_a_fit_equal_to_refitting_each_draw():
    points = law_points(SIZES[:4], seeds=3, noise=0.003)
    fit = fit_variant(points, "base", "val/loss", n_boot=40, seed=3)
    rng = np.random.default_rng(3)  # the draws of the fit's generator, replayed
    seen = {}
    for E, b, alpha in fit.boots:
        draw = rng.integers(0, 3, size=3)
        key = tuple(sorted(draw))
        if key in seen:
            assert seen[key] == (E, b, alpha)  # 3 seeds have 10 multisets: most of 40 draws repeat one
            continue
        seen[key] = (E, b, alpha)
        # the draw's runs fitted on their own, from the grid of starts
        alone = fit_variant(pd.concat([points[points["seed"] == k] for k in draw]), "base", "val/loss", n_boot=0)
        assert (alone.E, alone.alpha) == pytest.approx((E, alpha), rel=1e-4)
        assert alone.A == pytest.approx(math.exp(b + alpha * fit.log_ref), rel=1e-3)
    assert len(seen) <= 10 and fit.boot_fits == 40


def test_a_fit_against_compute_reads_its_size_from_the_named_column():
    points = law_points(SIZES).assign(compute=lambda f: 120.0 * f["params_counted"] ** 2)
    fit = fit_variant(points, "base", "val/loss", n_boot=0, size="compute")
    # L = E + A N^-alpha with C = 120 N^2 is E + A (C / 120)^(-alpha / 2)
    assert fit.size == "compute" and fit.alpha == pytest.approx(0.15, abs=0.015)
    assert fit.solve(fit.predict(1e18)) == pytest.approx(1e18, rel=1e-9) and fit.solve(fit.E) == math.inf


def _huber_cost(theta, n, loss, log_ref):
    """The fits' objective written out: Huber (delta 1e-3) of log residuals of E + exp(b - alpha (ln N - ln N_ref))."""
    E, b, alpha = theta
    r = np.log(E + np.exp(b - alpha * (np.log(n) - log_ref))) - np.log(loss)
    return float(np.sum(np.where(np.abs(r) <= 1e-3, 0.5 * r**2, 1e-3 * np.abs(r) - 0.5e-6)))


def _scipy_draw_fit(n, loss, log_ref):
    """One draw fitted by scipy's least_squares alone (no project code), best of a grid of starts."""
    from scipy.optimize import least_squares

    x, floor, best = np.log(n) - log_ref, loss.min(), None
    for e in (0.0, 0.5, 0.9):
        for a in (0.1, 0.3, 0.6):
            res = least_squares(lambda t: np.log(t[0] + np.exp(t[1] - t[2] * x)) - np.log(loss),
                                [e * floor, math.log(loss.mean() - e * floor), a], loss="huber", f_scale=1e-3,
                                bounds=([0, -50, 0], [floor * (1 - 1e-9), 50, 5]), x_scale="jac", ftol=1e-14,
                                xtol=1e-14, gtol=1e-14, max_nfev=20000)
            best = res if best is None or res.cost < best.cost else best
    return best.x


@pytest.mark.integration
@pytest.mark.parametrize("E", [1.8, 0.0], ids=["saturating", "E at its bound"])
def test_batched_bootstrap_reaches_each_draws_own_minimum_and_its_intervals_match_separate_fits(E):
    points = law_points(SIZES[:5], seeds=4, E=E, noise=0.004, rng_seed=7)
    fit = fit_variant(points, "base", "val/loss", n_boot=20, seed=5)
    rng = np.random.default_rng(5)  # the fit's draws, replayed
    n, loss = points["params_counted"].to_numpy(float), points["val/loss"].to_numpy(float)
    separate = []
    for drawn in fit.boots:
        rows = np.concatenate([np.flatnonzero(points["seed"].to_numpy() == k) for k in rng.integers(0, 4, 4)])
        alone = _scipy_draw_fit(n[rows], loss[rows], fit.log_ref)
        separate.append(alone)
        # never a worse minimum than scipy run to tight tolerances, and the same one
        assert _huber_cost(drawn, n[rows], loss[rows], fit.log_ref) <= (
            _huber_cost(alone, n[rows], loss[rows], fit.log_ref) * (1 + 1e-9) + 1e-15)
        assert drawn[2] == pytest.approx(alone[2], rel=1e-3, abs=1e-6)
        assert drawn[0] == pytest.approx(alone[0], rel=1e-3, abs=1e-6)
    separate = np.array(separate)
    assert fit.boot_fits == 20
    assert fit.alpha_boot == pytest.approx(tuple(np.quantile(separate[:, 2], [0.025, 0.975])), rel=1e-3)
    assert fit.E_boot == pytest.approx(tuple(np.quantile(separate[:, 0], [0.025, 0.975])), rel=1e-3, abs=1e-6)
    if E == 0.0:
        assert np.sum(separate[:, 0] < 1e-9) > 0  # the bound is really reached in some draws


LADDER_ENDS = {"conventional": [5.392564, 5.473115, 5.307606, 5.392525, 5.29945, 5.375173],
               "hourglass": [5.332595, 5.446055, 5.308447, 5.413364, 5.308477, 5.421289]}
"""Final val/loss of trained runs (a reduced CPU ladder: 3 sizes x seeds 0, 1, sorted by size then seed): seed noise
of 1-2 %, far past the Huber threshold, so the fit's minimum is flat between two seeds of a size."""
LADDER_SIZES = {"conventional": (8272, 18552, 32928), "hourglass": (8304, 18600, 32928)}
LADDER_FLOPS = {"conventional": (110592, 202752, 319488), "hourglass": (128832, 242256, 355584)}


def test_fits_and_multipliers_of_trained_runs_do_not_depend_on_the_order_the_store_returns_them_in():
    from analysis.compute import effective_compute

    rows = [{"variant": v, "scale": f"s{k}", "seed": seed, "params_counted": LADDER_SIZES[v][k],
             "tokens": 2048.0 * (1 + k / 2), "flops_per_token": float(LADDER_FLOPS[v][k]), "status": "FINISHED",
             "val/loss": LADDER_ENDS[v][2 * k + seed], "run_name": f"{v}-s{k}-{seed}"}
            for v in LADDER_ENDS for k in range(3) for seed in (0, 1)]
    runs = pd.DataFrame(rows)
    seen = set()
    for order in range(6):
        shuffled = runs.sample(frac=1, random_state=order)
        scaling = scaling_report(shuffled, "conventional", n_boot=20)
        compute = effective_compute(shuffled, "conventional", n_boot=20, by_params=scaling.fits)
        seen.add((tuple((f.A, f.alpha) for f in scaling.fits.values()),
                  tuple((r.multiplier, r.ci_low, r.ci_high) for r in compute.rows)))
    assert len(seen) == 1


def test_alphas_standard_error_on_seed_noisy_runs_is_the_gauss_newton_one_of_the_log_residuals():
    """Trained runs' seed noise puts most log residuals past the Huber threshold; the standard error is still the
    Gauss-Newton one of the model's log residuals (scipy's Huber-weighted Jacobian zeroes those rows: 5e5)."""
    n = np.repeat(np.array(LADDER_SIZES["conventional"], float), 2)
    loss = np.array(LADDER_ENDS["conventional"])
    points = pd.DataFrame({"scale": np.repeat(["a", "b", "c"], 2), "seed": [0, 1] * 3, "params_counted": n,
                           "val/loss": loss})
    fit = fit_variant(points, "conventional", "val/loss", n_boot=0)
    x = np.log(n) - np.log(n).mean()
    residuals = np.log(fit.A * n ** -fit.alpha) - np.log(loss)
    assert fit.form == "A*N^-alpha"
    assert fit.alpha_sd == pytest.approx(math.sqrt(np.sum(residuals ** 2) / (len(n) - 2) / np.sum(x ** 2)), rel=1e-6)
    assert fit.alpha_sd < 0.05
