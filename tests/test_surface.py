"""Loss against parameters and tokens over decay branches (analysis.surface): planted laws recovered, the compute-optimal
point and the effective-compute multiplier checked against computations made here, and a branched experiment's
report end to end on a real SQLite MLflow store."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from analysis.surface import SURFACE, TOKENS, fit_surface, surface_report
from conftest import new_store

LAW = {"E": 1.7, "A": 400.0, "alpha": 0.34, "B": 410.0, "beta": 0.28}
"""The planted baseline: L(N, D) = E + A / N^alpha + B / D^beta."""

SIZES = {"20M": 2e7, "40M": 4e7, "80M": 8e7, "160M": 1.6e8}
TOKENS_PER_PARAM = 20


def law(n, d, E, A, alpha, B, beta):
    return E + A * np.asarray(n, float) ** -alpha + B * np.asarray(d, float) ** -beta


def branch_ends(arms: dict, sizes: dict = SIZES, points=(0.25, 0.5, 1.0), seeds=(0, 1), noise: float = 0.0):
    """Branch ends as analysis.run_table reads them: ``arms`` maps a variant to (its loss at (N, D), its FLOPs per
    token as a multiple of 6N)."""
    rng = np.random.default_rng(0)
    rows = []
    for variant, (loss, flops) in arms.items():
        for scale, n in sizes.items():
            for at in points:
                for seed in seeds:
                    d = TOKENS_PER_PARAM * n * at
                    rows.append({"variant": variant, "scale": scale, "seed": seed, "at": at, "params_counted": n,
                                 "tokens": d, "flops_per_token": 6 * n * flops, "status": "FINISHED",
                                 "max_steps": math.nan, "global_batch": math.nan, "seq_len": math.nan,
                                 "run_name": f"{variant}-{scale}-s{seed}-at{at:g}",
                                 "val/loss": float(loss(n, d)) + rng.normal(0, noise) if noise else float(loss(n, d))})
    return pd.DataFrame(rows)


def points_of(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(n=frame["params_counted"], d=frame["tokens"],
                        compute=frame["flops_per_token"] * frame["tokens"])


def baseline(n, d):
    return law(n, d, **LAW)


def test_the_surface_fit_recovers_planted_parameters_from_a_noise_free_grid():
    points = points_of(branch_ends({"a": (baseline, 1.0)}, points=(0.125, 0.25, 0.5, 1.0)))
    fit = fit_surface(points, "a", n_boot=20)
    assert fit.form == SURFACE and fit.status == "ok" and (fit.n_sizes, fit.n_distinct) == (4, 16)
    for name, true in LAW.items():
        assert getattr(fit, name) == pytest.approx(true, rel=1e-5), name
        low, high = fit.intervals[name]  # every draw holds the same noise-free points
        assert low == pytest.approx(true, rel=1e-5) and high == pytest.approx(true, rel=1e-5), name
    assert fit.interval == "range" and fit.boot_fits == 20  # two seeds: a range, never a 95% interval
    assert float(fit.predict(3e8, 5e9)) == pytest.approx(float(baseline(3e8, 5e9)), rel=1e-9)


def test_the_compute_optimal_point_is_the_minimum_of_the_fitted_surface_along_C_6ND():
    report = surface_report(branch_ends({"a": (baseline, 1.0)}), "a", n_boot=0)
    fit = report.fit("a")
    for o in report.optima:
        assert o.compute == pytest.approx(6 * SIZES[o.scale] ** 2 * TOKENS_PER_PARAM)  # 6 N D of the planned run
        n = np.geomspace(SIZES[o.scale] / 100, SIZES[o.scale] * 100, 400_001)
        loss = fit.predict(n, o.compute / (6 * n))
        best = int(np.argmin(loss))
        assert o.n_opt == pytest.approx(n[best], rel=1e-4)
        assert o.d_opt == pytest.approx(o.compute / (6 * n[best]), rel=1e-4)
        assert loss[best] - 1e-9 < o.loss_opt <= loss[best] + 1e-15  # the grid's best, or below it between points
        assert o.planned_loss == pytest.approx(float(baseline(SIZES[o.scale], TOKENS_PER_PARAM * SIZES[o.scale])))
        # the planted law's closed form (Hoffmann et al. 2022, eq. 4): N_opt = G (C/6)^(beta/(alpha+beta))
        a, b = LAW["alpha"], LAW["beta"]
        g = (a * LAW["A"] / (b * LAW["B"])) ** (1 / (a + b))
        assert o.n_opt == pytest.approx(g * (o.compute / 6) ** (b / (a + b)), rel=1e-4)
    line = next(i for i in report.isoflops if i.scale == "40M")
    assert min(line.loss) >= next(o.loss_opt for o in report.optima if o.scale == "40M") - 1e-12


@pytest.mark.parametrize("planted", ["more tokens", "more parameters"])
def test_the_multiplier_is_the_compute_factor_a_variant_is_planted_at(planted):
    k = 1.3

    def variant(n, d):  # the baseline at k times the compute: k D tokens, or k N parameters, at 6 N D
        return baseline(n, k * d) if planted == "more tokens" else baseline(k * n, d)

    report = surface_report(branch_ends({"base": (baseline, 1.0), "variant": (variant, 1.0)}), "base", n_boot=20)
    assert [m.scale for m in report.multipliers] == list(SIZES)
    for m in report.multipliers:
        assert m.multiplier == pytest.approx(k, rel=1e-6)
        assert m.ci_low == pytest.approx(k, rel=1e-6) and m.ci_high == pytest.approx(k, rel=1e-6)
        assert m.interval == "range" and m.seeds == 2 and m.draws == 20


def test_the_multiplier_compares_flops_when_the_arms_flops_per_token_differ():
    """The same loss per (N, D) at twice the FLOPs per token: at a compute C the variant trains on half the tokens
    the baseline would, so the baseline reaches its loss at C / 2 (a reading in tokens would say 1)."""
    report = surface_report(branch_ends({"base": (baseline, 1.0), "variant": (baseline, 2.0)}), "base", n_boot=0)
    assert report.source == "resolved.flops_per_token x recipe.tokens"
    for m in report.multipliers:
        assert m.compute == pytest.approx(2 * 6 * SIZES[m.scale] ** 2 * TOKENS_PER_PARAM)
        assert m.multiplier == pytest.approx(0.5, rel=1e-6)


def test_one_scale_fits_loss_against_tokens_per_arm_and_says_why_there_is_no_surface():
    k, n = 1.5, SIZES["40M"]

    def variant(n, d):
        return baseline(n, k * d)

    one = {"40M": n}
    frame = branch_ends({"base": (baseline, 1.0), "variant": (variant, 1.0)}, sizes=one, points=(0.25, 0.5, 0.75, 1.0))
    report = surface_report(frame, "base", n_boot=20)
    assert report.form == TOKENS and "1 size (40M)" in report.why and report.optima == []
    fit = report.fit("base", "40M")
    assert fit.status == "ok" and fit.E == pytest.approx(LAW["E"] + LAW["A"] * n ** -LAW["alpha"], rel=1e-6)
    assert (fit.B, fit.beta) == (pytest.approx(LAW["B"], rel=1e-5), pytest.approx(LAW["beta"], rel=1e-6))
    assert math.isnan(fit.A) and "A" not in fit.intervals
    # at one size, the baseline needs k times the tokens, and as many FLOPs per token: k times the compute
    (m,) = report.multipliers
    assert (m.variant, m.scale, m.multiplier) == ("variant", "40M", pytest.approx(k, rel=1e-6))

    few = surface_report(frame[frame["at"].isin([0.5, 1.0])], "base", n_boot=0).fit("base", "40M")
    assert few.form == "none" and few.status == "no fit: 2 distinct token counts D for 3 parameters"


def test_a_surface_with_fewer_distinct_points_than_parameters_is_not_fitted():
    frame = branch_ends({"base": (baseline, 1.0)}, sizes={s: SIZES[s] for s in ("20M", "40M", "80M")}, points=(1.0,))
    report = surface_report(frame, "base", n_boot=0)
    assert report.form == SURFACE and report.optima == [] and report.multipliers == []
    assert report.fit("base").status == "no fit: 3 distinct (N, D) for 5 parameters"


# the branched store: 2 arms x 3 scales x 2 seeds x 3 points, one trunk per (arm, scale, seed)
EXPERIMENT, ARMS, SEEDS, POINTS = "branch_report", ("conventional", "hourglass"), (0, 1), (0.25, 0.5, 1.0)
STORE_SIZES = {s: SIZES[s] for s in ("20M", "40M", "80M")}
FLOPS = {"conventional": 1.05, "hourglass": 1.12}
"""Each arm's FLOPs per token over 6N (attention), different at matched parameters."""
EFFECT = 1.25
"""Hourglass is planted at the baseline's loss with 1.25 times its tokens."""
MISSING = ("hourglass", "80M")
"""The cell whose branches at the largest point never ran."""


