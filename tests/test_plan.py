"""`study plan`: every experiment expands into its runs, matched to each scale's budget; plan loads no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from conftest import ROOT
from study.cli import main
from study.plan.planner import plan_experiment

# the papers' matrix arithmetic (attention + FFN) of each scale's reference; the budget adds its norm gains
SCALE_MATRICES = {"113M": 113_246_208, "128M": 127_926_272, "256M": 262_144_000, "440M": 438_829_056,
                  "906M": 905_969_664, "1B": 1_073_741_824}
SCALE_SHAPES = {"113M": (768, 12), "128M": (1024, 8), "256M": (1280, 10), "440M": (1536, 12), "906M": (1536, 24),
                "1B": (2048, 16)}


def budget_of(scale: str) -> int:
    d, layers = SCALE_SHAPES[scale]
    return SCALE_MATRICES[scale] + 2 * layers * d + d


def plan_json(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_hourglass_experiment_lists_every_variant_scale_and_seed_within_1e5(capsys):
    out = plan_json(capsys, "hourglass")
    runs = out["runs"]
    variants = ("conventional", "olmo2", "hourglass_fixed", "hourglass_attn", "hourglass_depth")
    scales = ("113M", "256M", "440M", "906M", "1B")
    # each (arm, scale, seed): one trunk and three decay branches; each arm's LR tuned at 113M on three seed-0 points
    assert Counter((r["variant"], r["scale"]) for r in runs if r["role"] == "trunk") == {
        (v, s): 5 for v in variants for s in scales}
    assert Counter((r["variant"], r["scale"]) for r in runs if r["role"] == "branch") == {
        (v, s): 15 for v in variants for s in scales}
    assert Counter(r["variant"] for r in runs if r["role"] == "tune") == {v: 3 for v in variants}
    assert all(abs(r["mismatch"]) <= 1e-5 for r in runs)  # every non-embedding parameter, norm gains included
    assert all(r["budget"] == budget_of(r["scale"]) and r["params"]["counted"] == r["params"]["total"]
               - r["params"]["embedding"] for r in runs)
    conventional = {(r["scale"], r["seed"]): r["model"] for r in runs if r["variant"] == "conventional"}
    for r in runs:
        m = r["model"]
        assert r["d_model_per_layer"] == m["d_model"] / m["n_layers"]
        d_h = sum(m["ffn"]["widths"]) / (m["ffn"]["k"] * m["n_layers"])
        if r["variant"] == "hourglass_fixed":  # attention exactly as the conventional model's
            ref = conventional[(r["scale"], r["seed"])]
            assert (m["n_layers"], m["d_model"], m["n_heads"]) == (ref["n_layers"], ref["d_model"], ref["n_heads"])
            assert m["ffn"]["k"] == 8 and d_h < m["d_model"]
        elif r["variant"] == "hourglass_attn" and r["scale"] == "113M":  # the v1 paper's best 113M proportions
            assert m["ffn"]["k"] == 4 and 0.38 <= d_h / m["d_model"] <= 0.45 and m["head_dim"] == 64
            assert 100 <= r["d_model_per_layer"] <= 250 and r["params"]["attention"] > r["params"]["ffn"]
        elif r["variant"] == "hourglass_attn":  # above 113M, the release's: attention within d_model, d_h 0.8-0.9
            assert m["ffn"]["k"] == 4 and 0.8 <= d_h / m["d_model"] <= 0.9 and m["head_dim"] == 64
            assert 100 <= r["d_model_per_layer"] <= 250 and m["n_heads"] * 64 <= m["d_model"]
            assert r["params"]["ffn"] > 0.7 * r["params"]["counted"]
        elif r["variant"] == "hourglass_depth":
            assert m["ffn"]["k"] == 4 and 0.35 <= d_h / m["d_model"] <= 0.45
    attn = next(r for r in runs if r["variant"] == "hourglass_attn" and r["scale"] == "113M")
    # the paper's best 113M model: 66M attention and 47M FFN
    assert abs(attn["params"]["attention"] - 66e6) < 2e6 and abs(attn["params"]["ffn"] - 47e6) < 2e6
    assert len({r["run_key"] for r in runs}) == len(runs) == 125 * 4 + 15
    keys = {"run_key", "variant", "scale", "seed", "role", "model", "params", "budget", "mismatch", "mismatch_total"}
    assert keys <= set(runs[0]) and set(runs[0]["params"]) == {"embedding", "attention", "ffn", "norm", "total", "counted"}
    assert set(runs[0]["model"]) >= {"block", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                     "vocab_size", "tie_embeddings", "ffn"}


@pytest.mark.integration
def test_olmo2_and_conventional_runs_differ_in_the_block_only():
    from dataclasses import asdict

    from study.track.tracker import flatten

    plan = plan_experiment("hourglass")
    by = {(r.config.variant, r.config.scale, r.config.seed): flatten(asdict(r.config)) for r in plan.runs}
    for (variant, scale, seed), olmo in by.items():
        if variant != "olmo2":
            continue
        conv = by[("conventional", scale, seed)]
        differ = {k for k in olmo.keys() | conv.keys() if olmo.get(k) != conv.get(k)}
        # the block, and the FFN widths it leaves after its QK-norm gains; never the recipe or the data
        assert differ == {"variant", "model.block", "model.ffn.widths"}, (scale, differ)
    recipe = plan_experiment("demo", ["variants.tapered.model.block=olmo2"])  # a comparison stays one recipe
    assert len({r.config.train.z_loss for r in recipe.runs}) == 1


def test_the_k_sweep_holds_attention_fixed_and_keeps_every_d_h_below_d_model(capsys):
    runs = plan_json(capsys, "hourglass_k")["runs"]
    ks = {r["variant"]: r["model"]["ffn"]["k"] for r in runs}
    assert ks == {"conventional": 1, "hourglass_k6": 6, "hourglass_k8": 8, "hourglass_k12": 12, "hourglass_k16": 16}
    for r in runs:
        m = r["model"]
        assert (m["n_layers"], m["d_model"], m["n_heads"]) == (12, 768, 12) and abs(r["mismatch"]) <= 1e-5
        if m["ffn"]["kind"] == "hourglass":
            assert max(m["ffn"]["widths"]) / m["ffn"]["k"] < m["d_model"]


def test_geometry_experiment_has_reference_and_pending_scheduled_runs(capsys):
    everything = plan_json(capsys, "geometry")["runs"]
    runs = [r for r in everything if r["role"] != "tune"]
    assert Counter((r["variant"], r["scale"]) for r in everything if r["role"] == "tune") == {
        ("uniform", "128M"): 3, ("cosine", "128M"): 3}  # geometry and anti take their reference's tuning
    seeds = Counter(r["scale"] for r in runs if r["variant"] == "uniform")
    assert seeds == {"128M": 3, "256M": 3, "440M": 5}
    assert Counter(r["role"] for r in runs) == {"reference": 3, "train": 19, "scheduled": 22}
    for r in runs:
        if r["role"] == "scheduled":
            assert r["model"]["ffn"]["widths"] is None and "profile of reference run" in r["pending"]
            assert r["params"] is None and r["depends_on"]
        else:
            assert abs(r["mismatch"]) <= 1e-5
    cosine = next(r for r in runs if r["variant"] == "cosine")
    widths = cosine["model"]["ffn"]["widths"]
    assert widths[0] > widths[-1] and widths == sorted(widths, reverse=True)


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "sweeps" / "experiment").glob("*.yaml")))
def test_every_run_waits_only_on_runs_its_plan_trains(name):
    """A dependency on a key no run of the plan has never resolves: a scheduled run must wait on the profile of the
    reference run as the plan trains it (tuned, where the experiment tunes), a branch on its own trunk."""
    plan = plan_experiment(name)
    keys = {r.key for r in plan.runs}
    for r in plan.runs:
        assert set(r.depends_on) <= keys, (r.name, r.depends_on)
        if r.role == "scheduled":
            (ref,) = [q for q in plan.runs if q.key == r.depends_on[0]]
            assert ref.role == "reference" and r.profile == str(ref.run_dir.profile)


def test_scaling_and_search_experiments_plan_every_run(capsys):
    scaling = [r for r in plan_json(capsys, "scaling")["runs"] if r["role"] != "tune"]
    assert len(scaling) == 5 * 5 * 3
    assert all(abs(r["mismatch"]) <= 1e-5 for r in scaling if r["params"])
    search = [r for r in plan_json(capsys, "search")["runs"] if r["role"] != "tune"]
    assert len(search) == 1 + 4 * 2 * 3
    assert {r["model"]["d_model"] for r in search} == {768, 896, 1024, 1280, 1536}
    ratios = [r["d_model_per_layer"] for r in search if r["variant"] != "conventional"]
    assert min(ratios) < 50 and max(ratios) > 300  # the U-shape's optimum (100-250) lies inside the grid
    realised = [sum(r["model"]["ffn"]["widths"]) / r["model"]["ffn"]["k"] / r["model"]["n_layers"] / r["model"]["d_model"]
                for r in search if r["variant"] != "conventional"]
    assert min(realised) < 0.35 < 0.45 < max(realised)  # the d_h/d_model < 0.4 cliff lies inside the grid too
    # the resolution bound: one hidden unit is 3 d_model parameters, so the nearest leaves at most 1.5 d_model
    assert all(abs(r["mismatch"]) * r["budget"] <= 1.5 * r["model"]["d_model"] for r in search)


def test_demo_is_tiny_and_matched(capsys):
    runs = plan_json(capsys, "demo")["runs"]
    assert Counter((r["variant"], r["role"] == "tune") for r in runs) == {
        (v, tune): 3 for v in ("conventional", "hourglass", "tapered") for tune in (False, True)}
    assert all(r["params"]["total"] < 5_000_000 and abs(r["mismatch"]) <= 2e-4 for r in runs)


def test_seeds_share_a_shape_and_differ_in_key():
    plan = plan_experiment("demo")
    hg = [r for r in plan.runs if r.config.variant == "hourglass" and r.role != "tune"]
    assert len({r.key for r in hg}) == 3 and len({tuple(r.model.ffn.widths) for r in hg}) == 1


@pytest.mark.integration
def test_plan_command_imports_neither_torch_mlflow_pandas_nor_scipy_stats(tmp_path):
    """The power table's statistics come from scipy.special: scipy.stats and pandas would cost a plan about a
    second and a half before it prints."""
    code = ("import sys; from study.cli import main; main(['plan', 'hourglass']);"
            "sys.stderr.write(repr(sorted(m for m in ('torch', 'mlflow', 'pandas', 'scipy.stats', 'statsmodels')"
            " if m in sys.modules)))")
    # no store to read measured noise from (mlflow.set_tracking_uri in other tests of this process sets the variable)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0 and out.stderr.strip().endswith("[]"), out.stderr[-500:]


def test_tables_fit_columns_when_it_is_set_and_the_version_is_the_installed_one(monkeypatch, capsys, tmp_path):
    from importlib.metadata import version

    from study.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", "demo"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80 and "conventional" in out
    monkeypatch.delenv("COLUMNS")
    assert main(["plan", "demo"]) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) > 80  # into a pipe: one line per run
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"study {version('study')}"
