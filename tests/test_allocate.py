"""Fixed-budget width allocation: the KKT solution is the optimum, meets the budget and respects the bounds."""

from __future__ import annotations

import numpy as np
import pytest

from study.errors import StudyError
from study.geometry.allocate import (
    AllocationConfig,
    allocate_from_profile,
    allocate_widths,
    reversed_profile,
    smooth_profile,
)


def objective(w, cost, a, lam=1.0):
    return float(np.sum(lam * np.asarray(cost) * np.asarray(w, dtype=float) ** (-np.asarray(a))))


def grid_optimum(cost, a, budget, w_min, step):
    """Brute force over every grid point of {w >= w_min, sum w = budget}; the last layer takes the remainder."""
    values = np.arange(w_min, budget, step)
    head = np.stack(np.meshgrid(*[values] * (len(cost) - 1), indexing="ij"), axis=-1).reshape(-1, len(cost) - 1)
    w = np.concatenate([head, budget - head.sum(axis=1, keepdims=True)], axis=1)
    w = w[w[:, -1] >= w_min - 1e-12]
    values = (np.asarray(cost) * w ** (-np.asarray(a))).sum(axis=1)
    best = int(np.argmin(values))
    return float(values[best]), w[best]


@pytest.mark.parametrize(
    "cost, a, w_min",
    [
        ([3.0, 1.0, 0.5], [0.5, 0.5, 0.5], 0.5),
        ([3.0, 1.0, 0.02], [0.3, 1.0, 2.0], 1.0),  # the idle layer sits on its bound
        ([0.2, 2.0, 1.5, 0.7], [1.0, 0.4, 0.8, 0.2], 0.5),
    ],
)
def test_kkt_widths_are_the_brute_force_optimum(cost, a, w_min):
    budget = 3.0 * len(cost)
    step = 0.01 if len(cost) == 3 else 0.1
    w = allocate_widths(cost, budget, w_min, a)
    best, best_w = grid_optimum(cost, a, budget, w_min, step)
    # The continuous optimum is at least as good as every grid point and within a grid cell of the best one.
    assert objective(w, cost, a) <= best + 1e-12
    np.testing.assert_allclose(w, best_w, atol=1.5 * step)


def test_marginal_gains_are_equal_on_free_layers_and_lower_on_bound_layers():
    rng = np.random.default_rng(0)
    cost, a, lam = rng.uniform(0.01, 5, 12), rng.uniform(0.1, 1.5, 12), rng.uniform(0.5, 2, 12)
    w_min = 2.0
    w = allocate_widths(cost, 12 * 8.0, w_min, a, lam)
    gain = a * lam * cost * w ** (-a - 1)
    free = w > w_min * (1 + 1e-9)
    assert 3 <= free.sum() < 12
    np.testing.assert_allclose(gain[free], gain[free].mean(), rtol=1e-9)
    assert np.all(gain[~free] <= gain[free].mean() * (1 + 1e-9))


@pytest.mark.parametrize("a", [0.1, 1.0, [0.05, 0.3, 2.0, 0.7, 0.2, 1.1]])
def test_widths_meet_the_budget_to_float_precision_and_respect_the_bound(a):
    cost = np.array([5.0, 0.001, 2.0, 0.0, 40.0, 1.0])
    budget, w_min = 6 * 1536.0, 384.0
    w = allocate_widths(cost, budget, w_min, a)
    assert abs(w.sum() - budget) <= 1e-12 * budget
    assert w.min() >= w_min
    assert w[3] == w_min  # a layer without work gets exactly the lower bound


def test_equal_exponents_give_widths_proportional_to_cost_to_the_one_over_one_plus_a():
    cost, a = np.array([1.0, 2.0, 4.0, 8.0]), 1.0
    w = allocate_widths(cost, 40.0, 1.0, a)
    np.testing.assert_allclose(w, 40.0 * cost**0.5 / (cost**0.5).sum(), rtol=1e-12)


def test_anti_reverses_the_order_of_widths():
    cost = smooth_profile([9.0, 7.5, 6.0, 3.0, 2.5, 2.0, 1.2, 1.0], "gaussian", 1.0)
    w = allocate_widths(cost, 8 * 100.0, 10.0, 0.5)
    anti = allocate_widths(reversed_profile(cost), 8 * 100.0, 10.0, 0.5)
    assert np.all(np.diff(w) < 0) and np.all(np.diff(anti) > 0)
    np.testing.assert_array_equal(np.argsort(anti), np.argsort(w)[::-1])
    np.testing.assert_allclose(reversed_profile(cost)[::-1].min(), cost.min())


