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


BLOCKED = ("mlflow", "transformers", "datasets", "hydra", "lm_eval", "submitit", "scipy", "psutil")
"""What the GPU acceptance run may not need: a lent GPU machine has torch and this repository (with omegaconf and
PyYAML, which study.config imports), not the tracking, data, evaluation or launch stack."""


@pytest.mark.integration
def test_the_gpu_acceptance_dry_run_on_cpu_passes_every_check_and_rewrites_only_its_section(tmp_path):
    """`python -m benchmarks --gpu --device cpu --tiny`: every part of the acceptance run but the GPU itself (fp32,
    gloo for NCCL, dynamo's eager backend for torch.compile, MemTracker for the allocator's peak), importing none of
    BLOCKED. Its table replaces the previous one between RESULTS.md's markers and nothing else."""
    from benchmarks.acceptance import END, MEMORY_TOLERANCE, START

    results = tmp_path / "RESULTS.md"
    results.write_text(f"# Latest figures\n\nkept above\n\n{START}\nan older run's table\n{END}\n\nkept below\n")
    block = ("import importlib.abc, sys\n"
             "class Block(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path, target=None):\n"
             f"        if name.split('.')[0] in {BLOCKED!r}:\n"
             "            raise ImportError('the acceptance run imported ' + name)\n"
             "sys.meta_path.insert(0, Block())\n"
             "from benchmarks.__main__ import main\n"
             f"sys.exit(main(['--gpu', '--device', 'cpu', '--tiny', '--results', {str(results)!r}]))\n")
    done = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    arms = {"conventional", "hourglass K=4"}
    assert {(r["arm"], r["mode"]) for r in rows if r["check"] == "memory"} == {
        (a, m) for a in arms for m in ("eager", "compiled")}
    assert {r["arm"] for r in rows if r["check"] == "bf16 vs fp32"} == arms
    assert [r["check"] for r in rows if r["check"] in ("gloo", "resume")] == ["gloo", "resume"]
    assert all(r["verdict"] == ("info" if r["check"] == "throughput" else "pass") for r in rows)
    for r in rows:
        if r["check"] == "memory":  # MemTracker's peak of the step against study.plan.memory's, on CPU
            assert abs(r["measured_over_estimate"] - 1) <= MEMORY_TOLERANCE and r["ours"] > 0
        if r["check"] == "throughput":
            assert r["tokens_per_s"] > 0 if "tokens_per_s" in r else r["ours"] > 0
        if r["check"] == "bf16 vs fp32":  # on CPU both compute in fp32: the same curve, and it fell
            assert r["bf16_losses"] == r["fp32_losses"] and len(r["bf16_losses"]) == 50
            assert r["bf16_losses"][-1] < r["bf16_losses"][0] - 0.5
        if r["check"] in ("gloo", "resume"):
            assert r["relative_difference"] == 0.0  # one CPU process adds in one order
    text = results.read_text()
    assert text.startswith("# Latest figures\n\nkept above\n\n" + START) and text.endswith(f"{END}\n\nkept below\n")
    assert "an older run's table" not in text and text.count(START) == 1
    section = text.split(START)[1].split(END)[0]
    assert "`python -m benchmarks --gpu --device cpu --tiny`" in section and "**passed**: all 8 checks" in section
    assert len([line for line in section.splitlines() if line.startswith("| ")]) == 1 + len(rows)