def _logged_loss(variant: str, scale: str, seed: int, at: float) -> float:
    n, d = STORE_SIZES[scale], TOKENS_PER_PARAM * STORE_SIZES[scale] * at
    seed_effect = 0.004 * (seed - 0.5) + (0.002 * at * seed if variant == "hourglass" else 0.0)
    return float(baseline(n, d * (EFFECT if variant == "hourglass" else 1.0))) + seed_effect


@pytest.fixture(scope="module")
def branched(tmp_path_factory):
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from study import schema

    root = tmp_path_factory.mktemp("branched")
    uri = new_store(root / "mlflow.db")
    client = MlflowClient(uri)
    exp = client.create_experiment(EXPERIMENT)
    names = {"trunk": [], "branch": {}}
    for variant in ARMS:
        for scale, n in STORE_SIZES.items():
            planned = TOKENS_PER_PARAM * n
            steps = 100
            for seed in SEEDS:
                common = {schema.TAG_EXPERIMENT: EXPERIMENT, schema.TAG_VARIANT: variant, schema.TAG_SCALE: scale,
                          schema.TAG_SEED: str(seed), schema.TAG_BASELINE: "conventional"}
                trunk_key = f"trunk-{variant}-{scale}-{seed}"
                runs = [(f"{variant}-{scale}-s{seed}-trunk", {schema.TAG_ROLE: "trunk", schema.TAG_RUN_KEY: trunk_key},
                         0.8 * planned, 80, 9.0)]  # a trunk's last loss: never an end of schedule
                for at in POINTS:
                    if (variant, scale) == MISSING and at == max(POINTS):
                        continue
                    runs.append((f"{variant}-{scale}-s{seed}-at{at:g}",
                                 {schema.TAG_ROLE: "branch", schema.TAG_RUN_KEY: f"{trunk_key}-at{at:g}",
                                  schema.TAG_TRUNK_KEY: trunk_key, schema.TAG_BRANCH_STEP: str(int(0.8 * at * steps)),
                                  schema.TAG_BRANCH_AT: f"{at:g}"},
                                 at * planned, int(at * steps), _logged_loss(variant, scale, seed, at)))
                for name, tags, tokens, max_steps, loss in runs:
                    run = client.create_run(exp, run_name=name, tags={**common, **tags})
                    params = {"params.counted": int(n), "recipe.tokens": int(tokens), "recipe.max_steps": max_steps,
                              "recipe.global_batch": 8, "data.seq_len": 128,
                              "resolved.flops_per_token": 6 * n * FLOPS[variant]}
                    metrics = [Metric("val/loss", loss + 0.5, 0, max_steps // 2), Metric("val/loss", loss, 0, max_steps),
                               Metric("train/tokens_per_s", 1e5, 0, max_steps)]
                    client.log_batch(run.info.run_id, metrics=metrics,
                                     params=[Param(k, str(v)) for k, v in params.items()])
                    client.set_terminated(run.info.run_id)
                    if tags[schema.TAG_ROLE] == "trunk":
                        names["trunk"].append((name, run.info.run_id))
                    else:
                        names["branch"][variant, scale, seed, float(tags[schema.TAG_BRANCH_AT])] = run.info.run_id
    # the race stopped hourglass at 80M at the middle point: its branches at the largest point never ran
    racing = client.create_run(exp, run_name="racing", tags={schema.TAG_ROLE: schema.ROLE_RACING})
    client.log_dict(racing.info.run_id, {"at": list(POINTS), "baseline": "conventional", "stop_equivalent": False,
                                         "stops": [RACE_STOP], "verdicts": [{**RACE_STOP, "stops": True}]},
                    "racing.json")
    return uri, names


RACE_STOP = {"variant": "hourglass", "scale": "80M", "at": 0.5, "verdict": "worse", "n": 2, "mean_delta": 0.0123,
             "ci_low": 0.0101, "ci_high": 0.0145, "alpha": 0.0125, "gpu_hours_saved": 42.5}


@pytest.fixture(scope="module")
def branched_report(branched, tmp_path_factory):
    from analysis.report import build_report

    uri, _ = branched
    out = tmp_path_factory.mktemp("out")
    return build_report(EXPERIMENT, tracking_uri=uri, out_dir=out, n_resamples=999), out / EXPERIMENT


@pytest.mark.integration
def test_a_branched_study_decides_on_the_branch_ends_and_fits_every_branch_never_a_trunk(branched):
    from analysis.run_table import read_study

    uri, names = branched
    study = read_study(EXPERIMENT, uri)
    trunk_ids = {run_id for _, run_id in names["trunk"]}
    assert set(study.runs["role"]) == {"branch"} and set(study.runs["at"]) == {1.0}
    assert len(study.runs) == len(ARMS) * len(STORE_SIZES) * len(SEEDS) - len(SEEDS)  # the missing cell's ends
    assert not study.runs.duplicated(["variant", "scale", "seed"]).any()
    assert len(study.branches) == len(ARMS) * len(STORE_SIZES) * len(SEEDS) * len(POINTS) - len(SEEDS)
    assert set(study.branches["at"]) == set(POINTS) and set(study.branches["trunk_key"].str[:6]) == {"trunk-"}
    assert trunk_ids.isdisjoint(study.runs["run_id"]) and trunk_ids.isdisjoint(study.branches["run_id"])
    assert "No run of hourglass at 80M: these cells are in no comparison" in study.notes


@pytest.mark.integration
def test_the_report_of_a_branched_study_shows_each_arms_surface_and_pairs_the_largest_point(branched, branched_report):
    uri, names = branched
    result, out = branched_report
    md = (out / "report.md").read_text()
    order = ["## Decisions on final val/loss", "## Scaling of final val/loss", "## L(N, D) per arm",
             "(isoflop.png)", "## Racing", "## Final val/loss per scale"]
    assert [md.index(s) for s in order] == sorted(md.index(s) for s in order)
    assert "| conventional | ok | 18 / 3 / 9 |" in md and "| hourglass | ok | 16 / 3 / 8 |" in md
    for scale in STORE_SIZES:
        assert f"| conventional | {scale} |" in md and f"| hourglass | {scale} |" in md
    surface = result["surface"]
    assert surface["form"] == SURFACE and {f["variant"] for f in surface["fits"]} == set(ARMS)
    # hourglass is the baseline at 1.25 times its tokens, and pays 1.12 / 1.05 the FLOPs per token for them
    ks = {m["scale"]: m for m in surface["multipliers"]}
    assert set(ks) == set(STORE_SIZES) and all(m["interval"] == "range" for m in ks.values())
    assert all(m["ci_low"] <= m["multiplier"] <= m["ci_high"] for m in ks.values())
    assert ks["40M"]["multiplier"] == pytest.approx(EFFECT * FLOPS["conventional"] / FLOPS["hourglass"], rel=0.05)
    assert json.loads((out / "report.json").read_text())["surface"]["form"] == SURFACE

    # the decisions pair the ends at the largest point, and no trunk enters any comparison
    pairs = {(r["metric"], r["scale"], r["variant"]): r for r in result["results"]}
    at_40m = pairs["val/loss", "40M", "hourglass"]
    logged = [_logged_loss("hourglass", "40M", s, 1.0) - _logged_loss("conventional", "40M", s, 1.0) for s in SEEDS]
    assert at_40m["n"] == 2 and at_40m["mean_delta"] == pytest.approx(np.mean(logged), rel=1e-9)
    assert ("val/loss", "80M", "hourglass") not in pairs or pairs["val/loss", "80M", "hourglass"]["n"] == 0
    trunk_names = [name for name, _ in names["trunk"]]
    trunk_ids = {run_id for _, run_id in names["trunk"]}
    assert not any(name in md for name in trunk_names)
    listed = {u["run_id"] for u in result["unpaired"]}
    assert trunk_ids.isdisjoint(listed)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    used = client.get_run(result["report_run_id"]).data.tags["study.report.runs"]
    assert int(used) == len(ARMS) * len(STORE_SIZES) * len(SEEDS) - len(SEEDS)
    assert all("study.report_run_id" not in client.get_run(i).data.tags for i in trunk_ids)
    ends = {names["branch"][v, s, seed, 1.0] for v in ARMS for s in STORE_SIZES for seed in SEEDS
            if (v, s) != MISSING}
    assert all(client.get_run(i).data.tags.get("study.report_run_id") == result["report_run_id"] for i in ends)
    assert "No run of hourglass at 80M: these cells are in no comparison" in md
    # the race's record: where the arm stopped, on which interval and alpha, and the GPU-hours that saved
    assert "1 arm(s) stopped, saving about 42.5 GPU-hours" in md
    assert "| hourglass | 80M | 0.5 | worse | 2 | +0.0123 | [+0.0101, +0.0145] | 0.0125 | 42.5 |" in md
    assert result["racing"]["stops"] == [RACE_STOP]


def test_the_fit_of_seed_noisy_branch_ends_does_not_depend_on_the_order_the_store_returns_them_in():
    """Branch ends of a trained reduced ladder (3 sizes x 2 points x seeds 0, 1): their seeds differ by 1-3 %, far past
    the Huber threshold, so the minimum is flat between two seeds and the order of the sums would pick its point."""
    loss = [5.557172, 5.392564, 5.711925, 5.473115, 5.405629, 5.307606, 5.547866, 5.392525, 5.401743, 5.29945,
            5.414602, 5.375173]
    ends = pd.DataFrame({"scale": np.repeat(["a", "b", "c"], 4), "seed": [0, 0, 1, 1] * 3, "at": [0.5, 1.0] * 6,
                         "n": np.repeat([8272.0, 18552.0, 32928.0], 4),
                         "d": [1024.0, 2048.0] * 2 + [1536.0, 3072.0] * 2 + [2048.0, 4096.0] * 2, "val/loss": loss})
    fits = {tuple(getattr(fit_surface(ends.sample(frac=1, random_state=order), "arm", n_boot=20), k)
                  for k in ("E", "A", "alpha", "B", "beta")) for order in range(6)}
    assert len(fits) == 1


def test_where_an_arms_optimum_lies_beyond_the_searched_sizes_the_multiplier_is_read_at_the_planned_size():
    """Losses that do not fall with N at fixed D (runs far too large for their tokens, as a CPU ladder's are) put the
    minimum along every iso-FLOP line at the search's edge: no optimum, so k is read at the variant's planned N,
    the baseline's FLOPs at that N to its fitted loss equal to the variant's at its planned (N, D)."""
    def base(n, d):
        return 1.0 + 410.0 * np.asarray(d, float) ** -0.28 + 0 * np.asarray(n, float)

    def variant(n, d):
        return 1.8 + 300.0 * np.asarray(d, float) ** -0.28 + 0 * np.asarray(n, float)

    report = surface_report(branch_ends({"base": (base, 1.0), "variant": (variant, 1.0)}), "base", n_boot=0)
    assert all(math.isnan(o.n_opt) and math.isnan(o.loss_opt) for o in report.optima)
    for m in report.multipliers:
        n, d = SIZES[m.scale], TOKENS_PER_PARAM * SIZES[m.scale]
        needed = ((float(variant(n, d)) - 1.0) / 410.0) ** (-1 / 0.28)  # base's tokens to the variant's loss
        assert m.read_at == "planned N" and m.multiplier == pytest.approx(needed / d, rel=1e-3)
    # a surface whose optima lie within the searched sizes is read between the frontiers
    planted = surface_report(branch_ends({"base": (baseline, 1.0), "variant": (baseline, 1.0)}), "base", n_boot=0)
    assert {m.read_at for m in planted.multipliers} == {"frontier"}
