"""Shapes a GPU runs well: `study plan` names every (variant, scale) whose matmul dimensions (d_model, FFN and
sub-MLP widths, heads x head_dim, vocabulary) are not multiples of 64, and `--json` gives each run its list."""

from __future__ import annotations

import json
from dataclasses import replace

from study.cli import main


def own_misaligned(model: dict) -> dict[str, set[int]]:
    """Each matmul dimension of a run's JSON model that is not a multiple of 64, computed here from its fields."""
    ffn, head = model["ffn"], model["head_dim"]
    if ffn["widths"] is None:  # a geometry schedule's widths wait for its profile
        widths = []
    elif ffn["kind"] == "hourglass":  # each layer's total split over K, the first total % K one unit wider
        k = ffn["k"]
        widths = [w // k + (i < w % k) for w in ffn["widths"] for i in range(k)]
    else:
        widths = ffn["widths"]
    dims = {"d_model": {model["d_model"]}, "attention": {h * head for h in model["layer_heads"]},
            "ffn": set(widths), "vocabulary": {model["vocab_size"]}}
    return {k: {v for v in values if v % 64} for k, values in dims.items() if any(v % 64 for v in values)}


def test_plan_json_names_each_runs_dimensions_that_are_not_multiples_of_64(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "scaling", "--scale", "1B", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    by_variant = {}
    for run in runs:
        own = own_misaligned(run["model"])
        named = run["misaligned"]
        assert (named == []) == (own == {}), (run["name"], named, own)
        for what, values in own.items():  # every misaligned dimension is named with its value
            label = {"d_model": "d_model", "attention": "attention", "vocabulary": "vocabulary",
                     "ffn": "sub-MLP width" if run["model"]["ffn"]["kind"] == "hourglass" else "FFN width"}[what]
            item = next(i for i in named if i.startswith(label))
            assert all(str(v) in item for v in values), (item, values)
        by_variant[run["variant"]] = named
    # the scaling study's hourglass at 1B: d_model 2,536 and sub-MLPs of 2,021-2,032; its conventional is aligned
    assert by_variant["conventional"] == [] and by_variant["geometry"] == []  # (geometry's widths are pending)
    assert by_variant["hourglass"] == ["d_model 2536", "sub-MLP widths 2021, 2022, 2032 (13 of 13 layers)"]
    assert by_variant["olmo2"] == ["FFN widths 8181 (1 of 16 layers)"]


def test_plan_prints_one_line_per_variant_and_scale_after_the_table(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "hourglass_release", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    want = {}
    for run in runs:
        if run["misaligned"]:
            want.setdefault((run["variant"], run["scale"]), run["misaligned"])
    assert main(["plan", "hourglass_release"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "matmul dimensions not multiples of 64" in line]
    assert lines == [f"{v} at {s}: matmul dimensions not multiples of 64 (slower on GPU tensor cores): "
                     f"{'; '.join(items)}" for (v, s), items in want.items()]
    # the release's own hourglass at 906M: K = 4 sub-MLPs of 8,064 / 4 = 2,016; its baseline is aligned everywhere
    assert lines[0] == ("hourglass at 906M: matmul dimensions not multiples of 64 (slower on GPU tensor cores): "
                        "sub-MLP width 2016")
    assert not any(line.startswith("baseline at") for line in lines)
    assert out.index(lines[0]) > out.index("GPU-hours")  # after the table and its summary


def test_misaligned_names_heads_key_value_heads_per_layer_widths_and_the_vocabulary():
    from study.config.model import FFNConfig, ModelConfig
    from study.plan.alignment import misaligned

    aligned = ModelConfig(d_model=1024, n_layers=4, n_heads=16, vocab_size=50304, ffn=FFNConfig(widths=[4096] * 4))
    assert misaligned(aligned) == []
    odd = replace(aligned, d_model=1000, n_heads=10, n_kv_heads=5, head_dim=100, vocab_size=50257,
                  ffn=FFNConfig(widths=[4096, 4100, 4101, 4096]))
    assert misaligned(odd) == ["d_model 1000", "attention 10 x 100", "key/value heads 5 x 100",
                               "FFN widths 4100, 4101 (2 of 4 layers)", "vocabulary 50257"]
    pending = replace(aligned, ffn=FFNConfig(widths=None))  # a geometry schedule's widths wait for its profile
    assert misaligned(pending) == []
