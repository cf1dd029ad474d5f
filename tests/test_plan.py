"""`study plan`: every experiment expands into its runs, matched to each scale's budget; plan loads no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from conftest import ROOT
from study.cli import main
from study.plan.planner import plan_experiment

SCALE_BUDGETS = {"113M": 113_246_208, "128M": 127_926_272, "256M": 262_144_000, "440M": 438_829_056,
                 "906M": 905_969_664, "1B": 1_073_741_824}


def plan_json(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_hourglass_experiment_lists_every_variant_scale_and_seed_within_1e5(capsys):
    out = plan_json(capsys, "hourglass")
    runs = out["runs"]
    assert Counter((r["variant"], r["scale"]) for r in runs) == {
        (v, s): 5 for v in ("conventional", "hourglass", "hourglass_attn", "olmo2")
        for s in ("113M", "256M", "440M", "906M", "1B")}
    assert all(abs(r["mismatch"]) <= 1e-5 for r in runs)
    assert all(r["budget"] == SCALE_BUDGETS[r["scale"]] for r in runs)
    hg = [r for r in runs if r["variant"] == "hourglass"]
    for r in hg:
        m = r["model"]
        d_h = sum(m["ffn"]["widths"]) / (m["ffn"]["k"] * m["n_layers"])
        assert m["ffn"]["kind"] == "hourglass" and m["ffn"]["k"] == 4 and 0.35 <= d_h / m["d_model"] <= 0.45
    assert len({r["run_key"] for r in runs}) == 100
    keys = {"run_key", "variant", "scale", "seed", "stage", "model", "params", "budget", "mismatch"}
    assert keys <= set(runs[0]) and set(runs[0]["params"]) == {"embedding", "attention", "ffn", "norm", "total", "counted"}
    assert set(runs[0]["model"]) >= {"block", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                     "vocab_size", "tie_embeddings", "ffn"}


def test_geometry_experiment_has_reference_and_pending_scheduled_runs(capsys):
    runs = plan_json(capsys, "geometry")["runs"]
    seeds = Counter(r["scale"] for r in runs if r["variant"] == "uniform")
    assert seeds == {"128M": 3, "256M": 3, "440M": 5}
    assert Counter(r["stage"] for r in runs) == {"reference": 3, "train": 19, "scheduled": 22}
    for r in runs:
        if r["stage"] == "scheduled":
            assert r["model"]["ffn"]["widths"] is None and "profile of reference run" in r["pending"]
            assert r["params"] is None and r["depends_on"]
        else:
            assert abs(r["mismatch"]) <= 1e-5
    cosine = next(r for r in runs if r["variant"] == "cosine")
    widths = cosine["model"]["ffn"]["widths"]
    assert widths[0] > widths[-1] and widths == sorted(widths, reverse=True)


def test_scaling_and_search_experiments_plan_every_run(capsys):
    scaling = plan_json(capsys, "scaling")["runs"]
    assert len(scaling) == 5 * 5 * 3
    assert all(abs(r["mismatch"]) <= 1e-5 for r in scaling if r["params"])
    search = plan_json(capsys, "search")["runs"]
    assert len(search) == 1 + 3 * 2 * 3
    assert {r["model"]["d_model"] for r in search} == {640, 768, 896}
    assert all(abs(r["mismatch"]) <= 1e-5 for r in search)


def test_demo_is_tiny_and_matched(capsys):
    runs = plan_json(capsys, "demo")["runs"]
    assert Counter(r["variant"] for r in runs) == {"conventional": 3, "hourglass": 3, "tapered": 3}
    assert all(r["params"]["total"] < 5_000_000 and abs(r["mismatch"]) <= 2e-4 for r in runs)


def test_seeds_share_a_shape_and_differ_in_key():
    plan = plan_experiment("demo")
    hg = [r for r in plan.runs if r.cfg.variant == "hourglass"]
    assert len({r.key for r in hg}) == 3 and len({tuple(r.model.ffn.widths) for r in hg}) == 1


def test_plan_command_imports_neither_torch_nor_mlflow(tmp_path):
    code = ("import sys; from study.cli import main; main(['plan', 'hourglass', '--json']);"
            "sys.stderr.write(repr(sorted(m for m in ('torch', 'mlflow') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0 and out.stderr.strip().endswith("[]"), out.stderr[-500:]