def test_a_failed_check_or_step_fails_the_acceptance_naming_it_and_the_other_checks_still_run(
        tmp_path, monkeypatch, capsys):
    """A step that raises (an out-of-memory at micro-batch 1, a CUDA error), a memory estimate 20 % off, bf16 losses
    that diverge, a resume that lands elsewhere: each fails its own row, the rest run, RESULTS.md says FAILED and
    which, and the process exits 1."""
    import benchmarks.gpu_bench as bench
    from benchmarks.__main__ import main

    def throughput(cfg, shape, dev, steps, micro, compiled, peer=False):
        if compiled:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"tokens_per_s": 1000.0, "step_s": 0.1, "micro_batch": micro,
                "peak": int(1.2 * bench.estimated_peak(cfg, shape, micro, dev))}

    def losses(cfg, shape, dev, bf16, steps=50):
        return [5.0 - 0.01 * i for i in range(49)] + [float("nan") if bf16 and cfg.ffn.kind == "hourglass" else 4.5]

    monkeypatch.setattr(bench, "throughput", throughput)
    monkeypatch.setattr(bench, "losses", losses)
    monkeypatch.setattr(bench, "nccl_world_of_one", lambda cfg, shape, dev: ([3.0, 2.0, 1.0], [3.0, 2.0, 1.0]))
    monkeypatch.setattr(bench, "resumed", lambda cfg, shape, dev: ([2.5, 2.4], [2.5, 2.3]))
    results = tmp_path / "RESULTS.md"
    assert main(["--gpu", "--device", "cpu", "--tiny", "--results", str(results)]) == 1
    printed = capsys.readouterr()
    rows = [json.loads(line) for line in printed.out.splitlines()]
    verdicts = {(r["check"], r.get("arm"), r.get("mode")): r["verdict"] for r in rows}
    assert verdicts == {
        ("throughput", "conventional", "eager"): "info", ("memory", "conventional", "eager"): "fail",
        ("step", "conventional", "compiled"): "fail",
        ("throughput", "hourglass K=4", "eager"): "info", ("memory", "hourglass K=4", "eager"): "fail",
        ("step", "hourglass K=4", "compiled"): "fail",
        ("bf16 vs fp32", "conventional", None): "pass", ("bf16 vs fp32", "hourglass K=4", None): "fail",
        ("gloo", None, None): "pass", ("resume", None, None): "fail"}
    step = next(r for r in rows if r["check"] == "step")
    assert step["result"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    memory = next(r for r in rows if r["check"] == "memory")
    assert memory["measured_over_estimate"] == pytest.approx(1.2, abs=1e-6) and "(x1.200)" in memory["against"]
    named = [line for line in printed.err.splitlines() if line.startswith("acceptance: FAILED ")]
    assert len(named) == 6 and "acceptance: FAILED resume: tiny conventional: checkpoint after step 2 of 4" in (
        printed.err)
    section = results.read_text()
    assert "**FAILED**: 6 of 8 checks." in section and section.count("| fail |") == 6


def test_the_acceptance_names_each_failure_on_stderr(tmp_path, capsys):
    import argparse

    from benchmarks.__main__ import _accept
    from benchmarks.acceptance import check

    rows = [check("113M conventional eager peak memory", "memory", "fail", "eager: within 10 %", "52.0 GiB measured",
                  "40.0 GiB estimated (x1.300)"),
            check("113M conventional eager train step", "throughput", "info", "measured", "1 tok/s")]
    args = argparse.Namespace(quick=False, device="cpu", tiny=True, results=tmp_path / "R.md")
    assert _accept(args, rows, 61.0) is True
    err = capsys.readouterr().err
    assert err == ("acceptance: FAILED memory: 113M conventional eager peak memory: 52.0 GiB measured (criterion: "
                   "eager: within 10 %)\n")
    assert "1.0 min" in (tmp_path / "R.md").read_text()


def test_without_a_gpu_the_acceptance_is_not_run_exits_1_and_writes_nothing(tmp_path, monkeypatch, capsys):
    import torch

    from benchmarks.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    results = tmp_path / "RESULTS.md"
    assert main(["--gpu", "--results", str(results)]) == 1
    assert "acceptance: not run: no CUDA device: `python -m benchmarks --gpu --device cpu --tiny` is the dry run" in (
        capsys.readouterr().err)
    assert not results.exists()


@pytest.mark.parametrize("flag", [["--device", "cpu"], ["--tiny"], ["--results", "x.md"]])
def test_acceptance_flags_without_gpu_are_refused(flag, capsys):
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(flag)
    assert exit_.value.code == 2 and "--device, --tiny and --results go with --gpu" in capsys.readouterr().err


def test_acceptance_verdicts_at_their_bounds():
    import math

    from benchmarks.acceptance import loss_verdict, memory_verdict, same_verdict

    assert [memory_verdict(m, 100, compiled=False)[0] for m in (89, 90, 110, 111)] == ["fail", "pass", "pass", "fail"]
    assert [memory_verdict(m, 100, compiled=True)[0] for m in (10, 110, 111)] == ["pass", "pass", "fail"]
    fp32 = [5.0] * 50
    assert loss_verdict([5.09] * 50, fp32)[0] == "pass" and loss_verdict([5.11] * 50, fp32)[0] == "fail"
    assert loss_verdict([5.0] * 49, fp32)[0] == "fail"  # 50 steps each
    assert loss_verdict([math.inf] + [5.0] * 49, fp32)[0] == "fail"  # every loss finite, early ones too
    assert same_verdict([1.0, 2.0], [1.0, 2.0], 1e-5) == ("pass", 0.0)
    assert same_verdict([1.0, 2.0001], [1.0, 2.0], 1e-5)[0] == "fail" and same_verdict([], [], 1)[0] == "fail"