def test_smoothing_keeps_a_flat_profile_and_averages_neighbours():
    flat = np.full(7, 3.0)
    np.testing.assert_allclose(smooth_profile(flat, "gaussian", 2.0), flat)
    np.testing.assert_allclose(smooth_profile([0.0, 3.0, 0.0, 6.0], "moving", 3), [1.0, 1.0, 3.0, 4.0])
    raw = [1.0, 5.0, 2.0]
    assert smooth_profile(raw, "none", 1).tolist() == raw


def test_impossible_bounds_and_empty_profiles_are_user_errors():
    with pytest.raises(StudyError, match="w_min_fraction"):
        allocate_widths([1.0, 2.0], 10.0, 6.0, 1.0)
    with pytest.raises(StudyError, match="work"):
        allocate_widths([0.0, 0.0, 0.0], 30.0, 1.0, 1.0)
    np.testing.assert_allclose(allocate_widths([1.0, 9.0], 10.0, 5.0, 1.0), [5.0, 5.0])
    with pytest.raises(StudyError, match="statistic"):
        AllocationConfig(statistic="curvature")
    with pytest.raises(StudyError, match="smoothing_width"):
        AllocationConfig(smoothing="moving", smoothing_width=2)
    with pytest.raises(StudyError, match="hyperbolic_radius"):
        AllocationConfig(hyperbolic_radius=1.0)


def profile(work, intrinsic_dim, sensitivity=None):
    stats = {s: {g: list(work) for g in ("raw", "spherical", "hyperbolic")} for s in ("shift", "gw", "topo")}
    return {"layers": len(work), "stats": stats, "intrinsic_dim": intrinsic_dim, "sensitivity": sensitivity}


def test_widths_from_a_profile_use_intrinsic_exponents_and_sensitivity():
    work, ids = [4.0, 3.0, 2.0, 1.0], [10.0, 20.0, 20.0, 40.0]
    cfg = AllocationConfig(smoothing="none", w_min_fraction=0.1, weight_by_sensitivity=False)
    w = np.array(allocate_from_profile(profile(work, ids), 1024.0, cfg))
    assert w.sum() == pytest.approx(4 * 1024.0, rel=1e-12)
    expected = 1024.0 * allocate_widths(work, 4.0, 0.1, 2.0 / np.array(ids))  # solved in units of the reference
    np.testing.assert_allclose(w, expected, rtol=1e-12)
    weighted = AllocationConfig(smoothing="none", w_min_fraction=0.1, weight_by_sensitivity=True)
    w_lam = allocate_from_profile(profile(work, ids, sensitivity=[1.0, 1.0, 1.0, -0.5]), 1024.0, weighted)
    assert w_lam[3] == pytest.approx(102.4)
    with pytest.raises(StudyError, match="weight_by_sensitivity"):
        allocate_from_profile(profile(work, ids), 1024.0, weighted)
    with pytest.raises(StudyError, match="intrinsic_dim"):
        allocate_from_profile(profile(work, [10.0, None, 20.0, 30.0]), 1024.0, cfg)


def test_one_profile_gives_the_same_relative_widths_at_any_reference_width():
    work, ids = [4.0, 3.0, 2.0, 1.0], [10.0, 20.0, 20.0, 40.0]
    cfg = AllocationConfig(smoothing="none", w_min_fraction=0.1, weight_by_sensitivity=False)
    small = np.array(allocate_from_profile(profile(work, ids), 3840.0, cfg)) / 3840.0
    large = np.array(allocate_from_profile(profile(work, ids), 8192.0, cfg)) / 8192.0
    np.testing.assert_allclose(small, large, rtol=1e-12)
    # solving in hidden units instead would make the schedule depend on the unit (per-layer exponents differ)
    a = 2.0 / np.array(ids)
    raw_small = allocate_widths(work, 4 * 3840.0, 384.0, a) / 3840.0
    raw_large = allocate_widths(work, 4 * 8192.0, 819.2, a) / 8192.0
    assert np.max(np.abs(raw_small - raw_large)) > 1e-3


def test_sensitivity_weights_are_on_by_default():
    assert AllocationConfig().weight_by_sensitivity is True
    work, ids = [4.0, 3.0, 2.0, 1.0], [10.0, 20.0, 20.0, 40.0]
    weighted = allocate_from_profile(profile(work, ids, sensitivity=[1.0, 1.0, 1.0, 4.0]), 1024.0,
                                     AllocationConfig(smoothing="none"))
    plain = allocate_from_profile(profile(work, ids, sensitivity=[1.0, 1.0, 1.0, 4.0]), 1024.0,
                                  AllocationConfig(smoothing="none", weight_by_sensitivity=False))
    assert weighted[3] > plain[3]  # the sensitive last layer gets more width
