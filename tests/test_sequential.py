"""The adaptive-seed loop on a synthetic noise model: it adds seeds only where undecided, stops, and keeps alpha."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.sequential import Caps, look_alpha, until_decided
from study.config.decision import DecisionRule
from study.errors import StudyError


class NoiseModel:
    """Trains nothing: each run's final val/loss is 3 + its variant's true effect + Gaussian run noise."""

    def __init__(self, effects: dict[str, float], sd: float, seed: int = 0):
        self.effects, self.sd, self.rng = effects, sd, np.random.default_rng(seed)
        self.rows: list[dict] = []
        self.rounds: list[list[tuple]] = []

    def execute(self, runs):
        """Like a launch: a run already in the store is not trained again."""
        have = {(r["variant"], r["scale"], r["seed"]) for r in self.rows}
        runs = [r for r in runs if r not in have]
        self.rounds.append(list(runs))
        for variant, scale, seed in runs:
            self.rows.append({"run_id": f"{variant}-{scale}-{seed}", "run_key": f"{variant}{scale}{seed}",
                              "variant": variant, "scale": scale, "seed": seed, "status": "FINISHED",
                              "start_time": len(self.rows), "failure_reason": None, "params_counted": 1,
                              "val/loss": 3.0 + self.effects[variant] + self.rng.normal(0, self.sd)})

    def read(self):
        return pd.DataFrame(self.rows)


def run_loop(effects, sd, max_seeds=8, seed=0, max_gpu_hours=None, margin=0.01):
    model = NoiseModel(effects, sd, seed)
    recorded = []
    out = until_decided(DecisionRule(margin=margin), "base", {"s": [0, 1, 2]}, list(effects), model.execute,
                        model.read, lambda run: 1.0, Caps(max_seeds, max_gpu_hours), recorded.append)
    return out, model, recorded


def test_seeds_go_only_to_undecided_comparisons_and_the_loop_stops_when_all_are_decided():
    out, model, recorded = run_loop({"base": 0.0, "clear": -0.08, "close": -0.02, "same": 0.0}, sd=0.003)
    assert recorded == out.looks
    decided_at = {}
    for look in out.looks:
        for row in look["decisions"]:
            if row["verdict"] != "undecided":
                decided_at.setdefault(row["variant"], look["round"])
        undecided = {row["variant"] for row in look["decisions"] if row["verdict"] == "undecided"}
        added = {entry.split("@")[0] for entry in look["added"]}
        assert added == (undecided | {"base"} if undecided and look["added"] else set())
    # the clear difference is settled on the experiment's own 3 seeds: it never trains another one
    assert decided_at["clear"] == 1
    assert all(run[0] != "clear" for batch in model.rounds[1:] for run in batch)
    # every later round trains one new seed for the baseline and each still-open variant together
    for batch in model.rounds[1:]:
        assert len({seed for _, _, seed in batch}) == 1 and ("base", "s", batch[0][2]) in batch
    assert out.stopped == "every comparison is decided"
    assert {v: r["verdict"] for (_, v), r in out.final.items()} == {
        "clear": "better", "close": "better", "same": "equivalent"}


def test_alpha_spent_over_all_looks_never_exceeds_alpha():
    out, _, _ = run_loop({"base": 0.0, "a": 0.0, "b": 0.0}, sd=0.02, max_seeds=7, margin=None)
    assert out.stopped == "max seeds reached (7) with 2 undecided"
    assert [look["n"] for look in out.looks] == [3, 4, 5, 6, 7]
    assert [look["alpha"] for look in out.looks] == pytest.approx([0.05 * 3 / 7] + [0.05 / 7] * 4)
    assert out.looks[-1]["alpha_spent"] == pytest.approx(0.05)
    assert look_alpha(0.05, 3, 0, 6) + sum(look_alpha(0.05, n, n - 1, 6) for n in range(4, 7)) == pytest.approx(0.05)


@pytest.mark.integration
def test_no_true_difference_is_called_a_difference_more_often_than_alpha():
    # 60 experiments where nothing differs, two variants each, looked at with 3, 4 and 5 pairs
    false, trials = 0, 60
    for seed in range(trials):
        out, _, _ = run_loop({"base": 0.0, "a": 0.0, "b": 0.0}, sd=0.01, max_seeds=5, seed=seed, margin=None)
        false += any(row["verdict"] in ("better", "worse") for row in out.final.values())
    assert false / trials <= 0.05 + 2 * np.sqrt(0.05 * 0.95 / trials)


def test_the_gpu_hour_cap_stops_before_a_round_it_cannot_pay_for():
    out, model, _ = run_loop({"base": 0.0, "a": 0.0, "b": 0.0}, sd=0.02, max_seeds=10, max_gpu_hours=14,
                             margin=None)
    assert len(model.rounds) == 2 and out.gpu_hours == 9 + 3  # 3x3 first, then base+a+b at seed 3
    assert out.stopped.startswith("GPU-hour cap: the next round needs 3.0 more, 12.0 of 14 are spent")
    with pytest.raises(StudyError) as err:
        run_loop({"base": 0.0, "a": 0.0}, sd=0.02, max_gpu_hours=5)
    assert err.value.field == "--max-gpu-hours"
    with pytest.raises(StudyError) as err:
        run_loop({"base": 0.0, "a": 0.0}, sd=0.02, max_seeds=2)
    assert err.value.field == "--max-seeds"


def test_running_the_loop_again_replays_every_look_without_training():
    first, model, _ = run_loop({"base": 0.0, "a": -0.01, "b": 0.0}, sd=0.01, max_seeds=6)
    trained = len(model.rows)
    again = until_decided(DecisionRule(margin=0.01), "base", {"s": [0, 1, 2]}, ["base", "a", "b"], model.execute,
                          model.read, lambda run: 1.0, Caps(6))
    assert again.looks == first.looks and len(model.rows) == trained
    assert all(batch == [] for batch in model.rounds[-len(again.looks):])


def test_a_scale_that_starts_with_more_seeds_stops_growing_at_the_cap():
    model = NoiseModel({"base": 0.0, "a": 0.0}, sd=0.02)
    out = until_decided(DecisionRule(), "base", {"small": [0, 1, 2], "big": [0, 1, 2, 3, 4]}, ["base", "a"],
                        model.execute, model.read, lambda run: 1.0, Caps(6))
    seeds = {scale: {seed for _, sc, seed in (r for batch in model.rounds for r in batch) if sc == scale}
             for scale in ("small", "big")}
    assert seeds == {"small": set(range(6)), "big": set(range(6))}
    assert out.stopped.startswith("max seeds reached (6)")
