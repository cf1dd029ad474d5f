"""The benchmark harness: a figure runs end to end and prints self-describing JSON rows (timings not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.integration
def test_a_figure_prints_json_rows_with_both_values_an_oriented_ratio_and_the_machine():
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", "loader"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == 1
    r = rows[0]
    assert r["figure"] == "loader" and "batch stream" in r["name"] and r["units"] == "tokens/s"
    assert r["better"] == "higher" and r["ours"] > 0 and r["peer"] > 0
    assert r["ratio"] == pytest.approx(r["ours"] / r["peer"])
    assert r["step_fed_by_stream_tokens_per_s"] > 0
    assert {"cpu", "cores", "torch", "torch_threads", "device"} <= set(r["machine"])
    assert r["machine"]["device"] == "cpu" and r["machine"]["torch_threads"] == 1


@pytest.mark.parametrize("scale", ["113M", "1B"])
def test_gpu_figures_use_the_shapes_of_the_scale_presets(scale):
    from benchmarks.gpu_bench import SCALES
    from study.config.compose import compose

    cfg = compose({"scale": scale}, overrides=[])
    shape, m = SCALES[scale], cfg.model
    assert (shape.d_model, shape.n_layers, shape.n_heads, shape.d_ff, shape.vocab_size, shape.multiple_of) == (
        m.d_model, m.n_layers, m.n_heads, m.ffn.width, m.vocab_size, m.ffn.multiple_of)
    assert (shape.seq_len, shape.micro_batch) == (cfg.data.seq_len, cfg.train.micro_batch)
