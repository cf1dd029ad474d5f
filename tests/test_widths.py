"""Width-schedule families: each one's planned widths against its formula before rounding and against the budget
after; heads per layer from OpenELM's rule; the `reverse` operator; the `widths` experiment; old configs' keys."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest

from conftest import TINY
from study.config.compose import compose
from study.cli import main
from study.errors import StudyError
from study.plan.planner import plan_adhoc, plan_experiment

FAMILY_VARIANTS = ("uniform", "explicit", "linear", "cosine", "sigmoid", "cosine_reverse", "openelm", "lws_reverse",
                   "crown", "frame")


@pytest.fixture(scope="module")
def widths_plan():
    return plan_experiment("widths")


def corenet_divisible(v: float, divisor: int) -> int:
    """corenet.utils.math_utils.make_divisible, written out again for the check."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def expected_shape(variant: str, model, base: float) -> tuple[np.ndarray, list[int] | None]:
    """Each family's formula (TLM tapers, corenet's GPTConfig), computed independently of study.plan.widths."""
    L, d, hd = model.n_layers, model.d_model, model.dim_head
    t = np.arange(L) / (L - 1)
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    taper = {"linear": lambda t: 1.5 + (0.5 - 1.5) * t,
             "cosine": lambda t: 0.5 + (1.5 - 0.5) * (1 + np.cos(np.pi * t)) / 2,
             "sigmoid": lambda t: 0.5 + (1.5 - 0.5) * (sig(8 * (0.5 - t)) - sig(-4)) / (sig(4) - sig(-4))}
    if variant == "uniform":
        return np.full(L, base), None
    if variant == "explicit":  # the experiment's lists: two steps, the first half wide
        return np.array({8: [5120] * 4 + [2560] * 4, 10: [6400] * 5 + [3840] * 5}[L], dtype=float), None
    if variant in taper:
        return base * taper[variant](t), None
    if variant == "cosine_reverse":
        return base * taper["cosine"](1 - t), None  # the mirror
    group = model.kv_group

    def lws(beta, alpha, layers):
        if len(beta) == 2:
            b, a = np.linspace(*beta, num=layers), np.linspace(*alpha, num=layers)
        else:
            u = np.arange(layers) / (layers - 1)
            b, a = np.interp(u, [0, 0.5, 1], beta), np.interp(u, [0, 0.5, 1], alpha)
        b, a = [round(float(x), 2) for x in b], [round(float(x), 2) for x in a]
        return [x * d for x in b], [corenet_divisible(x * d, hd * group) // hd for x in a]

    if variant == "openelm":
        shape, heads = lws([0.5, 4.0], [0.5, 1.0], L)
    elif variant == "lws_reverse":
        shape, heads = lws([4.0, 0.5], [1.0, 0.5], L)
    elif variant == "crown":
        shape, heads = lws([0.5, 4.0, 0.5], [0.5, 1.0, 0.5], L)
    else:  # frame: isotropic first and last layer
        shape, heads = lws([0.5, 4.0], [0.5, 1.0], L - 2)
        shape, heads = [base, *shape, base], [model.n_heads, *heads, model.n_heads]
    return np.array(shape), heads


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_every_family_follows_its_formula_before_rounding_and_meets_the_budget_after(variant, widths_plan):
    from study.models.transformer import build_model
    from study.plan.budget import target_width

    runs = [r for r in widths_plan.runs if r.config.variant == variant and r.role != "tune"]
    assert {r.config.scale for r in runs} == {"128M", "256M"} and len(runs) == 6
    for scale in ("128M", "256M"):
        run = next(r for r in runs if r.config.scale == scale)
        m, multiple = run.model, run.model.ffn.multiple_of
        shape, heads = expected_shape(variant, m, target_width(m))
        widths = np.array(m.ffn.widths)
        ideal = shape * widths.sum() / shape.sum()  # the formula at the matched scale: the widths before rounding
        # largest remainder to the multiple: every layer within one multiple, the leftover units on one layer
        assert np.all(np.abs(widths - ideal) < 2 * multiple), (scale, widths, ideal)
        assert np.sum(widths % multiple != 0) <= 1
        assert abs(run.mismatch) <= 1e-5 and run.params["counted"] == run.budget * (1 + run.mismatch)
        assert [m.q_heads(layer) for layer in range(m.n_layers)] == (heads or [m.n_heads] * m.n_layers)
        built = build_model(m)
        assert sum(p.numel() for p in built.parameters()) == run.params["total"]
        assert [b.attn_sublayer.fn.wq.out_features // m.dim_head for b in built.layers] == \
            [m.q_heads(layer) for layer in range(m.n_layers)]


def test_openelm_heads_are_the_published_ones():
    """OpenELM-270M and 1.1B (HF config.json num_query_heads / num_kv_heads): alpha 0.5 -> 1.0, 4 query heads per
    KV head, head_dim 64."""
    from study.config.model import FFNConfig, ModelConfig, WidthSchedule
    from study.plan.budget import with_schedule

    def heads(d, layers):
        schedule = WidthSchedule(family="layerwise", beta=[0.5, 4.0], alpha=[0.5, 1.0])
        cfg = ModelConfig(d_model=d, n_layers=layers, n_heads=d // 64, n_kv_heads=d // 256, head_dim=64,
                          ffn=FFNConfig(schedule=schedule))
        m, _ = with_schedule(cfg)
        return m.layer_heads, [m.kv_heads_of(layer) for layer in range(layers)]

    assert heads(1280, 16) == ([12] * 5 + [16] * 7 + [20] * 4, [3] * 5 + [4] * 7 + [5] * 4)
    assert heads(2048, 28)[0] == [16] * 3 + [20] * 7 + [24] * 8 + [28] * 6 + [32] * 4


def test_sigmoid_is_exact_at_both_ends_and_reverse_mirrors_every_taper():
    from study.plan.widths import cosine_taper, interpolate, linear_taper, reflect, sigmoid_taper

    for steepness in (0.5, 8.0, 40.0):
        w = sigmoid_taper(9, 1000.0, 1.5, 0.5, steepness)
        assert w[0] == pytest.approx(1500.0) and w[-1] == pytest.approx(500.0)
        assert all(a > b for a, b in zip(w, w[1:]))  # monotone from start to end
        assert w[4] == pytest.approx(1000.0)  # centred at mid-depth
    for taper in (linear_taper, cosine_taper, sigmoid_taper):
        shape = taper(7, 100.0, 1.5, 0.5)
        assert reflect(shape) == pytest.approx(taper(7, 100.0, 0.5, 1.5))
    crown = interpolate([0.5, 4.0, 0.5], 5)
    assert crown == pytest.approx([0.5, 2.25, 4.0, 2.25, 0.5]) and reflect(crown) == pytest.approx(
        [4.0, 2.25, 0.5, 2.25, 4.0])  # reverse of a crown: most capacity at the ends


@pytest.mark.integration
def test_the_widths_experiment_plans_every_family_and_shows_widths_and_heads(capsys, monkeypatch):
    assert main(["plan", "widths", "--json"]) == 0
    runs = [r for r in json.loads(capsys.readouterr().out)["runs"] if r["role"] != "tune"]
    variants = (*FAMILY_VARIANTS, "geometry", "anti")
    assert Counter((r["variant"], r["scale"]) for r in runs) == {(v, s): 3 for v in variants for s in ("128M", "256M")}
    families = {r["variant"]: r["model"]["ffn"]["width_schedule"]["family"] for r in runs}
    assert set(families.values()) == {"uniform", "explicit", "geometry", "linear", "cosine", "sigmoid", "layerwise"}
    geometry = plan_experiment("geometry")
    ref_keys = {r.key for r in geometry.runs if r.role == "reference" and r.config.scale in ("128M", "256M")}
    for r in runs:
        if r["role"] == "scheduled":  # the geometry study's own reference run, profiled once
            assert r["pending"] and set(r["depends_on"]) <= ref_keys
            continue
        m = r["model"]
        assert abs(r["mismatch"]) <= 1e-5 and len(m["ffn"]["widths"]) == len(m["layer_heads"]) == m["n_layers"]
        assert m["layer_kv_heads"] == m["layer_heads"]  # multi-head attention: one KV head per query head
    # the same keys as the geometry study for the runs the two share
    shared = {(r.config.variant, r.config.scale, r.config.seed): r.key for r in geometry.runs}
    for r in runs:
        if (r["variant"], r["scale"], r["seed"]) in shared:
            assert r["run_key"] == shared[(r["variant"], r["scale"], r["seed"])], r["name"]
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["plan", "widths", "--variant", "openelm", "--variant", "crown", "--scale", "128M"]) == 0
    out = capsys.readouterr().out
    openelm = next(r for r in runs if r["variant"] == "openelm" and r["scale"] == "128M")
    heads = openelm["model"]["layer_heads"]
    assert len(set(heads)) == len(heads)  # every layer its own count: printed one by one
    assert "heads/layer" in out and " ".join(map(str, heads[:4])) in out
    assert f"{openelm['model']['ffn']['widths'][0]}..{openelm['model']['ffn']['widths'][-1]}" in out


def test_fields_under_their_old_names_are_refused_naming_the_new_one_and_keys_did_not_move():
    """Keys pinned under key schema 4 when the fields had their old names (before the schedule was a mapping): the
    fields in their new places give the same keys, and the old names are refused naming the new ones."""
    pinned = {
        ("model=tapered", "model.ffn.schedule.start=2.0"): ("model.ffn.cosine_start=2.0", "426ee52aaf44"),
        ("model=tapered", "model.ffn.schedule.end=0.25", "model.ffn.multiple_of=8"):
            ("model.ffn.cosine_end=0.25", "f721761d045d"),
        ("model=uniform", "model.ffn.schedule.start=3.0"): ("model.ffn.cosine_start=3.0", "b18e152a6420"),
        ("model.ffn.schedule={family: cosine}",): (None, "8d7f4843591d"),
        ("model.ffn.schedule.family=explicit", "model.ffn.widths=[100,200,300,400]"): (None, "7eaf9e79e97b"),
    }
    for current, (old, key) in pinned.items():
        assert plan_adhoc(["scale=tiny", *current]).key == key, current
        if old is not None:
            with pytest.raises(StudyError) as err:
                plan_adhoc(["scale=tiny", old])
            new = current[1] if "multiple_of" in current[-1] else current[-1]
            assert err.value.field == old.split("=")[0] and new.split("=")[0] in err.value.problem
    with pytest.raises(StudyError) as err:
        compose(layers=[({"geometry": {"anti": True}}, "a user's file")])
    assert err.value.field == "geometry.anti" and "model.ffn.schedule.reverse" in err.value.problem
    assert "a user's file" in err.value.problem
    # the family alone is the short form of the schedule: same run
    string = plan_adhoc(["scale=tiny", "model.ffn.schedule=cosine"])
    assert string.model.ffn.schedule.family == "cosine"
    assert string.key == plan_adhoc(["scale=tiny", "model.ffn.schedule={family: cosine}"]).key
    # a parameter only another family reads changes neither the model nor the key
    assert plan_adhoc(["scale=tiny", "model.ffn.schedule=cosine", "model.ffn.schedule.steepness=3"]).key == string.key
    assert plan_adhoc(["scale=tiny", "model.ffn.schedule=sigmoid", "model.ffn.schedule.steepness=3"]).key != \
        plan_adhoc(["scale=tiny", "model.ffn.schedule=sigmoid"]).key


@pytest.mark.parametrize("name", ["spec_v3_tapered.json", "spec_v3_anti.json"])
def test_a_run_spec_of_key_schema_3_is_refused_by_name(name):
    """run.json files of key schema 3 (a string schedule, cosine_start/cosine_end, geometry.anti): read_spec names both
    schemas instead of resuming them as schema-4 runs."""
    from conftest import ROOT
    from study.config.spec import read_spec

    with pytest.raises(StudyError) as err:
        read_spec(ROOT / "tests" / "golden" / name)
    assert err.value.field == "run spec" and "key schema 3" in err.value.problem and "uses 4" in err.value.problem


def test_a_run_spec_holding_a_field_under_its_old_name_is_refused_naming_file_and_new_name(tmp_path):
    from study.config.spec import read_spec, write_spec

    spec = plan_adhoc(["scale=tiny", f"paths.runs={tmp_path}"])
    path = write_spec(spec)
    raw = json.loads(path.read_text())
    raw["config"]["stage"] = raw["config"].pop("role")
    path.write_text(json.dumps(raw))
    with pytest.raises(StudyError) as err:
        read_spec(path)
    assert err.value.field == "stage" and "role" in err.value.problem and str(path) in err.value.problem



@pytest.mark.parametrize("override,field", [
    ("model.ffn.schedule={family: zigzag}", "model.ffn.schedule"),
    ("model.ffn.schedule={family: linear, start: 0}", "model.ffn.schedule.start"),
    ("model.ffn.schedule={family: sigmoid, end: -0.5}", "model.ffn.schedule.end"),
    ("model.ffn.schedule={family: sigmoid, steepness: 0}", "model.ffn.schedule.steepness"),
    ("model.ffn.schedule={family: layerwise, beta: [1.0, 0.0]}", "model.ffn.schedule.beta"),
    ("model.ffn.schedule={family: layerwise, beta: [1.0, 2.0, 3.0, 4.0]}", "model.ffn.schedule.beta"),
    ("model.ffn.schedule={family: layerwise, alpha: [0.01, 1.0]}", "model.ffn.schedule.alpha"),
    ("model.ffn.schedule={family: linear, start: 1.0, end: 0.002}", "model.ffn.schedule"),
])
def test_bad_schedules_are_refused_naming_the_field(override, field):
    with pytest.raises(StudyError) as err:
        plan_adhoc(["scale=128M", override])
    assert err.value.field == field and err.value.fix


def test_heads_fixed_per_layer_refuse_a_strategy_that_re_solves_them():
    with pytest.raises(StudyError) as err:
        plan_adhoc(["scale=128M", "model=openelm", "budget.match=depth"])
    assert err.value.field == "budget.match" and "ffn" in err.value.fix


def tiny_widths_tree(workdir, variants):
    """The shipped `widths` experiment at the tiny scale: its variants as they are, one seed, a few steps."""
    import shutil

    import yaml

    from conftest import ROOT

    tree = workdir / "sweeps"
    shutil.copytree(ROOT / "sweeps", tree)
    exp = yaml.safe_load((ROOT / "sweeps" / "experiment" / "widths.yaml").read_text())
    settings = dict(o.split("=", 1) for o in TINY if not o.startswith(("scale=", "model.n_layers=")))
    common = {}
    for dotted, value in settings.items():
        node = common
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    common["train"].update({"max_steps": 3, "val_interval": 3, "ckpt_interval": 3})
    exp.update(scales=["tiny"], seeds=[0], variants={v: exp["variants"][v] for v in variants}, common=common)
    exp.pop("reference")
    exp.pop("tune")  # its tuning scale is a real one; these runs compare at the tiny scale's shared LR
    (tree / "experiment" / "widths_tiny.yaml").write_text(yaml.safe_dump(exp))
    return tree


def test_a_tiny_widths_experiment_trains_the_per_layer_heads_and_piecewise_families(workdir, monkeypatch):
    """OpenELM-style (heads per layer) and Crown (three points) train on CPU as planned: the built model has the
    plan's count and heads, and the loss is finite."""
    from study.launch.callables import TrainJob
    from study.launch.submit import write_specs
    from study.models.transformer import build_model

    monkeypatch.setenv("STUDY_SWEEPS", str(tiny_widths_tree(workdir, ["uniform", "openelm", "crown"])))
    plan = plan_experiment("widths_tiny")
    write_specs(plan)
    for run in (r for r in plan.runs if r.config.variant != "uniform"):
        m = run.model
        heads = [m.q_heads(layer) for layer in range(m.n_layers)]
        assert len(set(heads)) > 1 and len(set(m.ffn.widths)) > 1
        built = build_model(m, "cpu", seed=0)
        assert sum(p.numel() for p in built.parameters()) == run.params["total"]
        assert [b.attn_sublayer.fn.n_heads for b in built.layers] == heads
        result = TrainJob(run.dir)()
        assert result["run_key"] == run.key and result["step"] == 3 and math.isfinite(result["val_loss"])
